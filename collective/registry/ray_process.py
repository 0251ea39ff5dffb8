"""What this process knows of Ray: whether it runs, whether this is a worker, actor ids.

The one place the group lifecycle, the elastic calls and the subgroups ask Ray
about the process they run in; importing it does not import Ray.
"""

from __future__ import annotations

from typing import Any

from collective.types import ArgumentTypeError, ArgumentValueError, CollectiveError


def ray_module() -> Any:
    """Return the ray module, or say what to install."""
    try:
        import ray
    except ImportError as exc:
        raise CollectiveError("collective groups need Ray: pip install ray") from exc
    return ray


def in_ray_worker() -> bool:
    """Return whether this process is a Ray worker (an actor or a task), not a driver."""
    ray = ray_module()
    return ray.is_initialized() and ray._private.worker.global_worker.mode == ray.WORKER_MODE


def ray_running() -> bool:
    """Return whether Ray is initialized in this process (a driver connected, or a worker)."""
    return bool(ray_module().is_initialized())


def node_ip() -> str:
    """Return the address this node's transports bind to: the Ray node IP."""
    return ray_module().util.get_node_ip_address()


def actor_ids(actors: Any, name: str) -> list[str]:
    """Return the ids of the distinct actor handles in the list ``actors`` (argument ``name``).

    Raises:
        TypeError: ``actors`` is no list or tuple, or holds something else than handles.
        ValueError: an actor appears twice.

    """
    ray = ray_module()
    if not isinstance(actors, (list, tuple)):
        raise ArgumentTypeError(
            f"{name} must be a list of actor handles, got {type(actors).__name__}"
        )
    ids = []
    for i, actor in enumerate(actors):
        if not isinstance(actor, ray.actor.ActorHandle):
            raise ArgumentTypeError(
                f"{name}[{i}] must be a Ray actor handle, got {type(actor).__name__}"
            )
        ids.append(actor._ray_actor_id.hex())
    if len(set(ids)) != len(ids):
        raise ArgumentValueError(f"{name} must be distinct; the same actor appears twice")
    return ids


def require_ray_worker(function: str) -> None:
    """Raise unless this process is a Ray worker; ``function`` names the caller."""
    if not in_ray_worker():
        raise CollectiveError(f"{function} must be called inside a Ray actor or task")
