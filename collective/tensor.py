"""Recognise numpy arrays, torch tensors and cupy arrays; the only module that knows them."""

from __future__ import annotations

import itertools
import math
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from collective import objectstore
from collective.types import ArgumentTypeError, ArgumentValueError, CollectiveError

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
        ArgumentTypeError: ``x`` is of another type, or of a dtype no backend supports.

    """
    if isinstance(x, np.ndarray):
        kind, shape, dtype, device = "numpy", x.shape, dtype_name(x.dtype), "cpu"
        if not x.dtype.isnative:
            raise ArgumentTypeError(f"{name} must have native byte order, got {x.dtype.str}")
    elif _is_torch(x):
        kind, shape, device = "torch", tuple(x.shape), str(x.device)
        dtype = str(x.dtype).removeprefix("torch.")
    elif _is_cupy(x):
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


_PLAIN_TORCH_DTYPES: frozenset[Any] = frozenset()
"""The torch dtypes ``plain_flat`` takes: those of ``DTYPES`` that numpy has too."""


def plain_flat(x: Any) -> np.ndarray | None:
    """Return a flat numpy view of ``x`` when it is a plain buffer to write in place, else None.

    Plain means nothing to check or stage: a numpy array (no subclass), C-contiguous
    and writeable, or a CPU torch tensor (no subclass) that is contiguous, does not
    require grad, has a dtype numpy has, and does not lie in Ray's object store.
    The view shares ``x``'s memory. The caller must still check the view's dtype
    (see ``plain_dtype``); anything else goes through ``spec`` and the buffer checks.
    """
    if type(x) is np.ndarray:
        flags = x.flags
        return x.ravel() if flags.c_contiguous and flags.writeable else None
    torch = sys.modules.get("torch")
    if torch is None or type(x) is not torch.Tensor:
        return None
    global _PLAIN_TORCH_DTYPES
    if not _PLAIN_TORCH_DTYPES:
        _PLAIN_TORCH_DTYPES = frozenset(
            getattr(torch, name) for name in DTYPES if name != "bfloat16"
        )
    if (
        x.requires_grad
        or not x.is_cpu
        or x.layout is not torch.strided
        or x.dtype not in _PLAIN_TORCH_DTYPES
        or not x.is_contiguous()
        or _in_object_store(x)
    ):
        return None
    return x.numpy().ravel()


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


def _span(layout: tuple[int, int, list[tuple[int, int]]]) -> tuple[int, int]:
    start, itemsize, dims = layout
    if any(size == 0 for size, _ in dims):
        return start, start
    low = sum(stride * (size - 1) for size, stride in dims if stride < 0)
    high = sum(stride * (size - 1) for size, stride in dims if stride > 0)
    return start + low, start + high + itemsize


def memory_span(x: Any) -> tuple[int, int]:
    """Return ``(first_byte_address, one_past_last_byte_address)`` of ``x``'s elements."""
    if type(x) is np.ndarray and x.flags.c_contiguous:
        start = x.__array_interface__["data"][0]
        return start, start + x.nbytes
    return _span(_layout(x))


def spans_overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Return whether two non-empty memory spans (see ``memory_span``) intersect."""
    return a[0] < b[1] and b[0] < a[1] and a[0] != a[1] and b[0] != b[1]


def overlaps(a: Any, b: Any) -> bool:
    """Return whether the memory spans of ``a`` and ``b`` intersect."""
    return spans_overlap(memory_span(a), memory_span(b))


SAME, PARTIAL = 1, 2
"""How an input relates to an output in ``aliasing``; 0 means disjoint."""


def aliasing(output: Any, inputs: list[Any]) -> list[int]:
    """Return, per input, how its memory relates to ``output``'s.

    ``SAME`` when it views exactly ``output``'s elements (address, shape and
    strides), ``PARTIAL`` when their memory overlaps otherwise, else 0.
    """
    layout = _layout(output)
    span = _span(layout)
    found = []
    for x in inputs:
        other = _layout(x)
        found.append(SAME if other == layout else PARTIAL * spans_overlap(span, _span(other)))
    return found


def self_overlapping(x: Any) -> bool:
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


def copy_of(x: Any) -> Any:
    """Return a new buffer of ``x``'s kind, device, shape and dtype holding its values."""
    return x.clone() if _is_torch(x) else x.copy()


GRAD_LEAF, OVERLAPPING, READ_ONLY = 1, 2, 4
"""The hazards of writing a buffer in place that ``write_hazards`` reports, as bit flags."""


