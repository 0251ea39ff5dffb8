"""NCCL as the stand-in runs it: each rank's launch is a kernel on the device clock.

``nccl_binding`` checks every call against cupy's real binding, then hands the calls it
accepts here. NCCL's rules that a test can break are kept:

- **Matching across ranks.** A communicator's k-th launch (one call, or the calls of one
  ``groupStart``/``groupEnd`` on it) meets the k-th launch of every other rank of its
  communicator (``World``): a kernel on the launch's stream that completes only when
  every rank's stream has reached its own (``DeviceClock.meet``). Launches that do not
  match (another collective, count, dtype, reduction or root; a send without its
  receive) never complete, as a real mismatched collective hangs, until the
  communicator is aborted (``cancel``).
- **Data.** A launch that matches moves the bytes NCCL would, in ``device_clock.MEMORY``:
  allreduce, reduce, broadcast, allgather, reduce-scatter, send/recv, in every dtype
  but bfloat16's reductions (left alone).
- **First-use connections** (``NCCL_RUNTIME_CONNECT``, the default): a communicator's
  first collective, and its first send or receive with each peer, block the calling
  host thread, inside the NCCL call, until the peers have issued theirs. A peer that
  never does leaves it blocked: the stand-in gives up after the clock's bound with
  ``ClockTimeoutError`` (a real GPU would block forever).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tests.device_clock import MEMORY, bounded_wait

DTYPES: dict[int, Any] = {
    0: np.int8,
    1: np.uint8,
    2: np.int32,
    3: np.uint32,
    4: np.int64,
    5: np.uint64,
    6: np.float16,
    7: np.float32,
    8: np.float64,
    9: None,  # bfloat16: moved as bytes, never reduced
}
"""numpy's type of each ``ncclDataType_t``."""

_SIZES = {9: 2}

COLLECTIVES = frozenset({"allReduce", "reduce", "broadcast", "bcast", "allGather", "reduceScatter"})
P2P = frozenset({"send", "recv"})

Call = tuple[str, tuple[Any, ...]]


def _itemsize(dtype: int) -> int:
    found = DTYPES.get(dtype)
    return _SIZES.get(dtype, 1) if found is None else int(np.dtype(found).itemsize)


def _read(ptr: int, count: int, dtype: int) -> np.ndarray | None:
    raw = MEMORY.view(ptr, count * _itemsize(dtype))
    if raw is None:
        return None
    found = DTYPES.get(dtype)
    return raw.view(np.uint16 if found is None else found)


