"""A bulk call that repeats an earlier one on its group skips this rank's per-tensor work.

A trainer sends the same state dict every bulk_op: the same names and tensors, over
the same memory. A call's own checks and descriptions of its tensors (``local``)
are kept, per group, under the call's arguments; a later call with equal arguments
and keys whose tensors ``Fingerprint.matches`` takes them instead of checking and
describing each tensor again. Only this rank's side is known here: the agreement
still compares every rank's listing, so a rank whose tensors changed is an error on
every rank, as on a first call. Plain contiguous CPU torch tensors have
fingerprints; other calls are checked in full every time.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from collective.bulk.meta import Listing
from collective.bulk.plan import BulkOp
from collective.frameworks.bytelist import ByteList, byte_runs
from collective.frameworks.prints import Fingerprint, fingerprint
from collective.groups.base import BaseGroup

KEPT_PER_GROUP = 4
"""Calls kept per group, the most recent ones; the oldest goes first."""


@dataclass
class Kept:
    """What a call found about this rank's tensors, for a call that repeats it.

    ``listing`` is in the rank's own order. The moves (``runs`` on a group that
    takes lists, ``bulk_ops`` elsewhere) depend on the agreed layout too, so they are
    kept with the layout they were made for.
    """

    names: tuple[str, ...] | None
    prints: Fingerprint
    listing: Listing
    layout: Listing | None = None
    runs: ByteList | None = None
    bulk_ops: list[BulkOp] | None = None
    scratch: dict[int, Any] = field(default_factory=dict)
    """Tensors this rank lacks (a key the source sends, with ``strict=False``), by layout
    entry: scratch that the bytes pass through."""

    def moves_for(self, layout: Listing) -> Kept | None:
        """Return self if the kept moves were made for ``layout``; else forget them, None."""
        if self.layout is not None and (self.layout is layout or self.layout == layout):
            return self
        self.layout, self.runs, self.bulk_ops, self.scratch = layout, None, None, {}
        return None


_kept: weakref.WeakKeyDictionary[BaseGroup, dict[Hashable, Kept]] = weakref.WeakKeyDictionary()


def find(
    group: BaseGroup, key: Hashable, names: tuple[str, ...] | None, xs: Sequence[Any]
) -> Kept | None:
    """Return what a call of ``key`` on ``group`` kept, if ``names`` and ``xs`` still match it."""
    kept = _kept.get(group, {}).get(key)
    if kept is None or kept.names != names or not kept.prints.matches(xs):
        return None
    return kept


def keep(
    group: BaseGroup,
    key: Hashable,
    names: tuple[str, ...] | None,
    xs: Sequence[Any],
    listing: Listing,
) -> Kept | None:
    """Keep what a call of ``key`` found about ``xs`` (named ``names``); None where it cannot."""
    calls = _kept.setdefault(group, {})
    calls.pop(key, None)
    prints = fingerprint(xs)
    if prints is None:
        return None
    while len(calls) >= KEPT_PER_GROUP:
        calls.pop(next(iter(calls)))
    kept = calls[key] = Kept(names, prints, listing)
    return kept


def runs(kept: Kept, ordered: Sequence[Any]) -> ByteList:
    """Return (and keep) the byte views of ``ordered``, this rank's tensors in layout order."""
    if kept.runs is None:
        kept.runs = byte_runs(ordered)
    return kept.runs
