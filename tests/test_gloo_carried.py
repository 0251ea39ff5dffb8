"""Ops whose data rides in the Gloo agreement, and the same ops just too long for it.

A collective whose buffer fits in the agreement's records finishes from them on
every rank (see ``collective.groups.gloo.agree``); one byte more, and gloo moves the
data. Both sides of that limit must give the same results, for every dtype and
reduction.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from collective.groups.base import BaseGroup
from collective.groups.gloo.agree import capacity
from collective.types import (
    AllGatherOptions,
    AllReduceOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
)
from tests.test_gloo_group import (
    CLASSIC_OPS,
    DTYPES,
    _kinds,
    as_numpy,
    assert_equal,
    make,
    reference,
    run_ranks,
)

ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int64": 8, "int32": 4}


def _counts(world_size: int, dtype: str) -> list[int]:
    """Return the element counts that just fit in the records, and just do not."""
    fits = capacity(world_size) // ITEMSIZE.get(dtype, 1)
    return [fits, fits + 1]


def _values(rank: int, dtype: str, count: int) -> np.ndarray:
    """Return rank's input of ``count`` small integers (bits of the index for bool)."""
    j = np.arange(count)
    if dtype == "bool":
        return (j >> rank) & 1 == 1
    return ((j + 2 * rank) % 5 + 1).astype(dtype if dtype != "bfloat16" else "float32")


@pytest.mark.parametrize("world_size", [2, 3])
def test_allreduce_on_both_sides_of_the_limit(world_size: int) -> None:
    cases = [
        (kind, dtype, op, count)
        for dtype in DTYPES
        for kind in _kinds(dtype)
        for op in CLASSIC_OPS
        for count in _counts(world_size, dtype)
    ]

    def fn(group: BaseGroup, rank: int) -> dict[tuple[Any, ...], np.ndarray]:
        out = {}
        for kind, dtype, op, count in cases:
            x = make(kind, _values(rank, dtype, count), dtype)
            group.allreduce([x], AllReduceOptions(op))
            out[kind, dtype, op, count] = as_numpy(x)
        return out

    results = run_ranks(world_size, fn)
    for kind, dtype, op, count in cases:
        expected = reference([_values(r, dtype, count) for r in range(world_size)], op)
        for rank, result in enumerate(results):
            what = f"{kind} {dtype} {op.name} of {count} on rank {rank}"
            assert_equal(result[kind, dtype, op, count], expected, what)


@pytest.mark.parametrize("world_size", [2, 3])
def test_avg_on_both_sides_of_the_limit(world_size: int) -> None:
    counts = _counts(world_size, "float32")

    def fn(group: BaseGroup, rank: int) -> list[np.ndarray]:
        out = []
        for count in counts:
            x = np.full(count, rank + 1.0, dtype=np.float32)
            group.allreduce([x], AllReduceOptions(ReduceOp.AVG))
            out.append(x)
        return out

    mean = (world_size + 1) / 2
    for result in run_ranks(world_size, fn):
        for count, got in zip(counts, result, strict=True):
            assert_equal(got, np.full(count, mean), f"AVG of {count}")


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("dtype", ["float64", "int32", "bool", "bfloat16"])
def test_rooted_and_gathering_ops_on_both_sides_of_the_limit(world_size: int, dtype: str) -> None:
    kind = _kinds(dtype)[-1]
    counts = _counts(world_size, dtype)
    root = world_size - 1

    def fn(group: BaseGroup, rank: int) -> dict[tuple[str, int], Any]:
        out: dict[tuple[str, int], Any] = {}
        for count in counts:
            x = make(kind, _values(rank, dtype, count), dtype)
            group.reduce([x], ReduceOptions(ReduceOp.MAX, root))
            out["reduce", count] = as_numpy(x)
            x = make(kind, _values(rank, dtype, count), dtype)
            group.broadcast([x], BroadcastOptions(root_rank=root))
            out["broadcast", count] = as_numpy(x)
            parts = [make(kind, np.zeros(count), dtype) for _ in range(world_size)]
            mine = make(kind, _values(rank, dtype, count), dtype)
            group.allgather([parts], [mine], AllGatherOptions())
            out["allgather", count] = [as_numpy(p) for p in parts]
            parts = [make(kind, np.zeros(count), dtype) for _ in range(world_size)]
            parts = parts if rank == root else []
            mine = make(kind, _values(rank, dtype, count), dtype)
            group.gather([parts], [mine], GatherOptions(root_rank=root))
            out["gather", count] = [as_numpy(p) for p in parts]
            group.barrier(BarrierOptions())
        return out

    results = run_ranks(world_size, fn)
    for count in counts:
        inputs = [_values(r, dtype, count) for r in range(world_size)]
        for rank, got in enumerate(results):
            what = f"{dtype}[{count}] on rank {rank}"
            reduced = reference(inputs, ReduceOp.MAX) if rank == root else inputs[rank]
            assert_equal(got["reduce", count], reduced, f"reduce {what}")
            assert_equal(got["broadcast", count], inputs[root], f"broadcast {what}")
            for i, part in enumerate(got["allgather", count]):
                assert_equal(part, inputs[i], f"allgather part {i} {what}")
            assert len(got["gather", count]) == (world_size if rank == root else 0)
            for i, part in enumerate(got["gather", count]):
                assert_equal(part, inputs[i], f"gather part {i} {what}")