def _reduce(parts: Sequence[np.ndarray], op: int, dtype: int) -> np.ndarray | None:
    if DTYPES.get(dtype) is None:
        return None
    stack = np.stack(parts)
    if op == 0:
        return stack.sum(axis=0, dtype=stack.dtype)
    if op == 1:
        return stack.prod(axis=0, dtype=stack.dtype)
    if op == 2:
        return stack.max(axis=0)
    if op == 3:
        return stack.min(axis=0)
    summed = stack.sum(axis=0, dtype=stack.dtype)
    if np.issubdtype(stack.dtype, np.integer):
        return (summed // len(parts)).astype(stack.dtype)
    return (summed / len(parts)).astype(stack.dtype)


def _shape(call: Call) -> tuple[Any, ...]:
    """Return what must be equal in the i-th collective call of every rank."""
    name, args = call
    if name == "allReduce":
        return (name, args[2], args[3], args[4])
    if name == "reduce":
        return (name, args[2], args[3], args[4], args[5])
    if name == "broadcast":
        return (name, args[2], args[3], args[4])
    if name == "bcast":
        return ("broadcast", args[1], args[2], args[3])
    if name in ("allGather", "reduceScatter"):
        return (name, *args[2:-1])
    return (name,)


def matches(launches: list[tuple[int, list[Call]]]) -> bool:
    """Return whether the ranks' launches (``(nccl rank, calls)``) are one NCCL op."""
    shapes = {tuple(_shape(c) for c in calls if c[0] in COLLECTIVES) for _, calls in launches}
    if len(shapes) != 1:
        return False
    for rank, calls in launches:
        for peer, peer_calls in launches:
            sent = [(a[1], a[2]) for n, a in calls if n == "send" and a[3] == peer]
            taken = [(a[1], a[2]) for n, a in peer_calls if n == "recv" and a[3] == rank]
            if sent != taken:
                return False
    return True


def move(launches: list[tuple[int, list[Call]]], misuse: list[str] | None = None) -> None:
    """Move the bytes of matched launches, every read before any write (in-place calls).

    A buffer at an address no live allocation holds (memory freed while a launch still
    reads or writes it) is logged in ``misuse``.
    """
    unknown = [
        f"an NCCL {name} of rank {rank} on the device reads or writes {ptr:#x}, which no live "
        "allocation holds (freed while the launch was queued)"
        for rank, calls in launches
        for name, args in calls
        for ptr, count, dtype in _buffers(name, args, len(launches))
        if MEMORY.view(ptr, count * _itemsize(dtype)) is None
    ]
    if misuse is not None:
        misuse.extend(unknown)
    by_rank = dict(launches)
    writes: list[tuple[int, np.ndarray]] = []
    collective = [[c for c in by_rank[r] if c[0] in COLLECTIVES] for r in sorted(by_rank)]
    ranks = sorted(by_rank)
    for i in range(len(collective[0]) if collective else 0):
        calls = [collective[r][i] for r in range(len(ranks))]
        writes += _collective(ranks, calls)
    for rank in ranks:
        for peer in ranks:
            sent = [a for n, a in by_rank[rank] if n == "send" and a[3] == peer]
            taken = [a for n, a in by_rank[peer] if n == "recv" and a[3] == rank]
            for send, recv in zip(sent, taken, strict=True):
                source = _read(send[0], send[1], send[2])
                if source is not None:
                    writes.append((recv[0], source.copy()))
    for ptr, data in writes:
        target = MEMORY.view(ptr, data.nbytes)
        if target is not None:
            target[:] = np.ascontiguousarray(data).view(np.uint8).reshape(-1)


def _buffers(name: str, args: tuple[Any, ...], n: int) -> list[tuple[int, int, int]]:
    """Return the ``(address, count, dtype)`` of each buffer an NCCL call touches."""
    if name in P2P:
        return [(args[0], args[1], args[2])]
    if name == "bcast":
        return [(args[0], args[1], args[2])]
    count, dtype = args[2], args[3]
    if name == "allGather":
        return [(args[0], count, dtype), (args[1], count * n, dtype)]
    if name == "reduceScatter":
        return [(args[0], count * n, dtype), (args[1], count, dtype)]
    return [(args[0], count, dtype), (args[1], count, dtype)]


def _all(calls: list[Call], count: int, dtype: int) -> list[np.ndarray] | None:
    """Return each call's send buffer (its first argument), or None if one is unknown."""
    found = [_read(args[0], count, dtype) for _, args in calls]
    parts = [p for p in found if p is not None]
    return parts if len(parts) == len(found) else None


def _collective(ranks: list[int], calls: list[Call]) -> list[tuple[int, np.ndarray]]:
    """Return the writes of one collective call made by every rank (``calls`` in rank order)."""
    name, a0 = calls[0]
    if name == "bcast":
        data = _read(calls[ranks.index(a0[3])][1][0], a0[1], a0[2])
        return [] if data is None else [(args[0], data.copy()) for _, args in calls]
    count, dtype = a0[2], a0[3]
    if name == "broadcast":
        data = _read(calls[ranks.index(a0[4])][1][0], count, dtype)
        return [] if data is None else [(args[1], data.copy()) for _, args in calls]
    n = len(calls)
    parts = _all(calls, count * n if name == "reduceScatter" else count, dtype)
    if parts is None:
        return []
    if name == "allGather":
        whole = np.concatenate(parts)
        return [(args[1], whole) for _, args in calls]
    if name == "reduceScatter":
        out = []
        for j, (_, args) in enumerate(calls):
            reduced = _reduce([p[j * count : (j + 1) * count] for p in parts], a0[4], dtype)
            if reduced is not None:
                out.append((args[1], reduced))
        return out
    reduced = _reduce(parts, a0[4], dtype)
    if reduced is None:
        return []
    if name == "reduce":
        return [(calls[ranks.index(a0[5])][1][1], reduced)]
    return [(args[1], reduced) for _, args in calls]


@dataclass(eq=False)
class World:
    """The communicators made from one unique ID: one per NCCL rank."""

    nranks: int
    clock: Any
    """The ``DeviceClock`` (or a ``Process`` of it) whose bound ends a blocked connect."""
    cond: threading.Condition = field(default_factory=threading.Condition)
    connected: dict[Any, set[int]] = field(default_factory=dict)
    """Each connection (``"collective"`` or a pair of ranks) and the ranks that asked for it."""

    def announce(self, rank: int, launch: list[Call]) -> dict[Any, int]:
        """Ask for the connections ``launch`` needs; return them, with how many ranks each has."""
        wanted: dict[Any, int] = {}
        if any(name in COLLECTIVES for name, _ in launch):
            wanted["collective"] = self.nranks
        for name, args in launch:
            if name in P2P:
                wanted[frozenset((rank, args[3]))] = 2
        with self.cond:
            for key in wanted:
                self.connected.setdefault(key, set()).add(rank)
            self.cond.notify_all()
        return wanted

    def connect(self, rank: int, wanted: dict[Any, int], aborted: Any) -> None:
        """Block, as NCCL's first use does, until the peers have asked for ``wanted`` too.

        ``aborted()`` says whether the caller's communicator was aborted meanwhile.
        """
        clock = getattr(self.clock, "clock", self.clock)

        def done() -> bool:
            return aborted() or all(len(self.connected[k]) >= n for k, n in wanted.items())

        what = (
            f"NCCL rank {rank}'s first use of a connection: a peer never made the matching "
            "call (NCCL blocks in the call)"
        )
        with self.cond:
            bounded_wait(self.cond, done, what, clock.bound_s)

    def wake(self) -> None:
        """Wake the threads blocked in ``connect`` (a communicator was aborted)."""
        with self.cond:
            self.cond.notify_all()


_worlds: dict[tuple[bytes, int], World] = {}
_worlds_lock = threading.Lock()


def world(uid: Any, nranks: int, clock: Any) -> World:
    """Return the world of unique ID ``uid`` (bytes, or cupy 13's chars), made on first use."""
    key = (bytes(b & 0xFF for b in uid), nranks)
    with _worlds_lock:
        found = _worlds.get(key)
        if found is None:
            found = _worlds[key] = World(nranks, clock)
        return found
