"""How an NCCLGroup runs its ops: communicators, streams, launches, abort and destroy.

Communicators are made on first use and cached:

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

Streams: every op runs on a per-device comm stream, taken from the process's
``cuda.STREAMS`` and never destroyed (see ``StreamPool`` for why), that first
waits on an event recorded on the caller's current stream (torch's for torch
tensors, cupy's for cupy arrays). After the op an event is recorded on the comm
stream. A blocking op (``async_op`` False) makes the caller's current stream wait on
that event before it returns, without blocking the host, so any later work on that
stream sees the result. An async op returns at once; its ``Work.wait`` polls the
event up to the timeout, then orders the caller's current stream after it. The
group holds every buffer until its op's event has completed and records the comm
stream's use of torch tensors with torch's caching allocator, so freeing an input
early is safe.

Launches: a group runs one op at a time, under its op lock, so that ops issued from
several threads never interleave their NCCL calls. An op first builds its plan: every
NCCL call it makes, as a bound method and integer arguments. The launch then issues
them between one ``groupStart`` and ``groupEnd``, so no code of ours that could raise
runs inside the NCCL group. Should a call fail there all the same, the NCCL group is
discarded (``nccl_comm.discard_group``), so no peer is left waiting for half an op,
and the group fails: its communicators are aborted.

Locks: the op lock is held for a whole op, including the making of a communicator,
which waits up to the timeout for the peers; the state lock is held for moments
only, so ``abort`` and ``destroy_group`` never wait for an op or a pending init.

``p2p.NcclPointToPoint`` adds the ops built on send and recv, and
``group.NCCLGroup`` the collectives.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from collective import tensor
from collective.groups.base import BaseGroup
from collective.groups.nccl.comm import (
    NCCL_REDUCE_OPS,
    create_communicators,
    cupy_module,
    discard_group,
    encode_unique_id,
    exchange_unique_id,
    release_communicators,
    unavailable_reason,
)
from collective.groups.nccl.cuda import (
    STREAMS,
    NcclWork,
    follow,
    record,
    settled,
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

Step = tuple[Callable[..., Any], tuple[Any, ...]]
"""One call of an op's plan: a bound method of a communicator (or cupy's runtime), its arguments."""

Plan = Callable[[int, Any, int], list[Step]]
"""Returns device i's calls: ``plan(i, communicator, comm_stream_handle)``."""

