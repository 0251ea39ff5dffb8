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

Launches: an op's first call with a given signature (see ``launch``) checks and
describes its buffers, makes its communicators if new, and builds its launch, which
the group keeps; a repeated call looks it up and issues it. A group runs one op at a
time, under its op lock, so that ops issued from several threads never interleave
their NCCL calls. A launch of several calls issues them between one ``groupStart``
and ``groupEnd``, so no code of ours that could raise runs inside the NCCL group;
should a call fail there all the same, the NCCL group is discarded
(``nccl_comm.discard_group``), so no peer is left waiting for half an op, and the
group fails: its communicators are aborted. A failure, an abort or a destroy drops
the launches.

Streams: a blocking op (``async_op`` False) runs on the caller's current stream
(torch's for torch tensors, cupy's for cupy arrays), as NCCL's own API does: no
stream, event or device switch of ours, so the caller's later work on that stream
sees the result, and the op can be captured in a CUDA graph. The watchdog (see
``watchdog``) watches it against its timeout through one reusable event per stream.
An async op runs on a per-device comm stream, taken from the process's
``cuda.STREAMS`` and never destroyed (see ``StreamPool`` for why), that first waits
on an event recorded on the caller's current stream; after the op an event is
recorded on the comm stream, both from the group's pool. ``Work.wait`` polls that
event up to the timeout, then orders the caller's current stream after it. The
group holds an async op's buffers until its event has completed and records the
comm stream's use of torch tensors with torch's caching allocator, so freeing an
input early is safe.

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
from collective.groups.nccl import mismatch
from collective.groups.nccl.comm import (
    NCCL_REDUCE_OPS,
    create_communicators,
    cupy_module,
    encode_unique_id,
    exchange_unique_id,
    release_communicators,
    unavailable_reason,
)
from collective.groups.nccl.cuda import STREAMS, NcclWork, follow, record, settled, wait_events
from collective.groups.nccl.launch import LAUNCHES_KEPT, Launch, Plan, Signed, build
from collective.groups.nccl.watchdog import Watch
from collective.store import RendezvousStore, meet
from collective.tensor import NCCL_DTYPES, CudaBuffer
from collective.types import (
    DEFAULT_TIMEOUT,
    Backend,
    CollectiveError,
    CollectiveTimeoutError,
    GroupOptions,
    ReduceOp,
)
from collective.work import Work

Communicators = Callable[[timedelta], list[Any]]
"""Returns an op's communicators, one per device, making them within the timeout if new."""

