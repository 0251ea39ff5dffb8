"""What the shared-GPU transport asks of the device: memory and events shared by CUDA IPC.

``Device`` is the whole interface; ``CudaDevice`` implements it with cupy's CUDA
runtime binding (``cupy.cuda.runtime``), one call each, on the device that is
current when it is made. The rules it follows (``../shared/CUDA-IPC.md``):

- memory comes from ``cudaMalloc`` (never a pool or a VMM allocator), so every
  exported pointer is the base of its allocation;
- events are made with ``cudaEventInterprocess | cudaEventDisableTiming``, as
  ``cudaIpcGetEventHandle`` requires;
- a process never opens its own handles (CUDA refuses), and opens each peer's
  handle once;
- a peer's memory is closed before its owner frees it (the transport's teardown
  orders that).

Tests stand in for the device with host memory (``tests/shared_gpu_standin.py``), so
that the step protocol runs in real processes on a machine without a GPU.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

MEMORY_HANDLE_BYTES = 64
"""The size of a ``cudaIpcMemHandle_t`` and of a ``cudaIpcEventHandle_t``."""


class Device(Protocol):
    """Device memory and events that other processes on the same GPU can open."""

    device_id: int
    """The GPU's CUDA ordinal in this process (where a caller's buffers must be)."""

    def uuid(self) -> str:
        """Return the UUID of this process's current GPU, the same in every process."""
        ...

    def alloc(self, nbytes: int) -> int:
        """Return the base address of ``nbytes`` of new device memory, zeroed."""
        ...

    def free(self, ptr: int) -> None:
        """Free memory that ``alloc`` returned."""
        ...

    def export_memory(self, ptr: int) -> bytes:
        """Return the handle through which other processes open the memory at ``ptr``."""
        ...

    def open_memory(self, handle: bytes) -> int:
        """Map another process's memory by its ``handle``; return its address here."""
        ...

    def close_memory(self, ptr: int) -> None:
        """Unmap memory that ``open_memory`` returned."""
        ...

    def new_event(self) -> int:
        """Return a new event that other processes can open."""
        ...

    def export_event(self, event: int) -> bytes:
        """Return the handle through which other processes open ``event``."""
        ...

    def open_event(self, handle: bytes) -> int:
        """Open another process's event by its ``handle``."""
        ...

    def destroy_event(self, event: int) -> None:
        """Destroy an event that ``new_event`` or ``open_event`` returned."""
        ...

    def record(self, event: int, stream: int) -> None:
        """Record ``event`` on ``stream``: it completes once the stream's work so far has."""
        ...

    def wait(self, stream: int, event: int) -> None:
        """Order ``stream``'s later work after what ``event`` last captured."""
        ...

    def copy(self, target: int, source: int, nbytes: int, stream: int) -> None:
        """Copy ``nbytes`` from ``source`` to ``target``, both device memory, on ``stream``."""
        ...

    def view(self, ptr: int, nbytes: int) -> Any:
        """Return a flat ``uint8`` array over ``nbytes`` of device memory at ``ptr``."""
        ...

    def on_stream(self, stream: int) -> Any:
        """Return a context manager under which array operations run on ``stream``."""
        ...

    def synchronize(self) -> None:
        """Wait until every stream of this process's current device is idle."""
        ...

    def settle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the work every ``on_stream`` block queued; say if done.

        Unlike ``synchronize`` it never waits forever: a stream that waits on the
        event of a peer that died may never go idle. It never touches the streams
        themselves, which their user may have destroyed since.
        """
        ...


_NOT_READY = 600
"""``cudaErrorNotReady``: what ``cudaEventQuery`` returns for work not yet done."""


class _Handle:
    """A raw CUDA stream handle that speaks the CUDA stream protocol."""

    def __init__(self, stream: int) -> None:
        self._stream = stream

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self._stream)


class _Current:
    """Enters a cupy device, then a cupy stream; leaves them in reverse, marking the end."""

    def __init__(self, device: Any, stream: Any, ended: Callable[[], None]) -> None:
        self._device = device
        self._stream = stream
        self._ended = ended

    def __enter__(self) -> None:
        self._device.__enter__()
        try:
            self._stream.__enter__()
        except BaseException:
            self._device.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            self._stream.__exit__(*exc)
            try:
                self._ended()
            except Exception:
                if exc[0] is None:  # else the block's own error goes on
                    raise
        finally:
            self._device.__exit__(*exc)


class CudaDevice:
    """``Device`` on the current CUDA device, through cupy's runtime binding."""

    def __init__(self, cupy: Any) -> None:
        """Use ``cupy`` (the module) on the device current now."""
        self._cupy = cupy
        self._runtime = cupy.cuda.runtime
        self.device_id = int(self._runtime.getDevice())
        self._event_flags = int(self._runtime.eventDisableTiming | self._runtime.eventInterprocess)
        self._streams: dict[int, Any] = {}
        self._ends: dict[int, int] = {}
        """Per stream: an event recorded as each ``on_stream`` block on it ends."""
        self._lock = threading.Lock()

    def uuid(self) -> str:
        """Return the GPU's UUID and PCI address (the same in every process, whatever its index).

        cupy hands the UUID over as a C string, which a zero byte cuts short: the PCI
        address beside it keeps two GPUs apart all the same. Two MIG instances of one
        GPU share a PCI address; should their cut UUIDs agree too, ranks on them would
        take each other for one GPU, and the group's check of its mappings (``verify``)
        fails it as it is made, before any op.
        """
        props = self._runtime.getDeviceProperties(self.device_id)
        pci = f"{props['pciDomainID']:04x}:{props['pciBusID']:02x}:{props['pciDeviceID']:02x}"
        return f"{bytes(props['uuid']).hex()}@{pci}"

    def alloc(self, nbytes: int) -> int:
        """Return the base of ``nbytes`` from ``cudaMalloc``, zeroed (synchronously)."""
        ptr = int(self._runtime.malloc(nbytes))
        try:
            self._runtime.memset(ptr, 0, nbytes)
        except BaseException:
            self._runtime.free(ptr)
            raise
        return ptr

    def free(self, ptr: int) -> None:
        """Free ``ptr`` with ``cudaFree``, on this GPU."""
        with self._on_gpu():
            self._runtime.free(ptr)

    def export_memory(self, ptr: int) -> bytes:
        """Return ``cudaIpcGetMemHandle(ptr)``."""
        return bytes(self._runtime.ipcGetMemHandle(ptr))

    def open_memory(self, handle: bytes) -> int:
        """Return ``cudaIpcOpenMemHandle(handle, cudaIpcMemLazyEnablePeerAccess)``."""
        flags = int(self._runtime.cudaIpcMemLazyEnablePeerAccess)
        return int(self._runtime.ipcOpenMemHandle(handle, flags))

    def close_memory(self, ptr: int) -> None:
        """Call ``cudaIpcCloseMemHandle(ptr)``, on this GPU."""
        with self._on_gpu():
            self._runtime.ipcCloseMemHandle(ptr)

    def new_event(self) -> int:
        """Return a new interprocess event, timing disabled."""
        return int(self._runtime.eventCreateWithFlags(self._event_flags))

    def export_event(self, event: int) -> bytes:
        """Return ``cudaIpcGetEventHandle(event)``."""
        return bytes(self._runtime.ipcGetEventHandle(event))

    def open_event(self, handle: bytes) -> int:
        """Return ``cudaIpcOpenEventHandle(handle)``."""
        return int(self._runtime.ipcOpenEventHandle(handle))

    def destroy_event(self, event: int) -> None:
        """Call ``cudaEventDestroy(event)``, on this GPU."""
        with self._on_gpu():
            self._runtime.eventDestroy(event)

    def record(self, event: int, stream: int) -> None:
        """Call ``cudaEventRecord(event, stream)``."""
        self._runtime.eventRecord(event, stream)

    def wait(self, stream: int, event: int) -> None:
        """Call ``cudaStreamWaitEvent(stream, event, 0)``."""
        self._runtime.streamWaitEvent(stream, event, 0)

    def copy(self, target: int, source: int, nbytes: int, stream: int) -> None:
        """Call ``cudaMemcpyAsync(target, source, nbytes, cudaMemcpyDefault, stream)``."""
        self._runtime.memcpyAsync(target, source, nbytes, self._runtime.memcpyDefault, stream)

    def view(self, ptr: int, nbytes: int) -> Any:
        """Return a cupy ``uint8`` array over device memory this process does not own."""
        cuda = self._cupy.cuda
        memory = cuda.UnownedMemory(ptr, nbytes, self, self.device_id)
        return self._cupy.ndarray((nbytes,), self._cupy.uint8, cuda.MemoryPointer(memory, 0))

    def on_stream(self, stream: int) -> Any:
        """Return a context in which this GPU is current and ``stream`` takes array operations.

        Ops may run on a lane's thread, whose current device is not the caller's: the
        context makes the GPU current for cupy and the CUDA runtime too. The cupy
        stream of each raw handle is made once (``Stream.from_external``, through the
        CUDA stream protocol) and kept.
        """
        wrapped = self._streams.get(stream)
        if wrapped is None:
            cuda = self._cupy.cuda
            if hasattr(cuda.Stream, "from_external"):
                wrapped = cuda.Stream.from_external(_Handle(stream))
            else:  # cupy before 14
                wrapped = cuda.ExternalStream(stream, self.device_id)
            self._streams[stream] = wrapped
        return _Current(self._cupy.cuda.Device(self.device_id), wrapped, lambda: self._end(stream))

    def _end(self, stream: int) -> None:
        """Record ``stream``'s end event after what was queued on it (made once per stream)."""
        runtime = self._runtime
        with self._lock:
            event = self._ends.get(stream)
            if event is None:
                flags = runtime.eventDisableTiming
                event = self._ends[stream] = int(runtime.eventCreateWithFlags(flags))
        runtime.eventRecord(event, stream)

    def synchronize(self) -> None:
        """Call ``cudaDeviceSynchronize`` on this GPU."""
        with self._on_gpu():
            self._runtime.deviceSynchronize()

    def settle(self, timeout_s: float) -> bool:
        """Poll the end event of every stream ops ran on until done or ``timeout_s``.

        The events were recorded as each op's block ended (``on_stream``), so a stream
        its user destroyed since is never recorded on (CUDA refuses a destroyed
        handle; its queued work still runs, and its event still completes). Once all
        completed, the events are destroyed.
        """
        runtime = self._runtime
        deadline = time.monotonic() + timeout_s
        with self._on_gpu():
            with self._lock:
                pending = list(self._ends.values())
            while pending:
                if runtime.eventQuery(pending[-1]) != _NOT_READY:
                    pending.pop()
                elif time.monotonic() > deadline:
                    return False
                else:
                    time.sleep(0.001)
            with self._lock:
                events, self._ends = list(self._ends.values()), {}
            for event in events:
                runtime.eventDestroy(event)
        return True

    def _on_gpu(self) -> Any:
        """Return cupy's context that makes this GPU current (teardown may run on any thread)."""
        return self._cupy.cuda.Device(self.device_id)
