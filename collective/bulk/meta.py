"""What a rank's many tensors are: names, dtypes and shapes, their encoding, digest and differences.

A ``Listing`` describes the tensors of one call in one order: a state dict's by
name, a list's by index (no names). Ranks compare digests of their listings; when
they differ, the reference rank's encoded listing travels, and each rank names the
first entry where its own differs.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from collective.frameworks.packing import ITEMSIZE

MAX_REPORTED = 1
"""Entries named in a mismatch message; the count of the others follows."""


@dataclass(frozen=True)
class Listing:
    """The dtype and shape of each tensor of a call; ``names`` is None for a list."""

    names: tuple[str, ...] | None
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    _memo: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """``sorted``, ``encode`` and ``digest``, once made: a kept listing serves many calls."""

    def __len__(self) -> int:
        """Return the number of tensors."""
        return len(self.dtypes)

    def nbytes(self, i: int) -> int:
        """Return the bytes of tensor ``i``."""
        return math.prod(self.shapes[i]) * ITEMSIZE[self.dtypes[i]]

    def sorted(self) -> Listing:
        """Return this listing in name order (a list's stays in index order)."""
        if self.names is None:
            return self
        done = self._memo.get("sorted")
        if done is None:
            order = sorted(range(len(self)), key=self.names.__getitem__)
            done = self._memo["sorted"] = Listing(
                tuple(self.names[i] for i in order),
                tuple(self.dtypes[i] for i in order),
                tuple(self.shapes[i] for i in order),
            )
        return done

    def encode(self) -> bytes:
        """Return the listing as compact bytes, for ``decode`` on another rank."""
        done = self._memo.get("encode")
        if done is None:
            body = [self.names, self.dtypes, self.shapes]
            text = json.dumps(body, separators=(",", ":"), ensure_ascii=False)
            done = self._memo["encode"] = text.encode()
        return done

    @classmethod
    def decode(cls, data: bytes) -> Listing:
        """Return the listing that ``encode`` made ``data`` of."""
        names, dtypes, shapes = json.loads(data.decode())
        return cls(
            None if names is None else tuple(names),
            tuple(dtypes),
            tuple(tuple(shape) for shape in shapes),
        )

    def digest(self) -> int:
        """Return a 64-bit digest of the listing, as a signed int64 value."""
        done = self._memo.get("digest")
        if done is None:
            value = hashlib.blake2b(self.encode(), digest_size=8).digest()
            done = self._memo["digest"] = int.from_bytes(value, "little", signed=True)
        return done

    def describe(self, i: int) -> str:
        """Return entry ``i`` as dtype and shape, e.g. ``float32[4, 2]``."""
        return f"{self.dtypes[i]}[{', '.join(str(d) for d in self.shapes[i])}]"


def differences(
    mine: Listing, reference: Listing, where: str, there: str, argument: str, strict: bool
) -> str | None:
    """Return how ``mine`` differs from ``reference`` (in its order), naming the first entry.

    Args:
        mine: this rank's listing.
        reference: the reference rank's listing, in that rank's order.
        where: this rank, as a message says it, e.g. ``"rank 2"``.
        there: the reference rank, e.g. ``"src_rank 0"``.
        argument: the argument's name, e.g. ``"state_dict"``.
        strict: whether keys on one side only count (a list's entries always do).

    Returns:
        None when they agree, else a message naming the first entry that differs.

    """
    if reference.names is None or mine.names is None:
        return _list_differences(mine, reference, where, there, argument)
    found = []
    index = {name: i for i, name in enumerate(mine.names)}
    for j, name in enumerate(reference.names):
        i = index.get(name)
        if i is None:
            if strict:
                found.append(f"{argument} lacks key {name!r}, which {there} sends")
        elif (mine.dtypes[i], mine.shapes[i]) != (reference.dtypes[j], reference.shapes[j]):
            found.append(
                f"{argument}[{name!r}] is {mine.describe(i)} on {where} but "
                f"{reference.describe(j)} on {there}"
            )
    if strict:
        sent = set(reference.names)
        found += [
            f"{argument} has key {name!r}, which {there} does not send"
            for name in mine.names
            if name not in sent
        ]
    return _summary(found)


def _list_differences(
    mine: Listing, reference: Listing, where: str, there: str, argument: str
) -> str | None:
    if len(mine) != len(reference):
        return f"{argument} holds {len(mine)} tensors on {where} but {len(reference)} on {there}"
    found = [
        f"{argument}[{i}] is {mine.describe(i)} on {where} but {reference.describe(i)} on {there}"
        for i in range(len(mine))
        if (mine.dtypes[i], mine.shapes[i]) != (reference.dtypes[i], reference.shapes[i])
    ]
    return _summary(found)


def _summary(found: list[str]) -> str | None:
    if not found:
        return None
    more = len(found) - MAX_REPORTED
    return "; ".join(found[:MAX_REPORTED]) + (f" (and {more} more differences)" if more else "")
