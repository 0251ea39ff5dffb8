"""DistributedDataParallel on CPU over ``"collective"`` trains exactly as over Gloo.

Two processes (``torch.multiprocessing.spawn``) join a default process group on the
``"collective"`` backend and a second group on ``"gloo"``. Each trains the same small
model for a few steps four times, from the same start and on the same data: with DDP's
own gradient averaging and with a communication hook that averages through
``dist.all_reduce(..., async_op=True).get_future()``, each on either group. DDP
broadcasts rank 0's weights at its start (each rank builds its model from its own
seed), then averages the gradients every step.

Every rank sends its parameters back to the parent, which checks that the ranks hold
the same weights and that ``"collective"`` gives exactly Gloo's. Exactly, not to a
tolerance: with two ranks each averaged gradient is ``(a + b) / 2`` on both backends,
and floating-point addition of two numbers gives the same either way round.

Usage: python examples/torch_ddp.py
"""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from spawned import run_ranks
from torch.nn.parallel import DistributedDataParallel

import collective  # noqa: F401  (registers the "collective" backend with torch.distributed)

BACKEND = "collective"
WORLD_SIZE = 2
STEPS = 5
BATCH = 16
TIMEOUT = timedelta(seconds=60)
RESULT_TIMEOUT_S = 240


def mean_hook(
    group: dist.ProcessGroup, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average a bucket of gradients over ``group``; DDP waits on the future it returns."""
    tensor = bucket.buffer().div_(group.size())
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def make_model(rank: int) -> torch.nn.Module:
    """Return the model, its weights drawn from this rank's seed (DDP broadcasts rank 0's)."""
    torch.manual_seed(rank)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 8),
    )  # fmt: skip


def train(rank: int, group: dist.ProcessGroup, hook: bool) -> list[float]:
    """Train a DDP replica on ``group`` for ``STEPS`` steps; return its parameters."""
    model = DistributedDataParallel(make_model(rank), process_group=group, bucket_cap_mb=0.01)
    if hook:
        model.register_comm_hook(group, mean_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        x = torch.randn(BATCH, 32, generator=data)
        y = torch.randn(BATCH, 8, generator=data)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return torch.nn.utils.parameters_to_vector(model.parameters()).tolist()


def worker(rank: int, port: int, results: mp.Queue) -> None:
    """One rank: train on each backend, with and without the hook; send the parameters back."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(BACKEND, rank=rank, world_size=WORLD_SIZE, timeout=TIMEOUT)
    groups = {BACKEND: dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    trained = {
        (backend, hook): train(rank, group, hook)
        for backend, group in groups.items()
        for hook in (False, True)
    }
    results.put((rank, trained))
    dist.destroy_process_group()


def main() -> int:
    """Start the ranks, collect their parameters and compare them; return the exit status."""
    trained = run_ranks(worker, WORLD_SIZE, RESULT_TIMEOUT_S)
    if trained is None:
        print(f"the ranks did not all end within {RESULT_TIMEOUT_S} s")
        return 1
    ok = True
    for rank in range(WORLD_SIZE):
        for hook in (False, True):
            how = "a comm hook's future" if hook else "DDP's own averaging"
            same = trained[rank][(BACKEND, hook)] == trained[rank][("gloo", hook)]
            print(f"rank {rank}, {how}: parameters equal to Gloo's: {same}")
            ok = ok and same
    replicas = all(
        trained[rank][key] == trained[0][key] for rank in range(WORLD_SIZE) for key in trained[0]
    )
    print(f"every rank holds the same parameters: {replicas}")
    moved = trained[0][(BACKEND, False)] != make_params(0)
    print(f"training changed the parameters: {moved}")
    return 0 if ok and replicas and moved else 1


def make_params(rank: int) -> list[float]:
    """Return rank ``rank``'s initial parameters, as one list."""
    return torch.nn.utils.parameters_to_vector(make_model(rank).parameters()).tolist()


if __name__ == "__main__":
    sys.exit(main())
