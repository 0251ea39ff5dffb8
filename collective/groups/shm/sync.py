"""Waiting on the arena's counters: spin briefly, then sleep on the shared word, bounded.

Every counter has one writer, the local rank whose progress it counts. A rank
that waits for a counter to reach a value polls it for a few hundred
microseconds (yielding the CPU at once when there are more local ranks than
cores), then marks itself asleep in the counter's flags and sleeps on the
counter's word with ``futex``. The writer, after advancing a counter, wakes the
word only if a flag is set, so the common case costs no system call.

Sleeps last at most ``SLICE_S``; between them a waiter looks for what would
make the wait hopeless: the deadline, the arena's abort word, a failure or
destroy reported to this process, and the death of the rank it waits on. So
a dead local peer is seen within one slice, and nothing waits past its deadline.
"""

from __future__ import annotations

import ctypes
import os
import platform
import select
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from collective.groups.shm.arena import ABORT_WORD, REASON_BYTES, Arena

SLICE_S = 0.02
"""The longest single sleep: the delay before a dead peer or an abort is seen."""

SPIN_POLLS = 3000
"""Polls of a counter before sleeping when every local rank has a core of its own: about
300 µs, longer than waking a sleeper takes here. Against 400 polls, a 2-rank 8-byte
alltoall took 158 instead of 200 µs, and a 1 MiB one 0.38 instead of 1.91 of gloo's time."""

YIELD_ROUNDS = 16
"""Rounds of (poll, yield) before sleeping when local ranks outnumber the cores."""

_SYS_FUTEX = {"x86_64": 202, "amd64": 202}
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_WAKE_ALL = 0x7FFFFFFF


class PeerDiedError(Exception):
    """The process of a local rank this rank waits on has exited."""

    def __init__(self, local_rank: int) -> None:
        """Record which local rank died."""
        super().__init__(f"local rank {local_rank} died")
        self.local_rank = local_rank


class StalledError(TimeoutError):
    """A wait ran out of time; ``local_rank`` is the rank whose step never came."""

    def __init__(self, local_rank: int) -> None:
        """Record which local rank this rank waited on."""
        super().__init__(f"local rank {local_rank} did not take its step in time")
        self.local_rank = local_rank


class AbortedError(Exception):
    """The wait was given up on: another rank failed, or the group was destroyed.

    ``local_rank`` is the local rank that set the arena's abort word, or None when this
    process gave up (a failure reported through the store, a destroy).
    """

    def __init__(self, reason: str, local_rank: int | None = None) -> None:
        """Record why, and which local rank aborted, if one did."""
        super().__init__(reason)
        self.local_rank = local_rank


def unsupported_reason() -> str:
    """Return why the shared-memory transport cannot run here, or "" if it can.

    It needs Linux's futex and the store ordering of x86-64: a rank writes a
    message, then the counter that announces it, with plain stores, and a reader
    on another core must never see the counter before the message.
    """
    if not sys.platform.startswith("linux"):
        return f"the shared-memory transport needs Linux, this is {sys.platform}"
    machine = platform.machine().lower()
    if machine not in _SYS_FUTEX:
        return f"the shared-memory transport needs x86-64's memory ordering, this is {machine}"
    if not os.path.isdir("/dev/shm"):
        return "the shared-memory transport needs /dev/shm, which is missing"
    return ""


