"""The NCCL watchdog: every op is watched against its timeout without blocking the caller.

A blocking op returns as soon as its NCCL calls are queued on the caller's stream,
so nobody waits for it on the host. Each stream a group's ops run on has one
reusable CUDA event (a ``Marker``): after each op the group records it on that
stream and, if no op of that stream was pending, notes the op and its deadline.
One thread per process (``WATCHDOG``) queries every pending marker a few times a
second (it keeps a group for ``LINGER_S`` after its last op, so back-to-back ops
never wake it): once its event has completed, every op queued on that stream before it
has finished; if the deadline passes first, or a communicator reports an
asynchronous NCCL error, the group fails: its communicators are aborted (so the
stuck kernel exits and the caller's stream moves on), and the next call on the
group, and ``wait`` on its ``Work``, raise the error.

Recording an event is a stream operation and querying it is not, so both stay
out of CUDA-graph capture: an op captured into a graph records no marker (a
graph's replay is the user's to synchronise), and while any stream that an op
was captured on still captures, the thread queries nothing, since an event query
in another thread can invalidate a capture in CUDA's global capture mode.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from collective.groups.nccl.cuda import events_done

POLL_S = 0.02
"""How often the watchdog queries the pending ops of every group."""

LINGER_S = 1.0
"""How long the watchdog keeps patrolling a group with nothing pending before it lets go."""

_CAPTURE_NONE = 0
"""``cudaStreamCaptureStatusNone``."""


class Marker:
    """One stream's reusable event and the oldest op on it not yet seen finished."""

    __slots__ = ("deadline", "device", "event", "number", "op", "stream", "timeout")

    def __init__(self, event: Any, stream: int, device: int) -> None:
        """Watch ``stream`` of GPU ``device`` with cupy ``event``, idle."""
        self.event = event
        self.stream = stream
        self.device = device
        self.deadline: float | None = None
        self.op = ""
        self.number = 0
        """The group's count of collectives when ``op`` was issued (0: not counted)."""
        self.timeout = timedelta(0)


class Watch:
    """The markers of one group, and what to do when one of its ops fails or hangs.

    ``issued`` runs under the group's op lock, on the caller's thread; ``patrol``
    runs on the watchdog thread and takes that lock only when it is free.
    """

    def __init__(
        self,
        cuda: Any,
        lock: threading.Lock,
        comms: Callable[[], Sequence[Any]],
        fail: Callable[[str, timedelta, BaseException, int], Any],
        mismatch: Callable[[], BaseException | None] = lambda: None,
        unread: Callable[[], list[Any]] = list,
    ) -> None:
        """Watch ops issued under ``lock`` on ``comms()``; ``fail`` ends the group.

        ``fail(op, timeout, exc, number)`` gets the group's count of collectives when
        the failed op was issued (0 when not known).

        ``mismatch`` reads the finished signature checks and returns the error of a
        mismatch (having failed the group), or None; ``unread`` returns the events of
        the checks not yet read, which keep the group patrolled.
        """
        self._cuda = cuda
        self._lock = lock
        self._comms = comms
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
            cuda = self._cuda
            with cuda.Device(device):
                event = cuda.Event(disable_timing=True)
            found = self.markers[stream] = Marker(event, stream, device)
        return found

    def capturing(self, stream: int) -> bool:
        """Return whether ``stream`` captures a CUDA graph; the watchdog then waits."""
        runtime = self._cuda.runtime
        try:
            capturing = runtime.streamIsCapturing(stream) != _CAPTURE_NONE
        except runtime.CUDARuntimeError:
            capturing = True  # e.g. the legacy stream while another thread captures
        if capturing:
            WATCHDOG.captured(runtime, stream)
        return capturing

    def issued(self, marker: Marker, op: str, timeout: timedelta, number: int = 0) -> None:
        """Mark that ``op`` was just queued on ``marker``'s stream (never during capture).

        The marker's deadline is the earliest of its pending ops': an op with a short
        timeout behind one with a long timeout ends at its own. ``number`` is the
        group's count of collectives with ``op`` (0 for a send or receive).
        """
        self._cuda.runtime.eventRecord(marker.event.ptr, marker.stream)
        deadline = time.monotonic() + timeout.total_seconds()
        earliest = marker.deadline
        if earliest is None or deadline < earliest:
            marker.op, marker.timeout, marker.deadline = op, timeout, deadline
            marker.number = number
            if earliest is None and not self.patrolled:
                WATCHDOG.wake(self)

    def pending(self) -> list[Any]:
        """Return the events of the ops not yet seen finished, and of the checks not yet read."""
        markers = [m.event for m in list(self.markers.values()) if m.deadline is not None]
        return markers + self._unread()

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
            if marker.deadline is None or self.stopped:
                continue
            try:
                if events_done(self._cuda, [marker.event]):
                    marker.deadline = None
                    continue
                for comm in self._comms():
                    comm.check_async_error()
            except RuntimeError as exc:
                self._end(marker, exc)
                return False
            if now >= marker.deadline:
                self._end(marker, TimeoutError(_stuck(marker)))
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

    def _end(self, marker: Marker, exc: BaseException) -> None:
        self.stopped = True
        op, timeout, number = marker.op, marker.timeout, marker.number
        for m in self.markers.values():
            m.deadline = None
        self._fail(op, timeout, exc, number)


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
            except runtime.CUDARuntimeError:
                return True
            with self._lock:
                self._captures.pop(stream, None)
        return False

    def _run(self) -> None:
        while True:
            self._signal.wait(POLL_S)
            self._signal.clear()
            with self._lock:
                watches = list(self._watches)
            if not watches:
                self._signal.wait()
                continue
            if self._capturing():
                continue
            now = time.monotonic()
            for watch in watches:
                if not watch.patrol(now):
                    with self._lock:  # ``wake`` adds it back under this lock
                        if watch.stopped or not watch.pending():
                            self._watches.discard(watch)


WATCHDOG = Watchdog()
"""The process's watchdog."""
