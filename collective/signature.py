"""CheckedGroup: before every op, the ranks compare what they are about to do.

A group built with ``check_args=True`` is wrapped in a ``CheckedGroup``. Before
each collective, every rank contributes a fixed-size int64 signature (the op,
dtype, shape, root, reduce op, list length and, for alltoall, the element count
per peer) to an allgather on the group itself. If the signatures disagree, every
rank raises the same ``ValueError``, naming the ranks and how they differ, and
no data moves. Send and recv swap signatures with their peer only. The check
costs one small allgather (or one swap) per op.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from collective.groups.base import BaseGroup
from collective.tensor import DTYPES, TensorSpec, int64_array, spec
from collective.types import (
    AllGatherOptions,
    AllReduceOptions,
    AllToAllOptions,
    Backend,
    BarrierOptions,
    BroadcastOptions,
    CollectiveError,
    GatherOptions,
    RecvOptions,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
    SendOptions,
)
from collective.work import Work

_OPS = (
    "allreduce",
    "barrier",
    "reduce",
    "broadcast",
    "allgather",
    "reducescatter",
    "send",
    "recv",
    "gather",
    "scatter",
    "alltoall",
)
_DTYPES = sorted(DTYPES)
_MAX_DIMS = 8
_NONE = -1
# Slots of the fixed part: op, dtype, shape crc, ndim, dims..., root, reduce op, list length.
_OP, _DTYPE, _CRC, _NDIM = 0, 1, 2, 3
_DIMS = 4
_ROOT, _REDUCE, _COUNT = _DIMS + _MAX_DIMS, _DIMS + _MAX_DIMS + 1, _DIMS + _MAX_DIMS + 2
_FIXED = _COUNT + 1


def _encode_tensor(slots: list[int], x: Any) -> None:
    described = spec(x, "tensor")
    slots[_DTYPE] = _DTYPES.index(described.dtype)
    slots[_NDIM] = len(described.shape)
    slots[_CRC] = zlib.crc32(repr(described.shape).encode())
    for i, dim in enumerate(described.shape[:_MAX_DIMS]):
        slots[_DIMS + i] = dim


def _numel(x: Any) -> int:
    count = 1
    for dim in spec(x, "tensor").shape:
        count *= dim
    return count


def _shape(slots: Sequence[int]) -> str:
    ndim = slots[_NDIM]
    dims = [str(d) for d in slots[_DIMS : _DIMS + min(ndim, _MAX_DIMS)]]
    if ndim > _MAX_DIMS:
        dims.append(f"... ({ndim} dims, crc {slots[_CRC]})")
    return "(" + ", ".join(dims) + ("," if ndim == 1 else "") + ")"


_FIELDS = {
    "op": lambda s: _OPS[s[_OP]],
    "dtype": lambda s: _DTYPES[s[_DTYPE]] if s[_DTYPE] != _NONE else "none",
    "shape": lambda s: _shape(s) if s[_NDIM] != _NONE else "none",
    "root": lambda s: str(s[_ROOT]) if s[_ROOT] != _NONE else "none",
    "reduce op": lambda s: ReduceOp(s[_REDUCE]).name if s[_REDUCE] != _NONE else "none",
    "list length": lambda s: str(s[_COUNT]) if s[_COUNT] != _NONE else "none",
}


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def describe_mismatch(signatures: Sequence[Sequence[int]], world_size: int) -> list[str]:
    """Return one line per way the ranks' signatures differ; empty when they agree."""
    lines = []
    for field, show in _FIELDS.items():
        by_value: dict[str, list[int]] = {}
        for rank, slots in enumerate(signatures):
            by_value.setdefault(show(slots[:_FIXED]), []).append(rank)
        if len(by_value) > 1:
            parts = ", ".join(f"{v} on {_ranks(r)}" for v, r in by_value.items())
            lines.append(f"{field}: {parts}")
    if lines or signatures[0][_OP] != _OPS.index("alltoall"):
        return lines
    sends = [s[_FIXED : _FIXED + world_size] for s in signatures]
    recvs = [s[_FIXED + world_size : _FIXED + 2 * world_size] for s in signatures]
    for i in range(world_size):
        for j in range(world_size):
            if recvs[i][j] != sends[j][i]:
                lines.append(
                    f"rank {i} expects {recvs[i][j]} elements from rank {j}, "
                    f"which sends it {sends[j][i]}"
                )
    return lines


