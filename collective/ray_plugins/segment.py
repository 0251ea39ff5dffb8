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

Consumers learn the tensors' dtypes and shapes from a ``Table``: a few byte strings
that pickle at once at every hop of Ray's metadata, where a list of 2,000 pairs takes
milliseconds, and that give every tensor's place in a few numpy operations.

Header words: the arenas' magic, ``KIND``, a digest of the object's id, the data
bytes and the tensor count; a reader checks them all before it reads. A reader on
another node gets the whole file's bytes (``collective.ray_plugins.remote_read``)
and cuts the same views from them (``check``, ``views``). ``alive`` tells whether
the producer that wrote a file still runs, by its pid and start time.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

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


@dataclass(frozen=True)
class Table:
    """An object's tensors' dtypes and shapes, packed into a few byte strings.

    Ray lists an object's tensors as ``(shape, dtype)`` pairs (``metas``), and pickles
    the list at every hop: a millisecond or more per thousand tensors. A table pickles
    as a few short strings, and gives the file's layout in a few numpy operations.
    """

    dtypes: tuple[Any, ...]
    """The distinct torch dtypes, in order of first use."""
    codes: bytes
    """Each tensor's dtype, as a ``uint8`` index into ``dtypes``."""
    ndims: bytes
    """Each tensor's number of dimensions, as ``uint8`` (``int32`` when ``wide``)."""
    dims: bytes
    """Every tensor's sizes back to back, as ``int32`` (``int64`` when ``wide``)."""
    wide: bool = False
    """Whether some tensor has over 255 dimensions, or a size of 2**31 or more."""

    @classmethod
    def of(cls, metas: Sequence[Meta]) -> Table:
        """Return the table of tensors ``metas``, each a ``(shape, torch dtype)``."""
        dtypes: dict[Any, int] = {}
        codes = [dtypes.setdefault(dtype, len(dtypes)) for _, dtype in metas]
        shapes = [shape for shape, _ in metas]
        ndims = np.array([len(s) for s in shapes], dtype=np.int32)
        dims = np.fromiter(itertools.chain.from_iterable(shapes), dtype=np.int64)
        wide = bool(ndims.size and ndims.max() > 255) or bool(dims.size and dims.max() >= 2**31)
        return cls(
            tuple(dtypes),
            np.array(codes, dtype=np.uint8).tobytes(),
            (ndims if wide else ndims.astype(np.uint8)).tobytes(),
            (dims if wide else dims.astype(np.int32)).tobytes(),
            wide,
        )

    def ndim_array(self) -> np.ndarray:
        """Return each tensor's number of dimensions."""
        return np.frombuffer(self.ndims, dtype=np.int32 if self.wide else np.uint8)

    def dim_array(self) -> np.ndarray:
        """Return every tensor's sizes, back to back."""
        return np.frombuffer(self.dims, dtype=np.int64 if self.wide else np.int32)

    def __len__(self) -> int:
        """Return the number of tensors."""
        return len(self.codes)

    def metas(self) -> list[Meta]:
        """Return each tensor's ``(torch.Size, dtype)``, as Ray lists them."""
        import torch

        dims = self.dim_array().tolist()
        codes = np.frombuffer(self.codes, dtype=np.uint8).tolist()
        out, at = [], 0
        for n, code in zip(self.ndim_array().tolist(), codes, strict=True):
            out.append((torch.Size(dims[at : at + n]), self.dtypes[code]))
            at += n
        return out

    def numels(self) -> np.ndarray:
        """Return each tensor's number of elements."""
        if not len(self):
            return np.zeros(0, np.int64)
        ndims = self.ndim_array().astype(np.int64)
        starts = np.cumsum(ndims) - ndims
        ones_first = np.insert(self.dim_array().astype(np.int64), starts, 1)
        return np.multiply.reduceat(ones_first, starts + np.arange(len(ndims)))

    def layout(self) -> tuple[np.ndarray, np.ndarray, int]:
        """Return each tensor's byte offset in the file and its bytes, and the file's size.

        Tensors lie in order, each at the next multiple of ``ALIGN`` past the header;
        empty ones take no bytes.
        """
        if not len(self):
            return np.zeros(0, np.int64), np.zeros(0, np.int64), HEADER
        itemsizes = np.array([d.itemsize for d in self.dtypes], dtype=np.int64)
        nbytes = self.numels() * itemsizes[np.frombuffer(self.codes, dtype=np.uint8)]
        taken = -(-nbytes // ALIGN) * ALIGN
        places = HEADER + np.cumsum(taken) - taken
        return places, nbytes, int(places[-1] + nbytes[-1])


def header(obj_id: str, table: Table, size: int) -> np.ndarray:
    """Return the header words of object ``obj_id``'s file (tensors ``table``, ``size`` bytes)."""
    digest = int.from_bytes(hashlib.blake2b(obj_id.encode(), digest_size=7).digest(), "little")
    return np.array([arena.MAGIC, KIND, digest, size - HEADER, len(table)], dtype=np.int64)


def write(obj_id: str, tensors: Sequence[Any], table: Table) -> tuple[str, int]:
    """Write the file of object ``obj_id`` holding CPU ``tensors``; return its path and size.

    ``table`` is their ``Table``. The tensors are only read; any strides, dtypes
    and sizes (empty ones take no bytes) are laid out contiguous.

    Raises:
        OSError: ``/dev/shm`` is missing, full or not writable; no file is left.

    """
    places, sizes, size = table.layout()
    words = header(obj_id, table, size)
    pieces: list[Any] = [words.view(np.uint8)]
    position = words.nbytes
    keep = []  # the contiguous copies of strided tensors, alive until written
    for t, place, n in zip(tensors, places.tolist(), sizes.tolist(), strict=True):
        if n == 0:
            continue
        if not t.is_contiguous() or t.is_conj() or t.is_neg():
            t = t.detach().resolve_conj().resolve_neg().contiguous()
            keep.append(t)
        if place > position:
            pieces.append(_ZEROS[: place - position])
        pieces.append((ctypes.c_ubyte * n).from_address(t.data_ptr()))
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


def _write_all(fd: int, pieces: list[Any]) -> None:
    """Write buffers ``pieces`` back to back from the file's start, however short writes fall."""
    offset, i = 0, 0
    while i < len(pieces):
        written = os.pwritev(fd, pieces[i : i + _IOV_MAX], offset)
        if written <= 0:
            raise OSError(f"wrote no bytes at offset {offset} of a shared-memory file")
        offset += written
        while written and i < len(pieces):
            n = memoryview(pieces[i]).nbytes
            if written >= n:
                written -= n
                i += 1
            else:
                pieces[i], written = memoryview(pieces[i]).cast("B")[written:], 0


def read(path: str, obj_id: str, table: Table, size: int) -> list[Any]:
    """Map the file at ``path`` copy-on-write and return its tensors as views of the mapping.

    Raises:
        FileNotFoundError: there is no file at ``path`` (any more).
        CollectiveError: the file is not the one of ``obj_id`` and ``table``.

    """
    return views(mapped(path, obj_id, table, size), table)


def mapped(path: str, obj_id: str, table: Table, size: int) -> Any:
    """Map the file at ``path`` copy-on-write; return it as one checked ``uint8`` tensor.

    Raises:
        FileNotFoundError: there is no file at ``path`` (any more).
        CollectiveError: the file is not the one of ``obj_id`` and ``table``.

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
    check(base, f"the shared-memory file {path}", obj_id, table, size)
    return base


def check(base: Any, where: str, obj_id: str, table: Table, size: int) -> None:
    """Check that ``uint8`` tensor ``base`` is the whole file of ``obj_id``, ``table``, ``size``.

    Raises:
        CollectiveError: ``base`` has another size, or holds another object.

    """
    import torch

    if base.numel() != size:
        raise CollectiveError(
            f"{where} of object {obj_id} has {base.numel()} bytes, expected {size}"
        )
    want = header(obj_id, table, size)
    got = base[: want.nbytes].view(torch.int64).numpy()
    if not np.array_equal(got, want):
        raise CollectiveError(
            f"{where} holds another object than {obj_id}: header "
            f"{got.tolist()}, expected {want.tolist()}"
        )


def views(base: Any, table: Table) -> list[Any]:
    """Return the tensors of ``table`` in a file held whole in ``uint8`` tensor ``base``, as views.

    Per dtype, one ``split_with_sizes`` of the file seen as that dtype cuts every
    tensor (and the gaps between them); only tensors of other than one dimension are
    then viewed in their shape. Empty tensors are new ones, which hold no mapping.
    """
    import torch

    places, _, size = table.layout()
    numels = table.numels()
    codes = np.frombuffer(table.codes, dtype=np.uint8)
    out: list[Any] = [None] * len(table)
    for code, dtype in enumerate(table.dtypes):
        mine = np.flatnonzero(codes == code)
        whole = base[: size // dtype.itemsize * dtype.itemsize].view(dtype)
        starts = places[mine] // dtype.itemsize
        cuts = np.empty(2 * len(mine) + 2, dtype=np.int64)
        cuts[0], cuts[-1] = 0, whole.numel()
        cuts[1:-1:2], cuts[2:-1:2] = starts, starts + numels[mine]
        lengths = np.diff(cuts)  # gap, tensor, gap, tensor, ..., gap
        kept = lengths > 0
        kept[1::2] = True  # every tensor, empty or not; only empty gaps go
        parts = whole.split_with_sizes(lengths[kept].tolist())
        at = (np.cumsum(kept) - 1)[1::2].tolist()
        for i, j in zip(mine.tolist(), at, strict=True):
            out[i] = parts[j]
    ndims = table.ndim_array().astype(np.int64)
    reshaped = np.flatnonzero((ndims != 1) | (numels == 0))
    if reshaped.size:
        dims = table.dim_array().tolist()
        starts = (np.cumsum(ndims) - ndims).tolist()
        for i in reshaped.tolist():
            shape = dims[starts[i] : starts[i] + int(ndims[i])]
            t = out[i]
            out[i] = t.view(shape) if numels[i] else torch.empty(shape, dtype=t.dtype)
    return out


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
