"""What the ranks of a Gloo group agree on before an op moves data, and how they say it.

gloo moves bytes only: ranks that pass different sizes make it abort the process
(its receive finds more bytes than it posted), and ranks that pass different
dtypes or reductions get mixed data without an error. So before every collective
each rank describes its call (``Call``) in ``WIDTH`` int64 words, the ranks
allgather them in one record each, and every rank compares all of them
(``disagreement``); from ``GATHER_FROM`` ranks on, they gather the records at rank 0,
which broadcasts them all back. An alltoall's elements per peer ride in its record
where they fit, else they are allgathered next. A send
goes out behind a header of its dtype and size, which the receiver compares with
its own buffer (``Header``). ``running`` runs these exchanges.

A record has room for ``capacity(world_size)`` bytes of data besides the words.
An op whose data fits (``Carried``) rides in it: once the ranks agree, each one
finishes the op from the records, and no other exchange is needed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from collective import signature
from collective.frameworks.cpu_buffers import CpuBuffer
from collective.signature import Call
from collective.types import ArgumentValueError, ReduceOp

UNSET = signature.UNSET
"""The word of a field the op does not use."""

WIDTH = signature.CORE
"""The int64 words of one rank's description of a collective: its signature's core."""

CARRY_BUDGET = 16 << 10
"""The data bytes all ranks' records hold together; each record gets its share, in words.

One allgather of records this size takes as long as one of the words alone (loopback,
2 ranks: 300-450 us at 48 B and at 16 KiB alike), and a big op pays it too."""


GATHER_FROM = 3
"""The world size from which records go to rank 0 and back rather than round a ring.

gloo's allgather is a ring of ``world_size - 1`` steps, which a peer waiting for a
core stalls at each step; a gather and a broadcast take two. One host, 2 cores,
records of 4 KiB (``benchmarks.gloo_agreement``): 3 ranks 0.50-0.59 ms against
0.81-0.92 ms, 4 ranks 0.61-0.71 ms against 3.7-3.8 ms; 2 ranks about the same."""


def capacity(world_size: int) -> int:
    """Return the data bytes one rank's record holds in a group of ``world_size`` ranks."""
    return CARRY_BUDGET // world_size // 8 * 8


@dataclass(frozen=True)
class Carried:
    """How a collective rides in its agreement when its data fits in the records.

    ``data`` is this rank's ``size`` bytes (a flat uint8 numpy array), or None
    where the rank sends none (off the root of a broadcast); ``size`` is the call's
    ``Call.nbytes`` unless given, and follows from the call, so that ranks that agree
    on it agree on whether it fits. ``complete`` writes this rank's result from every
    rank's carried bytes: the rows of a uint8 numpy array, in rank order.
    """

    data: np.ndarray | None
    complete: Callable[[np.ndarray], None]
    size: int | None = None


