"""The cached launch, the watchdog and CUDA-graph capture, checked against cupy's real binding.

A repeated call with the same signature runs no check and describes no buffer: it
makes the NCCL call alone, on the caller's stream, and records the stream's one
marker for the watchdog. The watchdog finds a blocking op that never finishes (an
event that stays "not ready") or an asynchronous NCCL error, aborts the group's
communicators and makes the next call raise. While a stream captures a CUDA graph,
nothing of ours records, queries or synchronises. Ranks run as threads on
``ContractCupy`` (see ``tests/nccl_binding.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest

import collective as col
from collective.frameworks import cuda_buffers
from collective.groups.nccl import launch as nccl_launch
from collective.ops import calls
from collective.registry import held
from collective.types import (
    AllReduceOptions,
    BroadcastOptions,
    CollectiveError,
    CollectiveTimeoutError,
    ReduceOp,
)
from tests.nccl_binding import NOT_READY, DeviceArray, without_checks
from tests.nccl_threads import CONTRACT, Ranks, caller_stream, contract_ranks, on_this_thread

pytestmark = CONTRACT

SHAPE = (4, 8)
SLACK_S = 5.0
"""How long past its timeout the watchdog may take to end a stuck op, on a loaded machine."""
SYNCS = ("eventQuery", "eventSynchronize", "streamSynchronize", "deviceSynchronize")


@pytest.fixture
def ranks(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Ranks]]:
    with contract_ranks(monkeypatch) as make:
        yield make


@pytest.fixture
def described(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Count every buffer description the backend makes."""
    seen: list[Any] = []
    real = cuda_buffers.cuda_buffer

    def counting(x: Any, name: str) -> Any:
        seen.append(x)
        return real(x, name)

    monkeypatch.setattr(cuda_buffers, "cuda_buffer", counting)
    return seen


def _registered(r: Ranks) -> str:
    """Register rank 0's group under its name, so that the public functions reach it."""
    group = r.groups[0]
    held.create_group(r.name, lambda: (group, None))
    on_this_thread(r.cupys[0])
    return r.name


def test_a_repeated_public_call_describes_nothing_and_makes_only_the_nccl_call(
    ranks: Callable[..., Ranks], described: list[Any]
) -> None:
    r = ranks(1)
    name = _registered(r)
    try:
        x = DeviceArray(SHAPE, "float32")
        col.allreduce(x, name, op="max")
        col.broadcast(x, 0, name)
        col.reduce(x, 0, name, op=ReduceOp.MIN)
        first = len(described)
        assert first >= 3
        r.clear()
        for _ in range(5):
            col.allreduce(x, name, op="max")
            col.broadcast(x, 0, name)
            col.reduce(x, 0, name, op=ReduceOp.MIN)
        assert len(described) == first, "a cached call described its buffer again"
        me = threading.get_ident()
        names = [e.name for e in without_checks(r.cupys[0].trace.entries) if e.thread == me]
        ops = ["allReduce", "broadcast", "reduce"]
        hit = [n for n in names if n != "eventQuery"]  # a read of the last op's check
        assert hit == [n for op in ops for n in ("streamIsCapturing", op, "eventRecord")] * 5
        assert names.count("eventQuery") <= 15
    finally:
        col.destroy_collective_group(name)


