"""The backend registry: backend names to ``BaseGroup`` classes, shared with every actor.

The built-in backends are registered at import. A class registered with
``register_collective_backend`` in the driver is also published, pickled, in the
Ray cluster's key-value store, so every actor finds it by name on first use
without registering it itself.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Protocol, cast

from collective.groups.base import BaseGroup
from collective.groups.cpu.group import CpuGroup
from collective.groups.gloo.group import GlooGroup
from collective.groups.gpu.connect import connect_gpu_group
from collective.groups.nccl.group import NCCLGroup
from collective.rendezvous.store import RendezvousStore
from collective.types import (
    ArgumentTypeError,
    ArgumentValueError,
    Backend,
    CollectiveError,
    GroupOptions,
)


class GroupConstructor(Protocol):
    """The constructor every backend class has, as ``BaseGroup`` describes it."""

    def __call__(
        self,
        world_size: int,
        rank: int,
        group_name: str,
        store: RendezvousStore,
        timeout: timedelta,
        host: str,
        *,
        options: GroupOptions | None = None,
    ) -> BaseGroup:
        """Connect this rank to the others through ``store``; block until all have arrived."""
        ...


def constructor(cls: type[BaseGroup]) -> GroupConstructor:
    """Return backend class ``cls`` typed as the constructor every backend has.

    ``BaseGroup.__init__`` takes neither store nor host: each backend connects its
    ranks in an ``__init__`` of its own, of the signature of ``GroupConstructor``.
    The registry checks that the built-in backends keep it; a registered class is
    trusted to.
    """
    return cast(GroupConstructor, cls)


_KV_NAMESPACE = "collective.backends"
"""The Ray key-value namespace under which registered classes are published."""

_lock = threading.Lock()
_classes: dict[str, type[BaseGroup]] = {
    Backend.GLOO.value: CpuGroup,
    Backend.NCCL.value: NCCLGroup,
}
_BUILT_IN = frozenset(_classes)
_BUILT_IN_CONSTRUCTORS: tuple[GroupConstructor, ...] = (
    CpuGroup,
    GlooGroup,
    NCCLGroup,
    connect_gpu_group,
)
"""The built-in constructors, so that mypy checks they keep the contract."""

_PICKERS: dict[str, GroupConstructor] = {Backend.NCCL.value: connect_gpu_group}
"""The built-in backends whose groups are built by a function that picks the class at init
(a GPU group: NCCL, or device memory among ranks that share a GPU)."""


def builder(name: str) -> GroupConstructor:
    """Return what builds a group of backend ``name``: its picker, else its class."""
    return _PICKERS.get(name) or constructor(group_class(name, here=False))


def rebuilder(group: BaseGroup) -> GroupConstructor:
    """Return what builds a new incarnation or a subgroup of ``group``, for its backend.

    A GPU group picks its transport again, as its ranks may sit elsewhere; any other
    group is rebuilt with its own class.
    """
    picker = _PICKERS.get(type(group).backend_name())
    return picker or constructor(type(group))


def backend_name(backend: Any) -> str:
    """Normalise ``backend`` (a ``Backend``, a built-in name in any case, or a registered name).

    Raises:
        TypeError: ``backend`` is neither a ``Backend`` nor a string.
        ValueError: ``backend`` names no built-in and no registered backend.

    """
    if isinstance(backend, str) and not isinstance(backend, Backend):
        name = backend.lower()
        if name in _classes or _fetch(name) is not None:
            return name
    return Backend.parse(backend).value


def group_class(name: str, here: bool = True) -> type[BaseGroup]:
    """Return the class of backend ``name``; with ``here``, check it can run in this process.

    A driver without a GPU may declare NCCL groups for its actors, so declaring
    passes ``here=False``.

    Raises:
        CollectiveError: no such backend, or it is unavailable here, saying what to install.

    """
    cls = _classes.get(name) or _fetch(name)
    if cls is None:
        raise CollectiveError(f"no backend named {name!r} is registered")
    if here and not cls.check_backend_availability():
        raise CollectiveError(cls.unavailable_reason())
    return cls


def is_available(name: str) -> bool:
    """Return whether groups of backend ``name`` can be built in this process."""
    cls = _classes.get(name) or _fetch(name)
    return cls is not None and cls.check_backend_availability()


def register_collective_backend(name: str, group_cls: type[BaseGroup]) -> None:
    """Register ``group_cls`` as the backend called ``name``, here and for every actor.

    Call it once in the driver: actors find the class by name when they build a
    group, without registering it themselves. ``group_cls`` is built as
    ``group_cls(world_size, rank, group_name, store, timeout, host, options=options)``.

    Raises:
        TypeError: ``name`` is no string or ``group_cls`` no ``BaseGroup`` subclass.
        ValueError: ``name`` is empty or a built-in backend's name.

    """
    if not isinstance(name, str):
        raise ArgumentTypeError(f"name must be a str, got {type(name).__name__}")
    if not isinstance(group_cls, type) or not issubclass(group_cls, BaseGroup):
        got = group_cls.__name__ if isinstance(group_cls, type) else type(group_cls).__name__
        raise ArgumentTypeError(f"group_cls must be a subclass of collective.BaseGroup, got {got}")
    key = name.lower()
    if not key:
        raise ArgumentValueError("name must be a non-empty string")
    if key in _BUILT_IN:
        raise ArgumentValueError(f"name must not be a built-in backend's name, got {name!r}")
    with _lock:
        _classes[key] = group_cls
    kv = _ray_kv()
    if kv is not None:
        import ray.cloudpickle as pickle

        kv._internal_kv_put(key, pickle.dumps(group_cls), overwrite=True, namespace=_KV_NAMESPACE)


def _ray_kv() -> Any:
    """Return Ray's internal key-value module when this process is connected to Ray."""
    try:
        import ray
        from ray.experimental import internal_kv
    except ImportError:
        return None
    return internal_kv if ray.is_initialized() else None


def _fetch(name: str) -> type[BaseGroup] | None:
    """Return the class the driver published as backend ``name``, or None."""
    kv = _ray_kv()
    if kv is None or name in _BUILT_IN:
        return None
    blob = kv._internal_kv_get(name, namespace=_KV_NAMESPACE)
    if blob is None:
        return None
    import ray.cloudpickle as pickle

    cls = pickle.loads(blob)
    with _lock:
        _classes.setdefault(name, cls)
    return cls
