"""Meet a group's other ranks at its rendezvous and build this rank's transports there.

``join_and_build`` joins a group through the namespace's store actor, as
``init_collective_group`` or a declared member's first op does; ``build_incarnation``
builds the transports of one incarnation, and commits it when a shrink or grow made it.
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta

from collective.checks.check_args import CheckedGroup
from collective.groups.base import BaseGroup
from collective.registry import backends, ray_process
from collective.registry.backends import GroupConstructor
from collective.rendezvous import membership
from collective.rendezvous.client import RayRendezvousStore
from collective.types import CollectiveError, CollectiveTimeoutError, GroupOptions


def join_and_build(
    group_name: str,
    rank: int,
    world_size: int,
    backend: str,
    timeout: timedelta,
    check_args: bool = False,
    declared: bool = False,
    options: GroupOptions | None = None,
) -> tuple[BaseGroup, RayRendezvousStore]:
    """Meet the other ranks through the group's store actor and connect to them.

    The ranks of a group made by init agree on ``check_args`` first (a declared
    group's ranks all read it from the declaration). A newcomer of a grow commits
    once connected, and the grow ends for every rank if it cannot.
    """
    backends.group_class(backend)  # raises, saying what to install, if it cannot run here
    build = backends.builder(backend)
    start = time.monotonic()
    try:
        store, newcomer = membership.join_store(
            group_name, rank, world_size, backend, timeout, declared
        )
    except TimeoutError as exc:
        raise CollectiveTimeoutError("init", group_name, rank, timeout, str(exc)) from exc
    commit_s = _left(start, timeout) if newcomer else None
    try:
        group = build_incarnation(
            build,
            world_size,
            rank,
            store,
            timeout,
            options,
            None if declared else check_args,
            commit_s,
        )
    except (TimeoutError, CollectiveTimeoutError) as exc:
        detail = exc.detail if isinstance(exc, CollectiveTimeoutError) else str(exc)
        detail = f"{detail}; {membership.missing_ranks_detail(store)}"
        membership.leave_store(store, rank)
        raise CollectiveTimeoutError("init", group_name, rank, timeout, detail) from exc
    except BaseException:
        membership.leave_store(store, rank)
        raise
    return (CheckedGroup(group) if check_args else group), store


def build_incarnation(
    build: GroupConstructor,
    world_size: int,
    rank: int,
    store: RayRendezvousStore,
    timeout: timedelta,
    options: GroupOptions | None,
    check_args: bool | None,
    commit_s: float | None,
) -> BaseGroup:
    """Build this rank's transports on ``store``'s incarnation; commit it if a change made it.

    Args:
        build: the group's class.
        world_size: the incarnation's number of ranks.
        rank: this rank in it.
        store: the incarnation's rendezvous.
        timeout: the group's timeout.
        options: the group's settings.
        check_args: this rank's ``check_args``, which every rank must share (compared
            first); None compares nothing.
        commit_s: for an incarnation a shrink or grow made, how long to wait for the
            other ranks to commit; None for one made by init.

    Raises:
        ArgumentValueError: the ranks passed different ``check_args``.
        CollectiveError, TimeoutError: the build failed; for a shrink or grow, the
            change was abandoned, and the group's old incarnation stays. A rank of
            an incarnation made by init has not left it: the caller leaves it.

    """
    name = store.group_name
    try:
        if check_args is not None:
            membership.agree(store, "check_args", rank, check_args, timeout)
        group = build(
            world_size, rank, name, store, timeout, ray_process.node_ip(), options=options
        )
    except BaseException as exc:
        if commit_s is not None:
            with contextlib.suppress(CollectiveError):
                membership.commit(store, rank, exc, 0.0)
        raise
    if commit_s is not None:
        try:
            membership.commit(store, rank, None, commit_s)
        except BaseException:
            group.destroy_group()
            raise
    return group


def _left(start: float, timeout: timedelta) -> float:
    """Return the seconds of ``timeout`` left since ``start`` (monotonic), at least a little."""
    return max(start + timeout.total_seconds() - time.monotonic(), 0.001)
