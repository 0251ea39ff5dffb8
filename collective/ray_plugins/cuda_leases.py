"""Which processes still map a producer's CUDA object: leases in a small file of the node.

A consumer that opens a producer's buffer through CUDA IPC takes a lease first, and
gives it back once it closed the mapping; a read that stops before its copies complete
parks its mapping (``cuda_objects``), and keeps its lease until the mapping closes. The
producer frees an object's buffer only when no live process holds a lease on it: CUDA
leaves freeing memory that another process still maps undefined.

The leases of an object are one file in ``/dev/shm``, named after the producer's pid
and the object's handle, that every consumer appends 24-byte records to (its pid, its
start time, +1 or -1); appends of that size are atomic. A lease of a process that died
does not count (its mappings died with it). The producer removes the file when it
frees the object; a consumer removes it when it finds the object gone or its producer
dead. Only objects that a consumer opened have a file.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter

import numpy as np

from collective.groups.shm.arena import NAME_PREFIX, SHM_DIR
from collective.ray_plugins import segment

_RECORD = np.dtype([("pid", "<i8"), ("started", "<i8"), ("delta", "<i8")])

_me: tuple[int, int] | None = None


def _self() -> tuple[int, int]:
    """Return this process's pid and start time, read once per process."""
    global _me
    pid = os.getpid()
    if _me is None or _me[0] != pid:  # a fork gets its own
        _me = (pid, segment.started(pid) or 0)
    return _me


def path(producer: int, memory: bytes) -> str:
    """Return the lease file of the object whose buffer handle is ``memory``."""
    digest = hashlib.blake2b(memory, digest_size=8).hexdigest()
    return os.path.join(SHM_DIR, f"{NAME_PREFIX}{producer}-lease-{digest}")


def _append(where: str, delta: int) -> None:
    pid, started = _self()
    record = np.array([(pid, started, delta)], _RECORD).tobytes()
    fd = os.open(where, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, record)
    finally:
        os.close(fd)


def take(producer: int, memory: bytes) -> None:
    """Hold a lease on the object: call before opening its handle."""
    _append(path(producer, memory), 1)


def give(producer: int, started: int, memory: bytes, *, gone: bool = False) -> None:
    """Give back a lease taken by ``take``: call once the mapping is closed.

    ``gone``: the object is freed or its producer died; the file then goes too.
    """
    where = path(producer, memory)
    if gone or not segment.alive(producer, started):
        clear(producer, memory)
        return
    _append(where, -1)


def holders(producer: int, memory: bytes) -> list[int]:
    """Return the pids of the live processes that hold a lease on the object."""
    try:
        with open(path(producer, memory), "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return []
    records = np.frombuffer(data[: len(data) // _RECORD.itemsize * _RECORD.itemsize], _RECORD)
    held: Counter[tuple[int, int]] = Counter()
    for pid, started, delta in records.tolist():
        held[(pid, started)] += delta
    return sorted(p for (p, s), n in held.items() if n > 0 and segment.alive(p, s))


def clear(producer: int, memory: bytes) -> None:
    """Remove the object's lease file, if any."""
    try:
        os.unlink(path(producer, memory))
    except FileNotFoundError:
        pass
