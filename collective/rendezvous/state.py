"""The state the shared store actor keeps for each group, and the rules for joining one.

A group has a declaration (if the driver declared it), the jobs whose driver may
end it, and its current incarnation: one life of the group, with the ranks that
joined, the keys they set and the events that wake their waits. Everything here
runs on the store actor's event loop, so a check and the change it allows happen
without anything in between.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from collective.rendezvous.liveness import Member
from collective.types import GroupOptions


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
class Incarnation:
    """One life of a group: who joined as which rank, and the keys they set."""

    world_size: int | None = None
    backend: str | None = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    joined: dict[int, Member] = field(default_factory=dict)
    left: set[int] = field(default_factory=set)
    dead: set[int] = field(default_factory=set)
    values: dict[str, bytes] = field(default_factory=dict)
    events: dict[str, asyncio.Event] = field(default_factory=dict)
    votes: dict[str, dict[int, Any]] = field(default_factory=dict)
    """What each rank voted on each topic of ``StoreActor.agree``."""
    over: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str = ""

    def holders(self) -> dict[int, Member]:
        """Return the ranks still held: joined, neither left nor dead."""
        gone = self.left | self.dead
        return {r: m for r, m in self.joined.items() if r not in gone}

    def closing(self) -> bool:
        """Return whether a member has left or died: this incarnation takes nobody new."""
        return bool(self.left or self.dead)

    def describe(self, conflict: str = "") -> tuple[list[int], str]:
        """Return the held ranks and what keeps a joining rank out, for a "held" reply."""
        return sorted(self.holders()), conflict

    def set(self, key: str, value: bytes) -> None:
        """Publish ``value`` under ``key`` and wake its waiters."""
        self.values[key] = value
        self.events.setdefault(key, asyncio.Event()).set()

    def vote(self, topic: str, rank: int, value: Any) -> dict[int, Any]:
        """Record ``rank``'s ``value`` on ``topic`` and wake its waiters; return the votes."""
        votes = self.votes.setdefault(topic, {})
        votes[rank] = value
        key = f"\x00vote/{topic}"
        woken = self.events.get(key)
        self.events[key] = asyncio.Event()
        if woken is not None:
            woken.set()
        return votes

    def voted(self, topic: str) -> asyncio.Event:
        """Return the event the next vote on ``topic`` (or the end) sets."""
        return self.events.setdefault(f"\x00vote/{topic}", asyncio.Event())

    def end(self, reason: str) -> None:
        """Wake everyone waiting on this incarnation; it is over."""
        self.reason = reason
        self.over.set()
        for event in self.events.values():
            event.set()


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
    deadline: float = 0.0
    """The latest deadline (monotonic) of the callers so far: building ends by then."""
    following: Incarnation | None = None
    """Once decided, the next incarnation, being built."""
    built: set[int] = field(default_factory=set)
    """The ranks of ``following`` that built their transports and committed."""
    committed: tuple[str, str] | None = None
    """Once the build is over: ``("ok", "")``, or ``(status, why)`` when it was abandoned."""

    def wake(self) -> None:
        """Wake every caller waiting on this change, to look at it again."""
        self.changed.set()
        self.changed = asyncio.Event()

    def come(self, rank: int, member: Member, deadline: float) -> None:
        """Record that ``rank`` came, as ``member``, with a wait that ends at ``deadline``."""
        self.arrived[rank] = member
        self.deadline = max(self.deadline, deadline)

    def terms(self) -> str:
        """Return how the callers asked for this change, for messages."""
        return describe(self.kind, self.world_size, self.exclude)


def describe(kind: str, world_size: int, exclude: tuple[int, ...]) -> str:
    """Return how a caller asked for a change, for messages."""
    if kind == SHRINK:
        return f"shrink_group(exclude={list(exclude)})"
    return f"grow_group(world_size={world_size})"


