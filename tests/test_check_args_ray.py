"""check_args=True: ranks that disagree on an op's arguments all raise ValueError, naming who.

The check compares shapes too, and spreads an argument error that only one rank's
own checks find to every rank, at once; every case here asserts every rank's error.
Without it, each transport still refuses a mismatch of op, root, reduction, dtype
or size before any data moves; the last tests assert that over Gloo and shared memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import ray
import torch

import collective as col
from collective.types import AllToAllOptions
from tests.conftest import live_groups, run_all, unique_name

OP_TIMEOUT = timedelta(seconds=20)


def _init(world_size: int, rank: int, name: str) -> None:
    col.init_collective_group(
        world_size, rank, backend="gloo", group_name=name, timeout=OP_TIMEOUT, check_args=True
    )


def _destroy(name: str) -> None:
    col.destroy_collective_group(name)


def _outcome(fn: Callable[..., Any], rank: int, name: str) -> str:
    """Run ``fn(rank, name)`` and return the ValueError's message, or "ok"."""
    try:
        fn(rank, name)
    except ValueError as exc:
        return str(exc)
    return "ok"


def _sum(rank: int, name: str) -> float:
    x = np.full(4, rank + 1.0)
    col.allreduce(x, name)
    return float(x.sum())


@pytest.fixture(scope="module")
def trio(members: list) -> Iterator[tuple[list, str]]:
    """Yield three members in one checked group, destroyed at the end."""
    actors, name = members[:3], unique_name("checked")
    run_all(actors, _init, [3] * 3, range(3), [name] * 3)
    yield actors, name
    run_all(actors, _destroy, [name] * 3)
    assert live_groups() == []


def _shape(rank: int, name: str) -> None:
    col.allreduce(np.ones(3 if rank == 2 else 4, dtype=np.float32), name)


def _dtype(rank: int, name: str) -> None:
    col.allreduce(np.ones(4, dtype=np.float64 if rank == 1 else np.float32), name)


def _reduce_op(rank: int, name: str) -> None:
    col.allreduce(np.ones(4), name, col.ReduceOp.MAX if rank == 0 else col.ReduceOp.SUM)


def _which_op(rank: int, name: str) -> None:
    if rank == 1:
        col.broadcast(np.ones(4), 0, name)
    else:
        col.allreduce(np.ones(4), name)


def _root(rank: int, name: str) -> None:
    col.broadcast(np.ones(4), rank % 2, name)


def _alltoall(rank: int, name: str) -> None:
    group = col.get_group_handle(name)
    sizes = [2, 2, 3 if rank == 0 else 2]
    inputs = [np.ones(s, dtype=np.float32) for s in sizes]
    outputs = [np.zeros(2, dtype=np.float32) for _ in range(3)]
    group.alltoall(outputs, inputs, AllToAllOptions()).wait()


