"""How a GlooGroup runs its ops: one torch ``ProcessGroupGloo`` per group, built from a store.

``GlooRunning`` connects the ranks, starts each op and waits for it under the
failure watch, turns torch's errors into ours, and aborts and destroys the group.
``group.GlooGroup`` adds the ops.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from collective.frameworks.kinds import DTYPES
from collective.groups.base import BaseGroup
from collective.groups.gloo.agree import Call, Carried
from collective.groups.gloo.agreement import Agreement
from collective.groups.gloo.reducescatter import Scratch
from collective.groups.gloo.work import (
    Completion,
    GlooWork,
    InFlight,
    buffer_list,
    c10d,
    connect_tcp_store,
    is_closed,
    is_timeout,
    nothing,
    one_buffer,
)
from collective.groups.lanes import Lane, Task
from collective.groups.progress import answer_wait
from collective.groups.watch import FailureWatch
from collective.rendezvous.store import RendezvousStore, meet
from collective.types import (
    DEFAULT_TIMEOUT,
    Backend,
    BarrierOptions,
    CollectiveError,
    CollectiveTimeoutError,
    GroupOptions,
)
from collective.work import CompletedWork, Work

REASON_WAIT_S = 0.25
"""How long an op whose connection a peer closed waits for that peer's reason."""


