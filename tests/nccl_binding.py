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
- What cannot exist without a GPU is stood in for, on a ``DeviceClock`` (see
  ``tests/device_clock.py``) shared by the ranks of a test: a device (a context that
  keeps the current ordinal), streams that queue their work and run it later, events
  that complete when their stream reaches them, and buffers (``DeviceArray``: a
  ``__cuda_array_interface__`` over stand-in device memory, ``device_clock.MEMORY``).
  Every call the binding accepts is also work on the clock: copies move bytes, and
  each NCCL launch is a kernel that completes when every rank's has been reached,
  moving the bytes NCCL would (see ``tests/nccl_world.py``). ``Trace.event_status``
  overrides what the clock says of an event.

Every call lands in the namespace's ``Trace``, in order, with the current device and
thread, so that tests can check what the backend asked for, value for value.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, ClassVar

import cupy
import numpy as np
from cupy.cuda import nccl as real_nccl
from cupy.cuda import runtime as real_runtime

from tests import nccl_world
from tests.device_clock import CAPTURE_INVALIDATED, MEMORY, DeviceClock, Process

INVALID_ARGUMENT = 4
"""``ncclInvalidArgument``: what NCCL says to a call on an uninitialised communicator."""

UNHANDLED_CUDA_ERROR = 1
"""``ncclUnhandledCudaError``: what NCCL says to a communicator init without a driver."""

NOT_READY = 600
"""``cudaErrorNotReady``."""

DEVICES = 8
"""GPUs of the stand-in machine."""


@dataclass(frozen=True)
class _Bfloat16:
    name: str = "bfloat16"
    itemsize: int = 2
    str: str = "<V2"


BFLOAT16 = _Bfloat16()
"""bfloat16 as a dtype (hashable, as every dtype is): cupy has none, and torch's CUDA
tensors cannot be made here."""


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
    event_status: Callable[[int, int], int] | None = None
    """If set, returns what ``eventQuery`` reports for an event, given what the real
    runtime said, instead of what the device clock says."""
    let_through: Callable[[Entry], bool] = lambda entry: False
    """Returns whether the real NCCL error of this call is raised rather than swallowed."""
    pause_s: float = 0.0
    """How long each communicator call sleeps, letting other threads run in between."""
    capturing: set[int] = field(default_factory=set)
    """Stream handles that ``streamIsCapturing`` reports as capturing a CUDA graph, besides
    those that capture on the clock."""
    misuse: list[str] = field(default_factory=list)
    """What the backend did that NCCL or CUDA forbids: an abort or destroy of a communicator
    while another thread is inside an NCCL call on it (NCCL's fault-tolerance and
    thread-safety rules; through cupy, a use after free); NCCL ops issued from two threads
    at once on independent communicators of one GPU; a communicator left to the garbage
    collector (cupy's ``__dealloc__`` calls ``ncclCommDestroy``, which every rank must
    call); a queued NCCL call on memory freed meanwhile."""
    nccl_version: int | None = None
    """What ``get_version`` says, if set; the real NCCL's otherwise."""
    on_call: Callable[[Entry], None] | None = None
    """Called inside each communicator call, on its thread, after the binding checked it."""
    issuing: dict[int, dict[int, Any]] = field(default_factory=dict)
    """The threads inside an NCCL op call now, by GPU: thread -> communicator."""

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
    """``cupy.cuda.Event``: only its handle, ``ptr``, an event of the clock on the current GPU."""

    def __init__(self, clock: Process, devices: _Devices, *, disable_timing: bool = False) -> None:
        self.ptr = clock.create_event(devices.current() or 0)
        self.disable_timing = disable_timing


