"""Where a buffer's elements lie in memory: overlaps, aliasing, and the hazards of writing it."""

from __future__ import annotations

import time
import weakref
from typing import Any

import numpy as np

from collective.frameworks import objectstore
from collective.frameworks.kinds import is_torch


def layout_of(x: Any) -> tuple[int, int, list[tuple[int, int]]]:
    """Return ``x``'s start address, item size and ``(size, byte_stride)`` per dimension."""
    if is_torch(x):
        start, itemsize = x.data_ptr(), x.element_size()
        strides = [s * itemsize for s in x.stride()]
    else:
        interface = (
            "__array_interface__" if isinstance(x, np.ndarray) else "__cuda_array_interface__"
        )
        start, itemsize = getattr(x, interface)["data"][0], x.dtype.itemsize
        strides = list(x.strides)
    return start, itemsize, list(zip((int(d) for d in x.shape), strides, strict=True))


def start_address(x: Any) -> int:
    """Return the address of buffer ``x``'s first element (a numpy, torch or cupy buffer)."""
    if is_torch(x):
        return int(x.data_ptr())
    interface = getattr(x, "__array_interface__", None)
    if interface is not None:
        return int(interface["data"][0])
    return int(x.data.ptr)


def span_of(layout: tuple[int, int, list[tuple[int, int]]]) -> tuple[int, int]:
    """Return the memory span (see ``memory_span``) of a ``layout_of`` result."""
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
    return span_of(layout_of(x))


def spans_overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Return whether two non-empty memory spans (see ``memory_span``) intersect."""
    return a[0] < b[1] and b[0] < a[1] and a[0] != a[1] and b[0] != b[1]


def overlaps(a: Any, b: Any) -> bool:
    """Return whether the memory spans of ``a`` and ``b`` intersect."""
    return spans_overlap(memory_span(a), memory_span(b))


_SOLVER_WORK: Any = 1 << 16
"""The most steps numpy's exact overlap solver may take before ``shares_elements`` assumes one."""

_TOO_HARD: Any = getattr(np, "exceptions", np).TooHardError


class _Phantom:
    """An ``__array_interface__`` over a layout's addresses; its memory is never read."""

    def __init__(self, layout: tuple[int, int, list[tuple[int, int]]]) -> None:
        start, itemsize, dims = layout
        self.__array_interface__ = {
            "data": (start, True),
            "shape": tuple(size for size, _ in dims),
            "strides": tuple(stride for _, stride in dims),
            "typestr": f"|V{itemsize}",
            "version": 3,
        }


def shares_elements(a: Any, b: Any) -> bool:
    """Return whether an element of ``a`` and one of ``b`` share a byte of memory.

    Views of one buffer that interleave (``x[0::2]`` and ``x[1::2]``) span the same
    memory but share none. Only the buffers' addresses and strides are looked at,
    never their memory, so GPU buffers are answered too. A layout too intricate to
    settle quickly counts as shared.
    """
    first, second = layout_of(a), layout_of(b)
    if not spans_overlap(span_of(first), span_of(second)):
        return False
    phantoms = np.asarray(_Phantom(first)), np.asarray(_Phantom(second))
    try:
        return bool(np.shares_memory(*phantoms, max_work=_SOLVER_WORK))
    except _TOO_HARD:
        return True


SAME, PARTIAL = 1, 2
"""How an input relates to an output in ``aliasing``; 0 means disjoint."""


def aliasing(output: Any, inputs: list[Any]) -> list[int]:
    """Return, per input, how its memory relates to ``output``'s.

    ``SAME`` when it views exactly ``output``'s elements (address, shape and
    strides), ``PARTIAL`` when their memory overlaps otherwise, else 0.
    """
    layout = layout_of(output)
    span = span_of(layout)
    found = []
    for x in inputs:
        other = layout_of(x)
        found.append(SAME if other == layout else PARTIAL * spans_overlap(span, span_of(other)))
    return found


def self_overlapping(x: Any) -> bool:
    """Return whether two elements of ``x`` may share memory.

    Dimensions sorted by stride must each step past everything the smaller ones
    span; a layout that does not (a stride of 0, ``as_strided`` tricks) counts as
    overlapping, which errs on the side of refusing to write.
    """
    _, itemsize, dims = layout_of(x)
    if any(size == 0 for size, _ in dims):
        return False
    reach = itemsize
    for size, stride in sorted((d for d in dims if d[0] > 1), key=lambda d: abs(d[1])):
        if abs(stride) < reach:
            return True
        reach += abs(stride) * (size - 1)
    return False


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
    if not is_torch(x):
        return 0
    hazards = GRAD_LEAF if x.requires_grad and x.is_leaf else 0
    if not x.is_contiguous() and self_overlapping(x):
        hazards |= OVERLAPPING
    if x.is_cpu and in_object_store(x):
        hazards |= READ_ONLY
    return hazards


_verdicts: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
"""Whether a torch storage over foreign memory lies in Ray's object store, once known."""
_first_seen: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()
"""When ``in_object_store`` first met such a storage whose verdict is not known yet."""


def in_object_store(x: Any) -> bool:
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


def overlap_message(name: str) -> str:
    """Return the error message for an output buffer ``name`` whose elements share memory."""
    return (
        f"{name} has overlapping memory (a stride of 0, as from expand or "
        "broadcast_to); pass a contiguous copy"
    )
