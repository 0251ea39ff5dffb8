"""A GPU stood in for on the device clock, for the shared-GPU transport and CUDA RDT's path.

``HostGpu`` is one "GPU" that the ranks of a test share: its memory is host memory at
real addresses, its streams and events are a ``DeviceClock``'s (``tests/device_clock.py``).
Each rank (a thread of the test, standing for a process) gets a ``HostDevice`` over it,
which implements the transport's ``Device`` (and RDT's ``query``) with a clock
``Process`` of its own: the same stream handle names another queue in each rank, as
on a real machine, and memory and events opened through IPC are the owner's.

Work runs as a GPU runs it, later and in stream order:

- ``copy`` queues the copy; a copy from host memory takes its bytes at once and a copy
  into host memory returns once it ran, as ``cudaMemcpyAsync`` does with pageable memory;
- the arrays ``view`` returns (``DeviceBytes``) queue every write and every ufunc that
  has an ``out`` on the thread's current stream (``on_stream``; outside one, the rank's
  legacy stream), reading their operands when the device reaches them, as cupy's
  kernels do; anything that reads them on the host waits for that stream first;
- an event completes when its stream reaches the record, and a wait orders a stream
  after what the event captured when the wait was called.

So a missing stream wait, or one on the wrong record, shows as wrong data. Memory the
GPU knows is what ``alloc`` made and what a test hands an op as GPU memory
(``device_bytes``, ``gpu_tensor``: kept in ``device_clock.MEMORY`` while it lives); any
other address is host memory. Queued work holds the buffers it touches until it ran, as
torch's and cupy's allocators keep a block for the work queued on its stream.

CUDA's rules are checked, each breach logged in ``HostGpu.misuse``: a process may not
open its own handles, nor one twice; an owner may not free memory or destroy an event
a peer still has open; only an event's owner records it; work may not touch memory
freed before the device reached it. ``waits``, ``records``, ``streams`` and ``made``
log what a rank did, so that tests can check which record each wait captured and that
nothing is made or exported per op.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
from cupy.cuda.runtime import CUDARuntimeError

from collective.frameworks.bytelist import raw_bytes
from tests.device_clock import MEMORY, NOT_READY, SUCCESS, DeviceClock, Gate

_current = threading.local()
"""Per thread: the stack of (rank's device, stream) that ``on_stream`` made current."""


def _stack() -> list[tuple[HostDevice, int]]:
    stack: list[tuple[HostDevice, int]] | None = getattr(_current, "stack", None)
    if stack is None:
        stack = _current.stack = []
    return stack


@dataclass(frozen=True)
class _Held:
    """Device bytes queued work will touch, held from when it was queued (stream-ordered).

    A caller's buffer stays alive until the work ran, as torch's and cupy's allocators
    keep a block for the work queued on its stream; an allocation (``base``) freed
    before the work ran is a misuse, which the work finds (``ok``) and then skips.
    """

    array: np.ndarray
    gpu: HostGpu | None = None
    base: int | None = None

    def ok(self, what: str) -> bool:
        """Return whether the memory is still allocated; log a misuse if not."""
        if self.gpu is None or self.base is None:
            return True
        with self.gpu.lock:
            if self.base in self.gpu.memory:
                return True
            self.gpu.misuse.append(f"{what} touched memory freed before the device reached it")
        return False


def _operand(value: Any) -> Any:
    """Return what work queued now reads later: device bytes (held), host bytes (taken now)."""
    if isinstance(value, DeviceBytes):
        return value.hold()
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, (list, tuple)):
        return type(value)(_operand(v) for v in value)
    return value


def _plain(value: Any) -> Any:
    """Return ``value`` with its held device bytes as numpy."""
    if isinstance(value, _Held):
        return value.array
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def _all_ok(value: Any, what: str) -> bool:
    """Return whether all the device bytes ``value`` holds are still allocated."""
    if isinstance(value, _Held):
        return value.ok(what)
    if isinstance(value, (list, tuple)):
        return all(_all_ok(v, what) for v in value)
    return True


