"""Recognise numpy arrays, torch tensors and cupy arrays; the only module that knows them."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

DTYPES = frozenset(
    {"float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool"}
)
"""Every dtype name any backend may accept; each backend narrows this set."""


@dataclass(frozen=True)
class TensorSpec:
    """What a collective needs to know about a buffer to check it against others."""

    kind: str
    shape: tuple[int, ...]
    dtype: str
    device: str

    def describe(self) -> str:
        """Return a short human-readable form, e.g. ``float32[4, 2] on cpu``."""
        dims = ", ".join(str(d) for d in self.shape)
        return f"{self.dtype}[{dims}] on {self.device}"


def _is_torch(x: Any) -> bool:
    """Return whether ``x`` is a torch tensor, without importing torch for the answer.

    A buffer can only be a torch tensor once torch is loaded, so processes that never
    touch torch (a group's store actor) never pay for importing it.
    """
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _is_cupy(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "cupy" and hasattr(x, "__cuda_array_interface__")


def spec(x: Any, name: str) -> TensorSpec:
    """Describe ``x``, or reject it if it is no supported buffer.

    Args:
        x: a numpy array, torch tensor or cupy array.
        name: the argument's name, used in the error message.

    Raises:
        TypeError: ``x`` is of another type, or of a dtype no backend supports.

    """
    if isinstance(x, np.ndarray):
        kind, shape, dtype, device = "numpy", x.shape, x.dtype.name, "cpu"
        if not x.dtype.isnative:
            raise TypeError(f"{name} must have native byte order, got {x.dtype.str}")
    elif _is_torch(x):
        kind, shape, device = "torch", tuple(x.shape), str(x.device)
        dtype = str(x.dtype).removeprefix("torch.")
    elif _is_cupy(x):
        kind, shape, dtype = "cupy", tuple(x.shape), x.dtype.name
        device = f"cuda:{x.device.id}"
    else:
        raise TypeError(
            f"{name} must be a numpy.ndarray, torch.Tensor or cupy.ndarray, "
            f"got {type(x).__module__}.{type(x).__qualname__}"
        )
    if dtype not in DTYPES:
        raise TypeError(f"{name} has unsupported dtype {dtype}; supported: {sorted(DTYPES)}")
    return TensorSpec(kind, tuple(int(d) for d in shape), dtype, device)


def int64_array(values: list[int]) -> Any:
    """Return a new int64 numpy array holding ``values``, for small control messages."""
    return np.array(values, dtype=np.int64)


def _layout(x: Any) -> tuple[int, int, list[tuple[int, int]]]:
    """Return ``x``'s start address, item size and ``(size, byte_stride)`` per dimension."""
    if _is_torch(x):
        start, itemsize = x.data_ptr(), x.element_size()
        strides = [s * itemsize for s in x.stride()]
    else:
        interface = (
            "__array_interface__" if isinstance(x, np.ndarray) else "__cuda_array_interface__"
        )
        start, itemsize = getattr(x, interface)["data"][0], x.dtype.itemsize
        strides = list(x.strides)
    return start, itemsize, list(zip((int(d) for d in x.shape), strides, strict=True))


def memory_span(x: Any) -> tuple[int, int]:
    """Return ``(first_byte_address, one_past_last_byte_address)`` of ``x``'s elements."""
    start, itemsize, dims = _layout(x)
    if any(size == 0 for size, _ in dims):
        return start, start
    low = sum(stride * (size - 1) for size, stride in dims if stride < 0)
    high = sum(stride * (size - 1) for size, stride in dims if stride > 0)
    return start + low, start + high + itemsize


def overlaps(a: Any, b: Any) -> bool:
    """Return whether the memory spans of ``a`` and ``b`` intersect."""
    a_start, a_end = memory_span(a)
    b_start, b_end = memory_span(b)
    return a_start < b_end and b_start < a_end and a_start != a_end and b_start != b_end


def _self_overlapping(x: Any) -> bool:
    """Return whether two elements of ``x`` may share memory.

    Dimensions sorted by stride must each step past everything the smaller ones
    span; a layout that does not (a stride of 0, ``as_strided`` tricks) counts as
    overlapping, which errs on the side of refusing to write.
    """
    _, itemsize, dims = _layout(x)
    if any(size == 0 for size, _ in dims):
        return False
    reach = itemsize
    for size, stride in sorted((d for d in dims if d[0] > 1), key=lambda d: abs(d[1])):
        if abs(stride) < reach:
            return True
        reach += abs(stride) * (size - 1)
    return False


class CpuBuffer:
    """A contiguous CPU torch tensor standing for a user buffer during one op.

    The tensor shares memory with the user's buffer when that buffer is contiguous
    and writable. Otherwise it is a staged copy, and ``commit`` copies the result
    back into the user's buffer.
    """

    def __init__(self, source: Any, name: str, writable: bool) -> None:
        """Wrap ``source`` (a CPU numpy array or torch tensor) for one op.

        Raises:
            ValueError: ``source`` must be written but is read-only or overlaps itself.

        """
        self._source = source
        is_numpy = isinstance(source, np.ndarray)
        if is_numpy:
            shares = source.flags.c_contiguous and source.flags.writeable
        else:
            shares = source.is_contiguous()
        self._staged = writable and not shares
        if self._staged and _self_overlapping(source):
            raise ValueError(
                f"{name} has overlapping memory (a stride of 0, as from expand or "
                "broadcast_to); pass a contiguous copy"
            )
        if is_numpy:
            if writable and not source.flags.writeable:
                raise ValueError(f"{name} is a read-only array but the op writes into it")
            import torch

            array = source if shares else np.array(source, order="C", copy=True)
            self.tensor = torch.from_numpy(array)
        else:
            self.tensor = source if shares else source.contiguous()

    def commit(self) -> None:
        """Copy the result into the user's buffer if it was staged; otherwise do nothing."""
        if not self._staged:
            return
        if isinstance(self._source, np.ndarray):
            np.copyto(self._source, self.tensor.numpy())
        else:
            self._source.copy_(self.tensor)
