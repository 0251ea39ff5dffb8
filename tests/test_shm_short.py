"""The short-message path of shared memory: same bits, what it declines, failures.

``CpuGroup.short_launch`` is the launch that ``collective.allreduce``, ``reduce``
and ``broadcast`` build and keep for a blocking call on a short plain buffer, once
its arguments are checked. Ranks are threads meeting on a TCPStore (see
``test_shm.run_cpu``); every test asserts every rank's result.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch

from collective.groups.cpu.group import CpuGroup
from collective.groups.shm.short import MAX_PREPARED, SHORT_BYTES
from collective.types import (
    AllReduceOptions,
    BarrierOptions,
    BroadcastOptions,
    CollectiveError,
    CollectiveTimeoutError,
    CpuTransport,
    GroupOptions,
    ReduceOp,
    ReduceOptions,
)
from tests.test_gloo_group import Absence
from tests.test_shm import _reference, run_cpu

_FLOATS = ("float16", "float32", "float64")
_INTEGERS = ("int8", "uint8", "int32", "int64")
_BASIC = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)


def _now(
    group: CpuGroup, op: str, x: Any, reduce_op: ReduceOp = ReduceOp.SUM, root: int = 0
) -> bool:
    """Run checked call ``op`` on ``x`` through the short path's launch; False if it declines.

    Declining, it does nothing to ``x``.
    """
    options: Any = {
        "allreduce": AllReduceOptions(reduce_op),
        "reduce": ReduceOptions(reduce_op, root),
        "broadcast": BroadcastOptions(root),
    }[op]
    launch = group.short_launch(op, x, options)
    if launch is None:
        return False
    launch(x)
    return True


def _cases() -> list[tuple[str, ReduceOp]]:
    cases = [(d, op) for d in _FLOATS for op in (*_BASIC, ReduceOp.AVG)]
    cases += [(d, op) for d in _INTEGERS for op in (*_BASIC, ReduceOp.BAND, ReduceOp.BOR)]
    cases += [(d, ReduceOp.BXOR) for d in _INTEGERS]
    cases += [("bool", op) for op in (*_BASIC, ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)]
    return cases


def _input(rank: int, seed: int, dtype: str, count: int = 5) -> np.ndarray:
    rng = np.random.default_rng(seed * 7 + rank)
    if dtype == "bool":
        return rng.integers(0, 2, count).astype(bool)
    if dtype in _FLOATS:
        return rng.uniform(-3, 3, count).astype(dtype)
    return rng.integers(1, 4, count).astype(dtype)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_dtype_and_op_gives_the_general_paths_bits_on_every_rank(world_size: int) -> None:
    cases = _cases()

    def fn(group: CpuGroup, rank: int) -> list[tuple[bool, bytes, bytes]]:
        results = []
        for seed, (dtype, op) in enumerate(cases):
            short = _input(rank, seed, dtype)
            general = short.copy()
            took = _now(group, "allreduce", short, op)
            group.allreduce([general], AllReduceOptions(op))
            results.append((took, short.tobytes(), general.tobytes()))
        return results

    per_rank = run_cpu(world_size, fn)
    for seed, (dtype, op) in enumerate(cases):
        inputs = [_input(r, seed, dtype) for r in range(world_size)]
        expected = _reference(inputs, op, dtype)
        first = per_rank[0][seed][1]
        for rank, results in enumerate(per_rank):
            took, short, general = results[seed]
            assert took, (rank, dtype, op)
            assert short == general == first, (rank, dtype, op)
            got = np.frombuffer(short, dtype=dtype).astype(expected.dtype)
            np.testing.assert_allclose(got, expected, rtol=2e-3, atol=2e-3, err_msg=f"{dtype} {op}")


def test_short_and_general_ranks_meet_in_one_op_of_every_shape() -> None:
    shapes: list[tuple[int, ...]] = [(), (0,), (1,), (3, 4), (SHORT_BYTES // 8,)]

    def fn(group: CpuGroup, rank: int) -> list[tuple[bool, np.ndarray]]:
        out = []
        for shape in shapes:
            x = np.full(shape, rank + 1.0)
            if rank == 1:
                group.allreduce([x], AllReduceOptions())
                out.append((False, x))
            else:
                out.append((_now(group, "allreduce", x, ReduceOp.SUM), x))
        return out

    results = run_cpu(3, fn)
    for rank, per_shape in enumerate(results):
        for shape, (took, x) in zip(shapes, per_shape, strict=True):
            assert took == (rank != 1), (rank, shape)
            assert x.shape == shape
            np.testing.assert_array_equal(x, np.full(shape, 6.0))


def test_plain_torch_tensors_take_the_short_path() -> None:
    def fn(group: CpuGroup, rank: int) -> list[tuple[bool, Any]]:
        tensors = [
            torch.full((3,), float(rank + 1)),
            torch.tensor(rank + 1, dtype=torch.int64),
            torch.arange(6, dtype=torch.float64).reshape(2, 3) * (rank + 1),
        ]
        return [(_now(group, "allreduce", t, ReduceOp.SUM), t) for t in tensors]

    for per_rank in run_cpu(2, fn):
        assert [took for took, _ in per_rank] == [True, True, True]
        assert torch.equal(per_rank[0][1], torch.full((3,), 3.0))
        assert per_rank[1][1].item() == 3
        assert torch.equal(per_rank[2][1], torch.arange(6, dtype=torch.float64).reshape(2, 3) * 3)


def _declined(rank: int) -> list[tuple[str, Any, Any]]:
    """Return (what, buffer, op) calls the short path must decline, leaving the buffer as is."""
    read_only = np.ones(4)
    read_only.setflags(write=False)
    grad = torch.ones(3, requires_grad=True)
    return [
        ("non-contiguous", np.ones((4, 4))[:, 0], ReduceOp.SUM),
        ("read-only", read_only, ReduceOp.SUM),
        ("longer than SHORT_BYTES", np.ones(SHORT_BYTES // 8 + 1), ReduceOp.SUM),
        ("AVG on integers", np.ones(3, np.int32), ReduceOp.AVG),
        ("BXOR on floats", np.ones(3), ReduceOp.BXOR),
        ("big-endian", np.ones(3, dtype=">f8"), ReduceOp.SUM),
        ("complex", np.ones(3, np.complex64), ReduceOp.SUM),
        ("a subclass", np.ma.masked_array(np.ones(3)), ReduceOp.SUM),
        ("bfloat16", torch.ones(3, dtype=torch.bfloat16), ReduceOp.SUM),
        ("requires grad", grad, ReduceOp.SUM),
        ("non-contiguous torch", torch.ones(4, 4).t(), ReduceOp.SUM),
        ("a list", [1.0, 2.0], ReduceOp.SUM),
    ]


def _snapshot(x: Any) -> bytes:
    if isinstance(x, torch.Tensor):
        return bytes(x.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return np.asarray(x).tobytes()


def test_what_needs_checking_is_declined_untouched() -> None:
    def fn(group: CpuGroup, rank: int) -> list[tuple[str, bool, bool]]:
        out = []
        for what, x, op in _declined(rank):
            before = _snapshot(x)
            took = _now(group, "allreduce", x, op)
            out.append((what, took, _snapshot(x) == before))
        group.barrier(BarrierOptions())
        return out

    for per_rank in run_cpu(2, fn):
        assert all(not took and same for _, took, same in per_rank), per_rank


@pytest.mark.parametrize("where", ["alone", "gloo forced", "across nodes"])
def test_groups_without_a_short_path_decline(where: str) -> None:
    kwargs: dict[str, Any] = {}
    size = 2
    if where == "alone":
        size = 1
    elif where == "gloo forced":
        kwargs["options"] = GroupOptions(cpu_transport=CpuTransport.GLOO)
    else:
        kwargs["nodes"] = ["a", "b"]

    def fn(group: CpuGroup, rank: int) -> tuple[bool, float]:
        x = np.ones(2)
        took = _now(group, "allreduce", x, ReduceOp.SUM)
        group.allreduce([x], AllReduceOptions())
        return took, float(x[0])

    assert run_cpu(size, fn, **kwargs) == [(False, float(size))] * size


def test_more_sizes_than_kept_prepared_calls_stay_right() -> None:
    counts = [*range(1, MAX_PREPARED + 10), 1, 2, 3]

    def fn(group: CpuGroup, rank: int) -> list[bool]:
        ok = []
        for count in counts:
            x = np.arange(count, dtype=np.int64) + rank
            took = _now(group, "allreduce", x, ReduceOp.SUM)
            ok.append(took and np.array_equal(x, 2 * np.arange(count) + 1))
        return ok

    for per_rank in run_cpu(2, fn):
        assert all(per_rank), per_rank


def test_ranks_passing_different_dtypes_fail_on_every_rank_and_break_the_group() -> None:
    def fn(group: CpuGroup, rank: int) -> tuple[str, str]:
        x = np.ones(2, np.float32) if rank == 0 else np.ones(2, np.int32)
        with pytest.raises(CollectiveError) as raised:
            _now(group, "allreduce", x, ReduceOp.SUM)
        with pytest.raises(CollectiveError, match="unusable after an earlier failure"):
            _now(group, "allreduce", np.ones(2), ReduceOp.SUM)
        with pytest.raises(CollectiveError) as again:
            group.allreduce([np.ones(2)], AllReduceOptions())
        return str(raised.value), str(again.value)

    for first, then in run_cpu(2, fn):
        assert "2 int32 elements" in first or "aborted" in first, first
        assert "2 float32 elements" in first or "aborted" in first, first
        assert "unusable after an earlier failure" in then, then


def test_a_missing_rank_times_out_within_the_group_timeout() -> None:
    absence = Absence()

    def fn(group: CpuGroup, rank: int) -> tuple[str, float] | None:
        group.barrier(BarrierOptions())
        if rank == 1:
            absence.stay()
            return None
        try:
            start = time.monotonic()
            with pytest.raises(CollectiveTimeoutError) as raised:
                _now(group, "allreduce", np.ones(3), ReduceOp.SUM)
            return str(raised.value), time.monotonic() - start
        finally:
            absence.done()

    result = run_cpu(2, fn, timeout=timedelta(seconds=1))[0]
    assert result is not None
    message, took = result
    assert "ranks that never joined it: [1]" in message, message
    assert 0.9 < took < 2.0, took


def test_a_queued_async_op_sends_the_next_call_down_the_general_path_in_order() -> None:
    def fn(group: CpuGroup, rank: int) -> tuple[list[float], float]:
        first = np.full(200_000, rank + 1.0)
        work = group.allreduce([first], AllReduceOptions(async_op=True))
        second = np.full(2, 10.0 * (rank + 1))
        took = _now(group, "allreduce", second, ReduceOp.SUM)
        if not took:
            group.allreduce([second], AllReduceOptions())
        work.wait()
        return [float(first[0]), float(first[-1])], float(second[0])

    for firsts, second in run_cpu(2, fn):
        assert firsts == [3.0, 3.0]
        assert second == 30.0


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_reduce_and_broadcast_give_the_general_paths_bits_on_every_rank(world_size: int) -> None:
    cases = _cases()

    def fn(group: CpuGroup, rank: int) -> list[tuple[bool, bytes, bytes, bool, bytes, bytes]]:
        results = []
        for seed, (dtype, op) in enumerate(cases):
            root = seed % world_size
            reduced = _input(rank, seed, dtype)
            general = reduced.copy()
            took_reduce = _now(group, "reduce", reduced, op, root)
            group.reduce([general], ReduceOptions(op, root_rank=root))
            cast = _input(rank, seed + 1000, dtype)
            cast_general = cast.copy()
            took_cast = _now(group, "broadcast", cast, root=root)
            group.broadcast([cast_general], BroadcastOptions(root_rank=root))
            results.append(
                (
                    took_reduce,
                    reduced.tobytes(),
                    general.tobytes(),
                    took_cast,
                    cast.tobytes(),
                    cast_general.tobytes(),
                )
            )
        return results

    per_rank = run_cpu(world_size, fn)
    for seed, (dtype, op) in enumerate(cases):
        root = seed % world_size
        inputs = [_input(r, seed, dtype) for r in range(world_size)]
        expected = _reference(inputs, op, dtype)
        sent = _input(root, seed + 1000, dtype).tobytes()
        for rank, results in enumerate(per_rank):
            took_reduce, reduced, general, took_cast, cast, cast_general = results[seed]
            assert took_reduce and took_cast, (rank, dtype, op)
            assert reduced == general, (rank, dtype, op)
            assert cast == cast_general == sent, (rank, dtype)
            if rank != root:
                assert reduced == inputs[rank].tobytes(), (rank, dtype, op)
                continue
            got = np.frombuffer(reduced, dtype=dtype).astype(expected.dtype)
            np.testing.assert_allclose(got, expected, rtol=2e-3, atol=2e-3, err_msg=f"{dtype} {op}")


def test_short_and_general_reduce_and_broadcast_meet_in_one_op() -> None:
    shapes: list[tuple[int, ...]] = [(), (0,), (3, 4), (SHORT_BYTES // 8,)]

    def fn(group: CpuGroup, rank: int) -> list[tuple[bool, np.ndarray, bool, np.ndarray]]:
        out = []
        for i, shape in enumerate(shapes):
            root = i % 3
            reduced = np.full(shape, rank + 1.0)
            cast = np.full(shape, 10.0 * (rank + 1))
            if rank == 1:
                group.reduce([reduced], ReduceOptions(root_rank=root))
                group.broadcast([cast], BroadcastOptions(root_rank=root))
                out.append((False, reduced, False, cast))
            else:
                took_reduce = _now(group, "reduce", reduced, ReduceOp.SUM, root)
                took_cast = _now(group, "broadcast", cast, root=root)
                out.append((took_reduce, reduced, took_cast, cast))
        return out

    results = run_cpu(3, fn)
    for rank, per_shape in enumerate(results):
        for i, (shape, (took_reduce, reduced, took_cast, cast)) in enumerate(
            zip(shapes, per_shape, strict=True)
        ):
            root = i % 3
            assert took_reduce == took_cast == (rank != 1), (rank, shape)
            assert reduced.shape == cast.shape == shape
            np.testing.assert_array_equal(
                reduced, np.full(shape, 6.0 if rank == root else rank + 1.0)
            )
            np.testing.assert_array_equal(cast, np.full(shape, 10.0 * (root + 1)))


_NO_OP_DECLINES = {"AVG on integers", "BXOR on floats"}
"""Calls of ``_declined`` that only the reductions decline: broadcast takes any op."""


def test_reduce_and_broadcast_decline_what_needs_checking_untouched() -> None:
    def fn(group: CpuGroup, rank: int) -> list[tuple[str, bool, bool]]:
        out = []
        for what, x, op in _declined(rank):
            before = _snapshot(x)
            took = _now(group, "reduce", x, op, 0)
            out.append((f"reduce {what}", took, _snapshot(x) == before))
            if what not in _NO_OP_DECLINES:
                took = _now(group, "broadcast", x, root=1)
                out.append((f"broadcast {what}", took, _snapshot(x) == before))
        group.barrier(BarrierOptions())
        return out

    for per_rank in run_cpu(2, fn):
        assert all(not took and same for _, took, same in per_rank), per_rank
