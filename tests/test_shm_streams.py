"""Shared memory keeps the user's messages and the collectives apart, and sees every mismatch.

Ranks are threads on a TCPStore (see ``test_shm.run_cpu``); ``NODES`` fakes two
nodes so that the hierarchical path runs. Two kinds of defect are covered:

- a hierarchical reduce or broadcast rooted off a node's leader moves a piece of
  its data inside the node; a user's send posted just before, to the same rank,
  must neither be read as that piece nor receive it;
- a rank that only writes in an op (a broadcast's or scatter's root, a reduce's or
  gather's other ranks) must learn when its readers run another op, or the same op
  with another root, dtype or size: no rank returns as if the op had happened.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from collective.groups.cpu.group import CpuGroup
from collective.types import (
    AllGatherOptions,
    AllReduceOptions,
    BroadcastOptions,
    CollectiveError,
    GatherOptions,
    RecvOptions,
    ReduceOptions,
    ScatterOptions,
    SendOptions,
)
from tests.test_shm import run_cpu

NODES = ["a", "a", "b", "b"]
"""Ranks 0 and 1 on node a (0 leads), ranks 2 and 3 on node b (2 leads)."""


def _mixed(op: str, root: int, sender: int, receiver: int, slot_bytes: int) -> list[Any]:
    """Send a user message, run ``op`` rooted at ``root``, then receive the message."""

    def fn(group: CpuGroup, rank: int) -> tuple[np.ndarray, np.ndarray | None]:
        if rank == sender:  # handed over into the mailbox before the op starts
            group.send([np.full(8, -5.0)], SendOptions(receiver))
        x = np.full(8, 42.0 if rank == root else float(rank + 1))
        if op == "reduce":
            group.reduce([x], ReduceOptions(root_rank=root))
        else:
            group.broadcast([x], BroadcastOptions(root_rank=root))
        got = None
        if rank == receiver:
            got = np.zeros(8)
            group.recv([got], RecvOptions(sender))
        return x, got

    return run_cpu(4, fn, nodes=NODES, slot_bytes=slot_bytes)


@pytest.mark.parametrize("slot_bytes", [512, 64 << 10])
@pytest.mark.parametrize(
    ("op", "sender", "receiver"),
    [("reduce", 0, 1), ("broadcast", 1, 0)],
    ids=["reduce, the leader sends to the root", "broadcast, the root sends to the leader"],
)
def test_a_user_send_never_meets_the_steps_of_a_hierarchical_op(
    op: str, sender: int, receiver: int, slot_bytes: int
) -> None:
    """The op's piece moves between the same two ranks, the same way, as the user's message."""
    for _ in range(5):
        results = _mixed(op, 1, sender, receiver, slot_bytes)
        for rank, (x, got) in enumerate(results):
            if op == "reduce":
                want = 42.0 + 1 + 3 + 4 if rank == 1 else float(rank + 1)
            else:
                want = 42.0
            np.testing.assert_array_equal(x, np.full(8, want), err_msg=f"rank {rank}")
            if rank == receiver:
                np.testing.assert_array_equal(got, np.full(8, -5.0))


Call = Callable[[CpuGroup, int], None]


def _broadcast(root: int, count: int = 8, dtype: str = "float64") -> Call:
    def call(group: CpuGroup, rank: int) -> None:
        group.broadcast([np.full(count, 7, dtype)], BroadcastOptions(root_rank=root))

    return call


def _reduce(root: int, count: int = 8) -> Call:
    def call(group: CpuGroup, rank: int) -> None:
        group.reduce([np.full(count, 7.0)], ReduceOptions(root_rank=root))

    return call


def _scatter(root: int) -> Call:
    def call(group: CpuGroup, rank: int) -> None:
        inputs = [np.full(8, 7.0) for _ in range(group.world_size)] if rank == root else []
        group.scatter([np.zeros(8)], [inputs], ScatterOptions(root_rank=root))

    return call


def _gather(root: int) -> Call:
    def call(group: CpuGroup, rank: int) -> None:
        outputs = [np.zeros(8) for _ in range(group.world_size)] if rank == root else []
        group.gather([outputs], [np.full(8, 7.0)], GatherOptions(root_rank=root))

    return call


MISMATCHES: dict[str, tuple[Call, Call]] = {
    "broadcast from 0 and from 1": (_broadcast(0), _broadcast(1)),
    "broadcast and reduce": (_broadcast(0), _reduce(0)),
    "scatter and gather": (_scatter(0), _gather(0)),
    "reduce and gather": (_reduce(1), _gather(1)),
    "broadcast of 8 and of 9": (_broadcast(0), _broadcast(0, count=9)),
    "broadcast of float64 and int64": (_broadcast(0), _broadcast(0, dtype="int64")),
    "long broadcast and short": (_broadcast(0, 20000), _broadcast(0, 8)),
    "reduce of 8 and of 9": (_reduce(0), _reduce(0, count=9)),
}


def _outcomes(first: Call, second: Call, short: bool) -> list[str]:
    """Run ``first`` on rank 0 and ``second`` on rank 1, then an allreduce; say how each ended."""

    def fn(group: CpuGroup, rank: int) -> str:
        try:
            (first if rank == 0 else second)(group, rank)
            group.allreduce([np.ones(4)], AllReduceOptions())
        except CollectiveError as exc:
            return f"raised: {exc}"
        return "returned"

    return run_cpu(2, fn, slot_bytes=None if short else 512)


@pytest.mark.parametrize("short", [True, False], ids=["short path", "general path"])
@pytest.mark.parametrize("calls", MISMATCHES.values(), ids=MISMATCHES.keys())
def test_a_rank_that_only_writes_learns_of_a_mismatch(
    calls: tuple[Call, Call], short: bool
) -> None:
    outcomes = _outcomes(*calls, short)
    assert all(o.startswith("raised") for o in outcomes), outcomes


def test_a_matched_writer_only_op_still_returns_on_every_rank() -> None:
    def fn(group: CpuGroup, rank: int) -> list[float]:
        out = []
        for root in range(3):
            x = np.full(5, 10.0 * root if rank == root else -1.0)
            group.broadcast([x], BroadcastOptions(root_rank=root))
            r = np.full(5, float(rank + 1))
            group.reduce([r], ReduceOptions(root_rank=root))
            out += [float(x[0]), float(r[0])]
        return out

    for rank, out in enumerate(run_cpu(3, fn)):
        assert out == [
            v for root in range(3) for v in (10.0 * root, 6.0 if rank == root else rank + 1.0)
        ]


def _written_on_mismatch(op: str, slot_bytes: int | None) -> list[tuple[str, bool]]:
    """Run ``op`` on 3 ranks, rank 2 with one element more, then an allreduce.

    Return how each rank ended (the op or the allreduce raised, or both returned) and
    whether its buffers hold anything but what they held, or the root's data.
    """

    def fn(group: CpuGroup, rank: int) -> tuple[str, bool]:
        n = 9 if rank == 2 else 8
        x = np.full(n, float(rank + 1))
        outs = [np.full(n, -1.0) for _ in range(3)]
        try:
            if op == "reduce":
                group.reduce([x], ReduceOptions(root_rank=0))
            elif op == "allreduce":
                group.allreduce([x], AllReduceOptions())
            elif op == "broadcast":
                group.broadcast([x], BroadcastOptions(root_rank=0))
            elif op == "allgather":
                group.allgather([outs], [x], AllGatherOptions())
            else:
                group.gather([outs if rank == 0 else []], [x], GatherOptions(root_rank=0))
        except CollectiveError as exc:
            how = f"raised in the op: {exc}"
        else:
            how = "returned"
        kept = bool((x == rank + 1).all()) or (op == "broadcast" and bool((x == 1.0).all()))
        wrote = not kept or any((o != -1).any() for o in outs)
        if how == "returned":
            try:
                group.allreduce([np.ones(2)], AllReduceOptions())
            except CollectiveError as exc:
                how = f"raised in the next op: {exc}"
        return how, wrote

    return run_cpu(3, fn, slot_bytes=slot_bytes)


@pytest.mark.parametrize("slot_bytes", [None, 512], ids=["short path", "general path"])
@pytest.mark.parametrize("op", ["reduce", "allreduce", "broadcast", "allgather", "gather"])
def test_a_size_mismatch_raises_and_nothing_wrong_is_written(
    op: str, slot_bytes: int | None
) -> None:
    """The ranks that disagree raise in the op; a rank that agrees with its peers may return
    (a reduce's other rank, a broadcast's reader of the root), and raises in the next op."""
    outcomes = _written_on_mismatch(op, slot_bytes)
    assert all(how.startswith("raised") for how, _ in outcomes), outcomes
    assert outcomes[2][0].startswith("raised in the op"), outcomes
    assert "rank 2 called" in outcomes[0][0] or "rank 0 called" in outcomes[0][0], outcomes
    assert "9 float64 elements" in outcomes[0][0] + outcomes[2][0], outcomes
    assert not any(wrote for _, wrote in outcomes), outcomes
