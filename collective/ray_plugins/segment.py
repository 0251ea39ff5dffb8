"""One object's tensors in a shared-memory file of its node: written once, then only mapped.

The producer writes the file once, with one ``pwritev`` pass, and never maps it: a
header page, then every tensor's bytes, each at a multiple of ``ALIGN`` bytes, small
ones back to back, so an object of 2,000 tensors is one file and one mapping. The
file is named and swept as the CPU groups' arenas are (``collective.groups.shm.arena``):
the name holds the producer's pid and random bytes, so no two objects ever share one,
and a file left by a producer that died is removed by the next file made on the node.

A reader maps the whole file copy-on-write (``MAP_PRIVATE``) and gets each tensor
as a view of that mapping: no byte is copied until the reader writes to a page, and
then only that page, in the reader alone. The mapping lives as long as any of the
views; unlinking the file (``unlink``) only removes its name.

Header words: the arenas' magic, ``KIND``, a digest of the object's id, the data
bytes and the tensor count; a reader checks them all before it reads. A reader on
another node gets the whole file's bytes (``collective.ray_plugins.remote_read``)
and cuts the same views from them (``check``, ``views``). ``alive`` tells whether
the producer that wrote a file still runs, by its pid and start time.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from collective.frameworks.bytelist import raw_bytes
from collective.groups.shm import arena
from collective.types import CollectiveError

ALIGN = 64
"""Tensors start at multiples of this many bytes past the header, so every dtype can view them."""

HEADER = arena.PAGE
"""Bytes before the first tensor: the header words, then zeros up to a page."""

KIND = 0x3154_4452_4C4C_4F43
"""The second header word: "COLLRDT1" in little-endian ASCII."""

_IOV_MAX = os.sysconf("SC_IOV_MAX")
_ZEROS = memoryview(bytes(HEADER))

Meta = tuple[Any, Any]
"""One tensor's ``(shape, torch dtype)``, as Ray's transport metadata lists it."""


def layout(metas: Sequence[Meta]) -> tuple[list[int], list[int], int]:
    """Return each tensor's byte offset in the file and its bytes, and the file's size."""
    places, sizes, end = [], [], 0
    for shape, dtype in metas:
        start = -(-end // ALIGN) * ALIGN
        n = math.prod(shape) * dtype.itemsize
        places.append(HEADER + start)
        sizes.append(n)
        end = start + n
    return places, sizes, HEADER + end


def header(obj_id: str, metas: Sequence[Meta], size: int) -> np.ndarray:
    """Return the header words of object ``obj_id``'s file (tensors ``metas``, ``size`` bytes)."""
    digest = int.from_bytes(hashlib.blake2b(obj_id.encode(), digest_size=7).digest(), "little")
    return np.array([arena.MAGIC, KIND, digest, size - HEADER, len(metas)], dtype=np.int64)


def write(obj_id: str, tensors: Sequence[Any]) -> tuple[str, int]:
    """Write the file of object ``obj_id`` holding CPU ``tensors``; return its path and size.

    The tensors are only read; any strides, dtypes and sizes (empty ones take no
    bytes) are laid out contiguous.

    Raises:
        OSError: ``/dev/shm`` is missing, full or not writable; no file is left.

    """
    metas = [(t.shape, t.dtype) for t in tensors]
    places, sizes, size = layout(metas)
    words = header(obj_id, metas, size)
    pieces: list[Any] = [words.view(np.uint8)]
    position = words.nbytes
    keep = []  # the contiguous copies of strided tensors, alive until written
    for t, place, n in zip(tensors, places, sizes, strict=True):
        if n == 0:
            continue
        if not t.is_contiguous() or t.is_conj() or t.is_neg():
            t = t.detach().resolve_conj().resolve_neg().contiguous()
            keep.append(t)
        if place > position:
            pieces.append(_ZEROS[: place - position])
        pieces.append(raw_bytes(t.data_ptr(), n))
        position = place + n
    fd, path = arena.new_file()
    try:
        _write_all(fd, pieces)
        if position < size:
            os.ftruncate(fd, size)
    except BaseException:
        unlink(path)
        raise
    finally:
        os.close(fd)
    return path, size


