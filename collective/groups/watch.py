"""FailureWatch: spread one rank's transport failure to every rank of its group at once.

Gloo fails an op quickly on the ranks whose connection to a dead peer breaks, but
a rank waiting on a live peer that has itself given up only learns at the op's
timeout: gloo's pending receives are not woken when another pair closes. So a
rank that sees a failure writes it under every other rank's abort key in the
group's rendezvous store, and each rank keeps one thread blocked on its own key.
When the key is set, the thread records the failure, and every wait of that
rank's ops sees it within one wait slice (50 ms). Any text but a progress query
(``progress.py``) or the stop marker counts as a failure report, whoever wrote it;
the first one is kept. Each time it wakes, the thread deletes the key, publishes the
rank's op count for the ranks asking, and goes on watching, until the stop marker;
then the rank's final count stays in the store for later askers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from collective.groups import progress
from collective.rendezvous.store import RendezvousStore, abort_key, reason_key, report_failure
from collective.types import CollectiveError

_STOP = b"\x00stop"
"""Written under a rank's own abort key to end its watch thread."""

_WATCH_PERIOD = timedelta(hours=1)
"""How long one blocking read of the abort key lasts before it is issued again."""

_SLICE_S = 0.05
"""How long one slice of an op's wait lasts: the delay before a reported failure is seen."""

_SLICE_EXPIRED = "timed out"
"""What torch's message says when a timed wait on a work runs out, the work still pending."""

_JOIN_S = 10.0
"""The longest ``stop`` waits for the watch thread to end."""


def _waited(work: Any, seconds: float) -> bool:
    """Wait up to ``seconds`` for the torch ``work``; return whether it has finished.

    A work that ends with an error counts as finished: its next plain ``wait``
    raises that error. Composite works (gloo's reduce_scatter) never report
    ``is_completed``, so a timed wait that returns is what says they are done.
    """
    start = time.monotonic()
    try:
        work.wait(timedelta(seconds=seconds))
    except RuntimeError as exc:
        expired = _SLICE_EXPIRED in str(exc) and time.monotonic() - start >= seconds / 2
        return work.is_completed() or not expired
    return True


class FailureWatch:
    """Watch one rank's abort key, and report this rank's failures to the others."""

    def __init__(
        self,
        store: RendezvousStore,
        rank: int,
        world_size: int,
        group_name: str,
        op_count: Callable[[], int] = lambda: 0,
        on_failure: Callable[[str], None] | None = None,
        last_op: Callable[[], str] = str,
    ) -> None:
        """Start the watch thread of ``rank``; it answers progress queries with ``op_count()``.

        ``on_failure(report)`` runs in the watch thread once another rank reports a
        failure, to end at once what no wait slice looks at (another group's op).
        ``last_op()`` names the last op counted, for the answers ("" if not kept).
        """
        self._store = store
        self._watched = store.watcher()
        self._rank = rank
        self._world_size = world_size
        self._op_count = op_count
        self._last_op = last_op
        self._on_failure = on_failure
        self._failure: str | None = None
        self._reported = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(
            target=self._watch, name=f"collective-watch-{group_name}", daemon=True
        )
        self._thread.start()

    @property
    def failure(self) -> str | None:
        """Return what another rank reported, or None while no failure is known."""
        return self._failure

    def awaited(self, seconds: float) -> str | None:
        """Return what another rank reports within ``seconds`` (or has already), else None."""
        self._reported.wait(seconds)
        return self._failure

    def _watch(self) -> None:
        key = abort_key(self._rank)
        while not self._stopped:
            try:
                value = self._watched.get(key, _WATCH_PERIOD)
            except TimeoutError:
                continue
            except (CollectiveError, RuntimeError):
                return
            if value == _STOP:
                return
            if self._failure is None:
                reported = value if not progress.is_query(value) else self._reason()
                if reported is not None:
                    self._failure = reported.decode(errors="replace")
                    self._reported.set()
                    if self._on_failure is not None:
                        self._on_failure(self._failure)
            try:
                self._watched.delete(key)
            except (CollectiveError, TimeoutError, RuntimeError):
                return
            count, last = self._op_count(), self._last_op()
            progress.publish(self._watched, self._rank, count, last)

    def _reason(self) -> bytes | None:
        """Return a failure reported to this rank whose ring a progress query replaced."""
        try:
            return self._watched.peek(reason_key(self._rank))
        except (CollectiveError, RuntimeError):
            return None

    def progress(self, op_number: int, wait: timedelta = progress.ANSWER_WAIT, op: str = "") -> str:
        """Ask the other ranks how far they got; describe who never joined op ``op_number``.

        The answers are waited for up to ``wait`` in all; ``op`` is this rank's op.
        """
        store, rank, size = self._store, self._rank, self._world_size
        return progress.ask(store, rank, size, op_number, abort_key, wait, op)

    def report(self, failure: str) -> None:
        """Tell every other rank that this one failed with ``failure``; never raises."""
        if self._failure is not None:
            return
        message = f"rank {self._rank} reported: {failure}".encode()
        for rank in range(self._world_size):
            if rank == self._rank:
                continue
            try:
                report_failure(self._store, rank, message)
            except (CollectiveError, TimeoutError, RuntimeError):
                return

    def wait(self, work: Any, timeout: timedelta | None) -> tuple[bool, str | None]:
        """Wait until the torch ``work`` finishes, a failure is reported, or ``timeout``.

        The wait runs in torch, without the GIL, in slices of ``_SLICE``; between
        slices it looks for a reported failure; once one is, the op gets one more slice
        to end by itself. An op that finishes within the first slice, the common case,
        costs one plain torch wait.

        Returns:
            Whether ``work`` finished (well or not; its ``wait`` then returns or
            raises at once), and the failure another rank reported, if any. A
            work that did not finish still runs in gloo until its own timeout,
            or until the group closes its connections.

        """
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        while True:
            left = _SLICE_S if deadline is None else min(_SLICE_S, deadline - time.monotonic())
            if left > 0 and _waited(work, left):
                return True, None
            if self._failure is not None:
                # The report may echo this rank's own failure: gloo closes every connection
                # of a rank whose op timed out, so a peer fails and reports at once, and this
                # rank's op, which ends with its own more precise error, comes a moment after.
                return (True, None) if _waited(work, _SLICE_S) else (False, self._failure)
            if deadline is not None and time.monotonic() >= deadline:
                return False, None

    def stop(self) -> None:
        """End the watch thread; the group no longer hears of other ranks' failures.

        The rank's op count is final from here on, and still true: it is left in the
        store for the ranks that ask after the thread has ended (``progress.settle``),
        and published once more for a query that rang as it ended (unless the store
        could not be reached).
        """
        self._stopped = True
        count, last = self._op_count(), self._last_op()
        reached = progress.settle(self._store, self._rank, count, last)
        if self._thread.is_alive():
            try:
                self._store.set(abort_key(self._rank), _STOP)
            except (CollectiveError, TimeoutError, RuntimeError):
                pass
            self._thread.join(_JOIN_S)
        if reached:
            progress.publish(self._store, self._rank, count, last)
