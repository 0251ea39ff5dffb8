"""Which transport a GPU group runs, decided at init from where its ranks' GPUs are.

Every rank publishes its node and its GPU's UUID; from the same list, every rank picks:

- every rank on a GPU of its own (or a group of one): ``NCCLGroup``, as always;
- every rank on one GPU: ``SharedGpuGroup``, device memory that every rank maps
  through CUDA IPC, with no NCCL at all (NCCL refuses two ranks of one
  communicator on one GPU);
- several GPUs with several ranks on some: ``GpuHierarchyGroup``, the shared-GPU
  transport inside each GPU and NCCL among one leader per GPU (``hierarchy``).

The last two run the ``*_multigpu`` calls of ranks that drive several GPUs through
groups of one rank per tensor, built the same way (``multigpu``).

``COLLECTIVE_GPU_TRANSPORT=nccl`` skips the exchange and builds ``NCCLGroup``
whatever the layout (for comparison; ranks that share a GPU then need a
``NCCL_HOSTID`` each, and move bytes through NCCL's sockets).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any

from collective.frameworks import cuda_buffers
from collective.groups import topology
from collective.groups.base import BaseGroup
from collective.groups.gpu.hierarchy import GpuHierarchyGroup
from collective.groups.gpu.multigpu import Gpus, SeveralGpus
from collective.groups.gpu.routed import shared_gpu_group
from collective.groups.gpu.stages import DEVICE_ARRAYS, Arrays, MakeStages, Stages
from collective.groups.nccl.comm import cupy_module
from collective.groups.nccl.group import NCCLGroup
from collective.groups.shared_gpu.device import CudaDevice, Device
from collective.groups.shared_gpu.running import Buffers, SharedGpuRunning
from collective.rendezvous.store import RendezvousStore
from collective.types import DEFAULT_TIMEOUT, CollectiveError, CollectiveTimeoutError, GroupOptions

TRANSPORT_ENV = "COLLECTIVE_GPU_TRANSPORT"
"""``auto`` (the default): pick from the ranks' GPUs; ``nccl``: NCCL whatever they are."""

_CHOICES = ("auto", "nccl")


def wished() -> str:
    """Return the transport ``COLLECTIVE_GPU_TRANSPORT`` asks for.

    Raises:
        CollectiveError: the variable holds something else than ``auto`` or ``nccl``.

    """
    value = os.environ.get(TRANSPORT_ENV, "auto").strip().lower() or "auto"
    if value not in _CHOICES:
        raise CollectiveError(f"{TRANSPORT_ENV} must be one of {list(_CHOICES)}, got {value!r}")
    return value


def choose(places: list[list[str]]) -> str:
    """Return "nccl", "shared_gpu" or "hierarchy" for ranks on ``places`` (node and GPU each).

    One rank per GPU: NCCL; every rank on one GPU: the shared-GPU transport; several
    GPUs with several ranks on some: both, composed (``hierarchy``).
    """
    keys = [tuple(place) for place in places]
    distinct = set(keys)
    if len(distinct) == len(keys):
        return "nccl"
    if len(distinct) == 1:
        return "shared_gpu"
    return "hierarchy"


def current_stream(x: Any) -> int:
    """Return the caller's current stream on ``x``'s device (None: on the current device)."""
    if x is None:
        return cuda_buffers.stream_of(None)[0]
    return cuda_buffers.current_stream(x)


def capturing(x: Any) -> bool:
    """Return whether the caller's current stream on ``x``'s device captures a CUDA graph.

    For None, the current device's current stream: torch's where torch is imported.
    """
    if x is not None:
        return cuda_buffers.capturing(x)
    torch = sys.modules.get("torch")
    if torch is not None:
        return bool(torch.cuda.is_current_stream_capturing())
    return bool(cupy_module().cuda.get_current_stream().is_capturing())


