"""GlooGroup's reducescatter: one alltoall of the input chunks, then a local reduction.

Torch's gloo ``reduce_scatter`` costs about as much as one allreduce per chunk, and
``ray.util.collective`` runs exactly that, in place on the caller's inputs. Here each
rank sends chunk j of its input to rank j in one gloo alltoall, so every byte crosses
once, half of what an allreduce moves, and then reduces the world-size chunks it
received, in rank order, into its output. The inputs are only read.

The received chunks land in a scratch buffer that the group keeps for its next
reducescatter (see ``Scratch``): on this path fresh memory costs more than the copy
into it, one page fault per 4 KiB.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from collections.abc import Callable, Sequence
from typing import Any

from collective.types import ReduceOp

KEEP_BYTES = 512 << 20
"""The largest scratch buffer a group keeps between reducescatters; bigger ones are freed."""

SCRATCH_BYTES = 64 << 10
"""Ops that exchange fewer bytes use plain new buffers, cheaper than borrowing the scratch."""

HUGE_PAGE_BYTES = 2 << 20
"""Scratch of at least this size is mapped on its own and asks for transparent huge pages."""


class Lease:
    """A scratch buffer lent to one op: ``tensor`` (uint8) until ``release``."""

    def __init__(self, tensor: Any, on_release: Callable[[], None]) -> None:
        self.tensor = tensor
        self._on_release = on_release

    def release(self) -> None:
        """Give the buffer back; it may be lent again at once."""
        self._on_release()
        self._on_release = lambda: None


class Scratch:
    """One reusable byte buffer of a group, lent to one op at a time.

    An op that finds it lent, or too small, gets a fresh buffer; a fresh buffer of
    at most ``keep_bytes`` replaces the kept one when that is free. A lent buffer
    whose op failed is never given back, so a late write from an abandoned op can
    only reach memory nobody else uses.
    """

    def __init__(self, keep_bytes: int = KEEP_BYTES) -> None:
        """Keep buffers of at most ``keep_bytes`` between ops."""
        self._keep_bytes = keep_bytes
        self._lock = threading.Lock()
        self._kept: Any = None
        self._lent = False

    def take(self, nbytes: int) -> Lease:
        """Return a lease on at least ``nbytes`` bytes of scratch."""
        with self._lock:
            if not self._lent and self._kept is not None and self._kept.numel() >= nbytes:
                self._lent = True
                return Lease(self._kept[:nbytes], self._give_back)
        tensor = _fresh(nbytes)
        with self._lock:
            if not self._lent and nbytes <= self._keep_bytes:
                self._kept, self._lent = tensor, True
                return Lease(tensor, self._give_back)
        return Lease(tensor, lambda: None)

    def _give_back(self) -> None:
        with self._lock:
            self._lent = False


def _fresh(nbytes: int) -> Any:
    """Return ``nbytes`` of new uint8 memory; a big buffer gets huge pages where it can."""
    import torch

    if nbytes < HUGE_PAGE_BYTES:
        return torch.empty(nbytes, dtype=torch.uint8)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            mapping.madvise(advice)
        except OSError:
            pass
    return torch.frombuffer(mapping, dtype=torch.uint8)


def flat_bytes(chunks: Sequence[Any]) -> Any | None:
    """Return the chunks as one uint8 tensor without copying, or None if they are not adjacent.

    Chunks are adjacent when each is contiguous and starts where the one before ends,
    as the views of one flat buffer do; their sizes may differ. Every byte of the
    result belongs to one of the chunks, and the result keeps them alive: an async
    op that holds it may outlive the caller's references to the chunks (staged
    copies of non-contiguous buffers have no other).
    """
    import torch

    if not chunks or not all(c.is_contiguous() for c in chunks):
        return None
    first = chunks[0]
    start = end = first.data_ptr()
    for c in chunks:
        if c.numel() and c.data_ptr() != end:
            return None
        end += c.numel() * c.element_size()
    if end == start:
        return torch.empty(0, dtype=torch.uint8)
    if len(chunks) == 1:
        return byte_view(first)
    memory = (ctypes.c_uint8 * (end - start)).from_address(start)
    memory.owners = list(chunks)
    return torch.frombuffer(memory, dtype=torch.uint8)


def byte_view(tensor: Any) -> Any:
    """Return the contiguous ``tensor``'s memory as a flat uint8 tensor (a view)."""
    import torch

    return tensor.reshape(-1).view(torch.uint8)


def joined_bytes(chunks: Sequence[Any], out: Any = None) -> Any:
    """Return the chunks' bytes copied one after another into ``out`` (uint8), or a new tensor."""
    import torch

    return torch.cat([byte_view(c) for c in chunks], out=out)


_COMBINE: dict[ReduceOp, str] = {
    ReduceOp.SUM: "add",
    ReduceOp.AVG: "add",
    ReduceOp.PRODUCT: "mul",
    ReduceOp.MIN: "minimum",
    ReduceOp.MAX: "maximum",
    ReduceOp.BAND: "bitwise_and",
    ReduceOp.BOR: "bitwise_or",
    ReduceOp.BXOR: "bitwise_xor",
}
"""The torch function that combines two chunks under each reduction."""


class ChunkExchange:
    """One reducescatter: ``sent`` goes out through gloo's alltoall into ``received``.

    The size picks the buffers, once per call. Below ``SCRATCH_BYTES`` both are new:
    ``sent`` a copy of the inputs. From there ``received`` is the group's scratch, and
    ``sent`` is the caller's inputs seen as one byte tensor, or a copy of them in the
    scratch when they are not adjacent. ``received`` holds the world-size chunks this
    rank reduces into ``output``.
    """

    def __init__(self, output: Any, inputs: Sequence[Any], scratch: Scratch) -> None:
        """Lay out the exchange of ``inputs`` (the caller's chunks, only read) into ``output``."""
        import torch

        self._output, self._inputs = output, list(inputs)
        self._n = len(inputs)
        nbytes = output.numel() * output.element_size() * self._n
        self._lease: Lease | None = None
        if nbytes < SCRATCH_BYTES:
            self.sent = joined_bytes(self._inputs)
            self.received = torch.empty_like(self.sent)
            return
        flat = flat_bytes(self._inputs)
        self._lease = scratch.take(nbytes if flat is not None else 2 * nbytes)
        self.received = self._lease.tensor[:nbytes]
        if flat is None:
            flat = self._lease.tensor[nbytes : 2 * nbytes]
            joined_bytes(self._inputs, out=flat)
        self.sent = flat

    def reduce(self, op: ReduceOp) -> None:
        """Reduce the received chunks into the output by ``op``, rank 0's first; free scratch."""
        out = self._output.view(-1)
        reduce_into(out, list(self.received.view(out.dtype).view(self._n, -1)), op)
        if self._lease is not None:
            self._lease.release()
        self._inputs = []


def reduce_into(out: Any, parts: Sequence[Any], op: ReduceOp) -> None:
    """Reduce ``parts`` (tensors of ``out``'s dtype and size) into ``out`` by ``op``, in order.

    Every rank that reduces the same parts in the same order gets the same bits.
    """
    import torch

    if len(parts) == 1:
        out.copy_(parts[0])
    else:
        combine = getattr(torch, _COMBINE[op])
        combine(parts[0], parts[1], out=out)
        for part in parts[2:]:
            combine(out, part, out=out)
    if op is ReduceOp.AVG:
        out.div_(len(parts))
