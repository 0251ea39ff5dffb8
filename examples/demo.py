"""Run every collective op on a 4-actor Gloo group and print what each rank got.

Usage: python examples/demo.py
"""

from __future__ import annotations

import numpy as np
import ray
import torch

import collective as col

WORLD_SIZE = 4
GROUP = "demo"


@ray.remote(num_cpus=0)
class Worker:
    """One rank: builds its inputs from its rank and returns what each op produced."""

    def setup(self, rank: int) -> int:
        col.init_collective_group(WORLD_SIZE, rank, backend="gloo", group_name=GROUP)
        return col.get_rank(GROUP)

    def run_ops(self) -> dict[str, list]:
        rank, n = col.get_rank(GROUP), col.get_collective_group_size(GROUP)
        got: dict[str, list] = {}

        x = np.full(4, rank + 1, dtype=np.float32)
        col.allreduce(x, GROUP)
        got["allreduce(sum of rank+1)"] = x.tolist()

        x = torch.full((4,), rank + 1, dtype=torch.int64)
        col.allreduce(x, GROUP, op=col.ReduceOp.MAX)
        got["allreduce(max, torch)"] = x.tolist()

        x = np.full(3, rank + 1, dtype=np.int32)
        col.reduce(x, dst_rank=1, group_name=GROUP, op=col.ReduceOp.PRODUCT)
        got["reduce(product -> rank 1)"] = x.tolist()

        x = np.full(3, rank, dtype=np.float64)
        col.broadcast(x, src_rank=2, group_name=GROUP)
        got["broadcast(from rank 2)"] = x.tolist()

        parts = [np.zeros(2, dtype=np.int64) for _ in range(n)]
        col.allgather(parts, np.full(2, rank * 10, dtype=np.int64), GROUP)
        got["allgather"] = [p.tolist() for p in parts]

        out = np.zeros(2, dtype=np.float32)
        chunks = [np.full(2, rank * 100 + i, dtype=np.float32) for i in range(n)]
        col.reducescatter(out, chunks, GROUP)
        got["reducescatter(sum)"] = out.tolist()

        msg = np.full(2, rank, dtype=np.float32)
        if rank % 2 == 0:
            col.send(msg, dst_rank=rank + 1, group_name=GROUP)
        else:
            col.recv(msg, src_rank=rank - 1, group_name=GROUP)
        got["send/recv(even -> odd)"] = msg.tolist()

        parts = [np.zeros(2, dtype=np.int32) for _ in range(n)] if rank == 0 else None
        col.gather(np.full(2, rank, dtype=np.int32), parts, dst_rank=0, group_name=GROUP)
        got["gather(-> rank 0)"] = [p.tolist() for p in parts] if parts else ["-"]

        out = torch.zeros(2)
        chunks = [torch.full((2,), 10.0 * i) for i in range(n)] if rank == 3 else None
        col.scatter(out, chunks, src_rank=3, group_name=GROUP)
        got["scatter(from rank 3)"] = out.tolist()

        sent = [np.array([10 * rank + j]) for j in range(n)]
        received = [np.zeros(1, dtype=np.int64) for _ in range(n)]
        col.alltoall(received, sent, GROUP)
        got["alltoall(10*src+dst)"] = [int(r[0]) for r in received]

        x = torch.full((3,), float(rank))
        work = col.allreduce(x, GROUP, op=col.ReduceOp.AVG, async_op=True)
        work.wait()
        got["allreduce(avg, async)"] = x.tolist()

        col.barrier(GROUP)
        got["barrier"] = ["passed"]
        return got

    def teardown(self) -> bool:
        col.destroy_collective_group(GROUP)
        return col.is_group_initialized(GROUP)


def main() -> None:
    """Start a local cluster, run the ops, print each rank's results, and clean up."""
    ray.init(
        address="local",
        num_cpus=2,
        namespace="collective-demo",
        include_dashboard=False,
        log_to_driver=False,
    )
    workers = [Worker.remote() for _ in range(WORLD_SIZE)]
    ranks = ray.get([w.setup.remote(r) for r, w in enumerate(workers)], timeout=120)
    print(f"gloo group {GROUP!r} ready, ranks {ranks}")
    results = ray.get([w.run_ops.remote() for w in workers], timeout=120)
    for op in results[0]:
        print(f"\n{op}")
        for rank, result in enumerate(results):
            print(f"  rank {rank}: {result[op]}")
    still_there = ray.get([w.teardown.remote() for w in workers], timeout=60)
    print(
        f"\ngroup {GROUP!r} destroyed: initialized on no rank: {not any(still_there)}; "
        f"live groups in this job: {col.list_collective_groups()}"
    )
    print(
        "the named actor 'collective.rendezvous', the store that hosted the group's "
        "rendezvous, exits by itself a few seconds after its last group: nothing is left "
        "to clean up"
    )
    ray.shutdown()


if __name__ == "__main__":
    main()
