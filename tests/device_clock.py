"""The stand-in runtime's device clock: streams that queue, events that complete when reached.

A real GPU runs what the host queues later, in stream order: ``cudaEventQuery`` says
not-ready until the event's stream reaches it, a stream that waits on an event waits
for the work that event captured, and the host runs ahead. The stand-ins of this test
suite (``nccl_binding`` for NCCL, ``shared_gpu_standin`` for the shared-GPU transport)
run their streams on a ``DeviceClock`` so that tests see that asynchrony:

- A **stream** is a queue. One thread per clock, the device, runs the item at the head
  of each stream once it is ready, in the order the host queued them; streams never
  wait for each other unless told to (``wait_event``). Stream 0 (and 1,
  ``cudaStreamLegacy``) is the legacy stream of the device current on the calling
  thread, as in CUDA; ``adopt_stream`` registers a handle made elsewhere (torch's or
  cupy's current stream).
- An **event** completes when its stream reaches the record: ``query`` returns
  ``NOT_READY`` (600) until then. Recording again overwrites what the event captured;
  a ``wait_event`` waits for the record captured *when it is called*, and a later
  record does not move it (CUDA: "captures the contents of stream at the time of this
  call"). A never-recorded event is complete. ``record`` on a stream of another
  device than the event's fails with ``cudaErrorInvalidResourceHandle`` (400), as it
  does on any destroyed or unknown stream or event.
- **Work** is an ``Item``: ``submit`` queues a callable (a copy, a kernel), ``delay`` a
  kernel that runs for some seconds of wall time, ``gate`` one that runs when the test
  opens it, ``meet`` one that completes when ``parties`` items of one key have all been
  reached on their streams (how the NCCL stand-in models a collective: each rank's
  kernel waits for the others), and ``cancel`` ends the items of a tag at once (as
  ``ncclCommAbort`` ends a stuck kernel). ``pace_s`` makes every kernel take at least
  that long, for a device slower than the host.
- **Capture**: ``begin_capture`` makes a stream capture (its work is kept, not run;
  an event recorded on it reports ``cudaErrorCapturedEvent``, 907, when queried).
  While a capture in global mode is active, an unsafe call (an event or stream query,
  a synchronize) from any other thread, or from the capturing thread itself unless its
  mode is relaxed, fails with ``cudaErrorStreamCaptureUnsupported`` (900) and
  invalidates the capture: ``capture_status`` then says ``CAPTURE_INVALIDATED`` (cupy's
  ``streamIsCapturing`` raises a plain ``RuntimeError`` for it) and ``end_capture``
  fails with 901. Asking about the legacy stream while a blocking stream of its device
  captures fails with ``cudaErrorStreamCaptureImplicit`` (906).
- **Waits** of the host (``stream_synchronize``, ``event_synchronize``,
  ``device_synchronize``, ``run_until_idle``) are bounded by ``bound_s``: where a real
  GPU would wait forever, the clock raises ``ClockTimeoutError`` (an ``AssertionError``, so
  that the code under test never takes it for a CUDA error) and the test fails.

``MEMORY`` is the stand-in device memory: host bytes at real addresses, which copies
and collectives on the clock read and write (an address it does not know is left
alone, never dereferenced).

Errors are cupy's ``CUDARuntimeError`` with CUDA's status, so the code under test
sees what cupy would raise.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from cupy.cuda.runtime import CUDARuntimeError

SUCCESS = 0
INVALID_VALUE = 1
INVALID_DEVICE = 101
INVALID_RESOURCE_HANDLE = 400
NOT_READY = 600
STREAM_CAPTURE_UNSUPPORTED = 900
STREAM_CAPTURE_INVALIDATED = 901
STREAM_CAPTURE_IMPLICIT = 906
CAPTURED_EVENT = 907
"""CUDA's status codes (``cudaError_t``) that the clock returns or raises."""

CAPTURE_NONE, CAPTURE_ACTIVE, CAPTURE_INVALIDATED = 0, 1, 2
"""``cudaStreamCaptureStatus``."""

GLOBAL, THREAD_LOCAL, RELAXED = 0, 1, 2
"""``cudaStreamCaptureMode``."""

LEGACY_HANDLES = (0, 1)
"""Handles that name the current device's legacy stream: NULL and ``cudaStreamLegacy``."""

_handles = itertools.count(0xD000, 0x10)


