"""Where ranks meet in Ray: the named store actor of each group, and its client side."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from collective.store import RendezvousStore
from collective.types import CollectiveError, GroupOptions

STORE_ACTOR_PREFIX = "collective.store."
"""Named store actors are called this prefix followed by the group name."""

_RPC_GRACE_S = 5.0
"""Extra seconds a client waits for a store actor's reply beyond the wait it asked for."""


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
class _Membership:
    world_size: int
    backend: str
    joined: dict[int, str] = field(default_factory=dict)
    left: set[int] = field(default_factory=set)


class StoreActor:
    """The named detached actor behind one group: its key-value store and membership.

    Every method is a coroutine, so a rank waiting on a key never blocks the others.
    Errors are returned as strings rather than raised, so that callers can raise
    them with their own context.
    """

    def __init__(self, group_name: str, declaration: Declaration | None) -> None:
        """Start an empty store for ``group_name``, optionally with a declaration."""
        self._group_name = group_name
        self._declaration = declaration
        self._incarnation = uuid.uuid4().hex
        self._values: dict[str, bytes] = {}
        self._events: dict[str, asyncio.Event] = {}
        self._members: _Membership | None = None
        if declaration is not None:
            self._members = _Membership(declaration.world_size, declaration.backend)
        self._closed = False

    async def declaration(self) -> Declaration | None:
        """Return the driver's declaration, or None for a group made by init."""
        return self._declaration

    async def join(
        self,
        rank: int,
        world_size: int,
        backend: str,
        actor_id: str,
        from_declaration: bool = False,
    ) -> tuple[str, str]:
        """Record that ``rank`` has arrived, by init or ``from_declaration``.

        Returns:
            ``("ok", incarnation)``; ``("retired", holders)`` when this store is
            closed or closing and a new one must be made once it is gone, with
            the ranks that still hold it; or ``("error", message)``.

        """
        if self._closed:
            return "retired", "[]"
        if self._declaration is not None and not from_declaration:
            return "error", (
                "it was declared from the driver; its members build it on first use "
                "and must not call init_collective_group for it"
            )
        declared = self._declaration
        if declared is not None and declared.ranks.get(actor_id, rank) != rank:
            return "error", (
                f"this actor was declared as rank {declared.ranks[actor_id]}, "
                f"but asked to join as rank {rank}"
            )
        if declared is not None and actor_id not in declared.ranks:
            return "error", "this actor is not among the actors the group was declared with"
        members = self._members or _Membership(world_size, backend)
        if (members.world_size, members.backend) != (world_size, backend):
            return "error", (
                f"rank {rank} asked for world_size={world_size}, backend={backend!r}, but "
                f"the group has world_size={members.world_size}, backend={members.backend!r}"
            )
        if rank in members.left:
            return "retired", str(sorted(set(members.joined) - members.left))
        holder = members.joined.get(rank)
        if holder is not None and holder != actor_id:
            return "error", f"rank {rank} was already taken by another actor"
        self._members = members
        members.joined[rank] = actor_id
        return "ok", self._incarnation

    async def leave(self, rank: int) -> bool:
        """Record that ``rank`` has left; return True once every joined rank has left."""
        members = self._members
        if members is not None and rank in members.joined:
            members.left.add(rank)
        if members is None or members.left >= set(members.joined):
            self._closed = True
        return self._closed

    async def members(self) -> tuple[str | None, list[str]]:
        """Return the group's backend and its members' actor ids, declared or joined."""
        if self._declaration is not None:
            return self._declaration.backend, sorted(self._declaration.ranks)
        if self._members is None:
            return None, []
        return self._members.backend, sorted(self._members.joined.values())

    async def arrivals(self) -> tuple[int | None, list[int]]:
        """Return the world size and the ranks that have joined, in order."""
        if self._members is None:
            return None, []
        return self._members.world_size, sorted(self._members.joined)

    async def set(self, key: str, value: bytes) -> None:
        """Publish ``value`` under ``key``."""
        self._values[key] = value
        self._events.setdefault(key, asyncio.Event()).set()

    async def get(self, key: str, timeout_s: float) -> bytes | None:
        """Return the value of ``key``, or None if it is not set within ``timeout_s``."""
        if key not in self._values:
            event = self._events.setdefault(key, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), timeout_s)
            except asyncio.TimeoutError:
                return None
        return self._values.get(key)

    async def delete(self, key: str) -> None:
        """Remove ``key`` if it is present."""
        self._values.pop(key, None)
        self._events.pop(key, None)

    async def wait_until_killed(self) -> None:
        """Never return; a caller learns from the error when this actor is killed."""
        await asyncio.Event().wait()


