"""SharedGpuGroup: a group whose ranks all share one GPU, moving bytes through device memory.

Each op describes the caller's buffers once (address, size, dtype), views them as
flat bytes on the device, and runs the transport's collective on the caller's current
stream (``running``). Nothing passes through the host but the step counters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from collective.frameworks import device_arrays
from collective.frameworks.bytelist import ByteList
from collective.frameworks.cuda_buffers import CudaBuffer
from collective.groups.shared_gpu.running import SharedGpuRunning
from collective.signature import dtype_code
from collective.types import (
    AllGatherOptions,
    AllReduceOptions,
    AllToAllOptions,
    ArgumentValueError,
    BarrierOptions,
    BroadcastOptions,
    CollectiveError,
    GatherOptions,
    RecvOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
    SendOptions,
)
from collective.work import Work


class SharedGpuGroup(SharedGpuRunning):
    """The ops of a group whose ranks all share one GPU; see ``running``."""

    def _list(self, tensor_lists: Sequence[Sequence[Any]], name: str) -> list[CudaBuffer]:
        """Return the descriptions of an op's single list of buffers."""
        if len(tensor_lists) != 1:
            raise ArgumentValueError(
                f"a group whose ranks share a GPU takes one {name} per rank, "
                f"got {len(tensor_lists)}"
            )
        return [self._describe(t, f"{name}[{i}]") for i, t in enumerate(tensor_lists[0])]

    def allreduce(self, tensors: Sequence[Any], options: AllReduceOptions) -> Work:
        """Reduce by ``options.reduce_op`` into every rank's tensor, in place."""
        buf = self._buffer(tensors, "tensor")
        self.check_reduce_op(options.reduce_op, buf.dtype)
        transport, collectives = self._collectives()
        reducer, data = transport.reducer(options.reduce_op, buf.dtype), self._view(buf)

        def body(deadline: float) -> None:
            collectives.allreduce(data, reducer, buf.dtype, deadline)

        return self._submit("allreduce", options, self._stream("allreduce", tensors), body, tensors)

    def barrier(self, options: BarrierOptions) -> Work:
        """Return once every rank has entered the barrier; each stream waits for the others'."""
        _, collectives = self._collectives()
        return self._submit("barrier", options, self._stream("barrier", ()), collectives.barrier)

    def reduce(self, tensors: Sequence[Any], options: ReduceOptions) -> Work:
        """Reduce onto the root's tensor; other ranks' tensors are left unchanged."""
        buf = self._buffer(tensors, "tensor")
        self.check_reduce_op(options.reduce_op, buf.dtype)
        transport, collectives = self._collectives()
        reducer, data, root = (
            transport.reducer(options.reduce_op, buf.dtype),
            self._view(buf),
            options.root_rank,
        )

        def body(deadline: float) -> None:
            collectives.reduce(data, root, reducer, buf.dtype, deadline)

        return self._submit("reduce", options, self._stream("reduce", tensors), body, tensors)

    def broadcast(self, tensors: Sequence[Any], options: BroadcastOptions) -> Work:
        """Copy the root's tensor into every other rank's tensor, in place."""
        buf = self._buffer(tensors, "tensor")
        _, collectives = self._collectives()
        data, root = self._view(buf), options.root_rank

        def body(deadline: float) -> None:
            collectives.broadcast(data, root, buf.dtype, deadline)

        return self._submit("broadcast", options, self._stream("broadcast", tensors), body, tensors)

    @property
    def takes_lists(self) -> bool:
        """Return True: a list of tensors moves as one message through the device slots."""
        return True

    def broadcast_list(self, tensors: Sequence[Any], options: BroadcastOptions) -> Work:
        """Copy the root's ``tensors`` into every other rank's, in order, as one message.

        Each byte is copied once into the root's slots and once out on each other rank,
        device to device, whatever the number of tensors.
        """
        transport, _ = self._collectives()
        root = options.root_rank
        stream = self._stream("broadcast", tensors)
        staged: list[tuple[Any, Callable[[], None]]]
        if isinstance(tensors, ByteList):
            message, staged, held = tensors, [], [tensors]
        else:
            message, staged, held = self._message(tensors, root)

        def body(deadline: float) -> None:
            transport.broadcast_list(message, root, deadline)
            for tensor, write_back in staged:  # on the op's stream, from a lane thread too
                with device_arrays.on_stream(tensor, stream):
                    write_back()
            held.clear()  # the buffers and staged copies lived until the copies were issued

        return self._submit("broadcast", options, stream, body, tensors)

    def _message(
        self, tensors: Sequence[Any], root: int
    ) -> tuple[ByteList, list[tuple[Any, Callable[[], None]]], list[Any]]:
        """Return ``tensors`` as one message, what writes back the staged ones, and the buffers.

        A tensor that is not contiguous (or a torch tensor with its negative bit set)
        moves through a contiguous copy of its own, written back on the ranks that
        receive, after the op.
        """
        buffers, bufs, staged, held = self._buffers, [], [], [tensors]
        for i, t in enumerate(tensors):
            name = f"tensors[{i}]"
            try:
                bufs.append(self._describe(t, name))
            except ArgumentValueError:
                copy, write_back = buffers.contiguous_copy(t)
                held.append(copy)
                bufs.append(self._describe(copy, name))
                if self.rank != root:
                    staged.append((t, write_back))
        message = ByteList.at([b.ptr for b in bufs], [b.nbytes for b in bufs])
        return message, staged, held

    def allgather(
        self,
        tensor_lists: Sequence[Sequence[Any]],
        tensors: Sequence[Any],
        options: AllGatherOptions,
    ) -> Work:
        """Write rank i's tensor into element i of every rank's list."""
        source = self._buffer(tensors, "tensor")
        outputs = self._list(tensor_lists, "tensor_list")
        _, collectives = self._collectives()
        piece, views = self._view(source), [self._view(b) for b in outputs]

        def body(deadline: float) -> None:
            collectives.allgather(piece, views, source.dtype, deadline)

        return self._submit(
            "allgather", options, self._stream("allgather", tensors), body, (tensor_lists, tensors)
        )

    def reducescatter(
        self,
        tensors: Sequence[Any],
        tensor_lists: Sequence[Sequence[Any]],
        options: ReduceScatterOptions,
    ) -> Work:
        """Reduce element i of every rank's list into rank i's tensor; inputs stay unchanged."""
        output = self._buffer(tensors, "tensor")
        self.check_reduce_op(options.reduce_op, output.dtype)
        inputs = self._list(tensor_lists, "tensor_list")
        transport, collectives = self._collectives()
        reducer = transport.reducer(options.reduce_op, output.dtype)
        out, views = self._view(output), [self._view(b) for b in inputs]

        def body(deadline: float) -> None:
            collectives.reducescatter(views, out, reducer, output.dtype, deadline)

        stream = self._stream("reducescatter", tensors)
        return self._submit("reducescatter", options, stream, body, (tensors, tensor_lists))

    def gather(
        self,
        tensor_lists: Sequence[Sequence[Any]],
        tensors: Sequence[Any],
        options: GatherOptions,
    ) -> Work:
        """Write rank i's tensor into element i of the root's list."""
        source = self._buffer(tensors, "tensor")
        outputs = self._list(tensor_lists, "gather_list")
        _, collectives = self._collectives()
        piece, views, root = self._view(source), [self._view(b) for b in outputs], options.root_rank

        def body(deadline: float) -> None:
            collectives.gather(piece, views, root, source.dtype, deadline)

        return self._submit(
            "gather", options, self._stream("gather", tensors), body, (tensor_lists, tensors)
        )

    def scatter(
        self,
        tensors: Sequence[Any],
        tensor_lists: Sequence[Sequence[Any]],
        options: ScatterOptions,
    ) -> Work:
        """Write element i of the root's list into rank i's tensor."""
        output = self._buffer(tensors, "tensor")
        inputs = self._list(tensor_lists, "scatter_list")
        _, collectives = self._collectives()
        out, views, root = self._view(output), [self._view(b) for b in inputs], options.root_rank

        def body(deadline: float) -> None:
            collectives.scatter(views, out, root, output.dtype, deadline)

        return self._submit(
            "scatter", options, self._stream("scatter", tensors), body, (tensors, tensor_lists)
        )

    def alltoall(
        self, outputs: Sequence[Any], inputs: Sequence[Any], options: AllToAllOptions
    ) -> Work:
        """Send ``inputs[j]`` to rank j; ``outputs[j]`` receives what rank j sends here."""
        describe = self._describe
        ins = [describe(t, f"inputs[{i}]") for i, t in enumerate(inputs)]
        outs = [describe(t, f"outputs[{i}]") for i, t in enumerate(outputs)]
        _, collectives = self._collectives()
        in_views, out_views = [self._view(b) for b in ins], [self._view(b) for b in outs]
        dtype = ins[0].dtype if ins else "uint8"

        def body(deadline: float) -> None:
            collectives.alltoall(in_views, out_views, dtype, deadline)

        return self._submit(
            "alltoall", options, self._stream("alltoall", inputs), body, (outputs, inputs)
        )

    def send(self, tensors: Sequence[Any], options: SendOptions) -> Work:
        """Send this rank's tensor to ``options.dst_rank``; see ``_point_to_point``."""
        buf = self._buffer(tensors, "tensor")
        stream = self._stream("send", tensors)
        return self._point_to_point("send", options, buf, options.dst_rank, stream, tensors)

    def recv(self, tensors: Sequence[Any], options: RecvOptions) -> Work:
        """Receive into this rank's tensor what ``options.src_rank`` sends, in place."""
        buf = self._buffer(tensors, "tensor")
        stream = self._stream("recv", tensors)
        return self._point_to_point("recv", options, buf, options.src_rank, stream, tensors)

    def _point_to_point(
        self, op: str, options: Any, buf: CudaBuffer, peer: int, stream: int, keep: Any
    ) -> Work:
        """Run ``op`` ("send" or "recv") with ``peer`` on the lane of that direction and peer.

        ``keep`` is the caller's tensor, held until the op is issued (see ``_submit``).
        """
        transport, _ = self._collectives()
        mail = transport.mail
        if mail is None:
            raise CollectiveError(f"group {self.group_name!r} has been destroyed")
        move: Callable[..., None] = mail.send if op == "send" else mail.recv
        data, code = self._view(buf), dtype_code(buf.dtype)

        def body(deadline: float) -> None:
            move(data, peer, code, deadline, stream)

        return self._submit(op, options, stream, body, keep, f"{op}-{peer}")
