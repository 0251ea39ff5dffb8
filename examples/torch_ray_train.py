"""Ray Train's ``TorchTrainer`` on the ``"collective"`` backend: ``TorchConfig(backend=...)``.

Ray Train starts the training workers as Ray actors and calls
``dist.init_process_group(backend)`` in each before your training function runs, so
the backend must be registered in every worker process first. One line does it, for
every worker of the job::

    ray.init(runtime_env={"worker_process_setup_hook": "collective.register_torch_backend"})

The trainer here runs two CPU workers with ``TorchConfig(backend="collective")``. Each
wraps a small model with ``ray.train.torch.prepare_model`` (DistributedDataParallel
over the workers' process group), trains it on its own data for a few steps, and
sends the backend it ran on, its loss and its parameters to an actor of the driver.
The driver checks that every worker ran on ``"collective"``, that the workers hold the
same parameters, and that the loss fell.

Usage: python examples/torch_ray_train.py
"""

import sys
import tempfile
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer, prepare_model

BACKEND = "collective"
WORKERS = 2
STEPS = 20
RESULT_TIMEOUT_S = 60


@ray.remote(num_cpus=0)
class Results:
    """What each worker sends back, by rank."""

    def __init__(self) -> None:
        self.by_rank: dict[int, dict[str, Any]] = {}

    def put(self, rank: int, result: dict[str, Any]) -> None:
        self.by_rank[rank] = result

    def get(self) -> dict[int, dict[str, Any]]:
        return self.by_rank


def train_loop(config: dict[str, Any]) -> None:
    """Train a DDP replica on this worker's data; send what it holds to ``Results``."""
    context = ray.train.get_context()
    rank = context.get_world_rank()
    torch.manual_seed(0)
    model = prepare_model(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 8, generator=data)
    y = x.sum(dim=1, keepdim=True)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    result = {
        "backend": dist.get_backend(),
        "world_size": dist.get_world_size(),
        "losses": losses,
        "parameters": torch.nn.utils.parameters_to_vector(model.parameters()).tolist(),
    }
    ray.get(config["results"].put.remote(rank, result), timeout=RESULT_TIMEOUT_S)


def main() -> int:
    """Train with ``TorchTrainer`` on ``BACKEND``; check every worker's result."""
    ray.init(runtime_env={"worker_process_setup_hook": "collective.register_torch_backend"})
    try:
        results = Results.remote()  # type: ignore[attr-defined]
        with tempfile.TemporaryDirectory() as storage:
            trainer = TorchTrainer(
                train_loop,
                train_loop_config={"results": results},
                torch_config=TorchConfig(backend=BACKEND, timeout_s=60),
                scaling_config=ScalingConfig(num_workers=WORKERS, use_gpu=False),
                run_config=RunConfig(storage_path=storage, name="torch_ray_train"),
            )
            trainer.fit()
        by_rank = ray.get(results.get.remote(), timeout=RESULT_TIMEOUT_S)
    finally:
        ray.shutdown()
    ok = sorted(by_rank) == list(range(WORKERS))
    for rank, result in sorted(by_rank.items()):
        fell = result["losses"][-1] < result["losses"][0] / 2
        print(
            f"worker {rank}: backend {result['backend']!r}, world size {result['world_size']}, "
            f"loss {result['losses'][0]:.3f} -> {result['losses'][-1]:.3f}, fell by half: {fell}"
        )
        ok = ok and result["backend"] == BACKEND and result["world_size"] == WORKERS and fell
    same = all(r["parameters"] == by_rank[0]["parameters"] for r in by_rank.values())
    print(f"every worker holds the same parameters: {same}")
    print(f"every worker trained on {BACKEND!r}: {ok and same}")
    return 0 if ok and same else 1


if __name__ == "__main__":
    sys.exit(main())
