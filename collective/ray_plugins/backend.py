"""Ray's collective backend registry: ``ray.util.collective`` groups that run on this library.

``register_ray_backend`` registers ``RayGroup``, a subclass of Ray's own ``BaseGroup``,
with ``ray.util.collective``. Ray then builds it for
``init_collective_group(..., backend=name)`` and for groups declared with Ray's
``create_collective_group``, and calls its methods from every op of its API. Each
``RayGroup`` holds one CPU group of this library (shared memory inside a node, Gloo
across nodes) and, when every rank has a GPU, one NCCL group; an op goes to the one
that holds its buffers. Both are ordinary groups of the public API, under names
derived from Ray's.

Ray hands ``gloo_timeout`` to its own ``"GLOO"`` backend only and builds any other as
``backend_cls(world_size, rank, group_name)``, so ``RayGroup`` reads the value from the
frame of Ray's ``GroupManager.create_collective_group`` that builds it (see
``gloo_timeout``).
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from datetime import timedelta
from typing import Any

import numpy as np
from ray.util.collective import backend_registry
from ray.util.collective.collective_group.base_collective_group import (
    BaseGroup as RayBaseGroup,
)

from collective.checks.arguments import check_milliseconds
from collective.frameworks import kinds, streams
from collective.ops import collectives, multigpu
from collective.ray_plugins.names import DEFAULT_NAME
from collective.registry import lifecycle, queries
from collective.types import ArgumentTypeError, ArgumentValueError, CollectiveError, ReduceOp

DEFAULT_TIMEOUT_MS = 30000
"""The timeout of a group whose ``gloo_timeout`` is not known, in ms: Ray's default."""

TIMEOUT_ENV = "collective_gloo_timeout"
"""Ray's environment variable for the ``gloo_timeout`` of groups made with actor options."""

_RAY_CALLER = ("ray.util.collective.collective", "create_collective_group")
"""The module and function in Ray that build a backend's group, holding ``gloo_timeout``."""

_warned = threading.Event()
"""Set once this process has warned that a group's ``gloo_timeout`` cannot be known."""


def gloo_timeout(given: Any, caller: Any) -> timedelta:
    """Return a Ray group's timeout: ``given``, else the ``gloo_timeout`` its builder holds.

    Ray passes ``gloo_timeout`` to its own ``"GLOO"`` backend only; for any other it
    stays a local of the frame that builds the group, ``caller``, when that frame is
    Ray's ``GroupManager.create_collective_group``. When ``caller`` is another frame,
    the value cannot be known: the group takes ``collective_gloo_timeout`` from the
    environment, else 30000 ms, and the process warns once.

    Raises:
        TypeError: the timeout is no number.
        ValueError: the timeout is not a positive number of ms.

    """
    if given is not None:
        return check_milliseconds(given, "gloo_timeout")
    code = getattr(caller, "f_code", None)
    if code is not None and (caller.f_globals.get("__name__"), code.co_name) == _RAY_CALLER:
        found = caller.f_locals.get("gloo_timeout")
        if found is not None:
            return check_milliseconds(found, "gloo_timeout")
        return _from_environment()
    timeout = _from_environment()
    if not _warned.is_set():
        _warned.set()
        warnings.warn(
            "RayGroup was built by something other than Ray's "
            "GroupManager.create_collective_group, so the gloo_timeout given to Ray is "
            f"unknown here; the group's timeout is {timeout.total_seconds():g} s (the "
            f"{TIMEOUT_ENV} environment variable, else {DEFAULT_TIMEOUT_MS} ms). Pass "
            f"gloo_timeout to RayGroup, or set {TIMEOUT_ENV} in the actor's environment.",
            stacklevel=4,
        )
    return timeout


def _from_environment() -> timedelta:
    """Return ``collective_gloo_timeout`` from the environment, else 30000 ms."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return timedelta(milliseconds=DEFAULT_TIMEOUT_MS)
    try:
        value = float(raw)
    except ValueError:
        raise ArgumentValueError(
            f"{TIMEOUT_ENV} must be a positive number of ms, got {raw!r}"
        ) from None
    return check_milliseconds(value, TIMEOUT_ENV)


def cpu_group_name(group_name: str) -> str:
    """Return the name of the CPU group that carries Ray group ``group_name``."""
    return f"ray:{group_name}"


def gpu_group_name(group_name: str) -> str:
    """Return the name of the NCCL group that carries Ray group ``group_name``."""
    return f"ray:{group_name}:cuda"


def _timeout(options: Any) -> timedelta | None:
    """Return the per-call timeout of Ray's ``options``, or None when it is unset (negative)."""
    value = getattr(options, "timeout_ms", None)
    if isinstance(value, timedelta) and value >= timedelta(0):
        return value
    return None


