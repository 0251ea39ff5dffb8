"""Lists of buffers as one message: the shared-memory transport's vectored broadcast.

The buffers stream through the slots back to back, so a slot may hold the end of
one buffer and the start of the next: each byte is copied once into the arena and
once out on each reader, with one synchronisation per slot whatever the number of
buffers. Which bytes go where is worked out once per message (``ByteList.cut``),
and each piece is one ``memmove``. This is what the bulk calls use on one node
instead of packing buckets.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable, Sequence

import numpy as np

from collective.frameworks.bytelist import ByteList, address
from collective.groups.shm.steps import Steps

_memmove = ctypes.memmove

_slot_addresses: weakref.WeakKeyDictionary[Steps, tuple[object, list[list[int]]]] = (
    weakref.WeakKeyDictionary()
)
"""Each rank's slot addresses per ``Steps``, with the slot list they were read from."""


def slot_addresses(steps: Steps) -> list[list[int]]:
    """Return the address of every local rank's every slot of ``steps``, by rank and buffer.

    They are read again once ``steps`` has dropped its slots (``Steps.release``), so
    no address outlives the mapping it was read from.
    """
    kept = _slot_addresses.get(steps)
    if kept is None or kept[0] is not steps.slots:
        found = [[address(slot) for slot in mine] for mine in steps.slots]
        kept = _slot_addresses[steps] = (steps.slots, found)
    return kept[1]


def broadcast_list(
    steps: Steps,
    datas: Sequence[np.ndarray],
    root: int,
    deadline: float,
    move: Callable[[int, int, int], object] = _memmove,
    slots: Sequence[int] | None = None,
) -> None:
    """Copy local rank ``root``'s ``datas`` into every other local rank's ``datas``, in place.

    Every local rank passes flat contiguous ``uint8`` buffers (a ``ByteList`` or
    arrays) of the same total size: the message is their bytes end to end, however
    each rank cuts it into buffers. The root's are only read. The root confirms on
    the first step that every reader runs the same op, as a broadcast's root does.
    ``move(target, source, size)`` copies bytes between addresses, and ``slots`` are
    the addresses of the root's slots: a ``memmove`` and the arena's by default,
    while device slots pass a device copy and their own.
    """
    message = datas if isinstance(datas, ByteList) else ByteList.of(datas)
    steps.begin("broadcast", "", root=root, nbytes=message.nbytes)
    me = steps.rank
    readers = [r for r in range(steps.size) if r != root]
    first = steps.step
    nbuf = steps.nbuf
    if slots is None:
        slots = slot_addresses(steps)[root]
    for pieces in message.cut(steps.slot_bytes):
        step = steps.next()
        if me == root:
            steps.free(step, deadline)
            slot = slots[step % nbuf]
            for source, at, size in pieces:
                move(slot + at, source, size)
            steps.post(step)
            if step == first:
                steps.confirm(readers, step, deadline)
        else:
            if step == first:
                steps.arrive(step, deadline)
            steps.collect(root, step, deadline)
            slot = slots[step % nbuf]
            for target, at, size in pieces:
                move(target, slot + at, size)
        steps.done(step)