class DeviceBytes(np.ndarray):
    """Device memory as cupy's arrays use it: every write and kernel is queued on a stream.

    A write (``x[...] = y``) or a ufunc with ``out`` runs when the thread's current
    stream reaches it (see the module docstring); a ufunc without ``out``, a numpy
    function, ``get`` and ``copy`` wait for that stream, then read. Like cupy, it
    refuses to be filled from a list. A plain numpy array stands for host memory.

    It owns nothing, as a view of device memory does not: work finds its memory by its
    address when queued (``hold``), and a view of memory the GPU does not know fails.
    """

    owner: HostDevice | None = None
    """The rank whose legacy stream takes work queued outside any ``on_stream``."""

    _keep: np.ndarray | None = None
    """The memory of an array made here (``copy``), which its views keep alive."""

    def __array_finalize__(self, obj: Any) -> None:
        self.owner = getattr(obj, "owner", None)
        self._keep = getattr(obj, "_keep", None)

    def _owned(self, owner: HostDevice | None) -> DeviceBytes:
        self.owner = owner
        return self

    def hold(self) -> _Held:
        """Return these bytes as numpy that holds their memory, and their allocation.

        Raises:
            AssertionError: the GPU does not know the memory (never made, or freed).

        """
        at = int(self.ctypes.data)
        span = self.nbytes  # a strided view (positive strides) spans to its last element
        if self.size and not self.flags.c_contiguous:
            ends = zip(self.shape, self.strides, strict=True)
            span = self.itemsize + sum((n - 1) * st for n, st in ends)
        gpu = self.owner.gpu if self.owner is not None else None
        found = gpu.find(at, span) if gpu is not None else None
        if found is None:
            flat = MEMORY.view(at, span)
            if flat is None:
                raise AssertionError(f"the stand-in GPU knows no memory at {at:#x} (freed?)")
            found = (flat, None)
        flat, base = found
        if self.flags.c_contiguous:
            array = flat.view(self.dtype).reshape(self.shape)
        else:
            array = np.ndarray(self.shape, self.dtype, flat, 0, self.strides)
        return _Held(array, gpu, base)

    def _where(self) -> tuple[HostDevice | None, int]:
        stack = _stack()
        return stack[-1] if stack else (self.owner, 0)

    def _queue(self, run: Callable[[], object], name: str) -> None:
        device, stream = self._where()
        if device is None:
            run()
        else:
            device.submit(stream, run, name)

    def _synchronize(self) -> None:
        device, stream = self._where()
        if device is not None:
            device.stream_synchronize(stream)

    def __setitem__(self, key: Any, value: Any) -> None:
        if isinstance(value, (list, tuple)):
            raise ValueError("non-scalar value cannot be used for fill (as cupy refuses it)")
        target, source = self.hold(), _operand(value)

        def run() -> None:
            if _all_ok((target, source), "a write"):
                target.array[key] = _plain(source)

        self._queue(run, "write")

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        call, out = getattr(ufunc, method), kwargs.pop("out", None)
        if out is None:
            self._synchronize()
            return call(*_plain(_operand(inputs)), **kwargs)
        operands, outs = _operand(inputs), _operand(tuple(out))

        def run() -> None:
            if _all_ok((operands, outs), ufunc.__name__):
                call(*_plain(operands), out=_plain(outs), **kwargs)

        self._queue(run, ufunc.__name__)
        return out[0] if len(out) == 1 else out

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        self._synchronize()
        plain = {k: _plain(_operand(v)) for k, v in kwargs.items()}
        return func(*_plain(_operand(args)), **plain)

    def get(self) -> np.ndarray:
        """Return the bytes on the host once the current stream has written them (cupy's)."""
        self._synchronize()
        return self.hold().array.copy()

    def copy(self, order: Any = "C") -> DeviceBytes:
        """Return a new device array that a copy queued on the current stream fills."""
        made = device_empty(self.nbytes, self.owner).view(self.dtype).reshape(self.shape)
        made[...] = self
        return cast(DeviceBytes, made)


def device_bytes(x: np.ndarray, owner: HostDevice | None = None) -> DeviceBytes:
    """Return contiguous ``x`` as flat device bytes, which the GPU knows while ``x`` lives."""
    return raw_bytes(MEMORY.adopt(x), x.nbytes).view(DeviceBytes)._owned(owner)


