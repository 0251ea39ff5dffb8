"""How an NCCLGroup runs its ops: communicators, streams, launches, abort and destroy.

Communicators are made on first use and cached, behind the group's lock:

- Collectives use one communicator per device set. A rank that drives ``n``
  devices holds NCCL ranks ``rank * n + i``, so the communicator has
  ``world_size * n`` ranks. Every rank must make its communicators in the same
  order (they do, since collectives are issued in the same order on every rank);
  the k-th one meets under store key ``collective/k``, where group rank 0 publishes
  the ``ncclUniqueId``.
- Point-to-point send and recv use a communicator of their own per pair of
  endpoints ``(rank, gpu index)``, as Ray does, so that a send never waits for
  ranks that take no part in it. The lower endpoint is NCCL rank 0 and publishes
  the ID. A gpu index is the CUDA device ordinal the owning process sees.

Streams: every op runs on a per-device comm stream of the group that first waits on
an event recorded on the caller's current stream (torch's for torch tensors, cupy's
for cupy arrays). After the op an event is recorded on the comm stream. A blocking
op (``async_op`` False) makes the caller's current stream wait on that event before
it returns, without blocking the host, so any later work on that stream sees the
result. An async op returns at once; its ``Work.wait`` polls the event up to the
timeout, then orders the caller's current stream after it. The group holds every
buffer until its op's event has completed and records the comm stream's use of
torch tensors with torch's caching allocator, so freeing an input early is safe.

``nccl_p2p.NcclPointToPoint`` adds the ops built on send and recv, and
``nccl.NCCLGroup`` the collectives.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from collective import tensor
from collective.groups.base import BaseGroup
from collective.groups.nccl_comm import (
    NCCL_REDUCE_OPS,
    NcclWork,
    create_communicators,
    cupy_module,
    encode_unique_id,
    exchange_unique_id,
    release_communicators,
    unavailable_reason,
    wait_events,
)
from collective.store import RendezvousStore, meet
from collective.tensor import NCCL_DTYPES
from collective.types import (
    DEFAULT_TIMEOUT,
    Backend,
    CollectiveError,
    CollectiveTimeoutError,
    GroupOptions,
)
from collective.work import Work

Call = Callable[[int, Any, int], None]
"""Issues device i's NCCL calls: ``call(i, communicator, comm_stream_handle)``."""

_ABORT_GRACE = timedelta(seconds=0.5)
"""How long ``abort`` lets kernels already launched finish before it aborts the communicators."""