def _write_all(fd: int, pieces: list[memoryview]) -> None:
    """Write ``pieces`` back to back from the file's start, however short each write falls."""
    offset, i = 0, 0
    while i < len(pieces):
        written = os.pwritev(fd, pieces[i : i + _IOV_MAX], offset)
        if written <= 0:
            raise OSError(f"wrote no bytes at offset {offset} of a shared-memory file")
        offset += written
        while written and i < len(pieces):
            if written >= pieces[i].nbytes:
                written -= pieces[i].nbytes
                i += 1
            else:
                pieces[i], written = pieces[i][written:], 0


def read(path: str, obj_id: str, metas: Sequence[Meta], size: int) -> list[Any]:
    """Map the file at ``path`` copy-on-write and return its tensors as views of the mapping.

    Raises:
        FileNotFoundError: there is no file at ``path`` (any more).
        CollectiveError: the file is not the one of ``obj_id`` and ``metas``.

    """
    return views(mapped(path, obj_id, metas, size), metas)


def mapped(path: str, obj_id: str, metas: Sequence[Meta], size: int) -> Any:
    """Map the file at ``path`` copy-on-write; return it as one checked ``uint8`` tensor.

    Raises:
        FileNotFoundError: there is no file at ``path`` (any more).
        CollectiveError: the file is not the one of ``obj_id`` and ``metas``.

    """
    import torch

    fd = os.open(path, os.O_RDONLY)
    try:
        found = os.fstat(fd).st_size
        if found != size:
            raise CollectiveError(
                f"the shared-memory file {path} of object {obj_id} has {found} bytes, "
                f"expected {size}"
            )
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=prot)
    finally:
        os.close(fd)
    base = torch.frombuffer(mapping, dtype=torch.uint8)
    check(base, f"the shared-memory file {path}", obj_id, metas, size)
    return base


def check(base: Any, where: str, obj_id: str, metas: Sequence[Meta], size: int) -> None:
    """Check that ``uint8`` tensor ``base`` is the whole file of ``obj_id``, ``metas``, ``size``.

    Raises:
        CollectiveError: ``base`` has another size, or holds another object.

    """
    import torch

    if base.numel() != size:
        raise CollectiveError(
            f"{where} of object {obj_id} has {base.numel()} bytes, expected {size}"
        )
    want = header(obj_id, metas, size)
    got = base[: want.nbytes].view(torch.int64).numpy()
    if not np.array_equal(got, want):
        raise CollectiveError(
            f"{where} holds another object than {obj_id}: header "
            f"{got.tolist()}, expected {want.tolist()}"
        )


def views(base: Any, metas: Sequence[Meta]) -> list[Any]:
    """Return the tensors ``metas`` of a file held whole in ``uint8`` tensor ``base``, as views."""
    import torch

    places, sizes, size = layout(metas)
    typed: dict[Any, Any] = {}  # the whole file as each dtype, to cut views from
    out = []
    for (shape, dtype), place, n in zip(metas, places, sizes, strict=True):
        if n == 0:
            out.append(torch.empty(shape, dtype=dtype))
            continue
        whole = typed.get(dtype)
        if whole is None:
            whole = typed[dtype] = base[: size // dtype.itemsize * dtype.itemsize].view(dtype)
        out.append(whole.as_strided(shape, _strides(shape), place // dtype.itemsize))
    return out


def _strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Return the strides, in elements, of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


def unlink(path: str) -> None:
    """Remove the file's name: readers that mapped it keep their views; later ones fail to open."""
    arena.unlink(path)


def gone(obj_id: str, pid: int, started: int) -> str:
    """Return why the file of ``obj_id`` (producer ``pid``, ``started``) is gone: freed, or died."""
    if alive(pid, started):
        return (
            f"object {obj_id} was freed: its producer (pid {pid}) unlinked its "
            "shared memory when Ray garbage-collected it"
        )
    return f"the producer of object {obj_id} (pid {pid}) died; its tensors are lost"


def started(pid: int) -> int | None:
    """Return the start time of process ``pid`` in clock ticks, or None if it does not run."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in (b"Z", b"X"):  # a zombie or a dead process: it died
        return None
    return int(fields[19])


def alive(pid: int, started_at: int) -> bool:
    """Return whether process ``pid``, started at ``started_at`` (0: unknown), still runs."""
    now = started(pid)
    return now is not None and started_at in (0, now)
