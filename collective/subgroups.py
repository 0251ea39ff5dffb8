"""Subgroups: a new group over some ranks of a live group, with no new actors.

Every member of the parent calls ``new_group`` with the same ranks, in the same
order of calls. The members of the subgroup meet through the parent's store,
under keys no other subgroup uses, and connect a transport of the parent's
backend (checking arguments across ranks if the parent does); the other ranks
only count the call.
"""

from __future__ import annotations

import json
import threading
import weakref
from datetime import timedelta
from typing import Any

from collective import checks, lifecycle
from collective.groups.base import BaseGroup
from collective.store import PrefixedRendezvousStore
from collective.types import ArgumentTypeError, ArgumentValueError

_RANKS_KEY = "ranks"
"""Key under which the subgroup's first rank publishes the rank list, for the others to compare."""

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
    ranks = [checks.check_int(rank, f"ranks[{i}]") for i, rank in enumerate(ranks)]
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
        group_name: the new group's name; None derives one from the parent's name
            and the number of earlier ``new_group`` calls on it.
        parent: the parent group's name.
        timeout: the new group's default timeout; None keeps the parent's.

    Returns:
        The new group's name on its members, None on the parent's other ranks.

    Raises:
        ValueError, TypeError: an argument is invalid (on every rank that calls).
        CollectiveTimeoutError: not every member arrived in time.

    """
    parent_group, parent_store = lifecycle.group_entry(parent)
    ranks = check_subset(ranks, parent_group.world_size)
    name = checks.check_group_name(group_name) if group_name is not None else None
    group_timeout = checks.check_timeout(timeout) or parent_group.timeout
    call = _next_call(parent_group)
    name = name or f"{parent}.sub{call}"
    if parent_group.rank not in ranks:
        return None
    rank = ranks.index(parent_group.rank)
    store = PrefixedRendezvousStore(parent_store, f"subgroup/{call}/{name}/")
    _check_same_ranks(store, rank, ranks, group_timeout)
    cls = type(parent_group)
    lifecycle.create_group(
        name,
        lambda: (
            cls(
                len(ranks),
                rank,
                name,
                store,
                group_timeout,
                lifecycle.node_ip(),
                options=parent_group.options,
            ),
            store,
        ),
    )
    return name


def _check_same_ranks(
    store: PrefixedRendezvousStore, rank: int, ranks: list[int], timeout: timedelta
) -> None:
    """Raise on a member whose ``ranks`` differ from the subgroup's first member's."""
    mine = json.dumps(ranks).encode()
    if rank == 0:
        store.set(_RANKS_KEY, mine)
        return
    first = store.get(_RANKS_KEY, timeout)
    if first != mine:
        raise ArgumentValueError(
            "every member must pass the same ranks to new_group: the first member passed "
            f"{json.loads(first)}, this rank passed {ranks}"
        )