def cuda_gpus(cupy: Any) -> Gpus:
    """Return this process's GPUs through cupy: ``CudaDevice`` on each, made current by cupy."""

    def device(ordinal: int) -> Device:
        with cupy.cuda.Device(ordinal):
            return CudaDevice(cupy)

    return Gpus(device, cupy.cuda.Device)


CUDA_BUFFERS = Buffers(
    cuda_buffers.cuda_buffer,
    current_stream,
    capturing,
    cuda_buffers.contiguous_copy,
)
"""A GPU group's buffers: cupy arrays and CUDA torch tensors on the caller's streams."""


def connect_gpu_group(
    world_size: int,
    rank: int,
    group_name: str,
    store: RendezvousStore,
    timeout: timedelta = DEFAULT_TIMEOUT,
    host: str = "127.0.0.1",
    *,
    options: GroupOptions | None = None,
    device: Device | None = None,
    cupy: Any = None,
    buffers: Buffers = CUDA_BUFFERS,
    make_stages: MakeStages | None = None,
    arrays: Arrays = DEVICE_ARRAYS,
    gpus: Gpus | None = None,
) -> BaseGroup:
    """Connect this rank to the others of a ``backend="nccl"`` group; see the module docstring.

    ``device``, ``cupy``, ``buffers``, ``make_stages`` (the NCCL groups of a group
    across GPUs), ``arrays`` and ``gpus`` (this process's GPUs by ordinal, for the
    ``*_multigpu`` calls) stand in for the CUDA device, cupy, CUDA's buffers, NCCL,
    cupy's arrays and CUDA's devices in tests; by default they are the real ones.
    Without ``gpus`` and ``cupy``, a ``*_multigpu`` list of several tensors raises
    ``ValueError``.

    Raises:
        CollectiveError: cupy, NCCL or a GPU is missing, or ``COLLECTIVE_GPU_TRANSPORT``
            holds an unknown value.
        CollectiveTimeoutError: the ranks did not all arrive within ``timeout``.

    """
    if world_size == 1 or wished() == "nccl":
        return NCCLGroup(world_size, rank, group_name, store, timeout, host, options)
    if device is None:
        cupy = cupy_module()
        device = CudaDevice(cupy)
    place = [topology.node_key(), device.uuid()]
    try:
        places = topology.exchange(store, "gpu/where", rank, world_size, place, timeout)
    except TimeoutError as exc:
        raise CollectiveTimeoutError("init", group_name, rank, timeout, str(exc)) from exc
    picked = choose(places)
    if picked == "nccl":
        return NCCLGroup(world_size, rank, group_name, store, timeout, host, options)
    shared: dict[str, Any] = {"buffers": buffers, "cupy": cupy}

    def nccl_stages(size: int, index: int, name: str, scoped: RendezvousStore) -> Stages:
        return NCCLGroup(size, index, name, scoped, timeout, host, options)

    stages = make_stages or nccl_stages

    def build(
        places: list[list[str]],
        size: int,
        index: int,
        name: str,
        scoped: RendezvousStore,
        on: Device,
    ) -> SharedGpuRunning:
        """Build a group of ``size`` ranks that share GPUs: rank ``index``, on ``on``."""
        common = (size, index, name, scoped, timeout, host, options)
        if choose(places) == "shared_gpu":
            return shared_gpu_group(*common, make_stages=stages, arrays=arrays, device=on, **shared)
        return GpuHierarchyGroup(
            *common, places=places, make_stages=stages, arrays=arrays, device=on, **shared
        )

    def whole(name: str, scoped: RendezvousStore) -> BaseGroup:
        return NCCLGroup(world_size, rank, name, scoped, timeout, host, options)

    group = build(places, world_size, rank, group_name, store, device)
    if gpus is None and cupy is not None:
        gpus = cuda_gpus(cupy)
    if gpus is not None:
        group.lists = SeveralGpus(group, store, place[0], buffers, gpus, whole, build)
    return group
