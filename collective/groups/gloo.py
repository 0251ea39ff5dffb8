"""GlooGroup: one torch ``ProcessGroupGloo`` per group, built directly from a store."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from collective.groups.base import BaseGroup
from collective.groups.gloo_reducescatter import ChunkExchange, Scratch
from collective.groups.gloo_work import (
    Completion,
    GlooWork,
    InFlight,
    buffer_list,
    c10d,
    c10d_reduce_op,
    call_options,
    commit_all,
    connect_tcp_store,
    is_timeout,
    one_buffer,
)
from collective.groups.watch import FailureWatch
from collective.store import RendezvousStore, meet
from collective.tensor import DTYPES, CpuBuffer
from collective.types import (
    DEFAULT_TIMEOUT,
    AllGatherOptions,
    AllReduceOptions,
    AllToAllOptions,
    Backend,
    BarrierOptions,
    BroadcastOptions,
    CollectiveError,
    CollectiveTimeoutError,
    GatherOptions,
    GroupOptions,
    RecvOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
    SendOptions,
)
from collective.work import Work

_P2P_TAG = 0


class GlooGroup(BaseGroup):
    """A group of CPU ranks connected by torch's ``ProcessGroupGloo``.

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

    def allreduce(self, tensors: Sequence[Any], options: AllReduceOptions) -> Work:
        """Reduce by ``options.reduce_op`` into every rank's tensor, in place."""
        buf = self._one(tensors, "tensor", writable=True)
        op = c10d_reduce_op(options.reduce_op)
        return self._run(
            "allreduce",
            options,
            lambda t: self._pg.allreduce([buf.tensor], call_options("Allreduce", t, reduceOp=op)),
            buf.commit,
        )

    def barrier(self, options: BarrierOptions) -> Work:
        """Block until every rank has entered the barrier."""
        return self._run("barrier", options, lambda t: self._pg.barrier(call_options("Barrier", t)))

    def reduce(self, tensors: Sequence[Any], options: ReduceOptions) -> Work:
        """Reduce onto the root's tensor; other ranks' tensors are left unchanged.

        Gloo uses every rank's buffer as scratch, so non-root ranks reduce from a copy.
        """
        is_root = self.rank == options.root_rank
        buf = self._one(tensors, "tensor", writable=is_root)
        tensor = buf.tensor if is_root else buf.tensor.clone()
        op, root = c10d_reduce_op(options.reduce_op), options.root_rank
        return self._run(
            "reduce",
            options,
            lambda t: self._pg.reduce(
                [tensor], call_options("Reduce", t, reduceOp=op, rootRank=root)
            ),
            buf.commit,
        )

    def broadcast(self, tensors: Sequence[Any], options: BroadcastOptions) -> Work:
        """Copy the root's tensor into every other rank's tensor, in place."""
        buf = self._one(tensors, "tensor", writable=self.rank != options.root_rank)
        root = options.root_rank
        return self._run(
            "broadcast",
            options,
            lambda t: self._pg.broadcast([buf.tensor], call_options("Broadcast", t, rootRank=root)),
            buf.commit,
        )

    def allgather(
        self,
        tensor_lists: Sequence[Sequence[Any]],
        tensors: Sequence[Any],
        options: AllGatherOptions,
    ) -> Work:
        """Write rank i's tensor into element i of every rank's list."""
        source = self._one(tensors, "tensor", writable=False)
        outputs = self._list(tensor_lists, "tensor_list", writable=True)
        out = [[o.tensor for o in outputs]]
        return self._run(
            "allgather",
            options,
            lambda t: self._pg.allgather(out, [source.tensor], call_options("Allgather", t)),
            lambda: commit_all(outputs),
        )

    def reducescatter(
        self,
        tensors: Sequence[Any],
        tensor_lists: Sequence[Sequence[Any]],
        options: ReduceScatterOptions,
    ) -> Work:
        """Reduce element i of every rank's list into rank i's tensor; inputs stay unchanged.

        One gloo alltoall sends chunk j to rank j, then each rank reduces what it
        received, in rank order (see ``gloo_reducescatter``): this beats torch's
        gloo reduce_scatter and ``ray.util.collective``'s allreduce per chunk at
        every size measured.
        """
        output = self._one(tensors, "tensor", writable=True)
        inputs = self._list(tensor_lists, "tensor_list", writable=False)
        if self._scratch is None:
            self._scratch = Scratch()
        exchange = ChunkExchange(output.tensor, [i.tensor for i in inputs], self._scratch)

        def finish() -> None:
            exchange.reduce(options.reduce_op)
            output.commit()

        return self._run(
            "reducescatter",
            options,
            lambda t: self._pg.alltoall_base(
                exchange.received, exchange.sent, [], [], call_options("AllToAll", t)
            ),
            finish,
        )

    def send(self, tensors: Sequence[Any], options: SendOptions) -> Work:
        """Send the tensor to ``options.dst_rank``; completes once it has been sent."""
        buf = self._one(tensors, "tensor", writable=False)
        return self._run(
            "send",
            options,
            lambda _: self._pg.send([buf.tensor], options.dst_rank, _P2P_TAG),
            completion=Completion.DIRECT_WAIT,
        )

    def recv(self, tensors: Sequence[Any], options: RecvOptions) -> Work:
        """Receive from ``options.src_rank`` into the tensor, in place."""
        buf = self._one(tensors, "tensor", writable=True)
        return self._run(
            "recv",
            options,
            lambda _: self._pg.recv([buf.tensor], options.src_rank, _P2P_TAG),
            buf.commit,
            Completion.DIRECT_WAIT,
        )

    def gather(
        self,
        tensor_lists: Sequence[Sequence[Any]],
        tensors: Sequence[Any],
        options: GatherOptions,
    ) -> Work:
        """Write rank i's tensor into element i of the root's list; gloo's native gather."""
        source = self._one(tensors, "tensor", writable=False)
        outputs = self._list(tensor_lists, "gather_list", writable=True)
        out = [[o.tensor for o in outputs]] if outputs else []
        root = options.root_rank
        return self._run(
            "gather",
            options,
            lambda t: self._pg.gather(
                out, [source.tensor], call_options("Gather", t, rootRank=root)
            ),
            lambda: commit_all(outputs),
        )

    def scatter(
        self,
        tensors: Sequence[Any],
        tensor_lists: Sequence[Sequence[Any]],
        options: ScatterOptions,
    ) -> Work:
        """Write element i of the root's list into rank i's tensor; gloo's native scatter."""
        output = self._one(tensors, "tensor", writable=True)
        inputs = self._list(tensor_lists, "scatter_list", writable=False)
        chunks = [[i.tensor for i in inputs]] if inputs else []
        root = options.root_rank
        return self._run(
            "scatter",
            options,
            lambda t: self._pg.scatter(
                [output.tensor], chunks, call_options("Scatter", t, rootRank=root)
            ),
            output.commit,
        )

    def alltoall(
        self, outputs: Sequence[Any], inputs: Sequence[Any], options: AllToAllOptions
    ) -> Work:
        """Exchange ``inputs[j]`` for ``outputs[j]`` with every rank j.

        Equal sizes use gloo's native alltoall on the buffers themselves; uneven
        sizes go through one flat buffer each way and gloo's native alltoallv.
        """
        outs = [CpuBuffer(t, f"output[{i}]", True) for i, t in enumerate(outputs)]
        ins = [CpuBuffer(t, f"input[{i}]", False) for i, t in enumerate(inputs)]
        out, sent = [o.tensor for o in outs], [i.tensor for i in ins]
        if len({t.numel() for t in out + sent}) == 1:
            return self._run(
                "alltoall",
                options,
                lambda t: self._pg.alltoall(out, sent, call_options("AllToAll", t)),
                lambda: commit_all(outs),
            )
        import torch

        flat_in = torch.cat([t.reshape(-1) for t in sent])
        flat_out = torch.empty(sum(t.numel() for t in out), dtype=flat_in.dtype)
        out_splits, in_splits = [t.numel() for t in out], [t.numel() for t in sent]

        def finish() -> None:
            for target, chunk in zip(out, flat_out.split(out_splits), strict=True):
                target.copy_(chunk.view(target.shape))
            commit_all(outs)

        return self._run(
            "alltoall",
            options,
            lambda t: self._pg.alltoall_base(
                flat_out, flat_in, out_splits, in_splits, call_options("AllToAll", t)
            ),
            finish,
        )

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
