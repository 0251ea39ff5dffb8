"""The step protocol of the collective slots: who may write a slot, and when it may be read.

Every collective among the local ranks is a sequence of steps, numbered across
ops, that every local rank takes part in. In step ``s`` a rank may write its
slot ``s % nbuf``, then posts ``s + 1``; a reader waits for the writer's post,
checks the slot's header, reads, and every rank finally marks ``s + 1``
consumed. A rank may write slot ``s % nbuf`` once every other rank has consumed
step ``s - nbuf``, so a writer runs at most ``nbuf - 1`` steps ahead of its
slowest reader, and the slots pipeline a long message.

Each slot's header names the op it belongs to and its signature (kind, dtype,
reduction, root, bytes). A reader that finds another op there knows the ranks
called different ops or passed different arguments, and says so instead of
reading wrong data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from collective.groups.shm.arena import (
    CONSUMED,
    HDR_BYTES,
    HDR_OP,
    HDR_SIG,
    OP_SEQ,
    POSTED,
    Arena,
)
from collective.groups.shm.sync import Counter, Waiter
from collective.tensor import DTYPES
from collective.types import ReduceOp

KINDS = (
    "barrier",
    "broadcast",
    "reduce",
    "allreduce",
    "allgather",
    "reducescatter",
    "gather",
    "scatter",
    "alltoall",
    "relay",
)
_DTYPE_CODES = {name: i + 1 for i, name in enumerate(sorted(DTYPES))}
_DTYPE_NAMES = {code: name for name, code in _DTYPE_CODES.items()}
_NUMPY_NAMES = {"bfloat16": "int16"}
_WHOLE = 0x80
"""The kind byte's flag of a signature that describes a whole op (see ``Signature.whole``)."""
"""Dtypes numpy lacks, by a numpy dtype of their item size."""


def itemsize(dtype: str) -> int:
    """Return the bytes of one element of ``dtype`` (a dtype name; 1 for an empty name)."""
    return np.dtype(_NUMPY_NAMES.get(dtype, dtype)).itemsize if dtype else 1


def dtype_code(dtype: str) -> int:
    """Return the small number that stands for ``dtype`` in slot and mailbox headers."""
    return _DTYPE_CODES[dtype]


class MismatchError(Exception):
    """A peer's slot holds another op than this rank's: the ranks diverged."""


