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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import numpy as np

from collective.frameworks.cpu_buffers import _writable
from collective.frameworks.dtypes import ITEMSIZE
from collective.frameworks.kinds import is_contiguous, is_cupy, is_torch

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
        """Return the staging's bytes at ``offset`` as a view of numpy or cupy ``x``'s shape."""
        n = x.size * x.dtype.itemsize
        return self._array[offset : offset + n].view(x.dtype).reshape(x.shape)

    def pack(self, batch: Batch | Sequence[Item]) -> None:
        """Copy each buffer of ``batch`` into the staging at its offset; the buffers are read."""
        self._copy(batch if isinstance(batch, Batch) else Batch(batch), into_staging=True)

    def unpack(self, batch: Batch | Sequence[Item]) -> None:
        """Copy the staging's bytes at each offset of ``batch`` into its buffer, in place."""
        self._copy(batch if isinstance(batch, Batch) else Batch(batch), into_staging=False)

    def _copy(self, batch: Batch, into_staging: bool) -> None:
        """Copy between the staging and ``batch``: one ``torch._foreach_copy_`` per run."""
        if batch.runs:
            torch = sys.modules["torch"]
            staged = self._as_torch() if self._array is not None else self._torch
            with torch.no_grad():
                for run in batch.runs:
                    views = run.views(staged)
                    target, source = (views, run.tensors) if into_staging else (run.tensors, views)
                    torch._foreach_copy_(target, source)
        if batch.negated:
            staged = self._as_torch() if self._array is not None else self._torch
            for offset, x in batch.negated:
                view = staged[offset : offset + x.nbytes].view(x.dtype).view(x.shape)
                if into_staging:
                    view.copy_(x)
                else:
                    x.copy_(view)
        for offset, x in batch.rest:
            staged = self._like(x, offset)
            target, source = (staged, x) if into_staging else (x, staged)
            _copy_array(target, source)


@dataclass(frozen=True)
class _Run:
    """Torch tensors of one dtype in increasing order, within bytes ``[start, stop)`` of a staging.

    ``shapes`` are the tensors with, between two of them that are not adjacent, a
    tensor of no memory as long as the gap; ``select`` picks the tensors' views out of
    the views of ``shapes`` (None when there are no gaps).
    """

    start: int
    stop: int
    dtype: Any
    tensors: list[Any]
    shapes: list[Any]
    select: Callable[[Any], Any] | None

    def views(self, staged: Any) -> Any:
        """Return views of ``staged`` (flat ``uint8``), one shaped like each tensor at its place."""
        flat = staged[self.start : self.stop].view(self.dtype)
        views = _unflatten(flat, self.shapes)
        return self.select(views) if self.select is not None else views


class Batch:
    """The buffers that one op packs into a staging buffer, sorted once for copies in C.

    Torch tensors, and numpy arrays as torch views of their memory, fall into one run
    per dtype: ``Staging.pack`` and ``unpack`` copy a run with one
    ``torch._foreach_copy_`` between its tensors and views of the staging shaped like
    them, which ``unflatten_dense_tensors`` cuts in one call, so no Python runs per
    tensor. Other buffers (cupy arrays, numpy arrays torch cannot view, and tensors
    with the negative bit, which ``_foreach_copy_`` refuses to write and torch's own
    copy negates) are copied one by one. A bulk call builds one per bucket and reuses
    it to unpack.
    """

    def __init__(self, items: Sequence[Item]) -> None:
        """Sort ``items``, whose offsets increase and are multiples of their element size.

        Raises:
            ValueError: an offset overlaps the previous buffer of its dtype, or is not
                a multiple of its element size.

        """
        torch = _torch()
        self.rest: list[Item] = []
        self.negated: list[Item] = []
        by_dtype: dict[Any, list[tuple[int, Any]]] = {}
        for offset, x in items:
            t = _as_torch(torch, x)
            if t is None:
                self.rest.append((offset, x))
            elif t.is_neg():
                self.negated.append((offset, t))
            elif t.numel():
                by_dtype.setdefault(t.dtype, []).append((offset, t))
        nothing = torch.empty(())
        self.runs = [_run(dtype, pairs, nothing) for dtype, pairs in by_dtype.items()]


def _run(dtype: Any, pairs: list[tuple[int, Any]], nothing: Any) -> _Run:
    """Return the run of torch tensors ``pairs`` of ``dtype`` at their byte offsets.

    A gap is an expansion of 0-d tensor ``nothing``, which takes no memory.
    """
    size = pairs[0][1].element_size()
    shapes: list[Any] = []
    keep: list[int] = []
    end = pairs[0][0]
    for offset, t in pairs:
        if offset < end or offset % size:
            raise ValueError(
                f"a {dtype} buffer at byte {offset}: expected a multiple of {size} from {end}"
            )
        if offset > end:
            shapes.append(nothing.expand((offset - end) // size))
        keep.append(len(shapes))
        shapes.append(t)
        end = offset + t.numel() * size
    select = itemgetter(*keep) if len(keep) < len(shapes) else None
    return _Run(pairs[0][0], end, dtype, [t for _, t in pairs], shapes, select)


def _as_torch(torch: Any, x: Any) -> Any | None:
    """Return ``x`` as a torch tensor: itself, a view of a numpy array's memory, or None."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        try:
            return torch.from_numpy(_writable(x))
        except (TypeError, ValueError):  # negative strides, or strides across elements
            return None
    return None


def _unflatten(flat: Any, tensors: list[Any]) -> Any:
    """Return views of 1-D ``flat``, in order, each shaped like the tensor at its place."""
    return sys.modules["torch"]._C._nn.unflatten_dense_tensors(flat, tensors)


def _copy_array(target: Any, source: Any) -> None:
    """Copy numpy or cupy ``source`` into ``target`` of the same shape and dtype."""
    if isinstance(target, np.ndarray):
        np.copyto(target, source)
    else:
        target[...] = source
