"""Buffers of 0 and 1 elements, of any stride, through every op of the Gloo paths.

torch counts such buffers contiguous whatever their strides, and numpy gives empty
arrays odd strides; both must move like any other buffer. The forced-Gloo group and
the hierarchical group (two faked nodes of two ranks, Gloo among the leaders) run
every op on each kind, ranks as threads; every rank's result is asserted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from collective.groups.base import BaseGroup
from collective.types import (
    AllGatherOptions,
    AllReduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    RecvOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
    SendOptions,
)
from tests.test_gloo_group import run_ranks
from tests.test_shm import run_cpu

KINDS: dict[str, Callable[[float], Any]] = {
    "torch one of a row": lambda v: torch.full((1, 4), v)[:, 0],
    "numpy one of a column": lambda v: np.full((2, 4), v)[1:, 1:2],
    "torch empty slice": lambda v: torch.zeros(4)[4::2],
    "numpy empty": lambda v: np.zeros(0, dtype=np.float32),
    "torch empty int32": lambda v: torch.zeros(0, dtype=torch.int32),
}
"""Each kind of tiny buffer, made holding ``v`` (when it has an element)."""


def _value(x: Any) -> float | None:
    """Return the one element of ``x``, or None when it has none."""
    flat = x.reshape(-1)
    return float(flat[0]) if len(flat) else None


def _ops(group: BaseGroup, rank: int, make: Callable[[float], Any]) -> dict[str, Any]:
    """Run every op on buffers of one kind; return what each left in this rank's buffers."""
    n, out = group.world_size, dict[str, Any]()
    x = make(rank + 1)
    group.allreduce([x], AllReduceOptions())
    out["allreduce"] = _value(x)
    x = make(rank + 1)
    group.broadcast([x], BroadcastOptions(root_rank=n - 1))
    out["broadcast"] = _value(x)
    x = make(rank + 1)
    group.reduce([x], ReduceOptions(root_rank=1))
    out["reduce"] = _value(x)
    parts = [make(-1) for _ in range(n)]
    group.allgather([parts], [make(rank + 1)], AllGatherOptions())
    out["allgather"] = [_value(p) for p in parts]
    x = make(-1)
    group.reducescatter([x], [[make(rank + 1) for _ in range(n)]], ReduceScatterOptions())
    out["reducescatter"] = _value(x)
    parts = [make(-1) for _ in range(n)] if rank == 0 else []
    group.gather([parts], [make(rank + 1)], GatherOptions(root_rank=0))
    out["gather"] = [_value(p) for p in parts]
    x = make(-1)
    sources = [make(10 + i) for i in range(n)] if rank == 0 else []
    group.scatter([x], [sources], ScatterOptions(root_rank=0))
    out["scatter"] = _value(x)
    received = [make(-1) for _ in range(n)]
    sent = [make(10 * rank + j) for j in range(n)]
    group.alltoall(received, sent, AllToAllOptions())
    out["alltoall"] = [_value(r) for r in received]
    x, half = make(rank + 1), n // 2  # across nodes on the hierarchical group
    if rank < half:
        group.send([x], SendOptions(dst_rank=rank + half))
    else:
        group.recv([x], RecvOptions(src_rank=rank - half))
    out["send/recv"] = _value(x)
    group.barrier(BarrierOptions())
    return out


def _expected(rank: int, n: int, empty: bool) -> dict[str, Any]:
    """Return what ``_ops`` leaves on ``rank`` of ``n``; None for every element of empty ones."""
    total = n * (n + 1) / 2
    if empty:
        nothing: dict[str, Any] = {
            op: None for op in ("allreduce", "broadcast", "reduce", "reducescatter", "scatter")
        }
        lists = {"allgather": n, "gather": n if rank == 0 else 0, "alltoall": n}
        return {**nothing, **{op: [None] * k for op, k in lists.items()}, "send/recv": None}
    return {
        "allreduce": total,
        "broadcast": float(n),
        "reduce": total if rank == 1 else rank + 1.0,
        "allgather": [i + 1.0 for i in range(n)],
        "reducescatter": total,
        "gather": [i + 1.0 for i in range(n)] if rank == 0 else [],
        "scatter": 10.0 + rank,
        "alltoall": [10.0 * j + rank for j in range(n)],
        "send/recv": float(rank + 1 - n // 2 if rank >= n // 2 else rank + 1),
    }


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("path", ["gloo", "hierarchical"])
def test_every_op_moves_tiny_buffers_of_any_stride(kind: str, path: str) -> None:
    make = KINDS[kind]

    def fn(group: BaseGroup, rank: int) -> tuple[str, dict[str, Any]]:
        return group.transport, _ops(group, rank, make)

    if path == "gloo":
        results = run_ranks(2, fn)
    else:
        results = run_cpu(4, fn, nodes=["a", "a", "b", "b"])
    n, empty = len(results), _value(make(1)) is None
    for rank, (transport, got) in enumerate(results):
        assert transport == path, transport
        assert got == _expected(rank, n, empty), (rank, got)


def test_alltoall_of_numpy_arrays_with_an_empty_piece() -> None:
    """Rank 0 sends rank 0 nothing; every other piece holds one element."""

    def fn(group: BaseGroup, rank: int) -> list[list[float]]:
        sizes = [0 if rank == 0 else 1, 1]
        sent = [np.full(sizes[j], 10.0 * rank + j, dtype=np.float32) for j in range(2)]
        received = [np.zeros(0 if rank == 0 and j == 0 else 1, np.float32) for j in range(2)]
        group.alltoall(received, sent, AllToAllOptions())
        return [r.tolist() for r in received]

    assert run_ranks(2, fn) == [[[], [10.0]], [[1.0], [11.0]]]


@pytest.mark.parametrize("nodes", [["a", "b"], ["a", "a", "b", "b"]])
def test_an_empty_int32_broadcast_across_nodes_keeps_the_group(nodes: list[str]) -> None:
    def fn(group: BaseGroup, rank: int) -> tuple[str, list[int], float]:
        x = torch.zeros(0, dtype=torch.int32)
        group.broadcast([x], BroadcastOptions(root_rank=len(nodes) - 1))
        after = np.full(2, rank + 1.0)
        group.allreduce([after], AllReduceOptions())
        return group.transport, x.tolist(), float(after[0])

    results = run_cpu(len(nodes), fn, nodes=nodes)
    transport = "gloo" if len(nodes) == 2 else "hierarchical"
    n = len(nodes)
    assert results == [(transport, [], n * (n + 1) / 2)] * n
