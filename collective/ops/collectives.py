"""The collective ops; each looks up its group, checks its arguments, then calls the group.

Every op here takes the path of ``calls`` (allreduce, reduce, broadcast, send, recv) or of
``list_calls`` (allgather, reducescatter, barrier): a call's arguments are checked, and its launch
built, on the first call of its key only.

Every op writes its result into the caller's buffers in place and returns None,
as in ``ray.util.collective``. Its argument checks run before anything is sent;
on a group with ``check_args=True`` one rank's argument error is raised on every
rank of the op. Every op also takes a keyword-only ``timeout``
(a ``timedelta``) that overrides the group's default for this call, and
``async_op``: with True the op returns a ``Work`` at once, and its buffers must
not be touched until ``Work.wait`` has returned.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from collective.ops import list_calls
from collective.ops.calls import ALLREDUCE, BROADCAST, RECV, REDUCE, SEND, call
from collective.registry.held import get_group_handle
from collective.types import ReduceOp
from collective.work import Work


def allreduce(
    tensor: Any,
    group_name: str = "default",
    op: ReduceOp | str = ReduceOp.SUM,
    *,
    timeout: timedelta | None = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce ``tensor`` across the group; every rank's ``tensor`` is overwritten with the result.

    Args:
        tensor: a numpy array or torch tensor; written in place on every rank.
        group_name: the group.
        op: the reduction; AVG takes floating-point tensors, BAND/BOR/BXOR integer and bool.
        timeout: overrides the group's timeout for this call.
        async_op: return a ``Work`` at once instead of waiting.

    """
    return call(ALLREDUCE, get_group_handle(group_name), tensor, op, -1, timeout, async_op)


def barrier(
    group_name: str = "default", *, timeout: timedelta | None = None, async_op: bool = False
) -> Work | None:
    """Block until every rank of the group has called ``barrier``."""
    group = get_group_handle(group_name)
    return list_calls.call(list_calls.build_barrier, group, "barrier", (), (), timeout, async_op)


def reduce(
    tensor: Any,
    dst_rank: int = 0,
    group_name: str = "default",
    op: ReduceOp | str = ReduceOp.SUM,
    *,
    timeout: timedelta | None = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce ``tensor`` across the group onto ``dst_rank``.

    Only ``dst_rank``'s ``tensor`` is written, with the result; every other rank's
    ``tensor`` is left exactly as it was.
    """
    return call(REDUCE, get_group_handle(group_name), tensor, op, dst_rank, timeout, async_op)


def broadcast(
    tensor: Any,
    src_rank: int = 0,
    group_name: str = "default",
    *,
    timeout: timedelta | None = None,
    async_op: bool = False,
) -> Work | None:
    """Copy ``src_rank``'s ``tensor`` into every other rank's ``tensor``, in place.

    The tensors must agree in shape and dtype across ranks; ``src_rank``'s is only read.
    """
    return call(BROADCAST, get_group_handle(group_name), tensor, None, src_rank, timeout, async_op)


def allgather(
    tensor_list: list[Any] | Any,
    tensor: Any,
    group_name: str = "default",
    *,
    timeout: timedelta | None = None,
    async_op: bool = False,
) -> Work | None:
    """Gather every rank's ``tensor``: ``tensor_list[i]`` receives rank i's, on every rank.

    Args:
        tensor_list: world-size buffers of ``tensor``'s shape and dtype, or one
            contiguous buffer of world size x ``tensor``'s elements whose i-th chunk
            receives rank i's; written in place.
        tensor: this rank's contribution; only read.
        group_name: the group.
        timeout: overrides the group's timeout for this call.
        async_op: return a ``Work`` at once instead of waiting.

    """
    args = (tensor_list, tensor)
    group = get_group_handle(group_name)
    return list_calls.call(
        list_calls.build_allgather, group, "allgather", args, (), timeout, async_op
    )


def reducescatter(
    tensor: Any,
    tensor_list: list[Any] | Any,
    group_name: str = "default",
    op: ReduceOp | str = ReduceOp.SUM,
    *,
    timeout: timedelta | None = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce ``tensor_list`` elementwise across ranks; rank i's ``tensor`` receives chunk i.

    Args:
        tensor: this rank's result buffer; written in place.
        tensor_list: world-size buffers of ``tensor``'s shape and dtype, or one
            contiguous buffer of world size x ``tensor``'s elements; only read,
            never modified (unlike ``ray.util.collective``). ``tensor`` may be one
            of them, as in ``reducescatter(chunks[rank], chunks)``: then that one
            receives the result and the others stay unchanged.
        group_name: the group.
        op: the reduction; AVG takes floating-point tensors, BAND/BOR/BXOR integer and bool.
        timeout: overrides the group's timeout for this call.
        async_op: return a ``Work`` at once instead of waiting.

    """
    args = (tensor, tensor_list)
    group = get_group_handle(group_name)
    return list_calls.call(
        list_calls.build_reducescatter, group, "reducescatter", args, (op,), timeout, async_op
    )


def send(
    tensor: Any,
    dst_rank: int,
    group_name: str = "default",
    *,
    timeout: timedelta | None = None,
    async_op: bool = False,
) -> Work | None:
    """Send ``tensor`` to ``dst_rank`` of the group; ``tensor`` is only read.

    Ranks are the group's own ranks. Each send is matched by one ``recv`` on the peer.
    When a blocking send returns depends on the transport:

    - Shared memory (both ranks on one node): once the last chunk of ``tensor`` is in
      the pair's two mailboxes (up to 256 KiB each, less with more ranks on the node).
      A message that fits them returns before the peer calls ``recv``; a longer one
      returns once the peer has read all but what the mailboxes hold. Either way
      ``tensor`` may be changed as soon as the send returns.
    - Gloo (ranks on different nodes, or ``cpu_transport="gloo"``): once the peer has
      posted the matching ``recv`` and the bytes are sent.
    - NCCL: at once, with the send queued on the caller's current CUDA stream; it runs
      when the stream reaches it and the peer's ``recv`` runs. Later work on that
      stream is ordered after it; work on other streams must not change ``tensor``
      before the stream passes it.

    With ``async_op=True`` it returns a ``Work`` at once. On the CPU transports
    ``Work.wait`` returns when the blocking send would have; on NCCL, once the send
    has finished on the GPU.
    """
    return call(SEND, get_group_handle(group_name), tensor, None, dst_rank, timeout, async_op)


def recv(
    tensor: Any,
    src_rank: int,
    group_name: str = "default",
    *,
    timeout: timedelta | None = None,
    async_op: bool = False,
) -> Work | None:
    """Receive into ``tensor``, in place, what ``src_rank`` of the group sends."""
    return call(RECV, get_group_handle(group_name), tensor, None, src_rank, timeout, async_op)