class RayRendezvousStore(RendezvousStore):
    """A ``RendezvousStore`` backed by a group's store actor."""

    def __init__(self, handle: Any, group_name: str, incarnation: str = "") -> None:
        """Talk to the store actor ``handle`` of ``group_name``, joined as ``incarnation``."""
        self._handle = handle
        self._group_name = group_name
        self._incarnation = incarnation

    @property
    def incarnation(self) -> str:
        """Return the incarnation id this store was joined as; "" before a join."""
        return self._incarnation

    @property
    def handle(self) -> Any:
        """Return the store actor's handle."""
        return self._handle

    def call(self, method: str, *args: Any, timeout_s: float = _RPC_GRACE_S) -> Any:
        """Call ``method`` on the store actor and return its result.

        Raises:
            TimeoutError: no reply within ``timeout_s``.
            CollectiveError: the store actor is dead or failed.

        """
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            return ray.get(getattr(self._handle, method).remote(*args), timeout=timeout_s)
        except GetTimeoutError as exc:
            raise TimeoutError(f"store actor gave no reply to {method} in {timeout_s}s") from exc
        except RayActorError as exc:
            raise CollectiveError(
                f"the store actor of group {self._group_name!r} died: {exc}"
            ) from exc

    def set(self, key: str, value: bytes) -> None:
        """Publish ``value`` under ``key``."""
        self.call("set", key, value)

    def get(self, key: str, timeout: timedelta) -> bytes:
        """Return the value of ``key``, waiting up to ``timeout`` for it."""
        seconds = timeout.total_seconds()
        value = self.call("get", key, seconds, timeout_s=seconds + _RPC_GRACE_S)
        if value is None:
            raise TimeoutError(f"key {key!r} was not set within {timeout}")
        return value

    def delete(self, key: str) -> None:
        """Remove ``key`` if it is present."""
        self.call("delete", key)


def store_actor_name(group_name: str) -> str:
    """Return the name of the store actor of ``group_name``."""
    return STORE_ACTOR_PREFIX + group_name


def _actor_class() -> Any:
    import ray

    return ray.remote(num_cpus=0, max_restarts=0)(StoreActor)


def find_store(group_name: str) -> RayRendezvousStore | None:
    """Return the store of ``group_name`` in this job's namespace, or None."""
    import ray

    try:
        handle = ray.get_actor(store_actor_name(group_name))
    except ValueError:
        return None
    return RayRendezvousStore(handle, group_name)


def list_stores() -> list[str]:
    """Return the names of the groups that have a store in this job's namespace."""
    import ray

    names = ray.util.list_named_actors()
    return sorted(
        n.removeprefix(STORE_ACTOR_PREFIX) for n in names if n.startswith(STORE_ACTOR_PREFIX)
    )


def declare_store(group_name: str, declaration: Declaration) -> RayRendezvousStore:
    """Create the store of a group declared from the driver.

    Raises:
        CollectiveError: a group of that name already exists.

    """
    try:
        handle = (
            _actor_class()
            .options(name=store_actor_name(group_name), lifetime="detached")
            .remote(group_name, declaration)
        )
    except ValueError as exc:
        raise CollectiveError(f"a group named {group_name!r} already exists") from exc
    store = RayRendezvousStore(handle, group_name)
    store.call("declaration")
    return store


def join_store(
    group_name: str,
    rank: int,
    world_size: int,
    backend: str,
    timeout: timedelta,
    declared: bool = False,
) -> tuple[RayRendezvousStore, str]:
    """Join the store of ``group_name`` as ``rank``, creating the store if needed.

    A store whose members have all left is being removed; this waits for it to
    go and then makes a fresh one, so a group can be re-created under its name.

    Returns:
        The store and its incarnation id.

    Raises:
        CollectiveError: the membership disagrees (rank taken, other world size).
        TimeoutError: no usable store within ``timeout``.

    """
    import ray

    actor_id = ray.get_runtime_context().get_actor_id() or "driver"
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        handle = (
            _actor_class()
            .options(name=store_actor_name(group_name), lifetime="detached", get_if_exists=True)
            .remote(group_name, None)
        )
        store = RayRendezvousStore(handle, group_name)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"the old store of group {group_name!r} was not removed in time")
        try:
            status, detail = store.call("join", rank, world_size, backend, actor_id, declared)
        except CollectiveError:
            continue
        if status == "ok":
            return RayRendezvousStore(handle, group_name, detail), detail
        if status == "error":
            raise CollectiveError(f"cannot join group {group_name!r}: {detail}")
        try:
            store.call("wait_until_killed", timeout_s=remaining)
        except CollectiveError:
            continue
        except TimeoutError:
            raise TimeoutError(
                f"an earlier group named {group_name!r} is still held by ranks {detail}, "
                "which have not called destroy_collective_group on it"
            ) from None


def leave_store(store: RayRendezvousStore, rank: int) -> None:
    """Leave the group's store, and remove the store if this was its last member."""
    try:
        last = store.call("leave", rank)
    except CollectiveError:
        return
    if last:
        kill_store(store)


def kill_store(store: RayRendezvousStore) -> None:
    """Remove a store actor now; its name is free when this returns."""
    import ray

    ray.kill(store.handle, no_restart=True)


def missing_ranks_detail(store: RayRendezvousStore) -> str:
    """Describe which ranks have joined the store and which have not."""
    try:
        world_size, joined = store.call("arrivals")
    except (CollectiveError, TimeoutError) as exc:
        return f"could not ask the store which ranks arrived: {exc}"
    if world_size is None:
        return "no rank has joined"
    missing = sorted(set(range(world_size)) - set(joined))
    return f"ranks that arrived: {joined}; ranks that did not: {missing}"