class GlooRunning(BaseGroup):
    """A group of CPU ranks connected by torch's ``ProcessGroupGloo``; ``GlooGroup`` adds the ops.

    Rank 0 starts a ``TCPStore`` on port 0 at ``host`` and publishes its address
    through the rendezvous store; the other ranks read it and connect. The Gloo
    device binds to ``host``, so no network interface variable is consulted.
    """

    device_type = "cpu"
    dtypes = DTYPES
    _scratch: Scratch | None = None
    """The reducescatters' scratch buffer, made by the first one."""

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
        """Connect this rank to the others; blocks until every rank has arrived.

        Raises:
            CollectiveTimeoutError: the ranks did not all arrive within ``timeout``.
            CollectiveError: gloo or its store failed to start.

        """
        super().__init__(world_size, rank, group_name, timeout, options)
        self._tcp_store: Any = None
        self._pg: Any = None
        self._watch: FailureWatch | None = None
        self._in_flight = InFlight()
        self._ops = 0
        """How many collectives this rank has issued on the group (send and recv excepted)."""
        self._last = ""
        """The name of the last of them."""
        self._agreeing = world_size > 1
        """Whether each op first checks that every rank passed the same arguments."""
        self._lanes: dict[str, Lane] = {}
        self._agreement = Agreement(
            world_size, rank, group_name, timeout, self._numbered, lambda: self._pg
        )
        dist = c10d()
        try:
            self._tcp_store = connect_tcp_store(store, rank, host, timeout)
            meet(store, "gloo", rank, world_size, timeout)
            pg_options = dist.ProcessGroupGloo._Options()
            pg_options._timeout = timeout
            pg_options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            prefix = "/".join(p for p in (group_name, store.incarnation) if p)
            prefixed = dist.PrefixStore(f"{prefix}/", self._tcp_store)
            self._pg = dist.ProcessGroupGloo(prefixed, rank, world_size, pg_options)
            self._watch = FailureWatch(
                store, rank, world_size, group_name, lambda: self._ops, last_op=lambda: self._last
            )
        except TimeoutError as exc:
            self.destroy_group()
            raise CollectiveTimeoutError("init", group_name, rank, timeout, str(exc)) from exc
        except RuntimeError as exc:
            self.destroy_group()
            raise self._failure("init", timeout, exc) from exc

    @classmethod
    def backend(cls) -> Backend | str:
        """Return ``Backend.GLOO``."""
        return Backend.GLOO

    @classmethod
    def check_backend_availability(cls) -> bool:
        """Return whether torch with gloo support is importable."""
        try:
            c10d()
        except CollectiveError:
            return False
        return True

    def skip_agreement(self) -> None:
        """Run each op without first checking that the ranks agree on it; see ``BaseGroup``."""
        self._agreeing = False

    def _fail(
        self, op: str, timeout: timedelta, exc: BaseException, number: int = 0
    ) -> CollectiveError:
        """Mark the group unusable after ``exc`` in collective ``number``; return the error.

        After ``abort``, return the abort's error instead and report nothing.
        """
        if self._aborted is not None:
            return self._aborted_error(op)
        timed_out = is_timeout(exc)
        if timed_out and self._watch is not None:
            # Told before the peers are asked how far they got: gloo has closed this
            # rank's connections, and a peer that sees them close waits for the reason.
            self._watch.report(str(CollectiveTimeoutError(op, self.group_name, self.rank, timeout)))
        self._error = self._failure(op, timeout, exc, number)
        self.launches.clear()
        if self._watch is not None and not timed_out:
            self._watch.report(str(self._error))
        return self._error

    def _abort(self, op: str, failure: str) -> CollectiveError:
        """Mark the group unusable because another rank reported ``failure``."""
        if self._aborted is not None:
            return self._aborted_error(op)
        self._error = CollectiveError(
            f"{op} on group {self.group_name!r} was aborted on rank {self.rank}: {failure}"
        )
        return self._error

    def _wait(self, op: str, torch_work: Any, timeout: timedelta | None) -> None:
        """Wait for a collective up to ``timeout``; raise at once if another rank failed.

        With ``timeout`` None the wait ends with the op, which gloo bounds by the op's
        own timeout. Point-to-point ops are not watched: torch completes their
        futures only inside ``wait``, and a dead peer breaks their one connection.
        """
        if self._watch is None:
            torch_work.wait(timeout) if timeout is not None else torch_work.wait()
            return
        finished, failure = self._watch.wait(torch_work, timeout)
        if failure is not None:
            raise self._abort(op, failure)
        if not finished:
            raise TimeoutError(f"timed out waiting {timeout} for the op to complete")
        torch_work.wait()

    def _interrupted(self, watched: bool) -> bool:
        """Return whether a wait on a pending op would end at once (see ``WorkOwner``)."""
        watch = self._watch
        reported = watched and watch is not None and watch.failure is not None
        return self._aborted is not None or reported

    def _failure(
        self, op: str, timeout: timedelta, exc: BaseException, number: int = 0
    ) -> CollectiveError:
        if is_timeout(exc):
            detail = str(exc)
            if number and self._watch is not None:
                detail = f"{detail}; {self._watch.progress(number, answer_wait(timeout), op)}"
            return CollectiveTimeoutError(op, self.group_name, self.rank, timeout, detail)
        if is_closed(exc) and self._watch is not None:
            # A peer whose own op failed closes its connections, then says why.
            reason = self._watch.awaited(REASON_WAIT_S)
            if reason is not None:
                return CollectiveError(
                    f"{op} on group {self.group_name!r} was aborted on rank {self.rank}: {reason}"
                )
        return CollectiveError(
            f"{op} on group {self.group_name!r} failed on rank {self.rank}: {exc}"
        )

    def _run(
        self,
        op: str,
        options: Any,
        start: Callable[[timedelta | None], Any],
        finish: Callable[[], None] = nothing,
        completion: Completion = Completion.REPORTED,
        call: Call | None = None,
        carried: Carried | None = None,
    ) -> Work:
        """Start one gloo op with ``start(timeout)``; wait for it unless it is async.

        Collectives carry a per-call timeout in gloo's options (None keeps the
        group's) and end by themselves; point-to-point ops take it in ``wait``.
        ``finish`` runs once the op has succeeded, to write staged outputs back.
        Any failure leaves the group unusable. Every op is tracked until it has
        ended, so that ``abort`` knows whether any still runs.

        A collective's ``call`` is first agreed on by every rank (see
        ``agree``), on the group's collective lane: in the caller's thread
        when the op is blocking and the lane idle, else on the lane's thread, so
        that an async op returns at once and the ops reach gloo in issue order.
        An op that says how it is ``carried`` is done there when its data fits.
        """
        if call is None or not self._agreeing:
            work = self._start(op, options, start, finish, completion)
            if not options.async_op:
                work.wait()
            return work

        def run() -> Work:
            number = self._next_number(op)
            if self._agreement.agree(call, options, number, carried):
                return CompletedWork()
            work = self._start(op, options, start, finish, completion, number)
            work.wait()
            return work

        return self._on_lane("collective", op, options, run)

    def _on_lane(self, lane_name: str, op: str, options: Any, run: Callable[[], Work]) -> Work:
        """Run ``run`` as op ``op`` on the lane ``lane_name``: inline when it can, else queued."""
        lane = self._lane(lane_name)
        if not options.async_op and lane.enter():
            try:
                return run()
            finally:
                lane.leave()

        def body() -> None:
            run()

        def expired(waited: timedelta) -> BaseException:
            message = f"timed out waiting {waited} for the op to complete"
            return self._fail(op, waited, TimeoutError(message), self._ops)

        return lane.submit(Task(body, expired), options.async_op)

    def _lane(self, name: str) -> Lane:
        with self._in_flight.lock:
            self._check_usable(destroyed=self._pg is None)
            lane = self._lanes.get(name)
            if lane is None:
                lane = self._lanes[name] = Lane(f"collective-{self.group_name}-{name}")
            return lane

    def _next_number(self, op: str) -> int:
        """Count one more collective of this rank; raise if the group cannot run it."""
        with self._in_flight.lock:
            self._check_usable(destroyed=self._pg is None)
            return self._count(op)

    def _count(self, op: str) -> int:
        """Count collective ``op`` as this rank's next and return its number; hold the lock."""
        self._ops += 1
        self._last = op
        return self._ops

    def _start(
        self,
        op: str,
        options: Any,
        start: Callable[[timedelta | None], Any],
        finish: Callable[[], None] = nothing,
        completion: Completion = Completion.REPORTED,
        number: int | None = None,
    ) -> GlooWork:
        """Start one gloo op with ``start(timeout)`` and track it.

        ``number`` is the op's place among the group's collectives; None counts a
        new one, except for send and recv (0).
        """
        if self._error is None and self._watch is not None and self._watch.failure is not None:
            self._abort(op, self._watch.failure)
        timeout = options.timeout or self.timeout
        with self._in_flight.lock:
            self._check_usable(destroyed=self._pg is None)
            if number is None:
                number = 0
                if completion is not Completion.DIRECT_WAIT:
                    number = self._count(op)
            try:
                work = GlooWork(
                    self, op, start(options.timeout), timeout, finish, completion, number
                )
            except RuntimeError as exc:
                raise self._fail(op, timeout, exc, number) from exc
            self._in_flight.add(work)
        return work

    def _numbered(
        self, op: str, options: Any, start: Callable[[timedelta | None], Any], number: int
    ) -> GlooWork:
        """Start one gloo call as the group's collective ``number`` (see ``_start``)."""
        return self._start(op, options, start, number=number)

    def agree(self, call: Call, timeout: timedelta | None = None) -> None:
        """Check that every rank is about to run ``call``; no data moves.

        This is the check each op makes first, for a caller that skips it in the
        ops (``skip_agreement``) to make it ahead of work of its own.

        Raises:
            ArgumentValueError: the ranks' calls differ; the same error on every rank.
            CollectiveError: the exchange itself failed; the group is unusable.

        """
        options = BarrierOptions(timeout)

        def run() -> Work:
            self._agreement.agree(call, options, self._next_number(call.op))
            return CompletedWork()

        self._on_lane("collective", call.op, options, run)

    _one = staticmethod(one_buffer)
    _list = staticmethod(buffer_list)

    def abort(self, reason: str) -> None:
        """End every op pending on this rank at once by closing this rank's gloo connections.

        Only when an op may still run in gloo (blocked in another thread, async and
        unfinished, or given up on after a failure): the other ranks are told
        ``reason`` through their abort keys, then every connection of this rank
        closes, which fails each such op here at once (it then raises ``reason``)
        and the other ranks' ops with this rank.
        """
        super().abort(reason)
        with self._in_flight.lock:
            pg, running = self._pg, self._in_flight.running()
            lanes, self._lanes = list(self._lanes.values()), {}
        if running and pg is not None and self.world_size > 1:
            if self._watch is not None:
                self._watch.report(reason)
            peers = [r for r in range(self.world_size) if r != self.rank]
            self._in_flight.close(pg, peers, running)
        error = CollectiveError(f"group {self.group_name!r} was aborted: {self._aborted}")
        for lane in lanes:
            lane.stop(error)

    def destroy_group(self) -> None:
        """Abort pending ops, then drop the process group and the TCPStore, at once."""
        self.abort(f"group {self.group_name!r} was destroyed on rank {self.rank}")
        with self._in_flight.lock:
            pg, self._pg, self._tcp_store = self._pg, None, None
        self._scratch = None
        if self._watch is not None:
            self._watch.stop()
        del pg
