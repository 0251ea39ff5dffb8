"""Every op of ``ray.util.collective``'s API, run inside one actor of a 4-rank group, and its check.

Shared by the one-node and the two-node tests of the Ray backend plug-in: ``every_op``
runs in each member, ``check_every_op`` asserts every rank's results in the driver.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

WORLD = 4


def every_op(rank: int, name: str) -> dict[str, Any]:
    """Run each op of Ray's API on Ray group ``name`` once, from every root; return the results."""
    import ray.util.collective as rc

    x = torch.full((5,), float(rank + 1))
    rc.allreduce(x, name)  # first: Ray builds a group declared by the driver on its first op
    out: dict[str, Any] = {"allreduce": x.tolist(), "rank": rc.get_rank(name)}
    out["size"] = rc.get_collective_group_size(name)
    out["initialized"] = rc.is_group_initialized(name)
    m = np.full(3, rank + 1, dtype=np.int64)
    rc.allreduce(m, name, rc.types.ReduceOp.MAX)
    out["allreduce_max"] = m.tolist()
    rc.barrier(name)
    out["reduce"], out["broadcast"] = [], []
    for root in range(WORLD):
        r = torch.full((4,), float(rank + 2))
        rc.reduce(r, root, name, rc.types.ReduceOp.PRODUCT)
        out["reduce"].append(r.tolist())
        b = torch.full((6,), 100.0 + root if rank == root else -1.0)
        rc.broadcast(b, root, name)
        out["broadcast"].append(b.tolist())
    gathered = [torch.zeros(2) for _ in range(WORLD)]
    rc.allgather(gathered, torch.full((2,), float(rank)), name)
    out["allgather"] = [g.tolist() for g in gathered]
    pieces = [torch.full((3,), float(10 * rank + j)) for j in range(WORLD)]
    mine = torch.zeros(3)
    rc.reducescatter(mine, pieces, name, rc.types.ReduceOp.MIN)
    out["reducescatter"] = mine.tolist()
    out["reducescatter_inputs_kept"] = [p[0].item() for p in pieces]
    got = torch.zeros(4, dtype=torch.int32)
    to, frm = (rank + 1) % WORLD, (rank - 1) % WORLD
    message = torch.arange(4, dtype=torch.int32) + 10 * rank
    if rank % 2 == 0:
        rc.send(message, to, name)
        rc.recv(got, frm, name)
    else:
        rc.recv(got, frm, name)
        rc.send(message, to, name)
    out["recv"] = got.tolist()
    return out


def check_every_op(results: list[dict[str, Any]]) -> None:
    """Assert each rank's results of ``every_op``; ``results[i]`` is rank i's."""
    for rank, out in enumerate(results):
        assert (out["rank"], out["size"], out["initialized"]) == (rank, WORLD, True)
        assert out["allreduce"] == [10.0] * 5, rank
        assert out["allreduce_max"] == [4] * 3, rank
        for root in range(WORLD):
            product = float(2 * 3 * 4 * 5)
            want = [product] * 4 if rank == root else [float(rank + 2)] * 4
            assert out["reduce"][root] == want, (rank, root)
            assert out["broadcast"][root] == [100.0 + root] * 6, (rank, root)
        assert out["allgather"] == [[float(r)] * 2 for r in range(WORLD)], rank
        assert out["reducescatter"] == [float(rank)] * 3, rank
        assert out["reducescatter_inputs_kept"] == [float(10 * rank + j) for j in range(WORLD)]
        frm = (rank - 1) % WORLD
        assert out["recv"] == [10 * frm + i for i in range(4)], rank
