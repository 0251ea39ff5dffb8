"""Lanes: run a group's ops in issue order, inline when nothing is queued, else on a thread.

A lane is one ordered stream of ops: a group's collectives, or its sends to one
peer, or its receives from one peer. A blocking op on an idle lane runs in the
caller's thread, which costs nothing extra; an async op, or any op behind a
queued one, runs on the lane's worker thread, started on first use. So ops on
one lane run in the order they were issued, and a send and a receive, on
lanes of their own, can be in flight at once as they must.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from datetime import timedelta

from collective.types import CollectiveError, bounded_timeout
from collective.work import Work

_JOIN_S = 5.0
"""The longest ``stop`` waits for a worker thread to end."""


class Task(Work):
    """One op submitted to a lane; its ``Work``.

    ``run`` calls the op's body, which returns normally or raises the op's
    failure, already turned into the error the caller sees.
    """

    def __init__(self, body: Callable[[], None], expired: Callable[[timedelta], BaseException]):
        """Wrap ``body``; ``expired(timeout)`` makes the error of a ``wait`` that ran out."""
        self._body = body
        self._expired = expired
        self._done = threading.Event()
        self._error: BaseException | None = None

    def run(self) -> None:
        """Run the op once and record its outcome."""
        try:
            self._body()
        except BaseException as exc:
            self._error = exc
        finally:
            self._body = _nothing
            self._done.set()

    def cancel(self, error: BaseException) -> None:
        """End a task that never started with ``error``."""
        self._error = error
        self._body = _nothing
        self._done.set()

    def wait(self, timeout: timedelta | None = None) -> None:
        """Block until the op has finished, or raise its failure.

        Raises:
            CollectiveTimeoutError: ``timeout`` passed first; the group is unusable.
            CollectiveError: the op failed.

        """
        timeout = bounded_timeout(timeout)
        if timeout is None:
            self._done.wait()
        elif not self._done.wait(timeout.total_seconds()):
            raise self._expired(timeout)
        if self._error is not None:
            raise self._error

    def is_completed(self) -> bool:
        """Return whether the op has finished, successfully or not."""
        return self._done.is_set()

    def exception(self) -> BaseException | None:
        """Return the op's failure once it has finished with one, else None."""
        return self._error if self._done.is_set() else None


def _nothing() -> None:
    """Do nothing: the body of a task that has run."""


class Lane:
    """One ordered stream of ops with a worker thread for those that cannot run inline."""

    def __init__(self, name: str) -> None:
        """Make an idle lane; ``name`` names its worker thread."""
        self._name = name
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._queue: deque[Task] = deque()
        self._busy = False
        self._stopped: BaseException | None = None
        self._worker: threading.Thread | None = None

    def enter(self) -> bool:
        """Claim the idle lane for one blocking op in this thread; False if it is not idle.

        A caller that got True runs its op, then calls ``leave``. This is ``submit``
        of a blocking op without the task: the common case, made cheap.
        """
        with self._lock:
            if self._busy or self._queue or self._stopped is not None:
                return False
            self._busy = True
            return True

    def leave(self) -> None:
        """Release the lane claimed by ``enter``."""
        with self._lock:
            self._busy = False
            if self._queue:
                self._cond.notify_all()

    def submit(self, task: Task, async_op: bool) -> Task:
        """Run ``task`` now in this thread if it is blocking and the lane idle, else queue it.

        A blocking task that had to queue is waited for before this returns.
        """
        with self._cond:
            if self._stopped is not None:
                task.cancel(self._stopped)
                return task
            inline = not async_op and not self._busy and not self._queue
            if inline:
                self._busy = True
            else:
                self._queue.append(task)
                self._start_worker()
                self._cond.notify_all()
        if inline:
            try:
                task.run()
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
        elif not async_op:
            task.wait()
        return task

    def _start_worker(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name=self._name, daemon=True)
            self._worker.start()

    def _work(self) -> None:
        while True:
            with self._cond:
                while self._stopped is None and (self._busy or not self._queue):
                    self._cond.wait()
                if self._stopped is not None:
                    return
                task = self._queue.popleft()
                self._busy = True
            try:
                task.run()
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def active(self) -> bool:
        """Return whether an op runs on this lane or waits to."""
        with self._cond:
            return self._busy or bool(self._queue)

    def idle(self, seconds: float) -> bool:
        """Wait up to ``seconds`` until no op runs on this lane; return whether none does."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._busy, seconds)

    def stop(self, error: CollectiveError) -> None:
        """Refuse new ops, end queued ones with ``error``, and end the worker thread.

        An op already running keeps running; the caller makes it give up.
        """
        with self._cond:
            self._stopped = error
            queued, self._queue = list(self._queue), deque()
            self._cond.notify_all()
        for task in queued:
            task.cancel(error)
        worker, self._worker = self._worker, None
        if worker is not None and worker is not threading.current_thread():
            worker.join(_JOIN_S)


class Lanes:
    """A group's lanes by name, each started on first use."""

    def __init__(self, group_name: str) -> None:
        """Name the lanes' worker threads after ``group_name``."""
        self._prefix = f"collective-{group_name}-"
        self._lanes: dict[str, Lane] = {}

    def get(self, name: str) -> Lane:
        """Return the lane ``name``, made on first use."""
        lane = self._lanes.get(name)
        if lane is None:
            lane = self._lanes.setdefault(name, Lane(self._prefix + name))
        return lane

    def run(
        self,
        name: str,
        run: Callable[[], None],
        expired: Callable[[timedelta], BaseException],
        async_op: bool,
    ) -> Work | None:
        """Run ``run`` as an op on lane ``name``: inline when it is blocking and the lane idle.

        Returns the op's ``Task`` when ``async_op``, else None once the op has run
        (in this thread, or on the lane's thread behind the ops queued before it).
        ``expired(timeout)`` makes the error of a ``wait`` on the task that runs out.
        """
        lane = self.get(name)
        if not async_op and lane.enter():
            try:
                run()
            finally:
                lane.leave()
            return None
        task = Task(run, expired)
        lane.submit(task, async_op)
        if async_op:
            return task
        task.wait()
        return None

    def active(self) -> bool:
        """Return whether an op runs, or waits to, on any lane."""
        return any(lane.active() for lane in list(self._lanes.values()))

    def stop(self, error: CollectiveError) -> list[Lane]:
        """Stop every lane with ``error`` (see ``Lane.stop``), forget them, and return them."""
        lanes, self._lanes = list(self._lanes.values()), {}
        for lane in lanes:
            lane.stop(error)
        return lanes
