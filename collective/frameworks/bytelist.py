"""Many flat byte buffers as one message: their addresses and sizes, and their cut into slots.

A transport that streams a list of buffers through fixed-size slots back to back
(the shared-memory arena) needs, per slot, which bytes of which buffer go where.
``ByteList`` works that out with numpy over the buffers' addresses and sizes, once
per slot size, so a message of thousands of buffers sent again and again costs no
Python loop over its buffers beyond one ``memmove`` per piece.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from operator import attrgetter
from typing import overload

import numpy as np

Piece = tuple[int, int, int]
"""``(address, offset in the slot, bytes)``: one buffer's bytes in one slot."""

_CUTS_KEPT = 4
"""Cuts (one per slot size) a list keeps."""


@dataclass(frozen=True, eq=False)
class ByteList(Sequence[np.ndarray]):
    """Flat ``uint8`` views of memory, in order, as one message; build with ``of`` or ``byte_runs``.

    The list is read-only; the memory of its views is written where a rank receives.
    """

    views: tuple[np.ndarray, ...]
    addresses: np.ndarray
    """int64 address of each view's first byte."""
    sizes: np.ndarray
    """int64 bytes of each view."""
    _cuts: dict[int, list[list[Piece]]] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, datas: Sequence[np.ndarray]) -> ByteList:
        """Return the list of ``datas``, flat C-contiguous ``uint8`` arrays (checked)."""
        for data in datas:
            if data.dtype != np.uint8 or data.ndim != 1 or not data.flags.c_contiguous:
                raise ValueError(
                    f"a byte list takes flat contiguous uint8 arrays, got {data.dtype} of "
                    f"shape {data.shape} and strides {data.strides}"
                )
        count = len(datas)
        addresses = np.fromiter((d.ctypes.data for d in datas), np.int64, count)
        sizes = np.fromiter(map(len, datas), np.int64, count)
        return cls(tuple(datas), addresses, sizes)

    @classmethod
    def at(cls, addresses: Sequence[int], sizes: Sequence[int]) -> ByteList:
        """Return the list of the memory at ``addresses``, of ``sizes`` bytes each, with no views.

        For memory this process cannot view as numpy arrays (a GPU's): it has
        ``nbytes`` and ``cut``, and is empty as a sequence.
        """
        count = len(addresses)
        return cls((), np.fromiter(addresses, np.int64, count), np.fromiter(sizes, np.int64, count))

    @property
    def nbytes(self) -> int:
        """Return the bytes of the whole message."""
        return int(self.sizes.sum())

    def __len__(self) -> int:
        """Return the number of views."""
        return len(self.views)

    @overload
    def __getitem__(self, index: int) -> np.ndarray: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[np.ndarray]: ...

    def __getitem__(self, index: int | slice) -> np.ndarray | Sequence[np.ndarray]:
        """Return a view, or a tuple of them."""
        return self.views[index]

    def __iter__(self) -> Iterator[np.ndarray]:
        """Iterate over the views."""
        return iter(self.views)

    def cut(self, step_bytes: int) -> list[list[Piece]]:
        """Return, per slot of ``step_bytes``, its pieces of the message, end to end.

        One slot (of no pieces) when there are no bytes at all: every op takes a
        step. Kept per slot size.
        """
        done = self._cuts.get(step_bytes)
        if done is None:
            if len(self._cuts) >= _CUTS_KEPT:
                self._cuts.clear()
            done = self._cuts[step_bytes] = _cut(self.addresses, self.sizes, step_bytes)
        return done


def _cut(addresses: np.ndarray, sizes: np.ndarray, step: int) -> list[list[Piece]]:
    keep = sizes > 0
    addresses, sizes = addresses[keep], sizes[keep]
    ends = np.cumsum(sizes)
    starts = ends - sizes
    total = int(ends[-1]) if ends.size else 0
    first, last = starts // step, (ends - 1) // step
    counts = last - first + 1
    which = np.repeat(np.arange(sizes.size), counts)
    nth = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    slot = first[which] + nth
    begin = np.maximum(starts[which], slot * step)
    end = np.minimum(ends[which], (slot + 1) * step)
    pieces = list(
        zip(
            (addresses[which] + begin - starts[which]).tolist(),
            (begin - slot * step).tolist(),
            (end - begin).tolist(),
            strict=True,
        )
    )
    bounds = np.searchsorted(slot, np.arange(max(1, -(-total // step)) + 1)).tolist()
    return [pieces[a:b] for a, b in pairwise(bounds)]


def byte_runs(xs: Sequence[object]) -> ByteList:
    """Return the memory of contiguous CPU torch tensors ``xs``, in order, as a byte list.

    Tensors that lie back to back in memory, in this order, share one view; empty
    ones have none. The views do not keep the tensors alive: use them only while
    ``xs`` live, unchanged. Writing a view writes the tensors.
    """
    torch = sys.modules["torch"]
    count = len(xs)
    starts = np.fromiter(map(torch.Tensor.data_ptr, xs), np.int64, count)
    sizes = np.fromiter(map(attrgetter("nbytes"), xs), np.int64, count)
    keep = sizes > 0
    starts, sizes = starts[keep], sizes[keep]
    ends = starts + sizes
    breaks = np.flatnonzero(starts[1:] != ends[:-1]) + 1
    firsts = np.concatenate(([0], breaks)).astype(np.int64)
    lasts = np.concatenate((breaks - 1, [starts.size - 1])).astype(np.int64)
    if not starts.size:
        firsts = lasts = np.zeros(0, np.int64)
    run_starts, run_sizes = starts[firsts], ends[lasts] - starts[firsts]
    views = tuple(map(raw_bytes, run_starts.tolist(), run_sizes.tolist()))
    return ByteList(views, run_starts, run_sizes)


def raw_bytes(address: int, nbytes: int) -> np.ndarray:
    """Return a writeable ``uint8`` view of ``nbytes`` at ``address``; it owns nothing."""
    return np.frombuffer(memoryview((ctypes.c_ubyte * nbytes).from_address(address)), np.uint8)


def address(data: np.ndarray) -> int:
    """Return the address of the first byte of numpy array ``data``."""
    return int(data.__array_interface__["data"][0])