def write_hazards(x: Any) -> int:
    """Return why writing ``x`` in place is refused or needs care, as bit flags.

    ``GRAD_LEAF``: a torch leaf tensor that requires grad. ``OVERLAPPING``: two of
    its elements share memory (a stride of 0, as from ``expand``). ``READ_ONLY``:
    a numpy array whose ``writeable`` flag is off, as every array Ray hands out (an
    actor method's argument, a ``ray.get`` result), or a CPU torch tensor over
    memory of Ray's object store (``torch.from_numpy(ray.get(ref))``). Torch keeps
    no read-only flag, so such a tensor is recognised by where its memory lies,
    inside a mapping of Ray's object store in this process; one over a small
    result that Ray inlined into this process's heap is not recognised.
    """
    if isinstance(x, np.ndarray):
        flags = x.flags
        hazards = 0 if flags.writeable else READ_ONLY
        if not flags.c_contiguous and self_overlapping(x):
            hazards |= OVERLAPPING
        return hazards
    if not _is_torch(x):
        return 0
    hazards = GRAD_LEAF if x.requires_grad and x.is_leaf else 0
    if not x.is_contiguous() and self_overlapping(x):
        hazards |= OVERLAPPING
    if x.is_cpu and _in_object_store(x):
        hazards |= READ_ONLY
    return hazards


_verdicts: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
"""Whether a torch storage over foreign memory lies in Ray's object store, once known."""
_first_seen: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()
"""When ``_in_object_store`` first met such a storage whose verdict is not known yet."""


def _in_object_store(x: Any) -> bool:
    """Return whether the CPU torch tensor ``x`` lies in Ray's object store in this process.

    Torch allocates a resizable storage itself, never there. Only a storage over
    foreign memory (``torch.from_numpy``, or any storage once ``.numpy()`` has
    exported it) may make the mappings be read again. Its memory stays where it is
    for its lifetime, so its verdict is kept once mappings read after it was first
    met have given it: a long-lived tensor does not read them again.
    """
    address = x.data_ptr()
    if objectstore.holds(address):
        return True
    storage = x.untyped_storage()
    if storage.resizable():
        return False
    known = _verdicts.get(storage)
    if known is not None:
        return known
    seen = _first_seen.setdefault(storage, time.monotonic())
    found = objectstore.holds(address, reread=True)
    if found or objectstore.read_since(seen):
        _verdicts[storage] = found
        _first_seen.pop(storage, None)
    return found


class _WritableInterface:
    """An ``__array_interface__`` of a numpy array with its read-only flag cleared."""

    def __init__(self, array: np.ndarray) -> None:
        interface = dict(array.__array_interface__)
        interface["data"] = (interface["data"][0], False)
        self.__array_interface__ = interface
        self.array = array


def _writable(array: np.ndarray) -> np.ndarray:
    """Return ``array`` itself if writeable, else a writeable view of the same memory.

    This is what ``ray.util.collective`` does through ``torch.from_numpy``: Ray maps
    its object store read-write, so writing the view writes the object in place.
    The view keeps ``array`` alive.
    """
    if array.flags.writeable:
        return array
    return np.asarray(_WritableInterface(array))


class CpuBuffer:
    """A contiguous CPU buffer standing for a user buffer during one op.

    It shares memory with the user's buffer when that buffer is contiguous,
    read-only numpy arrays included: they are written in place, as Ray does (the
    public functions decide first whether to allow it). Otherwise it is a staged
    copy, and ``commit`` copies the result back into the user's buffer.
    ``tensor`` is it as a torch tensor (for gloo); ``bytes`` is it as a flat numpy
    ``uint8`` array (for shared memory).
    """

    def __init__(self, source: Any, name: str, writable: bool) -> None:
        """Wrap ``source`` (a CPU numpy array or torch tensor) for one op.

        Raises:
            ArgumentValueError: ``source`` must be written but overlaps itself.

        """
        self._source = source
        self._tensor: Any = None
        is_numpy = isinstance(source, np.ndarray)
        shares = source.flags.c_contiguous if is_numpy else source.is_contiguous()
        self._staged = writable and not shares
        if self._staged and self_overlapping(source):
            raise ArgumentValueError(overlap_message(name))
        if is_numpy:
            if shares:
                self._array: Any = _writable(source) if writable else source
            else:
                self._array = np.array(source, order="C", copy=True)
        else:
            self._array = None
            self._tensor = source if shares else source.contiguous()

    @property
    def tensor(self) -> Any:
        """Return the buffer as a contiguous CPU torch tensor."""
        if self._tensor is None:
            import torch

            self._tensor = torch.from_numpy(_writable(self._array))
        return self._tensor

    @property
    def bytes(self) -> np.ndarray:
        """Return the buffer's memory as a flat ``uint8`` numpy array (a view)."""
        if self._array is not None:
            return self._array.reshape(-1).view(np.uint8)
        import torch

        return self._tensor.detach().reshape(-1).view(torch.uint8).numpy()

    @property
    def dtype(self) -> str:
        """Return the buffer's dtype name, e.g. ``"bfloat16"``."""
        if self._array is not None:
            return dtype_name(self._array.dtype)
        return str(self._tensor.dtype).removeprefix("torch.")

    @property
    def torch_dtype(self) -> Any:
        """Return the buffer's dtype as a torch dtype."""
        return self.tensor.dtype

    def commit(self) -> None:
        """Copy the result into the user's buffer if it was staged; otherwise do nothing."""
        if not self._staged:
            return
        if isinstance(self._source, np.ndarray):
            np.copyto(_writable(self._source), self._array)
        else:
            self._source.copy_(self._tensor)


