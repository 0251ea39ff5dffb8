"""NCCLGroup: GPU ranks connected by cupy's NCCL communicators.

allreduce, reduce and broadcast are one NCCL call per device. allgather and
reducescatter are grouped broadcasts and reduces straight into the caller's
buffers, so no staging buffer is allocated. gather, scatter, alltoall, send and
recv come from ``p2p``; communicators, streams and launching from
``base``. Each op builds its plan, the NCCL calls it makes with their
arguments, which the launcher then issues as one NCCL group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from collective import tensor
from collective.groups.nccl.base import Communicators
from collective.groups.nccl.comm import NCCL_REDUCE_OPS, buffers_on, consecutive, per_device
from collective.groups.nccl.launch import Plan, Step
from collective.groups.nccl.p2p import NcclPointToPoint
from collective.types import (
    AllGatherOptions,
    AllReduceOptions,
    ArgumentValueError,
    BarrierOptions,
    BroadcastOptions,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
)
from collective.work import Work

REDUCE_OP_NAMES: dict[str, int] = {
    alias: op._value_ for op in ReduceOp for alias in (op.name, op.name.lower())
}
"""The value of each ``ReduceOp`` by its names, as the public ops take them; for cached calls.

Launch keys hold a reduction's value, not the member: hashing an enum member runs
Python code (``Enum.__hash__``), hashing an int does not."""


def _op_value(op: Any) -> int:
    """Return the value of ``op``, a ``ReduceOp`` or one of its names (KeyError otherwise)."""
    return op._value_ if type(op) is ReduceOp else REDUCE_OP_NAMES[op]


class NCCLGroup(NcclPointToPoint):
    """A group of GPU ranks connected by NCCL through ``cupy.cuda.nccl``."""

    def allreduce(self, tensors: Sequence[Any], options: AllReduceOptions) -> Work:
        """Reduce by ``options.reduce_op`` into every rank's tensors, in place."""

        def builder() -> tuple[Sequence[Any], Communicators, Plan]:
            bufs = per_device(tensors, "tensor_list")
            self.check_reduce_op(options.reduce_op, bufs[0].dtype)
            op = NCCL_REDUCE_OPS[options.reduce_op]

            def plan(i: int, comm: Any, stream: int) -> list[Step]:
                b = bufs[i]
                return [(comm.allReduce, (b.ptr, b.ptr, b.count, b.nccl_dtype, op, stream))]

            return tensors, self._comms_of(bufs), plan

        extra = (options.reduce_op._value_,)
        signed = (-1, options.reduce_op)
        return self._op("allreduce", options, tensors, tensors, extra, builder, signed)

    def allreduce_now(self, x: Any, op: Any) -> bool:
        """Run a blocking allreduce whose launch is cached; False, doing nothing, on a miss."""
        try:  # the hottest call: the op's value is read inline
            extra = (op._value_ if type(op) is ReduceOp else REDUCE_OP_NAMES[op],)
        except (KeyError, TypeError):
            return False
        return self._cached("allreduce", extra, x)

    def reduce_now(self, x: Any, op: Any, root: Any) -> bool:
        """Run a blocking reduce whose launch is cached; False, doing nothing, on a miss."""
        try:
            extra = (_op_value(op), root, 0) if type(root) is int else None
        except (KeyError, TypeError):
            return False
        return self._cached("reduce", extra, x)

    def broadcast_now(self, x: Any, root: Any) -> bool:
        """Run a blocking broadcast whose launch is cached; False, doing nothing, on a miss."""
        return self._cached("broadcast", (root, 0) if type(root) is int else None, x)

    def _cached(self, op: str, extra: Any, x: Any) -> bool:
        """Run the cached blocking launch of ``op`` on ``x`` with ``extra``; False on a miss.

        The key is the one ``_op`` files the launch under, for one buffer on the
        caller's current stream; a buffer it cannot describe is a miss too.
        """
        try:
            key = (op, False, extra, (tensor.buffer_key(x),), (tensor.current_stream(x),))
            launch = self._launches.get(key)
        except (KeyError, TypeError, AttributeError):
            return False
        if launch is None:
            return False
        self._run(launch, self._timeout)
        return True

    def barrier(self, options: BarrierOptions) -> Work:
        """Block until every rank has entered the barrier: a one-element allreduce."""
        cupy = self._cupy
        devices = self._default_devices or (cupy.cuda.Device().id,)
        flags = []
        for device in devices:
            with cupy.cuda.Device(device):
                flags.append(cupy.zeros(1, dtype=cupy.int32))
        reduce_options = AllReduceOptions(timeout=options.timeout, async_op=True)
        work = self.allreduce(flags, reduce_options)
        if not options.async_op:
            work.wait(options.timeout)
        return work

    def reduce(self, tensors: Sequence[Any], options: ReduceOptions) -> Work:
        """Reduce onto the root's tensor; other ranks' tensors are left unchanged."""

        def builder() -> tuple[Sequence[Any], Communicators, Plan]:
            bufs = per_device(tensors, "tensor_list")
            self.check_reduce_op(options.reduce_op, bufs[0].dtype)
            op = NCCL_REDUCE_OPS[options.reduce_op]
            root = options.root_rank * len(bufs) + options.root_tensor

            def plan(i: int, comm: Any, stream: int) -> list[Step]:
                b = bufs[i]
                return [(comm.reduce, (b.ptr, b.ptr, b.count, b.nccl_dtype, op, root, stream))]

            return tensors, self._comms_of(bufs), plan

        extra = (options.reduce_op._value_, options.root_rank, options.root_tensor)
        signed = (options.root_rank, options.reduce_op)
        return self._op("reduce", options, tensors, tensors, extra, builder, signed)

    def broadcast(self, tensors: Sequence[Any], options: BroadcastOptions) -> Work:
        """Copy the root's tensor into every other rank's tensors, in place."""

        def builder() -> tuple[Sequence[Any], Communicators, Plan]:
            bufs = per_device(tensors, "tensor_list")
            root = options.root_rank * len(bufs) + options.root_tensor

            def plan(i: int, comm: Any, stream: int) -> list[Step]:
                b = bufs[i]
                return [(comm.broadcast, (b.ptr, b.ptr, b.count, b.nccl_dtype, root, stream))]

            return tensors, self._comms_of(bufs), plan

        extra = (options.root_rank, options.root_tensor)
        signed = (options.root_rank, None)
        return self._op("broadcast", options, tensors, tensors, extra, builder, signed)

    def allgather(
        self,
        tensor_lists: Sequence[Sequence[Any]],
        tensors: Sequence[Any],
        options: AllGatherOptions,
    ) -> Work:
        """Write NCCL rank j's tensor into element j of every list.

        A list of consecutive views of one buffer, in rank order, is filled by one NCCL
        allgather, with no copy; any other list by grouped broadcasts straight into
        its tensors.
        """

        def builder() -> tuple[Sequence[Any], Communicators, Plan]:
            ins = per_device(tensors, "input_tensor_list")
            n = len(ins)
            if len(tensor_lists) != n:
                raise ArgumentValueError(f"output_tensor_lists must hold {n} lists (one per GPU)")
            nranks = self.world_size * n
            outs = [
                buffers_on(tensor_lists[i], f"output_tensor_lists[{i}]", ins[i], nranks)
                for i in range(n)
            ]

            def plan(i: int, comm: Any, stream: int) -> list[Step]:
                me, b = self.rank * n + i, ins[i]
                if consecutive(outs[i]):
                    return [
                        (comm.allGather, (b.ptr, outs[i][0].ptr, b.count, b.nccl_dtype, stream))
                    ]
                return [
                    (
                        comm.broadcast,
                        (b.ptr if j == me else out.ptr, out.ptr, b.count, b.nccl_dtype, j, stream),
                    )
                    for j, out in enumerate(outs[i])
                ]

            return tensors, self._comms_of(ins), plan

        flat = [x for xs in tensor_lists for x in xs]
        shape = tuple(len(xs) for xs in tensor_lists)
        buffers = [*tensors, *flat]
        return self._op("allgather", options, buffers, tensors, shape, builder, (-1, None))

    def reducescatter(
        self,
        tensors: Sequence[Any],
        tensor_lists: Sequence[Sequence[Any]],
        options: ReduceScatterOptions,
    ) -> Work:
        """Reduce element j of every list into NCCL rank j's tensor.

        A list of consecutive views of one buffer, in rank order, is reduced by one
        NCCL reduce-scatter, with no copy; any other list by grouped reduces. The input
        lists are only read.
        """

        def builder() -> tuple[Sequence[Any], Communicators, Plan]:
            outs = per_device(tensors, "output_tensor_list")
            n = len(outs)
            if len(tensor_lists) != n:
                raise ArgumentValueError(f"input_tensor_lists must hold {n} lists (one per GPU)")
            self.check_reduce_op(options.reduce_op, outs[0].dtype)
            op, nranks = NCCL_REDUCE_OPS[options.reduce_op], self.world_size * n
            ins = [
                buffers_on(tensor_lists[i], f"input_tensor_lists[{i}]", outs[i], nranks)
                for i in range(n)
            ]

            def plan(i: int, comm: Any, stream: int) -> list[Step]:
                out = outs[i]
                if consecutive(ins[i]):
                    first = ins[i][0].ptr
                    return [
                        (
                            comm.reduceScatter,
                            (first, out.ptr, out.count, out.nccl_dtype, op, stream),
                        )
                    ]
                return [
                    (comm.reduce, (source.ptr, out.ptr, out.count, out.nccl_dtype, op, j, stream))
                    for j, source in enumerate(ins[i])
                ]

            return tensors, self._comms_of(outs), plan

        flat = [x for xs in tensor_lists for x in xs]
        extra = (options.reduce_op._value_, *(len(xs) for xs in tensor_lists))
        signed = (-1, options.reduce_op)
        buffers = [*tensors, *flat]
        return self._op("reducescatter", options, buffers, tensors, extra, builder, signed)
