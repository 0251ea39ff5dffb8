"""The call path of the ops on one buffer: checked and built once per key, then looked up.

Ranks are threads meeting on a TCPStore (see ``test_shm.run_cpu``); each rank's
group is registered under a name of its own, and the public functions run on it.
The spy on the checks wraps the real ``check_tensor``. ``test_listcalls`` covers the
other ops.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch

import collective as col
from collective.checks.check_args import CheckedGroup
from collective.groups import launches
from collective.groups.cpu.group import CpuGroup
from collective.ops import calls
from collective.registry import held
from collective.types import (
    ArgumentTypeError,
    ArgumentValueError,
    CollectiveError,
    CpuTransport,
    GroupOptions,
    ReduceOp,
)
from tests.test_shm import run_cpu

_GLOO = GroupOptions(cpu_transport=CpuTransport.GLOO)


@pytest.fixture
def checked_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[int, int]]:
    """Count each thread's calls of the real ``check_tensor`` on the call path, by thread id."""
    counts: dict[int, int] = {}
    real = calls.arguments.check_tensor

    def spy(*args: Any) -> Any:
        me = threading.get_ident()
        counts[me] = counts.get(me, 0) + 1
        return real(*args)

    monkeypatch.setattr(calls.arguments, "check_tensor", spy)
    yield counts


def registered(
    fn: Callable[[str, CpuGroup, int], Any], checked: bool = False
) -> Callable[..., Any]:
    """Wrap ``fn(name, group, rank)`` for ``run_cpu``: the rank's group registered as ``name``."""

    def run(group: CpuGroup, rank: int) -> Any:
        name = f"calls-{uuid.uuid4().hex[:8]}-{rank}"
        wrapped = CheckedGroup(group) if checked else group
        held.create_group(name, lambda: (wrapped, None))
        try:
            return fn(name, group, rank)
        finally:
            held.forget(name)

    return run


@pytest.mark.parametrize("options", [None, _GLOO], ids=["shm", "gloo"])
def test_a_repeated_call_is_checked_once_and_stays_right(
    options: GroupOptions | None, checked_calls: dict[int, int]
) -> None:
    def fn(name: str, group: CpuGroup, rank: int) -> tuple[list[float], int, int]:
        x = np.zeros(3, dtype=np.float32)
        sums = []
        for i in range(5):
            x[:] = rank + i
            col.allreduce(x, name)
            sums.append(float(x[0]))
        for i in range(3):
            col.broadcast(x, i % 2, name)
        return sums, checked_calls[threading.get_ident()], len(group.launches)

    for sums, checked, kept in run_cpu(2, registered(fn), options=options):
        assert sums == [1.0 + 2 * i for i in range(5)]
        assert checked == 3, "one check for allreduce, one per broadcast root"
        assert kept == 3


def test_a_buffer_at_the_same_address_of_another_dtype_or_shape_is_checked_and_built_anew(
    checked_calls: dict[int, int],
) -> None:
    def fn(name: str, group: CpuGroup, rank: int) -> list[Any]:
        memory = np.zeros(4, dtype=np.float32)
        memory[:] = rank + 1
        col.allreduce(memory, name)
        as_ints = memory.view(np.int32)
        as_ints[:] = rank + 1
        col.allreduce(as_ints, name)
        square = as_ints.reshape(2, 2)
        col.allreduce(square, name, ReduceOp.MAX)
        return [memory.view(np.int32).tolist(), checked_calls[threading.get_ident()]]

    for values, checked in run_cpu(2, registered(fn)):
        assert values == [3, 3, 3, 3], "an int32 sum (3), then a max, not a float32 sum"
        assert checked == 3


def test_a_read_only_view_of_a_cached_buffer_is_refused_on_a_strict_group() -> None:
    def fn(name: str, group: CpuGroup, rank: int) -> tuple[float, str]:
        x = np.ones(4)
        col.allreduce(x, name)
        frozen = x.view()
        frozen.setflags(write=False)
        with pytest.raises(ArgumentValueError) as raised:
            col.allreduce(frozen, name)
        col.allreduce(x, name)
        return float(x[0]), str(raised.value)

    for value, message in run_cpu(2, registered(fn), options=GroupOptions(strict_buffers=True)):
        assert value == 4.0
        assert "read-only" in message


def test_arguments_equal_to_cached_ones_but_of_the_wrong_type_are_still_refused() -> None:
    def fn(name: str, group: CpuGroup, rank: int) -> list[str]:
        x = np.ones(2)
        col.allreduce(x, name, async_op=True).wait()  # type: ignore[union-attr]
        col.reduce(x, 1, name)
        col.allreduce(x, name, timeout=timedelta(seconds=5))
        errors = []
        for bad in (
            lambda: col.allreduce(x, name, async_op=1),  # type: ignore[arg-type]
            lambda: col.reduce(x, True, name),
            lambda: col.reduce(x, 1.0, name),  # type: ignore[arg-type]
            lambda: col.allreduce(x, name, timeout=5),  # type: ignore[arg-type]
        ):
            with pytest.raises(ArgumentTypeError) as raised:
                bad()
            errors.append(str(raised.value))
        col.allreduce(x, name, "sum")
        return errors

    for errors in run_cpu(2, registered(fn)):
        assert [e.split(" must")[0] for e in errors] == [
            "async_op",
            "dst_rank",
            "dst_rank",
            "timeout",
        ]


