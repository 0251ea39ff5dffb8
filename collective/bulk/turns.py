"""One bulk call at a time on a group: a call waits until the group's running one has ended.

A bulk call is many ops: its agreement, then its buckets. Two calls on one group
from two threads would interleave those ops, and their data with them. So each call
takes the group's turn before its agreement and gives it back once its last op has
ended: a blocking call when it returns, an async one when its ``Work`` completes (in
its own thread). A call that finds the turn taken waits for it, up to the bound of
the running call (``Turn.bound``), which ends by then: each of its ops has a timeout.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

from collective.groups.base import BaseGroup
from collective.types import LONGEST_TIMEOUT, CollectiveTimeoutError

AGREEMENT_OPS = 4
"""Ops a bulk call's agreement takes at most: a bound of its time, in op timeouts."""


class Turn:
    """One bulk call's hold on its group; ``release`` gives it back (once)."""

    def __init__(self, board: _Board, op: str, timeout: timedelta) -> None:
        """Hold ``board``'s group for ``op``, whose agreement takes at most ``AGREEMENT_OPS``."""
        self._board = board
        self.op = op
        self.deadline = 0.0
        self.bound(AGREEMENT_OPS, timeout)

    def bound(self, ops: int, timeout: timedelta) -> None:
        """Say that the call ends within ``ops`` ops of ``timeout`` each, from now."""
        self.deadline = time.monotonic() + ops * timeout.total_seconds()

    def release(self) -> None:
        """Give the group's turn back, to the next call waiting; a second call does nothing."""
        self._board.release(self)


class _Board:
    """The turn of one group's bulk calls."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._holder: Turn | None = None

    def take(self, group: BaseGroup, op: str, timeout: timedelta) -> Turn:
        with self._cond:
            while self._holder is not None:
                left = self._holder.deadline - time.monotonic()
                if left <= 0:
                    running = self._holder.op
                    raise CollectiveTimeoutError(
                        op,
                        group.group_name,
                        group.rank,
                        timeout,
                        f"the {running} call running on the group did not end in time",
                    )
                self._cond.wait(min(left, LONGEST_TIMEOUT.total_seconds()))
            self._holder = Turn(self, op, timeout)
            return self._holder

    def release(self, turn: Turn) -> None:
        with self._cond:
            if self._holder is turn:
                self._holder = None
                self._cond.notify_all()


_boards: weakref.WeakKeyDictionary[BaseGroup, _Board] = weakref.WeakKeyDictionary()
_boards_lock = threading.Lock()


@contextmanager
def held(group: BaseGroup, op: str) -> Iterator[Turn]:
    """Wait until no other bulk call runs on ``group``; give the block this call's turn.

    The turn is given back if the block raises; otherwise the block hands it on
    (to ``pipeline.start``), which gives it back once the call's ops have ended.
    Until the call says more (``Turn.bound``), its bound is that of an agreement
    under the group's timeout.

    Raises:
        CollectiveTimeoutError: the running call did not end within its bound.

    """
    with _boards_lock:
        board = _boards.get(group)
        if board is None:
            board = _boards[group] = _Board()
    turn = board.take(group, op, group.timeout)
    try:
        yield turn
    except BaseException:
        turn.release()
        raise
