"""The groups this process holds: find one (building a declared group on first use), add, drop.

One ``GroupManager`` maps this process's group names to their groups and rendezvous
stores; a driver's notice that it ended a group marks the entry ended, and the next
lookup closes it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from collective.checks import arguments
from collective.groups.base import BaseGroup
from collective.registry import ray_process
from collective.registry.build import join_and_build
from collective.registry.manager import Entry, GroupManager
from collective.rendezvous import membership
from collective.rendezvous.client import RayRendezvousStore, set_end_handler
from collective.rendezvous.state import Declaration
from collective.types import GroupNotFoundError

_manager = GroupManager()
set_end_handler(_manager.end)


def create_group(group_name: str, build: Callable[[], tuple[BaseGroup, Any]]) -> None:
    """Build and register group ``group_name`` in this process with ``build``.

    Raises:
        CollectiveError: a group of that name exists here or is being built.

    """
    close_ended(group_name)
    _manager.create(group_name, build)


def replace_group(group_name: str, group: BaseGroup, store: Any) -> None:
    """Make ``group`` (with its rendezvous ``store``) this process's group ``group_name``."""
    _manager.replace(group_name, (group, store))


def forget(group_name: str) -> Entry | None:
    """Drop this process's group ``group_name`` without closing it; return it and its store.

    Returns:
        The group and its rendezvous store, live or ended, or None when there is none.

    """
    return _manager.remove(group_name)


def end_subgroups(incarnation: str, reason: str) -> list[str]:
    """End this process's subgroups made from parent ``incarnation``; their next op says why."""
    return _manager.end_incarnation(incarnation, reason, keep="")


def close_ended(group_name: str) -> str | None:
    """Close this process's copy of ``group_name`` if its driver ended it; return why it ended."""
    entry, reason = _manager.take_ended(group_name)
    if entry is not None:
        entry[0].destroy_group()
    return reason


def declared_rank(group_name: str) -> tuple[Declaration, int] | None:
    """Return the declaration of ``group_name`` and this actor's rank in it, or None."""
    if not ray_process.in_ray_worker():
        return None
    declaration = membership.declaration(group_name)
    actor_id = ray_process.ray_module().get_runtime_context().get_actor_id()
    if declaration is None or actor_id not in declaration.ranks:
        return None
    return declaration, declaration.ranks[actor_id]


def _build_declared(group_name: str) -> tuple[BaseGroup, RayRendezvousStore] | None:
    found = declared_rank(group_name)
    if found is None:
        return None
    declaration, rank = found
    return join_and_build(
        group_name,
        rank,
        declaration.world_size,
        declaration.backend,
        declaration.timeout,
        declaration.check_args,
        declared=True,
        options=declaration.options,
    )


def held_group(group_name: str) -> BaseGroup | None:
    """Return this process's built group ``group_name``, or None; builds nothing."""
    return _manager.get(arguments.check_group_name(group_name))


def held_names() -> list[str]:
    """Return the names of this process's groups, those its driver ended included."""
    return _manager.names()


def get_group_handle(group_name: str = "default") -> BaseGroup:
    """Return this process's group ``group_name``, building a declared group on first use.

    Raises:
        GroupNotFoundError: no such group exists for this process.

    """
    try:
        entry = _manager.lookup(group_name)
    except TypeError:  # an unhashable name: group_entry says what it must be
        entry = None
    if entry is not None:
        return entry[0]
    return group_entry(group_name)[0]


def group_entry(group_name: str) -> tuple[BaseGroup, Any]:
    """Return this process's group ``group_name`` and its rendezvous store.

    Raises:
        GroupNotFoundError: no such group exists for this process.

    """
    arguments.check_group_name(group_name)
    entry = _manager.entry(group_name)
    if entry is not None:
        return entry
    ended = close_ended(group_name)
    _manager.get_or_build(group_name, lambda: _build_declared(group_name))
    entry = _manager.entry(group_name)
    if entry is None and ended is not None:
        raise GroupNotFoundError(f"{ended}; create it again to use it")
    if entry is None:
        raise GroupNotFoundError(
            f"group {group_name!r} is not initialized in this process and was not declared "
            "with this actor as a member"
        )
    return entry
