"""The CUDA side of the nccl backend: comm streams, event queries and the Work of an op.

Everything here takes cupy's CUDA namespace (``cupy.cuda``) as an argument and works
on raw stream and event handles through ``cupy.cuda.runtime``, so that no
``cupy.cuda.ExternalStream`` (deprecated in cupy 14, and a warning per construction)
is built on the hot path.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from collective.types import CollectiveError
from collective.work import OnceWork, Work

_NON_BLOCKING = 1
"""``cudaStreamNonBlocking``: the stream does not synchronise with the legacy default stream."""

NOT_READY = 600
"""``cudaErrorNotReady``: what ``cudaEventQuery`` returns while the event is pending."""

_POLL_S = (0.0005, 0.01)
"""First and longest sleep between two queries of an unfinished CUDA event."""


class StreamPool:
    """The comm streams of every NCCL group in this process, which are never destroyed.

    Each op records its torch buffers on the group's comm stream with torch's caching
    allocator. torch records an event on that stream only when such a block is freed,
    which may be long after the group is gone; had the stream been destroyed by then,
    torch would record on a dead handle (pytorch PR #66941). So a comm stream lives as
    long as the process: a destroyed group hands its streams back here and a later
    group reuses them, which keeps their number at the most groups alive at once.
    A reused stream is safe for torch: a block freed later waits for whatever then
    runs on the stream, which includes all the old group's work.

    The streams are not torch's pool streams (``torch.cuda.Stream()``), which torch
    shares round-robin with any other user, so that an NCCL kernel waiting for peers
    never queues unrelated work behind it.
    """

    def __init__(self) -> None:
        """Start with no streams."""
        self._lock = threading.Lock()
        self._free: dict[tuple[Any, int], list[int]] = {}

    def acquire(self, cuda: Any, device: int) -> int:
        """Return the handle of a non-blocking stream on GPU ``device`` that no group uses."""
        with self._lock:
            free = self._free.get((cuda.runtime, device))
            if free:
                return free.pop()
        with cuda.Device(device):
            return int(cuda.runtime.streamCreateWithFlags(_NON_BLOCKING))

    def release(self, cuda: Any, streams: dict[int, int]) -> None:
        """Take back ``streams`` (device -> handle), whose work has all finished."""
        with self._lock:
            for device, stream in streams.items():
                self._free.setdefault((cuda.runtime, device), []).append(stream)


STREAMS = StreamPool()
"""The process's comm streams."""


def events_done(cuda: Any, events: Sequence[Any]) -> bool:
    """Return whether every one of ``events`` has completed.

    Unlike ``cupy.cuda.Event.done``, a CUDA error is raised, not read as "not yet": a
    sticky error (an illegal address, a device-side assert) fails the op at once
    instead of after its whole timeout.

    Raises:
        RuntimeError: CUDA reports an error (``cupy.cuda.runtime.CUDARuntimeError``).

    """
    for event in events:
        status = cuda.runtime.eventQuery(event.ptr)
        if status == NOT_READY:
            return False
        if status != 0:
            raise cuda.runtime.CUDARuntimeError(status)
    return True


def no_probe() -> None:
    """Poll nothing: for waits on events of no communicator."""


def exchange_capture_mode(mode: int) -> int:
    """Set the calling thread's CUDA stream-capture mode; return the previous one.

    ``cuThreadExchangeStreamCaptureMode`` of the CUDA driver, which cupy does not bind.
    The mode is the driver's, per thread, whichever runtime a library links.

    Raises:
        OSError: the CUDA driver library cannot be loaded.
        RuntimeError: the driver refused the call.

    """
    driver = ctypes.CDLL("libcuda.so.1")
    exchange = driver.cuThreadExchangeStreamCaptureMode
    exchange.argtypes = [ctypes.POINTER(ctypes.c_int)]
    exchange.restype = ctypes.c_int
    value = ctypes.c_int(mode)
    status = exchange(ctypes.byref(value))
    if status:
        raise RuntimeError(f"cuThreadExchangeStreamCaptureMode failed with CUresult {status}")
    return int(value.value)


CAPTURE_THREAD_LOCAL = 1
"""``cudaStreamCaptureModeThreadLocal``: only this thread's own captures restrict it."""


def settled(cuda: Any, events: Sequence[Any]) -> bool:
    """Return whether ``events`` have all completed, or CUDA reports an error for them."""
    try:
        return events_done(cuda, events)
    except RuntimeError:
        return True


def wait_events(
    cuda: Any, events: Sequence[Any], probe: Callable[[], None], timeout: timedelta
) -> bool:
    """Poll ``events`` until all have completed; return False if ``timeout`` passes first.

    ``probe()`` polls the communicators' asynchronous NCCL errors between queries
    (``guard.CommGuard.probe``).

    Raises:
        RuntimeError: CUDA reports an error, or ``probe`` an asynchronous NCCL one.

    """
    deadline = time.monotonic() + timeout.total_seconds()
    pause = _POLL_S[0]
    while not events_done(cuda, events):
        probe()
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, _POLL_S[1])
    return True


