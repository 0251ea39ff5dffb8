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
  current size to the new size. A member or a newcomer that dies during a grow fails it.

A decided change is built before it takes over: every rank of the next incarnation
builds its transports and commits. Only once all have committed does the next
incarnation become the group's current one and the old one end; until then the old
incarnation stays current and usable. A rank that fails to build, dies, or does not
commit in time abandons the change: the next incarnation ends (which wakes every rank
still building in it with the reason) and every rank keeps the old group.

A change that failed is kept for the members that have not come yet: one that calls
afterwards gets the same failure at once, and its next call starts a new change.
"""

from __future__ import annotations

from dataclasses import replace

from collective.rendezvous.liveness import Member
from collective.rendezvous.state import (
    GROW,
    SHRINK,
    GroupState,
    Incarnation,
    Reshape,
    describe,
)


def enter(
    group: GroupState,
    kind: str,
    rank: int,
    member: Member,
    world_size: int,
    exclude: list[int],
    deadline: float,
) -> Reshape | tuple[str, str]:
    """Record that current member ``rank`` calls ``kind``; return the change, or why it cannot.

    Why it cannot is ``("mismatch", why)`` when the call disagrees with an earlier
    caller's (which then fails too), the outcome of a change that failed before this
    member came, else ``("error", why)``.

    Args:
        group: the group, in the store.
        kind: ``SHRINK`` or ``GROW``.
        rank: the caller's rank in the current incarnation.
        member: the caller.
        world_size: for a grow, the new world size.
        exclude: for a shrink, the live ranks to drop.
        deadline: when the caller stops waiting (monotonic).

    """
    world = group.current
    if world.holders().get(rank) != member:
        return "error", f"rank {rank} does not hold the current incarnation of the group"
    if group.building is not None:
        return "error", f"the {group.building.terms()} in progress is still being built"
    failed = late_for_failure(group, rank, member)
    if failed is not None:
        return failed
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
    change.come(rank, member, deadline)
    return change


def _callers(change: Reshape) -> str:
    ranks = sorted(change.arrived)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def late_for_failure(group: GroupState, rank: int, member: Member) -> tuple[str, str] | None:
    """Return the outcome of the change that failed before ``rank`` came to it, or None.

    A rank the failed change waited for gets its outcome, once; a rank that was told
    already starts a new change, so the failure is forgotten.
    """
    failed = group.failed
    if failed is None or failed.outcome is None:
        return None
    if rank in failed.arrived:
        group.failed = None
        return None
    failed.arrived[rank] = member
    status, why = failed.outcome
    return status, f"the {failed.terms()} this rank came to had failed: {why}"


def newcomer(
    group: GroupState, rank: int, world_size: int, member: Member, deadline: float
) -> Reshape | tuple[str, str] | None:
    """Record newcomer ``member`` as ``rank`` of a grow to ``world_size``.

    Returns:
        The grow; the outcome of a grow to ``world_size`` that failed before this
        newcomer came; or None if no grow fits.

    """
    change, world = group.reshape, group.current
    if not (world.world_size or 0) <= rank < world_size:
        return None
    failed = group.failed
    if (
        change is None
        and failed is not None
        and (failed.kind, failed.world_size)
        == (
            GROW,
            world_size,
        )
    ):
        return late_for_failure(group, rank, member)
    if change is None or change.kind != GROW or change.world_size != world_size:
        return None
    taken = change.arrived.get(rank)
    if taken is not None and taken.key != member.key:
        return None
    change.come(rank, member, deadline)
    group.jobs.add(member.job_id)
    return change


def newcomers(group: GroupState) -> dict[int, Member]:
    """Return the newcomers that came to the grow in progress, or wait for it, by rank."""
    change, size = group.reshape, group.current.world_size or 0
    if change is None or change.kind != GROW:
        return {}
    waiting = {
        r: m
        for r, (m, world_size) in group.waiting.items()
        if world_size == change.world_size and size <= r < world_size
    }
    return waiting | {r: m for r, m in change.arrived.items() if r >= size}


def fail_dead_newcomers(group: GroupState, name: str, dead: set[str]) -> None:
    """Fail the grow in progress if one of its newcomers is among the dead ``dead`` keys."""
    gone = sorted(r for r, m in newcomers(group).items() if m.key in dead)
    change = group.reshape
    if gone and change is not None:
        _fail(
            group,
            f"newcomer ranks {gone} died before {change.terms()} of group {name!r} was "
            f"built; the group keeps its {group.current.world_size} ranks",
        )


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


def decide(group: GroupState) -> Reshape | None:
    """Decide the change in progress if everyone it waits for has come; return it, or None.

    A grow whose member died fails instead. A decided change holds its next
    incarnation, ``following``, and is the group's ``building`` until every rank of it
    commits (``commit``) or it is abandoned (``abandon``).
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
    change.following = following
    change.outcome = ("ok", (following.id, numbering, size))
    group.reshape, group.building, group.failed = None, change, None
    change.wake()
    return change


def commit(group: GroupState, change: Reshape, rank: int) -> Incarnation | None:
    """Record that ``rank`` of ``change``'s next incarnation built it; return the old one.

    Once every rank has, the next incarnation becomes the group's current one and the
    old one is returned, for the caller to end; until then None.
    """
    following = change.following
    if following is None or group.building is not change or change.committed is not None:
        return None
    change.built.add(rank)
    if len(change.built) < (following.world_size or 0):
        return None
    old = group.current
    if group.declaration is not None:
        ranks = {m.actor_id or "": r for r, m in following.joined.items()}
        size = following.world_size or 0
        group.declaration = replace(group.declaration, world_size=size, ranks=ranks)
    group.current, group.building = following, None
    change.committed = ("ok", "")
    change.wake()
    return old


def abandon(group: GroupState, change: Reshape, status: str, why: str) -> Incarnation | None:
    """Give up building ``change``; return its next incarnation, for the caller to end.

    The old incarnation stays the group's current one. None if ``change`` is not
    being built (it was committed or abandoned already).
    """
    if group.building is not change or change.committed is not None:
        return None
    group.building = None
    change.committed = (status, why)
    change.wake()
    return change.following


def unbuilt(change: Reshape, dead: set[str], size: int) -> str:
    """Describe the ranks of ``change``'s next incarnation that died or have not committed.

    ``size`` is the group's size before the change: for a grow, the ranks from it on
    are the newcomers.
    """
    following = change.following
    if following is None:
        return ""
    gone = sorted(r for r, m in following.joined.items() if m.key in dead)
    newcomers = [r for r in gone if change.kind == GROW and r >= size]
    if newcomers:
        return f"newcomer ranks {newcomers} died while {change.terms()} was built"
    if gone:
        return f"ranks {gone} of the new incarnation died while {change.terms()} was built"
    waited = sorted(set(following.joined) - change.built)
    return f"ranks {waited} of the new incarnation did not finish building it in time"


def _fail(group: GroupState, why: str, status: str = "error") -> None:
    """End the change in progress with ``(status, why)`` for every caller."""
    change = group.reshape
    if change is not None:
        change.outcome = (status, why)
        group.reshape, group.failed = None, change
        change.wake()


def give_up(group: GroupState, change: Reshape, why: str) -> None:
    """End ``change`` with a timeout saying ``why``, if it is still the change in progress."""
    if group.reshape is change:
        _fail(group, why, "timeout")