class ClockTimeoutError(AssertionError):
    """A host wait on the clock passed its bound: a real GPU would wait there forever."""


_thread_modes: dict[int, int] = {}
"""Each thread's capture mode (``cuThreadExchangeStreamCaptureMode``), the process's
driver state: a thread not in it is in global mode."""


def exchange_capture_mode(mode: int) -> int:
    """Set the calling thread's capture mode (``GLOBAL``, ``THREAD_LOCAL``, ``RELAXED``).

    Returns the previous one, as ``cuThreadExchangeStreamCaptureMode`` does.
    """
    me = threading.get_ident()
    old = _thread_modes.get(me, GLOBAL)
    _thread_modes[me] = mode
    return old


def bounded_wait(
    cond: threading.Condition, done: Callable[[], bool], what: str, bound_s: float
) -> None:
    """Wait on ``cond`` (held) until ``done()``; raise ``ClockTimeoutError`` after ``bound_s``.

    ``what`` says what never happened, for where a real GPU or NCCL would wait forever.
    """
    deadline = time.monotonic() + bound_s
    while not done():
        left = deadline - time.monotonic()
        if left <= 0:
            raise ClockTimeoutError(
                f"{what} within {bound_s} s: a real GPU would wait here forever"
            )
        cond.wait(min(left, 0.05))


def cuda_error(status: int) -> CUDARuntimeError:
    """Return cupy's error for CUDA status ``status``."""
    return CUDARuntimeError(status)


@dataclass(eq=False)
class Item:
    """One piece of work on a stream; the device runs it once it is reached and ready."""

    name: str
    run: Callable[[], None] | None = None
    ready: Callable[[], bool] | None = None
    """Whether the item may run, once reached (evaluated under the clock's lock)."""
    reach: Callable[[Item], None] | None = None
    """Called once, under the clock's lock, when the item first heads its stream."""
    tag: Any = None
    """What ``cancel`` ends the item by (the NCCL stand-in: its communicator)."""
    kernel: bool = False
    """Whether ``pace_s`` applies: a kernel or a copy, not a record or a wait."""
    reached_at: float | None = None
    done: bool = False
    cancelled: bool = False


@dataclass(eq=False)
class _Stream:
    handle: int
    device: int
    blocking: bool
    process: int = 0
    legacy: bool = False
    queue: deque[Item] = field(default_factory=deque)
    queued: int = 0
    finished: int = 0
    held: int = 0
    destroyed: bool = False
    capture: _Capture | None = None


@dataclass(eq=False)
class _Event:
    handle: int
    device: int
    records: int = 0
    reached: set[int] = field(default_factory=set)
    captured: bool = False
    destroyed: bool = False

    def complete(self, generation: int | None = None) -> bool:
        gen = self.records if generation is None else generation
        return gen == 0 or gen in self.reached


@dataclass(eq=False)
class _Capture:
    mode: int
    thread: int
    status: int = CAPTURE_ACTIVE
    items: list[str] = field(default_factory=list)


@dataclass(eq=False)
class _Meeting:
    parties: int
    agree: Callable[[list[Any]], bool]
    effect: Callable[[list[Any]], None] | None
    arrived: dict[int, Any] = field(default_factory=dict)
    complete: bool = False
    ran: bool = False
    left: int = 0
    """How many of its items have yet to run."""


class Gate:
    """An item that runs when the test opens it: a kernel of unknown length."""

    def __init__(self, clock: DeviceClock) -> None:
        self._clock = clock
        self.opened = False

    def open(self) -> None:
        """Let the item run."""
        with self._clock._cond:
            self.opened = True
            self._clock._cond.notify_all()


