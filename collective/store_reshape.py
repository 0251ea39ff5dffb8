"""A shrink or a grow of a live group, as the store actor runs it: who must come, and the result.

Every current member of the group calls ``shrink`` or ``grow``; for a grow, each
newcomer joins by ``init_collective_group``. The store collects the callers of one
change and decides it once, on its event loop, so every caller gets the same
answer: the group's next incarnation, and each caller's rank in it.

- Shrink: the members kept are the current holders (joined, neither left nor
  dead) minus the excluded ranks. A member that dies while the others wait is
  dropped too, as soon as the store learns of the death. New ranks keep the old
  order.
- Grow: every current holder keeps its rank; the newcomers take the ranks from the
  current size to the new size. A member that dies during a grow fails it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import Any

from collective.liveness import Member
from collective.store_state import GroupState, Incarnation

SHRINK, GROW = "shrink", "grow"


@dataclass
class Reshape:
    """One shrink or grow in progress: its terms, who has come, and its outcome once decided."""

    kind: str
    world_size: int
    """For a grow, the new world size; for a shrink, the size it started from."""
    exclude: tuple[int, ...] = ()
    """For a shrink, the live ranks the callers drop, sorted."""
    arrived: dict[int, Member] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: tuple[str, Any] | None = None
    """``("ok", (incarnation id, {old rank: new rank}, world size))``, or ``(status, why)``
    with status ``"mismatch"`` (the callers disagree), ``"timeout"`` or ``"error"``."""

    def wake(self) -> None:
        """Wake every caller waiting on this change, to look at it again."""
        self.changed.set()
        self.changed = asyncio.Event()


def describe(kind: str, world_size: int, exclude: tuple[int, ...]) -> str:
    """Return how a caller asked for a change, for messages."""
    if kind == SHRINK:
        return f"shrink_group(exclude={list(exclude)})"
    return f"grow_group(world_size={world_size})"


def enter(
    group: GroupState, kind: str, rank: int, member: Member, world_size: int, exclude: list[int]
) -> Reshape | tuple[str, str]:
    """Record that current member ``rank`` calls ``kind``; return the change, or why it cannot.

    Why it cannot is ``("mismatch", why)`` when the call disagrees with an earlier
    caller's (which then fails too), else ``("error", why)``.

    Args:
        group: the group, in the store.
        kind: ``SHRINK`` or ``GROW``.
        rank: the caller's rank in the current incarnation.
        member: the caller.
        world_size: for a grow, the new world size.
        exclude: for a shrink, the live ranks to drop.

    """
    world = group.current
    if world.holders().get(rank) != member:
        return "error", f"rank {rank} does not hold the current incarnation of the group"
    excluded = tuple(sorted(set(exclude)))
    if kind == SHRINK and rank in excluded:
        return "error", f"rank {rank} is in exclude={list(excluded)}, so it leaves the group"
    if kind == GROW and (world.world_size or 0) >= world_size:
        return "error", (
            f"grow_group(world_size={world_size}) must grow the group, which has "
            f"{world.world_size} ranks"
        )
    change = group.reshape
    if change is None:
        size = world_size if kind == GROW else world.world_size or 0
        change = group.reshape = Reshape(kind, size, excluded)
        group.stir()
    else:
        terms = describe(change.kind, change.world_size, change.exclude)
        mine = describe(kind, world_size if kind == GROW else change.world_size, excluded)
        if terms != mine:
            why = (
                f"every member must make the same call: rank {rank} called {mine}, but "
                f"{_callers(change)} called {terms}"
            )
            _fail(group, why, "mismatch")
            return "mismatch", why
    change.arrived[rank] = member
    return change


def _callers(change: Reshape) -> str:
    ranks = sorted(change.arrived)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def newcomer(group: GroupState, rank: int, world_size: int, member: Member) -> Reshape | None:
    """Record newcomer ``member`` as ``rank`` of a grow to ``world_size``; None if none fits."""
    change, world = group.reshape, group.current
    if change is None or change.kind != GROW or change.world_size != world_size:
        return None
    if not (world.world_size or 0) <= rank < world_size:
        return None
    taken = change.arrived.get(rank)
    if taken is not None and taken.key != member.key:
        return None
    change.arrived[rank] = member
    group.jobs.add(member.job_id)
    return change


def missing(group: GroupState) -> list[int]:
    """Return the ranks the change in progress still waits for, in the current numbering."""
    change, world = group.reshape, group.current
    if change is None:
        return []
    held = set(world.holders())
    if change.kind == SHRINK:
        expected = held - set(change.exclude)
    else:
        expected = set(world.joined) | set(range(world.world_size or 0, change.world_size))
    return sorted(expected - set(change.arrived))


def decide(group: GroupState, name: str) -> Incarnation | None:
    """Make the change in progress happen if everyone it waits for has come; return the old one.

    A grow whose member died fails instead. The old incarnation is returned so that
    the caller ends it (with ``Reshape`` outcome set), or None if nothing changed.
    """
    change, world = group.reshape, group.current
    if change is None or change.outcome is not None:
        return None
    if change.kind == GROW:
        dead = sorted(world.dead | world.left)
        if dead:
            _fail(group, f"ranks {dead} left or died during grow_group; shrink the group first")
            return None
    if missing(group):
        return None
    if change.kind == SHRINK:
        kept = sorted(r for r in world.holders() if r not in change.exclude)
        numbering = {old: new for new, old in enumerate(kept)}
    else:
        kept = sorted(change.arrived)
        numbering = {r: r for r in kept}
    size = len(kept) if change.kind == SHRINK else change.world_size
    following = Incarnation(size, world.backend)
    following.joined = {numbering[r]: change.arrived[r] for r in kept}
    if group.declaration is not None:
        ranks = {m.actor_id or "": r for r, m in following.joined.items()}
        group.declaration = replace(group.declaration, world_size=size, ranks=ranks)
    group.current = following
    change.outcome = ("ok", (following.id, numbering, size))
    group.reshape = None
    change.wake()
    return world


def _fail(group: GroupState, why: str, status: str = "error") -> None:
    """End the change in progress with ``(status, why)`` for every caller."""
    change = group.reshape
    if change is not None:
        change.outcome = (status, why)
        group.reshape = None
        change.wake()


def give_up(group: GroupState, change: Reshape, why: str) -> None:
    """End ``change`` with a timeout saying ``why``, if it is still the change in progress."""
    if group.reshape is change:
        _fail(group, why, "timeout")
