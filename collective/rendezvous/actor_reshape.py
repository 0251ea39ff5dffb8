"""The store actor's shrink, grow and driver re-declaration of groups (see ``reshape``).

``ReshapeMethods`` is a part of ``StoreActor``; it runs on the actor's event loop
and uses the actor's groups, listeners and incarnation bookkeeping.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from collective.rendezvous import liveness, reshape
from collective.rendezvous.liveness import Member
from collective.rendezvous.state import (
    GROW,
    SHRINK,
    GroupState,
    Incarnation,
    Listener,
    Reshape,
    wait_event,
)
from collective.rendezvous.store import report_failure

RESHAPE_POLL_S = 0.1
"""How often a shrink or grow in progress asks the GCS whether the members it waits for live."""


class ReshapeMethods:
    """Shrink and grow a group from its members, and declare it anew from the driver."""

    if TYPE_CHECKING:  # what StoreActor provides
        _groups: dict[str, GroupState]
        _listeners: dict[str, Listener]
        _tasks: set[asyncio.Task[None]]

        def _start_sweeping(self) -> None: ...
        async def _settled(self, name: str) -> GroupState | None: ...
        def _gone_reason(self, name: str, incarnation: str) -> str: ...
        def _forget(self, world: Incarnation, reason: str) -> None: ...
        async def _tell_members(
            self, name: str, group: GroupState, reason: str, remove: bool = True
        ) -> None: ...

    async def shrink(
        self,
        name: str,
        incarnation: str,
        rank: int,
        member: Member,
        exclude: list[int],
        timeout_s: float,
    ) -> tuple[str, Any]:
        """Shrink ``name`` to its live members less ``exclude``, once every one of them calls.

        Returns:
            ``("ok", (incarnation id, {old rank: new rank}, world size))``;
            ``("mismatch", why)`` when the call disagrees with another member's;
            ``("timeout", why)`` when not every member called within ``timeout_s``;
            ``("error", why)`` when this rank no longer holds the group.

        """
        return await self._reshape(name, incarnation, SHRINK, rank, member, 0, exclude, timeout_s)

    async def grow(
        self,
        name: str,
        incarnation: str,
        rank: int,
        member: Member,
        world_size: int,
        timeout_s: float,
    ) -> tuple[str, Any]:
        """Grow ``name`` to ``world_size`` once every member and every newcomer has come.

        Returns:
            As ``shrink``; every member keeps its rank.

        """
        return await self._reshape(name, incarnation, GROW, rank, member, world_size, [], timeout_s)

    async def _reshape(
        self,
        name: str,
        incarnation: str,
        kind: str,
        rank: int,
        member: Member,
        world_size: int,
        exclude: list[int],
        timeout_s: float,
    ) -> tuple[str, Any]:
        self._start_sweeping()
        deadline = time.monotonic() + timeout_s
        group = self._groups.get(name)
        if group is None or group.reshape is None:
            group = await self._settled(name)  # the first caller learns who died
        if group is None or group.current.id != incarnation:
            return "error", self._gone_reason(name, incarnation)
        if kind == GROW and group.declaration is not None:
            return "error", (
                f"group {name!r} was declared from the driver: grow it there with "
                "grow_declared_group"
            )
        change = reshape.enter(group, kind, rank, member, world_size, exclude, deadline)
        if isinstance(change, tuple):
            return change
        return await self._reshaped(name, group, change, deadline)

    async def _reshaped(
        self, name: str, group: GroupState, change: Reshape, deadline: float
    ) -> tuple[str, Any]:
        """Wait until ``change`` is decided (or ``deadline``); return its outcome.

        While it waits, the store asks the GCS every ``RESHAPE_POLL_S`` whether the
        members and newcomers it waits for are alive, and once more just before it
        decides: a member that dies meanwhile is dropped from a shrink, and a member
        or newcomer that dies fails a grow, within about that delay.
        """
        while change.outcome is None:
            if not reshape.missing(group):
                await self._mark_deaths(name, group)
            if reshape.decide(group) is not None:
                self._watch_building(name, group, change)
                break
            if change.outcome is not None:
                break
            if time.monotonic() >= deadline:
                reshape.give_up(group, change, self._late(group, change))
                break
            await wait_event(change.changed, min(deadline, time.monotonic() + RESHAPE_POLL_S))
            await self._mark_deaths(name, group)
        assert change.outcome is not None
        return change.outcome

    async def _mark_deaths(self, name: str, group: GroupState) -> None:
        """Mark the dead members of ``name``; fail the grow in progress if a newcomer died."""
        if self._groups.get(name) is not group:
            return
        held = group.current.holders()
        coming = reshape.newcomers(group)
        dead = await liveness.dead_members([*held.values(), *coming.values()])
        group.mark_dead(dead)
        reshape.fail_dead_newcomers(group, name, dead)

    def _late(self, group: GroupState, change: Reshape) -> str:
        """Describe who did not come in time to ``change``, members and newcomers apart."""
        terms = change.terms()
        size = group.current.world_size or 0
        waited = reshape.missing(group)
        members = [r for r in waited if r < size]
        newcomers = [r for r in waited if r >= size]
        parts = [f"ranks {members} did not call {terms}"] if members else []
        if newcomers:
            parts.append(
                f"newcomer ranks {newcomers} did not call "
                f"init_collective_group(world_size={change.world_size})"
            )
        return f"{'; '.join(parts)} in time (ranks {sorted(change.arrived)} did)"

    # --- building the decided change ---------------------------------------------------------

    async def commit(
        self, name: str, incarnation: str, rank: int, built: bool, why: str, timeout_s: float
    ) -> tuple[str, str]:
        """Say that ``rank`` of the new ``incarnation`` built its transports (or why not).

        Waits up to ``timeout_s`` for every rank of it to commit; the new incarnation
        then becomes the group's current one. A rank that could not build, one that
        dies, or one that does not commit in time abandons the change: every rank
        keeps the old incarnation.

        Returns:
            ``("ok", "")``; ``(status, why)`` with status ``"error"`` or ``"timeout"``
            when the change was abandoned.

        """
        group = self._groups.get(name)
        change = group.building if group is not None else None
        following = change.following if change is not None else None
        if group is None or change is None or following is None or following.id != incarnation:
            return "error", self._gone_reason(name, incarnation)
        if not built:
            self._abandon(name, group, change, "error", f"rank {rank} could not build it: {why}")
        else:
            old = reshape.commit(group, change, rank)
            if old is not None:
                self._retire(name, old, change)
        deadline = time.monotonic() + timeout_s
        while change.committed is None:
            if not await wait_event(change.changed, deadline):
                self._abandon(
                    name,
                    group,
                    change,
                    "timeout",
                    reshape.unbuilt(change, set(), group.current.world_size or 0),
                )
        return change.committed

    def _watch_building(self, name: str, group: GroupState, change: Reshape) -> None:
        """Abandon ``change`` when a rank of its next incarnation dies, or by its deadline."""

        async def watch() -> None:
            following = change.following
            while change.committed is None and following is not None:
                await wait_event(
                    change.changed, min(change.deadline, time.monotonic() + RESHAPE_POLL_S)
                )
                if change.committed is not None:
                    return
                dead = await liveness.dead_members(following.joined.values())
                if dead & {m.key for m in following.joined.values()}:
                    self._abandon(
                        name,
                        group,
                        change,
                        "error",
                        reshape.unbuilt(change, dead, group.current.world_size or 0),
                    )
                elif time.monotonic() >= change.deadline:
                    self._abandon(
                        name,
                        group,
                        change,
                        "timeout",
                        reshape.unbuilt(change, dead, group.current.world_size or 0),
                    )

        task = asyncio.get_running_loop().create_task(watch())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _abandon(
        self, name: str, group: GroupState, change: Reshape, status: str, why: str
    ) -> None:
        """Abandon building ``change`` for ``why``; its next incarnation ends, the old one stays."""
        reason = (
            f"{change.terms()} of group {name!r} failed: {why}; the group keeps its "
            f"{group.current.world_size} ranks"
        )
        following = reshape.abandon(group, change, status, reason)
        if following is not None:
            self._forget(following, reason)

    def _retire(self, name: str, old: Incarnation, change: Reshape) -> None:
        """End ``old``, the incarnation a built ``change`` replaced; tell its excluded ranks."""
        reason = f"group {name!r} moved to a new incarnation by {change.terms()}"
        for rank in change.exclude:
            holder = old.holders().get(rank)
            if holder is None:
                continue
            why = f"rank {rank} was excluded from group {name!r} by shrink_group"
            report_failure(old, rank, why.encode())
            listener = self._listeners.setdefault(holder.worker_id, Listener())
            listener.push(name, old.id, why)
        self._forget(old, reason)

    async def redeclare(
        self, name: str, job_id: str, drop: list[str], add: list[str]
    ) -> tuple[str, Any]:
        """Declare ``name`` anew without the actors ``drop`` and the dead, with ``add`` after.

        The kept actors keep their order, so their ranks move down over the gaps; the
        added ones take the ranks after them. The current incarnation ends in every
        member, as when the driver destroys the group, and each member builds the
        group anew, with its new rank, at its next op.

        Returns:
            ``("ok", {actor id: rank})``; ``("absent", None)``; ``("not_allowed",
            None)`` when this driver's job neither declared the group nor holds a
            member; ``("error", why)`` when the group was made by init.

        """
        group = await self._settled(name)
        if group is None:
            return "absent", None
        if job_id not in group.jobs:
            return "not_allowed", None
        declaration = group.declaration
        if declaration is None:
            return "error", (
                f"group {name!r} was made by init_collective_group: its members shrink and "
                "grow it with shrink_group and grow_group"
            )
        dead = await liveness.dead_actors(declaration.ranks)
        order = sorted(declaration.ranks, key=declaration.ranks.__getitem__)
        kept = [a for a in order if a not in dead and a not in drop]
        ranks = {actor: rank for rank, actor in enumerate([*kept, *add])}
        reason = (
            f"group {name!r} was declared anew by the driver with {len(ranks)} ranks; "
            "its members build it again at their next op"
        )
        await self._tell_members(name, group, reason, remove=False)
        group.declaration = replace(declaration, world_size=len(ranks), ranks=ranks)
        group.current = Incarnation(len(ranks), declaration.backend)
        group.finished -= set(ranks)
        return "ok", ranks
