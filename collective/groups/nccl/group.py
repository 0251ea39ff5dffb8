"""NCCLGroup: GPU ranks connected by cupy's NCCL communicators.

allreduce, reduce and broadcast are one NCCL call per device. allgather and
reducescatter are grouped broadcasts and reduces straight into the caller's
buffers, so no staging buffer is allocated. gather, scatter, alltoall, send and
recv come from ``p2p``; communicators and streams from
``lifecycle``, launching from ``running``. Each op builds its device calls, the NCCL
calls it makes with their arguments, which the launch then issues as one NCCL group.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from collective.groups.nccl.comm import NCCL_REDUCE_OPS, buffers_on, consecutive, per_device
from collective.groups.nccl.launch import DeviceCalls, NcclCall
from collective.groups.nccl.lifecycle import Communicators
from collective.groups.nccl.p2p import NcclPointToPoint
from collective.groups.nccl.running import OpParts
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


class NCCLGroup(NcclPointToPoint):
    """A group of GPU ranks connected by NCCL through ``cupy.cuda.nccl``."""

    def _allreduce_parts(self, tensors: Sequence[Any], options: AllReduceOptions) -> OpParts:
        def builder() -> tuple[Sequence[Any], Communicators, DeviceCalls]:
            bufs = per_device(tensors, "tensor_list")
            self.check_reduce_op(options.reduce_op, bufs[0].dtype)
            op = NCCL_REDUCE_OPS[options.reduce_op]

            def device_calls(i: int, comm: Any, stream: int) -> list[NcclCall]:
                b = bufs[i]
                return [(comm.allReduce, (b.ptr, b.ptr, b.count, b.nccl_dtype, op, stream))]

            return tensors, self._comms_of(bufs), device_calls

        return tensors, (options.reduce_op._value_,), builder, (-1, options.reduce_op)

    def allreduce(self, tensors: Sequence[Any], options: AllReduceOptions) -> Work:
        """Reduce by ``options.reduce_op`` into every rank's tensors, in place."""
        return self._op("allreduce", options, *self._allreduce_parts(tensors, options))

    def agree(
        self, op: str, x: Any, root: int, reduce_op: ReduceOp | None, timeout: timedelta
    ) -> None:
        """Compare the signature of ``op`` on ``x`` among the ranks, on the caller's stream.

        Nothing is written: the ranks allreduce the signature words of ``op`` (its
        dtype, the element count and shape of ``x``, ``root`` and ``reduce_op``) as
        each op's own check does (see ``mismatch``), even in a group that skips those
        (``skip_agreement``). A group over several GPUs whose stages run on this one
        compares the whole op here, once, instead of each stage's. A mismatch fails
        the group on every rank at the latest at its next op, ``wait`` or watchdog
        poll; nothing happens in a group of one rank, or during CUDA-graph capture.

        Raises:
            ArgumentTypeError: ``x`` is not a GPU buffer NCCL moves.

        """
        options = AllReduceOptions(timeout=timeout)
        buffers = (x,)

        def builder() -> tuple[Sequence[Any], Communicators, DeviceCalls]:
            return buffers, self._comms_of(per_device(buffers, "tensor")), lambda *_: []

        extra = (op, root, None if reduce_op is None else reduce_op._value_)
        self._op("agree", options, buffers, extra, builder, (root, reduce_op), op)

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

    def _reduce_parts(self, tensors: Sequence[Any], options: ReduceOptions) -> OpParts:
        def builder() -> tuple[Sequence[Any], Communicators, DeviceCalls]:
            bufs = per_device(tensors, "tensor_list")
            self.check_reduce_op(options.reduce_op, bufs[0].dtype)
            op = NCCL_REDUCE_OPS[options.reduce_op]
            root = options.root_rank * len(bufs) + options.root_tensor

            def device_calls(i: int, comm: Any, stream: int) -> list[NcclCall]:
                b = bufs[i]
                return [(comm.reduce, (b.ptr, b.ptr, b.count, b.nccl_dtype, op, root, stream))]

            return tensors, self._comms_of(bufs), device_calls

        extra = (options.reduce_op._value_, options.root_rank, options.root_tensor)
        return tensors, extra, builder, (options.root_rank, options.reduce_op)

    def reduce(self, tensors: Sequence[Any], options: ReduceOptions) -> Work:
        """Reduce onto the root's tensor; other ranks' tensors are left unchanged."""
        return self._op("reduce", options, *self._reduce_parts(tensors, options))

    def _broadcast_parts(self, tensors: Sequence[Any], options: BroadcastOptions) -> OpParts:
        def builder() -> tuple[Sequence[Any], Communicators, DeviceCalls]:
            bufs = per_device(tensors, "tensor_list")
            root = options.root_rank * len(bufs) + options.root_tensor

            def device_calls(i: int, comm: Any, stream: int) -> list[NcclCall]:
                b = bufs[i]
                return [(comm.broadcast, (b.ptr, b.ptr, b.count, b.nccl_dtype, root, stream))]

            return tensors, self._comms_of(bufs), device_calls

        extra = (options.root_rank, options.root_tensor)
        return tensors, extra, builder, (options.root_rank, None)

    def broadcast(self, tensors: Sequence[Any], options: BroadcastOptions) -> Work:
        """Copy the root's tensor into every other rank's tensors, in place."""
        return self._op("broadcast", options, *self._broadcast_parts(tensors, options))

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
        return self._op(
            "allgather", options, *self._allgather_parts(tensor_lists, tensors, options)
        )

    def _allgather_parts(
        self,
        tensor_lists: Sequence[Sequence[Any]],
        tensors: Sequence[Any],
        options: AllGatherOptions,
    ) -> OpParts:

        def builder() -> tuple[Sequence[Any], Communicators, DeviceCalls]:
            ins = per_device(tensors, "input_tensor_list")
            n = len(ins)
            if len(tensor_lists) != n:
                raise ArgumentValueError(f"output_tensor_lists must hold {n} lists (one per GPU)")
            nranks = self.world_size * n
            outs = [
                buffers_on(tensor_lists[i], f"output_tensor_lists[{i}]", ins[i], nranks)
                for i in range(n)
            ]

            def device_calls(i: int, comm: Any, stream: int) -> list[NcclCall]:
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

            return tensors, self._comms_of(ins), device_calls

        flat = [x for xs in tensor_lists for x in xs]
        shape = tuple(len(xs) for xs in tensor_lists)
        buffers = [*tensors, *flat]
        return buffers, shape, builder, (-1, None)

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
        parts = self._reducescatter_parts(tensors, tensor_lists, options)
        return self._op("reducescatter", options, *parts)

    def _reducescatter_parts(
        self,
        tensors: Sequence[Any],
        tensor_lists: Sequence[Sequence[Any]],
        options: ReduceScatterOptions,
    ) -> OpParts:

        def builder() -> tuple[Sequence[Any], Communicators, DeviceCalls]:
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

            def device_calls(i: int, comm: Any, stream: int) -> list[NcclCall]:
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

            return tensors, self._comms_of(outs), device_calls

        flat = [x for xs in tensor_lists for x in xs]
        extra = (options.reduce_op._value_, *(len(xs) for xs in tensor_lists))
        signed = (-1, options.reduce_op)
        buffers = [*tensors, *flat]
        return buffers, extra, builder, signed
