"""The GPUs of this process as the one-sided transport's CUDA path sees them.

``cuda_objects`` does all its device work through two interfaces, so that its logic runs
on host stand-ins in tests (``tests/test_rdt_cuda.py``):

- ``IpcDevice``: the shared-GPU transport's ``Device`` (memory and events shared by CUDA
  IPC, copies, stream waits) and ``query``, which tells without blocking whether an
  event has completed, so that every host wait has a deadline;
- ``Gpus``: which GPU holds a tensor, the GPU of a given UUID, the current stream, new
  tensors to receive into, and this process's Ray node.

``TorchGpus`` implements ``Gpus`` with torch's tensors and streams and a
``CudaIpcDevice`` (cupy's runtime binding) per GPU index. A GPU is found by its UUID,
never by its index: Ray renumbers the GPUs of each process (``CUDA_VISIBLE_DEVICES``).
Nothing here imports cupy or touches a GPU until a CUDA tensor comes.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol, cast

from collective.frameworks.cuda_buffers import CUPY_INSTALL_HINT
from collective.groups.shared_gpu.device import CudaDevice, Device
from collective.types import CollectiveError

NOT_READY = 600
"""``cudaErrorNotReady``: what ``cudaEventQuery`` answers for an event not yet complete."""


class IpcDevice(Device, Protocol):
    """A ``Device`` that can also tell whether an event has completed, without blocking."""

    def query(self, event: int) -> bool:
        """Return whether the work ``event`` last captured has completed."""
        ...


class Gpus(Protocol):
    """The GPUs of this process, and the torch side of a transfer."""

    def holds(self, tensor: Any) -> bool:
        """Return whether ``tensor`` is one this path moves (a CUDA tensor)."""
        ...

    def device(self, tensor: Any) -> IpcDevice:
        """Return the device of the GPU that holds ``tensor``, the same object for one GPU."""
        ...

    def find(self, uuid: str) -> IpcDevice | None:
        """Return the device of this process's GPU whose UUID is ``uuid``, or None."""
        ...

    def uuids(self) -> list[str]:
        """Return the UUIDs of the GPUs this process sees, by index."""
        ...

    def stream(self, device: IpcDevice) -> int:
        """Return the current stream of ``device``'s GPU in this thread."""
        ...

    def side_stream(self, device: IpcDevice) -> int:
        """Return a stream of this process's own on ``device``'s GPU, made once, for reads.

        A read waits on the producer's event there, not on the caller's stream: a
        producer that died mid-write leaves that stream waiting, never the caller's.
        """
        ...

    def empty(self, nbytes: int, device: IpcDevice) -> Any:
        """Return a new flat ``uint8`` tensor of ``nbytes`` on ``device``'s GPU."""
        ...

    def node_id(self) -> str:
        """Return the id of this process's Ray node."""
        ...


class CudaIpcDevice(CudaDevice):
    """``CudaDevice`` and ``query``: ``cudaEventQuery``, which answers without blocking."""

    def __init__(self, cupy: Any) -> None:
        """Use ``cupy`` (the module) on the device current now; read its UUID on first use."""
        super().__init__(cupy)
        self._uuid: str | None = None

    def uuid(self) -> str:
        """Return the GPU's UUID and PCI address (``CudaDevice.uuid``), read once."""
        if self._uuid is None:
            self._uuid = super().uuid()
        return self._uuid

    def _end(self, stream: int) -> None:
        """Mark nothing as an ``on_stream`` block ends: a read waits on its own events."""

    def query(self, event: int) -> bool:
        """Return whether ``event`` has completed: ``cudaEventQuery`` is success, not not-ready.

        Raises:
            CUDARuntimeError: the query failed for another reason (the event is invalid,
                the context is lost).

        """
        status = int(self._runtime.eventQuery(event))
        if status == 0:
            return True
        if status == NOT_READY:
            return False
        raise self._runtime.CUDARuntimeError(status)


class TorchGpus:
    """``Gpus`` over torch's CUDA tensors and streams, with a ``CudaIpcDevice`` per GPU."""

    def __init__(self, cupy: Any = None) -> None:
        """Know no GPU yet: each is looked at on first use, through ``cupy`` (None: imported)."""
        self._cupy = cupy
        self._lock = threading.Lock()
        self._devices: dict[int, CudaIpcDevice] = {}
        self._uuids: list[str] | None = None
        self._side: dict[int, int] = {}

    def holds(self, tensor: Any) -> bool:
        """Return whether ``tensor`` is a CUDA tensor."""
        return bool(tensor.device.type == "cuda")

    def device(self, tensor: Any) -> IpcDevice:
        """Return the device of the GPU of CUDA tensor ``tensor``."""
        return self._at(int(tensor.device.index))

    def find(self, uuid: str) -> IpcDevice | None:
        """Return the device of the visible GPU whose UUID is ``uuid``, or None."""
        uuids = self.uuids()
        return self._at(uuids.index(uuid)) if uuid in uuids else None

    def uuids(self) -> list[str]:
        """Return the UUIDs of the GPUs this process sees, by index (read once)."""
        if self._uuids is None:
            cupy = self._module()
            count = int(cupy.cuda.runtime.getDeviceCount())
            self._uuids = [self._at(i).uuid() for i in range(count)]
        return self._uuids

    def stream(self, device: IpcDevice) -> int:
        """Return torch's current stream of ``device``'s GPU."""
        import torch

        return int(torch.cuda.current_stream(cast(CudaIpcDevice, device).device_id).cuda_stream)

    def side_stream(self, device: IpcDevice) -> int:
        """Return a stream of this process's own on ``device``'s GPU, made once, never freed.

        A raw non-blocking stream (``cudaStreamCreateWithFlags``): a stream from torch's
        pool is handed round-robin to every other user of the pool, whose work a read
        stuck on a dead producer's event would then hold up.
        """
        index = cast(CudaIpcDevice, device).device_id
        with self._lock:
            made = self._side.get(index)
            if made is None:
                cupy = self._module()
                runtime = cupy.cuda.runtime
                with cupy.cuda.Device(index):
                    flags = runtime.streamNonBlocking
                    made = self._side[index] = int(runtime.streamCreateWithFlags(flags))
        return made

    def empty(self, nbytes: int, device: IpcDevice) -> Any:
        """Return ``torch.empty(nbytes, dtype=uint8)`` on ``device``'s GPU."""
        import torch

        index = cast(CudaIpcDevice, device).device_id
        return torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", index))

    def node_id(self) -> str:
        """Return the id of this process's Ray node."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def _module(self) -> Any:
        """Return the cupy module, or raise saying what to install."""
        if self._cupy is None:
            try:
                import cupy
            except ImportError as exc:
                raise CollectiveError(
                    f"CUDA tensors in a one-sided transport need cupy: {CUPY_INSTALL_HINT} ({exc})"
                ) from None
            self._cupy = cupy
        return self._cupy

    def _at(self, index: int) -> CudaIpcDevice:
        """Return the device of GPU ``index`` of this process, made once."""
        with self._lock:
            found = self._devices.get(index)
            if found is None:
                cupy = self._module()
                with cupy.cuda.Device(index):
                    found = self._devices[index] = CudaIpcDevice(cupy)
            return found


def follow(device: IpcDevice, stream: int, leader: int) -> None:
    """Order ``stream``'s later work after what ``leader`` has queued so far.

    A read's copies run on a side stream into memory the caller's allocator may have
    just taken back from the caller's stream's pending work: they start after it.
    """
    event = device.new_event()
    device.record(event, leader)
    device.wait(stream, event)
    device.destroy_event(event)  # CUDA keeps it until the wait has used it
