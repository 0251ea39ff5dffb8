"""How the ranks of a bulk call agree on what moves, before anything moves.

Every rank allgathers one small signature: the op, root, reduction, list length, its
own argument error if any, its bucket size, a digest of its listing, the size of the
reference rank's encoded listing and whether it needs that listing. When every digest
matches the reference rank's (the source of a broadcast, rank 0 of an allreduce) and
no rank needs the listing, that is all. Otherwise the reference rank's listing
travels in one broadcast, each rank compares its own with it, and one more exchange
makes every rank raise the same error, naming the first entry that differs, when any
rank's does. Nothing is written before this returns.

While the caller's stream captures a CUDA graph nothing can travel and be read back,
so a call made during capture takes the agreement that the same call (the same op,
root, reduction, bucket size and listing on this rank) reached on the group before
capture, or raises. As for a single op captured on NCCL, the other ranks are then
trusted to capture the same calls.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from collective import signature
from collective.bulk.meta import Listing, differences
from collective.checks import check_args
from collective.frameworks.kinds import array_bytes, byte_array
from collective.frameworks.packing import to_host
from collective.groups.base import BaseGroup
from collective.types import (
    ArgumentError,
    ArgumentValueError,
    BroadcastOptions,
    CollectiveError,
    ReduceOp,
)

NEEDS_LIST, NO_TENSORS = 1, 2
"""Flags of a rank's signature: it needs the reference's listing; it passed no tensors."""

_EXTRA = 4
"""Slots after the standard signature: bucket bytes, digest, listing bytes, flags."""

AGREEMENTS_KEPT = 16
"""Agreements a GPU group keeps for calls made during CUDA-graph capture; oldest go first."""

_agreed: weakref.WeakKeyDictionary[BaseGroup, dict[Hashable, Agreement]] = (
    weakref.WeakKeyDictionary()
)


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
    *,
    capturing: bool = False,
) -> Agreement:
    """Agree with the other ranks on ``claim``; return the layout every rank then moves.

    With ``capturing`` (the caller's stream captures a CUDA graph) nothing travels:
    the agreement comes from the same call made on the group before.

    Raises:
        ArgumentError: some rank's own checks failed, or the ranks disagree; the same
            error on every rank, before anything is written. During capture, this
            rank's own argument error.
        CollectiveError: during capture, a call this group has not agreed on before.

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
    key = (op, claim.root, claim.reduce_op, claim.count, claim.bucket_bytes, digest, flags)
    if capturing:
        return _agreed_before(group, claim, key)
    slots = signature.of_call(op, n, None, claim.root, claim.reduce_op, claim.count)
    slots += [claim.bucket_bytes, digest, len(encoded), flags]
    signatures = check_args.agree(group, op, slots, timeout, claim.error, on_device)
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
        check_args.agree(group, op, signature.blank(op, n), timeout, error, on_device)
    if source_order is not None:
        agreement = Agreement(source_order.sorted(), source_order)
    elif layout is None:
        raise AssertionError("a rank without tensors always receives the listing")
    else:
        agreement = Agreement(layout, None)
    if group.device_type == "cuda":
        kept = _agreed.setdefault(group, {})
        kept.pop(key, None)
        if len(kept) >= AGREEMENTS_KEPT:
            kept.pop(next(iter(kept)))
        kept[key] = agreement
    return agreement


def _agreed_before(group: BaseGroup, claim: Claim, key: Hashable) -> Agreement:
    """Return the agreement the group reached on the call ``key`` before; see the module doc."""
    if claim.error is not None:
        raise claim.error
    found = _agreed.get(group, {}).get(key)
    if found is None:
        raise CollectiveError(
            f"{claim.op} on group {group.group_name!r} while a CUDA graph is captured: the "
            "ranks cannot compare their tensors during capture; make the same call once "
            "before capturing it"
        )
    return found


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
