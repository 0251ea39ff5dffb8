"""Quickstart: two Ray actors sum a tensor with a Gloo group, blocking and async.

Usage: python examples/quickstart.py
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import ray
import torch

import collective as col

WORLD_SIZE = 2


@ray.remote(num_cpus=0)
class Worker:
    """One rank of the group."""

    def setup(self, rank: int) -> None:
        col.init_collective_group(
            WORLD_SIZE, rank, backend="gloo", group_name="quickstart", timeout=timedelta(seconds=60)
        )

    def compute(self) -> dict[str, list[float]]:
        rank = col.get_rank("quickstart")

        x = np.full(4, rank + 1.0, dtype=np.float32)
        col.allreduce(x, group_name="quickstart")  # writes x in place on every rank

        y = torch.arange(4, dtype=torch.float64) * (rank + 1)
        work = col.allreduce(y, group_name="quickstart", op=col.ReduceOp.MAX, async_op=True)
        work.wait()  # y must not be touched before wait returns

        return {"sum": x.tolist(), "max": y.tolist()}

    def teardown(self) -> None:
        col.destroy_collective_group("quickstart")


def main() -> None:
    """Start a private local Ray cluster, run both ranks, check and print, shut down."""
    ray.init(address="local", num_cpus=2, namespace="quickstart", include_dashboard=False)
    try:
        workers = [Worker.remote() for _ in range(WORLD_SIZE)]
        ray.get([w.setup.remote(rank) for rank, w in enumerate(workers)], timeout=120)
        results = ray.get([w.compute.remote() for w in workers], timeout=120)
        ray.get([w.teardown.remote() for w in workers], timeout=60)
    finally:
        ray.shutdown()
    for rank, result in enumerate(results):
        print(f"rank {rank}: {result}")
    assert all(r["sum"] == [3.0] * 4 for r in results), results
    assert all(r["max"] == [0.0, 2.0, 4.0, 6.0] for r in results), results


if __name__ == "__main__":
    main()