def _op(options: Any) -> ReduceOp:
    """Return our reduction for Ray's ``options.reduceOp`` (a ``ray.util.collective`` ReduceOp)."""
    return ReduceOp[options.reduceOp.name]


def _has_gpu() -> bool:
    """Return whether this process can run an NCCL group: cupy's NCCL and a visible GPU."""
    if not queries.nccl_available():
        return False
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _timeout_of(given: float | None) -> timedelta:
    """Return ``gloo_timeout(given, frame)``, the frame being the caller of ``RayGroup``."""
    return gloo_timeout(given, sys._getframe(2))


class RayGroup(RayBaseGroup):
    """A ``ray.util.collective`` group whose ops run on this library's transports.

    Ray builds it as ``RayGroup(world_size, rank, group_name)`` in each member; the
    constructor returns once every rank has arrived. Buffers on the CPU (numpy arrays
    and torch tensors) go through the CPU group, CUDA buffers through the NCCL group.
    """

    def __init__(
        self, world_size: int, rank: int, group_name: str, gloo_timeout: float | None = None
    ) -> None:
        """Join the CPU group, then the NCCL group if every rank has a GPU.

        Args:
            world_size: the number of ranks in the group.
            rank: this process's rank.
            group_name: the Ray group's name.
            gloo_timeout: the default timeout of the group's waits and ops, in ms. None
                (as Ray passes it) takes the ``gloo_timeout`` given to Ray's
                ``init_collective_group`` or ``create_collective_group`` (see
                ``gloo_timeout``).

        Raises:
            TypeError, ValueError: the timeout is not a positive number of ms.
            CollectiveTimeoutError: not every rank arrived within the timeout.

        """
        timeout = _timeout_of(gloo_timeout)
        super().__init__(world_size, rank, group_name)
        self._cpu = cpu_group_name(group_name)
        self._gpu: str | None = None
        lifecycle.init_collective_group(world_size, rank, "gloo", self._cpu, timeout=timeout)
        try:
            everyone = np.array([1 if _has_gpu() else 0], dtype=np.int32)
            collectives.allreduce(everyone, self._cpu, ReduceOp.MIN)
            if everyone[0]:
                gpu = gpu_group_name(group_name)
                lifecycle.init_collective_group(world_size, rank, "nccl", gpu, timeout=timeout)
                self._gpu = gpu
        except BaseException:
            lifecycle.destroy_collective_group(self._cpu)
            raise

    @property
    def cpu_group(self) -> str:
        """Return the name of this library's CPU group under this Ray group."""
        return self._cpu

    @property
    def gpu_group(self) -> str | None:
        """Return the name of this library's NCCL group, or None when a rank has no GPU."""
        return self._gpu

    def group_for(self, x: Any) -> str:
        """Return the name of the group that moves buffer ``x``: the NCCL one for CUDA buffers.

        Raises:
            ArgumentTypeError: ``x`` is on a GPU but not every rank has one.

        """
        if kinds.is_buffer(x) and streams.on_gpu(x):
            if self._gpu is None:
                raise ArgumentTypeError(
                    f"group {self.group_name!r} moves CPU buffers only, as not every rank "
                    "had a GPU when it was made; got a CUDA buffer"
                )
            return self._gpu
        return self._cpu

    def destroy_group(self) -> None:
        """Leave both groups; pending ops on them end with a ``CollectiveError``."""
        if self._gpu is not None:
            lifecycle.destroy_collective_group(self._gpu)
        lifecycle.destroy_collective_group(self._cpu)

    @classmethod
    def backend(cls) -> str:
        """Return the default name of this backend."""
        return DEFAULT_NAME

    @classmethod
    def check_backend_availability(cls) -> bool:
        """Return whether the CPU transports can run here."""
        return queries.gloo_available()

    def allreduce(self, tensors: list[Any], allreduce_options: Any = None) -> None:
        """Reduce in place on every rank (``allreduce`` and ``allreduce_multigpu``)."""
        options = allreduce_options
        name, op, timeout = self.group_for(tensors[0]), _op(options), _timeout(options)
        if len(tensors) == 1:
            collectives.allreduce(tensors[0], name, op, timeout=timeout)
        else:
            multigpu.allreduce_multigpu(tensors, name, op, timeout=timeout)

    def barrier(self, barrier_options: Any = None) -> None:
        """Block until every rank has entered the barrier."""
        collectives.barrier(self._cpu, timeout=_timeout(barrier_options))

    def reduce(self, tensors: list[Any], reduce_options: Any = None) -> None:
        """Reduce onto ``root_rank``; only the root's buffer is written."""
        options = reduce_options
        name, op, timeout = self.group_for(tensors[0]), _op(options), _timeout(options)
        if len(tensors) == 1:
            collectives.reduce(tensors[0], options.root_rank, name, op, timeout=timeout)
        else:
            multigpu.reduce_multigpu(
                tensors, options.root_rank, options.root_tensor, name, op, timeout=timeout
            )

    def broadcast(self, tensors: list[Any], broadcast_options: Any = None) -> None:
        """Copy ``root_rank``'s buffer into every other rank's, in place."""
        options = broadcast_options
        name, timeout = self.group_for(tensors[0]), _timeout(options)
        if len(tensors) == 1:
            collectives.broadcast(tensors[0], options.root_rank, name, timeout=timeout)
        else:
            multigpu.broadcast_multigpu(
                tensors, options.root_rank, options.root_tensor, name, timeout=timeout
            )

    def allgather(
        self, tensor_lists: list[list[Any]], tensors: list[Any], allgather_options: Any = None
    ) -> None:
        """Gather every rank's tensor into each rank's list, in place."""
        name, timeout = self.group_for(tensors[0]), _timeout(allgather_options)
        if len(tensors) == 1:
            collectives.allgather(tensor_lists[0], tensors[0], name, timeout=timeout)
        else:
            multigpu.allgather_multigpu(tensor_lists, tensors, name, timeout=timeout)

    def reducescatter(
        self, tensors: list[Any], tensor_lists: list[list[Any]], reducescatter_options: Any = None
    ) -> None:
        """Reduce the lists elementwise; rank i's tensor receives the i-th result."""
        options = reducescatter_options
        name, op, timeout = self.group_for(tensors[0]), _op(options), _timeout(options)
        if len(tensors) == 1:
            collectives.reducescatter(tensors[0], tensor_lists[0], name, op, timeout=timeout)
        else:
            multigpu.reducescatter_multigpu(tensors, tensor_lists, name, op, timeout=timeout)

    def send(self, tensors: list[Any], send_options: Any) -> None:
        """Send the tensor to ``dst_rank`` (with ``send_multigpu``'s GPU index and length)."""
        options, x = send_options, tensors[0]
        name, timeout = self.group_for(x), _timeout(options)
        if name == self._cpu:
            collectives.send(x, options.dst_rank, name, timeout=timeout)
        else:
            multigpu.send_multigpu(
                x, options.dst_rank, options.dst_gpu_index, name, options.n_elements,
                timeout=timeout,
            )  # fmt: skip

    def recv(self, tensors: list[Any], recv_options: Any) -> None:
        """Receive from ``src_rank`` into the tensor, in place."""
        options, x = recv_options, tensors[0]
        name, timeout = self.group_for(x), _timeout(options)
        if name == self._cpu:
            collectives.recv(x, options.src_rank, name, timeout=timeout)
        else:
            multigpu.recv_multigpu(
                x, options.src_rank, options.src_gpu_index, name, options.n_elements,
                timeout=timeout,
            )  # fmt: skip


def ray_group(group_name: str) -> RayGroup:
    """Return this process's ``ray.util.collective`` group ``group_name`` if it is a ``RayGroup``.

    Raises:
        CollectiveError: there is no such group here, or it is of another backend.

    """
    import ray.util.collective as ray_collective

    if not ray_collective.is_group_initialized(group_name):
        raise CollectiveError(f"Ray collective group {group_name!r} is not initialized here")
    group = ray_collective.get_group_handle(group_name)
    if not isinstance(group, RayGroup):
        raise CollectiveError(
            f"Ray collective group {group_name!r} is of backend {type(group).__name__}, "
            "not one registered with register_ray_backend"
        )
    return group


def is_ours(backend: Any) -> bool:
    """Return whether Ray backend name ``backend`` is registered to ``RayGroup`` in this process."""
    registry = backend_registry._global_registry
    key = str(backend).upper()
    return registry.is_registered(key) and registry.get(key) is RayGroup