class DeviceClock:
    """One stand-in machine's devices, run by one thread; see the module docstring."""

    def __init__(self, devices: int = 4, *, bound_s: float = 20.0, pace_s: float = 0.0) -> None:
        """Start the device thread for ``devices`` GPUs; host waits give up after ``bound_s``."""
        self.devices = devices
        self.bound_s = bound_s
        self.pace_s = pace_s
        """The least time every kernel takes, from when its stream reaches it."""
        self._cond = threading.Condition()
        self._streams: dict[int, _Stream] = {}
        self._legacy: dict[tuple[int, int], int] = {}
        self._events: dict[int, _Event] = {}
        self._meetings: dict[Any, _Meeting] = {}
        self._paused = 0
        self._closed = False
        self.ran: list[str] = []
        """The names of the items run, in order (the last 10,000)."""
        self._thread = threading.Thread(target=self._device, name="device-clock", daemon=True)
        self._thread.start()

    # --- handles -------------------------------------------------------------------------

    def _device_ok(self, device: int) -> None:
        if not 0 <= device < self.devices:
            raise cuda_error(INVALID_DEVICE)

    def create_stream(self, device: int, *, non_blocking: bool = True) -> int:
        """Return a new stream of GPU ``device``."""
        self._device_ok(device)
        return self.adopt_stream(next(_handles), device, non_blocking=non_blocking)

    def adopt_stream(self, handle: int, device: int, *, non_blocking: bool = False) -> int:
        """Register ``handle``, made elsewhere, as a stream of GPU ``device``; return it."""
        with self._cond:
            found = self._streams.get(handle)
            if found is None or found.destroyed:
                self._streams[handle] = _Stream(handle, device, not non_blocking)
            elif found.device != device:
                raise ValueError(f"stream {handle:#x} is a stream of GPU {found.device}")
        return handle

    def legacy(self, device: int, process: int = 0) -> int:
        """Return the handle of GPU ``device``'s legacy stream in ``process`` (see ``process``)."""
        self._device_ok(device)
        with self._cond:
            handle = self._legacy.get((process, device))
            if handle is None:
                handle = self._legacy[(process, device)] = next(_handles)
                self._streams[handle] = _Stream(handle, device, True, process, legacy=True)
            return handle

    def process(self) -> Process:
        """Return a new process on this machine: its own stream handles, the same GPUs."""
        return Process(self)

    def _stream(self, stream: int, device: int) -> _Stream:
        """Return the stream ``stream`` names with ``device`` current (lock held)."""
        if stream in LEGACY_HANDLES:
            stream = self.legacy(device)  # the condition's lock is re-entrant
        found = self._streams.get(stream)
        if found is None or found.destroyed:
            raise cuda_error(INVALID_RESOURCE_HANDLE)
        return found

    def stream_device(self, stream: int, device: int = 0) -> int:
        """Return the GPU of ``stream`` (the legacy stream: of ``device``)."""
        with self._cond:
            return self._stream(stream, device).device

    def destroy_stream(self, stream: int, device: int = 0) -> None:
        """Destroy ``stream``: its queued work still runs; the handle then fails (400)."""
        with self._cond:
            found = self._stream(stream, device)
            if found.legacy:
                raise cuda_error(INVALID_RESOURCE_HANDLE)
            found.destroyed = True

    def create_event(self, device: int) -> int:
        """Return a new event of GPU ``device``, never recorded (so complete)."""
        self._device_ok(device)
        handle = next(_handles)
        with self._cond:
            self._events[handle] = _Event(handle, device)
        return handle

    def destroy_event(self, event: int) -> None:
        """Destroy ``event``; the handle then fails (400)."""
        with self._cond:
            self._event(event).destroyed = True

    def _event(self, event: int) -> _Event:
        found = self._events.get(event)
        if found is None or found.destroyed:
            raise cuda_error(INVALID_RESOURCE_HANDLE)
        return found

    def event_device(self, event: int) -> int:
        """Return the GPU of ``event``."""
        with self._cond:
            return self._event(event).device

    # --- stream operations ---------------------------------------------------------------

    def _queue(self, s: _Stream, item: Item) -> Item:
        """Queue ``item`` on ``s``, or keep it in the capture (lock held)."""
        if s.capture is not None:
            s.capture.items.append(item.name)
            item.done = True
            return item
        s.queue.append(item)
        s.queued += 1
        self._cond.notify_all()
        return item

    def submit(
        self,
        stream: int,
        run: Callable[[], None] | None = None,
        *,
        device: int = 0,
        name: str = "work",
        ready: Callable[[], bool] | None = None,
        reach: Callable[[Item], None] | None = None,
        tag: Any = None,
        kernel: bool = True,
    ) -> Item:
        """Queue ``run`` on ``stream`` (with ``device`` current); the device runs it later."""
        item = Item(name, run, ready, reach, tag, kernel)
        with self._cond:
            return self._queue(self._stream(stream, device), item)

    def record(self, event: int, stream: int, device: int = 0) -> None:
        """Record ``event`` on ``stream``: it completes when the stream reaches this point."""
        with self._cond:
            s, e = self._stream(stream, device), self._event(event)
            if e.device != s.device:
                raise cuda_error(INVALID_RESOURCE_HANDLE)
            if s.capture is not None:
                e.captured = True
                s.capture.items.append(f"record {event:#x}")
                return
            e.records += 1
            e.captured = False
            generation = e.records

            def reached() -> None:
                with self._cond:
                    e.reached.add(generation)

            self._queue(s, Item(f"record {event:#x}", reached, kernel=False))

    def wait_event(self, stream: int, event: int, device: int = 0) -> None:
        """Make ``stream`` wait for the record of ``event`` captured now (later ones aside)."""
        with self._cond:
            s, e = self._stream(stream, device), self._event(event)
            generation = e.records
            item = Item(f"wait {event:#x}", ready=lambda: e.complete(generation), kernel=False)
            self._queue(s, item)

    def delay(self, stream: int, seconds: float, *, device: int = 0, tag: Any = None) -> Item:
        """Queue a kernel that runs for ``seconds`` once its stream reaches it."""

        item = Item(f"kernel {seconds}s", tag=tag, kernel=True)

        def ready() -> bool:
            reached = item.reached_at
            return reached is not None and time.monotonic() >= reached + seconds

        item.ready = ready
        with self._cond:
            return self._queue(self._stream(stream, device), item)

    def gate(self, stream: int, *, device: int = 0) -> Gate:
        """Queue a kernel that runs when the returned ``Gate`` is opened."""
        gate = Gate(self)
        self.submit(stream, device=device, name="gate", ready=lambda: gate.opened)
        return gate

    def meet(
        self,
        stream: int,
        key: Any,
        parties: int,
        payload: Any,
        *,
        device: int = 0,
        agree: Callable[[list[Any]], bool] = lambda payloads: True,
        effect: Callable[[list[Any]], None] | None = None,
        tag: Any = None,
        name: str = "meet",
    ) -> Item:
        """Queue a kernel that completes once ``parties`` items of ``key`` have been reached.

        When the last arrives, ``agree(payloads)`` (in arrival order) says whether they
        match: if not, none ever completes (a real collective of mismatched calls hangs)
        until ``cancel`` ends it. ``effect(payloads)`` runs once, on the device, before
        the first of them completes.
        """

        def reach(item: Item) -> None:
            meeting = self._meetings.get(key)
            if meeting is None:
                meeting = self._meetings[key] = _Meeting(parties, agree, effect, left=parties)
            meeting.arrived[id(item)] = payload
            if len(meeting.arrived) == meeting.parties:
                meeting.complete = meeting.agree(list(meeting.arrived.values()))

        def ready() -> bool:
            meeting = self._meetings.get(key)
            return meeting is not None and meeting.complete

        def run() -> None:
            with self._cond:
                meeting = self._meetings[key]
                first, meeting.ran = not meeting.ran, True
                meeting.left -= 1
                if meeting.left == 0:
                    del self._meetings[key]
            if first and meeting.effect is not None:
                meeting.effect(list(meeting.arrived.values()))

        return self.submit(stream, run, device=device, name=name, ready=ready, reach=reach, tag=tag)

    def cancel(self, tag: Any) -> int:
        """End every queued item of ``tag`` at once, without running it; return how many."""
        ended = 0
        with self._cond:
            for s in self._streams.values():
                for item in s.queue:
                    if item.tag is tag and not item.cancelled:
                        item.cancelled = True
                        ended += 1
            self._cond.notify_all()
        return ended

    # --- host queries and waits ----------------------------------------------------------

    def _unsafe(self, call: str) -> None:
        """Fail an unsafe call made during a capture that forbids it; invalidate that capture."""
        me = threading.get_ident()
        mine = _thread_modes.get(me, GLOBAL)
        if mine == RELAXED:
            return
        hit = [
            c
            for s in self._streams.values()
            if (c := s.capture) is not None and c.status == CAPTURE_ACTIVE
            if (c.mode == GLOBAL and c.thread != me and mine == GLOBAL)
            or (c.thread == me and c.mode != RELAXED)
        ]
        if hit:
            for capture in hit:
                capture.status = CAPTURE_INVALIDATED
            raise cuda_error(STREAM_CAPTURE_UNSUPPORTED)

    def query(self, event: int) -> int:
        """Return ``cudaEventQuery``'s status for ``event``: 0, ``NOT_READY`` or an error."""
        with self._cond:
            try:
                self._unsafe("eventQuery")
                e = self._event(event)
            except CUDARuntimeError as exc:
                return int(exc.status)
            if e.captured:
                return CAPTURED_EVENT
            return SUCCESS if e.complete() else NOT_READY

    def stream_query(self, stream: int, device: int = 0) -> int:
        """Return ``cudaStreamQuery``'s status: 0 once all work queued on it has run."""
        with self._cond:
            try:
                self._unsafe("streamQuery")
                s = self._stream(stream, device)
            except CUDARuntimeError as exc:
                return int(exc.status)
            return SUCCESS if s.finished == s.queued else NOT_READY

    def _wait(self, done: Callable[[], bool], what: str) -> None:
        bounded_wait(self._cond, done, f"{what} did not finish", self.bound_s)

    def stream_synchronize(self, stream: int, device: int = 0) -> None:
        """Wait (bounded) until everything queued on ``stream`` so far has run."""
        with self._cond:
            self._unsafe("streamSynchronize")
            s = self._stream(stream, device)
            target = s.queued
            self._wait(lambda: s.finished >= target, f"stream {stream:#x}")

    def event_synchronize(self, event: int) -> None:
        """Wait (bounded) until ``event``'s latest record has been reached."""
        with self._cond:
            self._unsafe("eventSynchronize")
            e = self._event(event)
            if e.captured:
                raise cuda_error(CAPTURED_EVENT)
            generation = e.records
            self._wait(lambda: e.complete(generation), f"event {event:#x}")

    def device_synchronize(self, device: int) -> None:
        """Wait (bounded) until everything queued on GPU ``device`` so far has run."""
        with self._cond:
            self._unsafe("deviceSynchronize")
            targets = [(s, s.queued) for s in self._streams.values() if s.device == device]
            self._wait(lambda: all(s.finished >= n for s, n in targets), f"GPU {device}")

    def run_until_idle(self, timeout_s: float | None = None) -> None:
        """Wait (bounded) until no stream holds queued work."""
        with self._cond:
            bound, self.bound_s = self.bound_s, timeout_s or self.bound_s
            try:
                self._wait(self.idle, "the queued work")
            finally:
                self.bound_s = bound

    def idle(self) -> bool:
        """Return whether every stream's queue is empty."""
        return all(not s.queue for s in list(self._streams.values()))

    # --- capture -------------------------------------------------------------------------

    def begin_capture(self, stream: int, device: int = 0, mode: int = GLOBAL) -> None:
        """Make ``stream`` capture a graph, started by the calling thread in ``mode``."""
        with self._cond:
            s = self._stream(stream, device)
            if s.legacy or s.capture is not None:
                raise cuda_error(STREAM_CAPTURE_UNSUPPORTED)
            s.capture = _Capture(mode, threading.get_ident())

    def end_capture(self, stream: int, device: int = 0) -> list[str]:
        """End ``stream``'s capture; return the names of the work it captured.

        Raises:
            CUDARuntimeError: 901 if the capture was invalidated meanwhile.

        """
        with self._cond:
            s = self._stream(stream, device)
            capture, s.capture = s.capture, None
            if capture is None:
                raise cuda_error(INVALID_VALUE)
            if capture.status == CAPTURE_INVALIDATED:
                raise cuda_error(STREAM_CAPTURE_INVALIDATED)
            return capture.items

    def capture_status(self, stream: int, device: int = 0) -> int:
        """Return ``cudaStreamIsCapturing``'s status for ``stream``.

        Raises:
            CUDARuntimeError: 906 for the legacy stream while a blocking stream of its
                device captures; 400 for an unknown or destroyed stream.

        """
        with self._cond:
            s = self._stream(stream, device)
            if s.legacy and any(
                o.capture is not None
                and o.blocking
                and (o.device, o.process) == (s.device, s.process)
                for o in self._streams.values()
            ):
                raise cuda_error(STREAM_CAPTURE_IMPLICIT)
            return CAPTURE_NONE if s.capture is None else s.capture.status

    # --- the device ----------------------------------------------------------------------

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Run nothing while inside: the host runs ahead of the device."""
        with self._cond:
            self._paused += 1
        try:
            yield
        finally:
            with self._cond:
                self._paused -= 1
                self._cond.notify_all()

    @contextmanager
    def hold(self, stream: int, device: int = 0) -> Iterator[None]:
        """Run nothing on ``stream`` while inside (its head is not even reached)."""
        with self._cond:
            s = self._stream(stream, device)
            s.held += 1
        try:
            yield
        finally:
            with self._cond:
                s.held -= 1
                self._cond.notify_all()

    def close(self) -> None:
        """Stop the device thread; queued work is dropped."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(5)

    def _next(self, now: float) -> tuple[_Stream, Item] | None:
        """Return a stream whose head may run now, reaching new heads (lock held)."""
        if self._paused:
            return None
        for s in list(self._streams.values()):
            if not s.queue or s.held:
                continue
            item = s.queue[0]
            if item.reached_at is None:
                item.reached_at = now
                if item.reach is not None and not item.cancelled:
                    item.reach(item)
            if item.cancelled:
                return s, item
            if item.kernel and now < item.reached_at + self.pace_s:
                continue
            if item.ready is None or item.ready():
                return s, item
        return None

    def _device(self) -> None:
        with self._cond:
            while not self._closed:
                found = self._next(time.monotonic())
                if found is None:
                    busy = any(s.queue for s in self._streams.values())
                    self._cond.wait(0.003 if busy and not self._paused else 1.0)
                    continue
                s, item = found
                if not item.cancelled and item.run is not None:
                    self._cond.release()
                    try:
                        item.run()
                    finally:
                        self._cond.acquire()
                s.queue.popleft()
                s.finished += 1
                item.done = True
                self.ran.append(item.name)
                if len(self.ran) > 10_000:
                    del self.ran[:5_000]
                self._cond.notify_all()


