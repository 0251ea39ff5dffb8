"""The step protocol of the collective slots: who may write a slot, and when it may be read.

Every collective among the local ranks is a sequence of steps, numbered across
ops, that every local rank takes part in. In step ``s`` a rank may write its
slot ``s % nbuf``, then posts ``s + 1``; a reader waits for the writer's post,
checks the slot's header, reads, and every rank finally marks ``s + 1``
consumed. A rank may write slot ``s % nbuf`` once every other rank has consumed
step ``s - nbuf``, so a writer runs at most ``nbuf - 1`` steps ahead of its
slowest reader, and the slots pipeline a long message.

Each slot's header names the op it belongs to and its signature: the op, dtype,
reduction and root as ``signature.pack`` packs them into one word, and the op's
bytes. A reader that finds another op there knows the ranks called different ops
or passed different arguments, and says so instead of reading wrong data.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from collective import signature
from collective.frameworks.dtypes import ITEMSIZE, NAMES
from collective.groups.shm.arena import (
    CONSUMED,
    HDR_BLAME,
    HDR_BYTES,
    HDR_OP,
    HDR_SIG,
    OP_SEQ,
    POSTED,
    Arena,
)
from collective.groups.shm.sync import Counter, Waiter
from collective.types import ReduceOp

_WHOLE = signature.PACKED_FREE_BIT
"""The flag of a packed signature that describes a user's whole op (see ``Steps.begin_whole``)."""

VECTOR_RANKS = 8
"""From this many local ranks on, ``Steps.free`` and ``Steps.gather`` first look at every
rank's counter or header in one numpy call (about 1 us), not one Python call per rank
(about 0.3 us each): fewer ranks take the loop alone."""

Key = tuple[str, str, int, int]
"""An op's signature as ``Steps.begin`` takes it: op, dtype ("": none), reduction, root."""


class MismatchError(Exception):
    """A peer's slot holds another op than this rank's: the ranks diverged."""


def pack(key: Key, whole: bool = False) -> int:
    """Return the packed signature of ``key``; see ``signature.pack``."""
    op, dtype, reduce_op, root = key
    known = dtype if dtype in ITEMSIZE else None  # a group's own ops may move other dtypes
    call = signature.Call(
        op, known, root=root, reduce_op=None if reduce_op < 0 else ReduceOp(reduce_op)
    )
    return signature.pack(signature.encode(call)) | (_WHOLE if whole else 0)


def describe(word: int, nbytes: int, ranks: Sequence[int]) -> tuple[str, dict[str, str]]:
    """Return the op that a header's packed ``word`` and ``nbytes`` describe, and its fields.

    ``ranks`` maps local ranks to the group's ranks: the root of a stage is a local
    rank, that of a whole op (``Steps.begin_whole``) a rank of the group already.
    """
    words = signature.unpack(word & ~_WHOLE)
    root = words[signature.ROOT]
    if words[signature.OP] == signature.OP_CODES["relay"]:
        words[signature.ROOT] = signature.UNSET
    elif not word & _WHOLE and 0 <= root < len(ranks):
        words[signature.ROOT] = ranks[root]
    code = words[signature.DTYPE]
    dtype = NAMES[code] if 0 <= code < len(NAMES) else ""
    words[signature.COUNT] = nbytes // signature.itemsize(dtype)
    fields = signature.shown(words)
    try:
        return signature.describe(signature.decode(words)), fields
    except (IndexError, ValueError):
        return "an unknown op", fields


def counters(arena: Arena, kind: int) -> list[Counter]:
    """Return the ``kind`` counter (POSTED or CONSUMED) of every local rank of ``arena``."""
    result = []
    for rank in range(arena.layout.local_size):
        flags = arena.flags(rank, kind)
        result.append(
            Counter(
                arena.control[rank],
                kind,
                arena.control_address(rank, kind),
                flags,
                flags.view(np.int64),
                rank,
            )
        )
    return result


