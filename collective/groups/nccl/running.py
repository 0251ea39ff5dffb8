"""How an NCCLGroup runs an op: its cached launch, blocking on the caller's stream or async.

Launches: an op's first call with a given signature (see ``launch``) checks and
describes its buffers, makes its communicators if new, and builds its launch, which the
group keeps; a repeated call looks it up and issues it. A group runs one op at a time,
under its op lock, so ops from several threads never interleave their NCCL calls. A
launch of several calls issues them between one ``groupStart`` and ``groupEnd``, with no
code of ours that could raise inside; should a call fail there all the same, the NCCL
group is discarded (``nccl_comm.discard_group``) and the group fails, its communicators
aborted, so no peer waits for half an op. A failure, an abort or a destroy drops the
launches.

Streams: a blocking op (``async_op`` False) runs on the caller's current stream (torch's
for torch tensors, cupy's for cupy arrays), as NCCL's own API does: no stream, event or
device switch of ours, so the caller's later work on that stream sees the result, and
the op can be captured in a CUDA graph. The watchdog (see ``watchdog``) watches it
against its timeout through one reusable event per stream. An async op runs on a
per-device comm stream, taken from the process's ``cuda.STREAMS`` and never destroyed
(see ``StreamPool``), after an event recorded on the caller's current stream; an event
recorded after the op, both from the group's pool, is what ``Work.wait`` polls up to the
timeout before it orders the caller's current stream after it. The group holds an async
op's buffers until that event has completed and records the comm stream's use of torch
tensors with torch's caching allocator, so freeing an input early is safe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import timedelta
from functools import partial
from typing import Any

from collective.frameworks import cuda_buffers
from collective.groups.launches import Launch as PublicLaunch
from collective.groups.launches import Prepared
from collective.groups.nccl.checking import NcclChecking
from collective.groups.nccl.cuda import DONE, NcclWork, settled
from collective.groups.nccl.first import First
from collective.groups.nccl.guard import ISSUE
from collective.groups.nccl.launch import LAUNCHES_KEPT, Launch, build
from collective.groups.nccl.lifecycle import Builder
from collective.types import ArgumentValueError, CollectiveError, ReduceOp
from collective.work import Work

_ASYNC_CAPTURE = (
    "async_op=True cannot be captured in a CUDA graph: its events and Work.wait cannot "
    "run inside a capture; capture the blocking op (async_op=False) instead"
)

OpParts = tuple[Sequence[Any], tuple[Any, ...], Builder, "tuple[int, ReduceOp | None] | None"]
"""How a call of an op is described: ``(buffers, extra, builder, signed)``.

