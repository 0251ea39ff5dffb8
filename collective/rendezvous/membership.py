"""Where ranks meet in Ray: joining, leaving, declaring, ending and listing groups.

Every call goes to the namespace's shared store actor through ``client``,
which finds or creates it and listens for the notices it sends.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from collective.rendezvous.client import (
    RPC_GRACE_S,
    RayRendezvousStore,
    call,
    connection,
)
from collective.rendezvous.liveness import current_member
from collective.rendezvous.state import Declaration
from collective.types import ArgumentValueError, CollectiveError

__all__ = [
    "agree",
    "commit",
    "declaration",
    "declare_store",
    "end_group",
    "groups_with",
    "join_store",
    "leave_store",
    "list_groups",
    "missing_ranks_detail",
    "redeclare",
]

_RETRY_S = 0.05
"""Pause before asking again for the store actor after finding it dead or exiting."""


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
        call(
            handle,
            "wait_until_gone",
            group=group_name,
            timeout_s=max(deadline - time.monotonic(), 0.001),
        )
    except (CollectiveError, TimeoutError):
        pass
    connection.forget(handle)


def join_store(
    group_name: str,
    rank: int,
    world_size: int,
    backend: str,
    timeout: timedelta,
    declared: bool = False,
) -> tuple[RayRendezvousStore, bool]:
    """Join ``group_name`` as ``rank`` in the shared store, creating the store if needed.

    A name still held by an earlier group (members leaving, or a complete group
    this rank does not fit) is waited for, up to ``timeout``.

    Returns:
        The group's store, and whether this rank is a newcomer of a grow: it then
        commits (``commit``) once it has built its transports.

    Raises:
        CollectiveError: the membership disagrees (rank taken, other world size), or
            the grow this rank came to failed.
        TimeoutError: the name stayed held, no store answered, or the grow this rank
            came to timed out, within ``timeout``.

    """
    member = current_member()
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no store actor for group {group_name!r} answered in time")
        handle = connection.get_or_create()
        args = (group_name, rank, world_size, backend, member, declared, remaining)
        try:
            status, detail = call(
                handle, "join", *args, group=group_name, timeout_s=remaining + RPC_GRACE_S
            )
        except CollectiveError:
            time.sleep(_RETRY_S)
            continue
        if status in ("ok", "grow"):
            connection.listen(handle)
            return RayRendezvousStore(handle, group_name, detail), status == "grow"
        if status == "error":
            raise CollectiveError(f"cannot join group {group_name!r}: {detail}")
        if status == "timeout":
            raise TimeoutError(detail)
        if status == "held":
            raise TimeoutError(_held_message(group_name, detail))
        _until_gone(handle, group_name, deadline)


def agree(store: RayRendezvousStore, topic: str, rank: int, value: Any, timeout: timedelta) -> None:
    """Return once every rank of the store's incarnation passed the same ``value`` for ``topic``.

    Raises:
        ArgumentValueError: the ranks passed different values; names each rank's.
        TimeoutError: not every rank came within ``timeout``; names those that did.
        CollectiveError: the incarnation ended meanwhile; says why.

    """
    seconds = timeout.total_seconds()
    status, detail = store.call(
        "agree", topic, rank, value, seconds, timeout_s=seconds + RPC_GRACE_S
    )
    if status == "mismatch":
        by_value: dict[Any, list[int]] = {}
        for voter, voted in sorted(detail.items()):
            by_value.setdefault(voted, []).append(voter)
        passed = "; ".join(f"ranks {ranks} passed {v!r}" for v, ranks in by_value.items())
        raise ArgumentValueError(
            f"every rank of group {store.group_name!r} must pass the same {topic}: {passed}"
        )
    if status == "timeout":
        raise TimeoutError(f"not every rank came to compare {topic} in time (ranks {detail} did)")
    if status == "gone":
        raise CollectiveError(f"the rendezvous of group {store.group_name!r} is over: {detail}")


def commit(store: RayRendezvousStore, rank: int, built: BaseException | None, wait: float) -> None:
    """Commit this rank of the store's incarnation, which a shrink or grow made.

    ``built`` is None once this rank has built its transports, else why it could
    not. Waits up to ``wait`` seconds for the other ranks to commit.

    Raises:
        CollectiveError: the change was abandoned (by this rank, or another rank
            could not build, died, or did not commit in time); says why. The old
            incarnation stays the group's.

    """
    why = "" if built is None else f"{type(built).__name__}: {built}"
    try:
        status, detail = store.call(
            "commit", rank, built is None, why, wait, timeout_s=wait + RPC_GRACE_S
        )
    except TimeoutError as exc:
        raise CollectiveError(str(exc)) from exc
    if status != "ok":
        raise CollectiveError(detail)


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
        handle = connection.get_or_create()
        remaining = max(deadline - time.monotonic(), 0.0)
        args = (group_name, declaration, job_id, remaining)
        try:
            status, detail = call(
                handle, "declare", *args, group=group_name, timeout_s=remaining + RPC_GRACE_S
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


def redeclare(group_name: str, drop: list[str], add: list[str]) -> tuple[str, Any]:
    """Declare ``group_name`` anew without the actors ``drop`` (and the dead), ``add`` after.

    Returns:
        The store actor's answer: ``("ok", {actor id: rank})``, ``("absent", None)``,
        ``("not_allowed", None)`` or ``("error", why)``.

    """
    import ray

    job_id = ray.get_runtime_context().get_job_id()
    args = (group_name, job_id, drop, add)
    return _query("redeclare", *args, default=("absent", None), group=group_name, timeout_s=30.0)


def _query(method: str, *args: Any, default: Any, group: str = "", timeout_s: float = 5.0) -> Any:
    """Ask the store actor, if the namespace has one; ``default`` when it has none.

    A handle found dead is dropped and the actor looked up once more, in case a
    fresh store took the name since.
    """
    for _ in range(2):
        handle = connection.find()
        if handle is None:
            return default
        try:
            return call(handle, method, *args, group=group, timeout_s=timeout_s)
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
