"""A gathered step finished by the rank whose post completes it, not by a fixed rank.

On a crowded node (more local ranks than cores) a short allreduce or a barrier is one
step that every local rank posts (see ``gathered``). The rank that finds every rank
posted checks every header, reduces the slots in rank order into the second half of
its own slot, and says so: it writes its ``FINISHED`` counter, then the arena's
``DONE_WORD``. Every other rank waits for ``DONE_WORD`` and copies the result of a
rank whose ``FINISHED`` has the step.

Why not a fixed rank: with more ranks than cores, a rank that waits yields its core
and stays runnable, so the scheduler runs every rank of a core in turn. A fixed
gatherer that looks too early waits for its next turn behind every other rank of its
core, each of which is scheduled for nothing; the rank that posts last is running
already and holds every input. So one turn per rank per op completes it: each rank,
in its turn, copies the last result, posts its next contribution and yields, and the
last of them finishes the step. Sleeping instead of yielding would let a core go idle,
and waking a rank on an idle core costs tens of microseconds on a virtual machine.

The rank that sees every rank posted right after its own post finishes the step. At
least one does: a rank posts, fences, then looks at every counter, so the rank whose
fence comes last sees every post. Two may: both check the same headers and write the
same bits, each in its own slot, and the word names either. A rank that waits looks
for every post too once its polls are spent, and between sleeps, and finishes the step
itself if no one has: a last poster in another op, or a finisher that was descheduled
or died, delays nobody past that. The common path costs a rank one vector look at the
counters and scalar reads, each numpy call being a few microseconds on a cold core.

A rank in another op (or with other arguments) is found by every finisher, which
blames it in its own header before it says done; every rank raises, having written
nothing. Slots stay safe without more waits: a rank writes the step after next into
a buffer only once every rank has posted the next step, that is once every rank has
read this one.
"""

from __future__ import annotations

import numpy as np

from collective.groups.shm.arena import DONE_SHIFT, DONE_WORD, HDR_BLAME, POSTED, WORD, Arena
from collective.groups.shm.sync import Counter, Waiter

_WHO = (1 << DONE_SHIFT) - 1
"""The bits of ``DONE_WORD`` that name the finishing rank."""


class BlamedError(Exception):
    """A finisher found ``rank`` in another op, whose header held ``seen`` (op, sig, bytes)."""

    def __init__(self, rank: int, seen: tuple[int, int, int]) -> None:
        """Record the rank blamed and what its header held."""
        super().__init__(f"local rank {rank} is in another op")
        self.rank = rank
        self.seen = seen


class Finish:
    """One local rank's side of the finished steps of one arena."""

    def __init__(self, arena: Arena, local_rank: int, waiter: Waiter, result_at: int) -> None:
        """Take part as ``local_rank``; results start ``result_at`` bytes into each slot."""
        layout = arena.layout
        self._me = local_rank
        self._size = layout.local_size
        self._waiter = waiter
        self._posted = arena.control[:, POSTED]
        self._headers = arena.slot_headers
        self._tables = [arena.slot_headers[:, b, :HDR_BLAME] for b in range(layout.nbuf)]
        self._nbuf = layout.nbuf
        flags = arena.done_flags()
        address = arena.address + DONE_WORD * WORD
        self.done = Counter(arena.header, DONE_WORD, address, flags, flags.view(np.int64), -1)
        """``DONE_WORD`` as a counter, to wait and sleep on; ``owner`` -1: any rank writes it."""
        self.results = [
            [arena.slot(r, b)[result_at:] for r in range(self._size)] for b in range(self._nbuf)
        ]
        """Per slot buffer, every local rank's result area, as bytes."""
        self._target = 0

    def settle(self, step: int, deadline: float) -> int:
        """Wait until ``step`` (posted by this rank) is finished, or this rank must finish it.

        Returns the local rank whose result to read, or -1: this rank checked every
        header, found them alike, and must write its result and ``publish`` the step.

        Raises:
            BlamedError: a rank is in another op; a finisher has said so, or this rank
                found it and has published the step.
            TimeoutError, PeerDiedError, AbortedError: as ``Waiter.wait``.

        """
        target = step + 1
        word = target << DONE_SHIFT
        cells = self.done.cells
        if cells[DONE_WORD] < word and self._posted.min() < target:
            self._target = target
            waited = self._waiter.wait_or(self.done, word, deadline, self._all_posted, self._late)
            if not waited and cells[DONE_WORD] < word:
                return self._check(step)
        elif cells[DONE_WORD] < word:
            return self._check(step)
        who = int(cells[DONE_WORD]) & _WHO
        header = self._headers[who, step % self._nbuf]
        blamed = int(header[HDR_BLAME])
        if blamed:
            seen = header[HDR_BLAME + 1 : HDR_BLAME + 4].tolist()
            raise BlamedError(blamed - 1, (seen[0], seen[1], seen[2]))
        return who

    def _check(self, step: int) -> int:
        """As the rank that finishes ``step``, compare every header with its own; -1 if alike."""
        buffer = step % self._nbuf
        table = self._tables[buffer]
        if (table == table[self._me]).all():
            return -1
        mine = table[self._me].tolist()
        for rank in range(self._size):
            seen = table[rank].tolist()
            if seen != mine:
                header = self._headers[self._me, buffer]
                header[HDR_BLAME + 1 : HDR_BLAME + 4] = seen
                header[HDR_BLAME] = rank + 1
                self.publish(step)
                raise BlamedError(rank, (seen[0], seen[1], seen[2]))
        return -1

    def publish(self, step: int) -> None:
        """Say that this rank finished ``step``: its result, or its blame, is written."""
        self._waiter.advance(self.done, (step + 1) << DONE_SHIFT | self._me)

    def _all_posted(self) -> bool:
        """Return whether every rank has posted the step awaited."""
        return bool(self._posted.min() >= self._target)

    def _late(self) -> list[int]:
        """Return the local ranks that have not posted the step awaited."""
        return [int(r) for r in np.flatnonzero(self._posted < self._target)]

    def release(self) -> None:
        """Drop every view of the arena, so that it can be unmapped; no step may follow."""
        self.results = []
        self._tables = []
        self._posted = np.zeros(1, np.int64)
        self._headers = np.zeros((0, self._nbuf, HDR_BLAME + 4), np.int64)
        flags = np.zeros(WORD, np.uint8)
        self.done = Counter(np.zeros(DONE_WORD + 1, np.int64), DONE_WORD, 0, flags, flags, -1)
