"""Bad inputs fail early and clearly; timeouts fail in time and say who was missing.

Every argument error is raised inside a real Ray actor and must name the offending
argument. Errors on ops are raised on rank 0 of a live two-rank group while rank 1
stays idle; an allreduce on both ranks afterwards must still give the right answer,
which proves rank 0 sent nothing before raising.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import ray
import torch
from ray.exceptions import RayTaskError

import collective as col
from collective.checks.arguments import MAX_GROUP_NAME_BYTES
from tests.conftest import RAY_TIMEOUT_S, live_groups, run_all, unique_name

OP_TIMEOUT = timedelta(seconds=2)
SLACK_S = 5.0
"""A timed-out call must return within its timeout plus this."""


OURS = {ValueError: col.ArgumentValueError, TypeError: col.ArgumentTypeError}
"""The class each argument error is raised as: both the builtin and a RuntimeError."""


def _assert_argument_error(error: Any, error_type: type[Exception]) -> None:
    assert type(error) is OURS[error_type], repr(error)
    assert isinstance(error, error_type) and isinstance(error, RuntimeError)
    assert not isinstance(error, col.CollectiveError)


def _names(message: str, word: str) -> bool:
    """Return whether ``message`` mentions ``word`` as a word of its own."""
    return re.search(rf"(?<![\w.]){re.escape(word)}(?![\w])", message) is not None


def _catch(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> BaseException | None:
    """Call ``fn`` and return what it raised, or None."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        return exc
    return None


def _init(world_size: int, rank: int, name: str, **kwargs: Any) -> int:
    col.init_collective_group(world_size, rank, backend="gloo", group_name=name, **kwargs)
    return col.get_rank(name)


def _destroy(name: str) -> bool:
    col.destroy_collective_group(name)
    return col.is_group_initialized(name)


def _allreduce_values(rank: int, name: str) -> list[float]:
    x = np.array([rank + 1.0, 10.0 * (rank + 1)])
    col.allreduce(x, name, timeout=timedelta(seconds=20))
    return x.tolist()


def _assert_allreduce_works(actors: list, name: str) -> None:
    """Assert a fresh allreduce on every rank gives the right sum on every rank."""
    n = len(actors)
    total = [sum(r + 1.0 for r in range(n)), sum(10.0 * (r + 1) for r in range(n))]
    assert run_all(actors, _allreduce_values, list(range(n)), [name] * n) == [total] * n


# --------------------------------------------------------------------------- init


def _init_error(kwargs: dict[str, Any], name: str) -> tuple[BaseException | None, bool]:
    """Call init with ``kwargs`` over good arguments; return the error and if a group exists."""
    args = {"world_size": 2, "rank": 0, "backend": "gloo", "group_name": name}
    args.update(kwargs)
    error = _catch(col.init_collective_group, **args)
    return error, col.is_group_initialized(name)


