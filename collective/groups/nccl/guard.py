"""Who may call into NCCL when: a group's calls against its abort, and issue per GPU.

Two of NCCL's rules are about threads (``docs/userguide/source/usage/threadsafety.rst``
and ``usage/communicators.rst``, Fault Tolerance):

- ``ncclCommAbort`` (or ``ncclCommDestroy``) must not run while another thread is
  inside an NCCL call on that communicator: on a blocking communicator (cupy makes no
  other kind) NCCL may hang forever, and cupy's ``abort`` frees the communicator before
  it clears its handle, so a concurrent ``check_async_error`` would pass freed memory.
  ``CommGuard`` keeps them apart: every call a group makes on its communicators runs
  between ``enter()`` and ``leave()``, and ``end`` runs the abort at once when no thread is inside,
  or else as the last thread leaves; once ended, no call starts. A thread blocked
  inside NCCL (a first-use connection whose peer never comes) therefore delays the
  abort until it returns: the group is marked failed at once all the same.
- Operations on independent communicators of one GPU must not be issued in parallel
  from several threads. ``ISSUE`` holds one lock per GPU of the process, taken by every
  group around its NCCL calls (a group over several GPUs issues its leaders' ops on
  one thread and its cross-GPU sends on another, on two communicators of one GPU). A
  program whose threads issue first uses on two communicators of a GPU in an order its
  peers do not share can block there until the op's timeout; NCCL already requires one
  global order of the operations of several communicators on a GPU (before 2.26).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any


class CommGuard:
    """Keeps a group's abort or destroy away from its NCCL calls in flight; see the module."""

    def __init__(self) -> None:
        """Start open: calls may go ahead."""
        self._lock = threading.Lock()
        self._inside = 0
        self._ended = False
        self._deferred: list[Callable[[], None]] = []

    @property
    def ended(self) -> bool:
        """Return whether ``end`` was called: no NCCL call on the group may start."""
        return self._ended

    def enter(self) -> bool:
        """Start a call into NCCL; return False (call nothing, and skip ``leave``) once ended."""
        with self._lock:
            if self._ended:
                return False
            self._inside += 1
            return True

    def leave(self) -> None:
        """End a call that ``enter`` allowed; run a deferred abort if it was the last."""
        with self._lock:
            self._inside -= 1
            run = self._deferred if self._inside == 0 else []
            if run:
                self._deferred = []
        for release in run:
            release()

    def end(self, release: Callable[[], None]) -> None:
        """Refuse later calls; run ``release`` (the abort) now, or when the last call returns."""
        with self._lock:
            self._ended = True
            if self._inside:
                self._deferred.append(release)
                return
        release()

    def probe(self, comms: Callable[[], Sequence[Any]]) -> Callable[[], None]:
        """Return a poll of ``comms()``' asynchronous NCCL errors, skipped once ended.

        Raises (when called):
            RuntimeError: a communicator reports an asynchronous NCCL error.

        """

        def poll() -> None:
            if self.enter():
                try:
                    for comm in comms():
                        comm.check_async_error()
                finally:
                    self.leave()

        return poll


class IssueLocks:
    """One lock per GPU of the process, held while NCCL operations are issued on it."""

    def __init__(self) -> None:
        """Start with no lock."""
        self._lock = threading.Lock()
        self._locks: dict[tuple[Any, int], threading.Lock] = {}

    def _of(self, cuda: Any, device: int) -> threading.Lock:
        key = (cuda.runtime, device)  # one runtime per process (a test's stand-in has its own)
        found = self._locks.get(key)
        if found is None:
            with self._lock:
                found = self._locks.setdefault(key, threading.Lock())
        return found

    def lock(self, cuda: Any, devices: Iterable[int]) -> AbstractContextManager[Any]:
        """Return what holds the locks of ``devices``: made once per launch, entered per op.

        One device's is its lock itself (entering it runs no Python); several are held
        in order of device, so two holders never deadlock. ``cuda`` is cupy's CUDA
        namespace, whose runtime names the process.
        """
        chosen = sorted(set(devices))
        if len(chosen) == 1:
            return self._of(cuda, chosen[0])
        return _Several([self._of(cuda, device) for device in chosen])


class _Several:
    """Several issue locks held together, in the order given."""

    def __init__(self, locks: list[threading.Lock]) -> None:
        self._locks = locks

    def __enter__(self) -> None:
        for lock in self._locks:
            lock.acquire()

    def __exit__(self, *exc: object) -> None:
        for lock in reversed(self._locks):
            lock.release()


ISSUE = IssueLocks()
"""The process's NCCL issue locks, one per GPU."""
