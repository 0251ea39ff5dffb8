"""CheckedGroup: before every op, the ranks compare what they are about to do.

A group built with ``check_args=True`` is wrapped in a ``CheckedGroup``. Before
each collective, every rank contributes a fixed-size int64 signature (the op,
dtype, shape, root, reduce op, list length and, for alltoall, the element count
per peer) to an allgather on the group itself. If the signatures disagree, every
rank raises the same ``ArgumentValueError``, naming the ranks and how they differ,
and no data moves. Send and recv swap signatures with their peer only. The check
costs one small allgather (or one swap) per op.

A rank whose own argument checks failed still takes part: its signature carries
the error's kind and length, and a second exchange, made only then, carries the
messages. Every rank then raises the same error, and the group stays usable.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, NoReturn

from collective.groups.base import BaseGroup
from collective.tensor import (
    DTYPES,
    TensorSpec,
    array_bytes,
    byte_array,
    copy_of,
    int64_array,
    spec,
)
from collective.types import (
    AllGatherOptions,
    AllReduceOptions,
    AllToAllOptions,
    ArgumentError,
    ArgumentTypeError,
    ArgumentValueError,
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
# Slots of the fixed part: op, dtype, shape crc, ndim, dims..., root, reduce op, list length,
# then the kind of this rank's own argument error (0: none) and its message's length.
_OP, _DTYPE, _CRC, _NDIM = 0, 1, 2, 3
_DIMS = 4
_ROOT, _REDUCE, _COUNT = _DIMS + _MAX_DIMS, _DIMS + _MAX_DIMS + 1, _DIMS + _MAX_DIMS + 2
_ERROR, _LENGTH = _COUNT + 1, _COUNT + 2
_FIXED = _LENGTH + 1
_ERRORS: tuple[type[ArgumentError], ...] = (ArgumentValueError, ArgumentTypeError)
"""An argument error's kind is its index here, plus one."""
_MAX_MESSAGE = 4096
"""The longest error message sent to the other ranks, in bytes."""


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


def _mark_error(slots: list[int], error: ArgumentError | None) -> bytes:
    """Put ``error``'s kind and message length into ``slots``; return the encoded message."""
    if error is None:
        slots[_ERROR], slots[_LENGTH] = 0, 0
        return b""
    kind = next((i for i, cls in enumerate(_ERRORS) if isinstance(error, cls)), 0)
    message = str(error).encode(errors="replace")[:_MAX_MESSAGE]
    slots[_ERROR], slots[_LENGTH] = kind + 1, len(message)
    return message


def _argument_error(
    op: str, group_name: str, signatures: Sequence[Sequence[int]], messages: Sequence[bytes]
) -> ArgumentError:
    """Return the error every rank raises when some ranks' own argument checks failed."""
    failed = [r for r, s in enumerate(signatures) if s[_ERROR]]
    texts = [messages[r][: signatures[r][_LENGTH]].decode(errors="replace") for r in failed]
    cls = _ERRORS[signatures[failed[0]][_ERROR] - 1]
    if len(failed) == 1:
        detail = f"rank {failed[0]} passed an invalid argument: {texts[0]}"
    else:
        detail = "ranks passed invalid arguments: " + "; ".join(
            f"rank {r}: {t}" for r, t in zip(failed, texts, strict=True)
        )
    return cls(f"{op} on group {group_name!r}: {detail}")


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
        slots[_ERROR], slots[_LENGTH] = 0, 0
        return slots

    def refuse(self, op: str, error: ArgumentError, peer: int | None = None) -> NoReturn:
        """Raise ``error``, this rank's argument error in ``op``, on every rank that takes part.

        The other ranks learn of it in the signature exchange of their own call; for
        send and recv that is ``peer`` alone. The exchange uses the group's timeout.
        """
        slots = self._blank(op)
        if peer is None:
            self._agree(op, slots, None, error)
        else:
            self._swap(op, None, peer, op == "send", None, error)
        raise error

    def _agree(
        self,
        op: str,
        slots: list[int],
        timeout: timedelta | None,
        error: ArgumentError | None = None,
    ) -> None:
        """Allgather ``slots`` over the group; raise the same error on every rank if they differ.

        Raises:
            ArgumentError: a rank's own checks failed (``error`` here), or the ranks
                passed different arguments.

        """
        message = _mark_error(slots, error)
        mine = int64_array(slots)
        gathered = [int64_array([0] * len(slots)) for _ in range(self.world_size)]
        self._inner.allgather([gathered], [mine], AllGatherOptions(timeout)).wait()
        signatures = [g.tolist() for g in gathered]
        if any(s[_ERROR] for s in signatures):
            width = max(1, *(s[_LENGTH] for s in signatures))
            texts = [byte_array(b"", width) for _ in range(self.world_size)]
            options = AllGatherOptions(timeout)
            self._inner.allgather([texts], [byte_array(message, width)], options).wait()
            messages = [array_bytes(t, width) for t in texts]
            raise _argument_error(op, self.group_name, signatures, messages) from error
        lines = describe_mismatch(signatures, self.world_size)
        if lines:
            raise ArgumentValueError(
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

    def _swap(
        self,
        op: str,
        x: Any,
        peer: int,
        sends_first: bool,
        timeout: Any,
        error: ArgumentError | None = None,
    ) -> None:
        """Swap signatures with ``peer``; raise the same error on both if they do not match."""
        slots = self._blank(op)
        if x is not None:
            _encode_tensor(slots, x)
        slots[_ROOT] = peer
        message = _mark_error(slots, error)
        other = self._exchange(int64_array(slots), peer, sends_first, timeout).tolist()
        if slots[_ERROR] or other[_ERROR]:
            width = max(1, slots[_LENGTH], other[_LENGTH])
            theirs = self._exchange(byte_array(message, width), peer, sends_first, timeout)
            signatures = [self._blank(op) for _ in range(self.world_size)]
            messages = [b""] * self.world_size
            signatures[self.rank], messages[self.rank] = slots, message
            signatures[peer], messages[peer] = other, array_bytes(theirs, width)
            raise _argument_error(op, self.group_name, signatures, messages) from error
        lines = []
        if _OPS[other[_OP]] != ("recv" if op == "send" else "send") or other[_ROOT] != self.rank:
            lines.append(f"rank {peer} called {_OPS[other[_OP]]} with peer {other[_ROOT]}")
        for field in ("dtype", "shape"):
            a, b = _FIELDS[field](slots), _FIELDS[field](other)
            if a != b:
                lines.append(f"{field}: {a} on rank {self.rank}, {b} on rank {peer}")
        if lines:
            raise ArgumentValueError(
                f"{op} on group {self.group_name!r}: ranks {sorted((self.rank, peer))} passed "
                "different arguments; " + "; ".join(lines)
            )

    def _exchange(self, mine: Any, peer: int, sends_first: bool, timeout: Any) -> Any:
        """Send ``mine`` to ``peer`` and receive a buffer like it back, in a deadlock-free order."""
        theirs = copy_of(mine)
        send, recv = SendOptions(peer, timeout=timeout), RecvOptions(peer, timeout=timeout)
        if sends_first:
            self._inner.send([mine], send).wait()
            self._inner.recv([theirs], recv).wait()
        else:
            self._inner.recv([theirs], recv).wait()
            self._inner.send([mine], send).wait()
        return theirs

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
