"""The base of NCCLGroup: communicators, streams, failure, abort and destroy.

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

Launches, streams and the mismatch check: see ``running``, ``checking`` and
``mismatch``; the check's own communicators (``COLLECTIVE_NCCL_CHECK=side``) are
cached here with the others. A failure, an abort or a destroy drops the launches.

Peers: a rank counts the collectives it issues and keeps the last one's name; its
``FailureWatch`` answers the peers through the store (``groups.progress``). An op that
times out asks every peer how far it got, to name those that never issued it, and a
failure is told to the peers, whose groups fail at once.

Locks: the op lock is held for a whole op, including the making of a communicator,
which waits up to the timeout for the peers; the state lock is held for moments
only, so ``abort`` and ``destroy_group`` never wait for an op or a pending init. The
communicators themselves are aborted or destroyed through the group's ``CommGuard``,
never while another thread is inside an NCCL call on them (see ``guard``), and every
communicator made is held (``comm.keep``) until then, so the garbage collector never
destroys one.

``making.NcclMaking`` makes the communicators and streams,
``checking.NcclChecking`` adds the signature checks, ``running.NcclRunning`` how ops
run, ``p2p.NcclPointToPoint`` the ops built on send and recv, and ``group.NCCLGroup``
the collectives.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from datetime import timedelta
from itertools import chain
from typing import Any

from collective.frameworks.cuda_buffers import NCCL_DTYPES
from collective.groups.base import BaseGroup
from collective.groups.nccl import mismatch
from collective.groups.nccl.comm import (
    NCCL_REDUCE_OPS,
    cupy_module,
    release_communicators,
    unavailable_reason,
)
from collective.groups.nccl.cuda import STREAMS, wait_events
from collective.groups.nccl.first import FirstUse
from collective.groups.nccl.guard import CommGuard
from collective.groups.nccl.launch import DeviceCalls, Launch
from collective.groups.nccl.watchdog import Watch
from collective.groups.progress import answer_wait
from collective.groups.watch import FailureWatch
from collective.rendezvous.store import RendezvousStore, meet
from collective.types import (
    DEFAULT_TIMEOUT,
    Backend,
    CollectiveError,
    CollectiveTimeoutError,
    GroupOptions,
)

Communicators = Callable[[timedelta], list[Any]]
"""Returns an op's communicators, one per device, making them within the timeout if new."""

Builder = Callable[[], tuple[Sequence[Any], Communicators, DeviceCalls]]
"""Checks an op's buffers once; returns its buffer per device, communicators and device calls."""

_ABORT_GRACE = timedelta(seconds=0.5)
"""How long ``abort`` lets kernels already launched finish before it aborts the communicators."""


