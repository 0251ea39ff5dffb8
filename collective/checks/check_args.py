"""CheckedGroup: before every op, the ranks compare what they are about to do.

A group built with ``check_args=True`` is wrapped in a ``CheckedGroup``. Before
each collective, every rank contributes its call's signature (see ``signature``)
to an allgather on the group itself. If the signatures disagree, every rank
raises the same ``ArgumentValueError``, naming the ranks and how they differ,
and no data moves. Send and recv swap signatures with their peer only. The check
costs one small allgather (or one swap) per op.

A rank whose own argument checks failed still takes part: its signature carries
the error's kind and length, and a second exchange, made only then, carries the
messages. Every rank then raises the same error, and the group stays usable.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from datetime import timedelta
from typing import Any, NoReturn

from collective import signature
from collective.frameworks import kinds, packing, streams
from collective.frameworks.kinds import TensorSpec, array_bytes, byte_array, copy_of, int64_array
from collective.frameworks.packing import to_host
from collective.groups.base import BaseGroup
from collective.types import (
    AllGatherOptions,
    AllReduceOptions,
    AllToAllOptions,
    ArgumentError,
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


class CheckedGroup(BaseGroup):
    """A group that checks every op's arguments across ranks before running it."""

    def __init__(self, inner: BaseGroup) -> None:
        """Wrap ``inner``; every op is checked, then delegated to it."""
        super().__init__(
            inner.world_size, inner.rank, inner.group_name, inner.timeout, inner.options
        )
        self._inner = inner
        inner.skip_agreement()
        self.launches = inner.launches
        """The wrapped group's, which its failure, abort and destroy empty; only this
        group's launches (each with its agreement) are kept there."""

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

    def key_of(self, x: Any) -> Hashable | None:  # type: ignore[override]
        """Return the wrapped group's key of buffer ``x``."""
        return self._inner.key_of(x)

    def placed_key(self, x: Any) -> Hashable | None:
        """Return the wrapped group's ``placed_key``."""
        return self._inner.placed_key(x)

    def check_tensor(self, described: TensorSpec, name: str) -> None:
        """Reject a buffer the wrapped group cannot use."""
        self._inner.check_tensor(described, name)

    def refuse(self, op: str, error: ArgumentError, peer: int | None = None) -> NoReturn:
        """Raise ``error``, this rank's argument error in ``op``, on every rank that takes part.

        The other ranks learn of it in the signature exchange of their own call; for
        send and recv that is ``peer`` alone. The exchange uses the group's timeout.
        """
        slots = signature.blank(op, self.world_size)
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
        like: Any = None,
    ) -> None:
        """Allgather ``slots`` over the group; raise the same error on every rank if they differ.

        ``like`` is a buffer of the call, next to which a GPU group's messages go.
        """
        agree(self._inner, op, slots, timeout, error, self._mover(like))

    def _mover(self, like: Any) -> Callable[[Any], Any] | None:
        """Return how a control message reaches this rank's GPU (None: it stays in numpy).

        A GPU group moves only buffers on its GPU: the messages go where ``like``, a
        buffer of the call, lies, or onto the current CUDA device.
        """
        if self._inner.device_type != "cuda":
            return None
        if like is None or not kinds.is_buffer(like) or not streams.on_gpu(like):
            like = packing.empty("uint8", (0,), "cuda")
        return lambda array: packing.to_device(array, like)

    def _tensor_op(
        self,
        op: str,
        x: Any,
        timeout: timedelta | None,
        root: int = signature.UNSET,
        reduce_op: ReduceOp | None = None,
        count: int = signature.UNSET,
    ) -> None:
        slots = signature.of_call(op, self.world_size, x, root, reduce_op, count)
        self._agree(op, slots, timeout, like=x)

    def _run_inner(self, op: str, args: tuple[Any, ...], options: Any) -> Work:
        """Run ``op(*args, options)`` on the inner group, once this group has checked it.

        A call that the inner group runs its own way (one tensor per GPU, on ranks that
        share GPUs: its ``lists``) goes through the inner group's prepared run.
        """
        lists = getattr(self._inner, "lists", None)
        if lists is not None and lists.takes(op, args):
            run, _ = self._inner.prepare(op, args, options)
            return run(lambda: args)
        return getattr(self._inner, op)(*args, options)

    def allreduce(self, tensors: Sequence[Any], options: AllReduceOptions) -> Work:
        """Check, then reduce into every rank's tensor in place."""
        self._tensor_op("allreduce", tensors[0], options.timeout, reduce_op=options.reduce_op)
        return self._run_inner("allreduce", (tensors,), options)

    def barrier(self, options: BarrierOptions) -> Work:
        """Check, then block until every rank has entered the barrier."""
        self._tensor_op("barrier", None, options.timeout)
        return self._inner.barrier(options)

    def reduce(self, tensors: Sequence[Any], options: ReduceOptions) -> Work:
        """Check, then reduce onto the root's tensor in place."""
        self._tensor_op("reduce", tensors[0], options.timeout, options.root_rank, options.reduce_op)
        return self._run_inner("reduce", (tensors,), options)

    def broadcast(self, tensors: Sequence[Any], options: BroadcastOptions) -> Work:
        """Check, then copy the root's tensor into every other rank's, in place."""
        self._tensor_op("broadcast", tensors[0], options.timeout, options.root_rank)
        return self._run_inner("broadcast", (tensors,), options)

    def allgather(
        self,
        tensor_lists: Sequence[Sequence[Any]],
        tensors: Sequence[Any],
        options: AllGatherOptions,
    ) -> Work:
        """Check, then write rank i's tensor into element i of every rank's list."""
        count = len(tensor_lists[0])
        self._tensor_op("allgather", tensors[0], options.timeout, count=count)
        return self._run_inner("allgather", (tensor_lists, tensors), options)

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
        return self._run_inner("reducescatter", (tensors, tensor_lists), options)

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
        slots = signature.of_alltoall(self.world_size, outputs, inputs)
        self._agree("alltoall", slots, options.timeout, like=next(iter(inputs), None))
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
        slots = signature.of_call(op, self.world_size, x, root=peer)
        message = signature.mark_error(slots, error)
        move = self._mover(x) or (lambda array: array)
        mine = move(int64_array(slots))
        other = to_host(self._exchange(mine, peer, sends_first, timeout)).tolist()
        if signature.failed(slots) or signature.failed(other):
            width = max(1, signature.error_length(slots), signature.error_length(other))
            sent = move(byte_array(message, width))
            theirs = to_host(self._exchange(sent, peer, sends_first, timeout))
            signatures = [signature.blank(op, self.world_size) for _ in range(self.world_size)]
            messages = [b""] * self.world_size
            signatures[self.rank], messages[self.rank] = slots, message
            signatures[peer], messages[peer] = other, array_bytes(theirs, width)
            raise signature.argument_error(op, self.group_name, signatures, messages) from error
        lines = signature.describe_pair(op, slots, other, self.rank, peer)
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

    def retire(self, reason: str) -> None:
        """Retire the wrapped group (see ``BaseGroup.retire``)."""
        super().abort(reason)
        self._inner.retire(reason)


