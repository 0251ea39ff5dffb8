"""Ray Direct Transport through shared memory, one-sided: ``tensor_transport="COLLECTIVE_SHM"``.

When a method declared with ``@ray.method(tensor_transport=name)`` returns, Ray asks
its actor for the object's metadata: this transport then writes the CPU tensors once
into a shared-memory file of the node (``segment``) and publishes the file's name
with the producer's node and pid. Ray runs nothing on the producer for a transfer:
each consumer's receive maps the file and returns views of it, every consumer at the
same time, with no collective group. The file lives until Ray garbage-collects the
object in the producer (``garbage_collect``), which unlinks it; a consumer that comes
later, or on another node, or after the producer died, gets a ``CollectiveError``
that says which.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ray.experimental.rdt.tensor_transport_manager import (
    CommunicatorMetadata,
    TensorTransportManager,
    TensorTransportMetadata,
)

from collective.ray_plugins import segment
from collective.ray_plugins.names import DEFAULT_NAME, SHM_NAME
from collective.types import ArgumentTypeError, CollectiveError

CHUNK_BYTES = 16 << 20
"""Bytes copied between two checks for an abort, when Ray gives buffers to receive into."""


@dataclass
class ShmMetadata(TensorTransportMetadata):
    """Ray's metadata of an object in shared memory: where its file is, and whose it is.

    ``started`` is the producer's start time (in clock ticks since boot), which tells
    the producer from a later process that reuses its pid.
    """

    obj_id: str = ""
    path: str = ""
    size: int = 0
    node_id: str = ""
    pid: int = 0
    started: int = 0


@dataclass
class ShmCommunicatorMetadata(CommunicatorMetadata):
    """Nothing: a consumer finds everything in the object's ``ShmMetadata``."""