Builder = Callable[[], tuple[Sequence[Any], Communicators, Plan]]
"""Checks an op's buffers once; returns its anchors, communicators and plan."""

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
        self._nccl = self._cuda.nccl
        try:
            meet(store, f"nccl/{group_name}/init", rank, world_size, timeout)
        except TimeoutError as exc:
            raise CollectiveTimeoutError("init", group_name, rank, timeout, str(exc)) from exc
        self._store = store
        self._lock = threading.Lock()
        self._op_lock = threading.Lock()
        self._comms: dict[tuple[Any, ...], list[Any]] = {}
        self._streams: dict[int, int] = {}
        self._events: dict[int, list[Any]] = {}
        self._inflight: list[tuple[list[Any], list[Any]]] = []
        self._launches: dict[tuple[Any, ...], Launch] = {}
        self._collective_count = 0
        self._default_devices: tuple[int, ...] | None = None
        self._destroyed = False
        self._open = True
        """False once the group failed, was aborted or destroyed: ``_check_usable`` says why."""
        self._checking = mismatch.enabled()
        self._checks: dict[int, mismatch.Check] = {}
        self._watch = Watch(
            self._cuda,
            self._op_lock,
            self._all_comms,
            self._fail,
            self._mismatch,
            self._check_events,
        )

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

    def _check_usable(self, destroyed: bool) -> None:
        """Raise at once if the group is broken; a timeout the watchdog found raises as one."""
        error = self._error
        if isinstance(error, CollectiveTimeoutError):
            raise CollectiveTimeoutError(
                error.op,
                error.group_name,
                error.rank,
                error.timeout,
                f"{error.detail}; group {self.group_name!r} is unusable: destroy it and create "
                "it again",
            )
        super()._check_usable(destroyed)

    def _all_comms(self) -> list[Any]:
        with self._lock:
            return [c for entry in self._comms.values() for c in entry]

    def _close(self) -> None:
        """Refuse later ops and forget every launch (they hold the communicators)."""
        self._open = False
        self._launches = {}

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
            first = self._error
            if first is None:
                self._error = error
                self._close()
            comms = [c for entry in self._comms.values() for c in entry]
        if first is not None:  # the first failure aborted the communicators
            return first
        self._watch.stopped = True
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
        nccl = self._nccl
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

    def _comms_of(self, bufs: Sequence[CudaBuffer]) -> Communicators:
        """Return the getter of the collective communicators of ``bufs``' devices."""
        devices = [b.device for b in bufs]
        return lambda timeout: self._collective_comms(devices, timeout)

    def _stream(self, device: int) -> int:
        stream = self._streams.get(device)
        if stream is None:
            stream = STREAMS.acquire(self._cuda, device)
            with self._lock:
                self._streams[device] = stream
        return stream

    def _event(self, device: int) -> Any:
        """Return a free event of GPU ``device`` from the group's pool, made if none is free."""
        free = self._events.get(device)
        if free:
            return free.pop()
        with self._cuda.Device(device):
            return self._cuda.Event(disable_timing=True)

    def _give_back(self, device: int, events: Sequence[Any]) -> None:
        """Return ``events`` of GPU ``device`` to the pool: every wait on them is queued."""
        self._events.setdefault(device, []).extend(events)

    # --- launching ----------------------------------------------------------------------

    def _op(
        self,
        op: str,
        options: Any,
        buffers: Sequence[Any],
        anchors: Sequence[Any],
        extra: tuple[Any, ...],
        builder: Builder,
        signed: tuple[int, ReduceOp | None] | None = None,
    ) -> Work:
        """Run ``op`` through its cached launch, building it on the first call of its signature.

        ``buffers`` holds every caller buffer the op reads or writes, ``anchors`` one
        per device, whose current streams the op runs on (or follows); ``extra`` the
        arguments besides the buffers that change the calls (root, reduction);
        ``signed`` the root and reduction of a collective whose signature the ranks
        compare (see ``mismatch``), None for an op they do not.
        """
        key = (
            op,
            options.async_op,
            extra,
            tuple(map(tensor.buffer_key, buffers)),
            tuple(map(tensor.current_stream, anchors)),
        )
        timeout = options.timeout or self.timeout
        launch = self._launches.get(key)
        if launch is None:
            launch = self._build(key, op, options.async_op, timeout, builder, signed)
        if options.async_op:
            return self._run_async(launch, timeout, anchors, buffers)
        self._run(launch, timeout)
        return DONE

    def _build(
        self,
        key: tuple[Any, ...],
        op: str,
        async_op: bool,
        timeout: timedelta,
        builder: Builder,
        signed: tuple[int, ReduceOp | None] | None,
    ) -> Launch:
        """Check the buffers, make the communicators if new, and build (and keep) the launch."""
        anchors, communicators, plan = builder()
        devices = tuple(tensor.cuda_buffer(a, "tensor").device for a in anchors)
        with self._op_lock:
            self._check_usable(self._destroyed)
            try:
                comms = communicators(timeout)
                if async_op:
                    streams = tuple(self._stream(d) for d in devices)
                else:
                    streams = tuple(key[4])
                markers = tuple(
                    self._watch.marker(s, d) for s, d in zip(streams, devices, strict=True)
                )
                check = None
                if signed is not None and self._checking and len(devices) == 1:
                    check = self._signed(op, anchors[0], devices[0], comms[0], *signed)
                launch = build(op, devices, comms, streams, plan, markers, check)
            except Exception as exc:
                raise self._fail(f"{op} (nccl init)", timeout, exc) from exc
            if None not in key[3]:
                with self._lock:
                    if self._open:
                        if len(self._launches) >= LAUNCHES_KEPT:
                            self._launches.pop(next(iter(self._launches)))
                        self._launches[key] = launch
        return launch

    def _signed(
        self, op: str, x: Any, device: int, comm: Any, root: int, reduce_op: ReduceOp | None
    ) -> Signed:
        """Return the signature check of ``op`` on ``x``: its words, put on GPU ``device``."""
        check = self._checks.get(device)
        if check is None:
            check = self._checks[device] = mismatch.Check(self._cupy, device)
        with self._cuda.Device(device):
            words = self._cupy.asarray(mismatch.words(op, x, root, reduce_op))
        return Signed(check, words, int(words.data.ptr), comm)

    def _mismatch(self) -> CollectiveError | None:
        """Read the finished signature checks (op lock held); fail the group on a mismatch.

        Returns the group's error after a mismatch, or a CUDA error of a check's event.
        """
        for check in self._checks.values():
            try:
                found = check.read()
            except RuntimeError as exc:
                return self._fail(check.oldest(), self.timeout, exc)
            if found is not None:
                error = CollectiveError(
                    f"group {self.group_name!r}, found on rank {self.rank}: {found}; NCCL "
                    "moved nothing right, and the group is unusable"
                )
                return self._fail(found.split(":")[0], self.timeout, error)
        return None

    def _run(self, launch: Launch, timeout: timedelta) -> None:
        """Issue a blocking op's launch on the caller's streams; the watchdog watches it."""
        with self._op_lock:
            if not self._open:
                self._check_usable(self._destroyed)
            capturing = self._watch.capturing(launch.markers[0])
            if self._checks and not capturing:
                found = self._mismatch()
                if found is not None:
                    raise found
            signed, single = launch.signed, launch.single
            try:
                if signed is not None and not capturing:
                    signed.check.issue(launch.op, signed.ptr, signed.comm, launch.streams[0])
                if single is not None:
                    single[0](*single[1])
                else:
                    launch.issue(self._nccl, self._cuda)
            except Exception as exc:
                raise self._fail(launch.op, timeout, exc) from exc
            if not capturing:
                for marker in launch.markers:
                    self._watch.issued(marker, launch.op, timeout)

    def _run_async(
        self, launch: Launch, timeout: timedelta, anchors: Sequence[Any], buffers: Sequence[Any]
    ) -> Work:
        """Issue an async op's launch on the comm streams, after the callers' streams."""
        cuda = self._cuda
        callers = [tensor.current_stream(a) for a in anchors]
        with self._op_lock:
            if not self._open:
                self._check_usable(self._destroyed)
            if self._checks:
                found = self._mismatch()
                if found is not None:
                    raise found
            signed = launch.signed
            try:
                ready = [self._event(d) for d in launch.devices]
                for device, event, stream, caller in zip(
                    launch.devices, ready, launch.streams, callers, strict=True
                ):
                    with cuda.Device(device):
                        record(cuda, event, caller)
                        follow(cuda, stream, event)
                if signed is not None:
                    signed.check.issue(launch.op, signed.ptr, signed.comm, launch.streams[0])
                launch.issue(self._nccl, cuda)
                done = [self._event(d) for d in launch.devices]
                for device, event, stream in zip(launch.devices, done, launch.streams, strict=True):
                    with cuda.Device(device):
                        record(cuda, event, stream)
                for x in buffers:
                    tensor.record_stream(x, launch.streams[0])
            except Exception as exc:
                raise self._fail(launch.op, timeout, exc) from exc
            for marker in launch.markers:
                if not self._watch.capturing(marker):
                    self._watch.issued(marker, launch.op, timeout)
            for device, event in zip(launch.devices, ready, strict=True):
                self._give_back(device, [event])
        with self._lock:
            if len(self._inflight) > 8:
                self._inflight = [e for e in self._inflight if not settled(cuda, e[0])]
            self._inflight.append((done, list(buffers)))

        def order_after() -> None:
            for device, event, caller in zip(launch.devices, done, callers, strict=True):
                with cuda.Device(device):
                    follow(cuda, caller, event)
            with self._op_lock:
                for device, event in zip(launch.devices, done, strict=True):
                    self._give_back(device, [event])

        return NcclWork(
            launch.op, cuda, done, self._all_comms(), order_after, self._fail, timeout, self._broken
        )

    def _broken(self) -> CollectiveError | None:
        """Return the group's failure, if the watchdog, a signature check or an op found one."""
        if self._checks and self._op_lock.acquire(timeout=self.timeout.total_seconds()):
            try:
                self._mismatch()
            finally:
                self._op_lock.release()
        return self._error

    def _check_events(self) -> list[Any]:
        """Return the events of the signature checks not yet read."""
        return [e for check in list(self._checks.values()) for e in check.events()]

    def abort(self, reason: str) -> None:
        """End this rank's ops; kernels still running after ``_ABORT_GRACE`` abort the comms."""
        super().abort(reason)
        with self._lock:
            self._close()
            comms = [c for entry in self._comms.values() for c in entry]
            events = [e for pending in self._inflight for e in pending[0]]
        events += self._watch.pending()
        self._watch.stopped = True
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
        pending = self._watch.pending()
        self.abort(f"group {self.group_name!r} was destroyed on rank {self.rank}")
        with self._lock:
            self._destroyed = True
            comms = [c for entry in self._comms.values() for c in entry]
            events = [e for pending in self._inflight for e in pending[0]] + pending
            streams, self._streams = self._streams, {}
            self._comms.clear()
        if release_communicators(self._cuda, comms, events, self._error is None, self.timeout):
            STREAMS.release(self._cuda, streams)
        with self._lock:
            self._inflight = []


class _Done(Work):
    """The ``Work`` of a blocking op: queued on the caller's stream, which orders what follows."""

    def wait(self, timeout: timedelta | None = None) -> None:
        """Return at once: later work on the caller's stream runs after the op."""

    def is_completed(self) -> bool:
        """Return True."""
        return True

    def exception(self) -> BaseException | None:
        """Return None; a failure the watchdog finds fails the group's next call."""
        return None


DONE = _Done()
"""The one ``Work`` every blocking op returns."""
