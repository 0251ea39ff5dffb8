"""The shared store actor: every group's rendezvous, in one named detached actor per namespace.

Each group has its own state inside the actor (``collective.rendezvous.state``).
This module makes, joins, leaves and ends groups, answers queries and sends
notices; the keys of an incarnation are ``actor_keys``, a shrink or grow is
``actor_reshape``.
Every method is a coroutine, so a rank waiting on a key never blocks another;
the actor's one event loop makes each method's checks and changes atomic
between awaits.

The actor learns of dead members from Ray's GCS: at every join and leave for
the group at hand, and once a second for all groups (``SWEEP_S``). A dead rank
holds nothing, and a group whose members are all gone ends by itself. The actor
exits once it has hosted no group for ``IDLE_GRACE_S``.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Any

from collective.rendezvous import liveness, reshape
from collective.rendezvous.actor_keys import KeyMethods
from collective.rendezvous.actor_reshape import ReshapeMethods
from collective.rendezvous.liveness import Member
from collective.rendezvous.state import (
    Declaration,
    GroupState,
    Incarnation,
    Listener,
    wait_event,
    wait_first,
)
from collective.rendezvous.store import report_failure

__all__ = ["ACK_WAIT_S", "IDLE_GRACE_S", "STORE_ACTOR_NAME", "SWEEP_S", "StoreActor"]

STORE_ACTOR_NAME = "collective.rendezvous"
"""The name of the shared store actor in each namespace."""

SWEEP_S = 1.0
"""How often the actor asks the GCS whether the members of its groups are alive."""

IDLE_GRACE_S = 5.0
"""How long the actor lingers without groups before it exits."""

ACK_WAIT_S = 2.0
"""How long a driver's destroy waits for the members to take notice."""

_GONE_KEPT = 4096
"""How many ended incarnations keep the reason they ended, for the error messages."""

_LISTENER_QUIET_S = 300.0
"""A member process that has not listened for this long is forgotten (it is gone)."""