class NCCLGroupBase(BaseGroup):
    """A group of GPU ranks connected by NCCL through cupy; ``NCCLGroup`` adds the ops."""

    device_type = "cuda"
    dtypes = frozenset(NCCL_DTYPES)
    supported_ops = frozenset(NCCL_REDUCE_OPS)

    def __init__(
        self,
        world_size: int,
        rank: int,
        group_name: str,
        store: RendezvousStore,
        timeout: timedelta = DEFAULT_TIMEOUT,
        host: str = "127.0.0.1",
        options: GroupOptions | None = None,
    ) -> None:
        """Wait for every rank to arrive; communicators are made on first use, via ``store``.

        ``host`` is unused: NCCL finds its own interfaces.

        Raises:
            CollectiveError: cupy, NCCL or a GPU is missing; says what to install.
            CollectiveTimeoutError: the ranks did not all arrive within ``timeout``.

        """
        super().__init__(world_size, rank, group_name, timeout, options)
        self._cupy = cupy_module()
        try:
            meet(store, f"nccl/{group_name}/init", rank, world_size, timeout)
        except TimeoutError as exc:
            raise CollectiveTimeoutError("init", group_name, rank, timeout, str(exc)) from exc
        self._store = store
        self._lock = threading.RLock()
        self._comms: dict[tuple[Any, ...], list[Any]] = {}
        self._streams: dict[int, Any] = {}
        self._inflight: list[tuple[list[Any], list[Any]]] = []
        self._collective_count = 0
        self._default_devices: tuple[int, ...] | None = None
        self._destroyed = False

    @classmethod
    def backend(cls) -> Backend | str:
        """Return ``Backend.NCCL``."""
        return Backend.NCCL

    @classmethod
    def check_backend_availability(cls) -> bool:
        """Return whether cupy with NCCL is importable and a GPU is visible."""
        return not unavailable_reason()

    @classmethod
    def unavailable_reason(cls) -> str:
        """Return what is missing for the nccl backend, or "" if nothing is."""
        return unavailable_reason()

    def _fail(self, op: str, timeout: timedelta, exc: BaseException) -> CollectiveError:
        """Mark the group unusable after ``exc``, abort its communicators, return the error."""
        if self._aborted is not None:
            return self._aborted_error(op)
        if isinstance(exc, CollectiveError):
            error = exc
        elif isinstance(exc, TimeoutError):
            error = CollectiveTimeoutError(op, self.group_name, self.rank, timeout, str(exc))
        else:
            error = CollectiveError(
                f"{op} on group {self.group_name!r} failed on rank {self.rank}: {exc}"
            )
        with self._lock:
            self._error = self._error or error
            comms = [c for entry in self._comms.values() for c in entry]
        release_communicators(comms, [], False, self.timeout)
        return error

    # --- communicators and streams ------------------------------------------------------

    def _communicators(
        self,
        key: tuple[Any, ...],
        store_key: str,
        devices: Sequence[int],
        world: int,
        ranks: Sequence[int],
        timeout: timedelta,
    ) -> list[Any]:
        """Return the cached communicators ``key``, making them through the store if new."""
        with self._lock:
            found = self._comms.get(key)
            if found is not None:
                return found
            nccl = self._cupy.cuda.nccl
            uid = exchange_unique_id(
                self._store,
                f"nccl/{self.group_name}/{store_key}",
                min(ranks) == 0,
                lambda: encode_unique_id(nccl.get_unique_id()),
                timeout,
                self.group_name,
                self.rank,
            )
            comms = create_communicators(uid, world, ranks, devices, timeout)
            self._comms[key] = comms
            return comms

    def _collective_comms(self, devices: Sequence[int], timeout: timedelta) -> list[Any]:
        key = ("collective", tuple(devices))
        with self._lock:
            if key not in self._comms:
                store_key = f"collective/{self._collective_count}"
                self._collective_count += 1
                self._default_devices = self._default_devices or tuple(devices)
                n = len(devices)
                ranks = [self.rank * n + i for i in range(n)]
                self._communicators(key, store_key, devices, self.world_size * n, ranks, timeout)
            return self._comms[key]

    def _stream(self, device: int) -> Any:
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                with self._cupy.cuda.Device(device):
                    stream = self._cupy.cuda.Stream(non_blocking=True)
                self._streams[device] = stream
            return stream

    # --- launching ----------------------------------------------------------------------

    def _launch(
        self,
        op: str,
        options: Any,
        anchors: Sequence[Any],
        comms: Sequence[Any],
        call: Call,
        buffers: Sequence[Any],
    ) -> Work:
        """Run ``call`` for each device of ``anchors`` on its comm stream, ordered by streams.

        ``anchors`` holds one caller buffer per device, whose current stream the op
        follows; ``buffers`` holds every caller buffer the op reads or writes.
        """
        cuda = self._cupy.cuda
        timeout = options.timeout or self.timeout
        devices = [tensor.cuda_buffer(a, "tensor").device for a in anchors]
        streams = [self._stream(d) for d in devices]
        by_device = dict(zip(devices, streams, strict=True))
        kept = [(x, tensor.cuda_buffer(x, "tensor").device) for x in buffers]
        try:
            for anchor, device, stream in zip(anchors, devices, streams, strict=True):
                with cuda.Device(device):
                    ready = cuda.Event(disable_timing=True)
                    ready.record(cuda.ExternalStream(tensor.current_stream(anchor)))
                    stream.wait_event(ready)
            cuda.nccl.groupStart()
            try:
                for i, (comm, device) in enumerate(zip(comms, devices, strict=True)):
                    with cuda.Device(device):
                        call(i, comm, by_device[device].ptr)
            finally:
                cuda.nccl.groupEnd()
            events = {}
            for device, stream in by_device.items():
                with cuda.Device(device):
                    events[device] = cuda.Event(disable_timing=True)
                    events[device].record(stream)
            for x, device in kept:
                tensor.record_stream(x, by_device[device].ptr)
        except RuntimeError as exc:
            raise self._fail(op, timeout, exc) from exc
        event_list = list(events.values())
        with self._lock:
            self._inflight = [e for e in self._inflight if not all(v.done for v in e[0])]
            self._inflight.append((event_list, [x for x, _ in kept]))

        def order_after() -> None:
            for x, device in kept:
                with cuda.Device(device):
                    cuda.ExternalStream(tensor.current_stream(x)).wait_event(events[device])

        work = NcclWork(op, event_list, list(comms), order_after, self._fail, timeout)
        if not options.async_op:
            order_after()
        return work

    def _collective(
        self, op: str, options: Any, anchors: Sequence[Any], call: Call, buffers: Sequence[Any]
    ) -> Work:
        """Launch ``call`` on the collective communicators of ``anchors``' devices."""
        self._check_usable(self._destroyed)
        devices = [tensor.cuda_buffer(a, "tensor").device for a in anchors]
        timeout = options.timeout or self.timeout
        try:
            comms = self._collective_comms(devices, timeout)
        except (RuntimeError, TimeoutError) as exc:
            raise self._fail(f"{op} (nccl init)", timeout, exc) from exc
        return self._launch(op, options, anchors, comms, call, buffers)

    def abort(self, reason: str) -> None:
        """End this rank's ops; kernels still running after ``_ABORT_GRACE`` abort the comms."""
        super().abort(reason)
        with self._lock:
            comms = [c for entry in self._comms.values() for c in entry]
            events = [e for pending in self._inflight for e in pending[0]]
        try:
            finished = wait_events(events, comms, _ABORT_GRACE)
        except RuntimeError:
            finished = False
        if not finished:
            release_communicators(comms, [], False, self.timeout)

    def destroy_group(self) -> None:
        """Abort what still runs (see ``abort``), destroy the communicators, drop the streams."""
        self.abort(f"group {self.group_name!r} was destroyed on rank {self.rank}")
        with self._lock:
            self._destroyed = True
            comms = [c for entry in self._comms.values() for c in entry]
            events = [e for pending in self._inflight for e in pending[0]]
            self._comms.clear()
            self._streams.clear()
        release_communicators(comms, events, self._error is None, self.timeout)
        with self._lock:
            self._inflight = []
