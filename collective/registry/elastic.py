"""Elastic groups: the survivors of a failure shrink a group and go on; newcomers grow it back.

A shrink or grow makes a new incarnation of the same group name. Every current
member calls ``shrink_group`` (or ``grow_group``); the shared store actor, which
knows which members died, decides once who remains and gives every caller its new
rank. Each caller then aborts its old transports, never waiting on them, and
connects new ones under the new incarnation. Newcomers of a grow join with
``init_collective_group``. Subgroups made from the old incarnation end: their next
op says to make them again.

A group declared from the driver changes from the driver instead, with
``shrink_declared_group`` and ``grow_declared_group``: the declaration is replaced,
the current incarnation ends in every member, and each member builds the group
again, with its new rank, at its next op.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from collective.checks import arguments
from collective.checks.check_args import CheckedGroup
from collective.groups.base import BaseGroup
from collective.registry import backends, build, held, ray_process
from collective.rendezvous import membership
from collective.rendezvous.client import RPC_GRACE_S, RayRendezvousStore
from collective.rendezvous.liveness import current_member
from collective.types import (
    ArgumentTypeError,
    ArgumentValueError,
    CollectiveError,
    CollectiveTimeoutError,
)


def shrink_group(
    group_name: str = "default",
    *,
    exclude: list[int] | None = None,
    timeout: timedelta | None = None,
) -> int:
    """Drop the dead ranks (and ``exclude``) from a group; every remaining member calls this.

    The ranks the store has seen die are dropped, and so are the live ranks in
    ``exclude``. The remaining ranks keep their order: with four ranks and rank 1
    dead, ranks 0, 2 and 3 become 0, 1 and 2. The group keeps its name, backend and
    options; ``get_rank`` and ``get_collective_group_size`` answer the new values. A
    member that dies while the others wait is dropped too. An excluded live rank's
    next op on the group raises ``GroupNotFoundError``; it then destroys the group.
    Subgroups made with ``new_group`` from the group end the same way.

    Args:
        group_name: the group to shrink.
        exclude: live ranks (old numbering) to drop as well; the same on every caller.
        timeout: how long to wait for the other members; None takes the group's timeout.

    Returns:
        This rank's rank in the shrunk group.

    Raises:
        ValueError, TypeError: ``exclude`` or ``timeout`` is invalid (this rank only),
            or the members passed different ``exclude`` lists (every member).
        CollectiveTimeoutError: a member that is alive did not call in time; names it.
        CollectiveError: the group is not a Ray group, or the new transports failed
            (the group then stays as it was).

    """
    group, store = _ray_group(group_name, "shrink_group")
    excluded = _check_exclude(exclude, group.world_size, group.rank)
    wait = arguments.check_timeout(timeout) or group.timeout
    return _reshape(group_name, group, store, "shrink", excluded, wait)


def grow_group(
    group_name: str = "default",
    world_size: int | None = None,
    *,
    timeout: timedelta | None = None,
) -> None:
    """Grow a group to ``world_size`` ranks; every current member calls this.

    Members keep their ranks. Each newcomer calls ``init_collective_group(world_size,
    rank, backend, group_name)`` with a rank from the current size to ``world_size - 1``.
    The call returns once every member and every newcomer has come and the new
    transports connect.

    Args:
        group_name: the group to grow.
        world_size: the new number of ranks, larger than the current one.
        timeout: how long to wait for the others; None takes the group's timeout.

    The group's old incarnation stays until every member and newcomer has built the
    new transports; a grow that fails leaves the group as it was, usable.

    Raises:
        ValueError, TypeError: ``world_size`` or ``timeout`` is invalid (this rank
            only), or the members passed different sizes, or a newcomer another
            ``check_args`` (every member).
        CollectiveTimeoutError: a member or newcomer did not come in time; names it.
        CollectiveError: a member or newcomer died meanwhile (names it; after a
            member's death, shrink first), the group was declared from the driver
            (use ``grow_declared_group``), or the new transports failed.

    """
    if world_size is None:
        raise ArgumentTypeError("grow_group needs world_size, the group's new size, got None")
    size = arguments.check_world_size(world_size)
    group, store = _ray_group(group_name, "grow_group")
    if size <= group.world_size:
        raise ArgumentValueError(
            f"world_size must be larger than the group's {group.world_size} ranks, got {size}"
        )
    wait = arguments.check_timeout(timeout) or group.timeout
    _reshape(group_name, group, store, "grow", size, wait)


def shrink_declared_group(
    actors: list[Any],
    group_name: str = "default",
    *,
    exclude: list[Any] | None = None,
) -> list[int | None]:
    """Declare a group anew from the driver without its dead actors and ``exclude``.

    The kept actors keep their order, so their ranks close the gaps. The current
    incarnation ends in every member, as when the driver destroys the group (an op
    in flight raises), and each member builds the group again, with its new rank,
    at its next op.

    Args:
        actors: actor handles of the group (any of its members, dead ones included);
            the result answers for each.
        group_name: the declared group.
        exclude: live member actors to drop as well.

    Returns:
        The new rank of each of ``actors``, None for those dropped.

    Raises:
        ValueError, TypeError: an argument is invalid.
        CollectiveError: there is no such group, it was made by init (its members
            use ``shrink_group``), or this driver may not change it.

    """
    ids = ray_process.actor_ids(actors, "actors")
    drop = ray_process.actor_ids(exclude or [], "exclude")
    ranks = _redeclare(group_name, drop, [])
    return [ranks.get(actor) for actor in ids]


def grow_declared_group(actors: list[Any], group_name: str = "default") -> list[int]:
    """Declare a group anew from the driver with ``actors`` added after its members.

    The new actors take the ranks after the current members' (a dead member is
    dropped first, as by ``shrink_declared_group``). Every member, old or new, builds
    the group at its next op.

    Args:
        actors: the new member actors' handles, not members yet.
        group_name: the declared group.

    Returns:
        The rank of each of ``actors``.

    Raises:
        ValueError, TypeError: an argument is invalid, or an actor is a member already.
        CollectiveError: there is no such group, it was made by init (its members
            use ``grow_group``), or this driver may not change it.

    """
    ids = ray_process.actor_ids(actors, "actors")
    if not ids:
        raise ArgumentValueError("actors must name at least one new member, got []")
    declaration = membership.declaration(arguments.check_group_name(group_name))
    members = set(declaration.ranks) if declaration is not None else set()
    already = [i for i, actor in enumerate(ids) if actor in members]
    if already:
        raise ArgumentValueError(f"actors{already} are members of group {group_name!r} already")
    ranks = _redeclare(group_name, [], ids)
    return [ranks[actor] for actor in ids]


def _ray_group(group_name: str, function: str) -> tuple[BaseGroup, RayRendezvousStore]:
    group, store = held.group_entry(group_name)
    if not isinstance(store, RayRendezvousStore):
        raise CollectiveError(
            f"{function} reshapes groups made in Ray actors; group {group_name!r} is a subgroup "
            "or was made without Ray: make it again instead"
        )
    return group, store


def _check_exclude(exclude: Any, world_size: int, rank: int) -> list[int]:
    """Return ``exclude`` as a sorted list of distinct ranks other than ``rank``."""
    if exclude is None:
        return []
    if not isinstance(exclude, (list, tuple, set, frozenset)):
        raise ArgumentTypeError(f"exclude must be a list of ranks, got {type(exclude).__name__}")
    ranks = [arguments.check_int(r, "exclude") for r in exclude]
    outside = [r for r in ranks if not 0 <= r < world_size]
    if outside:
        raise ArgumentValueError(
            f"exclude must hold ranks of the group, in [0, {world_size}), got {outside}"
        )
    if rank in ranks:
        raise ArgumentValueError(
            f"exclude holds rank {rank}, the caller; an excluded rank does not call "
            "shrink_group, it destroys the group"
        )
    return sorted(set(ranks))


def _reshape(
    name: str,
    group: BaseGroup,
    store: RayRendezvousStore,
    kind: str,
    term: list[int] | int,
    wait: timedelta,
) -> int:
    """Agree on the change in the store, connect the new transports, then retire the old ones."""
    seconds = wait.total_seconds()
    deadline = time.monotonic() + seconds
    op = f"{kind}_group"
    status, detail = store.call(
        kind, group.rank, current_member(), term, seconds, timeout_s=seconds + RPC_GRACE_S
    )
    if status == "mismatch":
        raise ArgumentValueError(f"{op} on group {name!r}: {detail}")
    if status == "timeout":
        raise CollectiveTimeoutError(op, name, group.rank, wait, detail)
    if status != "ok":
        raise CollectiveError(f"{op} on group {name!r} failed on rank {group.rank}: {detail}")
    incarnation, numbering, size = detail
    rank = numbering[group.rank]
    fresh = RayRendezvousStore(store.handle, name, incarnation)
    inner = group.inner if isinstance(group, CheckedGroup) else group
    checked = isinstance(group, CheckedGroup)
    try:
        built = build.build_incarnation(
            backends.rebuilder(inner),
            size,
            rank,
            fresh,
            group.timeout,
            group.options,
            checked if kind == "grow" else None,
            max(deadline - time.monotonic(), 0.001),
        )
    except (CollectiveError, TimeoutError) as exc:
        raise CollectiveError(
            f"{op} on group {name!r} failed on rank {group.rank}: {exc}; the group keeps "
            f"its {group.world_size} ranks"
        ) from exc
    group.retire(f"group {name!r} moved to a new incarnation by {op}")
    held.end_subgroups(store.incarnation, f"its parent group {name!r} was reshaped by {op}")
    held.replace_group(name, CheckedGroup(built) if checked else built, fresh)
    return rank


def _redeclare(group_name: str, drop: list[str], add: list[str]) -> dict[str, int]:
    arguments.check_group_name(group_name)
    if ray_process.in_ray_worker():
        raise CollectiveError("declared groups are reshaped from the driver, not inside an actor")
    status, detail = membership.redeclare(group_name, drop, add)
    if status == "ok":
        return dict(detail)
    if status == "absent":
        raise CollectiveError(f"there is no group named {group_name!r} to reshape")
    if status == "not_allowed":
        raise CollectiveError(
            f"group {group_name!r} was declared by another job, whose driver may reshape it"
        )
    raise CollectiveError(f"cannot reshape group {group_name!r}: {detail}")
