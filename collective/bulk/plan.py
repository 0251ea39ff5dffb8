"""Cut an agreed layout into the ops of a bulk call: buckets of small tensors, ranges of big ones.

The plan depends only on what every rank agreed on (dtypes, shapes, bucket size),
never on a rank's own memory layout, so every rank issues the same ops in the same
order. A tensor of at least ``direct_bytes``, or bigger than a bucket, moves in ops
of its own, one per bucket-sized range of its elements: a rank whose tensor is
contiguous moves it in place, another packs the range into staging. The other
tensors are packed into buckets of at most ``bucket_bytes``, each at an offset
aligned to its element size. A reduction's bucket holds one dtype only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from collective.bulk.meta import Listing
from collective.frameworks.packing import ITEMSIZE


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of layout entry ``entry``, at byte ``offset`` of its op."""

    entry: int
    start: int
    stop: int
    offset: int


@dataclass
class BulkOp:
    """One op of the call: ``nbytes`` moved, as ``dtype`` elements or (None) as bytes.

    ``direct`` ops carry one range of one big tensor, which a rank moves in place
    when its tensor is contiguous.
    """

    nbytes: int = 0
    dtype: str | None = None
    direct: bool = False
    pieces: list[Piece] = field(default_factory=list)


def plan(layout: Listing, bucket_bytes: int, direct_bytes: int, typed: bool) -> list[BulkOp]:
    """Return the ops that move ``layout``, in the order every rank issues them.

    Args:
        layout: the agreed tensors, in layout order.
        bucket_bytes: the most bytes of one op.
        direct_bytes: the size from which a tensor moves in ops of its own.
        typed: whether each op moves one dtype (a reduction) rather than bytes.

    """
    bulk_ops: list[BulkOp] = []
    open_buckets: dict[str | None, BulkOp] = {}
    for i in range(len(layout)):
        dtype, nbytes = layout.dtypes[i], layout.nbytes(i)
        if nbytes == 0:
            continue
        size = ITEMSIZE[dtype]
        count = nbytes // size
        if nbytes >= direct_bytes or nbytes > bucket_bytes:
            per_op = bucket_bytes // size
            for start in range(0, count, per_op):
                stop = min(count, start + per_op)
                piece = Piece(i, start, stop, 0)
                bulk_ops.append(
                    BulkOp((stop - start) * size, dtype if typed else None, True, [piece])
                )
            continue
        key = dtype if typed else None
        bucket = open_buckets.get(key)
        offset = -(-bucket.nbytes // size) * size if bucket is not None else 0
        if bucket is None or offset + nbytes > bucket_bytes:
            bucket = open_buckets[key] = BulkOp(dtype=key)
            bulk_ops.append(bucket)
            offset = 0
        bucket.pieces.append(Piece(i, 0, count, offset))
        bucket.nbytes = offset + nbytes
    return bulk_ops


def staging_bytes(bulk_ops: list[BulkOp]) -> int:
    """Return the bytes of the largest op of ``bulk_ops``: what one staging buffer must hold."""
    return max((s.nbytes for s in bulk_ops), default=0)