def overlap_message(name: str) -> str:
    """Return the error message for an output buffer ``name`` whose elements share memory."""
    return (
        f"{name} has overlapping memory (a stride of 0, as from expand or "
        "broadcast_to); pass a contiguous copy"
    )


def is_buffer(x: Any) -> bool:
    """Return whether ``x`` is a numpy array, torch tensor or cupy array."""
    return isinstance(x, np.ndarray) or _is_torch(x) or _is_cupy(x)


def is_contiguous(x: Any) -> bool:
    """Return whether ``x``'s elements are laid out densely in row-major order."""
    return bool(x.is_contiguous()) if _is_torch(x) else bool(x.flags.c_contiguous)


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


# --- CUDA buffers for the nccl backend ------------------------------------------------------

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
        ArgumentTypeError: ``x`` is no GPU buffer, or its dtype is one NCCL does not move.
        ArgumentValueError: ``x`` is not contiguous.

    """
    if _is_torch(x) and x.device.type == "cuda":
        dtype = str(x.dtype).removeprefix("torch.")
        contiguous = x.is_contiguous()
        ptr, count, device, itemsize = x.data_ptr(), x.numel(), x.device.index, x.element_size()
    elif _is_cupy(x):
        interface = x.__cuda_array_interface__
        dtype, shape, itemsize = x.dtype.name, tuple(interface["shape"]), x.dtype.itemsize
        contiguous = _c_contiguous(shape, interface.get("strides"), itemsize)
        ptr, device = interface["data"][0], x.device.id
        count = int(np.prod(shape, dtype=np.int64))
    else:
        found = spec(x, name).device if isinstance(x, np.ndarray) or _is_torch(x) else None
        where = f"a buffer on {found}" if found else f"a {type(x).__qualname__}"
        raise ArgumentTypeError(f"{name} must be a cupy array or a CUDA torch tensor, got {where}")
    if dtype not in NCCL_DTYPES:
        raise ArgumentTypeError(
            f"{name} has dtype {dtype}, which NCCL does not move; supported: {sorted(NCCL_DTYPES)}"
        )
    if not contiguous:
        raise ArgumentValueError(f"{name} must be contiguous for NCCL; pass a contiguous copy")
    return CudaBuffer(int(ptr), count, dtype, int(device), int(itemsize))


def current_stream(x: Any) -> int:
    """Return the handle of the caller's current CUDA stream on ``x``'s device.

    That is torch's current stream for a torch tensor and cupy's for a cupy array.
    """
    if _is_torch(x):
        import torch

        return int(torch.cuda.current_stream(x.device).cuda_stream)
    with x.device:
        import cupy

        return int(cupy.cuda.get_current_stream().ptr)


def record_stream(x: Any, stream: int) -> None:
    """Tell torch's caching allocator that ``stream`` uses ``x``, so it is not reused early.

    Cupy arrays need no record: the group holds a reference to them until the work
    on ``stream`` has finished.
    """
    if _is_torch(x):
        import torch

        x.record_stream(torch.cuda.ExternalStream(stream, device=x.device))


def synchronize_device(gpu_id: int) -> None:
    """Block until all work queued on GPU ``gpu_id`` has finished.

    Raises:
        CollectiveError: neither cupy nor torch with CUDA is installed.

    """
    try:
        import cupy
    except ImportError:
        cupy = None
    if cupy is not None:
        cupy.cuda.Device(gpu_id).synchronize()
        return
    try:
        import torch
    except ImportError as exc:
        raise CollectiveError('synchronize needs cupy: pip install "collective[nccl]"') from exc
    if not torch.cuda.is_available():
        raise CollectiveError('synchronize needs cupy: pip install "collective[nccl]"')
    torch.cuda.synchronize(gpu_id)
