"""How a GlooGroup runs its ops: one torch ``ProcessGroupGloo`` per group, built from a store.

``GlooGroupBase`` connects the ranks, starts each op and waits for it under the
failure watch, turns torch's errors into ours, and aborts and destroys the group.
``gloo.GlooGroup`` adds the ops.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from collective.groups.base import BaseGroup
from collective.groups.gloo_reducescatter import Scratch
from collective.groups.gloo_work import (
    Completion,
    GlooWork,
    InFlight,
    buffer_list,
    c10d,
    connect_tcp_store,
    is_timeout,
    one_buffer,
)
from collective.groups.watch import FailureWatch
from collective.store import RendezvousStore, meet
from collective.tensor import DTYPES
from collective.types import (
    DEFAULT_TIMEOUT,
    Backend,
    CollectiveError,
    CollectiveTimeoutError,
    GroupOptions,
)
from collective.work import Work


class GlooGroupBase(BaseGroup):
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
            self._watch = FailureWatch(store, rank, world_size, group_name, lambda: self._ops)
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

    def _fail(
        self, op: str, timeout: timedelta, exc: BaseException, number: int = 0
    ) -> CollectiveError:
        """Mark the group unusable after ``exc`` in collective ``number``; return the error.

        After ``abort``, return the abort's error instead and report nothing.
        """
        if self._aborted is not None:
            return self._aborted_error(op)
        self._error = self._failure(op, timeout, exc, number)
        if self._watch is not None:
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
                detail = f"{detail}; {self._watch.progress(number)}"
            return CollectiveTimeoutError(op, self.group_name, self.rank, timeout, detail)
        return CollectiveError(
            f"{op} on group {self.group_name!r} failed on rank {self.rank}: {exc}"
        )

    def _run(
        self,
        op: str,
        options: Any,
        start: Callable[[timedelta | None], Any],
        finish: Callable[[], None] = lambda: None,
        completion: Completion = Completion.REPORTED,
    ) -> Work:
        """Start one gloo op with ``start(timeout)``; wait for it unless it is async.

        Collectives carry a per-call timeout in gloo's options (None keeps the
        group's) and end by themselves; point-to-point ops take it in ``wait``.
        ``finish`` runs once the op has succeeded, to write staged outputs back.
        Any failure leaves the group unusable. Every op is tracked until it has
        ended, so that ``abort`` knows whether any still runs.
        """
        if self._error is None and self._watch is not None and self._watch.failure is not None:
            self._abort(op, self._watch.failure)
        timeout = options.timeout or self.timeout
        with self._in_flight.lock:
            self._check_usable(destroyed=self._pg is None)
            number = 0
            if completion is not Completion.DIRECT_WAIT:
                self._ops += 1
                number = self._ops
            try:
                work = GlooWork(
                    self, op, start(options.timeout), timeout, finish, completion, number
                )
            except RuntimeError as exc:
                raise self._fail(op, timeout, exc, number) from exc
            self._in_flight.add(work)
        if not options.async_op:
            work.wait()
        return work

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
        if running and pg is not None and self.world_size > 1:
            if self._watch is not None:
                self._watch.report(reason)
            peers = [r for r in range(self.world_size) if r != self.rank]
            self._in_flight.close(pg, peers, running)

    def destroy_group(self) -> None:
        """Abort pending ops, then drop the process group and the TCPStore, at once."""
        self.abort(f"group {self.group_name!r} was destroyed on rank {self.rank}")
        with self._in_flight.lock:
            pg, self._pg, self._tcp_store = self._pg, None, None
        self._scratch = None
        if self._watch is not None:
            self._watch.stop()
        del pg