class Steps:
    """One local rank's side of the step protocol on one arena."""

    def __init__(
        self,
        arena: Arena,
        local_rank: int,
        waiter: Waiter,
        ranks: Sequence[int] | None = None,
        gather_bytes: int = 0,
    ) -> None:
        """Take part as ``local_rank`` in the steps of ``arena``.

        ``ranks`` maps local ranks to the group's ranks, for messages (None: the same).
        ``gather_bytes``: the longest allreduce that local rank 0 gathers and reduces for
        every rank, and barriers too (see ``gathered``); 0: none, every rank reads every
        other's slot. Every local rank must pass the same.
        """
        layout = arena.layout
        self.ranks = list(ranks) if ranks is not None else list(range(layout.local_size))
        self.size = layout.local_size
        self.rank = local_rank
        self.slot_bytes = layout.slot_bytes
        self.nbuf = layout.nbuf
        self.waiter = waiter
        self.slots = [[arena.slot(r, b) for b in range(layout.nbuf)] for r in range(self.size)]
        self._headers = [
            [arena.slot_headers[r, b] for b in range(self.nbuf)] for r in range(self.size)
        ]
        self.posted = counters(arena, POSTED)
        self.consumed = counters(arena, CONSUMED)
        self._control = arena.control[local_rank]
        self._others = [r for r in range(self.size) if r != local_rank]
        self._vector = self.size >= VECTOR_RANKS
        self._posted_all = arena.control[:, POSTED]
        self._consumed_all = arena.control[:, CONSUMED]
        self._tables = [arena.slot_headers[:, b, :HDR_BLAME] for b in range(self.nbuf)]
        self.gather_bytes = gather_bytes
        self.step = 0
        self.op = 0
        self._sig = 0
        self._nbytes = 0
        self._words: dict[tuple[Key, bool], int] = {}

    @property
    def others(self) -> list[int]:
        """Return the other local ranks."""
        return self._others

    def begin(
        self, kind: str, dtype: str = "", reduce_op: int = -1, root: int = -1, nbytes: int = 0
    ) -> None:
        """Start an op ``kind`` with these arguments: count it, and announce it."""
        self.begin_signed(self.signature_word((kind, dtype, reduce_op, root)), nbytes)

    def begin_whole(self, kind: str, dtype: str, reduce_op: int, root: int, nbytes: int) -> None:
        """Start the check of a user's whole op ``kind`` (``root`` a rank of the group).

        A group that spans nodes runs each op in stages; this signature, which no
        stage carries, lets the node's ranks compare the op they were called with.
        """
        key = (kind, dtype, reduce_op, root)
        self.begin_signed(self.signature_word(key, whole=True), nbytes)

    def signature_word(self, key: Key, whole: bool = False) -> int:
        """Return ``pack(key, whole)``, packed once per key."""
        word = self._words.get((key, whole))
        if word is None:
            word = self._words[(key, whole)] = pack(key, whole)
        return word

    def begin_signed(self, word: int, nbytes: int) -> None:
        """Start an op whose signature packs into ``word``; see ``begin``."""
        self.op += 1
        self._control[OP_SEQ] = self.op
        self._sig = word
        self._nbytes = nbytes

    def slot(self, step: int) -> np.ndarray:
        """Return this rank's slot for ``step``."""
        return self.slots[self.rank][step % self.nbuf]

    def peer_slot(self, rank: int, step: int) -> np.ndarray:
        """Return ``rank``'s slot for ``step``."""
        return self.slots[rank][step % self.nbuf]

    def put(self, target: np.ndarray, values: np.ndarray) -> None:
        """Write the host array ``values`` into ``target``, a part of a slot."""
        target[...] = values

    def free(self, step: int, deadline: float) -> None:
        """Wait until every other rank has consumed what this rank wrote ``nbuf`` steps ago.

        Among ``VECTOR_RANKS`` or more, one look at every rank's counter at once
        settles the common case, so a rank's cost per step does not grow by a Python
        call per rank.
        """
        target = step - self.nbuf + 1
        if target <= 0 or (self._vector and self._consumed_all.min() >= target):
            return
        wait, consumed = self.waiter.wait, self.consumed
        for rank in self._others:
            wait(consumed[rank], target, deadline)

    def post(self, step: int) -> None:
        """Announce that this rank's slot for ``step`` holds its data.

        It writes the slot's header, so ``free`` must have returned for ``step`` first,
        even when the step carries no data.
        """
        header = self._headers[self.rank][step % self.nbuf]
        header[HDR_OP] = self.op
        header[HDR_SIG] = self._sig
        header[HDR_BYTES] = self._nbytes
        header[HDR_BLAME] = 0
        self.waiter.advance(self.posted[self.rank], step + 1)

    def collect(self, rank: int, step: int, deadline: float) -> None:
        """Wait until ``rank`` has posted ``step``, and check that it is the same op.

        Raises:
            MismatchError: ``rank`` is in another op, or one with other arguments.

        """
        self.waiter.wait(self.posted[rank], step + 1, deadline)
        header = self._headers[rank][step % self.nbuf]
        op, sig, nbytes = int(header[HDR_OP]), int(header[HDR_SIG]), int(header[HDR_BYTES])
        if op != self.op or sig != self._sig or nbytes != self._nbytes:
            raise MismatchError(self._mismatch(rank, op, sig, nbytes))

    def gather(self, step: int, deadline: float) -> None:
        """Collect ``step`` from every other rank, as the one rank that reads all their slots.

        On the first rank found in another op, this rank posts ``step`` naming that rank
        and its header (``HDR_BLAME``), then raises: the ranks that wait for its step
        with ``collect_gathered`` raise too, although they read no other rank's header.
        This rank must have freed ``step`` and not posted it.

        Raises:
            MismatchError: a rank is in another op, or one with other arguments.

        """
        target, buffer, table = step + 1, step % self.nbuf, self._tables[step % self.nbuf]
        mine = self._headers[self.rank][buffer]
        expected = (self.op, self._sig, self._nbytes)
        mine[HDR_OP], mine[HDR_SIG], mine[HDR_BYTES] = expected
        posted = self.posted
        if not self._vector or np.count_nonzero(self._posted_all >= target) < self.size - 1:
            wait = self.waiter.wait
            for rank in self._others:
                wait(posted[rank], target, deadline)
        if self._vector and (table == table[self.rank]).all():
            return
        for rank in self._others:
            header = self._headers[rank][buffer]
            seen = (int(header[HDR_OP]), int(header[HDR_SIG]), int(header[HDR_BYTES]))
            if seen != expected:
                mine[HDR_BLAME + 1 : HDR_BLAME + 4] = seen
                mine[HDR_BLAME] = rank + 1
                self.waiter.advance(posted[self.rank], target)
                raise MismatchError(self._mismatch(rank, *seen))

    def collect_gathered(self, rank: int, step: int, deadline: float) -> None:
        """Collect ``step`` from ``rank``, which ``gather``-ed it, and check what it found.

        Raises:
            MismatchError: ``rank`` is in another op, or it found a rank that is.

        """
        self.collect(rank, step, deadline)
        header = self._headers[rank][step % self.nbuf]
        blamed = int(header[HDR_BLAME])
        if blamed:
            op, sig, nbytes = (int(w) for w in header[HDR_BLAME + 1 : HDR_BLAME + 4])
            raise MismatchError(self._mismatch(blamed - 1, op, sig, nbytes))

    def _mismatch(self, rank: int, op: int, sig: int, nbytes: int) -> str:
        """Describe how local ``rank``, in its ``op``-th op of packed signature ``sig``, differs."""
        theirs, their_fields = describe(sig, nbytes, self.ranks)
        mine, my_fields = describe(self._sig, self._nbytes, self.ranks)
        who, me = self.ranks[rank], self.ranks[self.rank]
        if op != self.op:
            return (
                f"rank {who} is in its collective #{op} ({theirs}) where rank {me} is in its "
                f"#{self.op} ({mine}): the ranks called a different number of collectives on "
                "the group"
            )
        lines = signature.differences([their_fields, my_fields], [who, me])
        return "; ".join([f"rank {who} called {theirs} where rank {me} called {mine}", *lines])

    def arrive(self, step: int, deadline: float) -> None:
        """Post ``step`` without data: announce this rank's op to the ranks that write to it.

        A rank that only reads in an op posts the op's first step this way, so that its
        writers can ``confirm`` that it runs the same op before they return.
        """
        self.free(step, deadline)
        self.post(step)

    def confirm(self, readers: list[int], step: int, deadline: float) -> None:
        """Check that every rank of ``readers`` arrived at ``step`` in the same op.

        A rank that only writes in an op calls this on the op's first step, so that a
        rank that never reads what it wrote (it runs another op, or the same op with
        another root, size or dtype) is an error here, not a silent loss.

        Raises:
            MismatchError: a reader is in another op, or one with other arguments.

        """
        for rank in readers:
            self.collect(rank, step, deadline)

    def collect_all(self, step: int, deadline: float) -> None:
        """Collect ``step`` from every other rank."""
        for rank in self._others:
            self.collect(rank, step, deadline)

    def done(self, step: int) -> None:
        """Mark ``step`` consumed by this rank; its writers may reuse their slots."""
        self.waiter.advance(self.consumed[self.rank], step + 1)

    def next(self) -> int:
        """Return the next step's number and count it taken."""
        step = self.step
        self.step += 1
        return step

    def release(self) -> None:
        """Drop every view of the arena, so that it can be unmapped; no step may follow."""
        self.slots, self.posted, self.consumed, self._headers = [], [], [], []
        self._posted_all = self._consumed_all = np.zeros(0, np.int64)
        self._tables = []
        self._control = np.zeros(OP_SEQ + 1, np.int64)

    def all_counters(self) -> list[Counter]:
        """Return every counter of the arena's slots, to wake their sleepers."""
        return self.posted + self.consumed
