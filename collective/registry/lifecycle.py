"""Create, declare and destroy groups: the Ray-facing half of the public API (see ``queries``)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from collective.checks import arguments
from collective.registry import backends, held, ray_process
from collective.registry.build import join_and_build
from collective.rendezvous import membership
from collective.rendezvous.client import RayRendezvousStore
from collective.rendezvous.state import Declaration
from collective.types import ArgumentValueError, Backend, CollectiveError, CpuTransport


def _resolve_timeout(gloo_timeout: Any, timeout: Any) -> timedelta:
    checked = arguments.check_timeout(timeout)
    if checked is not None:
        return checked
    return arguments.check_milliseconds(gloo_timeout, "gloo_timeout")


def init_collective_group(
    world_size: int,
    rank: int,
    backend: Backend | str = Backend.NCCL,
    group_name: str = "default",
    gloo_timeout: float = 30000,
    *,
    timeout: timedelta | None = None,
    check_args: bool = False,
    strict_buffers: bool | None = None,
    cpu_transport: CpuTransport | str | None = None,
) -> None:
    """Join this actor to a collective group as ``rank``; blocks until all ranks arrive.

    Args:
        world_size: the number of ranks in the group.
        rank: this actor's rank, in ``[0, world_size)``.
        backend: ``"gloo"`` or ``"nccl"`` (any case), a ``Backend``, or the name of a
            backend registered with ``register_collective_backend``.
        group_name: the group's name, unique among live groups of the job.
        gloo_timeout: the default timeout of the group's waits and ops, in ms (an int
            or a float), as in Ray.
        timeout: the same as a ``timedelta``; it wins over ``gloo_timeout`` when given.
        check_args: before every op, compare the ranks' arguments (op, dtype, shape,
            root, reduce op) over the group and raise ``ValueError`` on every rank if
            they differ, or if one rank's own argument checks failed. Costs one
            small allgather per op. Every rank must pass the same value; ranks
            that differ all get a ``ValueError`` naming each rank's, and no group.
        strict_buffers: refuse read-only output buffers (an actor argument, a
            ``ray.get`` result) with ``ValueError`` instead of writing them with a
            warning; None reads ``COLLECTIVE_STRICT_BUFFERS``.
        cpu_transport: for CPU groups, ``"auto"`` (shared memory inside a node,
            Gloo between nodes), ``"shm"`` (the same, never falling back to TCP inside
            a node) or ``"gloo"`` (TCP everywhere); None reads
            ``COLLECTIVE_CPU_TRANSPORT``, then ``"auto"``.

    Raises:
        ValueError, TypeError: an argument is invalid.
        CollectiveError: the group exists here already, or the backend is unavailable.
        CollectiveTimeoutError: not every rank arrived in time.

    """
    arguments.check_group_name(group_name)
    world_size = arguments.check_world_size(world_size)
    rank = arguments.check_rank(rank, world_size)
    backend = backends.backend_name(backend)
    group_timeout = _resolve_timeout(gloo_timeout, timeout)
    check_args = arguments.check_bool(check_args, "check_args")
    options = arguments.check_group_options(strict_buffers, cpu_transport)
    backends.group_class(backend)
    ray_process.require_ray_worker("init_collective_group")
    held.create_group(
        group_name,
        lambda: join_and_build(
            group_name, rank, world_size, backend, group_timeout, check_args, options=options
        ),
    )


def declare_collective_group(
    actors: list[Any],
    world_size: int,
    ranks: list[int],
    backend: Backend | str = Backend.NCCL,
    group_name: str = "default",
    gloo_timeout: float = 30000,
    *,
    timeout: timedelta | None = None,
    check_args: bool = False,
    strict_buffers: bool | None = None,
    cpu_transport: CpuTransport | str | None = None,
) -> None:
    """Declare from the driver that ``actors`` form a group; each builds it on first use.

    Nothing runs in the actors now. ``get_rank`` and ``get_collective_group_size``
    inside them already return the declared values.

    Args:
        actors: the member actors' handles.
        world_size: the number of ranks; equal to ``len(actors)``.
        ranks: ``ranks[i]`` is the rank of ``actors[i]``; a permutation of the ranks.
        backend: ``"gloo"`` or ``"nccl"`` (any case), a ``Backend``, or the name of a
            backend registered with ``register_collective_backend``.
        group_name: the group's name, unique among live groups of the job.
        gloo_timeout: the default timeout of the group's waits and ops, in ms, as in Ray.
        timeout: the same as a ``timedelta``; it wins over ``gloo_timeout`` when given.
        check_args: as in ``init_collective_group``; kept in the declaration.
        strict_buffers: as in ``init_collective_group``; kept in the declaration.
        cpu_transport: as in ``init_collective_group``; kept in the declaration.

    Raises:
        ValueError, TypeError: an argument is invalid.
        CollectiveError: a live group of that name exists, an earlier one is still
            being left by its members after ``timeout``, or the backend is unavailable.

    """
    arguments.check_group_name(group_name)
    world_size = arguments.check_world_size(world_size)
    ids = ray_process.actor_ids(actors, "actors")
    if not isinstance(ranks, (list, tuple)) or len(actors) != len(ranks):
        got = len(ranks) if isinstance(ranks, (list, tuple)) else type(ranks).__name__
        raise ArgumentValueError(f"ranks must hold one rank per actor ({len(actors)}), got {got}")
    ranks = arguments.check_permutation(ranks, world_size)
    ray = ray_process.ray_module()
    check_args = arguments.check_bool(check_args, "check_args")
    options = arguments.check_group_options(strict_buffers, cpu_transport)
    if not ray.is_initialized():
        raise CollectiveError("declare_collective_group needs ray.init() first")
    backend = backends.backend_name(backend)
    group_timeout = _resolve_timeout(gloo_timeout, timeout)
    backends.group_class(backend, here=False)
    ranks_by_actor = dict(zip(ids, ranks, strict=True))
    declaration = Declaration(
        world_size, backend, ranks_by_actor, group_timeout, check_args, options
    )
    try:
        membership.declare_store(group_name, declaration)
    except TimeoutError as exc:
        raise CollectiveError(f"cannot declare group {group_name!r}: {exc}") from exc


create_collective_group = declare_collective_group


def destroy_collective_group(group_name: str = "default") -> None:
    """Destroy a group: inside a member, leave it; from the driver, end it in every member.

    In a member this closes the group's connections and leaves it; the group is
    gone once every member that joined has left it or died. In the driver of the
    job that declared the group or holds its members, it ends the group at once:
    each member's next op on it raises ``CollectiveError`` saying so, and the name
    is free. Anywhere else it does nothing: in a Ray task or actor that does not
    hold the group (a declared member before its first op included), or for a
    group that does not exist.
    """
    arguments.check_group_name(group_name)
    entry = held.forget(group_name)
    if entry is not None:
        group, store = entry
        group.destroy_group()
        if isinstance(store, RayRendezvousStore):
            membership.leave_store(store, group.rank)
        return
    ray = ray_process.ray_module()
    if ray.is_initialized() and not ray_process.in_ray_worker():
        membership.end_group(group_name)


def destroy_all_collective_groups() -> None:
    """Destroy every group this process holds; from the driver, also end every group of its job.

    Inside an actor this leaves each of its groups, as ``destroy_collective_group``
    does. In the driver it also ends, in their members, every group of the
    namespace that its job declared or whose members belong to its job.
    """
    for name in held.held_names():
        destroy_collective_group(name)
    ray = ray_process.ray_module()
    if ray.is_initialized() and not ray_process.in_ray_worker():
        for name in membership.list_groups():
            destroy_collective_group(name)
