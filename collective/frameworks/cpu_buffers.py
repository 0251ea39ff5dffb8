"""CPU buffers as the CPU backend moves them: in place when it can, staged when it must."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from collective.frameworks.kinds import DTYPES, dtype_name
from collective.frameworks.memory import in_object_store, overlap_message, self_overlapping
from collective.types import ArgumentValueError

_TYPESTRS: dict[Any, str] = {}
"""numpy's type string of each torch dtype ``plain_flat`` takes: those of ``DTYPES`` numpy has."""


class _Interface:
    """An ``__array_interface__`` for numpy to read, and the object that owns its memory.

    The array numpy makes from it keeps the owner alive for as long as it lives.
    """

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, interface: dict[str, Any], owner: Any) -> None:
        self.__array_interface__ = interface
        self.owner = owner


def host_view(tensor: Any, typestr: str = "|u1", count: int = -1) -> np.ndarray:
    """Return a flat numpy view of the contiguous CPU torch ``tensor``'s memory.

    The view reads ``count`` elements of numpy type ``typestr`` (by default: all of
    its bytes) from the tensor's first element, and keeps the tensor alive. Unlike
    ``Tensor.numpy``, it leaves the tensor's storage as it found it: torch marks a
    storage exported by ``numpy()`` as not resizable for good, which breaks code
    that frees and regrows parameter storage. The tensor must not have its negative
    bit set (its memory holds the negated values).
    """
    if count < 0:
        count = tensor.nbytes // np.dtype(typestr).itemsize
    interface: dict[str, Any] = {
        "data": (tensor.data_ptr(), False),
        "shape": (count,),
        "typestr": typestr,
        "version": 3,
    }
    return np.asarray(_Interface(interface, tensor))


def plain_flat(x: Any) -> np.ndarray | None:
    """Return a flat numpy view of ``x`` when it is a plain buffer to write in place, else None.

    Plain means nothing to check or stage: a numpy array (no subclass), C-contiguous
    and writeable, or a CPU torch tensor (no subclass) that is contiguous, does not
    require grad, has a dtype numpy has, has no negative bit (a lazy negation such
    as ``z.conj().imag``) and does not lie in Ray's object store. The view shares
    ``x``'s memory (``host_view`` for a tensor, which leaves it resizable). The
    caller must still check the view's dtype (see ``plain_dtype``); anything else
    goes through ``spec`` and the buffer checks.
    """
    if type(x) is np.ndarray:
        flags = x.flags
        return x.ravel() if flags.c_contiguous and flags.writeable else None
    torch = sys.modules.get("torch")
    if torch is None or type(x) is not torch.Tensor:
        return None
    if not _TYPESTRS:
        for name in DTYPES:
            if name != "bfloat16":
                _TYPESTRS[getattr(torch, name)] = np.dtype(name).str
    typestr = _TYPESTRS.get(x.dtype)
    if (
        typestr is None
        or x.requires_grad
        or not x.is_cpu
        or x.layout is not torch.strided
        or not x.is_contiguous()
        or x.is_neg()
        or in_object_store(x)
    ):
        return None
    return host_view(x, typestr, x.numel())


def cpu_key(x: Any) -> tuple[Any, ...] | None:
    """Return what an op on CPU buffer ``x`` and its checks depend on, hashable; None: no key.

    For a numpy array (no subclass): its dtype (byte order included), shape, strides
    and whether it is writeable. For a torch tensor (no subclass) that does not
    require grad, of the strided layout: its device, dtype, shape and strides,
    whether its negative bit is set (such a tensor is staged), and whether it lies
    in Ray's object store, looked at again on every call
    (``in_object_store``). The address is left out: an op is handed the buffer on
    every call, so a new buffer like the last one takes its launch. Anything else
    has no key: it is checked on every call.
    """
    if type(x) is np.ndarray:
        return (np.ndarray, x.dtype, x.shape, x.strides, x.flags.writeable)
    torch = sys.modules.get("torch")
    if torch is None or type(x) is not torch.Tensor or x.requires_grad:
        return None
    if x.layout is not torch.strided:
        return None
    device = x.device
    held = x.is_cpu and in_object_store(x)
    return (torch.Tensor, device, x.dtype, x.shape, x.stride(), x.is_neg(), held)


def _writable(array: np.ndarray) -> np.ndarray:
    """Return ``array`` itself if writeable, else a writeable view of the same memory.

    This is what ``ray.util.collective`` does through ``torch.from_numpy``: Ray maps
    its object store read-write, so writing the view writes the object in place.
    The view keeps ``array`` alive.
    """
    if array.flags.writeable:
        return array
    interface = dict(array.__array_interface__)
    interface["data"] = (interface["data"][0], False)
    return np.asarray(_Interface(interface, array))


def _dense(tensor: Any) -> Any:
    """Return ``tensor`` with row-major strides: itself, or a view if it has under two elements.

    torch counts a tensor of 0 or 1 elements contiguous whatever its strides
    (``torch.zeros(4)[4::2]``, ``torch.ones(1, 4)[:, 0]``), but refuses to view it
    as bytes unless its last stride is 1. The view shares the same memory.
    """
    if tensor.numel() > 1 or tensor.dim() == 0:
        return tensor
    strides = [1] * tensor.dim()
    for i in range(tensor.dim() - 2, -1, -1):
        strides[i] = strides[i + 1] * tensor.shape[i + 1]
    if list(tensor.stride()) == strides:
        return tensor
    return tensor.as_strided(tensor.shape, strides, tensor.storage_offset())


def torch_view(data: np.ndarray, dtype: Any) -> Any:
    """Return the flat ``uint8`` array ``data`` as a torch tensor of ``dtype``, sharing memory.

    ``data`` may be empty, whatever its stride.
    """
    import torch

    return _dense(torch.from_numpy(data)).view(dtype)


class CpuBuffer:
    """A contiguous CPU buffer standing for a user buffer during one op.

    It shares memory with the user's buffer when that buffer is contiguous (and,
    for a torch tensor, has no negative bit), read-only numpy arrays included: they
    are written in place, as Ray does (the public functions decide first whether to
    allow it). Otherwise it is a staged copy, and ``commit`` copies the result back
    into the user's buffer (torch negates it again for a tensor with the negative
    bit).
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
        if is_numpy:
            shares = source.flags.c_contiguous
        else:
            shares = source.is_contiguous() and not source.is_neg()
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
            self._tensor = _dense(source if shares else source.resolve_neg().contiguous())

    @property
    def tensor(self) -> Any:
        """Return the buffer as a contiguous CPU torch tensor."""
        if self._tensor is None:
            import torch

            self._tensor = _dense(torch.from_numpy(_writable(self._array)))
        return self._tensor

    @property
    def bytes(self) -> np.ndarray:
        """Return the buffer's memory as a flat ``uint8`` numpy array (a view)."""
        if self._array is not None:
            return self._array.reshape(-1).view(np.uint8)
        return host_view(self._tensor)

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