class _Timespec(ctypes.Structure):
    _fields_ = (("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long))


class _Kernel:
    """The futex system call, through ctypes, and a full memory fence."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._syscall = libc.syscall
        self._syscall.restype = ctypes.c_long
        self._number = _SYS_FUTEX[platform.machine().lower()]
        self._trylock = libc.pthread_spin_trylock
        self._trylock.argtypes = (ctypes.c_void_p,)
        self._trylock.restype = ctypes.c_int
        self._spin = ctypes.c_int(1)
        self._spin_address = ctypes.addressof(self._spin)
        lock = threading.Lock()
        self._acquire, self._release = lock.acquire, lock.release

    def fence(self) -> None:
        """Order every earlier store before every later load (a locked instruction).

        Taking a free lock is an atomic read-modify-write, which x86-64 runs as a
        locked instruction, a full fence: a Python lock costs about a quarter of a
        ctypes call. When another thread holds the lock, taking it may fail without
        writing, so the fence falls back to ``pthread_spin_trylock`` on a held
        spinlock, whose exchange always writes.
        """
        if self._acquire(False):
            self._release()
        else:
            self._trylock(self._spin_address)

    def wait(self, address: int, expected: int, seconds: float) -> None:
        """Sleep while the 32-bit word at ``address`` holds ``expected``, up to ``seconds``."""
        low = expected & 0xFFFFFFFF
        low -= (low >> 31) << 32
        whole = int(seconds)
        spec = _Timespec(whole, int((seconds - whole) * 1e9))
        self._syscall(
            self._number,
            ctypes.c_void_p(address),
            _FUTEX_WAIT,
            ctypes.c_int(low),
            ctypes.byref(spec),
            None,
            0,
        )

    def wake(self, address: int) -> None:
        """Wake every thread sleeping on the word at ``address``."""
        self._syscall(self._number, ctypes.c_void_p(address), _FUTEX_WAKE, _WAKE_ALL, None, None, 0)


_kernel: _Kernel | None = None


def kernel() -> _Kernel:
    """Return the process's futex and fence helpers, made on first use."""
    global _kernel
    if _kernel is None:
        _kernel = _Kernel()
    return _kernel


@dataclass
class Counter:
    """One monotonically increasing int64 in the arena, advanced by one local rank only."""

    cells: np.ndarray
    """An int64 view holding the counter at ``index``."""
    index: int
    address: int
    flags: np.ndarray
    """One byte per local rank: 1 while that rank sleeps on this counter."""
    flag_words: np.ndarray
    owner: int
    """The local rank that advances it."""


class Liveness:
    """Tell whether local peers' processes are still running, by pidfd or by /proc."""

    def __init__(self, pids: list[int]) -> None:
        """Watch the processes ``pids`` (one per local rank; this process's own is skipped)."""
        me = os.getpid()
        self._pids = pids
        self._fds: dict[int, int] = {}
        for rank, pid in enumerate(pids):
            if pid == me:
                continue
            try:
                self._fds[rank] = os.pidfd_open(pid)
            except (AttributeError, OSError):
                pass

    def alive(self, rank: int) -> bool:
        """Return whether local rank ``rank``'s process is still running."""
        pid = self._pids[rank]
        if pid == os.getpid():
            return True
        fd = self._fds.get(rank)
        if fd is not None:
            readable, _, _ = select.select([fd], [], [], 0)
            return not readable
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                state = stat.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        return state not in (b"Z", b"X")

    def close(self) -> None:
        """Release the pidfds."""
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


class Waiter:
    """One local rank's waits on, and advances of, the counters of one arena."""

    def __init__(
        self,
        arena: Arena,
        local_rank: int,
        liveness: Liveness,
        interrupted: Callable[[], str | None],
    ) -> None:
        """Wait as ``local_rank`` of ``arena``.

        Args:
            arena: the mapped arena.
            local_rank: this rank's index among the arena's ranks.
            liveness: tells whether peers' processes still run.
            interrupted: returns why every wait must end now (a reported failure,
                a destroy), or None; called between sleeps, so it must be cheap.

        """
        self._arena = arena
        self._me = local_rank
        self._liveness = liveness
        self._interrupted = interrupted
        self._kernel = kernel()
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        self._crowded = arena.layout.local_size > cores
        self._header = arena.header
        self._reasons = [arena.reason(r) for r in range(arena.layout.local_size)]

    def release(self) -> None:
        """Drop this waiter's view of the arena, so that it can be unmapped."""
        self._header = np.zeros(ABORT_WORD + 1, np.int64)
        self._reasons = []

    def reason_of(self, local_rank: int) -> str:
        """Return why ``local_rank`` set the abort word, as it wrote it ("" if it did not)."""
        if local_rank >= len(self._reasons):
            return ""
        area = self._reasons[local_rank]
        length = min(int(area[:8].view(np.int64)[0]), REASON_BYTES - 8)
        return bytes(area[8 : 8 + max(length, 0)]).decode(errors="replace")

    def aborted_by(self) -> int | None:
        """Return the local rank that set the abort word, or None."""
        value = int(self._header[ABORT_WORD])
        return value - 1 if value else None

    def _hopeless(self, counter: Counter, deadline: float) -> None:
        """Raise if the wait on ``counter`` can no longer succeed."""
        by = self.aborted_by()
        if by is not None:
            raise AbortedError(self.reason_of(by), by)
        reason = self._interrupted()
        if reason is not None:
            raise AbortedError(reason)
        if not self._liveness.alive(counter.owner):
            raise PeerDiedError(counter.owner)
        if time.monotonic() >= deadline:
            raise StalledError(counter.owner)

    def wait(self, counter: Counter, target: int, deadline: float) -> None:
        """Return once ``counter`` is at least ``target``.

        Raises:
            TimeoutError: ``deadline`` (a ``time.monotonic`` time) passed first.
            PeerDiedError: the counter's writer died.
            AbortedError: another rank aborted, or this process gave up on the group.

        """
        cells, index = counter.cells, counter.index
        if cells[index] >= target:
            return
        if self._crowded:
            for _ in range(YIELD_ROUNDS):
                os.sched_yield()
                if cells[index] >= target:
                    return
        else:
            for _ in range(SPIN_POLLS):
                if cells[index] >= target:
                    return
        flags, me = counter.flags, self._me
        while True:
            self._hopeless(counter, deadline)
            flags[me] = 1
            observed = int(cells[index])
            if observed < target:
                left = min(SLICE_S, max(deadline - time.monotonic(), 0.0005))
                self._kernel.wait(counter.address, observed, left)
            flags[me] = 0
            if cells[index] >= target:
                return

    def advance(self, counter: Counter, value: int) -> None:
        """Set ``counter`` (one of this rank's) to ``value`` and wake whoever sleeps on it."""
        counter.cells[counter.index] = value
        self._kernel.fence()
        if any(counter.flag_words.tolist()):
            self._kernel.wake(counter.address)

    def abort(self, counters: list[Counter], reason: str) -> None:
        """Write ``reason``, set the arena's abort word, and wake every sleeper on ``counters``.

        The other local ranks' waits then raise ``AbortedError`` with the reason
        written by the first rank that set the word.
        """
        if not self._header[ABORT_WORD]:
            text = reason.encode()[: REASON_BYTES - 8]
            area = self._reasons[self._me]
            area[8 : 8 + len(text)] = np.frombuffer(text, np.uint8)
            area[:8].view(np.int64)[0] = len(text)
            self._kernel.fence()
            self._header[ABORT_WORD] = self._me + 1
        self.wake_all(counters)

    def wake_all(self, counters: list[Counter]) -> None:
        """Wake every thread sleeping on any of ``counters``, so it looks at its wait again."""
        self._kernel.fence()
        for counter in counters:
            self._kernel.wake(counter.address)
