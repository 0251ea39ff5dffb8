"""The shared-memory arena of one CPU group on one node: its layout, creation and mapping.

One local rank (the node's leader) creates the arena as a file in ``/dev/shm``,
reserving its whole size up front, so a full ``/dev/shm`` fails here with
``OSError`` instead of a ``SIGBUS`` later. The other local ranks map it by name,
and the leader unlinks it once every local rank has it mapped: from then on the
memory lives only as long as the mappings, and a ``kill -9`` leaves nothing behind.

Layout, every region aligned to 4096 bytes:

- header: a magic number and the layout, checked by every rank that maps it, and
  the abort word, set by a rank that saw a failure;
- reasons: ``REASON_BYTES`` per local rank, where a rank that sets the abort word
  first writes why, so that the others can say it;
- control: one block per local rank, written by that rank only: its step
  counters, pid and op sequence, and the bytes through which other ranks say
  they sleep on its counters;
- mail control: one block per ordered pair of local ranks, for send/recv;
- slot headers: 64 bytes per (rank, buffer): the op and bytes a step carries;
- slots: ``nbuf`` buffers of ``slot_bytes`` per local rank, the collective pipeline;
- mail: ``mail_nbuf`` buffers of ``mail_bytes`` per ordered pair.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
from dataclasses import dataclass

import numpy as np

SHM_DIR = "/dev/shm"
"""Where arenas are created."""

NAME_PREFIX = "collective-"
"""Arena files are called ``collective-<creator pid>-<random>``."""

MAGIC = 0x314D_4853_4C4C_4F43
"""The first word of every arena: "COLLSHM1" in little-endian ASCII."""
_MAGIC_BYTES = MAGIC.to_bytes(8, "little")

_NAME = re.compile(re.escape(NAME_PREFIX) + r"([0-9]+)-[0-9a-f]{12}")
"""The whole name of an arena file: the creator's pid, then 6 random bytes in hex."""

PAGE = 4096
WORD = 8

SLOTS_BUDGET = 16 << 20
"""Bytes of collective slots per arena; each local rank gets ``nbuf`` of them."""

SLOT_MAX = 2 << 20
"""The largest slot. Against 1 MiB, 2 MiB slots halve the steps of a long message,
which at 4 ranks on 2 cores took allreduce and alltoall of 16-64 MiB from 0.8-1.3x
raw torch gloo's time to 0.4-0.8x; 4 MiB slots made 2-rank allreduce slower."""

MAIL_BUDGET = 4 << 20
"""Bytes of send/recv mailboxes per arena."""

SLOT_BYTES_ENV = "COLLECTIVE_SHM_SLOT_BYTES"
"""Overrides the slot size (bytes, a multiple of 64); small values exercise chunking."""

# Words of a rank's control block.
POSTED, CONSUMED, PID, OP_SEQ, UNMAPPED = 0, 1, 2, 3, 4
"""``UNMAPPED``: set by a rank of a group that shares a GPU once it unmapped the others'
device slots, so that they may free theirs."""
FLAGS_OFFSET = 64
"""Byte offset, in a control block, of the sleep flags: ``align(L)`` bytes per counter."""

# Words of a mail control block (one per ordered pair).
MAIL_POSTED, MAIL_CONSUMED = 0, 8
MAIL_FLAGS = 128
"""Byte offset of the pair's sleep flags: ``align(L)`` bytes per counter, posted first."""

# Words of a slot header.
HDR_OP, HDR_SIG, HDR_BYTES, HDR_BLAME = 0, 1, 2, 3
"""``HDR_BLAME``: 1 + the local rank found in another op by a ``Steps.gather``, then its header."""
HDR_STRIDE = 64

# Words of the header page.
ABORT_WORD = 16
"""Header word a rank sets to ``1 + its local rank`` when it has seen a failure."""

REASON_BYTES = 512
"""Bytes of each local rank's reason area: an int64 length, then UTF-8 text."""


def _align(value: int, to: int) -> int:
    return (value + to - 1) // to * to


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