@dataclass(frozen=True)
class Signature:
    """What an op's slots must carry on every rank: its kind, dtype, reduction, root, bytes.

    ``whole`` marks the signature of the user's whole op, as a group that spans
    nodes checks it among a node's ranks before any stage runs: its root is a rank
    of the group, not a local rank, and its reduction is the user's (AVG included).
    """

    kind: str
    dtype: str = ""
    reduce_op: int = -1
    root: int = -1
    nbytes: int = 0
    whole: bool = False

    def word(self) -> int:
        """Return the signature packed into one int64 (the byte count aside)."""
        kind = KINDS.index(self.kind) + 1 | (_WHOLE if self.whole else 0)
        dtype = _DTYPE_CODES.get(self.dtype, 0)
        return kind | dtype << 8 | (self.reduce_op + 1) << 16 | (self.root + 1) << 24

    @classmethod
    def unpack(cls, word: int, nbytes: int) -> Signature:
        """Return the signature that ``word`` packs, with ``nbytes``; unknown fields stay blank."""
        kind = word & 0x7F
        dtype = _DTYPE_NAMES.get((word >> 8) & 0xFF, "")
        return cls(
            KINDS[kind - 1] if 0 < kind <= len(KINDS) else "an unknown op",
            dtype,
            ((word >> 16) & 0xFF) - 1,
            (word >> 24) - 1,
            nbytes,
            bool(word & _WHOLE),
        )

    def describe(self, ranks: Sequence[int] | None = None) -> str:
        """Return a short readable form, e.g. ``reduce (SUM) of 8 float32 elements with root 1``.

        ``ranks`` maps local ranks to the group's ranks, for the root.
        """
        parts = [self.kind]
        if self.reduce_op >= 0:
            parts.append(f"({ReduceOp(self.reduce_op).name})")
        if self.dtype:
            count = self.nbytes // itemsize(self.dtype)
            parts.append(f"of {count} {self.dtype} element{'' if count == 1 else 's'}")
        root = self.root
        if root >= 0 and self.kind != "relay":
            if ranks and root < len(ranks) and not self.whole:
                root = ranks[root]
            parts.append(f"with root {root}")
        return " ".join(parts)


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
        self, arena: Arena, local_rank: int, waiter: Waiter, ranks: Sequence[int] | None = None
    ) -> None:
        """Take part as ``local_rank`` in the steps of ``arena``.

        ``ranks`` maps local ranks to the group's ranks, for messages (None: the same).
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
        self.step = 0
        self.op = 0
        self._sig = 0
        self._nbytes = 0
        self._key: tuple[str, str, int, int] = ("barrier", "", -1, -1)
        self._whole = False
        self._words: dict[tuple[tuple[str, str, int, int], bool], int] = {}

    @property
    def others(self) -> list[int]:
        """Return the other local ranks."""
        return self._others

    def begin(
        self, kind: str, dtype: str = "", reduce_op: int = -1, root: int = -1, nbytes: int = 0
    ) -> None:
        """Start an op of ``Signature(kind, ...)``: count it, and announce it."""
        key = (kind, dtype, reduce_op, root)
        self.begin_signed(key, self.signature_word(key), nbytes)

    def begin_whole(self, kind: str, dtype: str, reduce_op: int, root: int, nbytes: int) -> None:
        """Start the check of a user's whole op ``kind`` (``root`` a rank of the group).

        A group that spans nodes runs each op in stages; this signature, which no
        stage carries, lets the node's ranks compare the op they were called with.
        """
        key = (kind, dtype, reduce_op, root)
        self.begin_signed(key, self.signature_word(key, whole=True), nbytes)
        self._whole = True

    def signature_word(self, key: tuple[str, str, int, int], whole: bool = False) -> int:
        """Return ``Signature(*key, whole=whole).word()``, packed once per key."""
        word = self._words.get((key, whole))
        if word is None:
            word = self._words[(key, whole)] = Signature(*key, whole=whole).word()
        return word

    def begin_signed(self, key: tuple[str, str, int, int], word: int, nbytes: int) -> None:
        """Start an op whose signature ``key`` packs into ``word``; see ``begin``."""
        self.op += 1
        self._control[OP_SEQ] = self.op
        self._sig = word
        self._nbytes = nbytes
        self._key = key
        self._whole = False

    def slot(self, step: int) -> np.ndarray:
        """Return this rank's slot for ``step``."""
        return self.slots[self.rank][step % self.nbuf]

    def peer_slot(self, rank: int, step: int) -> np.ndarray:
        """Return ``rank``'s slot for ``step``."""
        return self.slots[rank][step % self.nbuf]

    def free(self, step: int, deadline: float) -> None:
        """Wait until every other rank has consumed what this rank wrote ``nbuf`` steps ago."""
        target = step - self.nbuf + 1
        if target <= 0:
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
            raise MismatchError(self._mismatch(rank, op, Signature.unpack(sig, nbytes)))

    def _mismatch(self, rank: int, op: int, theirs: Signature) -> str:
        """Describe how local ``rank``, in its ``op``-th collective ``theirs``, differs."""
        mine = Signature(*self._key, self._nbytes, self._whole)
        who, me = self.ranks[rank], self.ranks[self.rank]
        if op != self.op:
            return (
                f"rank {who} is in its collective #{op} ({theirs.describe(self.ranks)}) where "
                f"rank {me} is in its #{self.op} ({mine.describe(self.ranks)}): the ranks "
                "called a different number of collectives on the group"
            )
        return (
            f"rank {who} called {theirs.describe(self.ranks)} where rank {me} called "
            f"{mine.describe(self.ranks)}"
        )

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
        self._control = np.zeros(OP_SEQ + 1, np.int64)

    def all_counters(self) -> list[Counter]:
        """Return every counter of the arena's slots, to wake their sleepers."""
        return self.posted + self.consumed
