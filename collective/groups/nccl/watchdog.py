"""The NCCL watchdog: every op is watched against its timeout without blocking the caller.

A blocking op returns as soon as its NCCL calls are queued on the caller's stream,
so nobody waits for it on the host. After each op the group records an event on each
stream the op ran on, from that stream's ``Marker``: a queue of the ops not yet seen
finished there, each with its own event and deadline (a query reflects only an
event's latest record, so one event re-recorded per op would read as unfinished for
as long as the stream is never idle, and a stream kept busy longer than the timeout
by ops that all finish would fail). One thread per process (``WATCHDOG``) queries the
oldest pending op of every marker a few times a second (it keeps a group for
``LINGER_S`` after its last op, so back-to-back ops never wake it): once its event has
completed, that op and every op queued on the stream before it have finished; if an
op's deadline passes first, or a communicator reports an asynchronous NCCL error,
the group fails: its communicators are aborted (so the stuck kernel exits and the
caller's stream moves on), and the next call on the group, and ``wait`` on its
``Work``, raise the error.

Recording an event is a stream operation and querying it is not, so both stay
out of CUDA-graph capture: an op captured into a graph records no marker (a
graph's replay is the user's to synchronise), and while any stream that an op
was captured on still captures, the thread queries nothing. The thread also sets its
own capture mode to thread-local (``cuThreadExchangeStreamCaptureMode``), so that its
queries never invalidate a capture another thread runs in CUDA's global mode (as
PyTorch's NCCL watchdog does since pytorch/pytorch#148594).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from collective.groups.nccl.cuda import CAPTURE_THREAD_LOCAL, events_done, exchange_capture_mode
from collective.types import ArgumentValueError

POLL_S = 0.02
"""How often the watchdog queries the pending ops of every group."""

LINGER_S = 1.0
"""How long the watchdog keeps patrolling a group with nothing pending before it lets go."""

_CAPTURE_NONE = 0
"""``cudaStreamCaptureStatusNone``."""

_CAPTURE_IMPLICIT = 906
"""``cudaErrorStreamCaptureImplicit``: the legacy stream asked about while a blocking
stream of its device captures."""

PENDING_KEPT = 256
"""Ops a marker tracks one by one; later ones share the newest entry's event."""


@dataclass
class Pending:
    """An op queued on a marker's stream and not yet seen finished."""

    event: Any
    deadline: float
    op: str
    timeout: timedelta
    number: int
    """The group's count of collectives when ``op`` was issued (0: not counted)."""


class Marker:
    """One stream's ops not yet seen finished, oldest first, and their events."""

    __slots__ = ("device", "free", "pending", "stream")

    def __init__(self, stream: int, device: int) -> None:
        """Watch ``stream`` of GPU ``device``, idle."""
        self.stream = stream
        self.device = device
        self.pending: deque[Pending] = deque()
        self.free: list[Pending] = []
        """Entries (with their events) of ops seen finished, to reuse."""