def _chunk_counts(world_size: int, dtype: str) -> list[int]:
    """Return the chunk lengths whose lists just fit in the records, and just do not."""
    fits = capacity(world_size) // world_size // ITEMSIZE.get(dtype, 1)
    return [fits, fits + 1]


@pytest.mark.parametrize("world_size", [2, 3])
def test_reducescatter_on_both_sides_of_the_limit(world_size: int) -> None:
    """Each rank carries its whole list: chunks of a world size-th of the records fit."""
    cases = [
        (kind, dtype, op, count)
        for dtype in DTYPES
        for kind in _kinds(dtype)
        for op in CLASSIC_OPS
        for count in _chunk_counts(world_size, dtype)
    ]

    def chunks(rank: int, dtype: str, count: int) -> list[np.ndarray]:
        whole = _values(rank, dtype, count * world_size)
        return [whole[i * count : (i + 1) * count] for i in range(world_size)]

    def fn(group: BaseGroup, rank: int) -> dict[tuple[Any, ...], np.ndarray]:
        out = {}
        for kind, dtype, op, count in cases:
            inputs = [make(kind, c, dtype) for c in chunks(rank, dtype, count)]
            before = [as_numpy(i).copy() for i in inputs]
            x = make(kind, np.zeros(count), dtype)
            group.reducescatter([x], [inputs], ReduceScatterOptions(op))
            for i, b in zip(inputs, before, strict=True):
                assert_equal(as_numpy(i), b, "an input was written")
            out[kind, dtype, op, count] = as_numpy(x)
        return out

    results = run_ranks(world_size, fn)
    for kind, dtype, op, count in cases:
        for rank, result in enumerate(results):
            expected = reference([chunks(r, dtype, count)[rank] for r in range(world_size)], op)
            what = f"{kind} {dtype} {op.name} chunks of {count} on rank {rank}"
            assert_equal(result[kind, dtype, op, count], expected, what)


def test_a_carried_reducescatter_into_its_own_chunk() -> None:
    """``reducescatter(chunks[rank], chunks)``: the rank's chunk takes the result."""

    def fn(group: BaseGroup, rank: int) -> list[list[float]]:
        parts = [np.full(4, float(rank * 10 + i), dtype=np.float32) for i in range(2)]
        group.reducescatter([parts[rank]], [parts], ReduceScatterOptions(ReduceOp.SUM))
        return [p.tolist() for p in parts]

    results = run_ranks(2, fn)
    assert results[0] == [[10.0] * 4, [1.0] * 4]
    assert results[1] == [[10.0] * 4, [12.0] * 4]
