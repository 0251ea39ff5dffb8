"""The reads of objects in flight in this process, which ``abort_transport`` ends.

Both one-sided paths (``shm_transport`` for CPU objects, ``cuda_objects`` for CUDA ones)
hold each read here while it runs; an abort sets every held read's ``aborted`` flag,
which the read checks between its steps, and hands them back so the caller can also
cancel a read's task.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Read:
    """One read in flight: ``aborted`` is set to end it; ``ref`` is its task on another node."""

    aborted: threading.Event = field(default_factory=threading.Event)
    ref: Any = None


class Reads:
    """The reads in flight in this process, by object id."""

    def __init__(self) -> None:
        """Hold no read yet."""
        self._lock = threading.Lock()
        self._reads: dict[str, list[Read]] = {}

    @contextmanager
    def holding(self, obj_id: str, ref: Any = None) -> Iterator[Read]:
        """Hold a read of ``obj_id`` (through the task ``ref``, if any) for the block."""
        read = Read(ref=ref)
        with self._lock:
            self._reads.setdefault(obj_id, []).append(read)
        try:
            yield read
        finally:
            with self._lock:
                reads = self._reads[obj_id]
                reads.remove(read)
                if not reads:
                    del self._reads[obj_id]

    def abort(self, obj_id: str) -> list[Read]:
        """Mark every read of ``obj_id`` in flight aborted; return them."""
        with self._lock:
            reads = list(self._reads.get(obj_id, []))
        for read in reads:
            read.aborted.set()
        return reads

    def count(self, obj_id: str | None = None) -> int:
        """Return how many reads of ``obj_id`` (None: of any object) are in flight."""
        with self._lock:
            if obj_id is not None:
                return len(self._reads.get(obj_id, []))
            return sum(map(len, self._reads.values()))