def agree(
    group: BaseGroup,
    op: str,
    slots: list[int],
    timeout: timedelta | None,
    error: ArgumentError | None = None,
    on_device: Callable[[Any], Any] | None = None,
) -> list[list[int]]:
    """Allgather the signature ``slots`` over ``group``; return every rank's, once they agree.

    Every rank of ``group`` must call this for the same ``op``.

    Args:
        group: the group that carries the exchange.
        op: the op whose arguments are compared.
        slots: this rank's signature (see ``signature``).
        timeout: the exchange's timeout; None is the group's.
        error: this rank's own argument error, if its checks failed.
        on_device: moves a numpy control message to the group's device (a GPU
            group's messages must lie on its GPU); None keeps them in numpy.

    Raises:
        ArgumentError: a rank's own checks failed (``error`` here, or another rank's),
            or the ranks passed different arguments; the same error on every rank.

    """
    move = on_device or (lambda array: array)
    message = signature.mark_error(slots, error)
    mine = move(int64_array(slots))
    gathered = [move(int64_array([0] * len(slots))) for _ in range(group.world_size)]
    group.allgather([gathered], [mine], AllGatherOptions(timeout)).wait()
    signatures = [to_host(g).tolist() for g in gathered]
    if any(signature.failed(s) for s in signatures):
        width = max(1, *(signature.error_length(s) for s in signatures))
        texts = [move(byte_array(b"", width)) for _ in range(group.world_size)]
        options = AllGatherOptions(timeout)
        group.allgather([texts], [move(byte_array(message, width))], options).wait()
        messages = [array_bytes(to_host(t), width) for t in texts]
        raise signature.argument_error(op, group.group_name, signatures, messages) from error
    lines = signature.describe_mismatch(signatures, group.world_size)
    if lines:
        raise ArgumentValueError(
            f"{op} on group {group.group_name!r}: the ranks passed different arguments; "
            + "; ".join(lines)
        )
    return signatures