class NcclLifecycle(BaseGroup):
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
            ArgumentValueError: ``COLLECTIVE_NCCL_CHECK`` is not 0, 1 or side, or is side
                where NCCL cannot order the checks (``mismatch.require_side``).
            CollectiveError: cupy, NCCL or a GPU is missing; says what to install.
            CollectiveTimeoutError: the ranks did not all arrive within ``timeout``.

        """
        super().__init__(world_size, rank, group_name, timeout, options)
        checks = mismatch.mode()  # before the peers wait: a bad value fails here, at once
        self._cupy = cupy_module()
        self._cuda = self._cupy.cuda
        self._nccl = self._cuda.nccl
        if checks == mismatch.SIDE:
            mismatch.require_side(self._nccl)
        try:
            meet(store, f"nccl/{group_name}/init", rank, world_size, timeout)
        except TimeoutError as exc:
            raise CollectiveTimeoutError("init", group_name, rank, timeout, str(exc)) from exc
        self._store = store
        self._first = FirstUse(store, group_name, rank)
        self._lock = threading.Lock()
        self._op_lock = threading.Lock()
        self._asking = threading.Lock()
        """Held by a timed-out op while it asks the peers and records the error: the same
        timeout found meanwhile by the watchdog or ``wait`` takes that error, not asking again."""
        self._comms: dict[tuple[Any, ...], list[Any]] = {}
        self.names: dict[int, tuple[str, tuple[int, ...]]] = {}
        """Each communicator list's store key and member ranks, by the id of its first."""
        self._capturing = False
        """Set while a launch is built on a capturing stream: no communicator is made."""
        self._guard = CommGuard()
        """Every NCCL call on ``_comms`` runs between ``_guard.enter()`` and ``leave()``;
        their abort or destroy runs through ``_guard.end`` (see ``guard``)."""
        self._probe = self._guard.probe(self._all_comms)
        self._streams: dict[int, int] = {}
        self._events: dict[int, list[Any]] = {}
        self._inflight: list[tuple[list[Any], list[Any]]] = []
        self._launches: dict[tuple[Any, ...], Launch] = {}
        self._collective_count = 0
        self._default_devices: tuple[int, ...] | None = None
        self._destroyed = False
        self._open = True
        """False once the group failed, was aborted or destroyed: ``_check_usable`` says why."""
        self._checking = checks != mismatch.OFF
        self._side = checks == mismatch.SIDE
        """Whether the checks run on their own communicators and the comm streams."""
        self._checks: dict[int, mismatch.Check] = {}
        self._issued, self._last_op = 0, ""  # collectives (not send, recv) issued; the last
        self._peers: FailureWatch | None = None
        self._listeners: list[Callable[[CollectiveError], None]] = []
        if world_size > 1:
            count, last = (lambda: self._issued), (lambda: self._last_op)
            own = store.watcher()  # never waits behind an op's store reads
            self._peers = FailureWatch(
                own, rank, world_size, group_name, count, self._reported, last
            )
        self._watch = Watch(
            self._cuda,
            self._op_lock,
            self._probe,
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

    def on_failure(self, listener: Callable[[CollectiveError], None]) -> None:
        """Have ``listener(error)`` called once, from whichever thread finds the group's failure.

        A group built on this one (a group over several GPUs, whose leaders talk over
        NCCL) breaks with it at once, even when the failure comes from the watchdog.
        """
        self._listeners.append(listener)

    def fail(self, error: CollectiveError) -> None:
        """Fail the group with ``error`` on this rank and tell the other ranks (see ``_fail``)."""
        self._fail("nccl op", self.timeout, error)

    def skip_agreement(self) -> None:
        """Drop the signature check of each op: ``CheckedGroup`` compares every call itself."""
        self._checking = False

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
            return list(chain.from_iterable(self._comms.values()))

    def _close(self) -> None:
        """Refuse later ops and forget every launch (they hold the communicators)."""
        self._open = False
        self._launches = {}
        self.launches.clear()

    def _reported(self, report: str) -> None:
        """Fail the group because another rank reported ``report`` (the watch thread runs it)."""
        self._fail("nccl op", self.timeout, CollectiveError(f"group {self.group_name!r}: {report}"))

    def _fail(
        self, op: str, timeout: timedelta, exc: BaseException, number: int = 0
    ) -> CollectiveError:
        """Mark the group unusable after ``exc``, abort its communicators, return the error.

        ``number`` is the group's count of collectives with ``op`` (0: not counted);
        when such an op timed out, the error says which peers never issued it. The
        first failure is told to the peers.
        """
        if self._aborted is not None:
            return self._aborted_error(op)
        peers = self._peers
        timed_out = isinstance(exc, TimeoutError) and not isinstance(exc, CollectiveError)
        with self._asking if timed_out else nullcontext():
            if isinstance(exc, CollectiveError):
                error = exc
            elif timed_out:
                detail = str(exc)
                if number and peers is not None and self._error is None:
                    detail += "; " + peers.progress(number, answer_wait(timeout), op)
                error = CollectiveTimeoutError(op, self.group_name, self.rank, timeout, detail)
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
        if peers is not None:
            peers.report(str(error))
        release_communicators(self._cuda, comms, [], False, self.timeout, self._guard)
        for listener in self._listeners:
            listener(error)
        return error

    # --- signature checks (see ``checking``) -------------------------------------------

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
                error = mismatch.error(self.group_name, self.rank, found)
                return self._fail(found.split(":")[0], self.timeout, error)
        return None

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
        finished = False
        if not self._guard.ended:  # else a failure aborted the communicators already
            try:
                finished = wait_events(self._cuda, events, self._probe, _ABORT_GRACE)
            except RuntimeError:
                finished = False
        if not finished:
            release_communicators(self._cuda, comms, [], False, self.timeout, self._guard)

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
        healthy = self._error is None and not self._guard.ended  # else aborted already
        if release_communicators(self._cuda, comms, events, healthy, self.timeout, self._guard):
            STREAMS.release(self._cuda, streams)
        with self._lock:
            self._inflight = []
        if self._peers is not None:
            self._peers.stop()