class Watch:
    """The markers of one group, and what to do when one of its ops fails or hangs.

    ``issued`` runs under the group's op lock, on the caller's thread; ``patrol``
    runs on the watchdog thread and takes that lock only when it is free.
    """

    def __init__(
        self,
        cuda: Any,
        lock: threading.Lock,
        probe: Callable[[], None],
        fail: Callable[[str, timedelta, BaseException, int], Any],
        mismatch: Callable[[], BaseException | None] = lambda: None,
        unread: Callable[[], list[Any]] = list,
    ) -> None:
        """Watch ops issued under ``lock``; ``probe()`` polls their communicators' errors.

        ``fail`` ends the group.

        ``fail(op, timeout, exc, number)`` gets the group's count of collectives when
        the failed op was issued (0 when not known).

        ``mismatch`` reads the finished signature checks and returns the error of a
        mismatch (having failed the group), or None; ``unread`` returns the events of
        the checks not yet read, which keep the group patrolled.
        """
        self._cuda = cuda
        self._lock = lock
        self._probe = probe
        self._fail = fail
        self._mismatch = mismatch
        self._unread = unread
        self.markers: dict[int, Marker] = {}
        self.stopped = False
        self.patrolled = False
        """Whether the watchdog patrols this group; read and cleared under the op lock."""
        self._idle_since: float | None = None

    def marker(self, stream: int, device: int) -> Marker:
        """Return the marker of ``stream`` on GPU ``device``, made on first use."""
        found = self.markers.get(stream)
        if found is None:
            found = self.markers[stream] = Marker(stream, device)
        return found

    def capturing(self, stream: int) -> bool:
        """Return whether ``stream`` captures a CUDA graph; the watchdog then waits.

        Raises:
            ArgumentValueError: ``stream`` captures a graph that an error invalidated.
            RuntimeError: CUDA refuses the stream (``CUDARuntimeError``).

        """
        runtime = self._cuda.runtime
        try:
            capturing = runtime.streamIsCapturing(stream) != _CAPTURE_NONE
        except runtime.CUDARuntimeError as exc:
            if getattr(exc, "status", None) != _CAPTURE_IMPLICIT:
                raise
            capturing = True  # the legacy stream while a blocking stream captures
        except RuntimeError as exc:  # cupy's word for an invalidated capture
            raise ArgumentValueError(
                f"the caller's stream {stream:#x} captures a CUDA graph that an earlier error "
                f"invalidated ({exc}); end that capture (it fails) before the next op"
            ) from exc
        if capturing:
            WATCHDOG.captured(runtime, stream)
        return capturing

    def issued(self, marker: Marker, op: str, timeout: timedelta, number: int = 0) -> None:
        """Mark that ``op`` was just queued on ``marker``'s stream (never during capture).

        Records an event of the op's own on the stream, on the stream's GPU (the
        legacy stream's handle names the current device's). Each op ends at its own
        deadline, even behind one with a longer timeout. ``number`` is the group's
        count of collectives with ``op`` (0 for a send or receive).
        """
        cuda = self._cuda
        pending = marker.pending
        deadline = time.monotonic() + timeout.total_seconds()
        with cuda.Device(marker.device):
            if len(pending) >= PENDING_KEPT:  # the newest entry stands for this op too
                last = pending[-1]
                event = last.event
                if deadline < last.deadline:
                    last.deadline, last.op, last.timeout = deadline, op, timeout
                    last.number = number
            else:
                if marker.free:  # reused, as its event is: no object made per op
                    entry = marker.free.pop()
                    entry.deadline, entry.op, entry.timeout = deadline, op, timeout
                    entry.number = number
                else:
                    entry = Pending(cuda.Event(disable_timing=True), deadline, op, timeout, number)
                pending.append(entry)
                event = entry.event
            cuda.runtime.eventRecord(event.ptr, marker.stream)
        if len(pending) == 1 and not self.patrolled:
            WATCHDOG.wake(self)

    def pending(self) -> list[Any]:
        """Return the events of the ops not yet seen finished, and of the checks not yet read."""
        ops = [p.event for m in list(self.markers.values()) for p in list(m.pending)]
        return ops + self._unread()

    def patrol(self, now: float) -> bool:
        """Query the pending markers once; fail the group on an error or a passed deadline.

        Returns whether to keep patrolling: while ops are pending, and for
        ``LINGER_S`` after, so that the next op finds the group patrolled and wakes
        nobody. Never waits for the op lock: if an op is being issued, this round
        skips the group.
        """
        if not self._lock.acquire(blocking=False):
            return True
        try:
            return self._patrol(now)
        finally:
            self._lock.release()

    def _patrol(self, now: float) -> bool:
        busy = False
        try:
            if self._mismatch() is not None:
                self.stopped = True
                return False
        except RuntimeError as exc:
            self._fail("nccl signature check", timedelta(0), exc, 0)
            self.stopped = True
            return False
        for marker in list(self.markers.values()):
            pending = marker.pending
            if self.stopped:
                break
            try:
                while pending and events_done(self._cuda, [pending[0].event]):
                    marker.free.append(pending.popleft())
                if not pending:
                    continue
                self._probe()
            except RuntimeError as exc:
                self._end(pending[0] if pending else None, exc)
                return False
            late = next((p for p in pending if now >= p.deadline), None)
            if late is not None:
                self._end(late, TimeoutError(_stuck(marker)))
                return False
            busy = True
        if busy or self._unread():
            self._idle_since = None
            return True
        if self._idle_since is None:
            self._idle_since = now
        if now - self._idle_since < LINGER_S:
            return True
        self.patrolled, self._idle_since = False, None
        return False

    def _end(self, failed: Pending | None, exc: BaseException) -> None:
        self.stopped = True
        for marker in self.markers.values():  # the group fails: none of its ops is awaited
            marker.pending.clear()
        if failed is None:
            self._fail("nccl op", timedelta(0), exc, 0)
        else:
            self._fail(failed.op, failed.timeout, exc, failed.number)


