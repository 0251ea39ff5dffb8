"""cupy's real NCCL binding and CUDA runtime, driven on a machine without a GPU.

The nccl backend reaches cupy through one namespace, ``nccl_comm.cupy_module()``.
``ContractCupy`` is such a namespace in which:

- ``cuda.nccl`` is cupy's real ``cupy.cuda.nccl``: ``get_unique_id``, ``groupStart``
  and ``groupEnd`` are the real functions, and ``NcclCommunicator`` is a
  ``CheckedCommunicator`` that hands every call, argument for argument, to a real
  ``NcclCommunicator``. The real one is never initialised (there is no GPU), so a
  call that the binding accepts reaches NCCL and fails there with "invalid
  argument", which is expected and swallowed; a call it refuses raises TypeError
  (or ValueError), which is not.
- ``cuda.runtime`` hands each call the backend makes to cupy's real CUDA runtime,
  which checks the arguments and then fails for want of a driver.
- What cannot exist without a GPU is stood in for: a device (a context that keeps
  the current ordinal), events and streams (fresh integer handles), and buffers
  (``DeviceArray``: a ``__cuda_array_interface__`` over no memory). Events complete
  at once unless a test sets ``Trace.event_status``.

Every call lands in the namespace's ``Trace``, in order, with the current device and
thread, so that tests can check what the backend asked for, value for value.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, ClassVar

import cupy
import numpy as np
from cupy.cuda import nccl as real_nccl
from cupy.cuda import runtime as real_runtime

INVALID_ARGUMENT = 4
"""``ncclInvalidArgument``: what NCCL says to a call on an uninitialised communicator."""

UNHANDLED_CUDA_ERROR = 1
"""``ncclUnhandledCudaError``: what NCCL says to a communicator init without a driver."""

NOT_READY = 600
"""``cudaErrorNotReady``."""


@dataclass(frozen=True)
class _Bfloat16:
    name: str = "bfloat16"
    itemsize: int = 2
    str: str = "<V2"


BFLOAT16 = _Bfloat16()
"""bfloat16 as a dtype (hashable, as every dtype is): cupy has none, and torch's CUDA
tensors cannot be made here."""

_handles = itertools.count(0x5E00, 0x10)
_addresses = itertools.count(0x7F00_0000_0000, 1 << 20)


def no_driver() -> bool:
    """Return whether CUDA here fails for want of a driver or device, as on CI machines."""
    try:
        return int(real_runtime.getDeviceCount()) == 0
    except real_runtime.CUDARuntimeError:
        return True


@dataclass(frozen=True)
class Entry:
    """One call the backend made: its name, arguments, and where it was made."""

    name: str
    args: tuple[Any, ...]
    device: int | None
    thread: int
    comm: CheckedCommunicator | None = None


@dataclass
class Trace:
    """Every call made through one ``ContractCupy``, and the knobs tests turn."""

    entries: list[Entry] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    event_status: Callable[[int, int], int] = lambda handle, real_status: 0
    """Returns what ``eventQuery`` reports for an event, given what the real runtime said."""
    let_through: Callable[[Entry], bool] = lambda entry: False
    """Returns whether the real NCCL error of this call is raised rather than swallowed."""
    pause_s: float = 0.0
    """How long each communicator call sleeps, letting other threads run in between."""
    capturing: set[int] = field(default_factory=set)
    """The stream handles that ``streamIsCapturing`` reports as capturing a CUDA graph."""

    def add(self, entry: Entry) -> Entry:
        with self.lock:
            self.entries.append(entry)
        return entry

    def named(self, *names: str) -> list[Entry]:
        with self.lock:
            return [e for e in self.entries if e.name in names]

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()


class _Devices:
    """The current device of each thread, as CUDA keeps it."""

    def __init__(self) -> None:
        self.local = threading.local()

    def current(self) -> int | None:
        stack = getattr(self.local, "stack", [])
        return stack[-1] if stack else None


class FakeDevice:
    """``cupy.cuda.Device``: a context that makes its ordinal current on this thread."""

    def __init__(self, devices: _Devices, device: int | None = None) -> None:
        if device is not None:
            cupy.cuda.Device(device)  # refuses what cupy refuses; makes nothing current
        self._devices = devices
        self._id = device

    @property
    def id(self) -> int:
        current = self._devices.current()
        return self._id if self._id is not None else (current or 0)

    def __enter__(self) -> FakeDevice:
        stack = getattr(self._devices.local, "stack", None)
        if stack is None:
            stack = self._devices.local.stack = []
        stack.append(self.id)
        return self

    def __exit__(self, *exc: object) -> None:
        self._devices.local.stack.pop()


class FakeEvent:
    """``cupy.cuda.Event``: only its handle, ``ptr``; recorded and queried via the runtime."""

    def __init__(self, *, disable_timing: bool = False) -> None:
        self.ptr = next(_handles)
        self.disable_timing = disable_timing


class CheckedRuntime:
    """``cupy.cuda.runtime`` for the calls the backend makes, each checked by the real one."""

    CUDARuntimeError = real_runtime.CUDARuntimeError

    def __init__(self, trace: Trace, devices: _Devices) -> None:
        self._trace = trace
        self._devices = devices
        self.streams: dict[int, int] = {}
        """The handle of each stream made, by the device current when it was made."""

    def _call(self, name: str, args: tuple[Any, ...]) -> Entry:
        try:
            getattr(real_runtime, name)(*args)
        except real_runtime.CUDARuntimeError:
            pass  # the arguments passed the binding; CUDA then failed for want of a driver
        entry = Entry(name, args, self._devices.current(), threading.get_ident())
        return self._trace.add(entry)

    def streamCreateWithFlags(self, *args: Any) -> int:  # noqa: N802 (cupy's name)
        handle = next(_handles)
        entry = self._call("streamCreateWithFlags", args)
        self.streams[entry.device or 0] = handle
        return handle

    def eventRecord(self, *args: Any) -> None:  # noqa: N802
        self._call("eventRecord", args)

    def streamWaitEvent(self, *args: Any) -> None:  # noqa: N802
        self._call("streamWaitEvent", args)

    def memcpyAsync(self, *args: Any) -> None:  # noqa: N802
        self._call("memcpyAsync", args)

    def streamIsCapturing(self, *args: Any) -> int:  # noqa: N802
        self._call("streamIsCapturing", args)
        return 1 if args[0] in self._trace.capturing else 0

    def eventQuery(self, *args: Any) -> int:  # noqa: N802
        real_status = int(real_runtime.eventQuery(*args))
        self._trace.add(Entry("eventQuery", args, self._devices.current(), threading.get_ident()))
        return self._trace.event_status(args[0], real_status)


class CheckedCommunicator:
    """``NcclCommunicator``: each call goes to a real, uninitialised one, as it was made."""

    trace: ClassVar[Trace]
    devices: ClassVar[_Devices]
    _real: Any
    closed: bool
    device: int | None
    """The device current where the communicator was made."""
    nccl_rank: int | None
    """Its NCCL rank; None for one made without ``__init__``, as ``initAll`` does."""

    def __new__(cls, *args: Any) -> CheckedCommunicator:
        self = super().__new__(cls)
        self._real = real_nccl.NcclCommunicator.__new__(real_nccl.NcclCommunicator)
        self.closed = False
        self.device = cls.devices.current()
        self.nccl_rank = None
        return self

    def __init__(self, *args: Any) -> None:
        try:
            self._real.__init__(*args)
        except real_nccl.NcclError as exc:
            if exc.status != UNHANDLED_CUDA_ERROR:
                raise
        self.nccl_rank = args[2]
        self._record("NcclCommunicator", args)

    def _record(self, name: str, args: tuple[Any, ...]) -> Entry:
        entry = Entry(name, args, self.devices.current(), threading.get_ident(), self)
        return self.trace.add(entry)

    def _forward(self, name: str, args: tuple[Any, ...]) -> None:
        entry = self._record(name, args)
        if self.trace.pause_s:
            time.sleep(self.trace.pause_s)
        try:
            getattr(self._real, name)(*args)
        except real_nccl.NcclError as exc:
            if exc.status != INVALID_ARGUMENT or self.closed or self.trace.let_through(entry):
                raise

    def allReduce(self, *args: Any) -> None:  # noqa: N802 (cupy's name)
        self._forward("allReduce", args)

    def reduce(self, *args: Any) -> None:
        self._forward("reduce", args)

    def broadcast(self, *args: Any) -> None:
        self._forward("broadcast", args)

    def bcast(self, *args: Any) -> None:
        self._forward("bcast", args)

    def allGather(self, *args: Any) -> None:  # noqa: N802
        self._forward("allGather", args)

    def reduceScatter(self, *args: Any) -> None:  # noqa: N802
        self._forward("reduceScatter", args)

    def send(self, *args: Any) -> None:
        self._forward("send", args)

    def recv(self, *args: Any) -> None:
        self._forward("recv", args)

    def check_async_error(self, *args: Any) -> None:
        self._forward("check_async_error", args)

    def abort(self, *args: Any) -> None:
        self._record("abort", args)
        self._real.abort(*args)
        self.closed = True

    def destroy(self, *args: Any) -> None:
        self._record("destroy", args)
        self._real.destroy(*args)
        self.closed = True


class CheckedNccl:
    """``cupy.cuda.nccl``: the real module's functions, recorded, and the checked communicator."""

    NcclError = real_nccl.NcclError

    def __init__(self, trace: Trace, devices: _Devices) -> None:
        self._trace = trace
        self._devices = devices
        attributes = {"trace": trace, "devices": devices}
        self.NcclCommunicator = type("NcclCommunicator", (CheckedCommunicator,), attributes)

    def _record(self, name: str, args: tuple[Any, ...] = ()) -> None:
        self._trace.add(Entry(name, args, self._devices.current(), threading.get_ident()))

    def get_unique_id(self) -> Any:
        uid = real_nccl.get_unique_id()
        self._record("get_unique_id", (uid,))
        return uid

    def groupStart(self) -> None:  # noqa: N802
        self._record("groupStart")
        real_nccl.groupStart()

    def groupEnd(self) -> None:  # noqa: N802
        self._record("groupEnd")
        try:
            real_nccl.groupEnd()
        except real_nccl.NcclError as exc:
            # NCCL drops a group in which it refused a call, as it refuses every call
            # on an uninitialised communicator: expected here, unless the group was
            # not open at all (ncclInvalidUsage)
            if exc.status != INVALID_ARGUMENT:
                raise


