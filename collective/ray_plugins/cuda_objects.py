"""The one-sided transport's CUDA objects: published by a producer, read through CUDA IPC.

``shm_transport`` hands an object of CUDA tensors here:

- **Producer** (``publish``, when Ray extracts the object's metadata): one
  ``cudaMalloc`` buffer (``cuda_buffer``) gets a copy of every tensor on the current
  stream, never an export of the user's tensors (they may come from a pool or a VMM
  allocator), then one interprocess event is recorded after the copies. The metadata
  carries the buffer's and the event's IPC handles, the GPU's UUID, the node, the
  producer's pid and start time, and each tensor's offset.
- **Consumer** (``read``): same node and same GPU (by UUID), or a ``CollectiveError``
  that says which; the handles are opened once per process (concurrent reads of an
  object share the mapping); a side stream of the reader's own (``Gpus.side_stream``)
  waits on what the caller's current stream queued and on the producer's event, and
  the bytes are copied out on it, so a producer that died mid-write can block that
  stream, never the caller's; an event of the reader's own is recorded after the
  copies, and the host waits for it (``query`` polls, bounded by a deadline, ended by ``abort`` and
  by the producer's death) before the mapping is closed. A read that stops before its
  copies complete parks its mapping; a later call closes it once they have.
- **Lifetime** (``free``, when Ray garbage-collects the object in the producer): the
  buffer is freed and the event destroyed, never while a read in this process still
  uses them (the last such read frees them), nor while another live process still maps
  them (``cuda_leases``: a consumer's parked read holds its lease until its mapping
  closes; the producer's next call frees them then).

A reader in the producer's process cannot open its own handles (CUDA refuses): it reads
the buffer directly.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from collective.ray_plugins import cuda_leases, segment
from collective.ray_plugins.cuda_buffer import (
    CudaIpcMetadata,
    check_targets,
    copy_out,
    gone,
    layout,
    pack,
    views,
)
from collective.ray_plugins.cuda_gpus import Gpus, IpcDevice, follow
from collective.ray_plugins.names import DEFAULT_NAME, SHM_NAME
from collective.ray_plugins.reads import Read, Reads
from collective.types import ArgumentTypeError, CollectiveError, CollectiveTimeoutError

LIVENESS_S = 0.1
"""How often a waiting read checks that the producer still runs, in seconds."""


@dataclass
class _Held:
    """A producer's object: its buffer and event, and the reads in this process using them."""

    meta: CudaIpcMetadata
    device: IpcDevice
    ptr: int
    event: int
    readers: int = 0
    freed: bool = False


@dataclass
class _Mapping:
    """A peer's buffer and event opened in this process, and how many reads use them."""

    meta: CudaIpcMetadata
    device: IpcDevice
    ptr: int
    event: int
    users: int = 0


