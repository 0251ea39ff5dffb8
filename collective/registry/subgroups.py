"""Subgroups: a new group over some ranks of a live group, with no new actors.

Every member of the parent calls ``new_group`` with the same ranks, in the same
order of calls. The members of the subgroup meet through the parent's store,
under keys no other subgroup uses, and connect a transport of the parent's
backend (checking arguments across ranks if the parent does); the other ranks
only count the call.

Before connecting, each member publishes what it was asked for (ranks, name)
or why it cannot build the group, and reads every other member's record. So
every member raises at once when one of them cannot take part, instead of the
others waiting out the timeout for it. Default names and keys carry the
parent's incarnation, so the subgroups of a re-created parent never meet those
of an old one that a process still holds.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import weakref
from datetime import timedelta
from typing import Any

from collective.checks import arguments
from collective.groups.base import BaseGroup
from collective.registry import backends, held, ray_process
from collective.rendezvous.store import PrefixedRendezvousStore, RendezvousStore
from collective.types import (
    ArgumentTypeError,
    ArgumentValueError,
    CollectiveError,
    CollectiveTimeoutError,
    time_left,
)

_lock = threading.Lock()
_calls: weakref.WeakKeyDictionary[BaseGroup, int] = weakref.WeakKeyDictionary()
"""How many times ``new_group`` was called on each live parent group in this process."""


def _next_call(parent: BaseGroup) -> int:
    with _lock:
        count = _calls.get(parent, 0)
        _calls[parent] = count + 1
    return count


def check_subset(ranks: Any, world_size: int) -> list[int]:
    """Return ``ranks`` as a list if it names distinct ranks of a group of ``world_size``."""
    if not isinstance(ranks, (list, tuple)):
        raise ArgumentTypeError(f"ranks must be a list of ints, got {type(ranks).__name__}")
    if not ranks:
        raise ArgumentValueError("ranks must name at least one rank, got []")
    ranks = [arguments.check_int(rank, f"ranks[{i}]") for i, rank in enumerate(ranks)]
    outside = [r for r in ranks if not 0 <= r < world_size]
    if outside or len(set(ranks)) != len(ranks):
        raise ArgumentValueError(
            f"ranks must be distinct ranks of the parent group, in [0, {world_size}), "
            f"got {list(ranks)}"
        )
    return list(ranks)


def new_group(
    ranks: list[int],
    group_name: str | None = None,
    parent: str = "default",
    *,
    timeout: timedelta | None = None,
) -> str | None:
    """Make a group of some ranks of ``parent``; every member of ``parent`` must call this.

    Rank ``i`` of the new group is ``ranks[i]`` of the parent. The new group has
    the parent's backend and outlives nothing: destroy it with
    ``destroy_collective_group`` like any group.

    Args:
        ranks: distinct parent ranks; their order gives the new ranks.
        group_name: the new group's name; None derives one from the parent's name,
            the number of earlier ``new_group`` calls on it and its incarnation.
        parent: the parent group's name.
        timeout: the new group's default timeout; None keeps the parent's.

    Returns:
        The new group's name on its members, None on the parent's other ranks.

    Raises:
        ValueError, TypeError: an argument is invalid (on every rank that calls), or
            the members passed different ranks or names (on every member).
        CollectiveError: a member cannot build the group (its name is taken there);
            raised at once on every member.
        CollectiveTimeoutError: not every member arrived in time.

    """
    parent_group, parent_store = held.group_entry(parent)
    call = _next_call(parent_group)
    incarnation = parent_store.incarnation
    meeting = PrefixedRendezvousStore(parent_store, f"subgroup/{incarnation}/{call}/")
    me = parent_group.rank
    try:
        ranks = check_subset(ranks, parent_group.world_size)
        name = arguments.check_group_name(group_name) if group_name is not None else None
        group_timeout = arguments.check_timeout(timeout) or parent_group.timeout
    except (TypeError, ValueError) as exc:
        with contextlib.suppress(CollectiveError, TimeoutError):
            _publish(meeting, me, {"error": f"{type(exc).__name__}: {exc}"})
        raise
    name = name or _default_name(parent, call, incarnation)
    if me not in ranks:
        return None
    rank = ranks.index(me)
    if held.held_group(name) is not None:
        error = f"group {name!r} is already initialized on parent rank {me}"
        _publish(meeting, me, {"error": error})
        raise CollectiveError(f"new_group cannot make {name!r}: {error}")
    _publish(meeting, me, {"ranks": ranks, "name": name})
    _agree(meeting, me, ranks, name, group_timeout)
    store = PrefixedRendezvousStore(parent_store, f"subgroup/{incarnation}/{call}/{name}/")
    cls = backends.rebuilder(parent_group)
    held.create_group(
        name,
        lambda: (
            cls(
                len(ranks),
                rank,
                name,
                store,
                group_timeout,
                ray_process.node_ip(),
                options=parent_group.options,
            ),
            store,
        ),
    )
    return name


def _default_name(parent: str, call: int, incarnation: str) -> str:
    """Return ``<parent>.sub<call>``, with the parent's incarnation when it has one."""
    base = f"{parent}.sub{call}"
    return f"{base}-{incarnation[:8]}" if incarnation else base


def _publish(meeting: RendezvousStore, me: int, record: dict[str, Any]) -> None:
    """Publish parent rank ``me``'s record of this call for the other members to read."""
    meeting.set(f"member/{me}", json.dumps(record).encode())


def _agree(
    meeting: RendezvousStore, me: int, ranks: list[int], name: str, timeout: timedelta
) -> None:
    """Read every other member's record; raise on every member unless all agree with ours.

    Raises:
        CollectiveError: a member reported that it cannot build the group.
        ArgumentValueError: a member passed other ranks or another name.
        CollectiveTimeoutError: a member did not call ``new_group`` in time.

    """
    deadline = time.monotonic() + timeout.total_seconds()
    for peer in ranks:
        if peer == me:
            continue
        left = time_left(deadline)
        try:
            theirs = json.loads(meeting.get(f"member/{peer}", left))
        except TimeoutError as exc:
            detail = f"parent rank {peer} did not call new_group for it: {exc}"
            rank = ranks.index(me)
            raise CollectiveTimeoutError("new_group", name, rank, timeout, detail) from exc
        if "error" in theirs:
            raise CollectiveError(
                f"new_group cannot make {name!r}: parent rank {peer} failed: {theirs['error']}"
            )
        for field, mine in (("ranks", ranks), ("name", name)):
            if theirs[field] != mine:
                raise ArgumentValueError(
                    f"every member must pass the same {field} to new_group: parent rank "
                    f"{peer} passed {theirs[field]!r}, parent rank {me} passed {mine!r}"
                )
