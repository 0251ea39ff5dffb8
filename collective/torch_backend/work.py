"""torch's ``Work`` over the library's: wait with a timeout, poll, read the failure, a future.

A blocking call returns ``DONE``, made once: torch's blocking ops only ``wait`` on it.
An async call returns a ``TorchWork`` over the library's ``Work`` of the op. Its future
(``get_future``, which DDP's communication hooks chain on) is completed by the group's
``Futures``: one thread per stream of ops (the collectives, the sends to one peer, the
receives from one peer) waits for them in the order they were issued, as they complete,
and sets each future to the op's outputs or its failure.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from collective.torch_backend.options import wait_timeout
from collective.work import Work

_JOIN_S = 5.0
"""The longest ``Futures.stop`` waits for a thread to end."""


class TorchWork(dist.Work):
    """The torch ``Work`` of one async op of the backend.

    ``wait`` raises the op's failure: a ``CollectiveTimeoutError`` naming the ranks
    that never joined, or a ``CollectiveError`` (a ``RuntimeError``) saying what failed.
    """

    def __init__(self, work: Work, outputs: list[Any], futures: Futures, lane: str) -> None:
        """Wrap the library's ``work``, whose op writes ``outputs``, run on ``lane``."""
        super().__init__()
        self._work = work
        self._outputs = outputs
        self._futures = futures
        self._lane = lane
        self._future: torch.futures.Future[Any] | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the op has finished and its outputs are written; return True.

        Args:
            timeout: the longest wait; None or zero (torch's "no timeout") waits up to the
                op's own timeout. A wait that runs out leaves the group unusable.

        Raises:
            CollectiveTimeoutError: the op did not finish in time.
            CollectiveError: the op failed; the group is unusable.
            ValueError: a received message did not fit the receiving tensor.

        """
        self._work.wait(wait_timeout(timeout))
        return True

    def is_completed(self) -> bool:
        """Return whether the op has finished, successfully or not; never blocks."""
        return self._work.is_completed()

    def is_success(self) -> bool:
        """Return whether the op has finished without a failure; never blocks."""
        return self._work.is_completed() and self._work.exception() is None

    def exception(self) -> BaseException | None:
        """Return the op's failure once it has finished with one, else None; never blocks."""
        return self._work.exception()

    def result(self) -> list[Any]:
        """Return the tensors the op writes."""
        return self._outputs

    def get_future(self) -> torch.futures.Future[Any]:
        """Return a future set to the op's output tensors when it finishes, or to its failure."""
        if self._future is None:
            self._future = self._futures.watch(self._lane, self._work, self._outputs)
        return self._future

    def source_rank(self) -> int:
        """Return the rank a receive received from (-1 until it has, or for another op)."""
        return int(getattr(self._work, "source", -1))

    _source_rank = source_rank

    def synchronize(self) -> None:
        """Do nothing: a CPU op has nothing to order on a stream."""


class _Done(dist.Work):
    """The torch ``Work`` of a blocking op, which has finished when it is returned."""

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Return True at once."""
        return True

    def is_completed(self) -> bool:
        """Return True."""
        return True

    def is_success(self) -> bool:
        """Return True."""
        return True

    def exception(self) -> BaseException | None:
        """Return None."""
        return None

    def synchronize(self) -> None:
        """Do nothing."""


DONE = _Done()
"""The one ``Work`` every blocking op returns."""


class _Stream:
    """One thread that completes the futures of one stream of ops, in order."""

    def __init__(self, name: str) -> None:
        self._cond = threading.Condition()
        self._queue: deque[Callable[[], None]] = deque()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(self, job: Callable[[], None]) -> None:
        with self._cond:
            self._queue.append(job)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopped:
                    self._cond.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
            job()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(_JOIN_S)


class Futures:
    """A group's future-completing threads, one per stream of ops, each started on first use."""

    def __init__(self, group_name: str) -> None:
        """Name the threads after ``group_name``."""
        self._prefix = f"collective-torch-{group_name}-futures-"
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}

    def watch(self, lane: str, work: Work, outputs: list[Any]) -> torch.futures.Future[Any]:
        """Return a future set to ``outputs`` once ``work`` (on ``lane``) ends, or to why not."""
        future: torch.futures.Future[Any] = torch.futures.Future()

        def complete() -> None:
            try:
                work.wait()
            except BaseException as exc:
                future.set_exception(exc)
                return
            future.set_result(outputs)

        with self._lock:
            stream = self._streams.get(lane)
            if stream is None:
                stream = self._streams[lane] = _Stream(self._prefix + lane)
            stream.add(complete)
        return future

    def stop(self) -> None:
        """End every thread once the futures given to it are set (their ops have ended)."""
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.stop()
