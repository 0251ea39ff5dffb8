"""Run a bulk call's ops: pack a bucket, move it, unpack it, two staging buffers in turn.

Each op is issued with ``async_op``, so packing the next bucket overlaps moving this
one; at most ``DEPTH`` ops are in flight, and each staging buffer is packed again
only after the op that moved it has finished and its bytes were unpacked. A rank
holds at most ``DEPTH`` staging buffers of the largest op's size, whatever the total.
Ranges of big contiguous tensors move in place, with no staging; on a CPU group
such an op runs in the caller's thread, as there is nothing to overlap it with.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from collective.bulk.plan import BulkOp, staging_bytes
from collective.bulk.turns import AGREEMENT_OPS, Turn
from collective.frameworks import cuda_buffers, kinds, packing, streams
from collective.frameworks.packing import ITEMSIZE, Batch, Staging
from collective.groups.base import BaseGroup
from collective.types import (
    AllReduceOptions,
    BroadcastOptions,
    CollectiveTimeoutError,
    ReduceOp,
)
from collective.work import OnceWork, Work

DEPTH = 2
"""Ops in flight at once, and staging buffers per call."""

_END_S = 5.0
"""How long a ``wait`` that ran out waits for the aborted call's thread to end."""


@dataclass(frozen=True)
class Moves:
    """What one rank does in a bulk call.

    ``tensors[i]`` is this rank's tensor for layout entry ``i``, or None where it has
    none (a key it lacks, with ``strict=False``): that entry's bytes pass through.
    ``reads`` says whether the rank's tensors are sent (the source; every rank of a
    reduction), ``writes`` whether they receive the result. ``root`` is the source
    of a broadcast; ``reduce_op`` makes the call a reduction.
    """

    group: BaseGroup
    bulk_ops: list[BulkOp]
    tensors: Sequence[Any | None]
    reads: bool
    writes: bool
    like: Any
    timeout: timedelta | None
    root: int = 0
    reduce_op: ReduceOp | None = None
    whole: Sequence[Any] | None = None
    """Every tensor in layout order (scratch where this rank has none), when the group
    moves them as one message (``BaseGroup.takes_lists``); then ``bulk_ops`` go unused."""


class HaltedError(Exception):
    """An async bulk call stopped because its ``wait`` ran out; it writes nothing more."""


class Halt:
    """Whether an async bulk call may still write into its tensors; ``stop`` ends that.

    The call's thread writes only inside ``writing``, and says ``finish`` once it has
    written everything; ``stop`` waits for a write in progress, so that nothing is
    written after it returns.
    """

    def __init__(self) -> None:
        """Let the call write."""
        self._lock = threading.Lock()
        self._stopped = False
        self._finished = False

    def check(self) -> None:
        """Raise ``HaltedError`` once ``stop`` has run."""
        if self._stopped:
            raise HaltedError

    def writing(self, write: Callable[[], None]) -> None:
        """Run ``write`` unless the call was stopped (then raise ``HaltedError``)."""
        with self._lock:
            self.check()
            write()

    def finish(self) -> None:
        """Record that the call has written everything; raise ``HaltedError`` if it was stopped."""
        with self._lock:
            self.check()
            self._finished = True

    def stop(self) -> bool:
        """Stop the call's writes; return False if it had already written everything."""
        with self._lock:
            self._stopped = not self._finished
            return self._stopped


_FREE = Halt()
"""The halt of a blocking call, which nobody stops."""