@dataclass
class GroupState:
    """One group inside the store actor."""

    declaration: Declaration | None
    jobs: set[str]
    current: Incarnation
    finished: set[str] = field(default_factory=set)
    """Members (by key) that left the group after joining it, or died."""
    reshape: Reshape | None = None
    """The shrink or grow in progress, if any (see ``collective.rendezvous.reshape``)."""
    building: Reshape | None = None
    """The decided shrink or grow whose next incarnation its ranks are building, if any."""
    failed: Reshape | None = None
    """The last shrink or grow that failed, for the members that come to it late."""
    waiting: dict[int, tuple[Member, int]] = field(default_factory=dict)
    """The ranks waiting to join a group they do not fit, by init: member and world size.

    A newcomer waits here for the grow it comes to; the grow learns of it even if Ray
    cancelled the newcomer's call, as it does when the caller dies."""
    stirred: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when a shrink or grow starts, so that ranks waiting to join look again."""

    def stir(self) -> None:
        """Wake the ranks waiting to join this group, to look at it again."""
        self.stirred.set()
        self.stirred = asyncio.Event()

    @classmethod
    def declared(cls, declaration: Declaration, job_id: str) -> GroupState:
        """Return a group declared by the driver of ``job_id``."""
        world = Incarnation(declaration.world_size, declaration.backend)
        return cls(declaration, {job_id}, world)

    def retired(self) -> bool:
        """Return whether the group is done once its incarnation ends.

        A group made by init is; a declared group is once each declared actor
        has left it or died. Until then a new incarnation takes over.
        """
        return self.declaration is None or set(self.declaration.ranks) <= self.finished

    def mark_dead(self, dead: set[str]) -> None:
        """Free the ranks held by the members whose keys are in ``dead``."""
        for rank, holder in self.current.holders().items():
            if holder.key in dead:
                self.current.dead.add(rank)
                self.finished.add(holder.key)
        if self.declaration is not None:
            self.finished |= dead & set(self.declaration.ranks)

    def admit(
        self, rank: int, world_size: int, backend: str, member: Member, declared: bool
    ) -> tuple[str, Any]:
        """Let ``member`` join as ``rank`` if it fits.

        Returns:
            ``("ok", incarnation)``; ``("error", message)`` when it can never fit;
            ``("wait", (ranks, conflict))`` when it may once this incarnation is over:
            a member has left or died, or the group is complete and this rank
            does not fit it.

        """
        world = self.current
        refused = self._refuse(rank, member, declared)
        if refused:
            return "error", refused
        if world.closing():
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
            if backend == world.backend and world_size > (world.world_size or 0):
                conflict += (
                    f"; to add rank {rank} to the live group, its members call "
                    f"grow_group(world_size={world_size})"
                )
        elif rank in world.joined and world.joined[rank].key != member.key:
            conflict = f"rank {rank} was already taken by another actor"
        if conflict:
            complete = len(world.joined) == world.world_size
            return ("wait", world.describe(conflict)) if complete else ("error", conflict)
        world.world_size, world.backend = world_size, backend
        world.joined[rank] = member
        self.jobs.add(member.job_id)
        self.finished.discard(member.key)
        return "ok", world.id

    def _refuse(self, rank: int, member: Member, declared: bool) -> str:
        """Return why ``member`` may never join as ``rank`` by this route, or ""."""
        declaration = self.declaration
        if declaration is not None and not declared:
            return (
                "it was declared from the driver; its members build it on first use "
                "and must not call init_collective_group for it"
            )
        if declaration is None and declared:
            return "it is no longer declared; the name now holds a group made by init"
        if declaration is not None:
            mine = declaration.ranks.get(member.actor_id or "")
            if mine is None:
                return "this actor is not among the actors the group was declared with"
            if mine != rank:
                return f"this actor was declared as rank {mine}, but asked as rank {rank}"
        return ""


@dataclass
class Listener:
    """The notices queued for one member process, and how far it has taken them."""

    notices: list[tuple[int, str, str, str]] = field(default_factory=list)
    seq: int = 0
    acked: int = 0
    calls: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    took: asyncio.Condition = field(default_factory=asyncio.Condition)

    def push(self, group: str, incarnation: str, reason: str) -> int:
        """Queue a notice that ``incarnation`` of ``group`` ended; return its number."""
        self.seq += 1
        self.notices.append((self.seq, group, incarnation, reason))
        self.arrived.set()
        return self.seq

    async def ack(self, acked: int) -> None:
        """Drop the notices up to ``acked``, which the process has taken, and say so."""
        if acked > self.acked:
            self.acked = acked
            self.notices = [n for n in self.notices if n[0] > acked]
            async with self.took:
                self.took.notify_all()

    async def taken(self, seq: int, deadline: float) -> None:
        """Wait until notice ``seq`` is taken, or until ``deadline`` (monotonic)."""
        async with self.took:
            try:
                await asyncio.wait_for(
                    self.took.wait_for(lambda: self.acked >= seq),
                    max(deadline - time.monotonic(), 0.0),
                )
            except asyncio.TimeoutError:
                pass

    def quiet(self, for_s: float) -> bool:
        """Return whether nothing is queued and the process has not called for ``for_s``."""
        return not self.notices and not self.calls and time.monotonic() - self.last_seen > for_s


async def wait_event(event: asyncio.Event, deadline: float) -> bool:
    """Wait for ``event`` until ``deadline`` (monotonic); return whether it was set."""
    return await wait_first([event], deadline)


async def wait_first(events: list[asyncio.Event], deadline: float) -> bool:
    """Wait until one of ``events`` is set or ``deadline`` (monotonic); return whether one was."""
    left = deadline - time.monotonic()
    if left <= 0 or any(e.is_set() for e in events):
        return any(e.is_set() for e in events)
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        done, _ = await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
    return bool(done)
