"""How a CPU group runs its ops: transports at init, lanes, failures, teardown.

``connect`` decides at init which transports run (see there). Blocking ops
run in the caller's thread; async ones, and sends and receives per peer, on
lanes (``lanes``) so that each stream keeps its order. A failure seen by one rank
breaks the group on every rank: the arena's abort word stops the local peers at
once, and the failure watch tells the rest. ``group.CpuGroup`` adds the ops.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import Any, NoReturn

from collective.frameworks.kinds import DTYPES
from collective.groups import progress
from collective.groups.base import BaseGroup
from collective.groups.cpu.connect import Member, Transports, connect
from collective.groups.cpu.routes import Flat, Hierarchy
from collective.groups.gloo.group import GlooGroup
from collective.groups.lanes import Lanes
from collective.groups.shm.algorithms import Collectives
from collective.groups.shm.arena import OP_SEQ
from collective.groups.shm.failures import caller_error
from collective.groups.shm.local_copies import LocalCopies
from collective.groups.shm.sendrecv import SendRecv
from collective.groups.shm.short import ShortOps
from collective.groups.shm.steps import Steps
from collective.groups.shm.sync import Waiter
from collective.groups.watch import FailureWatch
from collective.rendezvous.store import RendezvousStore
from collective.types import (
    DEFAULT_TIMEOUT,
    ArgumentError,
    Backend,
    CollectiveError,
    CollectiveTimeoutError,
    GroupOptions,
    ReduceOp,
)
from collective.work import CompletedWork, Work

_DONE = CompletedWork()
_IDLE_S = 1.0
"""The longest destroy waits for ops running in other threads to give up."""


class CpuRunning(BaseGroup):
    """A CPU group's transports, and how its ops run, fail and end; ``CpuGroup`` adds the ops."""

    device_type = "cpu"
    dtypes = DTYPES

    def __init__(
        self,
        world_size: int,
        rank: int,
        group_name: str,
        store: RendezvousStore,
        timeout: timedelta = DEFAULT_TIMEOUT,
        host: str = "127.0.0.1",
        options: GroupOptions | None = None,
        *,
        node: str | None = None,
        slot_bytes: int | None = None,
    ) -> None:
        """Meet the other ranks, pick the transport and connect; blocks until all arrive.

        Args:
            world_size: the number of ranks.
            rank: this rank.
            group_name: the group's name.
            store: where the ranks meet.
            timeout: the default timeout of every wait and op.
            host: the address Gloo binds to.
            options: the group's settings; ``cpu_transport`` picks the transport.
            node: this rank's node id; None detects it (tests pass one to fake nodes).
            slot_bytes: the arena's slot size; None picks one (tests pass small ones).

        Raises:
            CollectiveTimeoutError: the ranks did not all arrive within ``timeout``.
            CollectiveError: a transport failed to start, or ``cpu_transport="shm"``
                was asked for and shared memory cannot be used.

        """
        super().__init__(world_size, rank, group_name, timeout, options)
        self._closing = False
        self._found = Transports()
        self._waiter: Waiter | None = None
        self._steps: Steps | None = None
        self._short: ShortOps | None = None
        self._sendrecv: SendRecv | None = None
        self._route: Flat | Hierarchy | None = None
        self._watch: FailureWatch | None = None
        self._lanes = Lanes(group_name)
        member = Member(world_size, rank, group_name, store, timeout, host, self.options)
        try:
            connect(member, self._found, node, slot_bytes)
            if self._found.mode != "gloo":
                self._start_shm()
                self._watch = FailureWatch(
                    store, rank, world_size, group_name, on_failure=self._end_gloo_legs
                )
        except TimeoutError as exc:
            self.destroy_group()
            raise CollectiveTimeoutError("init", group_name, rank, timeout, str(exc)) from exc
        except BaseException:
            self.destroy_group()
            raise
        self._gloo = self._found.gloo
        self._full = self._found.full
        self._topology = self._found.topology

    @property
    def transport(self) -> str:
        """Return how this group moves bytes: "shm", "hierarchical" or "gloo"."""
        return self._found.mode

    def _start_shm(self) -> None:
        """Make the node's collectives and the route of the ops over the connected transports."""
        found = self._found
        topo = found.topology
        if topo is None:
            raise CollectiveError("the group's topology is unknown")
        local: Collectives | LocalCopies = LocalCopies()
        if found.arena is not None and found.liveness is not None:
            self._waiter = Waiter(found.arena, topo.local_rank, found.liveness, self._interrupted)
            most = found.gather_bytes
            self._steps = Steps(found.arena, topo.local_rank, self._waiter, topo.local_ranks, most)
            self._sendrecv = SendRecv(found.arena, topo.local_rank, self._waiter)
            local = Collectives(self._steps)
        if found.mode == "shm":
            self._route = Flat(local, self.world_size)
            if self._steps is not None:
                self._short = ShortOps(self._steps, self.world_size, self._accepts)
        else:
            self._route = Hierarchy(topo, local, found.leaders, self.world_size)

    def _accepts(self, op: ReduceOp | None, dtype: str) -> bool:
        """Return whether the checks of an op pass ``op`` (None: no reduction) on ``dtype``."""
        if op is not None:
            try:
                self.check_reduce_op(op, dtype)
            except ArgumentError:
                return False
        return dtype in self.dtypes

    # --- identity ----------------------------------------------------------------------------

    @classmethod
    def backend(cls) -> Backend:
        """Return ``Backend.GLOO``: users keep writing ``backend="gloo"``."""
        return Backend.GLOO

    @classmethod
    def check_backend_availability(cls) -> bool:
        """Return whether torch with gloo support is importable, as ``GlooGroup`` needs."""
        return GlooGroup.check_backend_availability()

    def skip_agreement(self) -> None:
        """Run each op on the Gloo groups underneath without their agreement; see ``BaseGroup``."""
        for gloo in (self._found.gloo, self._found.full):
            if gloo is not None:
                gloo.skip_agreement()
        if isinstance(self._route, Hierarchy):
            self._route.skip_agreement()

    @property
    def error(self) -> CollectiveError | None:
        """Return the failure that made this group unusable, or None if it is healthy."""
        gloo = self._found.gloo
        return gloo.error if gloo is not None else self._error

    # --- running ops -------------------------------------------------------------------------

    def _end_gloo_legs(self, failure: str) -> None:
        """End the Gloo legs' pending ops at once: another rank of the group has failed.

        A leader waits in the leaders' Gloo op, whose own watch hears only of the
        leaders' failures; a rank that dies on another node is seen by its node's
        ranks, which report it to every rank of the group. The legs are aborted,
        so the op there ends with ``failure`` instead of at its timeout.
        """
        for gloo in (self._found.leaders, self._found.full):
            if gloo is not None:
                gloo.abort(f"the group {self.group_name!r} failed: {failure}")

    def _interrupted(self) -> str | None:
        """Return why every wait of this rank must end now, or None."""
        if self._aborted is not None:
            return self._aborted
        watch = self._watch
        return watch.failure if watch is not None else None

    def _submit(
        self, op: str, options: Any, body: Callable[[float], None], lane: str = "collective"
    ) -> Work:
        """Run ``body(deadline)`` as op ``op`` on ``lane``, inline or queued; see ``Lane``."""
        watch = self._watch
        if self._error is None and watch is not None and watch.failure is not None:
            self._error = CollectiveError(
                f"{op} on group {self.group_name!r} was aborted on rank {self.rank}: "
                f"{watch.failure}"
            )
        self._check_usable(destroyed=self._closing)
        timeout = options.timeout or self.timeout

        def run() -> None:
            try:
                body(time.monotonic() + timeout.total_seconds())
            except BaseException as exc:
                self._raise_failure(op, timeout, exc)

        expired = partial(self._expired, op)
        return self._lanes.run(lane, run, expired, options.async_op) or _DONE

    def _raise_failure(self, op: str, timeout: timedelta, exc: BaseException) -> NoReturn:
        """Raise what the caller sees of ``exc``, which ended ``op``; see ``_failed``."""
        error = self._failed(op, timeout, exc)
        if error is exc:
            raise exc
        # The cause's frames hold views of the arena; a group broken by it keeps
        # the error, and the views would keep the arena mapped after destroy.
        raise error from exc.with_traceback(None)

    def _failed(self, op: str, timeout: timedelta, exc: BaseException) -> BaseException:
        """Turn what ``exc`` says into the error the caller sees; break the group if needed."""
        error, breaks = caller_error(
            exc, op, self.group_name, self.rank, timeout, self._global_rank, self._laggards
        )
        if not breaks:
            return error
        if self._aborted is not None:
            return self._aborted_error(op)
        if isinstance(error, CollectiveError):
            self._break(error)
        return error

    def _expired(self, op: str, waited: timedelta) -> CollectiveTimeoutError:
        """Return the error of a ``Work.wait`` that ran out, and break the group."""
        error = CollectiveTimeoutError(op, self.group_name, self.rank, waited, self._laggards())
        self._break(error)
        return error

    def _break(self, error: CollectiveError) -> None:
        """Mark the group unusable, stop the local peers' waits, and tell every rank."""
        if self._error is None:
            self._error = error
        self.launches.clear()
        if self._waiter is not None and self._steps is not None and self._sendrecv is not None:
            self._waiter.abort(self._steps.all_counters() + self._sendrecv.counters(), str(error))
        if self._watch is not None:
            self._watch.report(str(error))

    def _global_rank(self, local_rank: int) -> int:
        topo = self._topology
        return topo.local_ranks[local_rank] if topo is not None else local_rank

    def _laggards(self, stalled: int | None = None) -> str:
        """Describe which ranks never joined this rank's current collective.

        Each local rank publishes in the arena how many collectives it has entered;
        the ranks on other nodes are not asked. ``stalled`` is the local rank this
        rank waited on when time ran out: named when it joined the op but never
        took its step, and every local rank joined (else it may only be waiting,
        as a gathering leader does, for a rank that never came, which is named).
        """
        arena = self._found.arena
        if self._steps is None or arena is None:
            return "the ranks on other nodes did not answer in time"
        counts = {
            self._global_rank(r): int(arena.control[r, OP_SEQ])
            for r in range(self._steps.size)
            if self._global_rank(r) != self.rank
        }
        others = [r for r in range(self.world_size) if r != self.rank and r not in counts]
        line = progress.describe(self.rank, self._steps.op, counts, others, "are on other nodes")
        op = self._steps.op
        if stalled is not None and all(count >= op for count in counts.values()):
            line += (
                f"; rank {self._global_rank(stalled)} joined it but did not take its step in time"
            )
        return line

    # --- teardown ----------------------------------------------------------------------------

    def abort(self, reason: str) -> None:
        """End every op pending on this rank at once, with ``reason``; see ``BaseGroup``.

        Waits in shared memory are woken and end with the reason; the Gloo groups
        underneath abort their own ops. When an op was pending, the other ranks are
        told too (the arena's abort word, the failure watch): their ops with this
        rank could not end otherwise, so their groups break, as if it had died.
        """
        super().abort(reason)
        pending = self._lanes.active()
        if self._waiter is not None and self._steps is not None and self._sendrecv is not None:
            counters = self._steps.all_counters() + self._sendrecv.counters()
            if pending:
                self._waiter.abort(counters, reason)
            else:
                self._waiter.wake_all(counters)
        if pending and self._watch is not None:
            self._watch.report(reason)
        for gloo in (self._found.gloo, self._found.leaders, self._found.full):
            if gloo is not None:
                gloo.abort(reason)

    def destroy_group(self) -> None:
        """End every pending op with an error, release the transports, unmap the arena.

        Ops running in other threads, or queued by ``async_op``, end with a
        ``CollectiveError`` saying the group was destroyed; this returns once they
        have (within about a wait slice), or after ``_IDLE_S`` at the most.
        """
        self._closing = True
        self.abort(f"group {self.group_name!r} was destroyed on rank {self.rank}")
        error = CollectiveError(f"group {self.group_name!r} has been destroyed")
        lanes = self._lanes.stop(error)
        self._found.destroy_gloo()
        if self._watch is not None:
            self._watch.stop()
        idle = all(lane.idle(_IDLE_S) for lane in lanes)
        self._route = None
        if idle:
            for user in (self._waiter, self._steps, self._sendrecv, self._short):
                if user is not None:
                    user.release()
            self._waiter, self._steps, self._sendrecv, self._short = None, None, None, None
            self._found.close_arena()
