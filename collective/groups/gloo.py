"""GlooGroup: one torch ``ProcessGroupGloo`` per group, built directly from a store."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from collective.groups.base import BaseGroup
from collective.groups.gloo_work import (
    GlooWork,
    c10d,
    c10d_reduce_op,
    call_options,
    commit_all,
    connect_tcp_store,
    is_timeout,
)
from collective.groups.watch import FailureWatch
from collective.store import RendezvousStore, meet
from collective.tensor import DTYPES, CpuBuffer
from collective.types import (
    DEFAULT_TIMEOUT,
    AllGatherOptions,
    AllReduceOptions,
    AllToAllOptions,
    ArgumentValueError,
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
        self._ops = 0
        dist = c10d()
        try:
            self._tcp_store = connect_tcp_store(store, rank, host, timeout)
            meet(store, "gloo", rank, world_size, timeout)
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            prefix = "/".join(p for p in (group_name, store.incarnation) if p)
            prefixed = dist.PrefixStore(f"{prefix}/", self._tcp_store)
            self._pg = dist.ProcessGroupGloo(prefixed, rank, world_size, options)
            self._watch = FailureWatch(store, rank, world_size, group_name, lambda: self._ops)
        except TimeoutError as exc:
            self.destroy_group()
            raise CollectiveTimeoutError("init", group_name, rank, timeout, str(exc)) from exc
        except RuntimeError as exc:
            self.destroy_group()
            raise self._failure("init", timeout, exc) from exc

    @classmethod
    def backend(cls) -> Backend:
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
        """Mark the group unusable after ``exc`` in collective ``number`` and return the error."""
        self._error = self._failure(op, timeout, exc, number)
        if self._watch is not None:
            self._watch.report(str(self._error))
        return self._error

    def _abort(self, op: str, failure: str) -> CollectiveError:
        """Mark the group unusable because another rank reported ``failure``."""
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
        p2p: bool = False,
    ) -> Work:
        """Start one gloo op with ``start(timeout)``; wait for it unless it is async.

        Collectives carry a per-call timeout in gloo's options (None keeps the
        group's) and end by themselves; point-to-point ops take it in ``wait``.
        ``finish`` runs once the op has succeeded, to write staged outputs back.
        Any failure leaves the group unusable.
        """
        if self._error is None and self._watch is not None and self._watch.failure is not None:
            self._abort(op, self._watch.failure)
        self._check_usable(destroyed=self._pg is None)
        timeout = options.timeout or self.timeout
        number = 0
        if not p2p:
            self._ops += 1
            number = self._ops
        try:
            torch_work = start(options.timeout)
        except RuntimeError as exc:
            raise self._fail(op, timeout, exc, number) from exc
        work = GlooWork(
            lambda t, exc: self._fail(op, t, exc, number),
            lambda w, t: self._wait(op, w, t),
            torch_work,
            timeout,
            finish,
            p2p,
        )
        if not options.async_op:
            work.wait()
        return work

    @staticmethod
    def _one(tensors: Sequence[Any], name: str, writable: bool) -> CpuBuffer:
        if len(tensors) != 1:
            raise ArgumentValueError(
                f"the gloo backend takes one {name} per rank, got {len(tensors)}"
            )
        return CpuBuffer(tensors[0], name, writable)

    @staticmethod
    def _list(tensor_lists: Sequence[Sequence[Any]], name: str, writable: bool) -> list[CpuBuffer]:
        if len(tensor_lists) != 1:
            raise ArgumentValueError(
                f"the gloo backend takes one {name} per rank, got {len(tensor_lists)}"
            )
        return [CpuBuffer(t, f"{name}[{i}]", writable) for i, t in enumerate(tensor_lists[0])]

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

        This is gloo's native reduce_scatter, not one allreduce per chunk.
        """
        output = self._one(tensors, "tensor", writable=True)
        inputs = self._list(tensor_lists, "tensor_list", writable=False)
        op, chunks = c10d_reduce_op(options.reduce_op), [[i.tensor for i in inputs]]
        return self._run(
            "reducescatter",
            options,
            lambda t: self._pg.reduce_scatter(
                [output.tensor], chunks, call_options("ReduceScatter", t, reduceOp=op)
            ),
            output.commit,
        )

    def send(self, tensors: Sequence[Any], options: SendOptions) -> Work:
        """Send the tensor to ``options.dst_rank``; completes once it has been sent."""
        buf = self._one(tensors, "tensor", writable=False)
        return self._run(
            "send",
            options,
            lambda _: self._pg.send([buf.tensor], options.dst_rank, _P2P_TAG),
            p2p=True,
        )

    def recv(self, tensors: Sequence[Any], options: RecvOptions) -> Work:
        """Receive from ``options.src_rank`` into the tensor, in place."""
        buf = self._one(tensors, "tensor", writable=True)
        return self._run(
            "recv",
            options,
            lambda _: self._pg.recv([buf.tensor], options.src_rank, _P2P_TAG),
            buf.commit,
            p2p=True,
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

    def destroy_group(self) -> None:
        """Drop the process group and the TCPStore; their threads and sockets close.

        Returns at once, even with ops given up on after a failure still in gloo.
        """
        pg, self._pg, self._tcp_store = self._pg, None, None
        if self._watch is not None:
            self._watch.stop()
            self._watch.release(pg)
