"""Where ranks meet in Ray: the client side of the namespace's shared store actor.

One named detached ``StoreActor`` (``collective.store_actor``) per namespace hosts
every group. This process finds it once and keeps its handle; the first caller
in a namespace creates it. Joining a group starts, once per process, a thread
that listens for the notices the store sends when a driver ends one of this
process's groups, and hands each to the handler that ``set_end_handler``
installed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from collective.liveness import current_member
from collective.store import RendezvousStore
from collective.store_actor import STORE_ACTOR_NAME, Declaration, StoreActor
from collective.types import CollectiveError

__all__ = [
    "STORE_ACTOR_NAME",
    "Declaration",
    "RayRendezvousStore",
    "declaration",
    "declare_store",
    "end_group",
    "groups_with",
    "join_store",
    "leave_store",
    "list_groups",
    "missing_ranks_detail",
    "set_end_handler",
]

_RPC_GRACE_S = 5.0
"""Extra seconds a client waits for a store actor's reply beyond the wait it asked for."""

_NOTICE_WAIT_S = 60.0
"""How long one call of the notice listener waits in the store before it is issued again."""

_RETRY_S = 0.05
"""Pause before asking again for the store actor after finding it dead or exiting."""

EndHandler = Callable[[str, str, str], None]
"""Called with (group, incarnation, reason) when a driver ends a group this process joined."""


class _Connection:
    """Hold this process's handle on the namespace's store actor, and its notice listener."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handle: Any = None
        self._listening: Any = None
        self.on_end: EndHandler = lambda group, incarnation, reason: None

    def find(self) -> Any:
        """Return the store actor's handle, or None when the namespace has none."""
        import ray

        with self._lock:
            if self._handle is None:
                try:
                    self._handle = ray.get_actor(STORE_ACTOR_NAME)
                except ValueError:
                    return None
            return self._handle

    def get_or_create(self) -> Any:
        """Return the store actor's handle, creating the actor if the namespace has none."""
        import ray

        with self._lock:
            if self._handle is None:
                self._handle = (
                    ray.remote(StoreActor)
                    .options(
                        name=STORE_ACTOR_NAME,
                        lifetime="detached",
                        get_if_exists=True,
                        num_cpus=0,
                        max_restarts=0,
                        max_concurrency=10_000,
                    )
                    .remote()
                )
            return self._handle

    def forget(self, handle: Any) -> None:
        """Drop ``handle`` after it failed, so that the next call looks the actor up again."""
        with self._lock:
            if self._handle is handle:
                self._handle = None

    def listen(self, handle: Any) -> None:
        """Make sure a thread listens for this process's notices on ``handle``."""
        with self._lock:
            if self._listening is handle:
                return
            self._listening = handle
        thread = threading.Thread(
            target=self._listen, args=(handle,), name="collective-notices", daemon=True
        )
        thread.start()

    def _listen(self, handle: Any) -> None:
        import ray

        worker_id = ray.get_runtime_context().get_worker_id()
        acked = 0
        while True:
            try:
                ref = handle.notices.remote(worker_id, acked, _NOTICE_WAIT_S)
                notices = _result(ref, _NOTICE_WAIT_S + _RPC_GRACE_S)
            except TimeoutError:
                continue
            except Exception:
                break  # the store actor exited, or Ray shut down in this process
            for seq, group, incarnation, reason in notices:
                self.on_end(group, incarnation, reason)
                acked = max(acked, seq)
        with self._lock:
            if self._listening is handle:
                self._listening = None


_connection = _Connection()


def set_end_handler(handler: EndHandler) -> None:
    """Install what runs when a driver ends a group this process joined."""
    _connection.on_end = handler


def _result(ref: Any, timeout_s: float) -> Any:
    """Return the value of the object ``ref`` once it is ready; raise its error if it failed.

    Not ``ray.get``: Ray 2.60's ``ray.get`` from a thread other than the one running
    the actor's task races with that task's end on the worker's task metrics, and we
    measured the worker crash (SIGSEGV in ``TaskCounter::UnsetMetricStatus``) while
    the notices listener and the failure watches wait in threads of their own. A
    future is completed by a callback instead, outside that path.

    Raises:
        TimeoutError: the object was not ready within ``timeout_s``.

    """
    return ref.future().result(timeout=timeout_s)


