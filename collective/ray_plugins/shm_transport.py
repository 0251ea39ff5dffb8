"""Ray Direct Transport through shared memory, one-sided: ``tensor_transport="COLLECTIVE_SHM"``.

When a method declared with ``@ray.method(tensor_transport=name)`` returns, Ray asks
its actor for the object's metadata: this transport then writes the CPU tensors once
into a shared-memory file of the node (``segment``) and publishes the file's name
with the producer's node and pid. Ray runs nothing on the producer for a transfer:
each consumer's receive maps the file and returns views of it, every consumer at the
same time, with no collective group. A consumer on another node runs a Ray task
pinned to the producer's node that reads the file there (``remote_read``); the
bytes travel once through Ray's object store and the consumer cuts the same tensors
from them. The file lives until Ray garbage-collects the object in the producer
(``garbage_collect``), which unlinks it; a consumer that comes later, or after the
producer died, gets a ``CollectiveError`` that says which, on any node.

An object of CUDA tensors takes the same steps on the GPU (``cuda_objects``): one
device buffer, shared by CUDA IPC with consumers on the producer's node and GPU.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from ray.experimental.rdt.tensor_transport_manager import (
    CommunicatorMetadata,
    FetchRequest,
    TensorTransportManager,
    TensorTransportMetadata,
)

from collective.ray_plugins import remote_read, segment
from collective.ray_plugins.carried import refuse_uncarried
from collective.ray_plugins.cuda_buffer import CudaIpcMetadata
from collective.ray_plugins.cuda_gpus import Gpus, TorchGpus
from collective.ray_plugins.cuda_objects import CudaObjects
from collective.ray_plugins.held import HeldFiles
from collective.ray_plugins.names import SHM_NAME
from collective.ray_plugins.reads import Read, Reads
from collective.types import ArgumentTypeError, CollectiveError

CHUNK_BYTES = 16 << 20
"""Bytes copied between two checks for an abort, when Ray gives buffers to receive into."""


@dataclass
class ShmMetadata(TensorTransportMetadata):
    """Ray's metadata of an object in shared memory: where its file is, and whose it is.

    ``started`` is the producer's start time (in clock ticks since boot), which tells
    the producer from a later process that reuses its pid. ``table`` holds the
    tensors' dtypes and shapes packed: the metadata pickles as it, at every hop
    through Ray, and ``tensor_meta`` is rebuilt from it where it lands.
    """

    obj_id: str = ""
    path: str = ""
    size: int = 0
    node_id: str = ""
    pid: int = 0
    started: int = 0
    table: segment.Table | None = None

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickle every field but ``tensor_meta``, which the ``table`` rebuilds."""
        kept = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "tensor_meta"}
        return _unpickled, (kept,)


def _unpickled(kept: dict[str, Any]) -> ShmMetadata:
    """Return the ``ShmMetadata`` whose fields ``ShmMetadata.__reduce__`` kept."""
    table = kept["table"]
    return ShmMetadata(table.metas() if table is not None else [], **kept)


@dataclass
class ShmCommunicatorMetadata(CommunicatorMetadata):
    """Nothing: a consumer finds everything in the object's ``ShmMetadata``."""


@dataclass
class RemoteFetch(FetchRequest):
    """A read of an object's file started on its producer's node (``remote_read``).

    ``ref`` is the reading task's result; ``targets`` the buffers to copy into, if any.
    """

    meta: ShmMetadata
    ref: Any
    targets: list[Any] | None = None


