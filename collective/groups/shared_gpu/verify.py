"""A check, once per group as it connects, that every rank maps its peers' GPU memory right.

Every local rank writes a stamp (its rank, a random number of its own, the region and
which end) at both ends of each of its slots and mailboxes, and waits until its GPU
has written them; after a barrier, every rank copies each peer's stamps back through
its mappings and compares them with what that peer wrote. A mapping that shows other
bytes (a handle opened onto other memory, or a region mapped short) fails the connect
on every rank with a ``MappingError`` that names each pair, before any op can read
wrong data. It costs two device copies per region and end, and one exchange through
the store more than connecting takes anyway; the barrier is the connect's own.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from collective.groups.shared_gpu.arena import DeviceSlots

STAMP_BYTES = 64
"""Bytes of a stamp: eight 64-bit words."""

MAGIC = 0x3150_414D_4C4C_4F43
"""The first word of a stamp: "COLLMAP1" in little-endian ASCII."""


class MappingError(RuntimeError):
    """A rank reads other bytes through its mapping of a peer's GPU memory than the peer wrote."""


def stamp(rank: int, nonce: int, region: int, end: int) -> np.ndarray:
    """Return the stamp local rank ``rank`` writes at end ``end`` (0 or 1) of region ``region``."""
    words = np.array([MAGIC, nonce, rank, region, end, 0, 0, 0], np.int64)
    return words.view(np.uint8)


def _ends(address: int, nbytes: int) -> list[int]:
    """Return the addresses of a region's two stamps: its first and its last bytes."""
    return [address, address + nbytes - STAMP_BYTES]


def write(slots: DeviceSlots, nonce: int) -> None:
    """Write this rank's stamps into its own slots and mailboxes; return once the GPU has."""
    device, me = slots.device, slots.local_rank
    for region, (_, address, nbytes) in enumerate(slots.regions(me, range(slots.local_size))):
        for end, at in enumerate(_ends(address, nbytes)):
            source = stamp(me, nonce, region, end)
            device.copy(at, int(source.ctypes.data), STAMP_BYTES, 0)  # pageable: taken at once
    device.synchronize()


def read(slots: DeviceSlots, nonces: Sequence[int], ranks: Sequence[int]) -> list[tuple[int, str]]:
    """Return ``(peer, region name)`` for each region of a peer that reads other bytes here."""
    device, me, wrong = slots.device, slots.local_rank, []
    for peer in range(slots.local_size):
        if peer == me:
            continue
        for region, (name, address, nbytes) in enumerate(slots.regions(peer, ranks)):
            backs = [np.zeros(STAMP_BYTES, np.uint8) for _ in range(2)]
            for back, at in zip(backs, _ends(address, nbytes), strict=True):
                # into pageable memory: cudaMemcpyAsync returns once the copy is done
                device.copy(int(back.ctypes.data), at, STAMP_BYTES, 0)
            device.synchronize()
            wants = [stamp(peer, nonces[peer], region, end) for end in range(2)]
            if not all(map(np.array_equal, backs, wants)):
                wrong.append((peer, name))
    return wrong


def check(
    slots: DeviceSlots, exchange: Callable[[str, Any], list[Any]], ranks: Sequence[int]
) -> None:
    """Check every rank's mappings of every other's slots and mailboxes; see the module doc.

    ``exchange(name, value)`` returns every local rank's value (the connect's store
    exchange, bounded by its timeout); ``ranks`` are the group ranks of the local ranks.

    Raises:
        MappingError: some rank read other bytes than a peer wrote; every rank raises it.
        TimeoutError: a rank did not take part within the timeout.

    """
    nonce = secrets.randbits(62)
    write(slots, nonce)
    nonces = exchange("stamped", nonce)
    wrong = read(slots, nonces, ranks)
    found = exchange("checked", [[peer, name] for peer, name in wrong])
    pairs = []
    for reader, seen in enumerate(found):
        for peer in sorted({p for p, _ in seen}):
            names = ", ".join(name for p, name in seen if p == peer)
            pairs.append(
                f"rank {ranks[reader]} reads other bytes than rank {ranks[peer]} wrote, in "
                f"its {names}"
            )
    if pairs:
        raise MappingError(
            "the ranks sharing this GPU do not see each other's GPU memory through their "
            f"CUDA IPC mappings: {'; '.join(pairs)}"
        )
