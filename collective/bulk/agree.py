"""How the ranks of a bulk call agree on what moves, before anything moves.

Every rank allgathers one small signature: the op, root, reduction, list length, its
own argument error if any, its bucket size, a digest of its listing, the size of the
reference rank's encoded listing and whether it needs that listing. When every digest
matches the reference rank's (the source of a broadcast, rank 0 of an allreduce) and
no rank needs the listing, that is all. Otherwise the reference rank's listing
travels in one broadcast, each rank compares its own with it, and one more exchange
makes every rank raise the same error, naming the first entry that differs, when any
rank's does. Nothing is written before this returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from collective import checked, signature
from collective.bulk.meta import Listing, differences
from collective.groups.base import BaseGroup
from collective.tensor import array_bytes, byte_array, to_host
from collective.types import ArgumentError, ArgumentValueError, BroadcastOptions, ReduceOp

NEEDS_LIST, NO_TENSORS = 1, 2
"""Flags of a rank's signature: it needs the reference's listing; it passed no tensors."""

_EXTRA = 4
"""Slots after the standard signature: bucket bytes, digest, listing bytes, flags."""


@dataclass(frozen=True)
class Claim:
    """What one rank brings to a bulk call, after its own argument checks.

    ``listing`` is in the rank's own order; None where the rank passed no tensors
    (a receiver's ``None``) or its checks failed, whose error is ``error``.
    """

    op: str
    argument: str
    root: int
    reduce_op: ReduceOp | None
    count: int
    bucket_bytes: int
    listing: Listing | None
    strict: bool
    error: ArgumentError | None


@dataclass(frozen=True)
class Agreement:
    """What every rank agreed on: the layout that moves, and the reference's own order.

    ``layout`` is the reference rank's listing in layout order (a state dict's by
    name). ``source_order`` is its listing in its own order, where it travelled.
    """

    layout: Listing
    source_order: Listing | None


def agree(
    group: BaseGroup,
    claim: Claim,
    timeout: timedelta | None,
    on_device: Callable[[Any], Any],
) -> Agreement:
    """Agree with the other ranks on ``claim``; return the layout every rank then moves.

    Raises:
        ArgumentError: some rank's own checks failed, or the ranks disagree; the same
            error on every rank, before anything is written.

    """
    n, op = group.world_size, claim.op
    reference = claim.root if claim.root != signature.UNSET else 0
    if not 0 <= reference < n:
        reference = 0  # this rank's root is out of range: its error ends the exchange
    listing = claim.listing if claim.error is None else None
    layout = listing.sorted() if listing is not None else None
    digest = layout.digest() if layout is not None else 0
    encoded = listing.encode() if listing is not None and group.rank == reference else b""
    flags = (NEEDS_LIST if listing is None or not claim.strict else 0) | (
        NO_TENSORS if listing is None else 0
    )
    slots = signature.of_call(op, n, None, claim.root, claim.reduce_op, claim.count)
    slots += [claim.bucket_bytes, digest, len(encoded), flags]
    signatures = checked.agree(group, op, slots, timeout, claim.error, on_device)
    extras = [s[-_EXTRA:] for s in signatures]
    _same_buckets(group, op, [e[0] for e in extras])
    ref_digest, ref_bytes = extras[reference][1], extras[reference][2]
    with_tensors = [e for e in extras if not e[3] & NO_TENSORS]
    differ = any(e[1] != ref_digest for e in with_tensors)
    source_order = None
    if differ or any(e[3] & NEEDS_LIST for e in extras):
        buffer = on_device(byte_array(encoded, ref_bytes))
        options = BroadcastOptions(reference, 0, timeout)
        group.broadcast([buffer], options).wait()
        source_order = Listing.decode(array_bytes(to_host(buffer), ref_bytes))
    if differ:
        there = f"{'src_rank' if claim.root != signature.UNSET else 'rank'} {reference}"
        problem = None
        if listing is not None and source_order is not None and digest != ref_digest:
            where = f"rank {group.rank}"
            problem = differences(listing, source_order, where, there, claim.argument, claim.strict)
        error = ArgumentValueError(problem) if problem else None
        checked.agree(group, op, signature.blank(op, n), timeout, error, on_device)
    if source_order is not None:
        return Agreement(source_order.sorted(), source_order)
    if layout is None:
        raise AssertionError("a rank without tensors always receives the listing")
    return Agreement(layout, None)


def _same_buckets(group: BaseGroup, op: str, sizes: list[int]) -> None:
    """Raise the same error on every rank if the ranks asked for different bucket sizes."""
    if len(set(sizes)) == 1:
        return
    by_size: dict[int, list[int]] = {}
    for rank, size in enumerate(sizes):
        by_size.setdefault(size, []).append(rank)
    parts = ", ".join(f"{size} on ranks {ranks}" for size, ranks in by_size.items())
    raise ArgumentValueError(
        f"{op} on group {group.group_name!r}: the ranks passed different arguments; "
        f"bucket_bytes: {parts}"
    )