class CudaObjects:
    """The CUDA objects this process produced, and its reads of other processes' objects."""

    def __init__(self, gpus: Gpus) -> None:
        """Work on the GPUs of ``gpus``; hold nothing yet."""
        self.gpus = gpus
        self._lock = threading.Lock()
        self._opening = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._mapped: dict[bytes, _Mapping] = {}
        self._reads = Reads()
        self._parked: list[tuple[IpcDevice, int, Any]] = []
        """(device, done event, release): reads whose copies had not completed."""
        self._leased: list[_Held] = []
        """Objects freed here that another live process still maps: freed once none does."""

    def publish(self, obj_id: str, tensors: Sequence[Any]) -> CudaIpcMetadata:
        """Pack CUDA ``tensors`` into a new device buffer, record its event; return the metadata.

        A second call for ``obj_id`` (Ray retried the task) returns the first's metadata.

        Raises:
            TypeError: the tensors are not all dense, on one GPU.

        """
        with self._lock:
            held = self._held.get(obj_id)
        if held is not None:
            return held.meta
        self._sweep()
        metas = [(t.shape, t.dtype) for t in tensors]
        device = self._checked_device(tensors)
        offsets, size = layout(metas)
        meta = CudaIpcMetadata(
            metas, "cuda", obj_id=obj_id, gpu=device.uuid(), node_id=self.gpus.node_id(),
            pid=os.getpid(), started=segment.started(os.getpid()) or 0, size=size, offsets=offsets,
        )  # fmt: skip
        if size == 0:
            return meta
        stream = self.gpus.stream(device)
        with device.on_stream(stream):
            ptr = device.alloc(size)
            event = 0
            try:
                event = device.new_event()
                device.record(event, 0)  # the zeroing ran on the legacy stream: order after it
                device.wait(stream, event)
                sources = [
                    pack(device, t, ptr + at, stream)
                    for t, at in zip(tensors, offsets, strict=True)
                ]
                device.record(event, stream)
                del sources  # copies made contiguous: only later work of the stream reuses them
                meta.memory, meta.event = device.export_memory(ptr), device.export_event(event)
            except BaseException:
                if event:
                    device.destroy_event(event)
                device.free(ptr)
                raise
        with self._lock:
            self._held[obj_id] = _Held(meta, device, ptr, event)
        return meta

    def _checked_device(self, tensors: Sequence[Any]) -> IpcDevice:
        """Return the one GPU's device that holds every tensor, or raise ``TypeError``."""
        import torch

        device = self.gpus.device(tensors[0])
        for t in tensors:
            if t.layout != torch.strided or self.gpus.device(t) is not device:
                raise ArgumentTypeError(
                    f"tensor transport {SHM_NAME!r} moves an object's CUDA tensors when they "
                    f"are dense and on one GPU, got a {t.layout} tensor on {t.device} beside "
                    f"one on {tensors[0].device}"
                )
        return device

    def read(self, meta: CudaIpcMetadata, targets: list[Any] | None, timeout_s: float) -> list[Any]:
        """Return the tensors of ``meta``'s object, copied out of the producer's buffer.

        Args:
            meta: what the producer's ``publish`` returned.
            targets: buffers to copy into (any device, contiguous), or None for new
                tensors on the producer's GPU, views of one new buffer.
            timeout_s: how long to wait for the copies, in seconds.

        Raises:
            CollectiveError: this process is on another node, or does not see the GPU;
                the producer died or freed the object; ``abort`` ended the read.
            CollectiveTimeoutError: the copies did not complete within ``timeout_s``.

        """
        self._sweep()
        if meta.node_id != self.gpus.node_id():
            raise CollectiveError(
                f"object {meta.obj_id} lies in GPU memory of node {meta.node_id}, and this "
                f"process runs on node {self.gpus.node_id()}: tensor transport {SHM_NAME!r} "
                "reads CUDA tensors on their producer's node only; use tensor_transport="
                f"{DEFAULT_NAME!r} (NCCL, through a group) across nodes"
            )
        device = self.gpus.find(meta.gpu)
        if device is None:
            raise CollectiveError(
                f"object {meta.obj_id} lies on GPU {meta.gpu}, which this process does not "
                f"see (it sees {self.gpus.uuids() or 'no GPU'}): tensor transport "
                f"{SHM_NAME!r} reads CUDA tensors on their producer's GPU only; give the "
                "consumer a share of that GPU (e.g. num_gpus=0.5 on both actors), or use "
                f"tensor_transport={DEFAULT_NAME!r}"
            )
        if targets is not None:
            check_targets(meta, targets)
        if meta.size == 0:
            return targets if targets is not None else views(meta, self.gpus.empty(0, device))
        with self._reads.holding(meta.obj_id) as read:
            caller, stream = self.gpus.stream(device), self.gpus.side_stream(device)
            done, release = 0, None
            try:
                with device.on_stream(stream):
                    source, event, release = self._acquire(meta, device)
                    try:
                        follow(device, stream, caller)  # what the caller queued first
                        device.wait(stream, event)
                        out = copy_out(meta, device, source, stream, targets, self.gpus)
                    finally:  # after whatever copy was enqueued
                        done = device.new_event()
                        device.record(done, stream)
                self._wait(meta, device, done, read, timeout_s)
            except BaseException:
                if release is not None:
                    self._release_later(device, done, release)
                raise
            device.destroy_event(done)
            release()
        return out

    def _acquire(self, meta: CudaIpcMetadata, device: IpcDevice) -> tuple[int, int, Any]:
        """Return the buffer's address here, the producer's event, and what ends their use.

        Raises:
            CollectiveError: the producer died, or freed the object.

        """
        with self._lock:
            held = self._held.get(meta.obj_id)
            if held is not None and held.meta.memory == meta.memory:  # this process's own
                if held.freed:
                    raise CollectiveError(gone(meta))
                held.readers += 1
                return held.ptr, held.event, lambda: self._unread(meta.obj_id)
            mapping = self._mapped.get(meta.memory)
            if mapping is not None:
                mapping.users += 1
                return mapping.ptr, mapping.event, lambda: self._unmap(meta.memory)
        with self._opening:  # one thread opens a handle: CUDA would count a second open
            with self._lock:
                mapping = self._mapped.get(meta.memory)
            if mapping is None:
                mapping = self._open(meta, device)
            with self._lock:
                self._mapped[meta.memory] = mapping
                mapping.users += 1
        return mapping.ptr, mapping.event, lambda: self._unmap(meta.memory)

    def _open(self, meta: CudaIpcMetadata, device: IpcDevice) -> _Mapping:
        """Open the producer's buffer and event, on its GPU, current now.

        Raises:
            CollectiveError: the producer died, or freed the object.

        """
        if not segment.alive(meta.pid, meta.started):
            raise CollectiveError(gone(meta))
        cuda_leases.take(meta.pid, meta.memory)  # before the open: the producer then waits
        try:
            ptr = device.open_memory(meta.memory)
        except Exception as exc:
            cuda_leases.give(meta.pid, meta.started, meta.memory, gone=True)
            raise CollectiveError(f"{gone(meta)} (opening its memory: {exc})") from None
        try:
            event = device.open_event(meta.event)
        except Exception as exc:
            device.close_memory(ptr)
            cuda_leases.give(meta.pid, meta.started, meta.memory, gone=True)
            raise CollectiveError(f"{gone(meta)} (opening its event: {exc})") from None
        return _Mapping(meta, device, ptr, event)

    def _wait(
        self, meta: CudaIpcMetadata, device: IpcDevice, done: int, read: Read, timeout_s: float
    ) -> None:
        """Wait until ``done`` completes: poll, sleeping longer each time, up to 1 ms.

        Raises:
            CollectiveError: ``abort`` ended the read, or the producer died.
            CollectiveTimeoutError: ``done`` did not complete within ``timeout_s``.

        """
        start = time.monotonic()
        checked, pause = start, 1e-5
        while not device.query(done):
            now = time.monotonic()
            if read.aborted.is_set():
                raise CollectiveError(_aborted(meta.obj_id))
            if now - start > timeout_s:
                raise CollectiveTimeoutError(
                    f"read of object {meta.obj_id} from GPU {meta.gpu}", SHM_NAME, 0,
                    timedelta(seconds=timeout_s),
                    "its copies did not complete; RAY_rdt_fetch_fail_timeout_milliseconds "
                    "sets the bound",
                )  # fmt: skip
            if now - checked > LIVENESS_S:
                checked = now
                if not segment.alive(meta.pid, meta.started):
                    raise CollectiveError(gone(meta))
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        if read.aborted.is_set():
            raise CollectiveError(_aborted(meta.obj_id))
        if not segment.alive(meta.pid, meta.started):  # its event may have been torn down
            raise CollectiveError(gone(meta))

    def _release_later(self, device: IpcDevice, done: int, release: Any) -> None:
        """End a failed read: release its mapping now if no copy is pending, else park it."""
        if done and not device.query(done):
            with self._lock:
                self._parked.append((device, done, release))
            return
        if done:
            device.destroy_event(done)
        release()

    def _sweep(self) -> None:
        """Release the parked reads whose copies have completed, then free what none maps."""
        with self._lock:
            parked, self._parked = self._parked, []
        pending = []
        for device, done, release in parked:
            if device.query(done):
                device.destroy_event(done)
                release()
            else:
                pending.append((device, done, release))
        with self._lock:
            self._parked += pending
            leased, self._leased = self._leased, []
        for held in leased:
            self._free_unmapped(held)

    def _unmap(self, memory: bytes) -> None:
        """End one read's use of a peer's buffer; close it and its event after the last."""
        with self._opening:  # closed before the handle can be opened again
            with self._lock:
                mapping = self._mapped[memory]
                mapping.users -= 1
                if mapping.users:
                    return
                del self._mapped[memory]
            mapping.device.close_memory(mapping.ptr)
            mapping.device.destroy_event(mapping.event)
            meta = mapping.meta
            cuda_leases.give(meta.pid, meta.started, meta.memory)

    def _unread(self, obj_id: str) -> None:
        """End one read of this process's own object; free it if it was freed meanwhile."""
        with self._lock:
            held = self._held[obj_id]
            held.readers -= 1
            if not (held.freed and held.readers == 0):
                return
            del self._held[obj_id]
        self._free_unmapped(held)

    def free(self, obj_id: str) -> None:
        """Free the object's buffer and event, at once or after this process's last read."""
        self._sweep()
        with self._lock:
            held = self._held.get(obj_id)
            if held is None or held.freed:
                return
            held.freed = True
            if held.readers:
                return
            del self._held[obj_id]
        self._free_unmapped(held)

    def _free_unmapped(self, held: _Held) -> None:
        """Free a producer's object now if no other live process maps it, else later."""
        meta = held.meta
        if cuda_leases.holders(meta.pid, meta.memory):
            with self._lock:
                self._leased.append(held)
            return
        _release(held)
        cuda_leases.clear(meta.pid, meta.memory)

    def abort(self, obj_id: str) -> None:
        """End this process's reads of ``obj_id`` in flight; each raises ``CollectiveError``."""
        self._reads.abort(obj_id)


def _release(held: _Held) -> None:
    """Destroy a producer's event and free its buffer."""
    held.device.destroy_event(held.event)
    held.device.free(held.ptr)


def _aborted(obj_id: str) -> str:
    """Return the message of a read of ``obj_id`` that Ray aborted."""
    return f"Ray aborted the read of object {obj_id}"