_processes = itertools.count(1)


class Process:
    """One process's view of a ``DeviceClock``: its own stream handles on shared GPUs.

    Ranks of a test that stand for separate processes each take one: stream 0 is this
    process's legacy stream of the current device, and ``adopt_stream`` maps a handle
    the process sees (torch's or cupy's current stream) to a stream of its own, so two
    processes that both see handle ``h`` queue on different streams, as on a real
    machine. Events, memory and everything else are the machine's, shared (as CUDA IPC
    shares them). The methods are the clock's, taking this process's handles.
    """

    def __init__(self, clock: DeviceClock) -> None:
        """Start a process on ``clock`` with no stream of its own yet."""
        self.clock = clock
        self.id = next(_processes)
        self._aliases: dict[int, int] = {}

    def _s(self, stream: int, device: int) -> int:
        if stream in LEGACY_HANDLES:
            return self.clock.legacy(device, self.id)
        return self._aliases.get(stream, stream)

    def adopt_stream(self, handle: int, device: int, *, non_blocking: bool = False) -> int:
        """Make ``handle`` name a new stream of GPU ``device`` in this process; return it."""
        made = self.clock.create_stream(device, non_blocking=non_blocking)
        with self.clock._cond:
            self.clock._streams[made].process = self.id
        self._aliases[handle] = made
        return handle

    def create_stream(self, device: int, *, non_blocking: bool = True) -> int:
        """Return a new stream of GPU ``device`` in this process."""
        made = self.clock.create_stream(device, non_blocking=non_blocking)
        with self.clock._cond:
            self.clock._streams[made].process = self.id
        return made

    def legacy(self, device: int) -> int:
        """Return the handle of this process's legacy stream of GPU ``device``."""
        return self.clock.legacy(device, self.id)

    def stream_device(self, stream: int, device: int = 0) -> int:
        return self.clock.stream_device(self._s(stream, device), device)

    def destroy_stream(self, stream: int, device: int = 0) -> None:
        self.clock.destroy_stream(self._s(stream, device), device)

    def create_event(self, device: int) -> int:
        return self.clock.create_event(device)

    def destroy_event(self, event: int) -> None:
        self.clock.destroy_event(event)

    def record(self, event: int, stream: int, device: int = 0) -> None:
        self.clock.record(event, self._s(stream, device), device)

    def wait_event(self, stream: int, event: int, device: int = 0) -> None:
        self.clock.wait_event(self._s(stream, device), event, device)

    def submit(self, stream: int, run: Callable[[], None] | None = None, **kw: Any) -> Item:
        return self.clock.submit(self._s(stream, kw.get("device", 0)), run, **kw)

    def delay(self, stream: int, seconds: float, *, device: int = 0, tag: Any = None) -> Item:
        return self.clock.delay(self._s(stream, device), seconds, device=device, tag=tag)

    def gate(self, stream: int, *, device: int = 0) -> Gate:
        return self.clock.gate(self._s(stream, device), device=device)

    def meet(self, stream: int, key: Any, parties: int, payload: Any, **kw: Any) -> Item:
        resolved = self._s(stream, kw.get("device", 0))
        return self.clock.meet(resolved, key, parties, payload, **kw)

    def query(self, event: int) -> int:
        return self.clock.query(event)

    def stream_query(self, stream: int, device: int = 0) -> int:
        return self.clock.stream_query(self._s(stream, device), device)

    def stream_synchronize(self, stream: int, device: int = 0) -> None:
        self.clock.stream_synchronize(self._s(stream, device), device)

    def event_synchronize(self, event: int) -> None:
        self.clock.event_synchronize(event)

    def device_synchronize(self, device: int) -> None:
        self.clock.device_synchronize(device)

    def begin_capture(self, stream: int, device: int = 0, mode: int = GLOBAL) -> None:
        self.clock.begin_capture(self._s(stream, device), device, mode)

    def end_capture(self, stream: int, device: int = 0) -> list[str]:
        return self.clock.end_capture(self._s(stream, device), device)

    def capture_status(self, stream: int, device: int = 0) -> int:
        return self.clock.capture_status(self._s(stream, device), device)

    def hold(self, stream: int, device: int = 0) -> AbstractContextManager[None]:
        return self.clock.hold(self._s(stream, device), device)

    def cancel(self, tag: Any) -> int:
        return self.clock.cancel(tag)