def test_a_repeated_list_call_describes_nothing_and_finds_its_nccl_launch_once(
    ranks: Callable[..., Ranks], described: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    nccl_keys: list[Any] = []
    real_key = cuda_buffers.launch_key

    def counting_key(x: Any) -> Any:
        nccl_keys.append(x)
        return real_key(x)

    monkeypatch.setattr(cuda_buffers, "launch_key", counting_key)
    r = ranks(1)
    name = _registered(r)
    x, out = DeviceArray(SHAPE, "float32"), DeviceArray(SHAPE, "float32")
    calls_of = {
        "allgather": lambda: col.allgather([out], x, name),
        "allgather_async": lambda: col.allgather([out], x, name, async_op=True).wait(),  # type: ignore[union-attr]
        "reducescatter": lambda: col.reducescatter(out, [x], name, op="max"),
        "gather": lambda: col.gather(x, [out], 0, name),
        "scatter": lambda: col.scatter(out, [x], 0, name),
        "alltoall": lambda: col.alltoall([out], [x], name),
        "allreduce_multigpu": lambda: col.allreduce_multigpu([x], name),
        "allgather_multigpu": lambda: col.allgather_multigpu([[out]], [x], name),
        "reducescatter_multigpu": lambda: col.reducescatter_multigpu([out], [[x]], name),
    }
    me = threading.get_ident()
    try:
        for op, run in calls_of.items():
            run()
            first = len(described)
            nccl_keys.clear()
            r.clear()
            run()
            one = [e.name for e in without_checks(r.cupys[0].trace.entries) if e.thread == me]
            r.clear()
            for _ in range(3):
                run()
            again = [e.name for e in without_checks(r.cupys[0].trace.entries) if e.thread == me]
            assert len(described) == first, f"{op}: a cached call described a buffer again"
            assert nccl_keys == [], f"{op}: a cached call looked its NCCL launch up again"
            polls = ("eventQuery", "check_async_error")  # as often as the device takes
            kept = [n for n in again if n not in polls]
            assert kept == [n for n in one if n not in polls] * 3, op
    finally:
        col.destroy_collective_group(name)


def test_a_list_call_first_made_while_capturing_is_built_again_after_the_capture(
    ranks: Callable[..., Ranks],
) -> None:
    """A launch built during capture has no watchdog marker: no later call may reuse it.

    The op ran once before the capture (on other buffers): its communicators exist.
    """
    r = ranks(1)
    name = _registered(r)
    x, out = DeviceArray(SHAPE, "float32"), DeviceArray(SHAPE, "float32")
    trace, me = r.cupys[0].trace, threading.get_ident()
    try:
        col.allgather([DeviceArray(SHAPE, "float32")], DeviceArray(SHAPE, "float32"), name)
        r.clear()
        trace.capturing.add(caller_stream(0))
        try:
            col.allgather([out], x, name)
        finally:
            trace.capturing.clear()
        assert not [e for e in trace.named("eventRecord") if e.thread == me]
        r.clear()
        col.allgather([out], x, name)
        names = [e.name for e in without_checks(trace.entries) if e.thread == me]
        assert "allGather" in names and "eventRecord" in names, names
    finally:
        col.destroy_collective_group(name)


def test_public_calls_are_checked_once_per_key_and_a_reused_address_of_another_dtype_rebuilds(
    ranks: Callable[..., Ranks], monkeypatch: pytest.MonkeyPatch
) -> None:
    checked: list[Any] = []
    real = calls.arguments.check_tensor

    def spy(group: Any, x: Any, name: str) -> Any:
        checked.append(x)
        return real(group, x, name)

    monkeypatch.setattr(calls.arguments, "check_tensor", spy)
    r = ranks(1)
    name = _registered(r)
    try:
        x = DeviceArray(SHAPE, "float32")
        same = DeviceArray(SHAPE, "int32")
        same.ptr, same.data = x.ptr, SimpleNamespace(ptr=x.ptr, device_id=0)
        for _ in range(3):
            col.allreduce(x, name)
            col.allreduce(x, name, async_op=True).wait()  # type: ignore[union-attr]
            col.allreduce(same, name)
        assert checked == [x, x, same], "a repeated call ran its checks again"
        me = threading.get_ident()
        entries = without_checks(r.cupys[0].trace.entries)
        dtypes = [e.args[3] for e in entries if e.name == "allReduce" and e.thread == me]
        assert dtypes == [7, 7, 2] * 3, "float32, float32 (async), then int32 at the same address"
        assert len(r.groups[0].launches) == 3
    finally:
        col.destroy_collective_group(name)
    assert len(r.groups[0].launches) == 0, "destroy kept the launches"


def test_another_buffer_stream_or_option_builds_its_own_launch(
    ranks: Callable[..., Ranks], monkeypatch: pytest.MonkeyPatch
) -> None:
    r = ranks(1)
    g = r.groups[0]
    x, y = DeviceArray(SHAPE, "float32"), DeviceArray(SHAPE, "float32")
    r.run(lambda _, g: g.allreduce([x], AllReduceOptions()))
    r.run(lambda _, g: g.allreduce([y], AllReduceOptions()))
    r.run(lambda _, g: g.allreduce([x], AllReduceOptions(ReduceOp.MAX)))
    r.run(lambda _, g: g.broadcast([x], BroadcastOptions(root_rank=0)))
    monkeypatch.setattr(cuda_buffers, "cupy_stream", lambda device: 0xBEEF)
    r.cupys[0].gpu.adopt_stream(0xBEEF, 0)
    r.run(lambda _, g: g.allreduce([x], AllReduceOptions()))
    entries = without_checks(r.cupys[0].trace.entries)
    calls = [(e.name, e.args) for e in entries if e.name in ("allReduce", "broadcast")]
    assert calls == [
        ("allReduce", (x.ptr, x.ptr, 32, 7, 0, caller_stream(0))),
        ("allReduce", (y.ptr, y.ptr, 32, 7, 0, caller_stream(0))),
        ("allReduce", (x.ptr, x.ptr, 32, 7, 2, caller_stream(0))),
        ("broadcast", (x.ptr, x.ptr, 32, 7, 0, caller_stream(0))),
        ("allReduce", (x.ptr, x.ptr, 32, 7, 0, 0xBEEF)),
    ]
    assert len(g._launches) == 5


def test_the_cache_is_bounded_and_abort_drops_it(
    ranks: Callable[..., Ranks], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(nccl_launch, "LAUNCHES_KEPT", 4)
    monkeypatch.setattr("collective.groups.nccl.running.LAUNCHES_KEPT", 4)
    r = ranks(1)
    g = r.groups[0]
    xs = [DeviceArray(SHAPE, "float32") for _ in range(6)]
    r.run(lambda _, g: [g.allreduce([x], AllReduceOptions()) for x in xs])
    assert len(g._launches) == 4
    g.abort("stopped by the test")
    assert g._launches == {}
    with pytest.raises(CollectiveError, match="stopped by the test"):
        r.run(lambda _, g: g.allreduce([xs[-1]], AllReduceOptions()))
    assert len(g.launches) == 0


def test_a_blocking_op_that_never_finishes_is_aborted_by_the_watchdog(
    ranks: Callable[..., Ranks],
) -> None:
    """The caller never waits; past the timeout the communicators abort and the next call raises."""
    r = ranks(1)
    x = DeviceArray(SHAPE, "float32")
    r.run(lambda _, g: g.allreduce([x], AllReduceOptions()))
    r.settle()
    r.cupys[0].trace.event_status = lambda handle, real_status: NOT_READY
    timeout = timedelta(seconds=0.5)
    start = time.monotonic()
    r.run(lambda _, g: g.allreduce([x], AllReduceOptions(timeout=timeout)))
    assert time.monotonic() - start < 0.4, "a blocking op waited for its kernel"
    group = r.groups[0]
    while group.error is None and time.monotonic() - start < 0.5 + SLACK_S:
        time.sleep(0.01)
    took = time.monotonic() - start
    assert 0.5 <= took < 0.5 + SLACK_S
    aborted = [e.name for e in r.cupys[0].trace.named("abort", "destroy")]
    assert aborted == ["abort"]
    for _ in range(2):
        with pytest.raises(CollectiveTimeoutError, match=r"allreduce.*unusable") as info:
            r.run(lambda _, g: g.allreduce([x], AllReduceOptions()))
        assert info.value.op == "allreduce" and info.value.group_name == r.name
        assert info.value.timeout == timeout


def test_an_async_nccl_error_after_a_blocking_op_breaks_the_group(
    ranks: Callable[..., Ranks],
) -> None:
    r = ranks(1)
    x = DeviceArray(SHAPE, "float32")
    r.run(lambda _, g: g.allreduce([x], AllReduceOptions()))
    r.settle()
    trace = r.cupys[0].trace
    trace.event_status = lambda handle, real_status: NOT_READY
    trace.let_through = lambda entry: entry.name == "check_async_error"
    r.run(lambda _, g: g.allreduce([x], AllReduceOptions()))
    deadline = time.monotonic() + SLACK_S
    while r.groups[0].error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "invalid argument" in str(r.groups[0].error)
    with pytest.raises(CollectiveError, match="invalid argument"):
        r.run(lambda _, g: g.allreduce([x], AllReduceOptions()))


def test_an_async_wait_raises_the_watchdogs_timeout(ranks: Callable[..., Ranks]) -> None:
    r = ranks(1)
    x = DeviceArray(SHAPE, "float32")
    r.run(lambda _, g: g.allreduce([x], AllReduceOptions()))
    r.settle()
    r.cupys[0].trace.event_status = lambda handle, real_status: NOT_READY
    r.run(lambda _, g: g.allreduce([x], AllReduceOptions(timeout=timedelta(seconds=0.3))))
    deadline = time.monotonic() + SLACK_S
    while r.groups[0].error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(CollectiveTimeoutError):
        r.run(lambda _, g: g.allreduce([x], AllReduceOptions(async_op=True)))


def test_nothing_records_queries_or_syncs_while_a_stream_captures(
    ranks: Callable[..., Ranks],
) -> None:
    """An op captured into a CUDA graph is its NCCL call alone; the watchdog stays quiet."""
    r = ranks(1)
    x = DeviceArray(SHAPE, "float32")
    r.run(lambda _, g: g.allreduce([x], AllReduceOptions()))
    r.settle()
    trace = r.cupys[0].trace
    trace.event_status = lambda handle, real_status: NOT_READY
    short = AllReduceOptions(timeout=timedelta(seconds=0.3))
    r.run(lambda _, g: g.allreduce([x], short))  # pending, its deadline soon
    trace.capturing.add(caller_stream(0))
    r.run(lambda _, g: g.allreduce([x], short))
    trace.clear()
    for _ in range(3):
        r.run(lambda _, g: g.allreduce([x], short))
    time.sleep(0.8)  # watchdog rounds while the capture lasts, past the pending op's deadline
    y = DeviceArray(SHAPE, "float32")  # its launch is built during the capture
    kept = len(r.groups[0]._launches)
    r.run(lambda _, g: g.allreduce([y], short))
    assert len(r.groups[0]._launches) == kept, "a launch built during capture was kept"
    during = [e.name for e in trace.entries]
    assert [n for n in during if n != "streamIsCapturing"] == ["allReduce"] * 4  # no check
    assert not set(during) & set(SYNCS)
    assert r.groups[0].error is None
    trace.capturing.clear()
    trace.event_status = lambda handle, real_status: 0
    r.run(lambda _, g: g.allreduce([x], AllReduceOptions()))
    assert trace.named("eventRecord")
    assert r.groups[0].error is None


def test_repeated_list_and_multigpu_calls_are_checked_once_and_make_the_same_nccl_calls(
    ranks: Callable[..., Ranks], monkeypatch: pytest.MonkeyPatch
) -> None:
    checked: list[Any] = []
    real = calls.arguments.check_timeout

    def spy(timeout: Any) -> Any:  # every op's checks check its timeout once
        checked.append(timeout)
        return real(timeout)

    monkeypatch.setattr(calls.arguments, "check_timeout", spy)
    r = ranks(1)
    name, g = r.name, r.groups[0]
    held.create_group(name, lambda: (g, None))
    try:
        x, outs = DeviceArray(SHAPE, "float64"), [DeviceArray(SHAPE, "float64")]
        a = [DeviceArray(SHAPE, "float64", device=i) for i in range(2)]
        lists = [[DeviceArray(SHAPE, "float64", device=i) for _ in range(2)] for i in range(2)]

        def once(*_: Any) -> None:
            col.allgather(outs, x, name)
            col.reducescatter(x, outs, name)
            col.gather(x, outs, 0, name)
            col.scatter(x, outs, 0, name)
            col.alltoall(outs, [x], name)
            col.barrier(name)
            col.allreduce_multigpu(a, name, op="max")
            col.reduce_multigpu(a, 0, 1, name)
            col.broadcast_multigpu(a, 0, 1, name)
            col.allgather_multigpu(lists, a, name)
            col.reducescatter_multigpu(a, lists, name)

        traces = []  # the barrier allreduces a new one-element buffer each time
        for _ in range(3):
            r.run(once)
            traces.append([(e.name, e.args) for e in without_checks(r.cupys[0].trace.entries)])
            r.clear()
            assert len(checked) == 11, "a repeated call ran its checks again"
        nccl = ("allReduce", "broadcast", "reduce", "allGather", "reduceScatter", "send", "recv")
        made = [
            [
                (n, args if n != "allReduce" or args[2] > 1 else args[2:-1])
                for n, args in t
                if n in nccl
            ]
            for t in traces
        ]
        assert made[0] == made[1] == made[2], "a cached call made other NCCL calls"
        assert len(made[0]) >= 11
    finally:
        col.destroy_collective_group(name)
