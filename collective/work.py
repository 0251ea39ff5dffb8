"""Work: the handle an op returns, to wait on it, poll it, or read its failure."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from datetime import timedelta


class Work(ABC):
    """The pending result of one op.

    The op's output buffers hold their result only once ``wait`` has returned;
    until then neither the inputs nor the outputs may be read, written or freed.
    Ops on one group complete in the order they were issued.
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
        """Return whether the op has finished, successfully or not; never blocks."""

    @abstractmethod
    def exception(self) -> BaseException | None:
        """Return the op's failure once it has finished with one, else None; never blocks."""


class OnceWork(Work):
    """A ``Work`` whose completion runs once, under a lock; later waits repeat its outcome."""

    def __init__(self) -> None:
        """Start not done and without a failure."""
        self._lock = threading.Lock()
        self._done = False
        self._error: BaseException | None = None

    def wait(self, timeout: timedelta | None = None) -> None:
        """Block until the op has finished, or raise its failure."""
        with self._lock:
            if not self._done:
                self._complete(timeout)
                self._done = True
        if self._error is not None:
            raise self._error

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


def issued(work: Work, async_op: bool) -> Work | None:
    """Return what a public op returns: its handle when called with ``async_op``, else None."""
    return work if async_op else None