CASES = {
    "shape": (_shape, ["shape", "(4,) on ranks [0, 1]", "(3,) on rank 2"]),
    "dtype": (_dtype, ["dtype", "float32 on ranks [0, 2]", "float64 on rank 1"]),
    "reduce_op": (_reduce_op, ["reduce op", "MAX on rank 0", "SUM on ranks [1, 2]"]),
    "op": (_which_op, ["op: allreduce on ranks [0, 2]", "broadcast on rank 1"]),
    "root": (_root, ["root: 0 on ranks [0, 2]", "1 on rank 1"]),
    "alltoall": (_alltoall, ["rank 2 expects 2 elements from rank 0, which sends it 3"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_raises_naming_the_ranks_that_differ(case: str, trio: tuple[list, str]) -> None:
    actors, name = trio
    fn, expected = CASES[case]
    messages = run_all(actors, _outcome, [fn] * 3, range(3), [name] * 3)
    for message in messages:
        assert name in message and "different arguments" in message, message
        for part in expected:
            assert part in message, (part, message)
    assert len({m.split(": ", 1)[1] for m in messages}) == 1
    # Nothing moved and nothing broke: the group still reduces correctly.
    assert run_all(actors, _sum, range(3), [name] * 3) == [24.0] * 3


def _p2p(rank: int, name: str) -> str:
    if rank == 0:
        return _outcome(lambda r, n: col.send(np.ones(4, dtype=np.float32), 1, n), rank, name)
    return _outcome(lambda r, n: col.recv(np.ones(5, dtype=np.float32), 0, n), rank, name)


def test_send_and_recv_both_raise_on_a_mismatch(trio: tuple[list, str]) -> None:
    actors, name = trio
    messages = ray.get([a.run.remote(_p2p, r, name) for r, a in enumerate(actors[:2])], timeout=60)
    for message in messages:
        assert "shape: (4,) on rank 0, (5,) on rank 1" in message or (
            "shape: (5,) on rank 1, (4,) on rank 0" in message
        ), message


def test_matching_arguments_pass_the_check(trio: tuple[list, str]) -> None:
    actors, name = trio

    def many(rank: int, name: str) -> list[float]:
        x = np.full(4, rank + 1.0)
        col.broadcast(x, 2, name)
        parts = [np.zeros(4) for _ in range(3)]
        col.allgather(parts, np.full(4, float(rank)), name)
        col.barrier(name)
        return [float(x[0])] + [float(p[0]) for p in parts]

    assert run_all(actors, many, range(3), [name] * 3) == [[3.0, 0.0, 1.0, 2.0]] * 3


def test_declared_group_keeps_check_args(members: list) -> None:
    actors, name = members[:2], unique_name("declchecked")
    col.declare_collective_group(
        actors, 2, [0, 1], backend="gloo", group_name=name, timeout=OP_TIMEOUT, check_args=True
    )
    try:
        messages = run_all(actors, _outcome, [_dtype] * 2, range(2), [name] * 2)
        assert all("float64 on rank 1" in m for m in messages), messages
    finally:
        run_all(actors, _destroy, [name] * 2)
        col.destroy_collective_group(name)
    assert name not in live_groups()


@pytest.mark.parametrize("value", [1, "yes", None])
def test_check_args_must_be_a_bool(value: Any, members: list) -> None:
    with pytest.raises(TypeError, match="check_args must be a bool"):
        col.declare_collective_group(
            members[:2], 2, [0, 1], backend="gloo", group_name=unique_name(), check_args=value
        )


def _unchecked(rank: int, name: str, transport: str) -> list[float] | str:
    col.init_collective_group(
        2, rank, backend="gloo", group_name=name, timeout=OP_TIMEOUT, cpu_transport=transport
    )
    x = np.full(4, float(rank + 1))
    try:
        col.allreduce(x, name, col.ReduceOp.MAX if rank == 0 else col.ReduceOp.SUM)
    except col.CollectiveError as exc:
        return str(exc)
    finally:
        col.destroy_collective_group(name)
    return x.tolist()


def _unchecked_gloo(rank: int, name: str, case: str) -> dict[str, Any]:
    """Run ``case`` on a forced-Gloo group without the check; report the error and the aftermath."""
    col.init_collective_group(
        2, rank, backend="gloo", group_name=name, timeout=OP_TIMEOUT, cpu_transport="gloo"
    )
    try:
        dtype, size, op = {
            "float32 vs float64": (np.float64 if rank else np.float32, 8, col.ReduceOp.SUM),
            "8 vs 9 elements": (np.float32, 8 + rank, col.ReduceOp.SUM),
            "SUM vs MAX": (np.float32, 8, col.ReduceOp.MAX if rank else col.ReduceOp.SUM),
            "send float32[8] into float64[8]": (np.float64 if rank else np.float32, 8, None),
        }[case]
        x = np.full(size, rank + 1, dtype=dtype)
        before, error = x.copy(), ""
        try:
            if op is not None:
                col.allreduce(x, name, op)
            elif rank == 0:
                col.send(x, 1, name)
            else:
                col.recv(x, 0, name)
        except ValueError as exc:
            error = str(exc)
        after = np.full(4, rank + 1.0)
        col.allreduce(after, name)
        return {"error": error, "unchanged": np.array_equal(x, before), "after": after.tolist()}
    finally:
        col.destroy_collective_group(name)


UNCHECKED_GLOO = {
    "float32 vs float64": "dtype: float32 on rank 0, float64 on rank 1",
    "8 vs 9 elements": "elements: 8 on rank 0, 9 on rank 1",
    "SUM vs MAX": "reduce op: SUM on rank 0, MAX on rank 1",
    "send float32[8] into float64[8]": "rank 0 sent float32[8], but rank 1 receives into float64",
}
"""Mismatches over Gloo without check_args, and what each rank that raises says."""


@pytest.mark.parametrize("case", list(UNCHECKED_GLOO))
def test_without_the_check_gloo_still_refuses_a_mismatch_and_the_actors_live(
    members: list, case: str
) -> None:
    """gloo alone aborted the actor's process on the first two and mixed the data on the others."""
    name = unique_name("unchecked")
    results = run_all(members[:2], _unchecked_gloo, [0, 1], [name, name], [case, case])
    raising = results[1:] if case.startswith("send") else results
    for result in raising:
        assert UNCHECKED_GLOO[case] in result["error"], result
        assert result["unchanged"], result
    for result in results:
        assert result["after"] == [3.0] * 4, result
    assert name not in live_groups()


def test_without_the_check_shared_memory_still_catches_a_reduce_op_mismatch(
    members: list,
) -> None:
    """Shared memory's slots carry each op's signature, so a mismatch fails instead of lying."""
    name = unique_name("unchecked")
    results = run_all(members[:2], _unchecked, [0, 1], [name, name], ["shm"] * 2)
    for message in results:
        assert isinstance(message, str), message
        assert "called allreduce (" in message or "aborted" in message, message
    assert any("check_args=True" in m for m in results), results
    assert name not in live_groups()


def _timed_outcome(fn: Callable[..., Any], rank: int, name: str) -> tuple[str, str, float]:
    """Run ``fn(rank, name)``; return the error's type name, its message and the time taken."""
    start = time.monotonic()
    try:
        fn(rank, name)
    except RuntimeError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "", "ok", time.monotonic() - start


def _short_list_on_rank_1(rank: int, name: str) -> None:
    outputs = [np.zeros(4) for _ in range(2 if rank == 1 else 3)]
    col.allgather(outputs, np.ones(4), name)


def _python_list_on_rank_2(rank: int, name: str) -> None:
    col.reduce([1.0, 2.0] if rank == 2 else np.ones(4), 0, name)


def _grad_leaf_on_rank_0(rank: int, name: str) -> None:
    x = torch.ones(4, requires_grad=rank == 0)
    col.broadcast(x, 1, name)


def _bad_ranks_everywhere_else(rank: int, name: str) -> None:
    col.broadcast(np.ones(4), 7 if rank != 0 else 0, name)


LOCAL_ERRORS = {
    "short_list": (
        _short_list_on_rank_1,
        "ArgumentValueError",
        "rank 1 passed an invalid argument: tensor_list must hold 3 tensors (the world size)",
    ),
    "not_a_tensor": (
        _python_list_on_rank_2,
        "ArgumentTypeError",
        "rank 2 passed an invalid argument: tensor must be a numpy.ndarray",
    ),
    "grad_leaf": (
        _grad_leaf_on_rank_0,
        "ArgumentValueError",
        "rank 0 passed an invalid argument: tensor is a leaf tensor that requires grad",
    ),
    "two_ranks": (
        _bad_ranks_everywhere_else,
        "ArgumentValueError",
        "ranks passed invalid arguments: rank 1: src_rank must be in [0, 3), got 7; rank 2:",
    ),
}


@pytest.mark.parametrize("case", list(LOCAL_ERRORS))
def test_one_ranks_own_argument_error_is_raised_on_every_rank_at_once(
    case: str, trio: tuple[list, str]
) -> None:
    actors, name = trio
    fn, kind, expected = LOCAL_ERRORS[case]
    outcomes = run_all(actors, _timed_outcome, [fn] * 3, range(3), [name] * 3)
    for error_kind, message, elapsed in outcomes:
        assert error_kind == kind, (error_kind, message)
        assert expected in message and name in message, message
        assert elapsed < OP_TIMEOUT.total_seconds() - 5, elapsed  # not the timeout
    assert len({message for _, message, _ in outcomes}) == 1
    assert run_all(actors, _sum, range(3), [name] * 3) == [24.0] * 3


def _recv_into_a_grad_leaf(rank: int, name: str) -> tuple[str, str, float]:
    if rank == 0:
        return _timed_outcome(lambda r, n: col.send(np.ones(4, dtype=np.float32), 1, n), rank, name)
    grad = torch.zeros(4, requires_grad=True)
    return _timed_outcome(lambda r, n: col.recv(grad, 0, n), rank, name)


def test_send_and_recv_both_raise_the_receivers_argument_error(trio: tuple[list, str]) -> None:
    actors, name = trio
    outcomes = ray.get(
        [a.run.remote(_recv_into_a_grad_leaf, r, name) for r, a in enumerate(actors[:2])],
        timeout=60,
    )
    for kind, message, elapsed in outcomes:
        assert kind == "ArgumentValueError", message
        assert "rank 1 passed an invalid argument: tensor is a leaf tensor" in message, message
        assert elapsed < OP_TIMEOUT.total_seconds() - 5, elapsed  # not the timeout
    assert run_all(actors, _sum, range(3), [name] * 3) == [24.0] * 3


def _strict_checked(rank: int, name: str) -> tuple[str, str, float, list[float]]:
    col.init_collective_group(
        2, rank, "gloo", name, timeout=OP_TIMEOUT, check_args=True, strict_buffers=True
    )
    x = np.ones(4)
    if rank == 1:
        x.flags.writeable = False  # as an actor argument or a ray.get result would be
    outcome = _timed_outcome(lambda r, n: col.allreduce(x, n), rank, name)
    y = np.full(4, rank + 1.0)
    col.allreduce(y, name)
    col.destroy_collective_group(name)
    return (*outcome, y.tolist())


def test_strict_buffers_refuse_a_read_only_buffer_on_every_rank(members: list) -> None:
    name = unique_name("strictchecked")
    for kind, message, elapsed, after in run_all(members[:2], _strict_checked, [0, 1], [name] * 2):
        assert kind == "ArgumentValueError", message
        assert "rank 1 passed an invalid argument: tensor is a read-only numpy array" in message
        assert "strict_buffers is set" in message
        assert elapsed < OP_TIMEOUT.total_seconds() - 5, elapsed  # not the timeout
        assert after == [3.0] * 4
    assert name not in live_groups()