class CheckedGroup(BaseGroup):
    """A group that checks every op's arguments across ranks before running it."""

    def __init__(self, inner: BaseGroup) -> None:
        """Wrap ``inner``; every op is checked, then delegated to it."""
        super().__init__(
            inner.world_size, inner.rank, inner.group_name, inner.timeout, inner.options
        )
        self._inner = inner

    @property
    def inner(self) -> BaseGroup:
        """Return the wrapped group."""
        return self._inner

    @property
    def error(self) -> CollectiveError | None:
        """Return the wrapped group's failure, or None if it is healthy."""
        return self._inner.error

    def backend(self) -> Backend | str:  # type: ignore[override]
        """Return the wrapped group's backend."""
        return self._inner.backend()

    def backend_name(self) -> str:  # type: ignore[override]
        """Return the wrapped group's backend name."""
        return self._inner.backend_name()

    @property
    def transport(self) -> str:
        """Return how the wrapped group moves bytes."""
        return self._inner.transport

    @property
    def device_type(self) -> str:  # type: ignore[override]
        """Return the device kind the wrapped group takes."""
        return self._inner.device_type

    def check_reduce_op(self, op: ReduceOp, dtype: str) -> None:
        """Reject a reduction the wrapped group cannot apply to ``dtype``."""
        self._inner.check_reduce_op(op, dtype)

    @classmethod
    def check_backend_availability(cls) -> bool:
        """Return True: the wrapper needs nothing of its own."""
        return True

    def check_tensor(self, described: TensorSpec, name: str) -> None:
        """Reject a buffer the wrapped group cannot use."""
        self._inner.check_tensor(described, name)

    def _blank(self, op: str) -> list[int]:
        slots = [_NONE] * (_FIXED + 2 * self.world_size)
        slots[_OP] = _OPS.index(op)
        return slots

    def _agree(self, op: str, slots: list[int], timeout: timedelta | None) -> None:
        """Allgather ``slots`` over the group; raise ValueError on every rank if they differ."""
        mine = int64_array(slots)
        gathered = [int64_array([0] * len(slots)) for _ in range(self.world_size)]
        self._inner.allgather([gathered], [mine], AllGatherOptions(timeout)).wait()
        lines = describe_mismatch([g.tolist() for g in gathered], self.world_size)
        if lines:
            raise ValueError(
                f"{op} on group {self.group_name!r}: the ranks passed different arguments; "
                + "; ".join(lines)
            )

    def _tensor_op(
        self,
        op: str,
        x: Any,
        timeout: timedelta | None,
        root: int = _NONE,
        reduce_op: ReduceOp | None = None,
        count: int = _NONE,
    ) -> None:
        slots = self._blank(op)
        if x is not None:
            _encode_tensor(slots, x)
        slots[_ROOT] = root
        slots[_REDUCE] = reduce_op.value if reduce_op is not None else _NONE
        slots[_COUNT] = count
        self._agree(op, slots, timeout)

    def allreduce(self, tensors: Sequence[Any], options: AllReduceOptions) -> Work:
        """Check, then reduce into every rank's tensor in place."""
        self._tensor_op("allreduce", tensors[0], options.timeout, reduce_op=options.reduce_op)
        return self._inner.allreduce(tensors, options)

    def barrier(self, options: BarrierOptions) -> Work:
        """Check, then block until every rank has entered the barrier."""
        self._tensor_op("barrier", None, options.timeout)
        return self._inner.barrier(options)

    def reduce(self, tensors: Sequence[Any], options: ReduceOptions) -> Work:
        """Check, then reduce onto the root's tensor in place."""
        self._tensor_op("reduce", tensors[0], options.timeout, options.root_rank, options.reduce_op)
        return self._inner.reduce(tensors, options)

    def broadcast(self, tensors: Sequence[Any], options: BroadcastOptions) -> Work:
        """Check, then copy the root's tensor into every other rank's, in place."""
        self._tensor_op("broadcast", tensors[0], options.timeout, options.root_rank)
        return self._inner.broadcast(tensors, options)

    def allgather(
        self,
        tensor_lists: Sequence[Sequence[Any]],
        tensors: Sequence[Any],
        options: AllGatherOptions,
    ) -> Work:
        """Check, then write rank i's tensor into element i of every rank's list."""
        count = len(tensor_lists[0])
        self._tensor_op("allgather", tensors[0], options.timeout, count=count)
        return self._inner.allgather(tensor_lists, tensors, options)

    def reducescatter(
        self,
        tensors: Sequence[Any],
        tensor_lists: Sequence[Sequence[Any]],
        options: ReduceScatterOptions,
    ) -> Work:
        """Check, then reduce element i of every list into rank i's tensor, in place."""
        count = len(tensor_lists[0])
        self._tensor_op(
            "reducescatter", tensors[0], options.timeout, reduce_op=options.reduce_op, count=count
        )
        return self._inner.reducescatter(tensors, tensor_lists, options)

    def gather(
        self,
        tensor_lists: Sequence[Sequence[Any]],
        tensors: Sequence[Any],
        options: GatherOptions,
    ) -> Work:
        """Check, then write rank i's tensor into element i of the root's list."""
        self._tensor_op("gather", tensors[0], options.timeout, options.root_rank)
        return self._inner.gather(tensor_lists, tensors, options)

    def scatter(
        self,
        tensors: Sequence[Any],
        tensor_lists: Sequence[Sequence[Any]],
        options: ScatterOptions,
    ) -> Work:
        """Check, then write element i of the root's list into rank i's tensor."""
        self._tensor_op("scatter", tensors[0], options.timeout, options.root_rank)
        return self._inner.scatter(tensors, tensor_lists, options)

    def alltoall(
        self, outputs: Sequence[Any], inputs: Sequence[Any], options: AllToAllOptions
    ) -> Work:
        """Check the per-peer sizes, then exchange ``inputs[j]`` for ``outputs[j]``."""
        slots = self._blank("alltoall")
        if inputs:
            _encode_tensor(slots, inputs[0])
            slots[_NDIM], slots[_CRC] = _NONE, _NONE
            slots[_DIMS : _DIMS + _MAX_DIMS] = [_NONE] * _MAX_DIMS
        slots[_COUNT] = len(inputs)
        n = self.world_size
        if len(inputs) == n and len(outputs) == n:
            slots[_FIXED : _FIXED + n] = [_numel(x) for x in inputs]
            slots[_FIXED + n :] = [_numel(x) for x in outputs]
        self._agree("alltoall", slots, options.timeout)
        return self._inner.alltoall(outputs, inputs, options)

    def _swap(self, op: str, x: Any, peer: int, sends_first: bool, timeout: Any) -> None:
        """Swap signatures with ``peer``; raise ValueError on both if they do not match."""
        slots = self._blank(op)
        _encode_tensor(slots, x)
        slots[_ROOT] = peer
        mine, theirs = int64_array(slots), int64_array([0] * len(slots))
        send, recv = SendOptions(peer, timeout=timeout), RecvOptions(peer, timeout=timeout)
        if sends_first:
            self._inner.send([mine], send).wait()
            self._inner.recv([theirs], recv).wait()
        else:
            self._inner.recv([theirs], recv).wait()
            self._inner.send([mine], send).wait()
        other = theirs.tolist()
        lines = []
        if _OPS[other[_OP]] != ("recv" if op == "send" else "send") or other[_ROOT] != self.rank:
            lines.append(f"rank {peer} called {_OPS[other[_OP]]} with peer {other[_ROOT]}")
        for field in ("dtype", "shape"):
            a, b = _FIELDS[field](slots), _FIELDS[field](other)
            if a != b:
                lines.append(f"{field}: {a} on rank {self.rank}, {b} on rank {peer}")
        if lines:
            raise ValueError(
                f"{op} on group {self.group_name!r}: ranks {sorted((self.rank, peer))} passed "
                "different arguments; " + "; ".join(lines)
            )

    def send(self, tensors: Sequence[Any], options: SendOptions) -> Work:
        """Check with the receiver, then send the tensor to ``options.dst_rank``."""
        self._swap("send", tensors[0], options.dst_rank, True, options.timeout)
        return self._inner.send(tensors, options)

    def recv(self, tensors: Sequence[Any], options: RecvOptions) -> Work:
        """Check with the sender, then receive into the tensor in place."""
        self._swap("recv", tensors[0], options.src_rank, False, options.timeout)
        return self._inner.recv(tensors, options)

    def abort(self, reason: str) -> None:
        """Abort the wrapped group's pending ops."""
        super().abort(reason)
        self._inner.abort(reason)

    def destroy_group(self) -> None:
        """Destroy the wrapped group."""
        self._inner.destroy_group()
