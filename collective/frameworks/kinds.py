"""Tell numpy arrays, torch tensors and cupy arrays apart; describe and cut them."""

from __future__ import annotations

import itertools
import math
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from collective.frameworks.dtypes import DTYPES
from collective.types import ArgumentTypeError


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


_NAMES_BY_NUM: dict[int, str] = {}
"""numpy's dtype names by dtype number, for the names in ``DTYPES``: ``dtype.name`` builds
a new string on every call (microseconds), ``dtype.num`` does not."""


def dtype_name(dtype: Any) -> str:
    """Return the name of the numpy ``dtype``, e.g. ``"float32"``; cheap for ``DTYPES``."""
    num = getattr(dtype, "num", None)
    name = _NAMES_BY_NUM.get(num) if num is not None else None
    if name is None:
        name = str(dtype.name)
        if num is not None and name in DTYPES:
            _NAMES_BY_NUM[num] = name
    return name


_TORCH_NAMES: dict[Any, str] = {}
_DEVICE_NAMES: dict[Any, str] = {}


def _torch_name(dtype: Any) -> str:
    """Return the name of the torch ``dtype``, e.g. ``"bfloat16"``; looked up once per dtype."""
    name = _TORCH_NAMES.get(dtype)
    if name is None:
        name = _TORCH_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def _device_name(device: Any) -> str:
    """Return a torch device as ``spec`` names it, e.g. ``"cuda:0"``; looked up once per device."""
    name = _DEVICE_NAMES.get(device)
    if name is None:
        name = _DEVICE_NAMES[device] = str(device)
    return name


def is_torch(x: Any) -> bool:
    """Return whether ``x`` is a torch tensor, without importing torch for the answer.

    A buffer can only be a torch tensor once torch is loaded, so processes that never
    touch torch (a group's store actor) never pay for importing it.
    """
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def is_cupy(x: Any) -> bool:
    """Return whether ``x`` is a cupy array, without importing cupy for the answer."""
    return type(x).__module__.split(".")[0] == "cupy" and hasattr(x, "__cuda_array_interface__")


def spec(x: Any, name: str) -> TensorSpec:
    """Describe ``x``, or reject it if it is no supported buffer.

    Args:
        x: a numpy array, torch tensor or cupy array.
        name: the argument's name, used in the error message.

    Raises:
        ArgumentTypeError: ``x`` is of another type, or of a dtype no backend supports.

    """
    if isinstance(x, np.ndarray):
        kind, shape, dtype, device = "numpy", x.shape, dtype_name(x.dtype), "cpu"
        if not x.dtype.isnative:
            raise ArgumentTypeError(f"{name} must have native byte order, got {x.dtype.str}")
    elif is_torch(x):
        kind, shape, device, dtype = "torch", x.shape, _device_name(x.device), _torch_name(x.dtype)
    elif is_cupy(x):
        kind, shape, dtype = "cupy", tuple(x.shape), dtype_name(x.dtype)
        device = f"cuda:{x.device.id}"
    else:
        raise ArgumentTypeError(
            f"{name} must be a numpy.ndarray, torch.Tensor or cupy.ndarray, "
            f"got {type(x).__module__}.{type(x).__qualname__}"
        )
    if dtype not in DTYPES:
        raise ArgumentTypeError(
            f"{name} has unsupported dtype {dtype}; supported: {sorted(DTYPES)}"
        )
    return TensorSpec(kind, tuple(int(d) for d in shape), dtype, device)


def plain_dtype(dtype: np.dtype) -> str | None:
    """Return the name of the numpy ``dtype`` if it is one of ``DTYPES`` in native order."""
    name = dtype_name(dtype)
    return name if name in DTYPES and dtype.isnative else None


def int64_array(values: list[int]) -> Any:
    """Return a new int64 numpy array holding ``values``, for small control messages."""
    return np.array(values, dtype=np.int64)


def byte_array(data: bytes, width: int) -> Any:
    """Return a new uint8 numpy array of ``width`` bytes: ``data``, then zeros."""
    array = np.zeros(width, dtype=np.uint8)
    array[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    return array


def array_bytes(array: Any, length: int) -> bytes:
    """Return the first ``length`` bytes of the uint8 numpy ``array``."""
    return bytes(array[:length].tobytes())


def copy_of(x: Any) -> Any:
    """Return a new buffer of ``x``'s kind, device, shape and dtype holding its values."""
    return x.clone() if is_torch(x) else x.copy()


def is_buffer(x: Any) -> bool:
    """Return whether ``x`` is a numpy array, torch tensor or cupy array."""
    return isinstance(x, np.ndarray) or is_torch(x) or is_cupy(x)


def is_contiguous(x: Any) -> bool:
    """Return whether ``x``'s memory holds its elements densely, in row-major order, as they read.

    A torch tensor with the negative bit set (a lazy negation such as
    ``z.conj().imag``) is not: its memory holds the negated values, so it moves
    through a resolved copy, or not at all where only raw memory moves (NCCL).
    """
    if is_torch(x):
        return bool(x.is_contiguous()) and not x.is_neg()
    return bool(x.flags.c_contiguous)


def contiguous_message(x: Any, name: str, where: str) -> str:
    """Return the error message for ``x``, named ``name``, that ``where`` needs contiguous."""
    if is_torch(x) and x.is_neg():
        return (
            f"{name} has its negative bit set (a lazy negation such as z.conj().imag), so its "
            f"memory holds the negated values: pass {name}.resolve_neg()"
        )
    return f"{name} must be contiguous {where}; pass a contiguous copy"


def chunks(x: Any, count: int, shape: tuple[int, ...]) -> list[Any]:
    """Return ``count`` consecutive views of contiguous ``x``, each of ``shape``.

    The views share ``x``'s memory, so writing them writes ``x``.
    """
    size = math.prod(shape)
    flat = x.reshape(-1)
    return [flat[i * size : (i + 1) * size].reshape(shape) for i in range(count)]


def split_rows(x: Any, sizes: list[int]) -> list[Any]:
    """Return views of consecutive row blocks of ``x`` along dim 0, of ``sizes`` rows each.

    The views share ``x``'s memory, so writing them writes ``x``.
    """
    offsets = [0, *itertools.accumulate(sizes)]
    return [x[a:b] for a, b in itertools.pairwise(offsets)]