INIT_ERRORS = {
    "rank_negative": ({"rank": -1}, ValueError, "rank"),
    "rank_equals_world_size": ({"rank": 2}, ValueError, "rank"),
    "rank_above_world_size": ({"rank": 7}, ValueError, "rank"),
    "world_size_zero": ({"world_size": 0, "rank": 0}, ValueError, "world_size"),
    "world_size_str": ({"world_size": "4"}, TypeError, "world_size"),
    "backend_unknown": ({"backend": "mpi"}, ValueError, "backend"),
    "group_name_empty": ({"group_name": ""}, ValueError, "group_name"),
    "timeout_negative": ({"timeout": timedelta(seconds=-1)}, ValueError, "timeout"),
    "gloo_timeout_negative_float": ({"gloo_timeout": -0.5}, ValueError, "gloo_timeout"),
    "gloo_timeout_nan": ({"gloo_timeout": float("nan")}, ValueError, "gloo_timeout"),
    "gloo_timeout_bool": ({"gloo_timeout": True}, TypeError, "gloo_timeout"),
    "rank_numpy_float": ({"rank": np.float64(0)}, TypeError, "rank"),
    "group_name_too_long": (
        {"group_name": "g" * (MAX_GROUP_NAME_BYTES + 1)},
        ValueError,
        "group_name",
    ),
    "group_name_too_long_in_utf8": (
        {"group_name": "\u00e9" * (MAX_GROUP_NAME_BYTES // 2 + 1)},
        ValueError,
        "group_name",
    ),
}


@pytest.mark.parametrize("case", list(INIT_ERRORS))
def test_init_rejects_bad_argument(case: str, members: list, no_leaks: None) -> None:
    kwargs, error_type, argument = INIT_ERRORS[case]
    name = unique_name("badinit")
    error, exists = ray.get(members[0].run.remote(_init_error, kwargs, name), timeout=RAY_TIMEOUT_S)
    _assert_argument_error(error, error_type)
    assert _names(str(error), argument), str(error)
    assert not exists


def _longest_name_works(name: str) -> tuple[int, list[float], bool]:
    col.init_collective_group(1, 0, backend="gloo", group_name=name, gloo_timeout=20000.0)
    x = np.ones(2)
    col.allreduce(x, name)
    return col.get_rank(name), x.tolist(), _destroy(name)


def test_the_longest_group_name_the_store_carries_works(members: list, no_leaks: None) -> None:
    name = unique_name("long").ljust(MAX_GROUP_NAME_BYTES, "x")
    got = ray.get(members[0].run.remote(_longest_name_works, name), timeout=RAY_TIMEOUT_S)
    assert got == (0, [1.0, 1.0], False)


def test_init_nccl_says_it_is_unavailable_and_what_to_use(members: list, no_leaks: None) -> None:
    name = unique_name("nccl")
    error, exists = ray.get(
        members[0].run.remote(_init_error, {"backend": "nccl"}, name), timeout=RAY_TIMEOUT_S
    )
    assert type(error) is col.CollectiveError, repr(error)
    assert "nccl" in str(error)
    assert "not available" in str(error)
    assert "gloo" in str(error)
    assert not exists


def test_init_twice_in_one_actor(members: list, no_leaks: None) -> None:
    actors, name = members[:2], unique_name("twice")
    assert run_all(actors, _init, [2, 2], [0, 1], [name, name]) == [0, 1]
    try:
        error = ray.get(actors[0].run.remote(_catch, _init, 2, 0, name), timeout=RAY_TIMEOUT_S)
        assert type(error) is col.CollectiveError, repr(error)
        assert name in str(error)
        assert "already" in str(error)
        _assert_allreduce_works(actors, name)
    finally:
        run_all(actors, _destroy, [name, name])


def test_init_in_the_driver(ray_cluster: None, no_leaks: None) -> None:
    name = unique_name("driver")
    with pytest.raises(col.CollectiveError) as info:
        col.init_collective_group(1, 0, backend="gloo", group_name=name)
    assert type(info.value) is col.CollectiveError
    assert "init_collective_group" in str(info.value)
    assert "actor" in str(info.value)
    assert not col.is_group_initialized(name)


def _solo(backend: Any, name: str) -> tuple[int, int, bool, list[float], bool]:
    col.init_collective_group(1, 0, backend=backend, group_name=name)
    x = np.array([1.5, -2.0])
    col.allreduce(x, name, op="max")
    got = (col.get_rank(name), col.get_collective_group_size(name), col.is_group_initialized(name))
    return (*got, x.tolist(), _destroy(name))


@pytest.mark.parametrize("backend", ["GLOO", "Gloo", col.Backend.GLOO], ids=str)
def test_backend_names_are_case_insensitive(backend: Any, members: list, no_leaks: None) -> None:
    name = unique_name("case")
    got = ray.get(members[0].run.remote(_solo, backend, name), timeout=RAY_TIMEOUT_S)
    assert got == (0, 1, True, [1.5, -2.0], False)


# ------------------------------------------------------------------------ declare


DECLARE_ERRORS = {
    "ranks_repeat": (2, [0, 0], ValueError, "ranks"),
    "ranks_out_of_range": (2, [1, 2], ValueError, "ranks"),
    "ranks_longer_than_actors": (2, [0, 1, 2], ValueError, "ranks"),
    "ranks_shorter_than_actors": (2, [0], ValueError, "ranks"),
    "same_actor_twice": (2, [0, 1], ValueError, "actors"),
}


@pytest.mark.parametrize("case", list(DECLARE_ERRORS))
def test_declare_rejects_bad_argument(case: str, members: list, no_leaks: None) -> None:
    world_size, ranks, error_type, argument = DECLARE_ERRORS[case]
    actors = [members[0], members[0]] if case == "same_actor_twice" else members[:2]
    name = unique_name("baddecl")
    with pytest.raises(error_type) as info:
        col.declare_collective_group(
            actors, world_size=world_size, ranks=ranks, backend="gloo", group_name=name
        )
    _assert_argument_error(info.value, error_type)
    assert _names(str(info.value), argument), str(info.value)
    assert live_groups() == []
    assert ray.get(members[0].run.remote(col.get_rank, name), timeout=RAY_TIMEOUT_S) == -1


def _rank_and_size(name: str) -> tuple[int, int]:
    return col.get_rank(name), col.get_collective_group_size(name)


def test_declare_an_existing_name(members: list, no_leaks: None) -> None:
    actors, name = members[:2], unique_name("dupdecl")
    col.declare_collective_group(
        actors, world_size=2, ranks=[0, 1], backend="gloo", group_name=name
    )
    try:
        with pytest.raises(col.CollectiveError) as info:
            col.declare_collective_group(
                actors[::-1], world_size=2, ranks=[0, 1], backend="gloo", group_name=name
            )
        assert type(info.value) is col.CollectiveError
        assert name in str(info.value)
        assert "exists" in str(info.value)
        # The first declaration is the one that stands.
        got = ray.get([a.run.remote(_rank_and_size, name) for a in actors], timeout=RAY_TIMEOUT_S)
        assert got == [(0, 2), (1, 2)]
    finally:
        col.destroy_collective_group(name)
    assert live_groups() == []


# ---------------------------------------------------------------------------- ops


def _group_not_found(name: str) -> None:
    col.allreduce(np.ones(3), name)


def test_op_on_missing_group_raises_group_not_found(members: list, no_leaks: None) -> None:
    name = unique_name("nosuch")
    with pytest.raises(col.GroupNotFoundError) as info:
        ray.get(members[0].run.remote(_group_not_found, name), timeout=RAY_TIMEOUT_S)
    assert isinstance(info.value, RuntimeError)
    assert isinstance(info.value, RayTaskError)
    assert issubclass(col.GroupNotFoundError, RuntimeError)
    assert name in str(info.value)


def _aliased_outputs(name: str) -> None:
    buf = np.zeros(3)
    col.allgather([buf, buf], np.ones(3), name)


def _overlapping_outputs(name: str) -> None:
    big = np.zeros(5)
    col.allgather([big[0:3], big[2:5]], np.ones(3), name)


def _reducescatter_output_straddles_inputs(name: str) -> None:
    big = np.ones(6)
    col.reducescatter(big[2:5], [big[:3], big[3:]], name)


OP_ERRORS: dict[str, tuple[Callable[[str], Any], type[Exception], str]] = {
    "allgather_list_too_short": (
        lambda g: col.allgather([np.zeros(3)], np.ones(3), g),
        ValueError,
        "tensor_list",
    ),
    "allgather_list_too_long": (
        lambda g: col.allgather([np.zeros(3) for _ in range(3)], np.ones(3), g),
        ValueError,
        "tensor_list",
    ),
    "allgather_shape_mismatch": (
        lambda g: col.allgather([np.zeros(3), np.zeros(4)], np.ones(3), g),
        ValueError,
        "tensor_list[1]",
    ),
    "allgather_dtype_mismatch": (
        lambda g: col.allgather([np.zeros(3, np.float32), np.zeros(3)], np.ones(3), g),
        ValueError,
        "tensor_list[0]",
    ),
    "allgather_torch_dtype_mismatch": (
        lambda g: col.allgather(
            [torch.zeros(3), torch.zeros(3, dtype=torch.int32)], torch.ones(3), g
        ),
        ValueError,
        "tensor_list[1]",
    ),
    "allgather_same_buffer_twice": (_aliased_outputs, ValueError, "tensor_list[1]"),
    "allgather_overlapping_views": (_overlapping_outputs, ValueError, "tensor_list[1]"),
    "allgather_list_item_not_a_tensor": (
        lambda g: col.allgather([np.zeros(3), [0.0, 0.0, 0.0]], np.ones(3), g),
        TypeError,
        "tensor_list[1]",
    ),
    "reducescatter_output_straddles_inputs": (
        _reducescatter_output_straddles_inputs,
        ValueError,
        "tensor_list[0]",
    ),
    "allreduce_grad_leaf": (
        lambda g: col.allreduce(torch.ones(3, requires_grad=True), g),
        ValueError,
        "tensor",
    ),
    "allreduce_strided_grad_leaf": (
        lambda g: col.allreduce(torch.zeros(3, 2).t().requires_grad_(), g),
        ValueError,
        "tensor",
    ),
    "allgather_grad_leaf_in_list": (
        lambda g: col.allgather(
            [torch.zeros(3), torch.zeros(3, requires_grad=True)], torch.ones(3), g
        ),
        ValueError,
        "tensor_list[1]",
    ),
    "allreduce_group_name_too_long": (
        lambda g: col.allreduce(np.ones(3), g * MAX_GROUP_NAME_BYTES),
        ValueError,
        "group_name",
    ),
    "allreduce_op_of_another_enum": (
        lambda g: col.allreduce(np.ones(3), g, op=col.Backend.GLOO),
        ValueError,
        "op",
    ),
    "allreduce_python_list": (lambda g: col.allreduce([1.0, 2.0], g), TypeError, "tensor"),
    "broadcast_python_list": (lambda g: col.broadcast([1.0, 2.0], 0, g), TypeError, "tensor"),
    "allreduce_unsupported_dtype": (
        lambda g: col.allreduce(np.zeros(3, np.complex64), g),
        TypeError,
        "tensor",
    ),
    "reduce_dst_rank_too_big": (lambda g: col.reduce(np.ones(3), 2, g), ValueError, "dst_rank"),
    "reduce_dst_rank_negative": (lambda g: col.reduce(np.ones(3), -1, g), ValueError, "dst_rank"),
    "broadcast_src_rank_too_big": (
        lambda g: col.broadcast(np.ones(3), 2, g),
        ValueError,
        "src_rank",
    ),
    "broadcast_src_rank_negative": (
        lambda g: col.broadcast(np.ones(3), -1, g),
        ValueError,
        "src_rank",
    ),
    "send_dst_rank_too_big": (lambda g: col.send(np.ones(3), 2, g), ValueError, "dst_rank"),
    "recv_src_rank_negative": (lambda g: col.recv(np.ones(3), -1, g), ValueError, "src_rank"),
    "send_to_self": (lambda g: col.send(np.ones(3), 0, g), ValueError, "dst_rank"),
    "recv_from_self": (lambda g: col.recv(np.ones(3), 0, g), ValueError, "src_rank"),
    "allreduce_op_unknown_string": (
        lambda g: col.allreduce(np.ones(3), g, op="MEAN"),
        ValueError,
        "op",
    ),
    "allreduce_op_int": (
        lambda g: col.allreduce(np.ones(3), g, op=0),  # type: ignore[arg-type]
        TypeError,
        "op",
    ),
    "reduce_op_unknown_string": (
        lambda g: col.reduce(np.ones(3), 0, g, op="mean"),
        ValueError,
        "op",
    ),
    "reducescatter_op_int": (
        lambda g: col.reducescatter(np.ones(3), [np.ones(3), np.ones(3)], g, op=3),  # type: ignore[arg-type]
        TypeError,
        "op",
    ),
    "allreduce_timeout_negative": (
        lambda g: col.allreduce(np.ones(3), g, timeout=timedelta(seconds=-1)),
        ValueError,
        "timeout",
    ),
    "allreduce_timeout_zero": (
        lambda g: col.allreduce(np.ones(3), g, timeout=timedelta(0)),
        ValueError,
        "timeout",
    ),
    "allreduce_timeout_number": (
        lambda g: col.allreduce(np.ones(3), g, timeout=5),  # type: ignore[arg-type]
        TypeError,
        "timeout",
    ),
    "barrier_timeout_number": (
        lambda g: col.barrier(g, timeout=5.0),  # type: ignore[arg-type]
        TypeError,
        "timeout",
    ),
    "allreduce_async_op_not_bool": (
        lambda g: col.allreduce(np.ones(3), g, async_op=1),  # type: ignore[arg-type]
        TypeError,
        "async_op",
    ),
    "allreduce_avg_on_integers": (
        lambda g: col.allreduce(np.ones(3, np.int32), g, op=col.ReduceOp.AVG),
        TypeError,
        "AVG",
    ),
    "reduce_band_on_floats": (
        lambda g: col.reduce(np.ones(3), 0, g, op="band"),
        TypeError,
        "BAND",
    ),
    "reducescatter_bxor_on_floats": (
        lambda g: col.reducescatter(torch.ones(3), torch.ones(6), g, op=col.ReduceOp.BXOR),
        TypeError,
        "BXOR",
    ),
    "allgather_flat_wrong_size": (
        lambda g: col.allgather(np.zeros(5), np.ones(3), g),
        ValueError,
        "tensor_list",
    ),
    "allgather_flat_wrong_dtype": (
        lambda g: col.allgather(np.zeros(6, np.float32), np.ones(3), g),
        ValueError,
        "tensor_list",
    ),
    "allgather_flat_not_contiguous": (
        lambda g: col.allgather(np.zeros(12)[::2], np.ones(3), g),
        ValueError,
        "tensor_list",
    ),
    "reducescatter_flat_wrong_size": (
        lambda g: col.reducescatter(np.zeros(3), np.ones(7), g),
        ValueError,
        "tensor_list",
    ),
    "gather_list_on_a_non_root": (
        lambda g: col.gather(np.ones(3), [np.zeros(3), np.zeros(3)], 1, g),
        ValueError,
        "gather_list",
    ),
    "gather_list_missing_on_root": (
        lambda g: col.gather(np.ones(3), None, 0, g),
        ValueError,
        "gather_list",
    ),
    "gather_list_too_short": (
        lambda g: col.gather(np.ones(3), [np.zeros(3)], 0, g),
        ValueError,
        "gather_list",
    ),
    "gather_list_is_the_input": (
        lambda g: (lambda x: col.gather(x, [x, np.zeros(3)], 0, g))(np.ones(3)),
        ValueError,
        "gather_list[0]",
    ),
    "gather_dst_rank_too_big": (
        lambda g: col.gather(np.ones(3), None, 2, g),
        ValueError,
        "dst_rank",
    ),
    "scatter_list_on_a_non_root": (
        lambda g: col.scatter(np.zeros(3), [np.ones(3), np.ones(3)], 1, g),
        ValueError,
        "scatter_list",
    ),
    "scatter_list_missing_on_root": (
        lambda g: col.scatter(np.zeros(3), None, 0, g),
        ValueError,
        "scatter_list",
    ),
    "scatter_list_shape_mismatch": (
        lambda g: col.scatter(np.zeros(3), [np.ones(3), np.ones(4)], 0, g),
        ValueError,
        "scatter_list[1]",
    ),
    "scatter_src_rank_negative": (
        lambda g: col.scatter(np.zeros(3), None, -1, g),
        ValueError,
        "src_rank",
    ),
    "alltoall_lists_too_short": (
        lambda g: col.alltoall([np.zeros(3)], [np.ones(3)], g),
        ValueError,
        "input_tensor_list",
    ),
    "alltoall_dtype_mismatch": (
        lambda g: col.alltoall([np.zeros(3), np.zeros(3, np.int64)], [np.ones(3), np.ones(3)], g),
        ValueError,
        "output_tensor_list[1]",
    ),
    "alltoall_output_is_an_input": (
        lambda g: (lambda x: col.alltoall([x, np.zeros(3)], [np.ones(3), x], g))(np.ones(3)),
        ValueError,
        "output_tensor_list[0]",
    ),
    "alltoall_single_splits_do_not_sum": (
        lambda g: col.alltoall_single(np.zeros(4), np.ones(4), [1, 2], [2, 2], g),
        ValueError,
        "output_split_sizes",
    ),
    "alltoall_single_splits_wrong_length": (
        lambda g: col.alltoall_single(np.zeros(4), np.ones(4), [4], [2, 2], g),
        ValueError,
        "output_split_sizes",
    ),
    "alltoall_single_negative_split": (
        lambda g: col.alltoall_single(np.zeros(4), np.ones(4), [2, 2], [5, -1], g),
        ValueError,
        "input_split_sizes[1]",
    ),
    "alltoall_single_uneven_without_splits": (
        lambda g: col.alltoall_single(np.zeros(4), np.ones(3), group_name=g),
        ValueError,
        "input_split_sizes",
    ),
    "alltoall_single_dtype_mismatch": (
        lambda g: col.alltoall_single(np.zeros(4, np.int32), np.ones(4), group_name=g),
        ValueError,
        "output",
    ),
}


def _op_error(case: str, name: str) -> BaseException | None:
    return _catch(OP_ERRORS[case][0], name)


@pytest.fixture(scope="class")
def pair(members: list) -> Iterator[tuple[list, str]]:
    """Yield one live two-rank group shared by the op error tests, and remove it after."""
    actors, name = members[:2], unique_name("errs")
    assert run_all(actors, _init, [2, 2], [0, 1], [name, name]) == [0, 1]
    yield actors, name
    assert run_all(actors, _destroy, [name, name]) == [False, False]
    assert live_groups() == []


class TestOpArgumentErrors:
    """Each bad op call on rank 0 raises at once; the group stays usable on every rank."""

    @pytest.mark.parametrize("case", list(OP_ERRORS))
    def test_bad_argument(self, case: str, pair: tuple[list, str]) -> None:
        actors, name = pair
        _, error_type, argument = OP_ERRORS[case]
        error = ray.get(actors[0].run.remote(_op_error, case, name), timeout=RAY_TIMEOUT_S)
        _assert_argument_error(error, error_type)
        assert _names(str(error), argument), str(error)
        _assert_allreduce_works(actors, name)


# ----------------------------------------------------------------------- timeouts


def _timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, float]:
    start = time.monotonic()
    error = _catch(fn, *args, **kwargs)
    return error, time.monotonic() - start


def _lonely_allreduce(name: str, timeout: timedelta | None) -> tuple[Any, float]:
    kwargs = {} if timeout is None else {"timeout": timeout}
    return _timed(col.allreduce, np.ones(4, dtype=np.float32), name, **kwargs)


def _assert_timed_out(error: Any, elapsed: float, op: str, name: str, rank: int) -> None:
    assert type(error) is col.CollectiveTimeoutError, repr(error)
    assert isinstance(error, col.CollectiveError)
    assert isinstance(error, TimeoutError)
    message = str(error)
    assert op in message
    assert name in message
    assert f"rank {rank}" in message
    assert OP_TIMEOUT.total_seconds() - 0.5 <= elapsed <= OP_TIMEOUT.total_seconds() + SLACK_S


def test_op_timeout_when_a_rank_never_calls(members: list, no_leaks: None) -> None:
    actors, name = members[:2], unique_name("late")
    assert run_all(actors, _init, [2, 2], [0, 1], [name, name]) == [0, 1]
    try:
        error, elapsed = ray.get(
            actors[0].run.remote(_lonely_allreduce, name, OP_TIMEOUT), timeout=RAY_TIMEOUT_S
        )
        _assert_timed_out(error, elapsed, "allreduce", name, 0)
        assert "ranks that joined it (op 1 of the group): [0]" in str(error), str(error)
        assert "ranks that never joined it: [1] (rank 1 has issued 0 ops)" in str(error)
    finally:
        assert run_all(actors, _destroy, [name, name]) == [False, False]


def _argument_error_on_rank_0(rank: int, name: str) -> tuple[Any, float, str, str]:
    outputs = [np.zeros(3) for _ in range(1 if rank == 0 else 2)]
    error, elapsed = _timed(col.allgather, outputs, np.ones(3), name, timeout=OP_TIMEOUT)
    if rank == 0:
        time.sleep(OP_TIMEOUT.total_seconds() + 3.0)  # until rank 1 has given up
    later = _catch(col.barrier, name, timeout=OP_TIMEOUT)
    return error, elapsed, type(later).__name__, str(later)


def _retry_on_rank_0(rank: int, name: str) -> tuple[str, list[list[float]]]:
    first = ""
    if rank == 0:
        first = type(_catch(col.allgather, [np.zeros(3)], np.ones(3), name)).__name__
    outputs = [np.zeros(3) for _ in range(2)]
    col.allgather(outputs, np.full(3, rank + 1.0), name, timeout=OP_TIMEOUT)
    return first, [o.tolist() for o in outputs]


def test_the_same_op_again_in_time_completes_without_check_args(
    members: list, no_leaks: None
) -> None:
    actors, name = members[:2], unique_name("retry")
    assert run_all(actors, _init, [2, 2], [0, 1], [name, name]) == [0, 1]
    try:
        results = run_all(actors, _retry_on_rank_0, [0, 1], [name, name])
        assert results[0][0] == "ArgumentValueError"
        assert [r[1] for r in results] == [[[1.0] * 3, [2.0] * 3]] * 2
    finally:
        assert run_all(actors, _destroy, [name, name]) == [False, False]


def test_an_argument_error_on_one_rank_without_check_args(members: list, no_leaks: None) -> None:
    """What troubleshooting.md says: the others time out naming the rank, then all are broken."""
    actors, name = members[:2], unique_name("onesided")
    assert run_all(actors, _init, [2, 2], [0, 1], [name, name]) == [0, 1]
    try:
        results = run_all(actors, _argument_error_on_rank_0, [0, 1], [name, name])
        (error0, elapsed0, later0, text0), (error1, elapsed1, later1, text1) = results
        _assert_argument_error(error0, ValueError)
        assert elapsed0 < 1.0
        _assert_timed_out(error1, elapsed1, "allgather", name, 1)
        assert "ranks that never joined it: [0] (rank 0 has issued 0 ops)" in str(error1)
        assert later0 == "CollectiveError" and "rank 1 reported" in text0, text0
        assert later1 == "CollectiveError" and "unusable" in text1, text1
    finally:
        assert run_all(actors, _destroy, [name, name]) == [False, False]


@pytest.mark.parametrize(
    "init_kwargs",
    [{"timeout": OP_TIMEOUT}, {"gloo_timeout": int(OP_TIMEOUT.total_seconds() * 1000)}],
    ids=["timeout", "gloo_timeout"],
)
def test_group_default_timeout_applies_to_ops(
    init_kwargs: dict[str, Any], members: list, no_leaks: None
) -> None:
    actors, name = members[:2], unique_name("deftimeout")
    refs = [a.run.remote(_init, 2, r, name, **init_kwargs) for r, a in enumerate(actors)]
    assert ray.get(refs, timeout=RAY_TIMEOUT_S) == [0, 1]
    try:
        error, elapsed = ray.get(
            actors[0].run.remote(_lonely_allreduce, name, None), timeout=RAY_TIMEOUT_S
        )
        _assert_timed_out(error, elapsed, "allreduce", name, 0)
        assert f"after {OP_TIMEOUT.total_seconds():g}s" in str(error)
    finally:
        assert run_all(actors, _destroy, [name, name]) == [False, False]


def _lonely_init(rank: int, name: str, timeout: timedelta) -> tuple[Any, float, bool]:
    error, elapsed = _timed(
        col.init_collective_group, 2, rank, backend="gloo", group_name=name, timeout=timeout
    )
    return error, elapsed, col.is_group_initialized(name)


@pytest.mark.parametrize("arriving", [1, 0], ids=["only_rank_1", "only_rank_0"])
def test_init_timeout_says_who_arrived(arriving: int, members: list, no_leaks: None) -> None:
    name, timeout = unique_name("lonely"), timedelta(seconds=3)
    error, elapsed, exists = ray.get(
        members[arriving].run.remote(_lonely_init, arriving, name, timeout),
        timeout=RAY_TIMEOUT_S,
    )
    assert type(error) is col.CollectiveTimeoutError, repr(error)
    message = str(error)
    assert "init" in message
    assert name in message
    assert f"rank {arriving}" in message
    assert re.search(rf"arrived[^\[]*\[{arriving}\]", message), message
    assert re.search(rf"did not[^\[]*\[{1 - arriving}\]", message), message
    assert timeout.total_seconds() - 0.5 <= elapsed <= timeout.total_seconds() + SLACK_S
    assert not exists
