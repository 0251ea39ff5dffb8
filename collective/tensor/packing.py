"""Pack many buffers into one flat byte buffer and back: the staging of the bulk functions.

A ``Staging`` is a flat ``uint8`` buffer on one device: a numpy array on the CPU, a
torch tensor or a cupy array on a GPU. ``pack`` copies buffers of any strides into it
at given byte offsets and ``unpack`` copies them back out; the ops move the staging
itself, or typed views of it. On a GPU every copy is queued on the caller's current
stream of the buffers' library, as the ops order themselves after that stream.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from collective.tensor.cpu import _writable
from collective.tensor.kinds import is_contiguous, is_cupy, is_torch

ITEMSIZE = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int32": 4,
    "int64": 8,
    "bool": 1,
}
"""The bytes of one element of each dtype name of ``DTYPES``."""

Item = tuple[int, Any]
"""A buffer and the byte offset of its elements in a staging buffer."""


def writable(x: Any) -> Any:
    """Return a view of ``x`` to write in place: detached if it requires grad, writeable if numpy.

    A model's parameters are written as under ``torch.no_grad()``; a read-only numpy
    array (one Ray mapped from its object store) through a writeable view of its
    memory, as the ops write it.
    """
    if is_torch(x):
        return x.detach() if x.requires_grad else x
    if isinstance(x, np.ndarray):
        return _writable(x)
    return x


def flat(x: Any) -> Any:
    """Return contiguous ``x`` as a 1-D view of its elements.

    A torch tensor of 0 or 1 elements counts as contiguous whatever its strides;
    its view gets stride 1.
    """
    if is_torch(x):
        return x.as_strided((x.numel(),), (1,))
    return x.reshape(-1)


def as_bytes(x: Any) -> Any:
    """Return contiguous ``x`` as a 1-D ``uint8`` view of its memory."""
    if is_torch(x):
        import torch

        return flat(x).view(torch.uint8)
    return flat(x).view(np.uint8)


def segments(x: Any, start: int, stop: int) -> list[Any]:
    """Return views of ``x`` that cover its row-major elements ``[start, stop)``, in order.

    A contiguous ``x`` gives one flat view; otherwise whole rows are one view and the
    partial rows at either end are cut further, so a range gives a few views per
    dimension at most.
    """
    if stop <= start:
        return []
    if is_contiguous(x):
        return [flat(x)[start:stop]]
    row = math.prod(x.shape[1:])
    low, high = -(-start // row), stop // row
    if low > high:
        r = start // row
        return segments(x[r], start - r * row, stop - r * row)
    out = segments(x[low - 1], start - (low - 1) * row, row) if start < low * row else []
    if low < high:
        out.append(x[low:high])
    return out + segments(x[high], 0, stop - high * row) if stop > high * row else out


def empty(dtype: str, shape: tuple[int, ...], device: str) -> Any:
    """Return a new uninitialised tensor: torch's on ``device`` ("cpu" or "cuda"), else numpy/cupy.

    On "cuda" it lies on the current CUDA device. Without torch it is a numpy array
    on the CPU and a cupy array on a GPU; bfloat16 needs torch.
    """
    torch = _torch()
    if torch is not None:
        where = "cpu" if device == "cpu" else torch.device("cuda", torch.cuda.current_device())
        return torch.empty(shape, dtype=getattr(torch, dtype), device=where)
    if device == "cpu":
        return np.empty(shape, dtype=dtype)
    import cupy

    return cupy.empty(shape, dtype=dtype)


def to_device(array: np.ndarray, like: Any) -> Any:
    """Return numpy ``array`` on ``like``'s device, in ``like``'s library; itself on the CPU."""
    if is_torch(like) and like.device.type == "cuda":
        import torch

        return torch.from_numpy(array).to(like.device)
    if is_cupy(like):
        import cupy

        with like.device:
            return cupy.asarray(array)
    return array


def to_host(x: Any) -> np.ndarray:
    """Return ``x`` as a numpy array: itself, or a copy of a torch tensor or a GPU buffer."""
    if isinstance(x, np.ndarray):
        return x
    if is_torch(x):
        return np.asarray(x.cpu().numpy())
    import cupy

    return np.asarray(cupy.asnumpy(x))


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


class Staging:
    """A flat byte buffer of ``nbytes`` on the device of ``like``, to pack buffers into.

    On the CPU it is a numpy array (a torch view of it serves torch buffers); on a
    GPU it is of ``like``'s library, on ``like``'s device. Its memory is uninitialised.
    """

    def __init__(self, like: Any, nbytes: int) -> None:
        """Allocate ``nbytes`` next to ``like`` (any buffer of the call)."""
        self.nbytes = nbytes
        self._torch: Any = None
        self._gpu = False
        if is_torch(like) and like.device.type == "cuda":
            import torch

            self._torch = torch.empty(nbytes, dtype=torch.uint8, device=like.device)
            self._array: Any = None
            self._gpu = True
        elif is_cupy(like):
            import cupy

            with like.device:
                self._array = cupy.empty(nbytes, dtype=cupy.uint8)
            self._gpu = True
        else:
            self._array = np.empty(nbytes, dtype=np.uint8)

    def _as_torch(self) -> Any:
        if self._torch is None:
            import torch

            self._torch = torch.from_numpy(self._array)
        return self._torch

    def bytes(self, offset: int, n: int) -> Any:
        """Return bytes ``[offset, offset + n)`` as a flat ``uint8`` buffer (a view)."""
        if self._array is not None:
            return self._array[offset : offset + n]
        return self._torch[offset : offset + n]

    def typed(self, offset: int, count: int, dtype: str) -> Any:
        """Return ``count`` elements of ``dtype`` from byte ``offset`` as a flat view.

        ``offset`` must be a multiple of the dtype's size. On the CPU the view is a
        numpy array, or a torch tensor for bfloat16, which numpy lacks.
        """
        n = count * ITEMSIZE[dtype]
        if self._array is not None and dtype != "bfloat16":
            return self._array[offset : offset + n].view(dtype)
        import torch

        return self._as_torch()[offset : offset + n].view(getattr(torch, dtype))

    def _like(self, x: Any, offset: int) -> Any:
        """Return the staging's bytes at ``offset`` as a view of ``x``'s dtype and shape."""
        if is_torch(x):
            staged = self._as_torch() if self._array is not None else self._torch
            n = x.numel() * x.element_size()
            return staged[offset : offset + n].view(x.dtype).view(x.shape)
        n = x.size * x.dtype.itemsize
        return self._array[offset : offset + n].view(x.dtype).reshape(x.shape)

    def pack(self, items: Sequence[Item]) -> None:
        """Copy each buffer of ``items`` into the staging at its offset; the buffers are read."""
        self._copy(items, into_staging=True)

    def unpack(self, items: Sequence[Item]) -> None:
        """Copy the staging's bytes at each offset of ``items`` into its buffer, in place."""
        self._copy(items, into_staging=False)

    def _copy(self, items: Sequence[Item], into_staging: bool) -> None:
        """Copy between the staging and ``items``: contiguous torch buffers in one batch.

        The offsets of ``items`` increase, as a plan lays them out.
        """
        torch: Any = sys.modules.get("torch")
        tensor_type = torch.Tensor if torch is not None else ()
        theirs, spans = [], []
        for offset, x in items:
            if isinstance(x, tensor_type):
                n = x.numel() * x.element_size()
                if n == 0:
                    continue
                if x.is_contiguous():
                    one_dim = x.dim() == 1 and x.stride(0) == 1
                    theirs.append(x.view(torch.uint8) if one_dim else as_bytes(x))
                    spans.append((offset, n))
                    continue
                staged = self._like(x, offset)
                if into_staging:
                    staged.copy_(x)
                else:
                    x.copy_(staged)
            elif x.size:
                staged = self._like(x, offset)
                target, source = (staged, x) if into_staging else (x, staged)
                _copy_array(target, source)
        if theirs:
            ours = self._parts(spans)
            target, source = (ours, theirs) if into_staging else (theirs, ours)
            _copy_tensors(target, source)

    def _parts(self, spans: list[tuple[int, int]]) -> list[Any]:
        """Return torch views of the staging's bytes at each ``(offset, nbytes)``, made at once."""
        sizes, keep, position = [], [], 0
        for offset, n in spans:
            if offset > position:
                sizes.append(offset - position)
            keep.append(len(sizes))
            sizes.append(n)
            position = offset + n
        staged = self._as_torch() if self._array is not None else self._torch
        parts = staged[:position].split_with_sizes(sizes)
        return [parts[k] for k in keep]


def _copy_array(target: Any, source: Any) -> None:
    """Copy numpy or cupy ``source`` into ``target`` of the same shape and dtype."""
    if isinstance(target, np.ndarray):
        np.copyto(target, source)
    else:
        target[...] = source


def _copy_tensors(targets: list[Any], sources: list[Any]) -> None:
    """Copy each torch tensor of ``sources`` into the one of ``targets`` at its place."""
    torch = sys.modules["torch"]
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        foreach(targets, sources)
        return
    for target, source in zip(targets, sources, strict=True):
        target.copy_(source)