@dataclass(frozen=True)
class Layout:
    """The sizes of an arena for ``local_size`` ranks; every offset derives from them."""

    local_size: int
    slot_bytes: int
    nbuf: int = 2
    mail_bytes: int = 64 << 10
    mail_nbuf: int = 2

    @classmethod
    def for_ranks(cls, local_size: int, slot_bytes: int | None = None) -> Layout:
        """Return the layout for ``local_size`` ranks within the default budgets.

        Args:
            local_size: the ranks that share the arena.
            slot_bytes: the slot size; None reads ``COLLECTIVE_SHM_SLOT_BYTES``, then
                divides the budget (between 64 KiB and ``SLOT_MAX`` per slot).

        Raises:
            ValueError: ``slot_bytes`` (or the variable) is no multiple of 64, or
                leaves less than 64 bytes per local rank.

        """
        if slot_bytes is None and os.environ.get(SLOT_BYTES_ENV):
            slot_bytes = int(os.environ[SLOT_BYTES_ENV])
        if slot_bytes is None:
            slot_bytes = _clamp(SLOTS_BUDGET // (2 * local_size), 64 << 10, SLOT_MAX)
            slot_bytes = slot_bytes // PAGE * PAGE
        if slot_bytes % 64 or slot_bytes < 64 * local_size:
            raise ValueError(
                f"slot_bytes must be a multiple of 64 of at least 64 per local rank "
                f"({64 * local_size}), got {slot_bytes}"
            )
        pairs = local_size * local_size
        mail = _clamp(MAIL_BUDGET // (2 * pairs), PAGE, 256 << 10) // PAGE * PAGE
        return cls(local_size, slot_bytes, 2, min(mail, _align(slot_bytes, PAGE)), 2)

    @property
    def flag_bytes(self) -> int:
        """Return the bytes of sleep flags per counter: one per local rank, word-aligned."""
        return _align(self.local_size, WORD)

    @property
    def control_stride(self) -> int:
        """Return the bytes of one rank's control block."""
        return _align(FLAGS_OFFSET + 2 * self.flag_bytes, 128)

    @property
    def mail_stride(self) -> int:
        """Return the bytes of one pair's mail control block."""
        return _align(MAIL_FLAGS + 2 * self.flag_bytes, 64)

    @property
    def control_offset(self) -> int:
        """Return where the control blocks start, after the header page and the reasons."""
        return _align(PAGE + self.local_size * REASON_BYTES, PAGE)

    @property
    def mail_control_offset(self) -> int:
        """Return where the mail control blocks start."""
        return _align(self.control_offset + self.local_size * self.control_stride, PAGE)

    @property
    def header_offset(self) -> int:
        """Return where the slot headers start."""
        pairs = self.local_size * self.local_size
        return _align(self.mail_control_offset + pairs * self.mail_stride, PAGE)

    @property
    def slots_offset(self) -> int:
        """Return where the collective slots start."""
        count = self.local_size * self.nbuf
        return _align(self.header_offset + count * HDR_STRIDE, PAGE)

    @property
    def slot_stride(self) -> int:
        """Return the distance between two consecutive slots."""
        return _align(self.slot_bytes, PAGE)

    @property
    def mail_offset(self) -> int:
        """Return where the mailboxes start."""
        return self.slots_offset + self.local_size * self.nbuf * self.slot_stride

    @property
    def size(self) -> int:
        """Return the arena's size in bytes."""
        pairs = self.local_size * self.local_size
        return self.mail_offset + pairs * self.mail_nbuf * self.mail_bytes

    def words(self) -> list[int]:
        """Return the header words that describe this layout."""
        return [MAGIC, self.local_size, self.slot_bytes, self.nbuf, self.mail_bytes, self.mail_nbuf]


class Arena:
    """A mapped arena and numpy views of its regions.

    The views share the mapping; ``close`` drops them and unmaps. Nothing may
    touch the views after ``close``.
    """

    def __init__(self, mapping: mmap.mmap, layout: Layout, path: str) -> None:
        """Wrap ``mapping``, an arena of ``layout`` mapped from ``path``."""
        self.layout = layout
        self.path = path
        self._mapping: mmap.mmap | None = mapping
        self.bytes = np.frombuffer(mapping, dtype=np.uint8)
        self.address = int(self.bytes.ctypes.data)
        self.header = self.bytes[:PAGE].view(np.int64)
        n, stride = layout.local_size, layout.control_stride
        control = self.bytes[layout.control_offset : layout.control_offset + n * stride]
        self.control = control.view(np.int64).reshape(n, stride // WORD)
        mail = self.bytes[layout.mail_control_offset : layout.header_offset]
        self.mail_control = mail[: n * n * layout.mail_stride].view(np.int64).reshape(n, n, -1)
        headers = self.bytes[layout.header_offset : layout.header_offset + n * layout.nbuf * 64]
        self.slot_headers = headers.view(np.int64).reshape(n, layout.nbuf, HDR_STRIDE // WORD)

    def reason(self, rank: int) -> np.ndarray:
        """Return the bytes of ``rank``'s reason area (see ``REASON_BYTES``)."""
        start = PAGE + rank * REASON_BYTES
        return self.bytes[start : start + REASON_BYTES]

    def control_address(self, rank: int, word: int) -> int:
        """Return the address of ``word`` of ``rank``'s control block."""
        return (
            self.address + self.layout.control_offset + rank * self.layout.control_stride + 8 * word
        )

    def flags(self, rank: int, kind: int) -> np.ndarray:
        """Return the sleep flags on counter ``kind`` (POSTED or CONSUMED) of ``rank``.

        Byte ``w`` is 1 while local rank ``w`` sleeps on that counter.
        """
        start = self.layout.control_offset + rank * self.layout.control_stride + FLAGS_OFFSET
        start += kind * self.layout.flag_bytes
        return self.bytes[start : start + self.layout.flag_bytes]

    def _mail_block(self, sender: int, receiver: int) -> int:
        layout = self.layout
        pair = sender * layout.local_size + receiver
        return layout.mail_control_offset + pair * layout.mail_stride

    def mail_address(self, sender: int, receiver: int, word: int) -> int:
        """Return the address of ``word`` of the mail control block of ``sender -> receiver``."""
        return self.address + self._mail_block(sender, receiver) + 8 * word

    def mail_flags(self, sender: int, receiver: int, word: int) -> np.ndarray:
        """Return the sleep flags on counter ``word`` (MAIL_POSTED or MAIL_CONSUMED) of a pair."""
        start = self._mail_block(sender, receiver) + MAIL_FLAGS
        start += (word != MAIL_POSTED) * self.layout.flag_bytes
        return self.bytes[start : start + self.layout.flag_bytes]

    def slot(self, rank: int, buffer: int) -> np.ndarray:
        """Return the bytes of ``rank``'s collective slot ``buffer``."""
        layout = self.layout
        start = layout.slots_offset + (rank * layout.nbuf + buffer) * layout.slot_stride
        return self.bytes[start : start + layout.slot_bytes]

    def mailbox(self, sender: int, receiver: int, buffer: int) -> np.ndarray:
        """Return the bytes of mailbox ``buffer`` of the pair ``sender -> receiver``."""
        layout = self.layout
        pair = sender * layout.local_size + receiver
        start = layout.mail_offset + (pair * layout.mail_nbuf + buffer) * layout.mail_bytes
        return self.bytes[start : start + layout.mail_bytes]

    def close(self) -> None:
        """Drop every view and unmap; views obtained earlier must no longer be used."""
        mapping, self._mapping = self._mapping, None
        if mapping is None:
            return
        del self.bytes, self.header, self.control, self.mail_control, self.slot_headers
        try:
            mapping.close()
        except BufferError:
            pass


def _map(fd: int, size: int) -> mmap.mmap:
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def new_file() -> tuple[int, str]:
    """Create an empty file named as arenas are, first sweeping stale ones; return fd and path.

    The name holds this process's pid and 6 random bytes, and the file is created
    exclusively, so no two files ever share a name. Once it starts with ``MAGIC``,
    ``sweep_stale`` removes it if this process dies before unlinking it.

    Raises:
        OSError: ``/dev/shm`` is missing or not writable.

    """
    sweep_stale()
    name = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
    path = os.path.join(SHM_DIR, name)
    return os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600), path


def create(layout: Layout) -> Arena:
    """Create, size and map a new arena of ``layout``; the caller unlinks it later.

    Raises:
        OSError: ``/dev/shm`` is missing, full or not writable.

    """
    fd, path = new_file()
    try:
        os.posix_fallocate(fd, 0, layout.size)
        os.pwrite(fd, _MAGIC_BYTES, 0)
        mapping = _map(fd, layout.size)
    except BaseException:
        os.close(fd)
        unlink(path)
        raise
    os.close(fd)
    arena = Arena(mapping, layout, path)
    arena.header[1 : 1 + len(layout.words()) - 1] = layout.words()[1:]
    return arena


def attach(path: str, layout: Layout) -> Arena:
    """Map the arena at ``path``, which must have been created with ``layout``.

    Raises:
        OSError: the file cannot be opened or mapped.
        ValueError: the file is no arena of ``layout``.

    """
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if size != layout.size:
            raise ValueError(f"arena {path} has {size} bytes, expected {layout.size}")
        mapping = _map(fd, layout.size)
    finally:
        os.close(fd)
    arena = Arena(mapping, layout, path)
    found = arena.header[: len(layout.words())].tolist()
    if found != layout.words():
        arena.close()
        raise ValueError(f"arena {path} has layout {found}, expected {layout.words()}")
    return arena


def unlink(path: str) -> None:
    """Remove the arena's name; mappings stay valid until they are closed."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ours(path: str) -> bool:
    """Return whether ``path`` is an arena this library made: this user's, with its magic."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        return os.fstat(fd).st_uid == os.getuid() and os.pread(fd, 8, 0) == _MAGIC_BYTES
    except OSError:
        return False
    finally:
        os.close(fd)


def sweep_stale() -> int:
    """Unlink arenas whose creator died before it could unlink them; return how many.

    Only a creator killed during a group's initialisation leaves one behind. A file
    is removed only when it is provably such an arena: named as ``create`` names
    them, owned by this user, starting with the arena magic, and made by a process
    that no longer runs.
    """
    removed = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        match = _NAME.fullmatch(name)
        if match is None or _alive(int(match.group(1))):
            continue
        path = os.path.join(SHM_DIR, name)
        if not _ours(path):
            continue
        try:
            os.unlink(path)
            removed += 1
        except OSError:
            pass
    return removed
