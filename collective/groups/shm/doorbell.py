"""The gathering rank's wait for every other local rank's post: one sleep, one wake-up.

In a gathered op (see ``gathered``) local rank 0 waits for the step of every other
local rank. Waiting on their counters one by one would wake it once per rank, and
polling or yielding would keep it runnable beside the very ranks it waits for, on a
node where they outnumber the cores. So it sleeps on one word of its own control
block, its doorbell (``arena.BELL``), and the rank whose post completes the step
rings it: writes the step there and wakes it. Every step costs the gatherer one
wake-up, whatever the number of ranks.

The gatherer marks itself asleep (``arena.BELL_ASLEEP``), then, past a full fence,
looks at every counter once more before it sleeps; a poster writes its counter,
then, past a fence too, reads the mark and every counter. Of two such orders one
sees the other's store, so either the gatherer sees the last post, or the last
poster sees the mark (and every post: its fence is the last of the posters'). The
kernel sleeps only while the doorbell still holds what the gatherer read before it
looked, so a ring between its look and its sleep is not lost. A ring it does not
need (a poster that sees the mark as the gatherer wakes) costs one spurious wake-up.

Sleeps last one slice at most (``sync.SLICE_S``), between which the gatherer looks
at what makes the wait hopeless, the death of any rank that has not posted among
them, as every wait does.
"""

from __future__ import annotations

import numpy as np

from collective.groups.shm.arena import BELL, BELL_ASLEEP, POSTED, Arena
from collective.groups.shm.sync import Waiter, kernel


class Doorbell:
    """One local rank's side of the doorbell of the gathering rank ``owner`` of an arena."""

    def __init__(self, arena: Arena, owner: int, waiter: Waiter) -> None:
        """Ring, or as ``owner`` sleep on, the doorbell of local rank ``owner`` of ``arena``."""
        self._waiter = waiter
        self._block = arena.control[owner]
        self._address = arena.control_address(owner, BELL)
        self._posted = arena.control[:, POSTED]
        self._owner = owner
        self._others = arena.layout.local_size - 1
        self._kernel = kernel()

    def _all_posted(self, target: int) -> bool:
        """Return whether every rank but the owner has posted ``target``.

        The owner posts ``target`` only once the others have, so counting it cannot
        make the answer wrong.
        """
        return int(np.count_nonzero(self._posted >= target)) >= self._others

    def wait(self, target: int, deadline: float) -> None:
        """As the owner, return once every other local rank has posted ``target``.

        Raises:
            TimeoutError: ``deadline`` (a ``time.monotonic`` time) passed first.
            PeerDiedError: the process of a rank that has not posted exited.
            AbortedError: another rank aborted, or this process gave up on the group.

        """
        if self._all_posted(target):
            return
        block, waiter = self._block, self._waiter
        try:
            while True:
                rung = int(block[BELL])
                block[BELL_ASLEEP] = 1
                self._kernel.fence()
                if self._all_posted(target):
                    return
                late = [int(r) for r in np.flatnonzero(self._posted < target) if r != self._owner]
                waiter.hopeless(late, deadline)
                waiter.sleep(self._address, rung, deadline)
        finally:
            block[BELL_ASLEEP] = 0

    def ring(self, target: int) -> None:
        """Wake the owner if it sleeps and this rank's post of ``target`` was the last one.

        Call it right after posting ``target``, whose advance fenced the post.
        """
        block = self._block
        if block[BELL_ASLEEP] and self._all_posted(target):
            block[BELL] = target
            self._kernel.wake(self._address)

    def release(self) -> None:
        """Drop the views of the arena, so that it can be unmapped."""
        self._block = np.zeros(BELL_ASLEEP + 1, np.int64)
        self._posted = np.zeros(0, np.int64)