class StoreActor(ReshapeMethods, KeyMethods):
    """The named detached actor behind every group of one namespace.

    Errors are returned as status strings rather than raised, so that callers
    raise them with their own context.
    """

    def __init__(self) -> None:
        """Start with no groups."""
        self._groups: dict[str, GroupState] = {}
        self._gone: OrderedDict[str, str] = OrderedDict()
        self._listeners: dict[str, Listener] = {}
        self._idle_since = time.monotonic()
        self._exiting = False
        self._sweeper: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # --- groups: made, joined, left, ended -------------------------------------------------

    async def declare(
        self, name: str, declaration: Declaration, job_id: str, timeout_s: float
    ) -> tuple[str, Any]:
        """Declare ``name``; wait up to ``timeout_s`` for a group leaving the name.

        Returns:
            ``("ok", None)``, ``("error", message)``, ``("held", (ranks, ""))`` or
            ``("retry", None)`` when this actor is exiting.

        """
        self._start_sweeping()
        deadline = time.monotonic() + timeout_s
        while not self._exiting:
            group = await self._settled(name)
            if group is None:
                self._groups[name] = GroupState.declared(declaration, job_id)
                return "ok", None
            if not group.current.closing():
                return "error", f"a group named {name!r} already exists"
            if not await wait_event(group.current.over, deadline):
                return "held", group.current.describe()
        return "retry", None

    async def join(
        self,
        name: str,
        rank: int,
        world_size: int,
        backend: str,
        member: Member,
        declared: bool,
        timeout_s: float,
    ) -> tuple[str, Any]:
        """Record that ``member`` joins ``name`` as ``rank``, by init or from its declaration.

        A group whose members are leaving, or a complete group this rank does
        not fit, keeps the rank waiting (up to ``timeout_s``) until it is over.

        Returns:
            ``("ok", incarnation)``; ``("grow", incarnation)`` for a newcomer of a
            grow, which commits (``commit``) once it has built its transports;
            ``("error", message)``; ``("timeout", message)`` when the grow it came to
            timed out; ``("held", (ranks, conflict))`` when the name stayed held;
            ``("retry", None)`` when this actor is exiting.

        """
        self._start_sweeping()
        deadline = time.monotonic() + timeout_s
        while not self._exiting:
            group = await self._settled(name)
            if group is None:
                if declared:
                    return "error", "it is no longer declared: the driver destroyed it"
                group = self._groups[name] = GroupState(None, set(), Incarnation())
            change = (
                None if declared else reshape.newcomer(group, rank, world_size, member, deadline)
            )
            if isinstance(change, tuple):
                return "timeout" if change[0] == "timeout" else "error", change[1]
            if change is not None:
                status, outcome = await self._reshaped(name, group, change, deadline)
                if status == "ok":
                    return "grow", outcome[0]
                why = f"the {change.terms()} it came to failed: {outcome}"
                return ("timeout" if status == "timeout" else "error"), why
            verdict, detail = group.admit(rank, world_size, backend, member, declared)
            if verdict != "wait":
                return verdict, detail
            group.waiting[rank] = (member, world_size)
            woken = await wait_first([group.current.over, group.stirred], deadline)
            if group.waiting.get(rank) == (member, world_size):
                del group.waiting[rank]  # kept if Ray cancelled this call: its caller died
            if not woken:
                return "held", detail
        return "retry", None

    async def leave(self, name: str, incarnation: str, rank: int, member: Member) -> None:
        """Record that ``member`` has left ``rank``; the group ends when no rank is held."""
        group = self._groups.get(name)
        if group is None or group.current.id != incarnation:
            return
        if group.current.holders().get(rank) != member:
            return
        group.current.left.add(rank)
        group.finished.add(member.key)
        await self._settled(name)

    async def end(self, name: str, job_id: str) -> str:
        """End ``name`` for every member, at the request of the driver of ``job_id``.

        Writes the reason under every held rank's abort key (a FailureWatch
        records it and fails the rank's pending ops), queues a notice for each
        member process, removes the group, and waits up to ``ACK_WAIT_S`` for
        the members to take the notice.

        Returns:
            ``"ended"``, ``"absent"``, or ``"not_allowed"`` when the driver's job
            neither declared the group nor holds one of its members.

        """
        group = self._groups.get(name)
        if group is None:
            return "absent"
        if job_id not in group.jobs:
            return "not_allowed"
        await self._tell_members(name, group, f"group {name!r} was destroyed by the driver")
        return "ended"

    async def _tell_members(
        self, name: str, group: GroupState, reason: str, remove: bool = True
    ) -> None:
        """End the current incarnation of ``name`` in every member that holds it, for ``reason``.

        Writes the reason under every held rank's abort key (a FailureWatch records
        it and fails the rank's pending ops), queues a notice for each member
        process, ends the incarnation (removing the group if ``remove``), and waits
        up to ``ACK_WAIT_S`` for the members to take the notice.
        """
        world = group.current
        held = world.holders()
        for rank in held:
            report_failure(world, rank, reason.encode())
        queued = []
        for member in held.values():
            listener = self._listeners.setdefault(member.worker_id, Listener())
            queued.append((listener, listener.push(name, world.id, reason)))
        if remove:
            self._end(name, group, reason, remove=True)
        else:
            self._forget(world, reason)
        deadline = time.monotonic() + ACK_WAIT_S
        for listener, seq in queued:
            await listener.taken(seq, deadline)

    async def _settled(self, name: str) -> GroupState | None:
        """Mark the dead members of ``name``, end it if nobody holds it, and return it."""
        group = self._groups.get(name)
        if group is None:
            return None
        held = group.current.holders()
        if held:
            group.mark_dead(await liveness.dead_members(held.values()))
        self._settle(name, group)
        return self._groups.get(name)

    def _settle(self, name: str, group: GroupState) -> None:
        """End the current incarnation of ``name`` if it was joined and no rank is held."""
        world = group.current
        if self._groups.get(name) is not group:
            return
        if world.joined and not world.holders():
            self._end(name, group, f"every member of group {name!r} left it or died")
        elif not world.joined and group.declaration is not None and group.retired():
            self._end(name, group, f"every actor group {name!r} was declared with died", True)

    def _end(self, name: str, group: GroupState, reason: str, remove: bool = False) -> None:
        """End the current incarnation; a declared group not yet done starts a fresh one."""
        world = group.current
        self._forget(world, reason)
        if remove or group.retired():
            del self._groups[name]
            if not self._groups:
                self._idle_since = time.monotonic()
        else:
            group.current = Incarnation(world.world_size, world.backend)

    def _forget(self, world: Incarnation, reason: str) -> None:
        """End incarnation ``world`` for ``reason``, which its later callers are told."""
        self._gone[world.id] = reason
        while len(self._gone) > _GONE_KEPT:
            self._gone.popitem(last=False)
        world.end(reason)

    # --- queries ---------------------------------------------------------------------------

    async def names(self) -> list[str]:
        """Return the names of the live groups."""
        return sorted(self._groups)

    async def declaration(self, name: str) -> Declaration | None:
        """Return the driver's declaration of ``name``, or None."""
        group = self._groups.get(name)
        return group.declaration if group is not None else None

    async def groups_with(self, actor_ids: list[str], backend: str | None) -> list[str]:
        """Return the groups whose members, declared or joined, include all ``actor_ids``."""
        found = []
        for name, group in sorted(self._groups.items()):
            members: set[str | None]
            if group.declaration is not None:
                members, kind = set(group.declaration.ranks), group.declaration.backend
            else:
                members = {m.actor_id for m in group.current.joined.values()}
                kind = group.current.backend or ""
            if set(actor_ids) <= members and backend in (None, kind):
                found.append(name)
        return found

    async def arrivals(self, name: str, incarnation: str = "") -> tuple[int | None, list[int]]:
        """Return the world size and the ranks that joined ``incarnation`` ("": the current)."""
        group = self._groups.get(name)
        world = group.current if group is not None and not incarnation else None
        world = world or self._world(name, incarnation)
        return (world.world_size, sorted(world.joined)) if world else (None, [])

    async def waiting(self, name: str) -> list[int]:
        """Return the ranks that wait to join ``name`` by init and do not fit it yet."""
        group = self._groups.get(name)
        return sorted(group.waiting) if group is not None else []

    # --- notices to member processes -------------------------------------------------------

    async def notices(
        self, worker_id: str, acked: int, wait_s: float
    ) -> list[tuple[int, str, str, str]]:
        """Take the notices for ``worker_id`` after ``acked``; wait up to ``wait_s`` for one.

        Each notice is ``(seq, group, incarnation, reason)``: the driver ended that
        incarnation. Passing the highest ``seq`` taken in the next call
        acknowledges it.
        """
        listener = self._listeners.setdefault(worker_id, Listener())
        listener.calls += 1
        try:
            await listener.ack(acked)
            if not listener.notices:
                listener.arrived.clear()
                await wait_event(listener.arrived, time.monotonic() + wait_s)
            return list(listener.notices)
        finally:
            listener.calls -= 1
            listener.last_seen = time.monotonic()

    # --- lifetime of the actor -------------------------------------------------------------

    async def wait_until_gone(self) -> None:
        """Never return; a caller learns from the error when this actor has exited."""
        await asyncio.Event().wait()

    def _start_sweeping(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            if self._groups:
                await self._sweep()
            elif time.monotonic() - self._idle_since >= IDLE_GRACE_S:
                self._exit()
                return

    async def _sweep(self) -> None:
        """End the groups whose members are all dead, declared or joined; forget quiet listeners."""
        held = [m for g in self._groups.values() for m in g.current.holders().values()]
        dead = await liveness.dead_members(held)
        declared = {
            actor
            for g in self._groups.values()
            if g.declaration is not None
            for actor in set(g.declaration.ranks) - g.finished
        }
        dead |= await liveness.dead_actors(declared)
        for name, group in list(self._groups.items()):
            group.mark_dead(dead)
            self._settle(name, group)
        for worker_id, listener in list(self._listeners.items()):
            if listener.quiet(_LISTENER_QUIET_S):
                del self._listeners[worker_id]

    def _exit(self) -> None:
        """Exit this actor: nothing is hosted, and new callers make a fresh one."""
        import ray

        self._exiting = True
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
