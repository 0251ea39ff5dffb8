"""One object's CUDA tensors in one device buffer: its metadata, its layout, the copies in and out.

The buffer holds every tensor of the object, each at a multiple of ``ALIGN`` bytes, small
ones back to back, so an object of 2,000 tensors is one ``cudaMalloc``, one IPC handle
and, on a consumer without buffers of its own, one copy. ``CudaIpcMetadata`` is what Ray
publishes of it. Every copy is a ``Device.copy`` (``cudaMemcpyAsync``) on the stream the
caller gives; the tensors handed out are views of one new ``uint8`` buffer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ray.experimental.rdt.tensor_transport_manager import TensorTransportMetadata

from collective.ray_plugins import segment
from collective.ray_plugins.cuda_gpus import Gpus, IpcDevice
from collective.types import ArgumentValueError

ALIGN = 256
"""Tensors start at multiples of this many bytes in the buffer, so every dtype can view them."""


@dataclass
class CudaIpcMetadata(TensorTransportMetadata):
    """Ray's metadata of an object in a producer's device buffer: its IPC handles, and whose.

    ``memory`` and ``event`` are the buffer's and the event's IPC handles (empty when
    the object holds no byte); ``gpu`` the GPU's UUID; ``offsets`` each tensor's place
    in the buffer; ``started`` the producer's start time, which tells it from a later
    process that reuses its pid.
    """

    obj_id: str = ""
    memory: bytes = b""
    event: bytes = b""
    gpu: str = ""
    node_id: str = ""
    pid: int = 0
    started: int = 0
    size: int = 0
    offsets: list[int] = field(default_factory=list)


def layout(metas: Sequence[tuple[Any, Any]]) -> tuple[list[int], int]:
    """Return each tensor's byte offset (a multiple of ``ALIGN``) and the buffer's size."""
    offsets, end = [], 0
    for shape, dtype in metas:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + math.prod(shape) * dtype.itemsize
    return offsets, end


def pack(device: IpcDevice, tensor: Any, target: int, stream: int) -> Any:
    """Copy ``tensor``'s bytes to device address ``target`` on ``stream``.

    Returns:
        The tensor copied from: ``tensor``, or its contiguous copy when it has strides,
        or a conjugate or negative bit (made on the current stream, so its memory is
        reused only by later work of that stream); None when it holds no byte.

    """
    n = tensor.numel() * tensor.element_size()
    if n == 0:
        return None
    if not tensor.is_contiguous() or tensor.is_conj() or tensor.is_neg():
        tensor = tensor.detach().resolve_conj().resolve_neg().contiguous()
    device.copy(target, tensor.data_ptr(), n, stream)
    return tensor


def copy_out(
    meta: CudaIpcMetadata, device: IpcDevice, source: int, stream: int,
    targets: list[Any] | None, gpus: Gpus,
) -> list[Any]:  # fmt: skip
    """Enqueue on ``stream`` the copies of ``meta``'s object, mapped at ``source``.

    Returns:
        ``targets``, once the copies complete; or, without targets, views of one new
        buffer on ``device``'s GPU that one copy fills.

    """
    if targets is not None:
        for (shape, dtype), place, target in zip(
            meta.tensor_meta, meta.offsets, targets, strict=True
        ):
            n = math.prod(shape) * dtype.itemsize
            if n:
                device.copy(target.data_ptr(), source + place, n, stream)
        return targets
    base = gpus.empty(meta.size, device)
    device.copy(base.data_ptr(), source, meta.size, stream)
    return views(meta, base)


def views(meta: CudaIpcMetadata, base: Any) -> list[Any]:
    """Return ``meta``'s tensors as views of ``base``, a flat ``uint8`` tensor laid out alike."""
    out = []
    for (shape, dtype), place in zip(meta.tensor_meta, meta.offsets, strict=True):
        n = math.prod(shape) * dtype.itemsize
        out.append(base[place : place + n].view(dtype).view(shape))
    return out


def check_targets(meta: CudaIpcMetadata, targets: list[Any]) -> None:
    """Check that ``targets`` can take the object's tensors, one each, contiguous.

    Raises:
        ValueError: a count or a size differs, or a target is not contiguous.

    """
    if len(targets) != len(meta.tensor_meta):
        raise ArgumentValueError(
            f"expecting {len(meta.tensor_meta)} buffers for object {meta.obj_id}, "
            f"got {len(targets)}"
        )
    for i, ((shape, dtype), target) in enumerate(zip(meta.tensor_meta, targets, strict=True)):
        want = math.prod(shape) * dtype.itemsize
        got = target.numel() * target.element_size()
        if got != want or not target.is_contiguous():
            raise ArgumentValueError(
                f"buffer {i} for object {meta.obj_id} must be contiguous with {want} bytes, "
                f"got {got} bytes{'' if target.is_contiguous() else ', not contiguous'}"
            )


def gone(meta: CudaIpcMetadata) -> str:
    """Return why ``meta``'s object cannot be read: its producer died, or freed it."""
    if segment.alive(meta.pid, meta.started):
        return (
            f"object {meta.obj_id} was freed: its producer (pid {meta.pid}) freed its GPU "
            "buffer when Ray garbage-collected it"
        )
    return f"the producer of object {meta.obj_id} (pid {meta.pid}) died; its tensors are lost"