class ShmTransport(TensorTransportManager):
    """A one-sided tensor transport for CPU tensors between processes of one node.

    The producer keeps, per object, the name of the file it wrote; consumers map
    that file. ``abort_transport`` ends a copy into buffers that Ray gave to receive
    into; a read without buffers maps the file and returns at once.
    """

    def __init__(self) -> None:
        """Start with no object held and no read in flight."""
        self._lock = threading.Lock()
        self._held: dict[str, ShmMetadata] = {}
        self._reads: dict[str, list[threading.Event]] = {}
        atexit.register(self._unlink_all)

    def tensor_transport_backend(self) -> str:
        """Return the default transport name; any name registered to this class works alike."""
        return SHM_NAME

    @staticmethod
    def is_one_sided() -> bool:
        """Return True: Ray runs only the consumer's receive, never a send on the producer."""
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        """Return True: ``abort_transport`` ends a consumer's copy at its next chunk."""
        return True

    def actor_has_tensor_transport(self, actor: Any) -> bool:
        """Return True: an actor needs nothing but the transport, which Ray registers in it."""
        return True

    def extract_tensor_transport_metadata(self, obj_id: str, rdt_object: list[Any]) -> Any:
        """Write the object's tensors into a new shared-memory file; return where it lies.

        A second call for the same object (Ray retried the task) returns the first
        call's metadata.

        Raises:
            TypeError: a tensor is not a dense CPU tensor.
            OSError: ``/dev/shm`` is full or not writable; no file is left.

        """
        import torch

        metas = [(t.shape, t.dtype) for t in rdt_object]
        for t in rdt_object:
            if t.device.type != "cpu" or t.layout != torch.strided:
                raise ArgumentTypeError(
                    f"tensor transport {SHM_NAME!r} moves dense CPU tensors, got a "
                    f"{t.layout} tensor on {t.device}; CUDA tensors move with "
                    f"tensor_transport={DEFAULT_NAME!r}"
                )
        with self._lock:
            held = self._held.get(obj_id)
        if held is not None:
            return held
        if not rdt_object:
            return ShmMetadata(metas, None, obj_id=obj_id)
        path, size = segment.write(obj_id, rdt_object)
        pid = os.getpid()
        meta = ShmMetadata(
            metas, "cpu", obj_id=obj_id, path=path, size=size, node_id=_node_id(), pid=pid,
            started=_started(pid) or 0,
        )  # fmt: skip
        with self._lock:
            self._held[obj_id] = meta
        return meta

    def get_communicator_metadata(
        self, src_actor: Any, dst_actor: Any, backend: str | None = None
    ) -> ShmCommunicatorMetadata:
        """Return an empty ``ShmCommunicatorMetadata``: no group and no rank are involved."""
        return ShmCommunicatorMetadata()

    def recv_multiple_tensors(
        self,
        obj_id: str,
        tensor_transport_metadata: Any,
        communicator_metadata: Any,
        target_buffers: list[Any] | None = None,
    ) -> list[Any]:
        """Map the object's file and return its tensors, or copy them into ``target_buffers``.

        Returns:
            Views of this process's copy-on-write mapping of the file (writes to them
            stay in this process), or ``target_buffers`` written in place when given.

        Raises:
            CollectiveError: the producer is on another node, died, or freed the
                object; or Ray aborted the copy into ``target_buffers``.

        """
        meta = _checked(tensor_transport_metadata)
        if not meta.tensor_meta:
            return target_buffers or []
        here = _node_id()
        if meta.node_id != here:
            raise CollectiveError(
                f"object {meta.obj_id} lies in shared memory on node {meta.node_id}, and "
                f"this process runs on node {here}: tensor transport {SHM_NAME!r} moves "
                f"tensors within a node; across nodes use tensor_transport={DEFAULT_NAME!r} "
                "(two-sided, over a collective group of both actors)"
            )
        try:
            views = segment.read(meta.path, meta.obj_id, meta.tensor_meta, meta.size)
        except FileNotFoundError:
            raise CollectiveError(_gone(meta)) from None
        if not _alive(meta.pid, meta.started):
            segment.unlink(meta.path)
            raise CollectiveError(_gone(meta))
        if target_buffers is None:
            return views
        self._copy(obj_id, views, target_buffers)
        return target_buffers

    def _copy(self, obj_id: str, views: Sequence[Any], targets: Sequence[Any]) -> None:
        """Copy ``views`` into ``targets`` by chunks, until done or ``abort_transport``."""
        aborted = threading.Event()
        with self._lock:
            self._reads.setdefault(obj_id, []).append(aborted)
        try:
            for target, view in zip(targets, views, strict=True):
                if not view.numel():
                    continue
                flat_target, flat_view = target.view(-1), view.reshape(-1)
                step = max(1, CHUNK_BYTES // view.element_size())
                for start in range(0, view.numel(), step):
                    if aborted.is_set():
                        raise CollectiveError(f"Ray aborted the read of object {obj_id}")
                    flat_target[start : start + step].copy_(flat_view[start : start + step])
        finally:
            with self._lock:
                reads = self._reads[obj_id]
                reads.remove(aborted)
                if not reads:
                    del self._reads[obj_id]

    def send_multiple_tensors(
        self, tensors: list[Any], tensor_transport_metadata: Any, communicator_metadata: Any
    ) -> None:
        """Refuse: Ray never calls it on a one-sided transport."""
        raise NotImplementedError(f"tensor transport {SHM_NAME!r} is one-sided: it never sends")

    def garbage_collect(self, obj_id: str, tensor_transport_meta: Any, tensors: list[Any]) -> None:
        """Unlink the object's file: consumers that mapped it keep their views, later ones fail."""
        with self._lock:
            held = self._held.pop(obj_id, None)
        if held is not None:
            segment.unlink(held.path)

    def abort_transport(self, obj_id: str, communicator_metadata: Any) -> None:
        """End this process's copies of the object in flight; each raises ``CollectiveError``."""
        with self._lock:
            for aborted in self._reads.get(obj_id, []):
                aborted.set()

    def _unlink_all(self) -> None:
        """Unlink every file this process still holds, as it exits."""
        with self._lock:
            held, self._held = self._held, {}
        for meta in held.values():
            segment.unlink(meta.path)


def _checked(meta: Any) -> ShmMetadata:
    if not isinstance(meta, ShmMetadata):
        raise CollectiveError(f"expecting {ShmMetadata.__name__}, got {type(meta).__name__}")
    return meta


def _gone(meta: ShmMetadata) -> str:
    """Return why the file of ``meta`` cannot be read: its producer died, or freed it."""
    if _alive(meta.pid, meta.started):
        return (
            f"object {meta.obj_id} was freed: its producer (pid {meta.pid}) unlinked its "
            "shared memory when Ray garbage-collected it"
        )
    return f"the producer of object {meta.obj_id} (pid {meta.pid}) died; its tensors are lost"


def _node_id() -> str:
    """Return the id of this process's Ray node (a few µs; a driver may join another later)."""
    import ray

    return str(ray.get_runtime_context().get_node_id())


def _started(pid: int) -> int | None:
    """Return the start time of process ``pid`` in clock ticks, or None if it does not run."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in (b"Z", b"X"):  # a zombie or a dead process: it died
        return None
    return int(fields[19])


def _alive(pid: int, started: int) -> bool:
    """Return whether process ``pid``, started at ``started`` (0: unknown), still runs."""
    now = _started(pid)
    return now is not None and started in (0, now)
