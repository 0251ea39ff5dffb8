"""Work: the handle an op returns, to wait on it, poll it, await it, or read its failure."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Generator
from datetime import timedelta
from typing import Any

from collective.types import bounded_timeout

_AWAIT_PAUSE_S = (0.0001, 0.005)
"""First and longest sleep of the event loop between two polls of an awaited op."""

_BACKGROUND_GRACE_S = 5.0
"""How long a wait without a timeout gives a background completion beyond the op's timeout."""


class Work(ABC):
    """The pending result of one op.

    The op's output buffers hold their result only once ``wait`` has returned;
    until then neither the inputs nor the outputs may be read, written or freed.
    Ops on one group complete in the order they were issued.

    In a coroutine, ``await work`` waits without blocking the event loop: it polls
    ``is_completed`` between short sleeps, then returns or raises as ``wait`` does.
    """

    @abstractmethod
    def wait(self, timeout: timedelta | None = None) -> None:
        """Block until the op has finished and its outputs are written.

        Args:
            timeout: the longest wait; None waits up to the op's own timeout.

        Raises:
            CollectiveTimeoutError: the op did not finish in time; the group is unusable.
            CollectiveError: the op failed; the group is unusable.

        """

    @abstractmethod
    def is_completed(self) -> bool:
        """Return whether the op has finished, successfully or not; never blocks.

        Every op turns True by itself once it has finished, without a ``wait``:
        polling this is enough to learn when to ``wait`` (which then returns at
        once, or raises the op's failure).
        """

    @abstractmethod
    def exception(self) -> BaseException | None:
        """Return the op's failure once it has finished with one, else None; never blocks."""

    def __await__(self) -> Generator[Any, None, None]:
        """Wait for the op in a coroutine, sleeping on the event loop between polls."""
        return _until_completed(self).__await__()


async def _until_completed(work: Work) -> None:
    """Poll ``work`` with growing sleeps until it has finished, then ``wait`` on it.

    Every op finishes by its own timeout at the latest, so this ends.
    """
    import asyncio

    pause = _AWAIT_PAUSE_S[0]
    while not work.is_completed():
        await asyncio.sleep(pause)
        pause = min(2 * pause, _AWAIT_PAUSE_S[1])
    work.wait()


class OnceWork(Work):
    """A ``Work`` whose completion runs once; later waits repeat its outcome.

    The completion (``_complete``) runs in the first thread that waits. A backend
    whose transport cannot report an op's end without being waited on calls
    ``_complete_in_background`` when polled: a thread of the work's own then runs
    the completion, so that ``is_completed`` turns True with nobody waiting. A
    ``wait`` while that thread runs waits for the thread, up to its timeout.
    """

    _finished: threading.Event | None = None
    """Set once the background completion has run; None while none was started."""
    _thread: threading.Thread | None = None
    _given_up: BaseException | None = None
    """The failure of a ``wait`` that ran out before the background completion."""

    def __init__(self, timeout: timedelta | None = None) -> None:
        """Start not done and without a failure; ``timeout`` is the op's own timeout."""
        self._lock = threading.Lock()
        self._done = False
        self._error: BaseException | None = None
        self._timeout = timeout

    def wait(self, timeout: timedelta | None = None) -> None:
        """Block until the op has finished, or raise its failure."""
        finished = self._finished
        if finished is None or self._done:
            with self._lock:  # the body of _complete_once, inlined: this is the hot path
                if not self._done:
                    self._complete(timeout)
                    if self._given_up is not None:
                        self._error = self._given_up
                    self._done = True
        elif not finished.wait(self._wait_seconds(timeout)):
            self._given_up = self._give_up(timeout)
            if not self._done:
                raise self._given_up
        if self._error is not None:
            raise self._error

    def _wait_seconds(self, timeout: timedelta | None) -> float:
        bounded = bounded_timeout(timeout)
        if bounded is not None:
            return bounded.total_seconds()
        own = self._timeout.total_seconds() if self._timeout is not None else 0.0
        return own + _BACKGROUND_GRACE_S

    def _complete_once(self, timeout: timedelta | None) -> None:
        with self._lock:
            if not self._done:
                self._complete(timeout)
                if self._given_up is not None:
                    self._error = self._given_up
                self._done = True

    def _complete_in_background(self, name: str) -> None:
        """Start a thread called ``name`` that runs the completion; never blocks.

        Does nothing once the op is done, while a thread already runs it, or while
        another thread's ``wait`` runs it (that wait marks it done when it ends).
        """
        if self._done or self._finished is not None or not self._lock.acquire(blocking=False):
            return
        try:
            if not self._done and self._finished is None:
                self._finished = threading.Event()
                self._thread = threading.Thread(target=self._background, name=name, daemon=True)
                self._thread.start()
        finally:
            self._lock.release()

    def _background(self) -> None:
        finished = self._finished
        try:
            self._complete_once(None)
        finally:
            if finished is not None:
                finished.set()

    def _join_background(self, seconds: float) -> None:
        """Wait up to ``seconds`` for the thread that runs the completion, if there is one."""
        thread = self._thread
        if thread is not None:
            thread.join(seconds)

    def _give_up(self, timeout: timedelta | None) -> BaseException:
        """Return the failure of a ``wait`` that ran out before the background completion."""
        return TimeoutError(f"the op did not finish within {timeout}")

    @abstractmethod
    def _complete(self, timeout: timedelta | None) -> None:
        """Wait for the op up to ``timeout`` and finish it; record a failure in ``_error``."""


class CompletedWork(Work):
    """A ``Work`` for an op that finished before its handle was made."""

    def __init__(self, error: BaseException | None = None) -> None:
        """Record the op's outcome: None for success, else its failure."""
        self._error = error

    def wait(self, timeout: timedelta | None = None) -> None:
        """Return at once, or raise the op's failure."""
        if self._error is not None:
            raise self._error

    def is_completed(self) -> bool:
        """Return True."""
        return True

    def exception(self) -> BaseException | None:
        """Return the op's failure, or None."""
        return self._error


def returned(work: Work, async_op: bool) -> Work | None:
    """Return what a public op returns: its handle when called with ``async_op``, else None."""
    return work if async_op else None
