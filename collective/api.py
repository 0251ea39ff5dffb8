"""The collective ops; each looks up its group, checks its arguments, then calls the group.

Every op writes its result into the caller's buffers in place and returns None,
as in ``ray.util.collective``. Every op also takes a keyword-only ``timeout``
(a ``timedelta``) that overrides the group's default for this call.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from collective import checks
from collective.lifecycle import get_group_handle
from collective.types import (
    AllGatherOptions,
    AllReduceOptions,
    BarrierOptions,
    BroadcastOptions,
    RecvOptions,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
    SendOptions,
)


def allreduce(
    tensor: Any,
    group_name: str = "default",
    op: ReduceOp = ReduceOp.SUM,
    *,
    timeout: timedelta | None = None,
) -> None:
    """Reduce ``tensor`` across the group; every rank's ``tensor`` is overwritten with the result.

    Args:
        tensor: a numpy array or torch tensor; written in place on every rank.
        group_name: the group.
        op: the reduction.
        timeout: overrides the group's timeout for this call.

    """
    group = get_group_handle(group_name)
    checks.check_tensor(group, tensor, "tensor")
    options = AllReduceOptions(ReduceOp.parse(op), checks.check_timeout(timeout))
    group.allreduce([tensor], options)


def barrier(group_name: str = "default", *, timeout: timedelta | None = None) -> None:
    """Block until every rank of the group has called ``barrier``."""
    group = get_group_handle(group_name)
    group.barrier(BarrierOptions(checks.check_timeout(timeout)))


def reduce(
    tensor: Any,
    dst_rank: int = 0,
    group_name: str = "default",
    op: ReduceOp = ReduceOp.SUM,
    *,
    timeout: timedelta | None = None,
) -> None:
    """Reduce ``tensor`` across the group onto ``dst_rank``.

    Only ``dst_rank``'s ``tensor`` is written, with the result; every other rank's
    ``tensor`` is left exactly as it was.
    """
    group = get_group_handle(group_name)
    checks.check_tensor(group, tensor, "tensor")
    checks.check_rank(dst_rank, group.world_size, "dst_rank")
    options = ReduceOptions(ReduceOp.parse(op), dst_rank, 0, checks.check_timeout(timeout))
    group.reduce([tensor], options)


def broadcast(
    tensor: Any,
    src_rank: int = 0,
    group_name: str = "default",
    *,
    timeout: timedelta | None = None,
) -> None:
    """Copy ``src_rank``'s ``tensor`` into every other rank's ``tensor``, in place.

    The tensors must agree in shape and dtype across ranks; ``src_rank``'s is only read.
    """
    group = get_group_handle(group_name)
    checks.check_tensor(group, tensor, "tensor")
    checks.check_rank(src_rank, group.world_size, "src_rank")
    group.broadcast([tensor], BroadcastOptions(src_rank, 0, checks.check_timeout(timeout)))


def allgather(
    tensor_list: list[Any],
    tensor: Any,
    group_name: str = "default",
    *,
    timeout: timedelta | None = None,
) -> None:
    """Gather every rank's ``tensor``: ``tensor_list[i]`` receives rank i's, on every rank.

    Args:
        tensor_list: world-size buffers of ``tensor``'s shape and dtype; written in place.
        tensor: this rank's contribution; only read.
        group_name: the group.
        timeout: overrides the group's timeout for this call.

    """
    group = get_group_handle(group_name)
    spec = checks.check_tensor(group, tensor, "tensor")
    outputs = checks.check_tensor_list(group, tensor_list, "tensor_list", spec, group.world_size)
    checks.check_disjoint([(f"tensor_list[{i}]", t) for i, t in enumerate(outputs)])
    group.allgather([outputs], [tensor], AllGatherOptions(checks.check_timeout(timeout)))


def reducescatter(
    tensor: Any,
    tensor_list: list[Any],
    group_name: str = "default",
    op: ReduceOp = ReduceOp.SUM,
    *,
    timeout: timedelta | None = None,
) -> None:
    """Reduce ``tensor_list`` elementwise across ranks; rank i's ``tensor`` receives chunk i.

    Args:
        tensor: this rank's result buffer; written in place.
        tensor_list: world-size buffers of ``tensor``'s shape and dtype; only read,
            never modified (unlike ``ray.util.collective``).
        group_name: the group.
        op: the reduction.
        timeout: overrides the group's timeout for this call.

    """
    group = get_group_handle(group_name)
    spec = checks.check_tensor(group, tensor, "tensor")
    inputs = checks.check_tensor_list(group, tensor_list, "tensor_list", spec, group.world_size)
    checks.check_disjoint(
        [("tensor", tensor)], [(f"tensor_list[{i}]", t) for i, t in enumerate(inputs)]
    )
    options = ReduceScatterOptions(ReduceOp.parse(op), checks.check_timeout(timeout))
    group.reducescatter([tensor], [inputs], options)


def send(
    tensor: Any, dst_rank: int, group_name: str = "default", *, timeout: timedelta | None = None
) -> None:
    """Send ``tensor`` to ``dst_rank`` of the group; returns once the peer has it.

    Ranks are the group's own ranks. Each send is matched by one ``recv`` on the peer.
    """
    group = get_group_handle(group_name)
    checks.check_tensor(group, tensor, "tensor")
    checks.check_peer(dst_rank, group, "dst_rank")
    group.send([tensor], SendOptions(dst_rank, 0, 0, checks.check_timeout(timeout)))


def recv(
    tensor: Any, src_rank: int, group_name: str = "default", *, timeout: timedelta | None = None
) -> None:
    """Receive into ``tensor``, in place, what ``src_rank`` of the group sends."""
    group = get_group_handle(group_name)
    checks.check_tensor(group, tensor, "tensor")
    checks.check_peer(src_rank, group, "src_rank")
    group.recv([tensor], RecvOptions(src_rank, 0, 0, checks.check_timeout(timeout)))