def _stuck(marker: Marker) -> str:
    return (
        f"its NCCL kernel on cuda:{marker.device} did not finish: a peer never made the "
        "matching call, or made a different one; the group's communicators were aborted, "
        "so the kernel ended and the stream moves on"
    )


class Watchdog:
    """The one thread per process that patrols every watched group; started on first use."""

    def __init__(self) -> None:
        """Start with nothing to watch and no thread."""
        self._lock = threading.Lock()
        self._watches: weakref.WeakSet[Watch] = weakref.WeakSet()
        self._captures: dict[int, Any] = {}
        self._thread: threading.Thread | None = None
        self._signal = threading.Event()
        self._relaxed = False
        """Whether the thread's capture mode is thread-local (see the module)."""

    def wake(self, watch: Watch) -> None:
        """Make sure ``watch`` is patrolled: its first op since it was last idle was issued."""
        with self._lock:
            self._watches.add(watch)
            watch.patrolled = True
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="collective-nccl-watchdog", daemon=True
                )
                self._thread.start()
        self._signal.set()

    def _relax(self) -> None:
        """Make this thread's queries safe during other threads' global-mode captures."""
        if not self._relaxed:
            try:
                exchange_capture_mode(CAPTURE_THREAD_LOCAL)
                self._relaxed = True
            except (OSError, RuntimeError):
                pass  # no CUDA driver in this process: nothing captures either

    def captured(self, runtime: Any, stream: int) -> None:
        """Note that an op was captured on ``stream``: no queries while it captures."""
        with self._lock:
            self._captures[stream] = runtime

    def _capturing(self) -> bool:
        with self._lock:
            captures = list(self._captures.items())
        for stream, runtime in captures:
            try:
                if runtime.streamIsCapturing(stream) != _CAPTURE_NONE:
                    return True
            except runtime.CUDARuntimeError as exc:
                if getattr(exc, "status", None) == _CAPTURE_IMPLICIT:
                    return True
                # the stream is gone (destroyed): it captures nothing any more
            except RuntimeError:
                return True  # cupy's word for a capture an error invalidated: still open
            with self._lock:
                self._captures.pop(stream, None)
        return False

    def _run(self) -> None:
        while True:
            try:
                self._round()
            except Exception:  # never let the process's watchdog die: the next round retries
                time.sleep(POLL_S)

    def _round(self) -> None:
        """Patrol every watched group once (or sleep until one is watched)."""
        self._relax()
        self._signal.wait(POLL_S)
        self._signal.clear()
        with self._lock:
            watches = list(self._watches)
        if not watches:
            self._signal.wait()
            return
        if self._capturing():
            return
        now = time.monotonic()
        for watch in watches:
            if not watch.patrol(now):
                with self._lock:  # ``wake`` adds it back under this lock
                    if watch.stopped or not watch.pending():
                        self._watches.discard(watch)


WATCHDOG = Watchdog()
"""The process's watchdog."""