def _call(handle: Any, method: str, *args: Any, group: str, timeout_s: float = _RPC_GRACE_S) -> Any:
    """Call ``method`` on the store actor and return its result.

    Raises:
        TimeoutError: no reply within ``timeout_s``.
        CollectiveError: the store actor is dead or failed.

    """
    from ray.exceptions import RayActorError

    try:
        ref = getattr(handle, method).remote(*args)
    except Exception as exc:  # Ray refuses to submit to an actor it knows is gone.
        _connection.forget(handle)
        raise CollectiveError(f"the store actor of group {group!r} died: {exc}") from exc
    try:
        return _result(ref, timeout_s)
    except TimeoutError as exc:
        raise TimeoutError(f"the store actor gave no reply to {method} in {timeout_s}s") from exc
    except RayActorError as exc:
        _connection.forget(handle)
        raise CollectiveError(f"the store actor of group {group!r} died: {exc}") from exc


class RayRendezvousStore(RendezvousStore):
    """A ``RendezvousStore`` on one incarnation of a group in the shared store actor.

    Once that incarnation is over (its members left, or the driver destroyed
    it), every call raises ``CollectiveError`` saying why.
    """

    def __init__(self, handle: Any, group_name: str, incarnation: str) -> None:
        """Talk to ``group_name``'s ``incarnation`` in the store actor ``handle``."""
        self._handle = handle
        self._group_name = group_name
        self._incarnation = incarnation

    @property
    def handle(self) -> Any:
        """Return the store actor's handle."""
        return self._handle

    @property
    def group_name(self) -> str:
        """Return the group's name."""
        return self._group_name

    @property
    def incarnation(self) -> str:
        """Return the id of the incarnation this store's keys belong to."""
        return self._incarnation

    def call(self, method: str, *args: Any, timeout_s: float = _RPC_GRACE_S) -> Any:
        """Call ``method`` of the store actor with this group and incarnation first."""
        args = (self._group_name, self._incarnation, *args)
        return _call(self._handle, method, *args, group=self._group_name, timeout_s=timeout_s)

    def _gone(self, reason: str) -> CollectiveError:
        return CollectiveError(f"the rendezvous of group {self._group_name!r} is over: {reason}")

    def set(self, key: str, value: bytes) -> None:
        """Publish ``value`` under ``key``."""
        gone = self.call("set", key, value)
        if gone is not None:
            raise self._gone(gone)

    def get(self, key: str, timeout: timedelta) -> bytes:
        """Return the value of ``key``, waiting up to ``timeout`` for it."""
        seconds = timeout.total_seconds()
        status, value = self.call("get", key, seconds, timeout_s=seconds + _RPC_GRACE_S)
        if status == "timeout":
            raise TimeoutError(f"key {key!r} was not set within {timeout}")
        if status == "gone":
            raise self._gone(value)
        return value

    def delete(self, key: str) -> None:
        """Remove ``key`` if it is present."""
        self.call("delete", key)


def _held_message(group_name: str, detail: tuple[list[int], str]) -> str:
    ranks, conflict = detail
    message = (
        f"an earlier group named {group_name!r} is still held by ranks {ranks}, "
        "which have not called destroy_collective_group on it"
    )
    return f"{message} ({conflict})" if conflict else message


def _until_gone(handle: Any, group_name: str, deadline: float) -> None:
    """Wait until an exiting store actor is gone, then let the caller look again."""
    try:
        _call(
            handle,
            "wait_until_gone",
            group=group_name,
            timeout_s=max(deadline - time.monotonic(), 0.001),
        )
    except (CollectiveError, TimeoutError):
        pass
    _connection.forget(handle)


