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
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from collective import tensor
from collective.bulk.plan import Step, staging_bytes
from collective.groups.base import BaseGroup
from collective.tensor import ITEMSIZE, Staging
from collective.types import (
    AllReduceOptions,
    BroadcastOptions,
    CollectiveTimeoutError,
    ReduceOp,
)
from collective.work import OnceWork, Work

DEPTH = 2
"""Ops in flight at once, and staging buffers per call."""


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
    steps: list[Step]
    tensors: Sequence[Any | None]
    reads: bool
    writes: bool
    like: Any
    timeout: timedelta | None
    root: int = 0
    reduce_op: ReduceOp | None = None
    whole: list[Any] | None = None
    """Every tensor in layout order (scratch where this rank has none), when the group
    moves them as one message (``BaseGroup.takes_lists``); then ``steps`` go unused."""


def run(moves: Moves) -> None:
    """Issue every op of ``moves`` in order and finish each; return once all have finished."""
    if moves.whole is not None:
        options = BroadcastOptions(moves.root, 0, moves.timeout)
        moves.group.broadcast_list(moves.whole, options).wait()
        return
    slots: list[Staging] = []
    free: list[int] = []
    size = staging_bytes([s for s in moves.steps if _in_place(moves, s) is None])
    pending: deque[tuple[Work, int | None, list[tuple[int, Any]]]] = deque()

    def finish() -> None:
        work, slot, items = pending.popleft()
        work.wait()
        if slot is not None:
            if moves.writes:
                slots[slot].unpack(items)
            free.append(slot)

    cpu = moves.group.device_type == "cpu"
    for step in moves.steps:
        buffer = _in_place(moves, step)
        slot, items = None, []
        blocking = cpu and buffer is not None
        if buffer is None:
            if not free and len(slots) == DEPTH:
                while not free:
                    finish()
            if not free:
                slots.append(Staging(moves.like, size))
                free.append(len(slots) - 1)
            slot = free.pop()
            items = _items(moves, step)
            if moves.reads:
                slots[slot].pack(items)
            staging = slots[slot]
            if step.dtype is None:
                buffer = staging.bytes(0, step.nbytes)
            else:
                buffer = staging.typed(0, step.nbytes // ITEMSIZE[step.dtype], step.dtype)
        pending.append((_issue(moves, buffer, not blocking), slot, items))
        if len(pending) > DEPTH:
            finish()
    while pending:
        finish()


def _in_place(moves: Moves, step: Step) -> Any | None:
    """Return the caller's own memory that ``step`` moves, or None if it goes through staging."""
    if not step.solo:
        return None
    piece = step.pieces[0]
    x = moves.tensors[piece.entry]
    if x is None or not tensor.is_contiguous(x):
        return None
    if step.dtype is None:
        size = step.nbytes // (piece.stop - piece.start)
        return tensor.as_bytes(x)[piece.start * size : piece.stop * size]
    return tensor.flat(x)[piece.start : piece.stop]


def _items(moves: Moves, step: Step) -> list[tuple[int, Any]]:
    """Return the (offset, view) pairs that ``step`` packs and unpacks on this rank."""
    items = []
    for piece in step.pieces:
        x = moves.tensors[piece.entry]
        if x is None:
            continue
        if piece.start == 0 and not step.solo:
            items.append((piece.offset, x))
            continue
        offset = piece.offset
        size = step.nbytes // (piece.stop - piece.start)
        for view in tensor.segments(x, piece.start, piece.stop):
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
    at the call; ``wait`` orders the waiter's current stream after them.
    """

    def __init__(self, op: str, moves: Moves, bound: timedelta) -> None:
        """Start running ``moves``, the ops of ``op``, in a thread; ``bound`` limits a ``wait``."""
        super().__init__(bound)
        self._op = op
        self._moves: Moves | None = moves
        self._where = (moves.group.group_name, moves.group.rank, moves.group.timeout)
        self._stream = tensor.caller_stream(moves.like)
        self._order: Callable[[], None] = lambda: None
        self._complete_in_background(f"collective-{moves.group.group_name}-{op}")

    def _complete(self, timeout: timedelta | None) -> None:
        moves = self._moves
        try:
            if moves is not None:
                with tensor.using_stream(moves.like, self._stream):
                    run(moves)
                self._order = tensor.mark(moves.like, self._stream)
        except BaseException as exc:
            self._error = exc
        finally:
            self._moves = None  # the call's tensors are the caller's again

    def wait(self, timeout: timedelta | None = None) -> None:
        """Block until every op of the call has finished and its results are written."""
        super().wait(timeout)
        self._order()

    def _give_up(self, timeout: timedelta | None) -> BaseException:
        name, rank, own = self._where
        waited = timeout or self._timeout or own
        detail = "its ops had not all finished"
        return CollectiveTimeoutError(self._op, name, rank, waited, detail)

    def is_completed(self) -> bool:
        """Return whether every op of the call has finished, successfully or not."""
        return self._done

    def exception(self) -> BaseException | None:
        """Return the call's failure once it has finished with one, else None."""
        return self._error if self._done else None


_running: weakref.WeakKeyDictionary[BaseGroup, BulkWork] = weakref.WeakKeyDictionary()
_running_lock = threading.Lock()


def settle(group: BaseGroup) -> None:
    """Wait until the last async bulk call on ``group`` has finished, whatever its outcome.

    A bulk call's ops must not interleave with another's; that call's own ``wait``
    reports its failure.
    """
    with _running_lock:
        work = _running.get(group)
    if work is None or work.is_completed():
        return
    try:
        work.wait()
    except BaseException:
        pass


def start(op: str, moves: Moves, async_op: bool) -> Work | None:
    """Run ``moves``, the ops of ``op``, now (None), or in a thread whose ``Work`` is returned."""
    if not async_op:
        run(moves)
        return None
    group = moves.group
    own = moves.timeout or group.timeout
    work = BulkWork(op, moves, own * (len(moves.steps) + 1))
    with _running_lock:
        _running[group] = work
    return work
