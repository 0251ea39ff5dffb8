"""A crowded node: 8 and 16 ranks on shared memory, short ops gathered at local rank 0.

With more local ranks than cores, a short allreduce and a barrier are gathered at local
rank 0 (``collective.groups.shm.gathered``). The tests make the node crowded on any
machine (``usable_cores`` says 2), run every rank as a thread meeting on a TCPStore
(see ``test_shm.run_cpu``), and assert every rank's result: of the short path and the
general path, mixed among the ranks, beside ops that every rank reads in full. A rank
in another op, or with other arguments, makes every rank raise, the gathered ones that
read no one's header but rank 0's too, and no rank's buffer is written.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from collective.groups.cpu.group import CpuGroup
from collective.groups.shm import gathered
from collective.types import (
    AllGatherOptions,
    AllReduceOptions,
    BarrierOptions,
    CollectiveError,
    ReduceOp,
    ReduceOptions,
)
from tests.test_shm import run_cpu
from tests.test_shm_short import _now


@pytest.fixture(autouse=True)
def _crowded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every node crowded: 2 usable cores, whatever this machine has."""
    monkeypatch.setattr(gathered, "usable_cores", lambda: 2)


def _input(rank: int, count: int, dtype: str) -> np.ndarray:
    values = np.random.default_rng(1000 * count + rank).uniform(-9, 9, count)
    return values.astype(dtype)


def _folded(inputs: list[np.ndarray], ufunc: Any) -> np.ndarray:
    """Return the reduction of ``inputs`` in rank order, as every path folds them."""
    out = ufunc(inputs[0], inputs[1])
    for x in inputs[2:]:
        out = ufunc(out, x)
    return out


CASES = [
    ("float32", 2, ReduceOp.SUM, np.add),
    ("float64", 512, ReduceOp.MAX, np.maximum),
    ("int64", gathered.GATHER_BYTES // 8, ReduceOp.SUM, np.add),
    ("float32", gathered.GATHER_BYTES // 4 + 16, ReduceOp.SUM, np.add),
]
"""(dtype, count, reduction, its ufunc): 8 bytes, 4 KiB, the longest gathered, and past it."""


@pytest.mark.parametrize("world_size", [8, 16])
def test_every_rank_gets_the_rank_order_reduction_on_both_paths(world_size: int) -> None:
    general = {3, world_size - 1}
    """Ranks that call the general path where the others take the short one."""

    def fn(group: CpuGroup, rank: int) -> dict[str, Any]:
        got: dict[str, Any] = {"gathers": group._steps.gather_bytes if group._steps else 0}
        for dtype, count, op, _ in CASES:
            x = _input(rank, count, dtype)
            if rank in general or not _now(group, "allreduce", x, op):
                group.allreduce([x], AllReduceOptions(op))
            got[f"allreduce {dtype} {count}"] = x
        group.barrier(BarrierOptions())
        x = np.full(3, rank + 1.0)
        group.reduce([x], ReduceOptions(ReduceOp.SUM, root_rank=world_size - 2))
        got["reduce"] = x
        x = np.arange(5.0) * (rank == 5)
        assert _now(group, "broadcast", x, root=5)
        got["broadcast"] = x
        outs = [np.zeros(2, np.int32) for _ in range(world_size)]
        group.allgather([outs], [np.full(2, rank, np.int32)], AllGatherOptions())
        got["allgather"] = outs
        y = np.ones(1, np.int64)
        assert _now(group, "allreduce", y, ReduceOp.SUM)
        got["last"] = y
        return got

    results = run_cpu(world_size, fn)
    for rank, got in enumerate(results):
        assert got["gathers"] == gathered.GATHER_BYTES, (rank, got["gathers"])
        for dtype, count, _, ufunc in CASES:
            want = _folded([_input(r, count, dtype) for r in range(world_size)], ufunc)
            mine = got[f"allreduce {dtype} {count}"]
            assert mine.tobytes() == want.tobytes(), (rank, dtype, count)
        root_sum = world_size * (world_size + 1) / 2
        want_reduce = root_sum if rank == world_size - 2 else rank + 1.0
        assert np.array_equal(got["reduce"], np.full(3, want_reduce)), rank
        assert np.array_equal(got["broadcast"], np.arange(5.0)), rank
        assert all(np.array_equal(o, np.full(2, r)) for r, o in enumerate(got["allgather"]))
        assert got["last"].tolist() == [world_size], rank


@pytest.mark.parametrize(("odd", "call"), [(11, "broadcast"), (0, "float64")])
def test_one_rank_in_another_op_makes_every_rank_raise_and_writes_nothing(
    odd: int, call: str
) -> None:
    """16 ranks: a rank in a broadcast, or the gathering rank on another dtype."""

    def fn(group: CpuGroup, rank: int) -> tuple[str, bool]:
        x = np.full(2, rank + 1.0, np.float32)
        before = x.copy()
        try:
            if rank != odd:
                _now(group, "allreduce", x, ReduceOp.SUM)
            elif call == "broadcast":
                _now(group, "broadcast", x, root=0)
            else:
                x = x.astype(np.float64)
                before = x.copy()
                _now(group, "allreduce", x, ReduceOp.SUM)
        except CollectiveError as exc:
            return str(exc), np.array_equal(x, before)
        return "", np.array_equal(x, before)

    for rank, (error, unchanged) in enumerate(run_cpu(16, fn)):
        assert error, f"rank {rank} returned from the op"
        assert unchanged, f"rank {rank} raised, but its buffer was written: {error}"


def test_two_crowded_nodes_agree_through_the_gathered_meet() -> None:
    """Two nodes of three ranks: each node's check of the whole op is a gathered meet."""
    nodes = ["a", "b", "a", "b", "a", "b"]

    def fn(group: CpuGroup, rank: int) -> dict[str, Any]:
        got: dict[str, Any] = {"gathers": group._steps.gather_bytes if group._steps else 0}
        x = _input(rank, 4, "float64")
        group.allreduce([x], AllReduceOptions())
        got["allreduce"] = x
        group.barrier(BarrierOptions())
        y = np.full(2, rank + 1, np.int64)
        group.reduce([y], ReduceOptions(ReduceOp.MAX, root_rank=3))
        got["reduce"] = y
        z = np.full(3, rank, np.int32) if rank != 4 else np.zeros(3, np.int64)
        try:
            group.allreduce([z], AllReduceOptions())
        except CollectiveError as exc:
            got["odd"] = str(exc)
        return got

    results = run_cpu(6, fn, nodes=nodes)
    total = np.sum([_input(r, 4, "float64") for r in range(6)], axis=0)
    for rank, got in enumerate(results):
        assert got["gathers"] == gathered.GATHER_BYTES, rank
        np.testing.assert_allclose(got["allreduce"], total, rtol=1e-12)
        assert got["reduce"].tolist() == ([6, 6] if rank == 3 else [rank + 1] * 2), rank
        assert "odd" in got, f"rank {rank} returned from an op whose dtypes differ"
