"""CUDA buffers as the nccl backend moves them: address, count, dtype, device and stream."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from collective._version import DISTRIBUTION
from collective.frameworks.kinds import contiguous_message, is_cupy, is_torch, spec
from collective.frameworks.values import not_values, refused
from collective.types import ArgumentTypeError, ArgumentValueError, CollectiveError

CUPY_INSTALL_HINT = (
    f'pip install cupy-cuda12x (for CUDA 13: cupy-cuda13x); "{DISTRIBUTION}[nccl]" has it'
)
"""What to install when cupy is missing: the package itself, and the extra that has it."""

NCCL_DTYPES: dict[str, int] = {
    "int8": 0,
    "uint8": 1,
    "int32": 2,
    "int64": 4,
    "float16": 6,
    "float32": 7,
    "float64": 8,
    "bfloat16": 9,
}
"""NCCL's ``ncclDataType_t`` value of each dtype name the nccl backend moves (nccl.h)."""


@dataclass(frozen=True)
class CudaBuffer:
    """A contiguous GPU buffer as NCCL sees it: address, element count, dtype and device."""

    ptr: int
    count: int
    dtype: str
    device: int
    itemsize: int

    @property
    def nccl_dtype(self) -> int:
        """Return NCCL's ``ncclDataType_t`` value of the buffer's dtype."""
        return NCCL_DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        """Return the buffer's size in bytes."""
        return self.count * self.itemsize


def _c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...] | None, itemsize: int) -> bool:
    if strides is None:
        return True
    expected = itemsize
    for size, stride in zip(reversed(shape), reversed(strides), strict=True):
        if size > 1 and stride != expected:
            return False
        expected *= size
    return True


def cuda_buffer(x: Any, name: str) -> CudaBuffer:
    """Describe ``x``, a cupy array or CUDA torch tensor, for an NCCL call.

    Raises:
        ArgumentTypeError: ``x`` is no GPU buffer, a torch tensor whose memory does not
            hold its values (``values.not_values``), or of a dtype NCCL does not move.
        ArgumentValueError: ``x`` is not contiguous.

    """
    if is_torch(x) and x.is_cuda:
        why = not_values(x)
        if why:
            raise refused(name, why)
        dtype = str(x.dtype).removeprefix("torch.")
        contiguous = x.is_contiguous() and not x.is_neg()
        ptr, count, device, itemsize = x.data_ptr(), x.numel(), x.get_device(), x.element_size()
    elif is_cupy(x):
        interface = x.__cuda_array_interface__
        dtype, shape, itemsize = x.dtype.name, tuple(interface["shape"]), x.dtype.itemsize
        contiguous = _c_contiguous(shape, interface.get("strides"), itemsize)
        ptr, device = interface["data"][0], x.device.id
        count = int(np.prod(shape, dtype=np.int64))
    else:
        found = spec(x, name).device if isinstance(x, np.ndarray) or is_torch(x) else None
        where = f"a buffer on {found}" if found else f"a {type(x).__qualname__}"
        raise ArgumentTypeError(f"{name} must be a cupy array or a CUDA torch tensor, got {where}")
    if dtype not in NCCL_DTYPES:
        raise ArgumentTypeError(
            f"{name} has dtype {dtype}, which NCCL does not move; supported: {sorted(NCCL_DTYPES)}"
        )
    if not contiguous:
        raise ArgumentValueError(contiguous_message(x, name, "for NCCL"))
    return CudaBuffer(int(ptr), count, dtype, int(device), int(itemsize))


def contiguous_copy(x: Any) -> tuple[Any, Callable[[], None]]:
    """Return a contiguous copy of GPU buffer ``x`` and a function that writes it back into ``x``.

    Both copies run on the caller's current stream. A torch tensor with its negative
    bit set is copied resolved, and written back through torch, which negates.
    """
    if is_torch(x):
        copy = x.resolve_neg().contiguous()
    else:
        import cupy

        copy = cupy.ascontiguousarray(x)

    def back() -> None:
        if is_torch(x):
            x.copy_(copy)
        else:
            x[...] = copy

    return copy, back


def current_stream(x: Any) -> int:
    """Return the handle of the caller's current CUDA stream on GPU buffer ``x``'s device.

    That is torch's current stream for a torch tensor and cupy's for a cupy array.
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return torch_stream(x.get_device())
    return cupy_stream(x.device.id)


def torch_stream(device: int) -> int:
    """Return the handle of torch's current CUDA stream on GPU ``device``: one C call."""
    return sys.modules["torch"]._C._cuda_getCurrentRawStream(device)


def cupy_stream(device: int) -> int:
    """Return the handle of cupy's current CUDA stream on GPU ``device``: one C call."""
    cupy = sys.modules.get("cupy") or importlib.import_module("cupy")
    return cupy.cuda.get_current_stream(device).ptr


