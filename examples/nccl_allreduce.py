"""Actors with one GPU each sum a tensor over NCCL, blocking and async.

One actor per visible GPU (``num_gpus=1``) joins a ``backend="nccl"`` group; each
passes a CUDA tensor holding its rank + 1, and ``allreduce`` leaves the sum in every
actor's tensor, in place, on the actor's current stream. It then runs the same call
async and waits on the handle, and times 1,000 calls of an 8-byte allreduce (each
queued on the stream; the time per call is the host's). On a machine with one GPU the
group has one rank: the calls run, and the sum is that rank's own tensor.

Without a CUDA GPU, torch with CUDA, or cupy with NCCL it prints ``skipped: <reason>``
and exits with status 0.

GPU example: ``tests/gpu/run.sh`` runs it on a GPU machine.

Usage: python examples/nccl_allreduce.py
"""

from __future__ import annotations

import sys
import time

import ray
import torch

import collective as col

GROUP = "nccl-allreduce"
CALLS = 1000


def skip_reason() -> str:
    """Return why this machine cannot run the example, or an empty string if it can."""
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to torch"
    if not col.nccl_available():
        return "the NCCL backend is unavailable: it needs cupy with NCCL (pip install cupy-cuda12x)"
    return ""


@ray.remote(num_gpus=1, num_cpus=0)
class Worker:
    """One rank of the group, on the GPU Ray gave it."""

    def run(self, world_size: int, rank: int) -> dict[str, float | list[float]]:
        col.init_collective_group(world_size, rank, backend="nccl", group_name=GROUP)
        x = torch.full((4,), float(rank + 1), device="cuda")
        col.allreduce(x, GROUP)  # blocking: queued on the current stream, in place
        blocking = x.tolist()  # .tolist() waits for the stream

        y = torch.full((4,), float(rank + 1), device="cuda")
        work = col.allreduce(y, GROUP, async_op=True)
        work.wait()  # orders this actor's current stream after the allreduce
        waited = y.tolist()

        z = torch.ones(2, device="cuda")
        col.allreduce(z, GROUP)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(CALLS):
            col.allreduce(z, GROUP)
        torch.cuda.synchronize()
        per_call_us = (time.perf_counter() - start) / CALLS * 1e6
        col.destroy_collective_group(GROUP)
        return {"blocking": blocking, "async": waited, "per_call_us": per_call_us}


def main() -> int:
    """Run one actor per GPU, print each rank's results, and check them."""
    reason = skip_reason()
    if reason:
        print(f"skipped: {reason}")
        return 0
    world_size = torch.cuda.device_count()
    ray.init(
        address="local", num_cpus=2, num_gpus=world_size, namespace=GROUP, include_dashboard=False
    )
    try:
        workers = [Worker.remote() for _ in range(world_size)]
        refs = [w.run.remote(world_size, rank) for rank, w in enumerate(workers)]
        results = ray.get(refs, timeout=300)
    finally:
        ray.shutdown()
    total = float(world_size * (world_size + 1) // 2)
    ok = True
    for rank, got in enumerate(results):
        right = got["blocking"] == [total] * 4 and got["async"] == [total] * 4
        ok = ok and right
        print(
            f"rank {rank}: blocking {got['blocking']}, async {got['async']}"
            f"{'' if right else ' WRONG'}; 8-byte allreduce {got['per_call_us']:.1f} us a call "
            f"({world_size} GPU(s), world size {world_size})"
        )
    print(f"every rank holds the sum: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
