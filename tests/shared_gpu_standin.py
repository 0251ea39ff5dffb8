"""A GPU stood in for by host memory, for the shared-GPU transport on a machine without one.

``HostGpu`` is one "GPU" that the ranks of a test (threads of this process) share:
its memory is numpy arrays, its events are counters of how often each was recorded.
Each rank gets a ``HostDevice`` over it, which implements the transport's ``Device``
interface with CUDA's rules made checkable:

- a process may not open its own handles, nor a handle twice without closing it;
- an owner may not free memory that a peer still has open, nor destroy an event a
  peer still has open (CUDA leaves both undefined): each is logged in ``misuse``;
- every stream wait logs which event it waited on and how many records the event
  had then (``waits``), so a test can check that each wait captured exactly the
  record the protocol meant it to;
- every call that makes, exports or opens memory or an event is logged (``made``),
  so a test can check that none runs per op: a caller's buffer is never exported.

Streams are synchronous (every copy and reduction runs at once on the host), so the
data that the transport's ops compute is what the step protocol alone guarantees.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from collective.frameworks.bytelist import raw_bytes


@dataclass
class _Event:
    owner: int
    records: int = 0
    opened_by: set[int] = field(default_factory=set)


@dataclass
class _Memory:
    owner: int
    array: np.ndarray
    opened_by: set[int] = field(default_factory=set)


class DeviceBytes(np.ndarray):
    """Device memory as cupy takes writes into it: from device arrays and scalars only.

    cupy fills a device array from a non-array value (``ndarray.fill``), which refuses
    anything but a scalar: a list of sizes written into a slot raises on a GPU, so it
    raises here too. Views of it (and numpy's results on it) stay ``DeviceBytes``; a
    plain numpy array stands for a caller's device buffer or another device array.
    """

    def __setitem__(self, key: Any, value: Any) -> None:
        if isinstance(value, (list, tuple)):
            raise ValueError("non-scalar value cannot be used for fill (as cupy refuses it)")
        super().__setitem__(key, value)


class HostGpu:
    """One stand-in GPU shared by the ranks (threads) of a test."""

    def __init__(self, uuid: str = "standin-gpu") -> None:
        """Make an empty GPU called ``uuid``."""
        self.uuid = uuid
        self.lock = threading.Lock()
        self.memory: dict[int, _Memory] = {}
        self.events: dict[int, _Event] = {}
        self.misuse: list[str] = []
        self._ids = itertools.count(1)

    def live(self) -> tuple[int, int]:
        """Return how many allocations and events exist."""
        with self.lock:
            return len(self.memory), len(self.events)


class HostDevice:
    """One rank's ``Device`` on a ``HostGpu``; see the module docstring."""

    def __init__(self, gpu: HostGpu, rank: int, device_id: int = 0) -> None:
        """Act as ``rank`` on ``gpu``, which this rank numbers ``device_id``."""
        self.gpu = gpu
        self.rank = rank
        self.device_id = device_id
        self.waits: list[tuple[int, int, int]] = []
        """(event, its owner, its records when waited on), in order."""
        self.records: list[tuple[int, int]] = []
        """(event, its records after this record), in order."""
        self.streams: list[tuple[str, int, int]] = []
        """("record" or "wait", the event, the stream), in order."""
        self.synchronized = 0
        """How many times ``synchronize`` was called."""
        self.settles = True
        """What ``settle`` says: False stands for device work that never finishes."""
        self.opened_memory: dict[int, int] = {}
        self.opened_events: dict[int, int] = {}
        self.made: list[str] = []
        """The calls that make, export or open memory or events, by name, in order."""

    def uuid(self) -> str:
        """Return the stand-in GPU's name."""
        return self.gpu.uuid

    def alloc(self, nbytes: int) -> int:
        """Return the address of ``nbytes`` of new zeroed host memory."""
        self.made.append("alloc")
        array = np.zeros(nbytes, np.uint8)
        with self.gpu.lock:
            self.gpu.memory[int(array.ctypes.data)] = _Memory(self.rank, array)
        return int(array.ctypes.data)

    def free(self, ptr: int) -> None:
        """Free ``ptr``; log a misuse when a peer still has it open."""
        with self.gpu.lock:
            memory = self.gpu.memory.pop(ptr)
            if memory.owner != self.rank:
                self.gpu.misuse.append(f"rank {self.rank} freed rank {memory.owner}'s memory")
            if memory.opened_by:
                self.gpu.misuse.append(
                    f"rank {self.rank} freed memory open in ranks {sorted(memory.opened_by)}"
                )

    def export_memory(self, ptr: int) -> bytes:
        """Return a 64-byte handle of ``ptr``."""
        self.made.append("export_memory")
        if self.gpu.memory[ptr].owner != self.rank:
            raise RuntimeError("only the owner exports memory")
        return ptr.to_bytes(64, "little")

    def open_memory(self, handle: bytes) -> int:
        """Open a peer's memory; refuse this rank's own, as CUDA does."""
        self.made.append("open_memory")
        ptr = int.from_bytes(handle, "little")
        with self.gpu.lock:
            memory = self.gpu.memory[ptr]
            if memory.owner == self.rank:
                raise RuntimeError("cudaErrorInvalidContext: a process cannot open its own handle")
            if self.rank in memory.opened_by:
                self.gpu.misuse.append(f"rank {self.rank} opened memory twice")
            memory.opened_by.add(self.rank)
        self.opened_memory[ptr] = ptr
        return ptr

    def close_memory(self, ptr: int) -> None:
        """Close a peer's memory."""
        with self.gpu.lock:
            self.gpu.memory[ptr].opened_by.discard(self.rank)
        del self.opened_memory[ptr]

    def new_event(self) -> int:
        """Return a new event."""
        self.made.append("new_event")
        with self.gpu.lock:
            event = next(self.gpu._ids)
            self.gpu.events[event] = _Event(self.rank)
        return event

    def export_event(self, event: int) -> bytes:
        """Return a 64-byte handle of ``event``."""
        self.made.append("export_event")
        return event.to_bytes(64, "little")

    def open_event(self, handle: bytes) -> int:
        """Open a peer's event; refuse this rank's own."""
        self.made.append("open_event")
        event = int.from_bytes(handle, "little")
        with self.gpu.lock:
            found = self.gpu.events[event]
            if found.owner == self.rank:
                raise RuntimeError("a process cannot open its own event handle")
            found.opened_by.add(self.rank)
        self.opened_events[event] = event
        return event

    def destroy_event(self, event: int) -> None:
        """Destroy an event: close it if a peer's, else free it (logging a misuse if open)."""
        with self.gpu.lock:
            found = self.gpu.events[event]
            if found.owner != self.rank:
                found.opened_by.discard(self.rank)
                del self.opened_events[event]
                return
            if found.opened_by:
                self.gpu.misuse.append(
                    f"rank {self.rank} destroyed an event open in ranks {sorted(found.opened_by)}"
                )
            del self.gpu.events[event]

    def record(self, event: int, stream: int) -> None:
        """Count a record of ``event`` (only its owner records it in this protocol)."""
        with self.gpu.lock:
            found = self.gpu.events[event]
            if found.owner != self.rank:
                self.gpu.misuse.append(f"rank {self.rank} recorded rank {found.owner}'s event")
            found.records += 1
            self.records.append((event, found.records))
            self.streams.append(("record", event, stream))

    def wait(self, stream: int, event: int) -> None:
        """Log a wait on ``event`` with the records it has now."""
        with self.gpu.lock:
            found = self.gpu.events[event]
            self.waits.append((event, found.owner, found.records))
            self.streams.append(("wait", event, stream))

    def copy(self, target: int, source: int, nbytes: int, stream: int) -> None:
        """Copy ``nbytes`` between host addresses, at once."""
        ctypes.memmove(target, source, nbytes)

    def view(self, ptr: int, nbytes: int) -> np.ndarray:
        """Return the bytes at ``ptr``: in an allocation, or a caller's (host) buffer."""
        with self.gpu.lock:
            for base, memory in self.gpu.memory.items():
                if base <= ptr and ptr + nbytes <= base + memory.array.size:
                    return memory.array[ptr - base : ptr - base + nbytes].view(DeviceBytes)
        return raw_bytes(ptr, nbytes)

    def on_stream(self, stream: int) -> Any:
        """Return a context that does nothing: the stand-in's streams are synchronous."""
        return contextlib.nullcontext()

    def settle(self, timeout_s: float) -> bool:
        """Return ``settles`` (True unless a test says otherwise): nothing is ever queued."""
        return self.settles

    def synchronize(self) -> None:
        """Count the call: every operation has finished already."""
        self.synchronized += 1
