"""Register the plug-ins with Ray, in this process; Ray is imported only when they are called."""

from __future__ import annotations

import threading

from collective.ray_plugins.names import DEFAULT_NAME, SHM_NAME, check_name
from collective.types import ArgumentValueError

_lock = threading.Lock()


def register_ray_backend(name: str = DEFAULT_NAME) -> None:
    """Register this library with ``ray.util.collective`` as backend ``name``, in this process.

    Afterwards ``ray.util.collective.init_collective_group(..., backend=name)`` (and
    Ray's ``create_collective_group`` with that backend) builds groups that run on
    this library: shared memory inside a node and Gloo across nodes for CPU
    buffers, NCCL for CUDA buffers when every rank has a GPU. Ray asks that a
    backend be registered in the driver and in every actor before groups are made:
    call it in both, or pass ``collective.ray_plugins.runtime_env()`` to
    ``ray.init`` so that every worker registers it as it starts. Calling it again
    with the same name is a no-op.

    Args:
        name: the backend's name, in any case; Ray keys it in upper case.

    Raises:
        TypeError: ``name`` is no str.
        ValueError: ``name`` is empty, or Ray holds another class under it.

    """
    key = check_name(name)
    from ray.util.collective import backend_registry

    from collective.ray_plugins.backend import RayGroup

    registry = backend_registry._global_registry
    with _lock:
        if registry.is_registered(key):
            held = registry.get(key)
            if held is RayGroup:
                return
            raise ArgumentValueError(
                f"name {name!r} already names Ray's backend {held.__qualname__}; pick another"
            )
        backend_registry.register_collective_backend(key, RayGroup)


def register_tensor_transport(name: str = DEFAULT_NAME) -> None:
    """Register this library as Ray Direct Transport ``name`` (and as Ray backend ``name``).

    Afterwards a method declared with ``@ray.method(tensor_transport=name)`` keeps the
    torch tensors (CPU or CUDA) it returns in its actor, and they move straight to
    the actor whose task receives them, through the Ray collective group of backend
    ``name`` that holds both actors (made with
    ``ray.experimental.collective.create_collective_group(actors, backend=name)``):
    shared memory inside a node, Gloo across nodes, NCCL between GPUs. Call it in
    the driver before making the actors: Ray then registers the transport in the
    actors the driver makes. Each actor also needs the backend, as
    ``register_ray_backend`` says. Calling it again with the same name is a no-op.
    Within one node (and one GPU, for CUDA tensors), ``register_shm_transport`` needs
    no group and serves every consumer at once.

    Args:
        name: the transport's name, in any case; Ray keys it in upper case.

    Raises:
        TypeError: ``name`` is no str.
        ValueError: ``name`` is empty, or names one of Ray's transports or another one.

    """
    key = check_name(name)
    from collective.ray_plugins.transport import CollectiveTransport

    _check_free(key, name)
    register_ray_backend(key)
    _register(key, name, CollectiveTransport, ["cpu", "cuda"])


def register_shm_transport(name: str = SHM_NAME) -> None:
    """Register this library's one-sided shared-memory transport as Ray Direct Transport ``name``.

    Afterwards a method declared with ``@ray.method(tensor_transport=name)`` (or a
    ``ray.put(..., _tensor_transport=name)``) writes the CPU torch tensors it returns
    once into shared memory when it returns, and every consumer on the same node maps
    them: Ray runs no task on the producer, so all consumers read at once, and no
    collective group is needed. A consumer on another node runs a task on the
    producer's node that reads them there and returns their bytes through Ray's object
    store. CUDA tensors (all of an object's on one GPU) are copied once into one
    device buffer, which every consumer on that GPU reads through CUDA IPC; a consumer
    on another GPU or node raises: use ``register_tensor_transport`` there.
    ``ray.get`` of the reference in the driver works too. Call it in the driver before
    making the actors; Ray registers the transport in the actors the driver makes.
    Calling it again with the same name is a no-op.

    Args:
        name: the transport's name, in any case; Ray keys it in upper case.

    Raises:
        TypeError: ``name`` is no str.
        ValueError: ``name`` is empty, or names one of Ray's transports or another one.

    """
    key = check_name(name)
    from collective.ray_plugins.shm_transport import ShmTransport

    _check_free(key, name)
    _register(key, name, ShmTransport, ["cpu", "cuda"])


def _check_free(key: str, name: str) -> None:
    """Refuse ``name`` when it is one of Ray's own transports."""
    from ray.experimental.rdt import util

    if key in util.DEFAULT_TRANSPORTS:
        raise ArgumentValueError(f"name {name!r} names one of Ray's own transports; pick another")


def _register(key: str, name: str, cls: type, devices: list[str]) -> None:
    """Register transport class ``cls`` under ``key`` unless it holds ``cls`` already."""
    import torch
    from ray.experimental import register_tensor_transport as ray_register
    from ray.experimental.rdt import util

    with _lock:
        held = util.transport_manager_info.get(key)
        if held is not None:
            if held.transport_manager_class is cls:
                return
            raise ArgumentValueError(
                f"name {name!r} already names the transport "
                f"{held.transport_manager_class.__qualname__}; pick another"
            )
        ray_register(key, devices, cls, torch.Tensor)