class CheckedRuntime:
    """``cupy.cuda.runtime`` for the calls the backend makes, each checked by the real one.

    Each call then runs on the device clock, with the thread's current device.
    """

    CUDARuntimeError = real_runtime.CUDARuntimeError

    def __init__(self, trace: Trace, devices: _Devices, clock: Process) -> None:
        self._trace = trace
        self._devices = devices
        self._clock = clock
        self.streams: dict[int, int] = {}
        """The handle of each stream made, by the device current when it was made."""

    def _call(self, name: str, args: tuple[Any, ...]) -> Entry:
        try:
            getattr(real_runtime, name)(*args)
        except real_runtime.CUDARuntimeError:
            pass  # the arguments passed the binding; CUDA then failed for want of a driver
        entry = Entry(name, args, self._devices.current(), threading.get_ident())
        return self._trace.add(entry)

    def _device(self) -> int:
        return self._devices.current() or 0

    def streamCreateWithFlags(self, *args: Any) -> int:  # noqa: N802 (cupy's name)
        entry = self._call("streamCreateWithFlags", args)
        handle = self._clock.create_stream(self._device(), non_blocking=bool(args[0] & 1))
        self.streams[entry.device or 0] = handle
        return handle

    def streamDestroy(self, *args: Any) -> None:  # noqa: N802
        self._call("streamDestroy", args)
        self._clock.destroy_stream(args[0], self._device())

    def eventRecord(self, *args: Any) -> None:  # noqa: N802
        self._call("eventRecord", args)
        self._clock.record(args[0], args[1], self._device())

    def streamWaitEvent(self, *args: Any) -> None:  # noqa: N802
        self._call("streamWaitEvent", args)
        self._clock.wait_event(args[0], args[1], self._device())

    def memcpyAsync(self, *args: Any) -> None:  # noqa: N802
        self._call("memcpyAsync", args)
        dst, src, nbytes = args[:3]

        def copy() -> None:
            MEMORY.copy(dst, src, nbytes)

        self._clock.submit(args[4], copy, device=self._device(), name="memcpyAsync")

    def streamIsCapturing(self, *args: Any) -> int:  # noqa: N802
        self._call("streamIsCapturing", args)
        if args[0] in self._trace.capturing:
            return 1
        status = self._clock.capture_status(args[0], self._device())
        if status == CAPTURE_INVALIDATED:  # as cupy's binding says it
            raise RuntimeError(
                "the stream was capturing, but an error has invalidated the capture sequence"
            )
        return status

    def eventQuery(self, *args: Any) -> int:  # noqa: N802
        real_status = int(real_runtime.eventQuery(*args))
        self._trace.add(Entry("eventQuery", args, self._devices.current(), threading.get_ident()))
        if self._trace.event_status is not None:
            return self._trace.event_status(args[0], real_status)
        return self._clock.query(args[0])

    def eventSynchronize(self, *args: Any) -> None:  # noqa: N802
        self._call("eventSynchronize", args)
        self._clock.event_synchronize(args[0])

    def streamSynchronize(self, *args: Any) -> None:  # noqa: N802
        self._call("streamSynchronize", args)
        self._clock.stream_synchronize(args[0], self._device())

    def deviceSynchronize(self) -> None:  # noqa: N802
        self._call("deviceSynchronize", ())
        self._clock.device_synchronize(self._device())


class _Groups(threading.local):
    """The NCCL group call open on this thread: its depth and the calls it holds."""

    depth = 0
    failed = False
    calls: list[tuple[CheckedCommunicator, str, tuple[Any, ...]]]

    def __init__(self) -> None:
        self.calls = []