class Memory:
    """Stand-in device memory: host bytes at real addresses, found by address."""

    def __init__(self) -> None:
        """Start with no allocation."""
        self._lock = threading.Lock()
        self._bases: list[int] = []
        self._arrays: dict[int, Callable[[], np.ndarray | None]] = {}

    def alloc(self, nbytes: int) -> int:
        """Return the address of ``nbytes`` new zeroed bytes (at least one), kept until ``free``."""
        array = np.zeros(max(nbytes, 1), np.uint8)
        return self._add(array, lambda: array)

    def adopt(self, array: np.ndarray) -> int:
        """Make ``array``'s bytes (contiguous) known by their address while it lives; return it."""
        ref = weakref.ref(array)

        def flat() -> np.ndarray | None:
            found = ref()
            return None if found is None else found.reshape(-1).view(np.uint8)

        return self._add(array.reshape(-1).view(np.uint8), flat)

    def _add(self, array: np.ndarray, ref: Callable[[], np.ndarray | None]) -> int:
        base = int(array.ctypes.data)
        with self._lock:
            if base not in self._arrays:
                bisect.insort(self._bases, base)
            self._arrays[base] = ref
        return base

    def free(self, ptr: int) -> None:
        """Forget the allocation at ``ptr``."""
        with self._lock:
            if self._arrays.pop(ptr, None) is not None:
                self._bases.remove(ptr)

    def view(self, ptr: int, nbytes: int) -> np.ndarray | None:
        """Return the ``nbytes`` at ``ptr`` as uint8, or None if no live allocation holds them."""
        with self._lock:
            # the nearest base below may be a dead array's, or a live one's that ends
            # first (a smaller array inside a larger one's bytes): look further down
            i = bisect.bisect_right(self._bases, ptr) - 1
            while i >= 0:
                base = self._bases[i]
                array = self._arrays[base]()
                if array is None:
                    del self._arrays[base]
                    self._bases.pop(i)
                elif ptr + nbytes <= base + array.size:
                    return array[ptr - base : ptr - base + nbytes]
                i -= 1
            return None

    def copy(self, dst: int, src: int, nbytes: int) -> bool:
        """Copy ``nbytes`` from ``src`` to ``dst`` if both are known; return whether copied."""
        target, source = self.view(dst, nbytes), self.view(src, nbytes)
        if target is None or source is None:
            return False
        target[:] = source
        return True


MEMORY = Memory()
"""The process's stand-in device memory (and the pinned host memory the stand-ins make)."""