Each op of ``NCCLGroup`` has a method ``_<op>_parts(*args, options)`` that returns
them for the op's arguments (see ``_op``); describing a call makes nothing: its
``builder`` checks and describes the buffers, once, on the first call of its key."""


class NcclRunning(NcclChecking):
    """Runs each op through its cached launch; ``p2p`` and ``group`` describe the ops."""

    def _new_event(self, device: int) -> Any:
        """Return a new event of GPU ``device``: for an async op when the pool has none free."""
        with self._cuda.Device(device):
            return self._cuda.Event(disable_timing=True)

    def _op(
        self,
        op: str,
        options: Any,
        buffers: Sequence[Any],
        extra: tuple[Any, ...],
        builder: Builder,
        signed: tuple[int, ReduceOp | None] | None = None,
        check_as: str | None = None,
    ) -> Work:
        """Run ``op`` through its cached launch, building it on the first call of its signature.

        ``buffers`` holds every caller buffer the op reads or writes (the key holds
        each one's current stream, which the op runs on or follows); ``extra`` the
        arguments besides the buffers that change the calls (root, reduction);
        ``signed`` the root and reduction of a collective whose signature the ranks
        compare (see ``mismatch``), None for an op they do not. With ``check_as``, the
        ranks compare the signature of that op instead, even where the group skips
        its own checks (``agree``).
        """
        timeout = options.timeout or self.timeout
        launch, _ = self._launch(op, options, buffers, extra, builder, signed, check_as)
        if options.async_op:
            return self._run_async(launch, timeout, *buffers)
        self._run(launch, timeout)
        return DONE

    def _launch(
        self,
        op: str,
        options: Any,
        buffers: Sequence[Any],
        extra: tuple[Any, ...],
        builder: Builder,
        signed: tuple[int, ReduceOp | None] | None = None,
        check_as: str | None = None,
    ) -> tuple[Launch, bool]:
        """Return the launch of a call of ``op`` (see ``_op``), and whether it is kept."""
        key = (op, options.async_op, extra, tuple(map(cuda_buffers.launch_key, buffers)))
        launch = self._launches.get(key)
        if launch is not None:
            return launch, True
        timeout = options.timeout or self.timeout
        return self._build(key, op, options.async_op, timeout, builder, signed, check_as)

    key_of = staticmethod(cuda_buffers.launch_key)
    """Return ``x``'s ``cuda_buffers.launch_key``: its description and the caller's stream."""

    placed_key = key_of
    """Return ``key_of(x)``, which starts with the address of ``x``'s first element."""

    def build(self, op: str, x: Any, options: Any) -> tuple[PublicLaunch, bool]:
        """Return the launch of a public call of ``op`` on ``x``: its NCCL launch, issued.

        See ``BaseGroup.build``. The launch runs on the caller's current stream when
        blocking, on the comm stream when async (see the module's doc).
        """
        describe: Callable[..., OpParts] = getattr(self, f"_{op}_parts")
        launch, kept = self._launch(op, options, *describe((x,), options))
        timeout = options.timeout or self.timeout
        if options.async_op:
            return partial(self._run_async, launch, timeout), kept
        return partial(self._run, launch, timeout), kept

    def prepare(self, op: str, args: tuple[Any, ...], options: Any) -> tuple[Prepared, bool]:
        """Return a run of ``op`` that issues its NCCL launch, found once, here.

        See ``BaseGroup.prepare``. A blocking run issues the launch on the caller's
        stream without making the call's arguments: the launch holds their addresses,
        which the caller's key says are the same. An async run makes them, to record
        their use on the comm stream (see ``_run_async``). An op without parts
        (barrier) runs as ``BaseGroup.prepare`` says.
        """
        describe: Callable[..., OpParts] | None = getattr(self, f"_{op}_parts", None)
        if describe is None:
            return super().prepare(op, args, options)
        launch, kept = self._launch(op, options, *describe(*args, options))
        timeout = options.timeout or self.timeout
        if options.async_op:
            run_async = self._run_async

            def run_async_op(make: Callable[[], tuple[Any, ...]]) -> Work:
                return run_async(launch, timeout, *describe(*make(), options)[0])

            return run_async_op, kept
        run = self._run

        def run_blocking(make: Callable[[], tuple[Any, ...]]) -> Work:
            run(launch, timeout)
            return DONE

        return run_blocking, kept

    def _build(
        self,
        key: tuple[Any, ...],
        op: str,
        async_op: bool,
        timeout: timedelta,
        builder: Builder,
        signed: tuple[int, ReduceOp | None] | None,
        check_as: str | None = None,
    ) -> tuple[Launch, bool]:
        """Check the buffers, make the communicators if new, and build (and keep) the launch.

        A launch built while its stream captures a CUDA graph allocates nothing: it has
        no marker and no signature check, and it is not kept (a later call outside the
        capture builds one that has both).
        """
        device_buffers, communicators, device_calls = builder()
        devices = tuple(cuda_buffers.cuda_buffer(a, "tensor").device for a in device_buffers)
        with self._op_lock:
            self._check_usable(self._destroyed)
            callers = tuple(map(cuda_buffers.current_stream, device_buffers))
            capturing = any(map(self._watch.capturing, callers))
            if capturing and async_op:
                raise ArgumentValueError(_ASYNC_CAPTURE)
            self._capturing = capturing  # no communicator is made during a capture
            try:
                comms = communicators(timeout)
                streams = tuple(map(self._stream, devices)) if async_op else callers
                markers = tuple(
                    self._watch.marker(s, d)
                    for s, d in zip(streams, devices, strict=True)
                    if not capturing
                )
                check = None
                if (
                    signed is not None
                    and (self._checking or check_as is not None)
                    and self.world_size > 1
                    and len(devices) == 1
                    and not capturing
                ):
                    first = (device_buffers[0], devices[0], comms[0], streams[0])
                    check = self._signed(check_as or op, *first, *signed, timeout)
                launch = build(op, devices, comms, streams, device_calls, markers, check, callers)
                name, members = self.names[id(comms[0])]
                kind = self._kind(op, check_as, signed, device_buffers, key[2])
                lock = ISSUE.lock(self._cuda, devices)
                launch = replace(launch, first=First(name, members, kind), lock=lock)
            except ArgumentValueError:
                raise
            except Exception as exc:
                raise self._fail(f"{op} (nccl init)", timeout, exc) from exc
            finally:
                self._capturing = False
            kept = None not in key[3] and not capturing
            if kept:
                with self._lock:
                    if self._open:
                        if len(self._launches) >= LAUNCHES_KEPT:
                            self._launches.pop(next(iter(self._launches)))
                        self._launches[key] = launch
        return launch, kept

    def _run(self, launch: Launch, timeout: timedelta, x: Any = None) -> None:
        """Issue a blocking op's launch on the caller's streams; the watchdog watches it.

        ``x``, the public call's buffer, is unused: the launch holds its address.

        Outside capture, the op's signature check reads the last finished result of
        its ring first, then goes just ahead of the op (on the op's stream, or beside
        it: see ``checking``); in a group that skips its ops' checks, the op reads the
        results of the agreements issued before it.
        """
        with self._op_lock:
            if not self._open:
                self._check_usable(self._destroyed)
            capturing = self._watch.capturing(launch.streams[0])
            first = launch.first
            if first is not None and first.kind not in self._first.agreed.get(first.comm, ()):
                self._connect(launch, first, timeout, capturing)
            signed, single = launch.signed, launch.single
            guard = self._guard
            allowed = guard.enter()
            if not allowed:
                self._check_usable(self._destroyed)
            try:
                if signed is not None and not capturing:
                    found = signed.check.read()
                    if found is not None:
                        raise self._mismatched(found)
                    self._room(signed, timeout)
                elif self._checks and not self._checking and not capturing:
                    failed = self._mismatch()  # the agreements (``agree``) issued before
                    if failed is not None:
                        raise failed
                with launch.lock:
                    if signed is not None and not capturing:
                        self._check_op(launch.op, signed)
                    if single is not None:
                        single[0](*single[1])
                    else:
                        launch.issue(self._nccl, self._cuda)
            except Exception as exc:
                raise self._fail(launch.op, timeout, exc) from exc
            finally:
                if allowed:
                    guard.leave()
            number = 0
            if launch.counted:
                number = self._issued = self._issued + 1
                self._last_op = launch.op
            if not capturing:
                for marker in launch.markers:
                    self._watch.issued(marker, launch.op, timeout, number)

    def _run_async(self, launch: Launch, timeout: timedelta, *buffers: Any) -> Work:
        """Issue an async op's launch on the comm streams, after the callers' streams.

        ``buffers``, every caller buffer the op reads or writes, are held until the
        op's events have completed; torch's allocator is told the comm streams use them.
        """
        cuda = self._cuda
        runtime, pool = cuda.runtime, self._events
        ready: list[Any] = []
        done: list[Any] = []
        with self._op_lock:
            if not self._open:
                self._check_usable(self._destroyed)
            if any(map(self._watch.capturing, launch.callers)):
                raise ArgumentValueError(_ASYNC_CAPTURE)
            first = launch.first
            if first is not None and first.kind not in self._first.agreed.get(first.comm, ()):
                self._connect(launch, first, timeout, False)
            if self._checks:
                found = self._mismatch()
                if found is not None:
                    raise found
            devices, streams = launch.devices, launch.streams
            signed, single = launch.signed, launch.single
            guard = self._guard
            allowed = guard.enter()
            if not allowed:
                self._check_usable(self._destroyed)
            try:
                if signed is not None:
                    self._room(signed, timeout)
                with launch.lock:
                    if signed is not None and self._side:  # beside the op: waits for nothing
                        self._check_op(launch.op, signed)
                    for device, stream, caller in zip(
                        devices, streams, launch.callers, strict=True
                    ):
                        free = pool.get(device)
                        event = free.pop() if free else self._new_event(device)
                        ready.append(event)
                        with cuda.Device(device):
                            runtime.eventRecord(event.ptr, caller)
                            runtime.streamWaitEvent(stream, event.ptr, 0)
                    if signed is not None and not self._side:
                        self._check_op(launch.op, signed)
                    if single is not None:
                        single[0](*single[1])
                    else:
                        launch.issue(self._nccl, cuda)
                    for device, stream in zip(devices, streams, strict=True):
                        free = pool.get(device)
                        event = free.pop() if free else self._new_event(device)
                        done.append(event)
                        with cuda.Device(device):
                            runtime.eventRecord(event.ptr, stream)
                cuda_buffers.record_streams(buffers, devices, streams)
            except Exception as exc:
                raise self._fail(launch.op, timeout, exc) from exc
            finally:
                if allowed:
                    guard.leave()
            number = 0
            if launch.counted:
                number = self._issued = self._issued + 1
                self._last_op = launch.op
            watch = self._watch
            for marker in launch.markers:
                watch.issued(marker, launch.op, timeout, number)
            for device, event in zip(devices, ready, strict=True):
                pool.setdefault(device, []).append(event)
        with self._lock:
            if len(self._inflight) > 8:
                self._inflight = [e for e in self._inflight if not settled(cuda, e[0])]
            self._inflight.append((done, list(buffers)))

        def order_after() -> None:
            for device, event, caller in zip(devices, done, launch.callers, strict=True):
                with cuda.Device(device):
                    runtime.streamWaitEvent(caller, event.ptr, 0)
            with self._op_lock:
                for device, event in zip(devices, done, strict=True):
                    pool.setdefault(device, []).append(event)

        return NcclWork(
            launch.op,
            cuda,
            done,
            self._probe,
            order_after,
            self._fail,
            timeout,
            self._broken,
            number,
        )

    def watch_stream(self, stream: int, device: int, timeout: timedelta) -> None:
        """Watch the work queued so far on ``stream`` of GPU ``device``, as an op of the group.

        For what the watchdog never sees, the replay of a CUDA graph holding the
        group's ops: if that work has not finished within ``timeout``, the group
        fails as after an op's timeout (its communicators are aborted, so the
        replay's kernels end, and its next call raises ``CollectiveTimeoutError``).

        Raises:
            ArgumentValueError: ``stream`` captures a CUDA graph now.

        """
        with self._op_lock:
            self._check_usable(self._destroyed)
            if self._watch.capturing(stream):
                raise ArgumentValueError(
                    "stream captures a CUDA graph: watch the replay after graph.replay(), "
                    "outside capture"
                )
            marker = self._watch.marker(stream, device)
            self._watch.issued(marker, "CUDA graph replay", timeout)

    def _broken(self) -> CollectiveError | None:
        """Return the group's failure, if the watchdog, a signature check or an op found one."""
        if self._checks and self._op_lock.acquire(timeout=self.timeout.total_seconds()):
            try:
                self._mismatch()
            finally:
                self._op_lock.release()
        return self._error