def stream_of(stream: Any) -> tuple[int, int]:
    """Return ``(handle, device)`` of a CUDA stream given as a user names it.

    ``stream`` is a ``torch.cuda.Stream``, a cupy stream, a raw handle (an int, on the
    current device), or None: torch's current stream on the current device (cupy's
    where torch is not imported).

    Raises:
        ArgumentTypeError: ``stream`` is none of these.

    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(stream, torch.cuda.Stream):
        return int(stream.cuda_stream), int(stream.device.index)
    cupy = sys.modules.get("cupy") or importlib.import_module("cupy")
    is_cupy_stream = isinstance(stream, cupy.cuda.stream._BaseStream)
    if is_cupy_stream and stream.device_id >= 0:
        return int(stream.ptr), int(stream.device_id)
    is_handle = isinstance(stream, int) and not isinstance(stream, bool) and stream >= 0
    if not (stream is None or is_handle or is_cupy_stream):
        raise ArgumentTypeError(
            "stream must be a torch.cuda.Stream, a cupy stream, a stream handle (an int) or "
            f"None, got {type(stream).__name__}"
        )
    if stream is None and torch is not None:
        device = torch.cuda.current_device()
        return torch_stream(device), device
    current = int(cupy.cuda.runtime.getDevice())
    if stream is None:
        return cupy_stream(current), current
    return (int(stream.ptr) if is_cupy_stream else stream), current


def capturing(x: Any) -> bool:
    """Return whether the caller's current stream on GPU buffer ``x``'s device captures a graph.

    torch's current stream for a torch tensor, cupy's for a cupy array. Work queued
    while it captures is recorded into the graph, not run: nothing may wait for it.
    """
    if is_torch(x):
        import torch

        return bool(torch.cuda.is_current_stream_capturing())
    import cupy

    return bool(cupy.cuda.get_current_stream(x.device.id).is_capturing())


def launch_key(x: Any) -> tuple[Any, ...] | None:
    """Return what a launch on GPU buffer ``x`` depends on, hashable; None: do not cache.

    The address, dtype, shape, strides and device of ``x``, then the caller's current
    stream on that device (``torch_stream`` or ``cupy_stream``), read with one kind
    check: a repeated call pays a few attribute reads and one C call for the stream.
    None for a buffer on no GPU, a torch tensor that requires grad or has its negative
    bit set (checked on every call, and refused), or anything else
    than a cupy array or a torch tensor.
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        device = x.get_device()
        if x.requires_grad or device < 0 or x.is_neg():
            return None
        return (x.data_ptr(), x.dtype, x.shape, x.stride(), device, torch_stream(device))
    try:
        data = x.data
        device = data.device_id
        key = (data.ptr, x.dtype, x.shape, x.strides, device)
    except AttributeError:
        return None
    return (*key, cupy_stream(device))


_TORCH_STREAMS: dict[tuple[int, int], Any] = {}
"""torch's wrapper of each stream handle ``record_stream`` has seen, by (handle, device)."""


def record_stream(x: Any, stream: int) -> None:
    """Tell torch's caching allocator that ``stream`` uses ``x``, so it is not reused early.

    torch records an event on ``stream`` when the block of ``x`` is freed, which may
    be at any later time, so ``stream`` must never be destroyed (the nccl backend's
    comm streams never are). That is also why torch's wrapper of each handle is made
    once and kept. Cupy arrays need no record: the group holds a reference to them
    until the work on ``stream`` has finished.
    """
    if is_torch(x):
        key = (stream, x.device.index)
        wrapper = _TORCH_STREAMS.get(key)
        if wrapper is None:
            import torch

            wrapper = torch.cuda.ExternalStream(stream, device=x.device)
            wrapper = _TORCH_STREAMS.setdefault(key, wrapper)
        x.record_stream(wrapper)


def record_streams(xs: Sequence[Any], devices: Sequence[int], streams: Sequence[int]) -> None:
    """``record_stream`` each torch tensor of ``xs`` on the stream of its device.

    ``streams[i]`` is the stream of GPU ``devices[i]``; other buffers than torch
    tensors are left alone.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return
    for x in xs:
        if isinstance(x, torch.Tensor):
            stream = streams[0] if len(streams) == 1 else streams[devices.index(x.get_device())]
            record_stream(x, stream)


def synchronize_device(gpu_id: int) -> None:
    """Block until all work queued on GPU ``gpu_id`` has finished.

    Raises:
        CollectiveError: neither cupy nor torch with CUDA is installed, or CUDA fails.

    """
    try:
        import cupy
    except ImportError:
        cupy = None
    if cupy is not None:
        try:
            cupy.cuda.Device(gpu_id).synchronize()
        except cupy.cuda.runtime.CUDARuntimeError as exc:
            raise CollectiveError(
                f"synchronize({gpu_id}) failed: {exc}; it needs a CUDA GPU in this process "
                f"(give the actor num_gpus=1) and cupy: {CUPY_INSTALL_HINT}"
            ) from exc
        return
    try:
        import torch
    except ImportError as exc:
        raise CollectiveError(f"synchronize needs cupy: {CUPY_INSTALL_HINT}") from exc
    if not torch.cuda.is_available():
        raise CollectiveError(f"synchronize needs cupy: {CUPY_INSTALL_HINT}")
    torch.cuda.synchronize(gpu_id)