def run(moves: Moves, halt: Halt = _FREE) -> None:
    """Issue every op of ``moves`` in order and finish each; return once all have finished.

    The tensors are written only while ``halt`` lets them: a stopped call raises
    ``HaltedError`` before its next write or op.
    """
    if moves.whole is not None:
        halt.check()
        options = BroadcastOptions(moves.root, 0, moves.timeout)
        moves.group.broadcast_list(moves.whole, options).wait()
        halt.finish()
        return
    slots: list[Staging] = []
    free: list[int] = []
    size = staging_bytes([s for s in moves.bulk_ops if _in_place(moves, s) is None])
    pending: deque[tuple[Work, int | None, Batch | None]] = deque()

    def finish() -> None:
        work, slot, batch = pending.popleft()
        work.wait()
        if slot is not None and batch is not None:
            if moves.writes:
                halt.writing(lambda: slots[slot].unpack(batch))
            free.append(slot)

    cpu = moves.group.device_type == "cpu"
    capturing = not cpu and moves.like is not None and cuda_buffers.capturing(moves.like)
    for bulk_op in moves.bulk_ops:
        buffer = _in_place(moves, bulk_op)
        slot, batch = None, None
        blocking = (cpu and buffer is not None) or capturing
        if buffer is None:
            if not free and len(slots) == DEPTH:
                while not free:
                    finish()
            if not free:
                slots.append(Staging(moves.like, size))
                free.append(len(slots) - 1)
            slot = free.pop()
            batch = Batch(_items(moves, bulk_op))
            if moves.reads:
                slots[slot].pack(batch)
            staging = slots[slot]
            if bulk_op.dtype is None:
                buffer = staging.bytes(0, bulk_op.nbytes)
            else:
                buffer = staging.typed(0, bulk_op.nbytes // ITEMSIZE[bulk_op.dtype], bulk_op.dtype)
        halt.check()
        pending.append((_issue(moves, buffer, not blocking), slot, batch))
        if len(pending) > DEPTH:
            finish()
    while pending:
        finish()
    halt.finish()


def _in_place(moves: Moves, bulk_op: BulkOp) -> Any | None:
    """Return the caller's own memory that ``bulk_op`` moves, or None if it goes through staging."""
    if not bulk_op.direct:
        return None
    piece = bulk_op.pieces[0]
    x = moves.tensors[piece.entry]
    if x is None or not kinds.is_contiguous(x):
        return None
    if bulk_op.dtype is None:
        size = bulk_op.nbytes // (piece.stop - piece.start)
        return packing.as_bytes(x)[piece.start * size : piece.stop * size]
    return packing.flat(x)[piece.start : piece.stop]


def _items(moves: Moves, bulk_op: BulkOp) -> list[tuple[int, Any]]:
    """Return the (offset, view) pairs that ``bulk_op`` packs and unpacks on this rank."""
    items = []
    for piece in bulk_op.pieces:
        x = moves.tensors[piece.entry]
        if x is None:
            continue
        if piece.start == 0 and not bulk_op.direct:
            items.append((piece.offset, x))
            continue
        offset = piece.offset
        size = bulk_op.nbytes // (piece.stop - piece.start)
        for view in packing.segments(x, piece.start, piece.stop):
            items.append((offset, view))
            offset += math.prod(view.shape) * size
    return items


def _issue(moves: Moves, buffer: Any, async_op: bool) -> Work:
    """Start the op that moves ``buffer``: asynchronously, or (``async_op`` False) to its end.

    A CPU op on the caller's own memory has no packing to overlap, and runs faster in
    the caller's thread than on the group's worker thread (256 MiB in 4 MiB broadcasts
    at 4 ranks in Ray actors: 66 ms in the caller's thread, 79-109 ms async); it waits
    behind the ops already in flight, which keep their order.
    """
    if moves.reduce_op is not None:
        reduced = AllReduceOptions(moves.reduce_op, moves.timeout, async_op=async_op)
        return moves.group.allreduce([buffer], reduced)
    copied = BroadcastOptions(moves.root, 0, moves.timeout, async_op)
    return moves.group.broadcast([buffer], copied)


class BulkWork(OnceWork):
    """The ``Work`` of a bulk call with ``async_op``: its ops run in a thread of their own.

    The thread queues its GPU copies on the stream that was current for the caller
    at the call; ``wait`` orders the waiter's current stream after them. A ``wait``
    that runs out ends the call as a plain op's does: it aborts the group, and no
    more is written into the call's tensors once it has raised.
    """

    def __init__(self, op: str, moves: Moves, bound: timedelta, turn: Turn) -> None:
        """Start running ``moves``, the ops of ``op``, in a thread; ``bound`` limits a ``wait``.

        ``turn`` is given back once the thread has ended.
        """
        super().__init__(bound)
        self._op = op
        self._moves: Moves | None = moves
        self._group = moves.group
        self._turn = turn
        self._halt = Halt()
        self._expired: CollectiveTimeoutError | None = None
        self._stream = streams.caller_stream(moves.like)
        self._order: Callable[[], None] = lambda: None
        self._ended = threading.Event()
        self._complete_in_background(f"collective-{moves.group.group_name}-{op}")

    def _complete(self, timeout: timedelta | None) -> None:
        moves = self._moves
        try:
            if moves is not None:
                with streams.using_stream(moves.like, self._stream):
                    run(moves, self._halt)
                self._order = streams.mark(moves.like, self._stream)
        except BaseException as exc:
            self._error = self._expired or exc
        finally:
            self._moves = None  # the call's tensors are the caller's again
            self._turn.release()
            self._ended.set()

    def wait(self, timeout: timedelta | None = None) -> None:
        """Block until every op of the call has finished and its results are written.

        Raises:
            CollectiveTimeoutError: ``timeout`` (by default the call's bound) passed
                first; the group is aborted, and the tensors are no longer written.
            CollectiveError: an op of the call failed.

        """
        if not self._ended.wait(self._wait_seconds(timeout)):
            expired = self._expire(timeout)
            if not self._ended.wait(_END_S):
                raise expired
        if self._error is not None:
            raise self._error
        self._order()

    def _expire(self, timeout: timedelta | None) -> CollectiveTimeoutError:
        """Stop the call that a wait of ``timeout`` gave up on: abort its group; return the error.

        A call that has already written everything is left to end by itself.
        """
        group = self._group
        waited = timeout or self._timeout or group.timeout
        detail = "its ops had not all finished, and the group was aborted"
        error = CollectiveTimeoutError(self._op, group.group_name, group.rank, waited, detail)
        if self._halt.stop():
            self._expired = error
            group.abort(str(error))
        return error

    def is_completed(self) -> bool:
        """Return whether every op of the call has finished, successfully or not."""
        return self._ended.is_set()

    def exception(self) -> BaseException | None:
        """Return the call's failure once it has finished with one, else None."""
        return self._error if self._ended.is_set() else None


def start(op: str, moves: Moves, async_op: bool, turn: Turn) -> Work | None:
    """Run ``moves``, the ops of ``op``, now (None), or in a thread whose ``Work`` is returned.

    ``turn``, the call's hold on its group, is given back once its ops have ended.
    """
    own = moves.timeout or moves.group.timeout
    turn.bound(len(moves.bulk_ops) + AGREEMENT_OPS, own)
    if not async_op:
        try:
            run(moves)
        finally:
            turn.release()
        return None
    return BulkWork(op, moves, own * (len(moves.bulk_ops) + 1), turn)
