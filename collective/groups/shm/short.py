"""Allreduce, reduce and broadcast of short messages among the ranks of one node.

An op of at most ``SHORT_BYTES`` is a single step of the step protocol (see
``steps``), and its cost is the Python around the step, not the bytes. This path
runs that step with what the general path makes on every call made once per (op,
dtype, element count, reduction, root): the typed views of every rank's slots, cut
to the message, the signature word and the ufunc. Each op is the general path's
step (``algorithms.Collectives``) for a one-step message, with the same signature,
so a rank on this path and a rank on the general one meet in the same op. It
reduces with the ufuncs of ``Reducer`` in the general path's order, so every rank
gets the general path's bits.

It takes a flat view of a plain buffer (see ``frameworks.plain_flat``) of a dtype and
a reduction the group accepts; ``plan`` says None for anything else. The CPU group
makes a call's plan once, when it builds the call's launch (see ``calls``), after
the call's checks; the launch then runs the op with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from collective.frameworks.kinds import plain_dtype
from collective.groups.shm.kernels import UFUNCS
from collective.groups.shm.steps import Steps
from collective.types import ReduceOp

SHORT_BYTES = 64 << 10
"""The largest message this path takes (never more than a slot)."""

MAX_PLANS = 64
"""Plans kept at most; the cache starts afresh when a new one would exceed this."""


PlanKey = tuple[str, np.dtype, int, "ReduceOp | None", int]
"""(op, dtype, element count, reduction or None, root or -1): what one plan serves."""


@dataclass(frozen=True)
class _Plan:
    """What one op on one dtype, element count, reduction and root needs, made once."""

    word: int
    nbytes: int
    ufunc: Any
    divisor: int
    """The world size for AVG, which divides the sum by it; else 0."""
    parts: list[list[np.ndarray]]
    """Per slot buffer, every local rank's slot as a typed array of the message's length."""
    root: int
    """The op's root, -1 for allreduce."""


class ShortOps:
    """Allreduce, reduce and broadcast of short plain buffers, when every rank is local."""

    def __init__(
        self, steps: Steps, world_size: int, accepts: Callable[[ReduceOp | None, str], bool]
    ) -> None:
        """Run through ``steps``; ``accepts(op, dtype)`` says what the group takes.

        ``op`` None asks about a dtype alone, for an op that reduces nothing.
        """
        self._steps = steps
        self._world_size = world_size
        self._accepts = accepts
        self._limit = min(SHORT_BYTES, steps.slot_bytes)
        self._plans: dict[PlanKey, _Plan | None] = {}

    def plan(self, kind: str, flat: np.ndarray, op: ReduceOp | None, root: int) -> _Plan | None:
        """Return the plan of ``kind`` on buffers like ``flat``; None if this path does not take it.

        It does not take a message longer than ``SHORT_BYTES`` or of a dtype or
        reduction the group does not accept. ``root`` is -1 for allreduce.
        """
        key = (kind, flat.dtype, flat.size, op, root)
        plan = self._plans.get(key)
        if plan is None and key not in self._plans:
            plan = self._prepare(key)
        return plan

    def allreduce(self, plan: _Plan, flat: np.ndarray, deadline: float) -> None:
        """Reduce every rank's ``flat`` into every rank's ``flat`` in place, as ``plan`` says.

        ``plan`` is the one ``plan`` gave for ``flat``'s dtype and length.

        Raises:
            TimeoutError, PeerDiedError, AbortedError, MismatchError: as ``Steps``.

        """
        steps = self._steps
        step, parts = self._start(plan)
        self._give(step, parts, flat, deadline)
        steps.collect_all(step, deadline)
        ufunc = plan.ufunc
        ufunc(parts[0], parts[1], out=flat)
        for part in parts[2:]:
            ufunc(flat, part, out=flat)
        if plan.divisor:
            np.divide(flat, plan.divisor, out=flat)
        steps.done(step)

    def reduce(self, plan: _Plan, flat: np.ndarray, deadline: float) -> None:
        """Reduce every rank's ``flat`` into the root's, in place; raises as ``allreduce``.

        The other ranks' ``flat`` is only read. The root is ``plan``'s, a local rank
        the caller checked.
        """
        root = plan.root
        steps = self._steps
        step, parts = self._start(plan)
        if steps.rank != root:
            self._give(step, parts, flat, deadline)
            steps.confirm([root], step, deadline)
        else:
            steps.arrive(step, deadline)
            steps.collect_all(step, deadline)
            ufunc = plan.ufunc
            for rank in steps.others:
                ufunc(flat, parts[rank], out=flat)
            if plan.divisor:
                np.divide(flat, plan.divisor, out=flat)
        steps.done(step)

    def broadcast(self, plan: _Plan, flat: np.ndarray, deadline: float) -> None:
        """Copy the root's ``flat`` into every other rank's, in place; raises as ``allreduce``.

        The root's ``flat`` is only read. The root is ``plan``'s, a local rank the
        caller checked.
        """
        root = plan.root
        steps = self._steps
        step, parts = self._start(plan)
        if steps.rank == root:
            self._give(step, parts, flat, deadline)
            steps.confirm(steps.others, step, deadline)
        else:
            steps.arrive(step, deadline)
            steps.collect(root, step, deadline)
            flat[...] = parts[root]
        steps.done(step)

    def _start(self, plan: _Plan) -> tuple[int, list[np.ndarray]]:
        """Begin ``plan``'s op; return its step and every rank's slot for that step."""
        steps = self._steps
        steps.begin_signed(plan.word, plan.nbytes)
        step = steps.next()
        return step, plan.parts[step % steps.nbuf]

    def _give(self, step: int, parts: list[np.ndarray], flat: np.ndarray, deadline: float) -> None:
        """Copy ``flat`` into this rank's slot of ``step`` once it is free, and post it."""
        steps = self._steps
        steps.free(step, deadline)
        parts[steps.rank][...] = flat
        steps.post(step)

    def _prepare(self, key: PlanKey) -> _Plan | None:
        """Make and keep the plan of ``key``; None (kept too) if this path does not take it."""
        kind, dtype, count, op, root = key
        name = plain_dtype(dtype)
        plan = None
        nbytes = count * dtype.itemsize
        if name is not None and nbytes <= self._limit and self._accepts(op, name):
            steps = self._steps
            signed = (kind, name, -1 if op is None else op.value, root)
            parts = [
                [steps.slots[r][b][:nbytes].view(dtype) for r in range(steps.size)]
                for b in range(steps.nbuf)
            ]
            divisor = self._world_size if op is ReduceOp.AVG else 0
            plan = _Plan(
                steps.signature_word(signed),
                nbytes,
                None if op is None else UFUNCS[op],
                divisor,
                parts,
                root,
            )
        if len(self._plans) >= MAX_PLANS:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def release(self) -> None:
        """Drop every view of the arena, so that it can be unmapped; no op may follow.

        The plans' views are dropped in place: a plan still held elsewhere (a cached
        launch, the traceback of an op that failed) holds none then.
        """
        for plan in self._plans.values():
            if plan is not None:
                for views in plan.parts:
                    views.clear()
                plan.parts.clear()
        self._plans = {}
