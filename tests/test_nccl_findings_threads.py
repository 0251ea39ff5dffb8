"""The GPU review's NCCL findings about threads, captures and teardown, on the stand-ins.

As ``test_nccl_findings.py``: ranks are threads on ``ContractCupy`` over one
``DeviceClock``. ``Trace.misuse`` logs what NCCL forbids (an abort while another thread
is inside a call on the communicator, ops issued in parallel on two communicators of
one GPU, a communicator left to the garbage collector). Each test here failed on the
code before its fix.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from collective.groups.nccl import mismatch
from collective.groups.nccl.group import NCCLGroup
from collective.types import (
    AllReduceOptions,
    ArgumentValueError,
    CollectiveError,
)
from tests.device_clock import GLOBAL, THREAD_LOCAL
from tests.nccl_binding import CheckedCommunicator, ContractCupy, DeviceArray, Entry
from tests.nccl_threads import CONTRACT, Ranks, caller_stream, ranks_fixture

pytestmark = CONTRACT
__all__ = ["ranks_fixture"]  # the fixture ``ranks``

SLACK_S = 4.0

ORDER = "NCCL_LAUNCH_ORDER_IMPLICIT"


def _x() -> DeviceArray:
    return DeviceArray((4,), "float32")


def _warm(r: Ranks) -> None:
    xs = [_x() for _ in r.groups]  # alive until the ops have run
    r.run(lambda rank, g: g.allreduce([xs[rank]], AllReduceOptions()))
    r.settle()


def test_m1_the_watchdog_never_invalidates_another_threads_global_capture(
    ranks: Callable[..., Ranks],
) -> None:
    """M1: an op is pending (its stream held) while another thread captures a graph.

    Before the fix the watchdog's event query, in CUDA's global capture mode, failed
    with ``cudaErrorStreamCaptureUnsupported``, invalidated the user's capture and broke
    the group.
    """
    r = ranks(1)
    _warm(r)
    gpu = r.cupys[0].gpu
    graph_stream = gpu.create_stream(0)
    with gpu.hold(caller_stream(0), 0):
        r.run(lambda _, g: g.allreduce([_x()], AllReduceOptions()))
        gpu.begin_capture(graph_stream, 0, GLOBAL)
        gpu.submit(graph_stream, device=0, name="the user's kernel")
        time.sleep(0.3)  # the watchdog polls the pending op every 20 ms
        captured = gpu.end_capture(graph_stream, 0)
    assert captured == ["the user's kernel"]
    r.settle()
    assert r.groups[0].error is None, str(r.groups[0].error)


def test_m3_an_abort_never_runs_while_another_thread_is_inside_an_nccl_call(
    ranks: Callable[..., Ranks],
) -> None:
    """M3: rank 1 fails while rank 0 polls its async op's NCCL errors in ``Work.wait``.

    Before the fix rank 0's failure watch aborted the communicators while the waiting
    thread was inside ``check_async_error`` on them (NCCL may hang; cupy frees the
    communicator under the call). Now the abort waits for the call to return.
    """
    r = ranks(2)
    _warm(r)
    group = r.groups[0]
    trace = r.cupys[0].trace
    waiter: list[int] = []

    def inside(entry: Entry) -> None:  # stay inside the call until the failure is known
        if entry.name == "check_async_error" and entry.thread in waiter:
            deadline = time.monotonic() + 5
            while group.error is None and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(0.05)

    try:  # rank 1 never makes the call: rank 0's kernel waits for it until the abort
        work = r.run(
            lambda rank, g: g.allreduce([_x()], AllReduceOptions(async_op=True)), ranks=[0]
        )[0]
        trace.on_call = inside

        def wait() -> BaseException | None:
            waiter.append(threading.get_ident())
            try:
                work.wait()
            except CollectiveError as exc:
                return exc
            return None

        outcome: list[BaseException | None] = []
        thread = threading.Thread(target=lambda: outcome.append(wait()))
        thread.start()
        time.sleep(0.1)
        r.groups[1].fail(CollectiveError("stopped by the test"))
        thread.join(20)
        assert not thread.is_alive()
    finally:
        trace.on_call = None
    assert isinstance(outcome[0], CollectiveError) and "stopped by the test" in str(outcome[0])
    assert not r.misuse(), r.misuse()
    assert [e.name for e in trace.named("abort")], "rank 0's communicators were never aborted"


def test_m5_side_checks_are_refused_where_nccl_cannot_order_them(
    ranks: Callable[..., Ranks], monkeypatch: pytest.MonkeyPatch
) -> None:
    """M5: ``COLLECTIVE_NCCL_CHECK=side`` needs NCCL >= 2.26 and NCCL_LAUNCH_ORDER_IMPLICIT=1."""
    monkeypatch.setenv(mismatch.CHECK_ENV, "side")
    monkeypatch.delenv(ORDER, raising=False)
    with pytest.raises(ArgumentValueError, match="NCCL_LAUNCH_ORDER_IMPLICIT=1"):
        ranks(2)
    monkeypatch.setenv(ORDER, "1")
    old = [ContractCupy() for _ in range(2)]
    for cupy in old:
        cupy.trace.nccl_version = 22505
    try:
        with pytest.raises(ArgumentValueError, match=r"NCCL 2\.25\.5"):
            ranks(2, cupys=old)
    finally:
        for cupy in old:
            cupy.clock.close()
    r = ranks(2)
    _warm(r)
    assert all(g.error is None for g in r.groups)


def test_m5_two_groups_of_one_process_never_issue_on_one_gpu_at_once(
    ranks: Callable[..., Ranks],
) -> None:
    """M5: as a group over GPUs issues its leaders' ops and its cross-GPU sends, from two
    threads on two communicators of one GPU. Before the fix both threads were inside
    NCCL calls on that GPU at once, which NCCL's thread-safety rules forbid.
    """
    first = ranks(2)
    second = ranks(2, cupys=first.cupys)  # the same processes
    for r in (first, second):
        _warm(r)
    for cupy in first.cupys:
        cupy.trace.pause_s = 0.002

    def loop(group: NCCLGroup) -> None:  # each group's ops on its own comm stream
        works = [group.allreduce([_x()], AllReduceOptions(async_op=True)) for _ in range(15)]
        for work in works:
            work.wait()

    def both(rank: int, _: Any) -> None:
        threads = [threading.Thread(target=loop, args=(r.groups[rank],)) for r in (first, second)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)

    first.run(both)
    for cupy in first.cupys:
        cupy.trace.pause_s = 0.0
    first.settle()
    second.settle()
    assert not first.misuse(), first.misuse()[:3]


def test_l2_an_async_op_or_a_first_op_inside_a_capture_is_refused(
    ranks: Callable[..., Ranks],
) -> None:
    """L2: before the fix an async op was issued into the capture (its events then fail
    every query) and a first op made its communicators inside it."""
    r = ranks(1)
    gpu = r.cupys[0].gpu

    def captured(rank: int, g: Any, async_op: bool) -> None:
        gpu.begin_capture(caller_stream(0), 0, THREAD_LOCAL)
        try:
            g.allreduce([_x()], AllReduceOptions(async_op=async_op))
        finally:
            gpu.end_capture(caller_stream(0), 0)

    with pytest.raises(ArgumentValueError, match="before the capture"):
        r.run(lambda rank, g: captured(rank, g, False))
    assert not r.cupys[0].trace.named("NcclCommunicator"), "made inside the capture"
    _warm(r)
    with pytest.raises(ArgumentValueError, match="async_op=True cannot be captured"):
        r.run(lambda rank, g: captured(rank, g, True))
    _warm(r)
    assert r.groups[0].error is None


def test_l4_an_invalidated_capture_fails_the_op_clearly_and_the_watchdog_lives_on(
    ranks: Callable[..., Ranks],
) -> None:
    """L4: cupy's ``streamIsCapturing`` raises a plain RuntimeError for an invalidated
    capture. Before the fix the op raised it bare, and the watchdog thread died of it:
    no op of a patrolled group ever timed out after.
    """
    r = ranks(1)
    _warm(r)
    gpu, trace = r.cupys[0].gpu, r.cupys[0].trace
    half = AllReduceOptions(timeout=timedelta(seconds=0.5))
    with gpu.hold(caller_stream(0), 0):
        r.run(lambda _, g: g.allreduce([_x()], AllReduceOptions()))  # pending: patrolled

        def capture_then_op(rank: int, g: Any) -> None:
            gpu.begin_capture(caller_stream(0), 0, GLOBAL)
            g.allreduce([_x()], AllReduceOptions())  # captured: the watchdog now asks
            assert gpu.query(gpu.create_event(0)) != 0  # no: another thread's query
            time.sleep(0.2)

        r.run(capture_then_op)
        with pytest.raises(ArgumentValueError, match="invalidated"):
            r.run(lambda _, g: g.allreduce([_x()], AllReduceOptions()))
        with pytest.raises(RuntimeError):
            gpu.end_capture(caller_stream(0), 0)
    trace.event_status = lambda handle, real_status: 600  # the next op never finishes
    r.run(lambda _, g: g.allreduce([_x()], half))
    start = time.monotonic()
    while r.groups[0].error is None and time.monotonic() - start < 0.5 + SLACK_S:
        time.sleep(0.01)
    assert r.groups[0].error is not None, "the watchdog no longer patrols"
    trace.event_status = None


def test_l6_a_communicator_nobody_took_is_aborted_not_left_to_the_garbage_collector(
    ranks: Callable[..., Ranks], monkeypatch: pytest.MonkeyPatch
) -> None:
    """L6: cupy's ``__dealloc__`` calls ``ncclCommDestroy``, which every rank must call.

    The second of a rank's two communicators fails to form: before the fix the first
    was dropped, and the garbage collector destroyed it.
    """
    made = CheckedCommunicator.__init__

    def second_fails(self: CheckedCommunicator, *args: Any) -> None:
        if args[2] == 1:
            raise RuntimeError("the stand-in's NCCL refused NCCL rank 1")
        made(self, *args)

    monkeypatch.setattr(CheckedCommunicator, "__init__", second_fails)
    r = ranks(1)
    with pytest.raises(CollectiveError, match="refused NCCL rank 1"):
        r.run(lambda _, g: g.allreduce([_x(), DeviceArray((4,), "float32", 1)], _options()))
    deadline = time.monotonic() + 5
    while not r.cupys[0].trace.named("abort") and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.02)
    gc.collect()
    assert not r.misuse(), r.misuse()
    assert [e.comm.nccl_rank for e in r.cupys[0].trace.named("abort") if e.comm] == [0]


def _options() -> AllReduceOptions:
    return AllReduceOptions(timeout=timedelta(seconds=5))