@contextlib.contextmanager
def host_stage() -> Iterator[None]:
    """Run host work that stands for device work (a stood-in NCCL call) in stream order.

    Waits for the thread's current stream (``on_stream``) first: the work then sees
    what was queued before it, and what is queued after it follows it.
    """
    stack = _stack()
    if stack:
        device, stream = stack[-1]
        device.stream_synchronize(stream)
    yield


def device_empty(nbytes: int, owner: HostDevice | None = None) -> DeviceBytes:
    """Return ``nbytes`` of new device memory as flat bytes, alive while any view of it is."""
    memory = np.empty(nbytes, np.uint8)
    flat = device_bytes(memory, owner)
    flat._keep = memory
    return flat


def gpu_tensor(like: Any) -> Any:
    """Return a CPU tensor the GPU knows as its memory while it lives, equal to ``like``.

    ``like`` is a tensor (its dtype, shape and values are copied) or a byte count (a
    flat ``uint8`` tensor of zeros).
    """
    import torch

    nbytes = like if isinstance(like, int) else like.numel() * like.element_size()
    if nbytes == 0:  # no byte to know
        return torch.empty(0, dtype=torch.uint8) if isinstance(like, int) else like.clone()
    memory = np.zeros(nbytes, np.uint8)
    MEMORY.adopt(memory)
    flat = torch.from_numpy(memory)  # holds the array: known while the tensor lives
    if isinstance(like, int):
        return flat
    made = flat.view(like.dtype).view(like.shape)
    made.copy_(like)
    return made


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


def _stop(clock: DeviceClock) -> None:
    """Close ``clock`` from a thread of its own (a finalizer may run on the clock's)."""
    threading.Thread(target=clock.close, name="standin-clock-close", daemon=True).start()


class HostGpu:
    """One stand-in GPU shared by the ranks (threads) of a test, on a device clock."""

    def __init__(
        self,
        uuid: str = "standin-gpu",
        clock: DeviceClock | None = None,
        index: int = 0,
        *,
        blocking: bool = False,
    ) -> None:
        """Make an empty GPU called ``uuid``: GPU ``index`` of ``clock``, else of its own clock.

        ``blocking`` makes every ``on_stream`` block wait for its stream as it ends, for
        layers whose tests hand plain numpy arrays, which the host reads and writes at
        once, where a GPU would order them on the stream (the bulk calls' packing, the
        hierarchy's stood-in NCCL): their device work still queues and runs on the clock.
        """
        self.uuid = uuid
        self.blocking = blocking
        self.clock = clock or DeviceClock(1)
        self.index = index
        self.lock = threading.Lock()
        self.memory: dict[int, _Memory] = {}
        self.events: dict[int, _Event] = {}
        self.misuse: list[str] = []
        self._ids = itertools.count(1)
        if clock is None:
            weakref.finalize(self, _stop, self.clock)

    def live(self) -> tuple[int, int]:
        """Return how many allocations and events exist."""
        with self.lock:
            return len(self.memory), len(self.events)

    def find(self, ptr: int, nbytes: int) -> tuple[np.ndarray, int | None] | None:
        """Return the device bytes at ``ptr`` (holding their memory) and their allocation.

        The allocation is None for a buffer the GPU knows (``device_bytes``,
        ``gpu_tensor``); the whole answer None for host memory.
        """
        with self.lock:
            for base, memory in self.memory.items():
                if base <= ptr and ptr + nbytes <= base + memory.array.size:
                    return memory.array[ptr - base : ptr - base + nbytes], base
        found = MEMORY.view(ptr, nbytes)
        return None if found is None else (found, None)


