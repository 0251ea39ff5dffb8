"""CPU groups without Ray: gather, scatter, alltoall, AVG and bitwise ops, async handles.

Ranks are threads of this process meeting on a TCPStore, as in test_gloo_group.py,
whose runners and references this module reuses.
"""

from __future__ import annotations

import gc
import time
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch

from collective.groups.base import BaseGroup
from collective.groups.gloo.group import GlooGroup
from collective.types import (
    AllReduceOptions,
    AllToAllOptions,
    BroadcastOptions,
    CollectiveError,
    CollectiveTimeoutError,
    GatherOptions,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)
from collective.work import Work
from tests.test_gloo_group import (
    DTYPES,
    SHAPE,
    WORLD_SIZES,
    Absence,
    _kinds,
    as_numpy,
    assert_equal,
    make,
    raw,
    run_ranks,
    transport,  # noqa: F401  (the autouse fixture that runs each test on both transports)
    values,
)
from tests.test_shm import run_cpu

FLOATS = ["float16", "bfloat16", "float32", "float64"]
INTEGRAL = [d for d in DTYPES if d not in FLOATS]


def _cases(dtypes: list[str]) -> list[tuple[str, str]]:
    return [(k, d) for d in dtypes for k in _kinds(d)]


def new_reference(inputs: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    """Reduce ``inputs`` by AVG, BAND, BOR or BXOR with numpy."""
    stack = np.stack(inputs)
    if op is ReduceOp.AVG:
        return stack.astype(np.float64).mean(axis=0)
    if stack.dtype == np.bool_:
        logical: dict[ReduceOp, np.ufunc] = {
            ReduceOp.BAND: np.logical_and,
            ReduceOp.BOR: np.logical_or,
        }
        return logical.get(op, np.logical_xor).reduce(stack, axis=0)
    bitwise: dict[ReduceOp, np.ufunc] = {ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or}
    ufunc = bitwise.get(op, np.bitwise_xor)
    return ufunc.reduce(stack.astype(np.int64), axis=0)


def _new_op_cases() -> list[tuple[str, str, ReduceOp]]:
    avg = [(k, d, ReduceOp.AVG) for k, d in _cases(FLOATS)]
    bitwise = [(k, d, op) for k, d in _cases(INTEGRAL) for op in (ReduceOp.BAND, ReduceOp.BOR)]
    return avg + bitwise + [(k, d, ReduceOp.BXOR) for k, d in _cases(INTEGRAL)]


# --- AVG and bitwise reductions ---------------------------------------------------------------


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_avg_and_bitwise_ops_in_allreduce_reduce_and_reducescatter(world_size: int) -> None:
    cases = _new_op_cases()

    def fn(group: GlooGroup, rank: int) -> dict[Any, np.ndarray]:
        out = {}
        for kind, dtype, op in cases:
            x = make(kind, values(rank, dtype), dtype)
            group.allreduce([x], AllReduceOptions(op))
            out["allreduce", kind, dtype, op] = as_numpy(x)
            root = world_size - 1
            x = make(kind, values(rank, dtype), dtype)
            group.reduce([x], ReduceOptions(reduce_op=op, root_rank=root))
            out["reduce", kind, dtype, op] = as_numpy(x)
            output = make(kind, np.zeros(SHAPE), dtype)
            inputs = [make(kind, values(rank, dtype, offset=j), dtype) for j in range(world_size)]
            group.reducescatter([output], [inputs], ReduceScatterOptions(reduce_op=op))
            out["reducescatter", kind, dtype, op] = as_numpy(output)
        return out

    results = run_ranks(world_size, fn)
    for kind, dtype, op in cases:
        expected = new_reference([values(r, dtype) for r in range(world_size)], op)
        for rank, result in enumerate(results):
            what = f"{kind} {dtype} {op.name} rank {rank}/{world_size}"
            assert_equal(result["allreduce", kind, dtype, op], expected, f"allreduce {what}")
            reduced = result["reduce", kind, dtype, op]
            if rank == world_size - 1:
                assert_equal(reduced, expected, f"reduce {what}")
            else:
                assert_equal(reduced, values(rank, dtype), f"reduce non-root {what}")
            chunk = new_reference([values(r, dtype, offset=rank) for r in range(world_size)], op)
            assert_equal(result["reducescatter", kind, dtype, op], chunk, f"reducescatter {what}")


# --- gather and scatter -------------------------------------------------------------------


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gather_every_dtype_and_root(world_size: int) -> None:
    cases = [(root, k, d) for root in range(world_size) for k, d in _cases(DTYPES)]

    def fn(group: GlooGroup, rank: int) -> dict[Any, Any]:
        out = {}
        for root, kind, dtype in cases:
            x = make(kind, values(rank, dtype), dtype)
            before = raw(x)
            outputs = (
                [make(kind, np.zeros(SHAPE), dtype) for _ in range(world_size)]
                if rank == root
                else []
            )
            group.gather([outputs], [x], GatherOptions(root_rank=root))
            out[root, kind, dtype] = ([as_numpy(o) for o in outputs], raw(x) == before)
        return out

    results = run_ranks(world_size, fn)
    for root, kind, dtype in cases:
        for rank, result in enumerate(results):
            gathered, input_kept = result[root, kind, dtype]
            what = f"gather {kind} {dtype} root {root} rank {rank}/{world_size}"
            assert input_kept, what
            if rank != root:
                assert gathered == [], what
                continue
            assert len(gathered) == world_size, what
            for source, got in enumerate(gathered):
                assert_equal(got, values(source, dtype).astype(got.dtype), f"{what} from {source}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_scatter_every_dtype_and_root(world_size: int) -> None:
    cases = [(root, k, d) for root in range(world_size) for k, d in _cases(DTYPES)]

    def fn(group: GlooGroup, rank: int) -> dict[Any, Any]:
        out = {}
        for root, kind, dtype in cases:
            inputs = (
                [make(kind, values(dest, dtype, offset=root), dtype) for dest in range(world_size)]
                if rank == root
                else []
            )
            before = [raw(t) for t in inputs]
            x = make(kind, np.zeros(SHAPE), dtype)
            group.scatter([x], [inputs], ScatterOptions(root_rank=root))
            out[root, kind, dtype] = (as_numpy(x), [raw(t) for t in inputs] == before)
        return out

    results = run_ranks(world_size, fn)
    for root, kind, dtype in cases:
        for rank, result in enumerate(results):
            got, inputs_kept = result[root, kind, dtype]
            what = f"scatter {kind} {dtype} root {root} rank {rank}/{world_size}"
            assert inputs_kept, what
            assert_equal(got, values(rank, dtype, offset=root).astype(got.dtype), what)


# --- alltoall -----------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_alltoall_every_dtype(world_size: int) -> None:
    cases = _cases(DTYPES)

    def fn(group: GlooGroup, rank: int) -> dict[Any, Any]:
        out = {}
        for kind, dtype in cases:
            inputs = [make(kind, values(rank, dtype, offset=j), dtype) for j in range(world_size)]
            before = [raw(t) for t in inputs]
            outputs = [make(kind, np.zeros(SHAPE), dtype) for _ in range(world_size)]
            group.alltoall(outputs, inputs, AllToAllOptions())
            out[kind, dtype] = ([as_numpy(o) for o in outputs], [raw(t) for t in inputs] == before)
        return out

    results = run_ranks(world_size, fn)
    for kind, dtype in cases:
        for rank, result in enumerate(results):
            outputs, inputs_kept = result[kind, dtype]
            what = f"alltoall {kind} {dtype} rank {rank}/{world_size}"
            assert inputs_kept, what
            for source, got in enumerate(outputs):
                expected = values(source, dtype, offset=rank).astype(got.dtype)
                assert_equal(got, expected, f"{what} from {source}")


@pytest.mark.parametrize("world_size", [2, 4])
def test_alltoall_uneven_sizes(world_size: int) -> None:
    def fn(group: GlooGroup, rank: int) -> list[list[float]]:
        inputs = [torch.full((rank + j + 1,), float(10 * rank + j)) for j in range(world_size)]
        outputs = [torch.zeros(j + rank + 1) for j in range(world_size)]
        group.alltoall(outputs, inputs, AllToAllOptions())
        return [o.tolist() for o in outputs]

    for rank, outputs in enumerate(run_ranks(world_size, fn)):
        for source, got in enumerate(outputs):
            assert got == [float(10 * source + rank)] * (source + rank + 1), (rank, source)


@pytest.mark.parametrize("world_size", [2, 3])
def test_alltoall_of_views_of_flat_buffers_and_of_separate_ones(world_size: int) -> None:
    n = world_size

    def fn(group: GlooGroup, rank: int) -> dict[str, Any]:
        sizes_in = [rank + j + 1 for j in range(n)]
        sizes_out = [j + rank + 1 for j in range(n)]
        flat_in = torch.cat(
            [torch.full((k,), float(10 * rank + j)) for j, k in enumerate(sizes_in)]
        )
        kept = flat_in.clone()
        flat_out = torch.zeros(sum(sizes_out))
        group.alltoall(
            list(flat_out.split(sizes_out)), list(flat_in.split(sizes_in)), AllToAllOptions()
        )
        separate_out = [torch.zeros(k) for k in sizes_out]
        group.alltoall(separate_out, list(flat_in.split(sizes_in)), AllToAllOptions())
        even = torch.arange(4 * n, dtype=torch.float64) + 100 * rank
        group.alltoall(list(even.split(4)), list(even.split(4)), AllToAllOptions())
        return {
            "flat": list(flat_out.split(sizes_out)),
            "separate": separate_out,
            "in place": list(even.split(4)),
            "input kept": torch.equal(flat_in, kept),
        }

    for rank, result in enumerate(run_ranks(n, fn)):
        assert result["input kept"], rank
        for source in range(n):
            want = [float(10 * source + rank)] * (source + rank + 1)
            assert result["flat"][source].tolist() == want, (rank, source)
            assert result["separate"][source].tolist() == want, (rank, source)
            start = 100 * source + 4 * rank
            assert result["in place"][source].tolist() == list(map(float, range(start, start + 4)))


# --- async handles ------------------------------------------------------------------------


ROUNDS = 8
"""Async alltoalls per test: the freed staging showed in every one of 20 on the old code."""


def _strided(rank: int, count: int) -> torch.Tensor:
    """Return rank's non-contiguous int32 input: every other element of a fresh buffer."""
    return (torch.arange(2 * count, dtype=torch.int32) + 1000 * rank)[::2]


def async_alltoall_to_rank_0(group: BaseGroup, rank: int) -> list[list[int]]:
    """Send a non-contiguous input to rank 0 only, async, dropping every reference to it.

    The op stages the input; the staged copy must live until the op completes,
    however much memory the caller allocates and frees before ``wait``.
    """
    n, count, got = group.world_size, 64, []
    for _ in range(ROUNDS):
        inputs = [_strided(rank, count)] + [torch.empty(0, dtype=torch.int32)] * (n - 1)
        outputs = [torch.empty(count if rank == 0 else 0, dtype=torch.int32) for _ in range(n)]
        work = group.alltoall(outputs, inputs, AllToAllOptions(async_op=True))
        del inputs
        gc.collect()
        scribbles = [torch.full((count,), -7, dtype=torch.int32) for _ in range(64)]
        work.wait()
        del scribbles
        got.append([int(x) for o in outputs for x in o.tolist()])
    return got


def check_alltoall_to_rank_0(results: list[list[list[int]]]) -> None:
    n, count = len(results), 64
    expected = [x for r in range(n) for x in _strided(r, count).tolist()]
    assert results[0] == [expected] * ROUNDS
    assert results[1:] == [[[]] * ROUNDS] * (n - 1)


@pytest.mark.parametrize("world_size", [2, 3])
def test_async_alltoall_keeps_its_staged_input_alive_until_it_completes(world_size: int) -> None:
    check_alltoall_to_rank_0(run_ranks(world_size, async_alltoall_to_rank_0))


def test_async_alltoall_across_nodes_keeps_its_staged_input_alive() -> None:
    check_alltoall_to_rank_0(run_cpu(4, async_alltoall_to_rank_0, nodes=["a", "a", "b", "b"]))


def test_async_ops_can_be_outstanding_together_and_stay_ordered() -> None:
    def fn(group: GlooGroup, rank: int) -> dict[str, Any]:
        xs = [torch.full((1 << 16,), float(rank + i)) for i in range(4)]
        works = [group.allreduce([x], AllReduceOptions(async_op=True)) for x in xs]
        y = torch.full((8,), float(rank))
        bcast = group.broadcast([y], BroadcastOptions(root_rank=1, async_op=True))
        for work in [*works, bcast]:
            work.wait()
        done = [w.is_completed() for w in [*works, bcast]]
        errors = [w.exception() for w in [*works, bcast]]
        return {
            "types": all(isinstance(w, Work) for w in works),
            "sums": [x[:2].tolist() for x in xs],
            "bcast": y.tolist(),
            "done": done,
            "errors": errors,
        }

    for result in run_ranks(2, fn):
        assert result["types"]
        assert result["sums"] == [[float(1 + 2 * i)] * 2 for i in range(4)]
        assert result["bcast"] == [1.0] * 8
        assert result["done"] == [True] * 5
        assert result["errors"] == [None] * 5


def test_async_staged_output_is_written_on_wait() -> None:
    def fn(group: GlooGroup, rank: int) -> list[list[float]]:
        x = torch.arange(6.0).reshape(2, 3).t()  # not contiguous: staged, written back on wait
        work = group.allreduce([x], AllReduceOptions(async_op=True))
        work.wait()
        work.wait()  # a second wait is harmless
        return x.tolist()

    for result in run_ranks(2, fn):
        assert result == (torch.arange(6.0).reshape(2, 3).t() * 2).tolist()


def test_async_failure_is_raised_by_wait_and_reported_by_exception() -> None:
    absence = Absence()

    def fn(group: GlooGroup, rank: int) -> dict[str, Any]:
        if rank == 1:
            absence.stay()  # never joins the allreduce; rank 0's times out
            return {}
        try:
            work = group.allreduce(
                [torch.ones(4)], AllReduceOptions(timeout=timedelta(seconds=1), async_op=True)
            )
            with pytest.raises(CollectiveTimeoutError) as raised:
                work.wait()
            deadline = time.monotonic() + 5
            while not work.is_completed() and time.monotonic() < deadline:
                time.sleep(0.05)
            with pytest.raises(CollectiveError, match="unusable"):
                group.allreduce([torch.ones(4)], AllReduceOptions(async_op=True))
            return {"same": work.exception() is raised.value, "done": work.is_completed()}
        finally:
            absence.done()

    result = run_ranks(2, fn, group_timeout=timedelta(seconds=10))[0]
    assert result == {"same": True, "done": True}


@pytest.mark.parametrize("op", ["gather", "scatter", "alltoall"])
def test_new_ops_time_out_instead_of_hanging(op: str) -> None:
    timeout = timedelta(seconds=1)
    absence = Absence()

    def fn(group: GlooGroup, rank: int) -> tuple[str, float]:
        if rank == 1:
            absence.stay()  # never joins; rank 0 must give up on its own
            return "absent", 0.0
        try:
            start = time.monotonic()
            x = torch.ones(4)
            with pytest.raises(CollectiveTimeoutError) as raised:
                if op == "gather":
                    gathered = [[torch.zeros(4), torch.zeros(4)]]
                    group.gather(gathered, [x], GatherOptions(0, timeout))
                elif op == "scatter":  # the absent rank is the root: a root may finish alone
                    group.scatter([x], [[]], ScatterOptions(1, timeout))
                else:
                    outputs = [torch.zeros(4), torch.zeros(4)]
                    group.alltoall(outputs, [x, x], AllToAllOptions(timeout))
            return str(raised.value), time.monotonic() - start
        finally:
            absence.done()

    message, elapsed = run_ranks(2, fn, group_timeout=timedelta(seconds=10))[0]
    assert op in message
    assert "rank 0" in message
    assert 0.5 <= elapsed <= 4.0
