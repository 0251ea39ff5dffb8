"""Answer which groups exist, who belongs to them, and which backends run here."""

from __future__ import annotations

from typing import Any

from collective.registry import backends, held, ray_process
from collective.rendezvous import membership
from collective.types import ArgumentTypeError, Backend


def is_group_initialized(group_name: str = "default") -> bool:
    """Return whether this process has built the group ``group_name``."""
    return held.held_group(group_name) is not None


def _membership(group_name: str) -> tuple[int, int]:
    """Return ``(rank, world_size)`` of this process in ``group_name``, or ``(-1, -1)``."""
    group = held.held_group(group_name)
    if group is not None:
        return group.rank, group.world_size
    held.close_ended(group_name)
    found = held.declared_rank(group_name)
    return (found[1], found[0].world_size) if found else (-1, -1)


def get_rank(group_name: str = "default") -> int:
    """Return this process's rank in ``group_name``, or -1 if it is not a member.

    A group declared from the driver answers before it is built.
    """
    return _membership(group_name)[0]


def get_collective_group_size(group_name: str = "default") -> int:
    """Return the world size of ``group_name``, or -1 if this process is not a member.

    A group declared from the driver answers before it is built.
    """
    return _membership(group_name)[1]


def is_backend_available(backend: Backend | str) -> bool:
    """Return whether groups of ``backend`` can be created in this process."""
    return backends.is_available(backends.backend_name(backend))


def gloo_available() -> bool:
    """Return whether the gloo backend can be used here."""
    return is_backend_available(Backend.GLOO)


def nccl_available() -> bool:
    """Return whether the nccl backend can be used here."""
    return is_backend_available(Backend.NCCL)


def list_collective_groups() -> list[str]:
    """Return the names of the live groups of this job, in every process.

    A group is listed from its creation or declaration until it is destroyed, or
    until all its members are dead. Subgroups made by ``new_group`` meet inside their
    parent's rendezvous and are not listed.
    """
    return membership.list_groups() if ray_process.ray_running() else []


def get_collective_groups(
    actors: list[Any] | None = None, backend: Backend | str | None = None
) -> list[str]:
    """Return the names of groups: this process's, or those that contain every one of ``actors``.

    Args:
        actors: None for the groups this process holds (inside an actor); or actor
            handles, for the live groups of the job whose members include them all.
        backend: keep only groups of this backend.

    """
    wanted = None if backend is None else backends.backend_name(backend)
    if actors is None:
        groups = ((name, held.held_group(name)) for name in held.held_names())
        return [n for n, g in groups if g is not None and wanted in (None, g.backend_name())]
    if not isinstance(actors, (list, tuple)):
        raise ArgumentTypeError(
            f"actors must be a list of actor handles, got {type(actors).__name__}"
        )
    ids = sorted({actor._ray_actor_id.hex() for actor in actors})
    return membership.groups_with(ids, wanted) if ray_process.ray_running() else []
