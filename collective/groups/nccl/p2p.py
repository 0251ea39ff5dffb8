"""Point-to-point ops of ``NCCLGroup``: send/recv, gather, scatter and alltoall.

send and recv use pair communicators; gather, scatter and alltoall are grouped
send/recv on the group's collective communicator.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from collective.frameworks import cuda_buffers
from collective.frameworks.cuda_buffers import CudaBuffer
from collective.groups.nccl.comm import buffers_on, per_device
from collective.groups.nccl.launch import DeviceCalls, NcclCall
from collective.groups.nccl.lifecycle import Communicators
from collective.groups.nccl.running import NcclRunning, OpParts
from collective.types import (
    AllToAllOptions,
    ArgumentValueError,
    GatherOptions,
    RecvOptions,
    ScatterOptions,
    SendOptions,
)
from collective.work import Work

_DEVICE_TO_DEVICE = 3
"""``cudaMemcpyDeviceToDevice``."""


class NcclPointToPoint(NcclRunning):
    """The send/recv-based ops of ``NCCLGroup``, on the communicators and launcher of its base."""

    def _p2p(self, op: str, tensors: Sequence[Any], options: Any, peer: int, gpu: int) -> Work:
        """Send or receive on the communicator of this endpoint and the peer's."""
        self._check_usable(self._destroyed)
        return self._op(op, options, *self._p2p_parts(op, tensors, options, peer, gpu))

    def _p2p_parts(
        self, op: str, tensors: Sequence[Any], options: Any, peer: int, gpu: int
    ) -> OpParts:
        """Describe a send or recv; the lower endpoint ``(rank, gpu index)`` is NCCL rank 0."""

        def builder() -> tuple[Sequence[Any], Communicators, DeviceCalls]:
            if len(tensors) != 1:
                raise ArgumentValueError(f"{op} takes one tensor, got {len(tensors)}")
            b = cuda_buffers.cuda_buffer(tensors[0], "tensor")
            count = options.n_elements or b.count
            if count > b.count:
                raise ArgumentValueError(f"n_elements must be at most {b.count}, got {count}")
            me, other = (self.rank, b.device), (peer, gpu)
            low, high = sorted([me, other])
            mine = 0 if me == low else 1
            store_key = f"p2p/{low[0]}.{low[1]}-{high[0]}.{high[1]}"

            def communicators(timeout: timedelta) -> list[Any]:
                key = ("p2p", low, high)
                members = (low[0], high[0])
                return self._communicators(key, store_key, [b.device], 2, [mine], timeout, members)

            def device_calls(_: int, comm: Any, stream: int) -> list[NcclCall]:
                return [(getattr(comm, op), (b.ptr, count, b.nccl_dtype, 1 - mine, stream))]

            return tensors, communicators, device_calls

        return tensors, (peer, gpu, options.n_elements), builder, None

    def _send_parts(self, tensors: Sequence[Any], options: SendOptions) -> OpParts:
        return self._p2p_parts("send", tensors, options, options.dst_rank, options.dst_gpu_index)

    def _recv_parts(self, tensors: Sequence[Any], options: RecvOptions) -> OpParts:
        return self._p2p_parts("recv", tensors, options, options.src_rank, options.src_gpu_index)

    def send(self, tensors: Sequence[Any], options: SendOptions) -> Work:
        """Send the tensor (or its first ``n_elements``) to GPU ``dst_gpu_index`` of the peer."""
        return self._p2p("send", tensors, options, options.dst_rank, options.dst_gpu_index)

    def recv(self, tensors: Sequence[Any], options: RecvOptions) -> Work:
        """Receive into the tensor, in place, from GPU ``src_gpu_index`` of the peer."""
        return self._p2p("recv", tensors, options, options.src_rank, options.src_gpu_index)

    def _copy(self, dst: CudaBuffer, src: CudaBuffer, stream: int) -> NcclCall:
        """Return the call that copies ``src`` into ``dst`` on ``stream``."""
        memcpy = self._cuda.runtime.memcpyAsync
        return (memcpy, (dst.ptr, src.ptr, src.nbytes, _DEVICE_TO_DEVICE, stream))

    def gather(
        self,
        tensor_lists: Sequence[Sequence[Any]],
        tensors: Sequence[Any],
        options: GatherOptions,
    ) -> Work:
        """Write rank j's tensor into element j of the root's list; grouped send/recv."""
        return self._op("gather", options, *self._gather_parts(tensor_lists, tensors, options))

    def _gather_parts(
        self,
        tensor_lists: Sequence[Sequence[Any]],
        tensors: Sequence[Any],
        options: GatherOptions,
    ) -> OpParts:
        root, on_root = options.root_rank, self.rank == options.root_rank

        def builder() -> tuple[Sequence[Any], Communicators, DeviceCalls]:
            source = per_device(tensors, "tensor")[0]
            length = self.world_size if on_root else 0
            first = tensor_lists[0] if tensor_lists else []
            outs = buffers_on(first, "gather_list", source, length)

            def device_calls(_: int, comm: Any, stream: int) -> list[NcclCall]:
                if not on_root:
                    return [
                        (comm.send, (source.ptr, source.count, source.nccl_dtype, root, stream))
                    ]
                return [
                    self._copy(out, source, stream)
                    if j == root
                    else (comm.recv, (out.ptr, out.count, out.nccl_dtype, j, stream))
                    for j, out in enumerate(outs)
                ]

            return tensors, self._comms_of([source]), device_calls

        flat = [x for xs in tensor_lists for x in xs]
        extra = (root, len(tensor_lists), len(flat))
        buffers = [*tensors, *flat]
        return buffers, extra, builder, (root, None)

    def scatter(
        self,
        tensors: Sequence[Any],
        tensor_lists: Sequence[Sequence[Any]],
        options: ScatterOptions,
    ) -> Work:
        """Write element j of the root's list into rank j's tensor; grouped send/recv."""
        return self._op("scatter", options, *self._scatter_parts(tensors, tensor_lists, options))

    def _scatter_parts(
        self,
        tensors: Sequence[Any],
        tensor_lists: Sequence[Sequence[Any]],
        options: ScatterOptions,
    ) -> OpParts:
        root, on_root = options.root_rank, self.rank == options.root_rank

        def builder() -> tuple[Sequence[Any], Communicators, DeviceCalls]:
            out = per_device(tensors, "tensor")[0]
            length = self.world_size if on_root else 0
            ins = buffers_on(tensor_lists[0] if tensor_lists else [], "scatter_list", out, length)

            def device_calls(_: int, comm: Any, stream: int) -> list[NcclCall]:
                if not on_root:
                    return [(comm.recv, (out.ptr, out.count, out.nccl_dtype, root, stream))]
                return [
                    self._copy(out, source, stream)
                    if j == root
                    else (comm.send, (source.ptr, source.count, source.nccl_dtype, j, stream))
                    for j, source in enumerate(ins)
                ]

            return tensors, self._comms_of([out]), device_calls

        flat = [x for xs in tensor_lists for x in xs]
        extra = (root, len(tensor_lists), len(flat))
        buffers = [*tensors, *flat]
        return buffers, extra, builder, (root, None)

    def alltoall(
        self, outputs: Sequence[Any], inputs: Sequence[Any], options: AllToAllOptions
    ) -> Work:
        """Exchange ``inputs[j]`` for ``outputs[j]`` with every rank j; grouped send/recv."""
        return self._op("alltoall", options, *self._alltoall_parts(outputs, inputs, options))

    def _alltoall_parts(
        self, outputs: Sequence[Any], inputs: Sequence[Any], options: AllToAllOptions
    ) -> OpParts:

        def builder() -> tuple[Sequence[Any], Communicators, DeviceCalls]:
            if len(outputs) != self.world_size or len(inputs) != self.world_size:
                raise ArgumentValueError(
                    f"alltoall takes {self.world_size} outputs and inputs, "
                    f"got {len(outputs)} and {len(inputs)}"
                )
            outs = [
                cuda_buffers.cuda_buffer(t, f"output_tensor_list[{j}]")
                for j, t in enumerate(outputs)
            ]
            ins = [
                cuda_buffers.cuda_buffer(t, f"input_tensor_list[{j}]") for j, t in enumerate(inputs)
            ]
            if len({b.device for b in outs + ins}) != 1 or len({b.dtype for b in outs + ins}) != 1:
                raise ArgumentValueError(
                    "alltoall's tensors must all be on one GPU and of one dtype"
                )
            me = self.rank
            if outs[me].count != ins[me].count:
                raise ArgumentValueError(
                    f"output_tensor_list[{me}] and input_tensor_list[{me}] (this rank's own "
                    f"share) must hold as many elements, got {outs[me].count} and {ins[me].count}"
                )

            def device_calls(_: int, comm: Any, stream: int) -> list[NcclCall]:
                calls = []
                for j, (out, source) in enumerate(zip(outs, ins, strict=True)):
                    if j == me:
                        calls.append(self._copy(out, source, stream))
                        continue
                    calls.append(
                        (comm.send, (source.ptr, source.count, source.nccl_dtype, j, stream))
                    )
                    calls.append((comm.recv, (out.ptr, out.count, out.nccl_dtype, j, stream)))
                return calls

            return [outputs[0]], self._comms_of([outs[0]]), device_calls

        extra = (len(outputs), len(inputs))
        buffers = [*outputs, *inputs]
        return buffers, extra, builder, None