class CheckedCommunicator:
    """``NcclCommunicator``: each call goes to a real, uninitialised one, as it was made.

    A call the binding accepts is then a launch on the device clock (``nccl_world``):
    at once outside an NCCL group call, at ``groupEnd`` inside one.
    """

    trace: ClassVar[Trace]
    devices: ClassVar[_Devices]
    clock: ClassVar[Process]
    groups: ClassVar[_Groups]
    _real: Any
    closed: bool
    device: int | None
    """The device current where the communicator was made."""
    nccl_rank: int | None
    """Its NCCL rank; None for one made without ``__init__``, as ``initAll`` does."""
    world: nccl_world.World | None
    inside: dict[int, str]
    """The threads inside a call on this communicator now, and the call."""
    _lock: threading.Lock
    launched: int

    def __new__(cls, *args: Any) -> CheckedCommunicator:
        self = super().__new__(cls)
        self._real = real_nccl.NcclCommunicator.__new__(real_nccl.NcclCommunicator)
        self.closed = False
        self.device = cls.devices.current()
        self.nccl_rank = None
        self.world = None
        self.inside = {}
        self._lock = threading.Lock()
        self.launched = 0
        return self

    def __init__(self, *args: Any) -> None:
        try:
            self._real.__init__(*args)
        except real_nccl.NcclError as exc:
            if exc.status != UNHANDLED_CUDA_ERROR:
                raise
        self.nccl_rank = args[2]
        self.world = nccl_world.world(args[1], args[0], self.clock)
        self._record("NcclCommunicator", args)

    def _record(self, name: str, args: tuple[Any, ...]) -> Entry:
        entry = Entry(name, args, self.devices.current(), threading.get_ident(), self)
        return self.trace.add(entry)

    def _enter(self, name: str) -> None:
        me = threading.get_ident()
        with self._lock:
            self.inside[me] = name
        if name == "check_async_error":
            return
        trace = self.trace
        with trace.lock:
            issuing = trace.issuing.setdefault(self.device or 0, {})
            others = [c for t, c in issuing.items() if t != me and c is not self]
            issuing[me] = self
        if others:
            trace.misuse.append(
                f"{name} issued on GPU {self.device or 0} while another thread issues on "
                "another communicator of that GPU (NCCL: not thread-safe)"
            )

    def _leave(self) -> None:
        me = threading.get_ident()
        with self._lock:
            self.inside.pop(me, None)
        with self.trace.lock:
            issuing = self.trace.issuing.get(self.device or 0, {})
            if issuing.get(me) is self:
                del issuing[me]

    def __del__(self) -> None:
        if self.world is not None and not self.closed:
            self.trace.misuse.append(
                f"NCCL rank {self.nccl_rank}'s communicator was garbage-collected alive: "
                "cupy's __dealloc__ calls ncclCommDestroy, which can hang alone"
            )

    def _forward(self, name: str, args: tuple[Any, ...]) -> None:
        entry = self._record(name, args)
        self._enter(name)
        try:
            if self.trace.pause_s:
                time.sleep(self.trace.pause_s)
            try:
                getattr(self._real, name)(*args)
            except real_nccl.NcclError as exc:
                if exc.status != INVALID_ARGUMENT or self.closed or self.trace.let_through(entry):
                    self.groups.failed = self.groups.depth > 0
                    raise
            if self.trace.on_call is not None:
                self.trace.on_call(entry)
            if name == "check_async_error":
                return
            if self.world is None:  # NCCL refuses a call on an uninitialised communicator
                self.groups.failed = self.groups.depth > 0
                return
            if self.groups.depth:
                self.groups.calls.append((self, name, args))
            else:
                self.launch([(name, args)], self.announce([(name, args)]))
        finally:
            self._leave()

    def announce(self, calls: list[nccl_world.Call]) -> dict[Any, int]:
        """Ask for the connections ``calls`` need (see ``nccl_world.World``)."""
        assert self.world is not None and self.nccl_rank is not None
        return self.world.announce(self.nccl_rank, calls)

    def launch(self, calls: list[nccl_world.Call], wanted: dict[Any, int]) -> None:
        """Queue ``calls`` as one kernel on their stream, once ``wanted`` are connected."""
        world, rank = self.world, self.nccl_rank
        assert world is not None and rank is not None
        world.connect(rank, wanted, lambda: self.closed)
        if self.closed:
            raise real_nccl.NcclError(INVALID_ARGUMENT)
        with self._lock:
            self.launched += 1
            number = self.launched
        self.clock.meet(
            calls[0][1][-1],
            (id(world), number),
            world.nranks,
            (rank, calls),
            device=self.device or 0,
            agree=nccl_world.matches,
            effect=functools.partial(nccl_world.move, misuse=self.trace.misuse),
            tag=self,
            name="+".join(name for name, _ in calls),
        )

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

    def _end(self, name: str) -> None:
        """Abort or destroy: log a misuse if another thread is inside a call on it."""
        me = threading.get_ident()
        with self._lock:
            others = {t: call for t, call in self.inside.items() if t != me}
        if others:
            self.trace.misuse.append(
                f"{name} of NCCL rank {self.nccl_rank} while another thread is inside "
                f"{sorted(others.values())} on it"
            )
        self._record(name, ())
        self.closed = True
        self.clock.cancel(self)  # the kernels of an aborted communicator end
        if self.world is not None:
            self.world.wake()

    def abort(self, *args: Any) -> None:
        self._end("abort")
        self._real.abort(*args)

    def destroy(self, *args: Any) -> None:
        self._end("destroy")
        self._real.destroy(*args)