class HostDevice:
    """One rank's ``Device`` on a ``HostGpu``; see the module docstring."""

    def __init__(self, gpu: HostGpu, rank: int, device_id: int = 0) -> None:
        """Act as ``rank`` on ``gpu``, which this rank numbers ``device_id``."""
        self.gpu = gpu
        self.rank = rank
        self.device_id = device_id
        self.process = gpu.clock.process()
        self.waits: list[tuple[int, int, int]] = []
        """(event, its owner, its records when waited on), in order."""
        self.records: list[tuple[int, int]] = []
        """(event, its records after this record), in order."""
        self.streams: list[tuple[str, int, int]] = []
        """("record" or "wait", the event, the stream), in order."""
        self.synchronized = 0
        """How many times ``synchronize`` was called."""
        self.opened_memory: dict[int, int] = {}
        self.opened_events: dict[int, int] = {}
        self.made: list[str] = []
        """The calls that make, export or open memory or events, by name, in order."""
        self._lock = threading.Lock()
        self._adopted: set[int] = set()
        self._ends: dict[int, int] = {}
        """Per stream: a private event recorded as each ``on_stream`` block ends."""
        self._stalls: dict[tuple[int, str], threading.Event] = {}

    # --- streams -----------------------------------------------------------------------------

    def _handle(self, stream: int) -> int:
        """Return ``stream`` once this process knows it: a handle seen first is a new stream."""
        if stream not in (0, 1):
            with self._lock:
                if stream not in self._adopted:
                    self._adopted.add(stream)
                    self.process.adopt_stream(stream, self.gpu.index, non_blocking=True)
        return stream

    def submit(self, stream: int, run: Callable[[], object], name: str) -> None:
        """Queue ``run`` on ``stream``; an exception in it is logged as a misuse."""
        gpu, rank = self.gpu, self.rank

        def guarded() -> None:
            try:
                run()
            except Exception as exc:  # on the device thread: a test must see it
                with gpu.lock:
                    gpu.misuse.append(f"rank {rank}'s {name} failed on the device: {exc!r}")

        handle = self._handle(stream)
        with self._lock:
            stall = self._stalls.pop((stream, name), None)
        if stall is not None:
            self.process.submit(handle, device=self.gpu.index, name="stall", ready=stall.is_set)
        self.process.submit(handle, guarded, device=self.gpu.index, name=name)

    def stall_next(self, stream: int, name: str) -> threading.Event:
        """Hold the next ``name`` work (a "copy", a "write") queued on ``stream`` until set.

        A kernel of unknown length lands on the stream just ahead of that work, as a
        busy stream's would: what the stream queued before it runs, the rest waits.
        """
        opened = threading.Event()
        with self._lock:
            self._stalls[(stream, name)] = opened
        return opened

    def stream_synchronize(self, stream: int) -> None:
        """Wait (bounded by the clock) until ``stream``'s queued work has run."""
        self.process.stream_synchronize(self._handle(stream), self.gpu.index)

    def destroy_stream(self, stream: int) -> None:
        """Destroy ``stream``, as a user's ``cudaStreamDestroy``; its queued work still runs."""
        self.process.destroy_stream(self._handle(stream), self.gpu.index)

    def gate(self, stream: int) -> Gate:
        """Queue a kernel on ``stream`` that runs once the returned gate is opened."""
        return self.process.gate(self._handle(stream), device=self.gpu.index)

    def stream_idle(self, stream: int) -> bool:
        """Return whether everything queued on ``stream`` has run."""
        return self.process.stream_query(self._handle(stream), self.gpu.index) == SUCCESS

    @contextlib.contextmanager
    def on_stream(self, stream: int) -> Iterator[None]:
        """Make ``stream`` this thread's current one for ``DeviceBytes`` work inside."""
        self._handle(stream)
        stack = _stack()
        stack.append((self, stream))
        try:
            yield
        finally:
            stack.pop()
            self._mark(stream)
            if self.gpu.blocking:
                self.stream_synchronize(stream)

    def _mark(self, stream: int) -> None:
        """Record ``stream``'s end event after what the block queued (``settle`` polls it)."""
        with self._lock:
            event = self._ends.get(stream)
            if event is None:
                event = self._ends[stream] = self.process.create_event(self.gpu.index)
        with contextlib.suppress(CUDARuntimeError):  # a stream destroyed meanwhile
            self.process.record(event, stream, self.gpu.index)

    def synchronize(self) -> None:
        """Wait until every stream this rank used (and its legacy stream) is idle."""
        self.synchronized += 1
        self._drain()

    def _drain(self) -> None:
        """Wait until this process's queued work has run (cudaFree's implicit synchronize)."""
        with self._lock:
            streams = [0, *self._adopted]
        for stream in streams:
            with contextlib.suppress(CUDARuntimeError):  # destroyed by its user
                self.process.stream_synchronize(stream, self.gpu.index)

    def settle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the work every ``on_stream`` block queued; say if done."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            pending = list(self._ends.values())
        while pending:
            if self.process.query(pending[-1]) != NOT_READY:
                pending.pop()
            elif time.monotonic() > deadline:
                return False
            else:
                time.sleep(0.001)
        return True

    # --- memory ------------------------------------------------------------------------------

    def uuid(self) -> str:
        """Return the stand-in GPU's name."""
        return self.gpu.uuid

    def alloc(self, nbytes: int) -> int:
        """Return the address of ``nbytes`` of new zeroed device memory."""
        self.made.append("alloc")
        array = np.zeros(nbytes, np.uint8)
        with self.gpu.lock:
            self.gpu.memory[int(array.ctypes.data)] = _Memory(self.rank, array)
        return int(array.ctypes.data)

    def free(self, ptr: int) -> None:
        """Free ``ptr`` once this process's queued work ran; a misuse if a peer has it open.

        ``cudaFree`` waits for the device as it frees: this process's work, never another's.
        """
        self._drain()
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

    def view(self, ptr: int, nbytes: int) -> DeviceBytes:
        """Return the device bytes at ``ptr`` (an allocation, or a buffer the GPU knows)."""
        if self.gpu.find(ptr, nbytes) is None:
            raise AssertionError(
                f"the stand-in GPU knows no memory at {ptr:#x} ({nbytes} bytes): hand ops "
                "GPU buffers made known by shared_gpu_standin.gpu_buffer or device_bytes"
            )
        return raw_bytes(ptr, nbytes).view(DeviceBytes)._owned(self)

    def copy(self, target: int, source: int, nbytes: int, stream: int) -> None:
        """Queue a copy of ``nbytes`` on ``stream``; see the module docstring for host memory."""
        gpu = self.gpu
        src, dst = gpu.find(source, nbytes), gpu.find(target, nbytes)
        if src is None:  # host memory: its bytes now
            src = (np.frombuffer(ctypes.string_at(source, nbytes), np.uint8), None)
        held = [_Held(src[0], gpu, src[1])]
        if dst is not None:
            held.append(_Held(dst[0], gpu, dst[1]))

        def run() -> None:
            if not _all_ok(held, f"rank {self.rank}'s copy"):
                return
            if dst is None:
                ctypes.memmove(target, held[0].array.ctypes.data, nbytes)
            else:
                held[1].array[:] = held[0].array

        self.submit(stream, run, "copy")
        if dst is None:  # into host memory: returns once copied
            self.stream_synchronize(stream)

    # --- events ------------------------------------------------------------------------------

    def new_event(self) -> int:
        """Return a new interprocess event."""
        self.made.append("new_event")
        event = self.process.create_event(self.gpu.index)
        with self.gpu.lock:
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
        self.process.destroy_event(event)

    def record(self, event: int, stream: int) -> None:
        """Record ``event`` on ``stream`` (only its owner records it in these protocols)."""
        stream = self._handle(stream)
        with self.gpu.lock:
            found = self.gpu.events[event]
            if found.owner != self.rank:
                self.gpu.misuse.append(f"rank {self.rank} recorded rank {found.owner}'s event")
            found.records += 1
            self.records.append((event, found.records))
            self.streams.append(("record", event, stream))
            self.process.record(event, stream, self.gpu.index)

    def wait(self, stream: int, event: int) -> None:
        """Order ``stream`` after what ``event`` captured now; log the records it had."""
        stream = self._handle(stream)
        with self.gpu.lock:
            found = self.gpu.events[event]
            self.waits.append((event, found.owner, found.records))
            self.streams.append(("wait", event, stream))
            self.process.wait_event(stream, event, self.gpu.index)

    def query(self, event: int) -> bool:
        """Return whether ``event`` completed (RDT's ``IpcDevice``); a bad one is a misuse."""
        status = self.process.query(event)
        if status in (SUCCESS, NOT_READY):
            return status == SUCCESS
        with self.gpu.lock:
            self.gpu.misuse.append(f"rank {self.rank} queried event {event:#x}: status {status}")
        raise CUDARuntimeError(status)