class Records:
    """A group's agreement records: this rank's, and all ranks' after the allgather.

    The buffers serve op after op; the group runs one agreement at a time. Bytes
    past an op's data keep an earlier op's, which went to the same ranks.
    """

    def __init__(self, world_size: int) -> None:
        """Make the buffers of a group of ``world_size`` ranks."""
        import torch

        self.room = capacity(world_size)
        width = WIDTH * 8 + self.room
        self._mine = np.zeros(width, dtype=np.uint8)
        self._rows = np.zeros((world_size, width), dtype=np.uint8)
        self.mine = torch.from_numpy(self._mine)
        """This rank's record, as gloo sends it."""
        self.gathered = torch.from_numpy(self._rows.reshape(-1))
        """Every rank's record, one after another, as gloo receives them."""
        self.rows = list(self.gathered.chunk(world_size))
        """Each rank's record in ``gathered``, where a gather at rank 0 writes it."""

    def fill(self, call: Call, data: np.ndarray | None) -> None:
        """Write ``call``'s words and, if given, ``data`` into this rank's record."""
        self._mine[: WIDTH * 8].view(np.int64)[:] = signature.encode(call)[:WIDTH]
        if data is not None:
            self._mine[WIDTH * 8 : WIDTH * 8 + data.size] = data

    def agreed(self) -> bool:
        """Return whether every rank's gathered words are the same."""
        first = self._rows[0, : WIDTH * 8].tobytes()
        return all(row[: WIDTH * 8].tobytes() == first for row in self._rows[1:])

    def words(self) -> list[list[int]]:
        """Return every rank's gathered words."""
        return np.ascontiguousarray(self._rows[:, : WIDTH * 8]).view(np.int64).tolist()

    def fill_sizes(self, call: Call) -> bool:
        """Write an alltoall ``call``'s words and its elements per peer; False if they do not fit.

        The elements to each peer, then from each, as int64; when they do not fit,
        only the words are written.
        """
        table = np.asarray([*call.sends, *call.receives], dtype=np.int64).view(np.uint8)
        fits = table.size <= self.room
        self.fill(call, table if fits else None)
        return fits

    def sizes(self) -> list[list[int]]:
        """Return the elements per peer that every rank wrote with ``fill_sizes``."""
        n = len(self._rows)
        return np.ascontiguousarray(self.data(16 * n)).view(np.int64).tolist()

    def data(self, nbytes: int) -> np.ndarray:
        """Return every rank's first ``nbytes`` carried bytes, as the rows of a uint8 array."""
        return self._rows[:, WIDTH * 8 : WIDTH * 8 + nbytes]


def on_buffer(
    op: str,
    buf: CpuBuffer,
    root: int = UNSET,
    reduce_op: ReduceOp | None = None,
    length: int = UNSET,
) -> Call:
    """Return the ``Call`` of ``op`` on ``buf`` with these arguments."""
    return Call(op, buf.dtype, buf.tensor.numel(), root, reduce_op, length)


def _error(op: str, group_name: str, lines: list[str]) -> ArgumentValueError:
    return ArgumentValueError(signature.mismatch(op, group_name, lines))


def disagreement(op: str, group_name: str, words: Sequence[Sequence[int]]) -> ArgumentValueError:
    """Return the error of a collective whose ranks' ``words`` differ, naming how.

    Every rank sees the same words, so every rank raises the same error.
    """
    return _error(op, group_name, signature.differences([signature.shown(w) for w in words]))


def unpaired(group_name: str, sizes: Sequence[Sequence[int]]) -> ArgumentValueError | None:
    """Return the error of an alltoall whose sizes do not pair up, or None when they do.

    ``sizes[i]`` is rank i's elements to each peer, then its elements from each peer.
    """
    n = len(sizes)
    sends = [row[:n] for row in sizes]
    receives = [row[n:] for row in sizes]
    lines = signature.unpaired(sends, receives)
    return _error("alltoall", group_name, lines) if lines else None


HEADER_WIDTH = 3
"""The int64 words of a send's header: dtype, elements, bytes."""


@dataclass(frozen=True)
class Header:
    """What a send carries ahead of its data, for the receiver to compare with its buffer."""

    dtype: int
    count: int
    nbytes: int

    @classmethod
    def of(cls, buf: CpuBuffer) -> Header:
        """Return the header of a send or receive of ``buf``."""
        tensor = buf.tensor
        count = tensor.numel()
        return cls(signature.dtype_code(buf.dtype), count, count * tensor.element_size())

    def words(self) -> list[int]:
        """Return the header as the words it travels in."""
        return [self.dtype, self.count, self.nbytes]

    def describe(self) -> str:
        """Return the header as a buffer, e.g. ``float32[8]``."""
        return signature.buffer_text(self.dtype, self.nbytes)


def message_mismatch(
    group_name: str, sent: Header, expected: Header, sender: int, receiver: int
) -> ArgumentValueError | None:
    """Return the receiver's error for a message unlike its buffer, or None when they match."""
    if sent == expected:
        return None
    return ArgumentValueError(
        f"recv on group {group_name!r}: rank {sender} sent {sent.describe()}, but rank "
        f"{receiver} receives into {expected.describe()}; the message was dropped and "
        "nothing was written"
    )