class CheckedNccl:
    """``cupy.cuda.nccl``: the real module's functions, recorded, and the checked communicator."""

    NcclError = real_nccl.NcclError

    def __init__(self, trace: Trace, devices: _Devices, clock: Process) -> None:
        self._trace = trace
        self._devices = devices
        self._groups = _Groups()
        attributes = {"trace": trace, "devices": devices, "clock": clock, "groups": self._groups}
        self.NcclCommunicator = type("NcclCommunicator", (CheckedCommunicator,), attributes)

    def _record(self, name: str, args: tuple[Any, ...] = ()) -> None:
        self._trace.add(Entry(name, args, self._devices.current(), threading.get_ident()))

    def get_version(self) -> int:
        found = self._trace.nccl_version
        return int(real_nccl.get_version()) if found is None else found

    def get_unique_id(self) -> Any:
        uid = real_nccl.get_unique_id()
        self._record("get_unique_id", (uid,))
        return uid

    def groupStart(self) -> None:  # noqa: N802
        self._record("groupStart")
        real_nccl.groupStart()
        self._groups.depth += 1

    def groupEnd(self) -> None:  # noqa: N802
        self._record("groupEnd")
        groups = self._groups
        try:
            real_nccl.groupEnd()
        except real_nccl.NcclError as exc:
            # NCCL drops a group in which it refused a call, as it refuses every call
            # on an uninitialised communicator: expected here, unless the group was
            # not open at all (ncclInvalidUsage)
            if exc.status != INVALID_ARGUMENT:
                raise
        groups.depth -= 1
        if groups.depth:
            return
        calls, failed = groups.calls, groups.failed
        groups.calls, groups.failed = [], False
        if failed:
            return  # NCCL launches nothing of a group in which it refused a call
        by_comm: dict[CheckedCommunicator, list[nccl_world.Call]] = {}
        for comm, name, args in calls:
            by_comm.setdefault(comm, []).append((name, args))
        wanted = {comm: comm.announce(launch) for comm, launch in by_comm.items()}
        for comm, launch in by_comm.items():  # the group connects all its communicators at once
            comm._enter("groupEnd")
            try:
                comm.launch(launch, wanted[comm])
            finally:
                comm._leave()


class DeviceArray:
    """A cupy array as the backend sees it, over stand-in device memory (``MEMORY``)."""

    __module__ = "cupy"

    def __init__(
        self, shape: tuple[int, ...], dtype: str, device: int = 0, *, at: Any = None
    ) -> None:
        """Make an array; ``at``, a ``(DeviceArray, byte offset)``, makes a view into one."""
        self.shape = tuple(shape)
        self.dtype: Any = BFLOAT16 if dtype == "bfloat16" else np.dtype(dtype)
        self.device = SimpleNamespace(id=device)
        self.flags = SimpleNamespace(c_contiguous=True)
        self.strides = tuple(
            int(np.prod(self.shape[i + 1 :], dtype=np.int64)) * self.dtype.itemsize
            for i in range(len(self.shape))
        )
        if at is None:
            self.ptr = MEMORY.alloc(self.nbytes)
            weakref.finalize(self, MEMORY.free, self.ptr)
            self._owner: DeviceArray | None = None
        else:
            self._owner, offset = at
            self.ptr = at[0].ptr + offset
        self.data = SimpleNamespace(ptr=self.ptr, device_id=device)
        """cupy's ``MemoryPointer`` of the array: its address and device."""

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * int(self.dtype.itemsize)

    def host(self) -> np.ndarray:
        """Return the array's bytes as numpy sees them (bfloat16 as uint16): a live view."""
        raw = MEMORY.view(self.ptr, self.nbytes)
        assert raw is not None, "the array's memory is gone"
        dtype = np.uint16 if self.dtype is BFLOAT16 else self.dtype
        return raw.view(dtype).reshape(self.shape)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        data = (self.ptr, False)
        return {"shape": self.shape, "typestr": self.dtype.str, "data": data, "version": 3}


def chunks(n: int, shape: tuple[int, ...], dtype: str, device: int = 0) -> list[DeviceArray]:
    """Return ``n`` consecutive arrays of ``shape``: views of one buffer, in order."""
    whole = DeviceArray((n, *shape), dtype, device)
    step = whole.nbytes // n
    return [DeviceArray(shape, dtype, device, at=(whole, j * step)) for j in range(n)]


