"""Fingerprints of many CPU torch tensors, taken and compared at C speed.

A bulk call that repeats (a trainer's weights sent every step) passes the same
tensors again. ``fingerprint`` says, without a Python loop over them, whether they
are still the same objects over the same memory with the same shape, strides,
dtype and grad flags.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter, is_
from typing import Any

_META = attrgetter("shape", "dtype", "requires_grad", "is_leaf", "is_cpu")
"""What a tensor's metadata holds besides its address and strides."""


@dataclass(frozen=True)
class Fingerprint:
    """The tensors of a call, held weakly, and what their memory and metadata were.

    It keeps no tensor alive: a tensor that is gone no longer matches.
    """

    refs: tuple[weakref.ref[Any], ...]
    addresses: list[int]
    metas: list[tuple[Any, ...]]
    strides: list[tuple[int, ...]]

    def matches(self, xs: Sequence[Any]) -> bool:
        """Return whether ``xs`` are the same tensors, over the same memory, as described."""
        if len(xs) != len(self.refs) or not all(map(is_, xs, map(weakref.ref.__call__, self.refs))):
            return False
        try:
            return (
                self.addresses == _addresses(xs)
                and self.metas == list(map(_META, xs))
                and self.strides == _strides(xs)
            )
        except RuntimeError:  # a tensor without storage (sparse, meta) since
            return False


def fingerprint(xs: Sequence[Any]) -> Fingerprint | None:
    """Return the fingerprint of ``xs`` if all are plain, contiguous CPU torch tensors, else None.

    Plain means of type ``torch.Tensor`` or ``torch.nn.Parameter``, dense, on the
    CPU, without the negative bit; anything else (numpy arrays, GPU tensors, strided
    views, lazy negations) has none.
    """
    torch = sys.modules.get("torch")
    if torch is None or not xs or not set(map(type, xs)) <= {torch.Tensor, torch.nn.Parameter}:
        return None
    try:
        if set(map(attrgetter("layout"), xs)) != {torch.strided}:
            return None
        if not all(map(attrgetter("is_cpu"), xs)) or not all(map(torch.Tensor.is_contiguous, xs)):
            return None
        if any(map(torch.Tensor.is_neg, xs)):
            return None
        metas = list(map(_META, xs))
        return Fingerprint(tuple(map(weakref.ref, xs)), _addresses(xs), metas, _strides(xs))
    except (RuntimeError, TypeError):
        return None


def _addresses(xs: Sequence[Any]) -> list[int]:
    return list(map(sys.modules["torch"].Tensor.data_ptr, xs))


def _strides(xs: Sequence[Any]) -> list[tuple[int, ...]]:
    return list(map(sys.modules["torch"].Tensor.stride, xs))