class ShmTransport(TensorTransportManager):
    """A one-sided tensor transport for CPU tensors from any node to any node, CUDA ones on one GPU.

    The producer keeps, per object, the name of the file it wrote; consumers on its
    node map that file, consumers elsewhere read it through a task on its node. CUDA
    objects go to ``CudaObjects``.
    ``abort_transport`` ends a copy into buffers that Ray gave to receive into, and a
    read from another node; a read on the node without buffers maps the file and
    returns at once.
    """

    def __init__(self, gpus: Gpus | None = None) -> None:
        """Start with no object held and no read in flight; CUDA tensors on ``gpus``' GPUs."""
        self._cuda = CudaObjects(gpus or TorchGpus())
        self._held = HeldFiles()
        self._reads = Reads()

    def tensor_transport_backend(self) -> str:
        """Return the default transport name; any name registered to this class works alike."""
        return SHM_NAME

    @staticmethod
    def is_one_sided() -> bool:
        """Return True: Ray runs only the consumer's receive, never a send on the producer."""
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        """Return True: ``abort_transport`` ends a consumer's copy or cross-node read at once."""
        return True

    def actor_has_tensor_transport(self, actor: Any) -> bool:
        """Return True: an actor needs nothing but the transport, which Ray registers in it."""
        return True

    def extract_tensor_transport_metadata(self, obj_id: str, rdt_object: list[Any]) -> Any:
        """Write the object's tensors into a new shared-memory file (or GPU buffer); say where.

        A second call for the same object (Ray retried the task) returns the first
        call's metadata.

        Raises:
            TypeError: the tensors are not all dense CPU tensors, nor all on one GPU, or
                one holds what the transport cannot carry (``carried``); nothing is left.
            OSError: ``/dev/shm`` is full or not writable; no file is left.

        """
        import torch

        refuse_uncarried(obj_id, rdt_object, SHM_NAME)
        on_gpu = list(map(self._cuda.gpus.holds, rdt_object))
        if any(on_gpu) and all(on_gpu):
            return self._cuda.publish(obj_id, rdt_object)
        dense = torch.strided
        if any(on_gpu) or not all(t.is_cpu and t.layout == dense for t in rdt_object):
            t = next(
                t
                for t, gpu in zip(rdt_object, on_gpu, strict=True)
                if gpu or t.device.type != "cpu" or t.layout != dense
            )
            raise ArgumentTypeError(
                f"tensor transport {SHM_NAME!r} moves an object's tensors when they are "
                f"all dense CPU tensors or all CUDA ones, got a {t.layout} tensor on "
                f"{t.device} among tensors on {sorted({str(x.device) for x in rdt_object})}"
            )
        metas = [(t.shape, t.dtype) for t in rdt_object]
        held = self._held.get(obj_id)
        if held is not None:
            return held
        if not rdt_object:
            return ShmMetadata(metas, None, obj_id=obj_id)
        table = segment.Table.of(metas)
        path, size = segment.write(obj_id, rdt_object, table)
        pid = os.getpid()
        meta = ShmMetadata(
            metas, "cpu", obj_id=obj_id, path=path, size=size, node_id=_node_id(), pid=pid,
            started=segment.started(pid) or 0, table=table,
        )  # fmt: skip
        self._held.add(obj_id, meta, path)
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
        """Return the object's tensors, or copy them into ``target_buffers``.

        On the producer's node this maps the file; on another node it reads the file
        there (``remote_read``), waiting at most Ray's RDT fetch timeout
        (``RAY_rdt_fetch_fail_timeout_milliseconds``). CUDA tensors are copied out of
        the producer's GPU buffer (``CudaObjects.read``), on its node and GPU only.

        Returns:
            Tensors that this process may write (views of its copy-on-write mapping of
            the file, or of its own copy of the bytes read on another node), or
            ``target_buffers`` written in place when given.

        Raises:
            CollectiveError: the producer died or freed the object, or its node is
                gone; or Ray aborted the read; or CUDA tensors lie on another node or GPU.
            CollectiveTimeoutError: the bytes from another node did not come in time.

        """
        request = self.fetch_multiple_tensors(
            obj_id, tensor_transport_metadata, communicator_metadata, target_buffers
        )
        return self.wait_fetch_complete(request, _fetch_timeout_s())

    def fetch_multiple_tensors(
        self,
        obj_id: str,
        tensor_transport_metadata: Any,
        communicator_metadata: Any,
        target_buffers: list[Any] | None = None,
    ) -> FetchRequest:
        """Read the object on this node at once; start reading it on the producer's node else.

        Returns:
            A ``FetchRequest`` holding the tensors, or a ``RemoteFetch`` to wait for
            with ``wait_fetch_complete``.

        Raises:
            CollectiveError: as ``recv_multiple_tensors`` says, on this node.

        """
        if isinstance(tensor_transport_metadata, CudaIpcMetadata):
            got = self._cuda.read(tensor_transport_metadata, target_buffers, _fetch_timeout_s())
            return FetchRequest(obj_id, got)
        meta = _checked(tensor_transport_metadata)
        if not meta.tensor_meta:
            return FetchRequest(obj_id, target_buffers or [])
        if meta.node_id != _node_id():
            ref = remote_read.start(
                meta.node_id, meta.path, meta.obj_id, _table(meta), meta.size, meta.pid,
                meta.started,
            )  # fmt: skip
            return RemoteFetch(obj_id, [], meta, ref, target_buffers)
        try:
            views = segment.read(meta.path, meta.obj_id, _table(meta), meta.size)
        except FileNotFoundError:
            raise CollectiveError(_gone(meta)) from None
        if not segment.alive(meta.pid, meta.started):
            segment.unlink(meta.path)
            raise CollectiveError(_gone(meta))
        if target_buffers is None:
            return FetchRequest(obj_id, views)
        with self._reads.holding(obj_id) as read:
            self._copy(obj_id, read, views, target_buffers)
        return FetchRequest(obj_id, target_buffers)

    def wait_fetch_complete(self, fetch_request: FetchRequest, timeout: float = -1) -> list[Any]:
        """Return the tensors of ``fetch_request``, waiting up to ``timeout`` s for other nodes.

        Args:
            fetch_request: what ``fetch_multiple_tensors`` returned.
            timeout: seconds to wait for a read on another node; a negative one means
                Ray's RDT fetch timeout.

        Raises:
            CollectiveError: as ``recv_multiple_tensors`` says.
            CollectiveTimeoutError: the read did not end within ``timeout``.

        """
        if not isinstance(fetch_request, RemoteFetch):
            return fetch_request.tensors
        timeout_s = timeout if timeout >= 0 else _fetch_timeout_s()
        meta, targets = fetch_request.meta, fetch_request.targets
        with self._reads.holding(fetch_request.obj_id, fetch_request.ref) as read:
            try:
                payload = remote_read.fetch(
                    fetch_request.ref, meta.obj_id, meta.node_id, timeout_s, SHM_NAME, read.aborted
                )
            except CollectiveError:
                if read.aborted.is_set():
                    raise CollectiveError(_aborted(fetch_request.obj_id)) from None
                raise
            table = _table(meta)
            base = remote_read.whole(  # with ``targets``, a view of ``payload``, kept here
                payload, meta.obj_id, table, meta.size, private=targets is None
            )
            views = segment.views(base, table)
            if targets is None:
                if read.aborted.is_set():
                    raise CollectiveError(_aborted(fetch_request.obj_id))
                return views
            self._copy(fetch_request.obj_id, read, views, targets)
        return targets

    def _copy(self, obj_id: str, read: Read, views: Sequence[Any], targets: Sequence[Any]) -> None:
        """Copy ``views`` into ``targets`` by chunks, until done or ``read`` is aborted."""
        for target, view in zip(targets, views, strict=True):
            if not view.numel():
                continue
            flat_target, flat_view = target.view(-1), view.reshape(-1)
            step = max(1, CHUNK_BYTES // view.element_size())
            for start in range(0, view.numel(), step):
                if read.aborted.is_set():
                    raise CollectiveError(_aborted(obj_id))
                flat_target[start : start + step].copy_(flat_view[start : start + step])

    def send_multiple_tensors(
        self, tensors: list[Any], tensor_transport_metadata: Any, communicator_metadata: Any
    ) -> None:
        """Refuse: Ray never calls it on a one-sided transport."""
        raise NotImplementedError(f"tensor transport {SHM_NAME!r} is one-sided: it never sends")

    def garbage_collect(self, obj_id: str, tensor_transport_meta: Any, tensors: list[Any]) -> None:
        """Unlink the object's file, or free its GPU buffer: consumers that read it keep theirs."""
        self._cuda.free(obj_id)
        self._held.release(obj_id)

    def abort_transport(self, obj_id: str, communicator_metadata: Any) -> None:
        """End this process's reads of the object in flight; each raises ``CollectiveError``.

        A copy into buffers stops at its next chunk; a read on another node is
        cancelled, and its wait ends at once.
        """
        import ray

        self._cuda.abort(obj_id)
        for read in self._reads.abort(obj_id):
            if read.ref is not None:
                ray.cancel(read.ref)


def _checked(meta: Any) -> ShmMetadata:
    if not isinstance(meta, ShmMetadata):
        raise CollectiveError(f"expecting {ShmMetadata.__name__}, got {type(meta).__name__}")
    return meta


def _table(meta: ShmMetadata) -> segment.Table:
    """Return the table of ``meta``'s tensors (rebuilt from ``tensor_meta`` if it has none)."""
    return meta.table if meta.table is not None else segment.Table.of(meta.tensor_meta)


def _gone(meta: ShmMetadata) -> str:
    """Return why the file of ``meta`` cannot be read: its producer died, or freed it."""
    return segment.gone(meta.obj_id, meta.pid, meta.started)


def _aborted(obj_id: str) -> str:
    """Return the message of a read of ``obj_id`` that Ray aborted."""
    return f"Ray aborted the read of object {obj_id}"


def _fetch_timeout_s() -> float:
    """Return Ray's bound on an RDT fetch, in seconds."""
    from ray._private import ray_constants

    return float(ray_constants.RDT_FETCH_FAIL_TIMEOUT_SECONDS)


def _node_id() -> str:
    """Return the id of this process's Ray node (a few µs; a driver may join another later)."""
    import ray

    return str(ray.get_runtime_context().get_node_id())