class Pinned(bytearray):
    """``cupy.cuda.alloc_pinned_memory``'s memory: host bytes with their address, ``ptr``.

    Copies on the clock reach it (``MEMORY`` knows it while it lives).
    """

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.ptr = ctypes.addressof((ctypes.c_char * size).from_buffer(self))
        self._bytes = np.frombuffer(self, np.uint8)
        MEMORY.adopt(self._bytes)


class ContractCupy:
    """The ``cupy`` the backend sees in the contract tests; its ``trace`` records every call.

    It is one process (``gpu``, its own stream handles) on ``clock``, the machine whose
    GPUs the ranks of one test share (made here if None).
    """

    int32 = np.int32

    def __init__(self, clock: DeviceClock | None = None) -> None:
        self.trace = Trace()
        self.clock = clock or DeviceClock(DEVICES)
        self.gpu = self.clock.process()
        devices = _Devices()
        clock_ = self.gpu
        self.cuda = SimpleNamespace(
            nccl=CheckedNccl(self.trace, devices, clock_),
            runtime=CheckedRuntime(self.trace, devices, clock_),
            Device=lambda device=None: FakeDevice(devices, device),
            Event=lambda disable_timing=False: FakeEvent(
                clock_, devices, disable_timing=disable_timing
            ),
            alloc_pinned_memory=Pinned,
        )
        self._devices = devices

    def zeros(self, shape: int | tuple[int, ...], dtype: Any) -> DeviceArray:
        dims = (shape,) if isinstance(shape, int) else shape
        return DeviceArray(dims, np.dtype(dtype).name, self._devices.current() or 0)

    def empty(self, shape: int | tuple[int, ...], dtype: Any) -> DeviceArray:
        return self.zeros(shape, dtype)

    def uploaded(self, ptr: int, count: int | None = None) -> np.ndarray:
        """Return the int64 words that the copy to GPU address ``ptr`` took from the host.

        A launch built before the trace was last cleared (its buffer's address reused by
        a new one, as allocators do) made its copy then: with ``count`` given, its
        ``count`` words are read where they landed instead.
        """
        copies = [e for e in self.trace.named("memcpyAsync") if e.args[0] == ptr]
        if not copies and count is not None:
            landed = MEMORY.view(ptr, count * 8)
            assert landed is not None, f"no words at {ptr:#x}"
            return landed.view(np.int64).copy()
        (copy,) = copies
        assert copy.args[3] == H2D, copy
        size = copy.args[2]
        return np.frombuffer((ctypes.c_char * size).from_address(copy.args[1]), np.int64).copy()

    def streams(self) -> dict[int, int]:
        """Return the handle of the stream made on each device."""
        return dict(self.cuda.runtime.streams)


H2D, D2H = 1, 2
"""``cudaMemcpyHostToDevice`` and ``cudaMemcpyDeviceToHost``: only the signature check
copies between host and GPU (its words up, once per launch, and each result down)."""


def check_calls(entries: list[Entry]) -> list[tuple[Entry, Entry, Entry]]:
    """Return each signature check in ``entries``: its allreduce, copy to the host and event.

    Only a check copies from the GPU to the host, right after its allreduce and right
    before its event, on one thread (other threads' calls may come between).
    """
    found = []
    for e in entries:
        if e.name == "memcpyAsync" and e.args[3] == D2H:
            mine = [f for f in entries if f.thread == e.thread]
            at = mine.index(e)
            if at + 1 == len(mine):
                continue  # its event is not recorded yet
            start = max(j for j in range(at) if mine[j].name == "allReduce")
            found.append((mine[start], e, mine[at + 1]))
    return found


def without_checks(entries: list[Entry]) -> list[Entry]:
    """Return ``entries`` less the signature checks: the upload of a launch's words, and
    each check's allreduce, its copy to the host and its event (see ``check_calls``).
    """
    dropped = {id(e) for check in check_calls(entries) for e in check}
    return [
        e
        for e in entries
        if id(e) not in dropped and not (e.name == "memcpyAsync" and e.args[3] == H2D)
    ]


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
