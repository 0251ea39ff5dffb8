"""Lists of buffers as one message: the shared-memory transport's vectored broadcast.

The buffers stream through the slots back to back, so a slot may hold the end of
one buffer and the start of the next: each byte is copied once into the arena and
once out on each reader, with one synchronisation per slot whatever the number of
buffers. This is what the bulk calls use on one node instead of packing buckets.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from collective.groups.shm.steps import Steps

Piece = tuple[np.ndarray, int, int, int]
"""``(buffer, start, end, slot offset)``: bytes ``[start, end)`` of a buffer at an offset."""


def broadcast_list(steps: Steps, datas: Sequence[np.ndarray], root: int, deadline: float) -> None:
    """Copy local rank ``root``'s ``datas`` into every other local rank's ``datas``, in place.

    Every local rank passes as many flat ``uint8`` buffers, of the same sizes in the
    same order; the root's are only read. The root confirms on the first step that
    every reader runs the same op, as a broadcast's root does.
    """
    total = sum(d.size for d in datas)
    steps.begin("broadcast", "", root=root, nbytes=total)
    me = steps.rank
    readers = [r for r in range(steps.size) if r != root]
    first = steps.step
    for pieces in cut(datas, steps.slot_bytes):
        step = steps.next()
        if me == root:
            steps.free(step, deadline)
            slot = steps.slot(step)
            for data, start, end, at in pieces:
                slot[at : at + end - start] = data[start:end]
            steps.post(step)
            if step == first:
                steps.confirm(readers, step, deadline)
        else:
            if step == first:
                steps.arrive(step, deadline)
            steps.collect(root, step, deadline)
            slot = steps.peer_slot(root, step)
            for data, start, end, at in pieces:
                data[start:end] = slot[at : at + end - start]
        steps.done(step)


def cut(datas: Sequence[np.ndarray], step_bytes: int) -> list[list[Piece]]:
    """Return, per step, the ``(data, start, end, slot offset)`` pieces of ``datas`` end to end.

    One step (of no pieces) when there are no bytes at all: every op takes a step.
    """
    steps: list[list[Piece]] = [[]]
    room = step_bytes
    for data in datas:
        start = 0
        while start < data.size:
            if room == 0:
                steps.append([])
                room = step_bytes
            end = min(data.size, start + room)
            steps[-1].append((data, start, end, step_bytes - room))
            room -= end - start
            start = end
    return steps