Communicators = Callable[[timedelta], list[Any]]
"""Returns an op's communicators, one per device, making them within the timeout if new."""

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
        self._cuda = self._cupy.cuda
        try:
            meet(store, f"nccl/{group_name}/init", rank, world_size, timeout)
        except TimeoutError as exc:
            raise CollectiveTimeoutError("init", group_name, rank, timeout, str(exc)) from exc
        self._store = store
        self._lock = threading.Lock()
        self._op_lock = threading.Lock()
        self._comms: dict[tuple[Any, ...], list[Any]] = {}
        self._streams: dict[int, int] = {}
        self._ready: dict[int, Any] = {}
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
                f"{op} on group {self.group_name!r} failed on rank {self.rank}: "
                f"{type(exc).__name__}: {exc}"
            )
        with self._lock:
            self._error = self._error or error
            comms = [c for entry in self._comms.values() for c in entry]
        release_communicators(self._cuda, comms, [], False, self.timeout)
        return error

    # --- communicators and streams (the op lock is held) --------------------------------

    def _communicators(
        self,
        key: tuple[Any, ...],
        store_key: str,
        devices: Sequence[int],
        world: int,
        ranks: Sequence[int],
        timeout: timedelta,
    ) -> list[Any]:
        """Return the cached communicators ``key``, making them through the store if new.

        Communicators made while the group was aborted are aborted, not kept.
        """
        found = self._comms.get(key)
        if found is not None:
            return found
        nccl = self._cuda.nccl
        uid = exchange_unique_id(
            self._store,
            f"nccl/{self.group_name}/{store_key}",
            min(ranks) == 0,
            lambda: encode_unique_id(nccl.get_unique_id()),
            timeout,
            self.group_name,
            self.rank,
        )
        comms = create_communicators(self._cuda, uid, world, ranks, devices, timeout)
        with self._lock:
            aborted = self._aborted
            if aborted is None:
                self._comms[key] = comms
        if aborted is not None:
            release_communicators(self._cuda, comms, [], False, timeout)
            raise CollectiveError(
                f"the group was aborted while its communicators formed: {aborted}"
            )
        return comms

    def _collective_comms(self, devices: Sequence[int], timeout: timedelta) -> list[Any]:
        key = ("collective", tuple(devices))
        found = self._comms.get(key)
        if found is not None:
            return found
        store_key = f"collective/{self._collective_count}"
        self._collective_count += 1
        self._default_devices = self._default_devices or tuple(devices)
        n = len(devices)
        ranks = [self.rank * n + i for i in range(n)]
        return self._communicators(key, store_key, devices, self.world_size * n, ranks, timeout)

    def _stream(self, device: int) -> int:
        stream = self._streams.get(device)
        if stream is None:
            stream = STREAMS.acquire(self._cuda, device)
            with self._lock:
                self._streams[device] = stream
        return stream

    def _ready_event(self, device: int) -> Any:
        """Return the event that marks, on GPU ``device``, where the caller's stream stands.

        One per device serves every op: a stream waits for an event as it was recorded
        when the wait was queued, so recording it again for the next op is safe.
        """
        event = self._ready.get(device)
        if event is None:
            with self._cuda.Device(device):
                event = self._ready[device] = self._cuda.Event(disable_timing=True)
        return event

    # --- launching ----------------------------------------------------------------------

    def _run(
        self,
        op: str,
        options: Any,
        anchors: Sequence[Any],
        communicators: Communicators,
        plan: Plan,
        buffers: Sequence[Any],
    ) -> Work:
        """Run one op under the op lock: get its communicators, then launch ``plan``.

        ``anchors`` holds one caller buffer per device, whose current stream the op
        follows; ``buffers`` holds every caller buffer the op reads or writes.
        """
        timeout = options.timeout or self.timeout
        with self._op_lock:
            self._check_usable(self._destroyed)
            try:
                comms = communicators(timeout)
            except Exception as exc:
                raise self._fail(f"{op} (nccl init)", timeout, exc) from exc
            return self._launch(op, options, timeout, anchors, comms, plan, buffers)

    def _launch(
        self,
        op: str,
        options: Any,
        timeout: timedelta,
        anchors: Sequence[Any],
        comms: Sequence[Any],
        plan: Plan,
        buffers: Sequence[Any],
    ) -> Work:
        """Issue ``plan`` for each device of ``anchors`` on its comm stream, ordered by streams."""
        cuda = self._cuda
        devices = [tensor.cuda_buffer(a, "tensor").device for a in anchors]
        callers = [tensor.current_stream(a) for a in anchors]
        kept = [(x, tensor.cuda_buffer(x, "tensor").device) for x in buffers]
        try:
            streams = [self._stream(d) for d in devices]
            by_device = dict(zip(devices, streams, strict=True))
            steps = [
                plan(i, comm, s) for i, (comm, s) in enumerate(zip(comms, streams, strict=True))
            ]
            for device, stream, caller in zip(devices, streams, callers, strict=True):
                with cuda.Device(device):
                    ready = self._ready_event(device)
                    record(cuda, ready, caller)
                    follow(cuda, stream, ready)
            cuda.nccl.groupStart()
            try:
                for device, calls in zip(devices, steps, strict=True):
                    with cuda.Device(device):
                        for method, args in calls:
                            method(*args)
            except BaseException:
                discard_group(cuda.nccl)
                raise
            cuda.nccl.groupEnd()
            events = {}
            for device, stream in by_device.items():
                with cuda.Device(device):
                    events[device] = cuda.Event(disable_timing=True)
                    record(cuda, events[device], stream)
            for x, device in kept:
                tensor.record_stream(x, by_device[device])
        except Exception as exc:
            raise self._fail(op, timeout, exc) from exc
        event_list = list(events.values())
        with self._lock:
            self._inflight = [e for e in self._inflight if not settled(cuda, e[0])]
            self._inflight.append((event_list, [x for x, _ in kept]))

        def order_after() -> None:
            waits = {(device, tensor.current_stream(x)) for x, device in kept}
            for device, stream in waits:
                with cuda.Device(device):
                    follow(cuda, stream, events[device])

        work = NcclWork(op, cuda, event_list, list(comms), order_after, self._fail, timeout)
        if not options.async_op:
            order_after()
        return work

    def _collective(
        self, op: str, options: Any, anchors: Sequence[Any], plan: Plan, buffers: Sequence[Any]
    ) -> Work:
        """Launch ``plan`` on the collective communicators of ``anchors``' devices."""
        devices = [tensor.cuda_buffer(a, "tensor").device for a in anchors]
        return self._run(
            op,
            options,
            anchors,
            lambda timeout: self._collective_comms(devices, timeout),
            plan,
            buffers,
        )

    def abort(self, reason: str) -> None:
        """End this rank's ops; kernels still running after ``_ABORT_GRACE`` abort the comms."""
        super().abort(reason)
        with self._lock:
            comms = [c for entry in self._comms.values() for c in entry]
            events = [e for pending in self._inflight for e in pending[0]]
        try:
            finished = wait_events(self._cuda, events, comms, _ABORT_GRACE)
        except RuntimeError:
            finished = False
        if not finished:
            release_communicators(self._cuda, comms, [], False, self.timeout)

    def retire(self, reason: str) -> None:
        """Abort the communicators, never destroying them: a peer may be dead.

        ``ncclCommDestroy`` waits for every peer of the communicator (with NCCL 2.31
        and later it can hang when one is gone); ``ncclCommAbort`` never waits. The
        comm streams are not handed on, as after any failure.
        """
        with self._lock:
            if self._error is None:
                self._error = CollectiveError(reason)
        self.destroy_group()

    def destroy_group(self) -> None:
        """Abort what still runs (see ``abort``), destroy the communicators, free the streams.

        The comm streams go back to the process's pool only when every op on them has
        finished; otherwise they are left alone, never destroyed.
        """
        self.abort(f"group {self.group_name!r} was destroyed on rank {self.rank}")
        with self._lock:
            self._destroyed = True
            comms = [c for entry in self._comms.values() for c in entry]
            events = [e for pending in self._inflight for e in pending[0]]
            streams, self._streams = self._streams, {}
            self._comms.clear()
            self._ready.clear()
        if release_communicators(self._cuda, comms, events, self._error is None, self.timeout):
            STREAMS.release(self._cuda, streams)
        with self._lock:
            self._inflight = []