def test_abort_and_destroy_drop_the_launches() -> None:
    def fn(name: str, group: CpuGroup, rank: int) -> tuple[int, int, str]:
        x = np.ones(2)
        col.allreduce(x, name)
        col.reduce(x, 0, name)
        kept = len(group.launches)
        group.abort("stopped by the test")
        after = len(group.launches)
        with pytest.raises(CollectiveError) as raised:
            col.allreduce(x, name)
        return kept, after, str(raised.value)

    for kept, after, message in run_cpu(2, registered(fn)):
        assert kept == 2
        assert after == 0
        assert "stopped by the test" in message


def test_destroy_drops_the_launches() -> None:
    def fn(name: str, group: CpuGroup, rank: int) -> tuple[int, int]:
        col.allreduce(np.ones(2), name)
        kept = len(group.launches)
        group.destroy_group()
        return kept, len(group.launches)

    assert run_cpu(2, registered(fn)) == [(1, 0), (1, 0)]


def test_the_launches_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launches, "LAUNCHES_KEPT", 3)

    def fn(name: str, group: CpuGroup, rank: int) -> tuple[list[float], int]:
        xs = [np.full(n, 1.0) for n in range(1, 6)]
        for x in xs + xs:
            col.allreduce(x, name)
        return [float(x[0]) for x in xs], len(group.launches)

    for values, kept in run_cpu(2, registered(fn)):
        assert values == [4.0] * 5
        assert kept == 3


def test_a_cached_call_on_a_checked_group_still_agrees_with_the_other_ranks() -> None:
    def fn(name: str, group: CpuGroup, rank: int) -> tuple[float, str]:
        x = np.ones(2)
        col.allreduce(x, name)
        with pytest.raises(ArgumentValueError) as raised:
            if rank == 0:
                col.allreduce(x, name)  # a hit: its launch includes the agreement
            else:
                col.allreduce(x, name, ReduceOp.MAX)
        col.allreduce(x, name)
        return float(x[0]), str(raised.value)

    for value, message in run_cpu(2, registered(fn, checked=True)):
        assert value == 4.0
        assert "different arguments" in message


@pytest.mark.parametrize("options", [None, _GLOO], ids=["shm", "gloo"])
def test_repeated_sends_and_receives_are_checked_once(
    options: GroupOptions | None, checked_calls: dict[int, int]
) -> None:
    def fn(name: str, group: CpuGroup, rank: int) -> tuple[list[float], int]:
        x = np.zeros(3)
        got = []
        for i in range(4):
            if rank == 0:
                x[:] = i
                col.send(x, 1, name)
            else:
                col.recv(x, 0, name)
                got.append(float(x[2]))
        return got, checked_calls[threading.get_ident()]

    results = run_cpu(2, registered(fn), options=options)
    assert results == [([], 1), ([0.0, 1.0, 2.0, 3.0], 1)]


def test_a_send_to_itself_is_refused_however_often_another_peer_was_used() -> None:
    def fn(name: str, group: CpuGroup, rank: int) -> str:
        x = np.ones(2)
        peer = 1 - rank
        for _ in range(2):
            (col.send if rank == 0 else col.recv)(x, peer, name)
        with pytest.raises(ArgumentValueError) as raised:
            col.send(x, rank, name)
        return str(raised.value)

    for message in run_cpu(2, registered(fn)):
        assert "must name another rank" in message


def test_new_cpu_buffers_like_the_last_ones_take_its_launch(checked_calls: dict[int, int]) -> None:
    def fn(name: str, group: CpuGroup, rank: int) -> tuple[list[float], int]:
        sums = []
        for i in range(4):
            fresh = torch.full((3,), float(rank + i)) if i % 2 else np.full(3, rank + i * 1.0)
            col.allreduce(fresh, name)
            sums.append(float(fresh[0]))
        return sums, checked_calls[threading.get_ident()]

    for sums, checked in run_cpu(2, registered(fn)):
        assert sums == [1.0, 3.0, 5.0, 7.0]
        assert checked == 2, "one check for the numpy arrays, one for the torch tensors"


@pytest.mark.parametrize(
    ("group_name", "error"),
    [(["g"], ArgumentTypeError), (7, ArgumentTypeError), ("", ArgumentValueError)],
    ids=["unhashable", "not_a_str", "empty"],
)
def test_a_bad_group_name_is_named_and_a_held_group_is_found(
    group_name: Any, error: type[Exception]
) -> None:
    def fn(name: str, group: CpuGroup, rank: int) -> list[float]:
        x = np.ones(2, dtype=np.float32)
        with pytest.raises(error, match="group_name"):
            col.allreduce(x, group_name)
        assert held.get_group_handle(name) is group
        col.allreduce(x, name)
        return x.tolist()

    assert run_cpu(2, registered(fn)) == [[2.0, 2.0], [2.0, 2.0]]


def test_a_first_launch_is_kept_unless_it_raised_had_no_key_or_was_not_to_be_kept() -> None:
    kept = launches.Launches()
    assert kept.run_first("k", lambda args: args * 2, 3) == 6
    assert kept.get("k") is not None

    def fails(args: Any) -> None:
        raise CollectiveError("failed")

    with pytest.raises(CollectiveError):
        kept.run_first("bad", fails, 0)
    kept.run_first(None, lambda args: None, 0)
    kept.run_first("unkept", lambda args: None, 0, keep=False)
    assert [kept.get(k) for k in ("bad", "unkept")] == [None, None]
    assert len(kept) == 1
