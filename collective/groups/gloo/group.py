"""GlooGroup: the ops over one torch ``ProcessGroupGloo`` per group (see ``running``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import numpy as np

from collective.frameworks.cpu_buffers import CpuBuffer
from collective.frameworks.memory import overlaps
from collective.groups.gloo.agree import (
    HEADER_WIDTH,
    Call,
    Carried,
    Header,
    capacity,
    message_mismatch,
    on_buffer,
)
from collective.groups.gloo.reducescatter import (
    ChunkExchange,
    Scratch,
    byte_view,
    flat_bytes,
    joined_bytes,
    reduce_into,
)
from collective.groups.gloo.running import GlooRunning
from collective.groups.gloo.work import (
    Completion,
    Sequenced,
    byte_tensor,
    c10d_reduce_op,
    call_options,
    commit_all,
    int64_tensor,
    nothing,
)
from collective.types import (
    AllGatherOptions,
    AllReduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    RecvOptions,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
    SendOptions,
)
from collective.work import CompletedWork, Work

_P2P_TAG = 0


class GlooGroup(GlooRunning):
    """A group of CPU ranks connected by torch's ``ProcessGroupGloo``.

    Each op starts one gloo call on the caller's buffers, or on staged copies of
    them, and writes staged results back once it has succeeded.
    """

    def allreduce(self, tensors: Sequence[Any], options: AllReduceOptions) -> Work:
        """Reduce by ``options.reduce_op`` into every rank's tensor, in place."""
        buf = self._one(tensors, "tensor", writable=True)
        op = c10d_reduce_op(options.reduce_op, buf.dtype)
        return self._run(
            "allreduce",
            options,
            lambda t: self._pg.allreduce([buf.tensor], call_options("Allreduce", t, reduceOp=op)),
            buf.commit,
            call=on_buffer("allreduce", buf, reduce_op=options.reduce_op),
            carried=Carried(buf.bytes, lambda parts: _reduce(buf, parts, options.reduce_op)),
        )

    def barrier(self, options: BarrierOptions) -> Work:
        """Block until every rank has entered the barrier."""
        return self._run(
            "barrier",
            options,
            lambda t: self._pg.barrier(call_options("Barrier", t)),
            call=Call("barrier"),
            carried=Carried(None, lambda _: None),
        )

    def reduce(self, tensors: Sequence[Any], options: ReduceOptions) -> Work:
        """Reduce onto the root's tensor; other ranks' tensors are left unchanged.

        Gloo uses every rank's buffer as scratch, so non-root ranks reduce from a copy.
        """
        is_root = self.rank == options.root_rank
        buf = self._one(tensors, "tensor", writable=is_root)
        op, root = c10d_reduce_op(options.reduce_op, buf.dtype), options.root_rank

        def start(timeout: timedelta | None) -> Any:
            tensor = buf.tensor if is_root else buf.tensor.clone()
            reduce_options = call_options("Reduce", timeout, reduceOp=op, rootRank=root)
            return self._pg.reduce([tensor], reduce_options)

        def complete(parts: np.ndarray) -> None:
            if is_root:
                _reduce(buf, parts, options.reduce_op)

        return self._run(
            "reduce",
            options,
            start,
            buf.commit,
            call=on_buffer("reduce", buf, root, options.reduce_op),
            carried=Carried(buf.bytes, complete),
        )

    def broadcast(self, tensors: Sequence[Any], options: BroadcastOptions) -> Work:
        """Copy the root's tensor into every other rank's tensor, in place."""
        is_root = self.rank == options.root_rank
        buf = self._one(tensors, "tensor", writable=not is_root)
        root = options.root_rank

        def complete(parts: np.ndarray) -> None:
            if not is_root:
                _write(buf, parts[root])

        return self._run(
            "broadcast",
            options,
            lambda t: self._pg.broadcast([buf.tensor], call_options("Broadcast", t, rootRank=root)),
            buf.commit,
            call=on_buffer("broadcast", buf, root),
            carried=Carried(buf.bytes if is_root else None, complete),
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
            call=on_buffer("allgather", source, length=len(outputs)),
            carried=Carried(source.bytes, lambda parts: _write_all(outputs, parts)),
        )

    def reducescatter(
        self,
        tensors: Sequence[Any],
        tensor_lists: Sequence[Sequence[Any]],
        options: ReduceScatterOptions,
    ) -> Work:
        """Reduce element i of every rank's list into rank i's tensor; inputs stay unchanged.

        One gloo alltoall sends chunk j to rank j, then each rank reduces what it
        received, in rank order (see ``reducescatter``): this beats torch's
        gloo reduce_scatter and ``ray.util.collective``'s allreduce per chunk at
        every size measured. A list small enough rides in the agreement's records
        instead, and each rank reduces its chunk of every rank's list from them.
        """
        output = self._one(tensors, "tensor", writable=True)
        inputs = self._list(tensor_lists, "tensor_list", writable=False)
        if self._scratch is None:
            self._scratch = Scratch()
        scratch, laid_out = self._scratch, []

        def start(timeout: timedelta | None) -> Any:
            # Laid out once the ranks agree: a refused op borrows no scratch.
            exchange = ChunkExchange(output.tensor, [i.tensor for i in inputs], scratch)
            laid_out.append(exchange)
            opts = call_options("AllToAll", timeout)
            return self._pg.alltoall_base(exchange.received, exchange.sent, [], [], opts)

        def finish() -> None:
            laid_out[0].reduce(options.reduce_op)
            output.commit()

        call = on_buffer("reducescatter", output, reduce_op=options.reduce_op, length=len(inputs))
        return self._run(
            "reducescatter",
            options,
            start,
            finish,
            call=call,
            carried=self._chunks(output, inputs, options.reduce_op, call.nbytes()),
        )

    def _chunks(
        self, output: CpuBuffer, inputs: list[CpuBuffer], op: ReduceOp, nbytes: int
    ) -> Carried | None:
        """Return how a reducescatter whose every chunk fits in the records rides in them.

        Each rank carries its whole list; each takes its own chunk of every rank's.
        """
        size = nbytes * len(inputs)
        if size > capacity(self.world_size) or len(inputs) != self.world_size:
            return None
        if any(i.bytes.size != nbytes for i in inputs):
            return None
        lo, hi = self.rank * nbytes, (self.rank + 1) * nbytes

        def complete(parts: np.ndarray) -> None:
            _reduce(output, np.ascontiguousarray(parts[:, lo:hi]), op)

        return Carried(np.concatenate([i.bytes for i in inputs]), complete, size)

    def send(self, tensors: Sequence[Any], options: SendOptions) -> Work:
        """Send the tensor to ``options.dst_rank``; completes once it has been sent.

        The data goes out behind a header of its dtype and size (see ``agree``).
        """
        buf = self._one(tensors, "tensor", writable=False)
        dst, header = options.dst_rank, Header.of(buf)
        words = int64_tensor(header.words())

        def start(_: Any) -> Any:
            if not self._agreeing:
                return self._pg.send([buf.tensor], dst, _P2P_TAG)
            sent = self._pg.send([words], dst, _P2P_TAG)
            if not header.nbytes:
                return sent
            return Sequenced(sent, self._pg.send([buf.tensor], dst, _P2P_TAG))

        return self._run("send", options, start, completion=Completion.DIRECT_WAIT)

    def recv(self, tensors: Sequence[Any], options: RecvOptions) -> Work:
        """Receive from ``options.src_rank`` into the tensor, in place.

        Raises:
            ArgumentValueError: the sender sent another dtype or size; its message
                is dropped and the tensor left unchanged.

        """
        buf = self._one(tensors, "tensor", writable=True)
        if not self._agreeing:
            return self._recv_into(buf.tensor, options, buf.commit, wait=not options.async_op)
        lane = f"recv-{options.src_rank}"
        return self._on_lane(lane, "recv", options, lambda: self._receive(buf, options))

    def _receive(self, buf: CpuBuffer, options: RecvOptions) -> Work:
        """Receive a send's header, then its data: into ``buf`` if they match, else dropped."""
        words = int64_tensor([0] * HEADER_WIDTH)
        self._recv_into(words, options)
        sent = Header(*words.tolist())
        error = message_mismatch(self.group_name, sent, Header.of(buf), options.src_rank, self.rank)
        work: Work = CompletedWork()
        if error is not None:
            if sent.nbytes:
                self._recv_into(byte_tensor(sent.nbytes), options)
            raise error
        if sent.nbytes:
            work = self._recv_into(buf.tensor, options, buf.commit)
        else:
            buf.commit()
        return work

    def _recv_into(
        self,
        tensor: Any,
        options: RecvOptions,
        finish: Callable[[], None] = nothing,
        wait: bool = True,
    ) -> Work:
        """Receive one message from ``options.src_rank`` into ``tensor``; with ``wait``, wait."""
        src = options.src_rank
        work = self._start(
            "recv",
            options,
            lambda _: self._pg.recv([tensor], src, _P2P_TAG),
            finish,
            Completion.DIRECT_WAIT,
        )
        if wait:
            work.wait()
        return work

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
            call=on_buffer("gather", source, root),
            carried=Carried(source.bytes, lambda parts: _write_all(outputs, parts)),
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
            call=on_buffer("scatter", output, root),
        )

    def alltoall(
        self, outputs: Sequence[Any], inputs: Sequence[Any], options: AllToAllOptions
    ) -> Work:
        """Exchange ``inputs[j]`` for ``outputs[j]`` with every rank j, in one gloo alltoallv.

        The buffers go to gloo's ``alltoall_base`` as bytes: views of one flat buffer
        as they are, others through one flat copy each way. Torch's list alltoall
        on gloo took 4-5 times as long from 1 MiB on.
        """
        import torch

        outs = [CpuBuffer(t, f"output[{i}]", True) for i, t in enumerate(outputs)]
        ins = [CpuBuffer(t, f"input[{i}]", False) for i, t in enumerate(inputs)]
        out, sent = [o.tensor for o in outs], [i.tensor for i in ins]
        flat_in = flat_bytes(sent)
        if flat_in is None:
            flat_in = joined_bytes(sent)
        direct = flat_bytes(out)
        if direct is not None and overlaps(direct, flat_in):
            direct = None
        out_splits = [t.numel() * t.element_size() for t in out]
        in_splits = [t.numel() * t.element_size() for t in sent]
        flat_out = direct if direct is not None else torch.empty(sum(out_splits), dtype=torch.uint8)

        def finish() -> None:
            if direct is None:
                for target, chunk in zip(out, flat_out.split(out_splits), strict=True):
                    byte_view(target).copy_(chunk)
            commit_all(outs)

        return self._run(
            "alltoall",
            options,
            lambda t: self._pg.alltoall_base(
                flat_out, flat_in, out_splits, in_splits, call_options("AllToAll", t)
            ),
            finish,
            call=Call(
                "alltoall",
                ins[0].dtype if ins else None,
                length=len(ins),
                sends=tuple(t.numel() for t in sent),
                receives=tuple(t.numel() for t in out),
            ),
        )


def _reduce(buf: CpuBuffer, parts: np.ndarray, op: ReduceOp) -> None:
    """Reduce every rank's bytes (the rows of ``parts``) into ``buf`` by ``op``, in rank order."""
    import torch

    out = buf.tensor.view(-1)
    reduce_into(out, torch.from_numpy(parts).view(out.dtype).unbind(0), op)
    buf.commit()


def _write(buf: CpuBuffer, data: np.ndarray) -> None:
    """Write the bytes ``data`` into ``buf``."""
    buf.bytes[:] = data
    buf.commit()


def _write_all(buffers: list[CpuBuffer], parts: np.ndarray) -> None:
    """Write rank i's bytes (row i of ``parts``) into ``buffers[i]``; none without buffers."""
    for buf, data in zip(buffers, parts[: len(buffers)], strict=True):
        _write(buf, data)
