"""Allreduce of short messages among the ranks of one node: one step, its views made once.

An allreduce of at most ``SHORT_BYTES`` is a single step of the step protocol
(see ``steps``), and its cost is the Python around the step, not the bytes. This
path runs that step with what the general path makes on every call made once per
(dtype, element count, reduction): the typed views of every rank's slots, cut to
the message, the signature word and the ufunc. It reduces the slots in rank order
with the ufuncs of ``Reducer.fold``, so every rank gets the general path's bits.

It only takes what needs no checking: a flat view of a plain buffer (see
``tensor.plain_flat``) of a dtype and a reduction the group accepts. For anything
else it returns False, and the caller runs the general path, which checks the
arguments and raises their errors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from collective.groups.shm.kernels import UFUNCS
from collective.groups.shm.steps import Steps
from collective.tensor import plain_dtype
from collective.types import ReduceOp

SHORT_BYTES = 64 << 10
"""The largest message this path takes (never more than a slot)."""

MAX_PLANS = 64
"""Plans kept at most; the cache starts afresh when a new one would exceed this."""


@dataclass(frozen=True)
class _Plan:
    """What one (dtype, element count, reduction) needs, made on its first op."""

    key: tuple[str, str, int, int]
    word: int
    nbytes: int
    ufunc: Any
    divisor: int
    """The world size for AVG, which divides the sum by it; else 0."""
    parts: list[list[np.ndarray]]
    """Per slot buffer, every local rank's slot as a typed array of the message's length."""


class ShortAllreduce:
    """Allreduce of short plain buffers for one local rank, when every rank is local."""

    def __init__(
        self, steps: Steps, world_size: int, accepts: Callable[[ReduceOp, str], bool]
    ) -> None:
        """Run through ``steps``; ``accepts(op, dtype)`` says what the group takes."""
        self._steps = steps
        self._world_size = world_size
        self._accepts = accepts
        self._limit = min(SHORT_BYTES, steps.slot_bytes)
        self._plans: dict[tuple[np.dtype, int, ReduceOp], _Plan | None] = {}

    def __call__(self, flat: np.ndarray, op: ReduceOp, deadline: float) -> bool:
        """Reduce every rank's ``flat`` into every rank's ``flat`` in place; False if not taken.

        Returns False, having done nothing, when the message is longer than
        ``SHORT_BYTES`` or of a dtype or reduction the group does not accept.

        Raises:
            TimeoutError, PeerDiedError, AbortedError, MismatchError: as ``Steps``.

        """
        key = (flat.dtype, flat.size, op)
        plan = self._plans.get(key)
        if plan is None:
            plan = None if key in self._plans else self._prepare(key)
            if plan is None:
                return False
        steps = self._steps
        steps.begin_signed(plan.key, plan.word, plan.nbytes)
        step = steps.next()
        parts = plan.parts[step % steps.nbuf]
        steps.free(step, deadline)
        parts[steps.rank][...] = flat
        steps.post(step)
        steps.collect_all(step, deadline)
        ufunc = plan.ufunc
        ufunc(parts[0], parts[1], out=flat)
        for part in parts[2:]:
            ufunc(flat, part, out=flat)
        if plan.divisor:
            np.divide(flat, plan.divisor, out=flat)
        steps.done(step)
        return True

    def _prepare(self, key: tuple[np.dtype, int, ReduceOp]) -> _Plan | None:
        """Make and keep the plan of ``key``; None (kept too) if this path does not take it."""
        dtype, count, op = key
        name = plain_dtype(dtype)
        plan = None
        nbytes = count * dtype.itemsize
        if name is not None and nbytes <= self._limit and self._accepts(op, name):
            steps = self._steps
            signed = ("allreduce", name, op.value, -1)
            parts = [
                [steps.slots[r][b][:nbytes].view(dtype) for r in range(steps.size)]
                for b in range(steps.nbuf)
            ]
            divisor = self._world_size if op is ReduceOp.AVG else 0
            plan = _Plan(
                signed,
                steps.signature_word(signed),
                nbytes,
                UFUNCS[op],
                divisor,
                parts,
            )
        if len(self._plans) >= MAX_PLANS:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def release(self) -> None:
        """Drop every view of the arena, so that it can be unmapped; no op may follow."""
        self._plans = {}