class NcclWork(OnceWork):
    """An NCCL op in flight, tracked by a CUDA event on each comm stream it used.

    ``wait`` polls the events up to a deadline, then calls ``finish``, which orders
    the caller's current streams after them; ``finish`` holds the op's buffers.
    """

    def __init__(
        self,
        op: str,
        cuda: Any,
        events: Sequence[Any],
        probe: Callable[[], None],
        finish: Callable[[], None],
        fail: Callable[[str, timedelta, BaseException, int], CollectiveError],
        timeout: timedelta,
        broken: Callable[[], CollectiveError | None] = lambda: None,
        number: int = 0,
    ) -> None:
        """Track ``events`` of op ``op``; ``fail`` turns a failure into the group's error.

        ``probe()`` polls the group's communicators for asynchronous NCCL errors.

        ``broken`` returns the group's failure, if another op or the watchdog found one:
        the events of an op whose communicators were aborted complete too. ``number``
        is the group's count of collectives with this op (0: not counted), which
        ``fail`` gets.
        """
        super().__init__()
        self._op = op
        self._cuda = cuda
        self._events = list(events)
        self._probe = probe
        self._finish: Callable[[], None] | None = finish
        self._fail = fail
        self._op_timeout = timeout
        self._broken = broken
        self._number = number

    def _complete(self, timeout: timedelta | None) -> None:
        if self._error is not None:  # ``exception`` has seen the failure already
            return
        limit = timeout or self._op_timeout
        try:
            if not wait_events(self._cuda, self._events, self._probe, limit):
                raise TimeoutError("the NCCL kernels did not finish")
            self._probe()
        except (RuntimeError, TimeoutError) as exc:
            self._error = self._fail(self._op, limit, exc, self._number)
            return
        self._error = self._broken()
        if self._error is None:
            if self._finish is not None:
                self._finish()
            self._finish = None

    def is_completed(self) -> bool:
        """Return whether the op has finished, successfully or not; never blocks."""
        return self._done or self._error is not None or settled(self._cuda, self._events)

    def exception(self) -> BaseException | None:
        """Return the op's failure once it has finished with one, else None."""
        if self._error is not None:
            return self._error
        try:
            events_done(self._cuda, self._events)
            self._probe()
        except RuntimeError as exc:
            with self._lock:
                self._error = self._fail(self._op, self._op_timeout, exc, self._number)
            return self._error
        return None


class _Done(Work):
    """The ``Work`` of a blocking op: queued on the caller's stream, which orders what follows."""

    def wait(self, timeout: timedelta | None = None) -> None:
        """Return at once: later work on the caller's stream runs after the op."""

    def is_completed(self) -> bool:
        """Return True."""
        return True

    def exception(self) -> BaseException | None:
        """Return None; a failure the watchdog finds fails the group's next call."""
        return None


DONE = _Done()
"""The one ``Work`` every blocking op returns."""