class DeviceArray:
    """A cupy array as the backend sees it, over no memory: its address is never read."""

    __module__ = "cupy"

    def __init__(self, shape: tuple[int, ...], dtype: str, device: int = 0) -> None:
        self.shape = tuple(shape)
        self.dtype: Any = BFLOAT16 if dtype == "bfloat16" else np.dtype(dtype)
        self.device = SimpleNamespace(id=device)
        self.flags = SimpleNamespace(c_contiguous=True)
        self.ptr = next(_addresses)
        self.data = SimpleNamespace(ptr=self.ptr, device_id=device)
        """cupy's ``MemoryPointer`` of the array: its address and device."""
        self.strides = tuple(
            int(np.prod(self.shape[i + 1 :], dtype=np.int64)) * self.dtype.itemsize
            for i in range(len(self.shape))
        )

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        data = (self.ptr, False)
        return {"shape": self.shape, "typestr": self.dtype.str, "data": data, "version": 3}


class Pinned(bytearray):
    """``cupy.cuda.alloc_pinned_memory``'s memory: host bytes with their address, ``ptr``."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.ptr = ctypes.addressof((ctypes.c_char * size).from_buffer(self))


class ContractCupy:
    """The ``cupy`` the backend sees in the contract tests; its ``trace`` records every call."""

    int32 = np.int32

    def __init__(self) -> None:
        self.trace = Trace()
        devices = _Devices()
        self.cuda = SimpleNamespace(
            nccl=CheckedNccl(self.trace, devices),
            runtime=CheckedRuntime(self.trace, devices),
            Device=lambda device=None: FakeDevice(devices, device),
            Event=FakeEvent,
            alloc_pinned_memory=Pinned,
        )
        self._devices = devices

    def zeros(self, shape: int | tuple[int, ...], dtype: Any) -> DeviceArray:
        dims = (shape,) if isinstance(shape, int) else shape
        return DeviceArray(dims, np.dtype(dtype).name, self._devices.current() or 0)

    def empty(self, shape: int | tuple[int, ...], dtype: Any) -> DeviceArray:
        return self.zeros(shape, dtype)

    def uploaded(self, ptr: int) -> np.ndarray:
        """Return the int64 words that the copy to GPU address ``ptr`` took from the host."""
        (copy,) = [e for e in self.trace.named("memcpyAsync") if e.args[0] == ptr]
        assert copy.args[3] == H2D, copy
        size = copy.args[2]
        return np.frombuffer((ctypes.c_char * size).from_address(copy.args[1]), np.int64).copy()

    def streams(self) -> dict[int, int]:
        """Return the handle of the stream made on each device."""
        return dict(self.cuda.runtime.streams)


H2D, D2H = 1, 2
"""``cudaMemcpyHostToDevice`` and ``cudaMemcpyDeviceToHost``: only the signature check
copies between host and GPU (its words up, once per launch, and each result down)."""


def without_checks(entries: list[Entry]) -> list[Entry]:
    """Return ``entries`` less the signature checks: the upload of a launch's words, and
    each check's allreduce, its copy to the host and its event.

    Only a check copies from the GPU to the host, right after its allreduce.
    """
    entries = [e for e in entries if not (e.name == "memcpyAsync" and e.args[3] == H2D)]
    kept = list(entries)
    for i, e in enumerate(entries):
        if e.name == "memcpyAsync" and e.args[3] == D2H:
            start = max(j for j in range(i) if entries[j].name == "allReduce")
            drop = {start, i, i + 1}
            kept = [k for k in kept if k not in [entries[j] for j in drop]]
    return kept


def group_blocks(entries: list[Entry]) -> Iterator[list[Entry]]:
    """Yield the calls between each ``groupStart`` and its ``groupEnd``, both included."""
    block: list[Entry] | None = None
    for entry in entries:
        if entry.name == "groupStart":
            block = [entry]
        elif block is not None:
            block.append(entry)
            if entry.name == "groupEnd":
                yield block
                block = None
