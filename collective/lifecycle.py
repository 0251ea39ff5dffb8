"""Create, find and destroy groups; the Ray-facing half of the public API (see ``queries``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from collective import checks, ray_process, registry
from collective.checked import CheckedGroup
from collective.groups.base import BaseGroup, GroupConstructor, constructor
from collective.manager import GroupManager
from collective.rendezvous import membership
from collective.rendezvous.client import RayRendezvousStore, set_end_handler
from collective.rendezvous.state import Declaration
from collective.types import (
    ArgumentValueError,
    Backend,
    CollectiveError,
    CollectiveTimeoutError,
    CpuTransport,
    GroupNotFoundError,
    GroupOptions,
)

_manager = GroupManager()
set_end_handler(_manager.end)


def _resolve_timeout(gloo_timeout: Any, timeout: Any) -> timedelta:
    if checks.check_timeout(timeout) is not None:
        return timeout
    return checks.check_milliseconds(gloo_timeout, "gloo_timeout")


def _join_and_build(
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
    cls = registry.group_class(backend)
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
            constructor(cls),
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


def forget(group_name: str) -> None:
    """Drop this process's group ``group_name`` without closing it (it is closed already)."""
    _manager.remove(group_name)


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
    return _join_and_build(
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
    return _manager.get(checks.check_group_name(group_name))


def held_names() -> list[str]:
    """Return the names of this process's groups, those its driver ended included."""
    return _manager.names()


def get_group_handle(group_name: str = "default") -> BaseGroup:
    """Return this process's group ``group_name``, building a declared group on first use.

    Raises:
        GroupNotFoundError: no such group exists for this process.

    """
    return group_entry(group_name)[0]


def group_entry(group_name: str) -> tuple[BaseGroup, Any]:
    """Return this process's group ``group_name`` and its rendezvous store.

    Raises:
        GroupNotFoundError: no such group exists for this process.

    """
    checks.check_group_name(group_name)
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
    checks.check_group_name(group_name)
    world_size = checks.check_world_size(world_size)
    rank = checks.check_rank(rank, world_size)
    backend = registry.backend_name(backend)
    group_timeout = _resolve_timeout(gloo_timeout, timeout)
    check_args = checks.check_bool(check_args, "check_args")
    options = checks.check_group_options(strict_buffers, cpu_transport)
    registry.group_class(backend)
    ray_process.require_ray_worker("init_collective_group")
    create_group(
        group_name,
        lambda: _join_and_build(
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
    checks.check_group_name(group_name)
    world_size = checks.check_world_size(world_size)
    ids = ray_process.actor_ids(actors, "actors")
    if not isinstance(ranks, (list, tuple)) or len(actors) != len(ranks):
        got = len(ranks) if isinstance(ranks, (list, tuple)) else type(ranks).__name__
        raise ArgumentValueError(f"ranks must hold one rank per actor ({len(actors)}), got {got}")
    ranks = checks.check_permutation(ranks, world_size)
    ray = ray_process.ray_module()
    check_args = checks.check_bool(check_args, "check_args")
    options = checks.check_group_options(strict_buffers, cpu_transport)
    if not ray.is_initialized():
        raise CollectiveError("declare_collective_group needs ray.init() first")
    backend = registry.backend_name(backend)
    group_timeout = _resolve_timeout(gloo_timeout, timeout)
    registry.group_class(backend, here=False)
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
    checks.check_group_name(group_name)
    entry = _manager.remove(group_name)
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
    for name in _manager.names():
        destroy_collective_group(name)
    ray = ray_process.ray_module()
    if ray.is_initialized() and not ray_process.in_ray_worker():
        for name in membership.list_groups():
            destroy_collective_group(name)
