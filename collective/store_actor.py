"""The shared store actor: every group's rendezvous, in one named detached actor per namespace.

Each group has its own state inside the actor: its declaration, the jobs whose
driver may end it, and its current incarnation, which holds the ranks that
joined, the keys and their events. Every method is a coroutine, so a rank
waiting on a key never blocks another; the actor's one event loop makes each
method's checks and changes atomic between awaits.

The actor learns of dead members from Ray's GCS: at every join and leave for
the group at hand, and once a second for all groups (``SWEEP_S``). A dead rank
holds nothing, and a group whose members are all gone ends by itself. The actor
exits once it has hosted no group for ``IDLE_GRACE_S``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from collective import liveness
from collective.groups.watch import abort_key
from collective.liveness import Member
from collective.types import GroupOptions

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


@dataclass(frozen=True)
class Declaration:
    """A group declared from the driver: who is in it, and how it is built."""

    world_size: int
    backend: str
    ranks: dict[str, int]
    timeout: timedelta
    check_args: bool = False
    options: GroupOptions = field(default_factory=GroupOptions)


@dataclass
class _Incarnation:
    """One life of a group: who joined as which rank, and the keys they set."""

    world_size: int | None = None
    backend: str | None = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    joined: dict[int, Member] = field(default_factory=dict)
    left: set[int] = field(default_factory=set)
    dead: set[int] = field(default_factory=set)
    values: dict[str, bytes] = field(default_factory=dict)
    events: dict[str, asyncio.Event] = field(default_factory=dict)
    over: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str = ""

    def holders(self) -> dict[int, Member]:
        """Return the ranks still held: joined, neither left nor dead."""
        gone = self.left | self.dead
        return {r: m for r, m in self.joined.items() if r not in gone}

    def describe(self, conflict: str = "") -> tuple[list[int], str]:
        """Return the held ranks and what keeps a joining rank out, for a "held" reply."""
        return sorted(self.holders()), conflict

    def end(self, reason: str) -> None:
        """Wake everyone waiting on this incarnation; it is over."""
        self.reason = reason
        self.over.set()
        for event in self.events.values():
            event.set()


@dataclass
class _Group:
    declaration: Declaration | None
    jobs: set[str]
    current: _Incarnation
    finished: set[str] = field(default_factory=set)
    """Declared actors that left the group after joining it, or died."""

    def retired(self) -> bool:
        """Return whether a declared group is done: each declared actor left or died."""
        return self.declaration is None or set(self.declaration.ranks) <= self.finished


@dataclass
class _Listener:
    """The notices queued for one member process, and how far it has taken them."""

    notices: list[tuple[int, str, str, str]] = field(default_factory=list)
    seq: int = 0
    acked: int = 0
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    took: asyncio.Condition = field(default_factory=asyncio.Condition)


class StoreActor:
    """The named detached actor behind every group of one namespace.

    Errors are returned as status strings rather than raised, so that callers
    raise them with their own context.
    """

    def __init__(self) -> None:
        """Start with no groups."""
        self._groups: dict[str, _Group] = {}
        self._gone: OrderedDict[str, str] = OrderedDict()
        self._listeners: dict[str, _Listener] = {}
        self._idle_since = time.monotonic()
        self._exiting = False
        self._sweeper: asyncio.Task[None] | None = None

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
                world = _Incarnation(declaration.world_size, declaration.backend)
                self._groups[name] = _Group(declaration, {job_id}, world)
                return "ok", None
            if not (group.current.left or group.current.dead):
                return "error", f"a group named {name!r} already exists"
            if not await _wait(group.current.over, deadline):
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
            ``("ok", incarnation)``; ``("error", message)``; ``("held", (ranks,
            conflict))`` when the name stayed held; ``("retry", None)`` when this
            actor is exiting.

        """
        self._start_sweeping()
        deadline = time.monotonic() + timeout_s
        while not self._exiting:
            group = await self._settled(name)
            if group is None:
                if declared:
                    return "error", "it is no longer declared: the driver destroyed it"
                group = self._groups[name] = _Group(None, set(), _Incarnation())
            verdict, detail = self._admit(group, rank, world_size, backend, member, declared)
            if verdict != "wait":
                return verdict, detail
            if not await _wait(group.current.over, deadline):
                return "held", detail
        return "retry", None

    def _admit(
        self,
        group: _Group,
        rank: int,
        world_size: int,
        backend: str,
        member: Member,
        declared: bool,
    ) -> tuple[str, Any]:
        world, declaration = group.current, group.declaration
        if declaration is not None and not declared:
            return "error", (
                "it was declared from the driver; its members build it on first use "
                "and must not call init_collective_group for it"
            )
        if declaration is None and declared:
            return "error", "it is no longer declared; the name now holds a group made by init"
        if declaration is not None:
            mine = declaration.ranks.get(member.actor_id or "")
            if mine is None:
                return "error", "this actor is not among the actors the group was declared with"
            if mine != rank:
                return "error", f"this actor was declared as rank {mine}, but asked as rank {rank}"
        if world.left or world.dead:
            return "wait", world.describe()
        conflict = ""
        if world.world_size is not None and (world.world_size, world.backend) != (
            world_size,
            backend,
        ):
            conflict = (
                f"rank {rank} asked for world_size={world_size}, backend={backend!r}, but the "
                f"group has world_size={world.world_size}, backend={world.backend!r}"
            )
        elif rank in world.joined and world.joined[rank].key != member.key:
            conflict = f"rank {rank} was already taken by another actor"
        if conflict:
            complete = len(world.joined) == world.world_size
            return ("wait", world.describe(conflict)) if complete else ("error", conflict)
        world.world_size, world.backend = world_size, backend
        world.joined[rank] = member
        group.jobs.add(member.job_id)
        group.finished.discard(member.key)
        return "ok", world.id

    async def leave(self, name: str, incarnation: str, rank: int, member: Member) -> None:
        """Record that ``member`` has left ``rank``; the group ends when no rank is held."""
        group = self._groups.get(name)
        if group is None or group.current.id != incarnation:
            return
        world = group.current
        if world.holders().get(rank) != member:
            return
        world.left.add(rank)
        if group.declaration is not None:
            group.finished.add(member.key)
        await self._settled(name)

    async def end(self, name: str, job_id: str) -> str:
        """End ``name`` for every member, at the request of the driver of ``job_id``.

        Writes the reason under every held rank's abort key, queues a notice for
        each member process, removes the group, and waits up to ``ACK_WAIT_S``
        for the members to take the notice.

        Returns:
            ``"ended"``, ``"absent"``, or ``"not_allowed"`` when the driver's job
            neither declared the group nor holds one of its members.

        """
        group = self._groups.get(name)
        if group is None:
            return "absent"
        if job_id not in group.jobs:
            return "not_allowed"
        world = group.current
        reason = f"group {name!r} was destroyed by the driver"
        held = world.holders()
        for rank in held:
            _set(world, abort_key(rank), reason.encode())
        queued = {
            m.worker_id: self._notify(m.worker_id, name, world.id, reason) for m in held.values()
        }
        self._end(name, group, reason, remove=True)
        deadline = time.monotonic() + ACK_WAIT_S
        for worker_id, seq in queued.items():
            listener = self._listeners[worker_id]
            async with listener.took:
                try:
                    await asyncio.wait_for(
                        listener.took.wait_for(lambda lis=listener, s=seq: lis.acked >= s),
                        max(deadline - time.monotonic(), 0.0),
                    )
                except asyncio.TimeoutError:
                    pass
        return "ended"

    async def _settled(self, name: str) -> _Group | None:
        """Mark the dead members of ``name``, end it if nobody holds it, and return it."""
        group = self._groups.get(name)
        if group is None:
            return None
        held = group.current.holders()
        if held:
            self._mark_dead(group, await liveness.dead_members(held.values()))
        self._settle(name, group)
        return self._groups.get(name)

    def _mark_dead(self, group: _Group, dead: set[str]) -> None:
        for rank, holder in group.current.holders().items():
            if holder.key in dead:
                group.current.dead.add(rank)
                group.finished.add(holder.key)

    def _settle(self, name: str, group: _Group) -> None:
        """End the current incarnation of ``name`` if it was joined and no rank is held."""
        world = group.current
        if self._groups.get(name) is not group:
            return
        if world.joined and not world.holders():
            self._end(name, group, f"every member of group {name!r} left it or died")
        elif not world.joined and group.declaration is not None and group.retired():
            self._end(name, group, f"every actor group {name!r} was declared with died", True)

    def _end(self, name: str, group: _Group, reason: str, remove: bool = False) -> None:
        """End the current incarnation; a declared group not yet done starts a fresh one."""
        world = group.current
        self._gone[world.id] = reason
        while len(self._gone) > _GONE_KEPT:
            self._gone.popitem(last=False)
        world.end(reason)
        if remove or group.retired():
            del self._groups[name]
            if not self._groups:
                self._idle_since = time.monotonic()
        else:
            group.current = _Incarnation(world.world_size, world.backend)

    # --- keys ------------------------------------------------------------------------------

    def _world(self, name: str, incarnation: str) -> _Incarnation | None:
        group = self._groups.get(name)
        return group.current if group is not None and group.current.id == incarnation else None

    def _gone_reason(self, name: str, incarnation: str) -> str:
        return self._gone.get(incarnation, f"group {name!r} no longer exists")

    async def set(self, name: str, incarnation: str, key: str, value: bytes) -> str | None:
        """Publish ``value`` under ``key``; return None, or why the incarnation is gone."""
        world = self._world(name, incarnation)
        if world is None:
            return self._gone_reason(name, incarnation)
        _set(world, key, value)
        return None

    async def get(
        self, name: str, incarnation: str, key: str, timeout_s: float
    ) -> tuple[str, bytes | str | None]:
        """Return ``("ok", value)``, ``("timeout", None)`` or ``("gone", reason)``."""
        world = self._world(name, incarnation)
        deadline = time.monotonic() + timeout_s
        while world is not None and key not in world.values and not world.reason:
            event = world.events.setdefault(key, asyncio.Event())
            if not await _wait(event, deadline):
                return "timeout", None
        if world is not None and key in world.values:
            return "ok", world.values[key]
        return "gone", self._gone_reason(name, incarnation)

    async def delete(self, name: str, incarnation: str, key: str) -> None:
        """Remove ``key`` if it is present."""
        world = self._world(name, incarnation)
        if world is not None and world.values.pop(key, None) is not None:
            world.events[key].clear()

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
            if group.declaration is not None:
                members, kind = set(group.declaration.ranks), group.declaration.backend
            else:
                members = {m.actor_id for m in group.current.joined.values()}
                kind = group.current.backend
            if set(actor_ids) <= members and backend in (None, kind):
                found.append(name)
        return found

    async def arrivals(self, name: str, incarnation: str = "") -> tuple[int | None, list[int]]:
        """Return the world size and the ranks that joined ``incarnation`` ("": the current)."""
        group = self._groups.get(name)
        world = group.current if group is not None and not incarnation else None
        world = world or self._world(name, incarnation)
        return (world.world_size, sorted(world.joined)) if world else (None, [])

    # --- notices to member processes -------------------------------------------------------

    def _notify(self, worker_id: str, name: str, incarnation: str, reason: str) -> int:
        listener = self._listeners.setdefault(worker_id, _Listener())
        listener.seq += 1
        listener.notices.append((listener.seq, name, incarnation, reason))
        listener.arrived.set()
        return listener.seq

    async def notices(
        self, worker_id: str, acked: int, wait_s: float
    ) -> list[tuple[int, str, str, str]]:
        """Take the notices for ``worker_id`` after ``acked``; wait up to ``wait_s`` for one.

        Each notice is ``(seq, group, incarnation, reason)``: the driver ended that
        incarnation. Passing the highest ``seq`` taken in the next call
        acknowledges it.
        """
        listener = self._listeners.setdefault(worker_id, _Listener())
        if acked > listener.acked:
            listener.acked = acked
            listener.notices = [n for n in listener.notices if n[0] > acked]
            async with listener.took:
                listener.took.notify_all()
        if not listener.notices:
            listener.arrived.clear()
            await _wait(listener.arrived, time.monotonic() + wait_s)
        return list(listener.notices)

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
        """End the groups whose members are all dead, declared or joined."""
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
            self._mark_dead(group, dead)
            if group.declaration is not None:
                group.finished |= dead & set(group.declaration.ranks)
            self._settle(name, group)

    def _exit(self) -> None:
        """Exit this actor: nothing is hosted, and new callers make a fresh one."""
        import ray

        self._exiting = True
        self._listeners.clear()
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


def _set(world: _Incarnation, key: str, value: bytes) -> None:
    world.values[key] = value
    world.events.setdefault(key, asyncio.Event()).set()


async def _wait(event: asyncio.Event, deadline: float) -> bool:
    """Wait for ``event`` until ``deadline`` (monotonic); return whether it was set."""
    left = deadline - time.monotonic()
    if left <= 0:
        return event.is_set()
    try:
        await asyncio.wait_for(event.wait(), left)
    except asyncio.TimeoutError:
        return False
    return True
