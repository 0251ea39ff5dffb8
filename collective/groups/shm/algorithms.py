"""The collectives among the ranks of one node, pipelined through the arena's slots.

Every op works on flat ``uint8`` arrays and cuts its message into steps of at
most one slot; each rank decides the step count from arguments every rank
shares, once per call. Reductions read every contribution from the slots in
rank order, so every rank computes the same bits. Roots and ranks here are
local ranks (indices among the node's ranks).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from collective import signature
from collective.groups.shm import gathered
from collective.groups.shm.failures import unpaired
from collective.groups.shm.kernels import Reducer
from collective.groups.shm.lists import broadcast_list
from collective.groups.shm.steps import Steps

SPLIT_ALLREDUCE_BYTES = 256 << 10
"""Allreduces of at least this many bytes split the reduction among the local ranks
(see ``Collectives.allreduce``)."""

REDUCE_BLOCK_BYTES = 256 << 10
"""The two-rank allreduce reduces a half-chunk in blocks of this many bytes and posts
each block while it is still in the core's cache (L2 is 512 KiB to 2 MiB on current
x86 cores). Measured side by side on 64 MiB: 3-9% less time than reducing the whole
half, then copying it; 32 KiB blocks were slower, from Python's cost per block."""

_PIECE_ALIGN = 64
"""Pieces of a slot shared among ranks start at multiples of this many bytes."""


def _spans(nbytes: int, step_bytes: int) -> list[tuple[int, int]]:
    """Return the ``[start, end)`` byte spans of the steps of an ``nbytes`` message."""
    if nbytes == 0:
        return [(0, 0)]
    return [(a, min(a + step_bytes, nbytes)) for a in range(0, nbytes, step_bytes)]


def _piece_bytes(steps: Steps, itemsize: int = 8) -> int:
    """Return the bytes of each rank's piece when one slot holds one piece per rank."""
    piece = steps.slot_bytes // steps.size // _PIECE_ALIGN * _PIECE_ALIGN
    return max(piece, itemsize)


