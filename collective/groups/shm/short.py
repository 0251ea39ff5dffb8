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
a reduction the group accepts; ``prepare`` says None for anything else. The CPU group
prepares a call once, when it builds the call's launch (see ``collective.ops.calls``), after
the call's checks; the launch then runs the op with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from collective.frameworks.kinds import plain_dtype
from collective.groups.shm import gathered
from collective.groups.shm.kernels import UFUNCS
from collective.groups.shm.steps import Steps
from collective.types import ReduceOp

SHORT_BYTES = 64 << 10
"""The largest message this path takes (never more than a slot)."""

MAX_PREPARED = 64
"""Prepared calls kept at most; the cache starts afresh when a new one would exceed this."""


PreparedKey = tuple[str, np.dtype, int, "ReduceOp | None", int]
"""(op, dtype, element count, reduction or None, root or -1): what one prepared call serves."""


@dataclass(frozen=True)
class _Prepared:
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
    gathered: bool
    """Whether the op is gathered at ``gathered.LEADER`` (see ``gathered``)."""


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
        self._prepared: dict[PreparedKey, _Prepared | None] = {}

    def prepare(
        self, kind: str, flat: np.ndarray, op: ReduceOp | None, root: int
    ) -> _Prepared | None:
        """Return the prepared call of ``kind`` on buffers like ``flat``; None if not taken here.

        It does not take a message longer than ``SHORT_BYTES`` or of a dtype or
        reduction the group does not accept. ``root`` is -1 for allreduce.
        """
        key = (kind, flat.dtype, flat.size, op, root)
        prepared = self._prepared.get(key)
        if prepared is None and key not in self._prepared:
            prepared = self._prepare(key)
        return prepared

    def allreduce(self, prepared: _Prepared, flat: np.ndarray, deadline: float) -> None:
        """Reduce every rank's ``flat`` into every rank's ``flat`` in place, as ``prepared`` says.

        ``prepared`` is the one ``prepare`` gave for ``flat``'s dtype and length.

        Raises:
            TimeoutError, PeerDiedError, AbortedError, MismatchError: as ``Steps``.

        """
        if prepared.gathered:
            self._allreduce_gathered(prepared, flat, deadline)
            return
        steps = self._steps
        step, parts = self._start(prepared)
        self._give(step, parts, flat, deadline)
        steps.collect_all(step, deadline)
        ufunc = prepared.ufunc
        ufunc(parts[0], parts[1], out=flat)
        for part in parts[2:]:
            ufunc(flat, part, out=flat)
        if prepared.divisor:
            np.divide(flat, prepared.divisor, out=flat)
        steps.done(step)

    def _allreduce_gathered(self, prepared: _Prepared, flat: np.ndarray, deadline: float) -> None:
        """Run ``allreduce`` as ``gathered.allreduce`` does, on the prepared views."""
        steps = self._steps
        step, parts = self._start(prepared)
        steps.free(step, deadline)
        mine = parts[steps.rank]
        if steps.rank == gathered.LEADER:
            steps.gather(step, deadline)
            ufunc = prepared.ufunc
            ufunc(flat, parts[1], out=mine)
            for part in parts[2:]:
                ufunc(mine, part, out=mine)
            if prepared.divisor:
                np.divide(mine, prepared.divisor, out=mine)
            flat[...] = mine
            steps.post(step)
        else:
            mine[...] = flat
            steps.post(step)
            steps.collect_gathered(gathered.LEADER, step, deadline)
            flat[...] = parts[gathered.LEADER]
        steps.done(step)

    def reduce(self, prepared: _Prepared, flat: np.ndarray, deadline: float) -> None:
        """Reduce every rank's ``flat`` into the root's, in place; raises as ``allreduce``.

        The other ranks' ``flat`` is only read. The root is ``prepared``'s, a local rank
        the caller checked.
        """
        root = prepared.root
        steps = self._steps
        step, parts = self._start(prepared)
        if steps.rank != root:
            self._give(step, parts, flat, deadline)
            steps.confirm([root], step, deadline)
        else:
            steps.arrive(step, deadline)
            steps.collect_all(step, deadline)
            ufunc = prepared.ufunc
            for rank in steps.others:
                ufunc(flat, parts[rank], out=flat)
            if prepared.divisor:
                np.divide(flat, prepared.divisor, out=flat)
        steps.done(step)

    def broadcast(self, prepared: _Prepared, flat: np.ndarray, deadline: float) -> None:
        """Copy the root's ``flat`` into every other rank's, in place; raises as ``allreduce``.

        The root's ``flat`` is only read. The root is ``prepared``'s, a local rank the
        caller checked.
        """
        root = prepared.root
        steps = self._steps
        step, parts = self._start(prepared)
        if steps.rank == root:
            self._give(step, parts, flat, deadline)
            steps.confirm(steps.others, step, deadline)
        else:
            steps.arrive(step, deadline)
            steps.collect(root, step, deadline)
            flat[...] = parts[root]
        steps.done(step)

    def _start(self, prepared: _Prepared) -> tuple[int, list[np.ndarray]]:
        """Begin ``prepared``'s op; return its step and every rank's slot for that step."""
        steps = self._steps
        steps.begin_signed(prepared.word, prepared.nbytes)
        step = steps.next()
        return step, prepared.parts[step % steps.nbuf]

    def _give(self, step: int, parts: list[np.ndarray], flat: np.ndarray, deadline: float) -> None:
        """Copy ``flat`` into this rank's slot of ``step`` once it is free, and post it."""
        steps = self._steps
        steps.free(step, deadline)
        parts[steps.rank][...] = flat
        steps.post(step)

    def _prepare(self, key: PreparedKey) -> _Prepared | None:
        """Make and keep the prepared call of ``key``; None (kept too) if not taken here."""
        kind, dtype, count, op, root = key
        name = plain_dtype(dtype)
        prepared = None
        nbytes = count * dtype.itemsize
        if name is not None and nbytes <= self._limit and self._accepts(op, name):
            steps = self._steps
            signed = (kind, name, -1 if op is None else op.value, root)
            parts = [
                [steps.slots[r][b][:nbytes].view(dtype) for r in range(steps.size)]
                for b in range(steps.nbuf)
            ]
            divisor = self._world_size if op is ReduceOp.AVG else 0
            prepared = _Prepared(
                steps.signature_word(signed),
                nbytes,
                None if op is None else UFUNCS[op],
                divisor,
                parts,
                root,
                kind == "allreduce" and gathered.gathers(steps, nbytes),
            )
        if len(self._prepared) >= MAX_PREPARED:
            self._prepared.clear()
        self._prepared[key] = prepared
        return prepared

    def release(self) -> None:
        """Drop every view of the arena, so that it can be unmapped; no op may follow.

        The prepared calls' views are dropped in place: a prepared still held elsewhere (a cached
        launch, the traceback of an op that failed) holds none then.
        """
        for prepared in self._prepared.values():
            if prepared is not None:
                for views in prepared.parts:
                    views.clear()
                prepared.parts.clear()
        self._prepared = {}
