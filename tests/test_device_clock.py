"""The stand-in runtime's device clock (``tests/device_clock.py``) keeps CUDA's stream rules."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from tests.device_clock import (
    CAPTURE_ACTIVE,
    CAPTURE_INVALIDATED,
    CAPTURE_NONE,
    CAPTURED_EVENT,
    GLOBAL,
    INVALID_RESOURCE_HANDLE,
    MEMORY,
    NOT_READY,
    STREAM_CAPTURE_IMPLICIT,
    STREAM_CAPTURE_INVALIDATED,
    STREAM_CAPTURE_UNSUPPORTED,
    THREAD_LOCAL,
    ClockTimeoutError,
    CUDARuntimeError,
    DeviceClock,
)


@pytest.fixture
def clock() -> Iterator[DeviceClock]:
    made = DeviceClock(bound_s=2.0)
    try:
        yield made
    finally:
        made.close()


def _in_thread(fn: object) -> object:
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(fn()))  # type: ignore[operator]
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    return out[0]


def test_an_event_completes_only_when_its_stream_reaches_it(clock: DeviceClock) -> None:
    a = clock.create_stream(0)
    event = clock.create_event(0)
    assert clock.query(event) == 0, "a never-recorded event is complete"
    with clock.hold(a):
        clock.record(event, a)
        time.sleep(0.05)
        assert clock.query(event) == NOT_READY
    clock.event_synchronize(event)
    assert clock.query(event) == 0


def test_work_runs_later_in_stream_order(clock: DeviceClock) -> None:
    a = clock.create_stream(0)
    ran: list[int] = []
    with clock.paused():
        for i in range(5):
            clock.submit(a, functools.partial(ran.append, i))
        time.sleep(0.05)
        assert ran == [], "the host runs ahead of the device"
    clock.stream_synchronize(a)
    assert ran == [0, 1, 2, 3, 4]


def test_a_wait_keeps_the_record_it_captured_when_called(clock: DeviceClock) -> None:
    a, b, c = (clock.create_stream(0) for _ in range(3))
    event = clock.create_event(0)
    after: list[str] = []
    with clock.hold(a):
        clock.record(event, a)
        clock.wait_event(b, event)
        clock.submit(b, lambda: after.append("b"))
        clock.record(event, c)  # a later record, reached at once, does not release b
        clock.stream_synchronize(c)
        assert clock.query(event) == 0, "a query reflects the latest record only"
        time.sleep(0.05)
        assert after == [], "b waited on the record captured when it waited"
    clock.stream_synchronize(b)
    assert after == ["b"]


def test_recording_on_a_stream_of_another_device_fails(clock: DeviceClock) -> None:
    on_1 = clock.create_event(1)
    with pytest.raises(CUDARuntimeError) as info:
        clock.record(on_1, 0, device=0)  # stream 0: the legacy stream of the current device
    assert info.value.status == INVALID_RESOURCE_HANDLE
    clock.record(on_1, 0, device=1)
    assert clock.stream_device(0, device=1) == 1
    with pytest.raises(CUDARuntimeError):
        clock.record(on_1, clock.create_stream(0))


def test_a_destroyed_stream_runs_its_work_then_fails(clock: DeviceClock) -> None:
    a = clock.create_stream(0)
    ran: list[int] = []
    with clock.paused():
        clock.submit(a, lambda: ran.append(1))
        clock.destroy_stream(a)
    with pytest.raises(CUDARuntimeError) as info:
        clock.record(clock.create_event(0), a)
    assert info.value.status == INVALID_RESOURCE_HANDLE
    clock.run_until_idle()
    assert ran == [1]
    event = clock.create_event(0)
    clock.destroy_event(event)
    assert clock.query(event) == INVALID_RESOURCE_HANDLE


def test_a_host_wait_is_bounded(clock: DeviceClock) -> None:
    a = clock.create_stream(0)
    gate = clock.gate(a)
    clock.bound_s = 0.5
    start = time.monotonic()
    with pytest.raises(ClockTimeoutError, match="would wait here forever"):
        clock.stream_synchronize(a)
    assert time.monotonic() - start < 5
    gate.open()
    clock.stream_synchronize(a)


def test_a_kernel_takes_its_time_and_pace_slows_every_kernel(clock: DeviceClock) -> None:
    a = clock.create_stream(0)
    event = clock.create_event(0)
    clock.delay(a, 0.2)
    clock.record(event, a)
    assert clock.query(event) == NOT_READY
    start = time.monotonic()
    clock.event_synchronize(event)
    assert time.monotonic() - start >= 0.15
    clock.pace_s = 0.02
    start = time.monotonic()
    for _ in range(5):
        clock.submit(a)
    clock.stream_synchronize(a)
    assert time.monotonic() - start >= 0.09


def test_a_meeting_completes_when_every_party_is_reached(clock: DeviceClock) -> None:
    a, b = clock.create_stream(0), clock.create_stream(1, non_blocking=True)
    seen: list[list[object]] = []
    with clock.hold(b):
        clock.meet(a, "k", 2, "x", effect=seen.append)
        clock.meet(b, "k", 2, "y", device=1, effect=seen.append)
        time.sleep(0.05)
        assert seen == [] and clock.stream_query(a) == NOT_READY
    clock.stream_synchronize(a)
    clock.stream_synchronize(b, device=1)
    assert seen == [["x", "y"]], "the effect runs once, with every payload"


def test_a_meeting_that_disagrees_hangs_until_cancelled(clock: DeviceClock) -> None:
    a, b = clock.create_stream(0), clock.create_stream(0)
    tags = object(), object()
    for s, payload, tag in zip((a, b), ("allreduce", "send"), tags, strict=True):
        clock.meet(s, "k", 2, payload, agree=lambda ps: len(set(ps)) == 1, tag=tag)
    clock.bound_s = 0.5
    with pytest.raises(ClockTimeoutError):
        clock.stream_synchronize(a)
    assert clock.cancel(tags[0]) == 1
    clock.stream_synchronize(a)
    assert clock.stream_query(b) == NOT_READY, "the peer's kernel waits until its own abort"
    clock.cancel(tags[1])
    clock.stream_synchronize(b)


def test_a_query_from_another_thread_invalidates_a_global_capture(clock: DeviceClock) -> None:
    capturing, other = clock.create_stream(0), clock.create_stream(0)
    event = clock.create_event(0)
    clock.begin_capture(capturing, mode=GLOBAL)
    assert clock.capture_status(capturing) == CAPTURE_ACTIVE
    clock.record(event, capturing)
    clock.submit(other)  # queuing on another stream is allowed
    assert _in_thread(lambda: clock.query(clock.create_event(0))) == STREAM_CAPTURE_UNSUPPORTED
    assert clock.capture_status(capturing) == CAPTURE_INVALIDATED
    assert clock.query(event) == CAPTURED_EVENT
    with pytest.raises(CUDARuntimeError) as info:
        clock.end_capture(capturing)
    assert info.value.status == STREAM_CAPTURE_INVALIDATED
    assert clock.capture_status(capturing) == CAPTURE_NONE


def test_a_thread_local_capture_lets_other_threads_query(clock: DeviceClock) -> None:
    capturing = clock.create_stream(0)
    event = clock.create_event(0)
    clock.begin_capture(capturing, mode=THREAD_LOCAL)
    clock.record(event, capturing)
    assert _in_thread(lambda: clock.query(clock.create_event(0))) == 0
    assert _in_thread(lambda: clock.query(event)) == CAPTURED_EVENT
    assert clock.query(event) == STREAM_CAPTURE_UNSUPPORTED, "the capturing thread's own query"
    assert clock.capture_status(capturing) == CAPTURE_INVALIDATED


def test_captured_work_never_runs_and_the_legacy_stream_reports_the_capture(
    clock: DeviceClock,
) -> None:
    blocking = clock.create_stream(0, non_blocking=False)
    ran: list[int] = []
    clock.begin_capture(blocking, mode=THREAD_LOCAL)
    clock.submit(blocking, lambda: ran.append(1), name="captured kernel")
    with pytest.raises(CUDARuntimeError) as info:
        clock.capture_status(0, device=0)
    assert info.value.status == STREAM_CAPTURE_IMPLICIT
    assert clock.capture_status(0, device=1) == CAPTURE_NONE
    assert clock.end_capture(blocking) == ["captured kernel"]
    clock.run_until_idle()
    assert ran == []


def test_copies_move_known_memory_and_leave_unknown_addresses_alone() -> None:
    src = MEMORY.alloc(16)
    dst = MEMORY.alloc(16)
    view = MEMORY.view(src, 16)
    assert view is not None
    view[:] = np.arange(16, dtype=np.uint8)
    assert MEMORY.copy(dst + 4, src, 8)
    assert MEMORY.view(dst, 16).tolist() == [0] * 4 + list(range(8)) + [0] * 4  # type: ignore[union-attr]
    assert not MEMORY.copy(dst, 0x10, 8)
    assert MEMORY.view(dst + 12, 8) is None, "past the end of an allocation"
    MEMORY.free(src)
    MEMORY.free(dst)