def join_store(
    group_name: str,
    rank: int,
    world_size: int,
    backend: str,
    timeout: timedelta,
    declared: bool = False,
) -> tuple[RayRendezvousStore, str]:
    """Join ``group_name`` as ``rank`` in the shared store, creating the store if needed.

    A name still held by an earlier group (members leaving, or a complete group
    this rank does not fit) is waited for, up to ``timeout``.

    Returns:
        The group's store and its incarnation id.

    Raises:
        CollectiveError: the membership disagrees (rank taken, other world size).
        TimeoutError: the name stayed held, or no store answered, within ``timeout``.

    """
    member = current_member()
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no store actor for group {group_name!r} answered in time")
        handle = _connection.get_or_create()
        args = (group_name, rank, world_size, backend, member, declared, remaining)
        try:
            status, detail = _call(
                handle, "join", *args, group=group_name, timeout_s=remaining + _RPC_GRACE_S
            )
        except CollectiveError:
            time.sleep(_RETRY_S)
            continue
        if status == "ok":
            _connection.listen(handle)
            return RayRendezvousStore(handle, group_name, detail), detail
        if status == "error":
            raise CollectiveError(f"cannot join group {group_name!r}: {detail}")
        if status == "held":
            raise TimeoutError(_held_message(group_name, detail))
        _until_gone(handle, group_name, deadline)


def leave_store(store: RayRendezvousStore, rank: int) -> None:
    """Leave the group's incarnation; the group ends once no rank holds it. Never raises."""
    try:
        store.call("leave", rank, current_member())
    except (CollectiveError, TimeoutError):
        pass


def declare_store(group_name: str, declaration: Declaration) -> None:
    """Declare a group in the shared store, creating the store if needed.

    A name whose members are still leaving is waited for, up to the declared timeout.

    Raises:
        CollectiveError: a live group of that name exists.
        TimeoutError: the name stayed held within the timeout.

    """
    import ray

    job_id = ray.get_runtime_context().get_job_id()
    deadline = time.monotonic() + declaration.timeout.total_seconds()
    while True:
        handle = _connection.get_or_create()
        remaining = max(deadline - time.monotonic(), 0.0)
        args = (group_name, declaration, job_id, remaining)
        try:
            status, detail = _call(
                handle, "declare", *args, group=group_name, timeout_s=remaining + _RPC_GRACE_S
            )
        except CollectiveError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(_RETRY_S)
            continue
        if status == "ok":
            return
        if status == "error":
            raise CollectiveError(detail)
        if status == "held":
            raise TimeoutError(_held_message(group_name, detail))
        _until_gone(handle, group_name, deadline)


def end_group(group_name: str) -> str:
    """End ``group_name`` in every member, from the driver; return the store's answer.

    Returns:
        ``"ended"``; ``"absent"`` when there is no such group; ``"not_allowed"``
        when this driver's job neither declared it nor holds one of its members.

    """
    import ray

    job_id = ray.get_runtime_context().get_job_id()
    return _query("end", group_name, job_id, default="absent", group=group_name, timeout_s=30.0)


def _query(method: str, *args: Any, default: Any, group: str = "", timeout_s: float = 5.0) -> Any:
    """Ask the store actor, if the namespace has one; ``default`` when it has none.

    A handle found dead is dropped and the actor looked up once more, in case a
    fresh store took the name since.
    """
    for _ in range(2):
        handle = _connection.find()
        if handle is None:
            return default
        try:
            return _call(handle, method, *args, group=group, timeout_s=timeout_s)
        except CollectiveError:
            continue
        except TimeoutError:
            return default
    return default


def declaration(group_name: str) -> Declaration | None:
    """Return the driver's declaration of ``group_name``, or None."""
    return _query("declaration", group_name, default=None, group=group_name)


def list_groups() -> list[str]:
    """Return the names of the live groups of this namespace."""
    return _query("names", default=[])


def groups_with(actor_ids: list[str], backend: str | None) -> list[str]:
    """Return the live groups whose members include every one of ``actor_ids``."""
    return _query("groups_with", actor_ids, backend, default=[])


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
