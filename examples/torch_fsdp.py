"""FSDP2 (``fully_shard``) on CPU over ``"collective"`` trains as over Gloo.

Two processes (``torch.multiprocessing.spawn``) join a default process group on the
``"collective"`` backend and a second group on ``"gloo"``. On each group a model's
every linear layer and the model itself are sharded with ``fully_shard`` over a
one-dimensional ``DeviceMesh`` of that group, so each rank holds half of each
parameter; the forward pass all-gathers the shards (``all_gather_into_tensor``) and
the backward pass reduce-scatters the gradients (``reduce_scatter_tensor``). Both train
from the same weights on the same data for a few steps; then every rank gathers the
full parameters (``DTensor.full_tensor``) and sends them to the parent.

The parent checks that the ranks hold the same full parameters and that
``"collective"`` gives Gloo's, and prints the largest difference. Exactly, as with two
ranks each reduced gradient is a sum of two numbers, the same either way round, and
FSDP2 divides it by the world size in the same way on both backends.

Usage: python examples/torch_fsdp.py
"""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from spawned import run_ranks
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

import collective  # noqa: F401  (registers the "collective" backend with torch.distributed)

BACKEND = "collective"
WORLD_SIZE = 2
STEPS = 4
BATCH = 16
TIMEOUT = timedelta(seconds=60)
RESULT_TIMEOUT_S = 240


def make_model() -> torch.nn.Module:
    """Return the model, with the same weights on every rank."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 8),
    )  # fmt: skip


def train(rank: int, group: dist.ProcessGroup) -> list[float]:
    """Shard the model over ``group``, train it; return its full parameters, gathered."""
    model = make_model()
    mesh = DeviceMesh.from_group(group, "cpu")
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        x = torch.randn(BATCH, 32, generator=data)
        y = torch.randn(BATCH, 8, generator=data)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    full = [p.full_tensor().reshape(-1) for p in model.parameters()]  # type: ignore[operator]
    return torch.cat(full).tolist()


def worker(rank: int, port: int, results: mp.Queue) -> None:
    """One rank: train on each backend; send the full parameters back."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(BACKEND, rank=rank, world_size=WORLD_SIZE, timeout=TIMEOUT)
    groups = {BACKEND: dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    results.put((rank, {backend: train(rank, group) for backend, group in groups.items()}))
    dist.destroy_process_group()


def main() -> int:
    """Start the ranks, collect their parameters and compare them; return the exit status."""
    trained = run_ranks(worker, WORLD_SIZE, RESULT_TIMEOUT_S)
    if trained is None:
        print(f"the ranks did not all end within {RESULT_TIMEOUT_S} s")
        return 1
    ok = True
    for rank in range(WORLD_SIZE):
        ours, gloo = (torch.tensor(trained[rank][b]) for b in (BACKEND, "gloo"))
        same = torch.equal(ours, gloo)
        difference = (ours - gloo).abs().max().item()
        print(
            f"rank {rank}: full parameters equal to Gloo's: {same} "
            f"(largest difference {difference:.3g})"
        )
        ok = ok and same
    replicas = all(trained[rank] == trained[0] for rank in range(WORLD_SIZE))
    print(f"every rank gathers the same parameters: {replicas}")
    start = torch.nn.utils.parameters_to_vector(make_model().parameters()).tolist()
    moved = trained[0][BACKEND] != start
    print(f"training changed the parameters: {moved}")
    return 0 if ok and replicas and moved else 1


if __name__ == "__main__":
    sys.exit(main())
