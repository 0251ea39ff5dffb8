"""Many tensors between two ranks of a group: a header, then few messages.

Both ends know the tensors' dtypes and shapes before anything moves (Ray hands them
the object's metadata), so both lay out the same messages without talking: a tensor
of at least ``DIRECT_BYTES`` moves alone, straight from the sender's memory into the
receiver's; the smaller ones are packed back to back into buckets of up to
``BUCKET_BYTES``, one message each. The receiver gets them as views of the bucket it
received, so each byte is copied once on the sender and never on the receiver. A
header goes first and names the object, its tensor count and its bytes, so that two
transfers between the same ranks can never be mixed up.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np

from collective.frameworks.packing import Staging, as_bytes
from collective.ops import collectives
from collective.types import CollectiveError

DIRECT_BYTES = 1 << 20
"""A tensor of at least this many bytes moves in a message of its own, not packed."""

BUCKET_BYTES = 64 << 20
"""The most bytes of small tensors packed into one message."""

ALIGN = 64
"""Packed tensors start at multiples of this many bytes, so every dtype can view them."""

Meta = tuple[Any, Any]
"""One tensor's ``(shape, torch dtype)``, as Ray's transport metadata lists it."""


@dataclass(frozen=True)
class Message:
    """One message of a transfer: tensor ``direct`` alone, or ``packed`` (index, offset) pairs."""

    nbytes: int
    direct: int | None = None
    packed: tuple[tuple[int, int], ...] = ()


def nbytes_of(meta: Meta) -> int:
    """Return the bytes of a tensor of ``meta``'s shape and dtype."""
    shape, dtype = meta
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def layout(metas: Sequence[Meta]) -> list[Message]:
    """Return the messages that move tensors of ``metas``, in order; empty tensors take none."""
    messages: list[Message] = []
    bucket: list[tuple[int, int]] = []
    position = 0
    for i, meta in enumerate(metas):
        n = nbytes_of(meta)
        if n >= DIRECT_BYTES:
            messages.append(Message(n, direct=i))
            continue
        if n == 0:
            continue
        if bucket and position + n > BUCKET_BYTES:
            messages.append(Message(position, packed=tuple(bucket)))
            bucket, position = [], 0
        bucket.append((i, position))
        position = -(-(position + n) // ALIGN) * ALIGN
    if bucket:
        end = bucket[-1][1] + nbytes_of(metas[bucket[-1][0]])
        messages.append(Message(end, packed=tuple(bucket)))
    return messages


def header(obj_id: str, metas: Sequence[Meta]) -> np.ndarray:
    """Return the header of a transfer: a digest of ``obj_id``, the tensor count, the bytes."""
    digest = hashlib.blake2b(obj_id.encode(), digest_size=7).digest()
    total = sum(nbytes_of(m) for m in metas)
    return np.array([int.from_bytes(digest, "little"), len(metas), total], dtype=np.int64)


def send(
    tensors: Sequence[Any],
    obj_id: str,
    dst_rank: int,
    group_name: str,
    control: str,
    timeout: timedelta | None = None,
) -> None:
    """Send ``tensors`` (torch tensors on one device) to ``dst_rank`` of ``group_name``.

    The tensors are only read; conjugate and negative views go resolved. The header
    goes through CPU group ``control`` (which may be ``group_name``). ``recv`` on
    ``dst_rank`` with the same ``obj_id`` and metadata receives them.
    """
    metas = [(t.shape, t.dtype) for t in tensors]
    collectives.send(header(obj_id, metas), dst_rank, control, timeout=timeout)
    for message in layout(metas):
        if message.direct is not None:
            x = tensors[message.direct].resolve_conj().resolve_neg().contiguous()
            collectives.send(as_bytes(x), dst_rank, group_name, timeout=timeout)
            continue
        staging = Staging(tensors[0], message.nbytes)
        staging.pack([(offset, tensors[i]) for i, offset in message.packed])
        collectives.send(staging.bytes(0, message.nbytes), dst_rank, group_name, timeout=timeout)


def recv(
    metas: Sequence[Meta],
    device: str,
    obj_id: str,
    src_rank: int,
    group_name: str,
    control: str,
    timeout: timedelta | None = None,
) -> list[Any]:
    """Receive the tensors of ``metas`` that ``src_rank`` of ``group_name`` sends with ``send``.

    The header comes through CPU group ``control``, as ``send`` sends it.

    Returns:
        New torch tensors on ``device`` (the current CUDA device for "cuda"): the big
        ones each in memory of its own, the small ones views of the bucket they came in.

    Raises:
        CollectiveError: the sender sent another object, or the group failed.

    """
    import torch

    where = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else "cpu"
    got = np.zeros(3, dtype=np.int64)
    collectives.recv(got, src_rank, control, timeout=timeout)
    want = header(obj_id, metas)
    if not np.array_equal(got, want):
        raise CollectiveError(
            f"rank {src_rank} of group {group_name!r} sent another object than {obj_id} "
            f"({int(got[1])} tensors, {int(got[2])} bytes; expected {int(want[1])}, "
            f"{int(want[2])}): the transfers between these ranks are out of order"
        )
    out: list[Any] = [torch.empty(shape, dtype=dtype, device=where) for shape, dtype in metas]
    for message in layout(metas):
        if message.direct is not None:
            collectives.recv(as_bytes(out[message.direct]), src_rank, group_name, timeout=timeout)
            continue
        bucket = torch.empty(message.nbytes, dtype=torch.uint8, device=where)
        collectives.recv(bucket, src_rank, group_name, timeout=timeout)
        for i, offset in message.packed:
            shape, dtype = metas[i]
            n = nbytes_of(metas[i])
            out[i] = bucket[offset : offset + n].view(dtype).view(shape)
    if device == "cuda":
        torch.cuda.current_stream().synchronize()
    return out