class Collectives:
    """The collective ops of one local rank over the arena's slots."""

    def __init__(self, steps: Steps, reduce_block_bytes: int = REDUCE_BLOCK_BYTES) -> None:
        """Run ops through ``steps``; see ``_allreduce_pair`` for ``reduce_block_bytes``."""
        self.steps = steps
        self.size = steps.size
        self.rank = steps.rank
        self.reduce_block_bytes = reduce_block_bytes

    def barrier(self, deadline: float) -> None:
        """Return once every local rank has entered the barrier."""
        self.steps.begin("barrier")
        self._meet(deadline)

    def agree(
        self, kind: str, dtype: str, reduce_op: int, root: int, nbytes: int, deadline: float
    ) -> None:
        """Check that every local rank is about to run the same whole op; no data moves.

        ``root`` is a rank of the group and ``reduce_op`` the user's reduction: a
        group that spans nodes checks the call this way before its stages, which
        carry neither.

        Raises:
            MismatchError: a local rank was called with another op or other arguments;
                every local rank raises it.

        """
        self.steps.begin_whole(kind, dtype, reduce_op, root, nbytes)
        self._meet(deadline)

    def _meet(self, deadline: float) -> None:
        """Take one step without data: post this rank's header and collect every other.

        Among three or more ranks that gather (``Steps.gather_bytes``), see ``gathered.meet``.
        """
        steps = self.steps
        if gathered.gathers(steps, 0):
            gathered.meet(steps, deadline)
            return
        step = steps.next()
        steps.free(step, deadline)
        steps.post(step)
        steps.collect_all(step, deadline)
        steps.done(step)

    def broadcast(self, data: np.ndarray, root: int, dtype: str, deadline: float) -> None:
        """Copy ``root``'s ``data`` into every other rank's ``data``, in place."""
        self.steps.begin("broadcast", dtype, root=root, nbytes=data.size)
        self._copy(data, root, [r for r in range(self.size) if r != root], deadline)

    def broadcast_list(self, datas: Sequence[np.ndarray], root: int, deadline: float) -> None:
        """Copy ``root``'s ``datas`` into every other rank's ``datas``, in place, as one message.

        See ``lists.broadcast_list``.
        """
        broadcast_list(self.steps, datas, root, deadline)

    def _copy(self, data: np.ndarray, source: int, readers: list[int], deadline: float) -> None:
        """Copy ``source``'s ``data`` into the ``data`` of each rank of ``readers``.

        Every local rank takes the steps; the others' ``data`` is not touched. The
        source confirms on the first step that every reader runs the same op.
        """
        steps, me = self.steps, self.rank
        first = steps.step
        for start, end in _spans(data.size, steps.slot_bytes):
            step = steps.next()
            if me == source:
                steps.free(step, deadline)
                steps.slot(step)[: end - start] = data[start:end]
                steps.post(step)
                if step == first:
                    steps.confirm(readers, step, deadline)
            elif me in readers:
                if step == first:
                    steps.arrive(step, deadline)
                steps.collect(source, step, deadline)
                data[start:end] = steps.peer_slot(source, step)[: end - start]
            steps.done(step)

    def reduce(
        self, data: np.ndarray, root: int, reducer: Reducer, dtype: str, deadline: float
    ) -> None:
        """Reduce every rank's ``data`` onto ``root``'s ``data``; the others' stay as they were."""
        steps, me = self.steps, self.rank
        steps.begin("reduce", dtype, reducer.op.value, root, data.size)
        first = steps.step
        for start, end in _spans(data.size, steps.slot_bytes):
            step = steps.next()
            length = end - start
            if me != root:
                steps.free(step, deadline)
                steps.slot(step)[:length] = data[start:end]
                steps.post(step)
                if step == first:
                    steps.confirm([root], step, deadline)
            else:
                if step == first:
                    steps.arrive(step, deadline)
                out = data[start:end]
                steps.collect_all(step, deadline)
                for rank in steps.others:
                    reducer(out, steps.peer_slot(rank, step)[:length], out)
                reducer.finish(out)
            steps.done(step)

    def allreduce(self, data: np.ndarray, reducer: Reducer, dtype: str, deadline: float) -> None:
        """Reduce every rank's ``data`` into every rank's ``data``, in place.

        Short messages reduce every slot on every rank (one step per slot of
        message), or are gathered at one rank (see ``gathered``). Longer ones split
        the reduction: between two ranks, see ``_allreduce_pair``; among three or more,
        each slot of message is cut into one piece per rank: rank i reduces piece i
        and posts it, and every rank copies the others' pieces (two steps per slot,
        and 1/ranks of the reduction work per rank).
        """
        steps = self.steps
        steps.begin("allreduce", dtype, reducer.op.value, -1, data.size)
        if gathered.gathers(steps, data.size):
            gathered.allreduce(steps, data, reducer, deadline)
            return
        if self.size == 2 and data.size >= SPLIT_ALLREDUCE_BYTES:
            self._allreduce_pair(data, reducer, deadline)
            return
        split = self.size > 2 and data.size >= SPLIT_ALLREDUCE_BYTES
        for start, end in _spans(data.size, steps.slot_bytes):
            step = steps.next()
            length = end - start
            steps.free(step, deadline)
            steps.slot(step)[:length] = data[start:end]
            steps.post(step)
            steps.collect_all(step, deadline)
            if split:
                self._reduce_pieces(data[start:end], step, reducer, deadline)
                continue
            out = data[start:end]
            reducer.fold([steps.peer_slot(r, step)[:length] for r in range(self.size)], out)
            steps.done(step)

    def _allreduce_pair(self, data: np.ndarray, reducer: Reducer, deadline: float) -> None:
        """Allreduce a long message between two ranks: each reduces half of every chunk.

        A chunk is two slots of message. Rank i hands the other rank the half it
        reduces, reduces its own half of the chunk in place (the two contributions in
        rank order), and hands the result over; each rank copies in the other's half.
        That moves and computes less than both ranks reducing the whole chunk. The
        half is reduced in blocks of ``reduce_block_bytes`` (``REDUCE_BLOCK_BYTES`` on the
        CPU), each copied to the result slot while it is still in cache.
        """
        steps, me = self.steps, self.rank
        peer = 1 - me
        for start, end in _spans(data.size, 2 * steps.slot_bytes):
            chunk = data[start:end]
            half = -(-chunk.size // 2 // reducer.itemsize) * reducer.itemsize
            pieces = (chunk[:half], chunk[half:])
            own, theirs = pieces[me], pieces[peer]
            given = steps.next()
            steps.free(given, deadline)
            steps.slot(given)[: theirs.size] = theirs
            steps.post(given)
            steps.collect(peer, given, deadline)
            other = steps.peer_slot(peer, given)
            result = steps.next()
            steps.free(result, deadline)
            posted = steps.slot(result)
            for a, b in _spans(own.size, self.reduce_block_bytes):
                block = own[a:b]
                reducer.fold([block, other[a:b]] if me == 0 else [other[a:b], block], block)
                posted[a:b] = block
            steps.done(given)
            steps.post(result)
            steps.collect(peer, result, deadline)
            theirs[:] = steps.peer_slot(peer, result)[: theirs.size]
            steps.done(result)

    def _reduce_pieces(self, out: np.ndarray, step: int, reducer: Reducer, deadline: float) -> None:
        """Reduce this rank's piece of ``step``'s slots, post it, and copy in the others'."""
        steps, me, n = self.steps, self.rank, self.size
        length = out.size
        piece = -(-length // n // reducer.itemsize) * reducer.itemsize
        spans = [(min(r * piece, length), min((r + 1) * piece, length)) for r in range(n)]
        a, b = spans[me]
        mine = out[a:b]
        reducer.fold([steps.peer_slot(r, step)[a:b] for r in range(n)], mine)
        steps.done(step)
        result = steps.next()
        steps.free(result, deadline)
        steps.slot(result)[a:b] = mine
        steps.post(result)
        for rank in steps.others:
            steps.collect(rank, result, deadline)
            a, b = spans[rank]
            out[a:b] = steps.peer_slot(rank, result)[a:b]
        steps.done(result)

    def allgather(
        self, piece: np.ndarray, outputs: list[np.ndarray], dtype: str, deadline: float
    ) -> None:
        """Write every rank's ``piece`` into ``outputs[rank]`` on every rank."""
        steps, me = self.steps, self.rank
        steps.begin("allgather", dtype, nbytes=piece.size)
        for start, end in _spans(piece.size, steps.slot_bytes):
            step = steps.next()
            length = end - start
            steps.free(step, deadline)
            steps.slot(step)[:length] = piece[start:end]
            steps.post(step)
            steps.collect_all(step, deadline)
            outputs[me][start:end] = piece[start:end]
            for rank in steps.others:
                outputs[rank][start:end] = steps.peer_slot(rank, step)[:length]
            steps.done(step)

    def gather(
        self, piece: np.ndarray, outputs: list[np.ndarray], root: int, dtype: str, deadline: float
    ) -> None:
        """Write every rank's ``piece`` into ``outputs[rank]`` on ``root`` (``[]`` elsewhere)."""
        steps, me = self.steps, self.rank
        steps.begin("gather", dtype, root=root, nbytes=piece.size)
        first = steps.step
        for start, end in _spans(piece.size, steps.slot_bytes):
            step = steps.next()
            length = end - start
            if me != root:
                steps.free(step, deadline)
                steps.slot(step)[:length] = piece[start:end]
                steps.post(step)
                if step == first:
                    steps.confirm([root], step, deadline)
            else:
                if step == first:
                    steps.arrive(step, deadline)
                steps.collect_all(step, deadline)
                outputs[me][start:end] = piece[start:end]
                for rank in steps.others:
                    outputs[rank][start:end] = steps.peer_slot(rank, step)[:length]
            steps.done(step)

    def scatter(
        self, inputs: list[np.ndarray], output: np.ndarray, root: int, dtype: str, deadline: float
    ) -> None:
        """Write ``root``'s ``inputs[rank]`` into every rank's ``output``."""
        steps, me = self.steps, self.rank
        steps.begin("scatter", dtype, root=root, nbytes=output.size)
        piece = _piece_bytes(steps)
        first = steps.step
        for start, end in _spans(output.size, piece):
            step = steps.next()
            length = end - start
            if me == root:
                steps.free(step, deadline)
                slot = steps.slot(step)
                for rank in steps.others:
                    slot[rank * piece : rank * piece + length] = inputs[rank][start:end]
                steps.post(step)
                if step == first:
                    steps.confirm(steps.others, step, deadline)
                output[start:end] = inputs[me][start:end]
            else:
                if step == first:
                    steps.arrive(step, deadline)
                steps.collect(root, step, deadline)
                offset = me * piece
                output[start:end] = steps.peer_slot(root, step)[offset : offset + length]
            steps.done(step)

    def relay(
        self, data: np.ndarray, source: int, target: int, dtype: str, deadline: float
    ) -> None:
        """Copy ``source``'s ``data`` into ``target``'s ``data``; every local rank takes part.

        The other ranks only count the steps (their ``data`` is not touched), so that
        the pieces of one hierarchical op move through the collective slots, in the
        group's one stream of collectives, and never through the user's mailboxes.
        """
        self.steps.begin("relay", dtype, root=source * self.size + target, nbytes=data.size)
        self._copy(data, source, [target], deadline)

    def reducescatter(
        self,
        inputs: list[np.ndarray],
        output: np.ndarray,
        reducer: Reducer,
        dtype: str,
        deadline: float,
    ) -> None:
        """Reduce ``inputs[rank]`` of every rank into ``rank``'s ``output``; inputs stay."""
        steps, me = self.steps, self.rank
        steps.begin("reducescatter", dtype, reducer.op.value, -1, output.size)
        piece = _piece_bytes(steps, reducer.itemsize)
        for start, end in _spans(output.size, piece):
            step = steps.next()
            length = end - start
            steps.free(step, deadline)
            slot = steps.slot(step)
            for rank in range(self.size):
                slot[rank * piece : rank * piece + length] = inputs[rank][start:end]
            steps.post(step)
            steps.collect_all(step, deadline)
            offset = me * piece
            parts = [steps.peer_slot(r, step)[offset : offset + length] for r in range(self.size)]
            reducer.fold(parts, output[start:end])
            steps.done(step)

    def alltoall(
        self, inputs: list[np.ndarray], outputs: list[np.ndarray], dtype: str, deadline: float
    ) -> None:
        """Send ``inputs[j]`` to rank j; ``outputs[j]`` receives what rank j sends here.

        The ranks first swap their sizes, so every rank knows every pair's size:
        sizes that do not pair up raise the same ``ArgumentValueError`` on every rank,
        before any data moves, and the group stays usable.
        """
        steps, me, n = self.steps, self.rank, self.size
        steps.begin("alltoall", dtype)
        step = steps.next()
        steps.free(step, deadline)
        sizes = np.array([x.size for x in inputs] + [x.size for x in outputs], dtype=np.int64)
        steps.put(steps.slot(step)[: 16 * n].view(np.int64), sizes)
        steps.post(step)
        steps.collect_all(step, deadline)
        table = np.stack([steps.peer_slot(r, step)[: 16 * n].view(np.int64) for r in range(n)])
        table = table.get() if hasattr(table, "get") else table  # device slots (cupy): to the host
        steps.done(step)
        sends, receives = table[:, :n], table[:, n:]
        if not np.array_equal(sends, receives.T):
            raise unpaired(sends, receives, signature.itemsize(dtype), steps.ranks)
        outputs[me][:] = inputs[me]
        piece = _piece_bytes(steps)
        largest = int(sends.max(initial=0))
        for start in range(0, max(largest, 1), piece):
            step = steps.next()
            steps.free(step, deadline)
            slot = steps.slot(step)
            for peer in steps.others:
                part = inputs[peer][start : start + piece]
                slot[peer * piece : peer * piece + part.size] = part
            steps.post(step)
            offset = me * piece
            for peer in steps.others:
                length = min(int(sends[peer, me]) - start, piece)
                if length > 0:
                    steps.collect(peer, step, deadline)
                    block = steps.peer_slot(peer, step)[offset : offset + length]
                    outputs[peer][start : start + length] = block
            steps.done(step)
