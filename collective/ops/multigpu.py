"""The ``*_multigpu`` ops, for actors that drive several GPUs; signatures as in Ray.

An actor of rank ``r`` that passes ``n`` tensors, one per GPU, holds NCCL ranks
``r * n + i``; every actor of the group must pass the same number of tensors. Each
op writes its results into the caller's buffers in place and returns None, and
takes a keyword-only ``timeout`` that overrides the group's for this call. Each
takes the path of ``list_calls``: a call is checked, and its launch built, on the
first call of its key only.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from collective.checks import arguments
from collective.checks.arguments import checking
from collective.checks.written import check_written
from collective.frameworks import cuda_buffers
from collective.groups.base import BaseGroup
from collective.groups.launches import Launch
from collective.ops.list_calls import call
from collective.registry.held import get_group_handle
from collective.types import (
    AllGatherOptions,
    AllReduceOptions,
    ArgumentTypeError,
    ArgumentValueError,
    BroadcastOptions,
    RecvOptions,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
    SendOptions,
)
from collective.work import Work


def _gpu_group(group_name: str, function: str) -> BaseGroup:
    group = get_group_handle(group_name)
    arguments.check_multigpu_group(group, function)
    return group


def allreduce_multigpu(
    tensor_list: list[Any],
    group_name: str = "default",
    op: ReduceOp | str = ReduceOp.SUM,
    *,
    timeout: timedelta | None = None,
) -> None:
    """Reduce every GPU's tensor across the group; each tensor of ``tensor_list`` receives it."""
    group = _gpu_group(group_name, "allreduce_multigpu")
    call(_build_allreduce, group, "allreduce_multigpu", (tensor_list,), (op,), timeout, False)


def _build_allreduce(
    group: BaseGroup, tensor_list: Any, op: Any, timeout: Any, _: bool
) -> tuple[Launch, bool]:
    with checking(group, "allreduce"):
        tensors = arguments.check_gpu_tensor_list(group, tensor_list, "tensor_list")
        options = AllReduceOptions(ReduceOp.parse(op), arguments.check_timeout(timeout))
        check_written(group, _named(tensors, "tensor_list"))
    run, keep = group.prepare("allreduce", (tensors,), options)
    return (lambda args: _done(run(lambda: (list(args[0]),)))), keep


def reduce_multigpu(
    tensor_list: list[Any],
    dst_rank: int = 0,
    dst_tensor: int = 0,
    group_name: str = "default",
    op: ReduceOp | str = ReduceOp.SUM,
    *,
    timeout: timedelta | None = None,
) -> None:
    """Reduce every GPU's tensor onto tensor ``dst_tensor`` of rank ``dst_rank``.

    Only that tensor is written; every other tensor is left unchanged.
    """
    group = _gpu_group(group_name, "reduce_multigpu")
    extra = (dst_rank, dst_tensor, op)
    call(_build_reduce, group, "reduce_multigpu", (tensor_list,), extra, timeout, False)


def _build_reduce(
    group: BaseGroup,
    tensor_list: Any,
    dst_rank: Any,
    dst_tensor: Any,
    op: Any,
    timeout: Any,
    _: bool,
) -> tuple[Launch, bool]:
    with checking(group, "reduce"):
        tensors = arguments.check_gpu_tensor_list(group, tensor_list, "tensor_list")
        dst_rank = arguments.check_rank(dst_rank, group.world_size, "dst_rank")
        dst_tensor = arguments.check_index(dst_tensor, len(tensors), "dst_tensor")
        timeout = arguments.check_timeout(timeout)
        options = ReduceOptions(ReduceOp.parse(op), dst_rank, dst_tensor, timeout)
        if group.rank == dst_rank:
            check_written(group, [(f"tensor_list[{dst_tensor}]", tensors[dst_tensor])])
    run, keep = group.prepare("reduce", (tensors,), options)
    return (lambda args: _done(run(lambda: (list(args[0]),)))), keep


def broadcast_multigpu(
    tensor_list: list[Any],
    src_rank: int = 0,
    src_tensor: int = 0,
    group_name: str = "default",
    *,
    timeout: timedelta | None = None,
) -> None:
    """Copy tensor ``src_tensor`` of rank ``src_rank`` into every other GPU's tensor."""
    group = _gpu_group(group_name, "broadcast_multigpu")
    extra = (src_rank, src_tensor)
    call(_build_broadcast, group, "broadcast_multigpu", (tensor_list,), extra, timeout, False)


def _build_broadcast(
    group: BaseGroup, tensor_list: Any, src_rank: Any, src_tensor: Any, timeout: Any, _: bool
) -> tuple[Launch, bool]:
    with checking(group, "broadcast"):
        tensors = arguments.check_gpu_tensor_list(group, tensor_list, "tensor_list")
        src_rank = arguments.check_rank(src_rank, group.world_size, "src_rank")
        src_tensor = arguments.check_index(src_tensor, len(tensors), "src_tensor")
        options = BroadcastOptions(src_rank, src_tensor, arguments.check_timeout(timeout))
        written = _named(tensors, "tensor_list")
        if group.rank == src_rank:
            del written[src_tensor]
        check_written(group, written)
    run, keep = group.prepare("broadcast", (tensors,), options)
    return (lambda args: _done(run(lambda: (list(args[0]),)))), keep


def allgather_multigpu(
    output_tensor_lists: list[list[Any]],
    input_tensor_list: list[Any],
    group_name: str = "default",
    *,
    timeout: timedelta | None = None,
) -> None:
    """Gather every GPU's tensor: ``output_tensor_lists[i][k]`` receives NCCL rank k's.

    Args:
        output_tensor_lists: one list per local GPU, each of world_size * num_gpus
            buffers on that GPU; written in place.
        input_tensor_list: one tensor per local GPU; only read.
        group_name: the group.
        timeout: overrides the group's timeout for this call.

    """
    group = _gpu_group(group_name, "allgather_multigpu")
    args = (output_tensor_lists, input_tensor_list)
    call(_build_allgather, group, "allgather_multigpu", args, (), timeout, False)


def _build_allgather(
    group: BaseGroup, output_tensor_lists: Any, input_tensor_list: Any, timeout: Any, _: bool
) -> tuple[Launch, bool]:
    with checking(group, "allgather"):
        inputs = arguments.check_gpu_tensor_list(group, input_tensor_list, "input_tensor_list")
        outputs = _tensor_lists(group, output_tensor_lists, "output_tensor_lists", len(inputs))
        options = AllGatherOptions(arguments.check_timeout(timeout))
        for i, xs in enumerate(outputs):
            check_written(group, _named(xs, f"output_tensor_lists[{i}]"))
    run, keep = group.prepare("allgather", (outputs, inputs), options)
    return (lambda args: _done(run(lambda: ([list(xs) for xs in args[0]], list(args[1]))))), keep


def reducescatter_multigpu(
    output_tensor_list: list[Any],
    input_tensor_lists: list[list[Any]],
    group_name: str = "default",
    op: ReduceOp | str = ReduceOp.SUM,
    *,
    timeout: timedelta | None = None,
) -> None:
    """Reduce the lists elementwise; NCCL rank k's output tensor receives element k.

    Args:
        output_tensor_list: one tensor per local GPU; written in place.
        input_tensor_lists: one list per local GPU, each of world_size * num_gpus
            buffers on that GPU; only read.
        group_name: the group.
        op: the reduction.
        timeout: overrides the group's timeout for this call.

    """
    group = _gpu_group(group_name, "reducescatter_multigpu")
    args = (output_tensor_list, input_tensor_lists)
    call(_build_reducescatter, group, "reducescatter_multigpu", args, (op,), timeout, False)


def _build_reducescatter(
    group: BaseGroup,
    output_tensor_list: Any,
    input_tensor_lists: Any,
    op: Any,
    timeout: Any,
    _: bool,
) -> tuple[Launch, bool]:
    with checking(group, "reducescatter"):
        outputs = arguments.check_gpu_tensor_list(group, output_tensor_list, "output_tensor_list")
        inputs = _tensor_lists(group, input_tensor_lists, "input_tensor_lists", len(outputs))
        options = ReduceScatterOptions(ReduceOp.parse(op), arguments.check_timeout(timeout))
        check_written(group, _named(outputs, "output_tensor_list"))
    run, keep = group.prepare("reducescatter", (outputs, inputs), options)
    return (lambda args: _done(run(lambda: (list(args[0]), [list(xs) for xs in args[1]])))), keep


def send_multigpu(
    tensor: Any,
    dst_rank: int,
    dst_gpu_index: int,
    group_name: str = "default",
    n_elements: int = 0,
    *,
    timeout: timedelta | None = None,
) -> None:
    """Send ``tensor`` (its first ``n_elements``, if not 0) to GPU ``dst_gpu_index`` of a peer."""
    group = _gpu_group(group_name, "send_multigpu")
    extra = (dst_rank, dst_gpu_index, n_elements)
    call(_build_send, group, "send_multigpu", (tensor,), extra, timeout, False)


def _build_send(
    group: BaseGroup,
    tensor: Any,
    dst_rank: Any,
    dst_gpu_index: Any,
    n_elements: Any,
    timeout: Any,
    _: bool,
) -> tuple[Launch, bool]:
    dst_rank = arguments.check_peer(dst_rank, group, "dst_rank")
    with checking(group, "send", dst_rank):
        arguments.check_tensor(group, tensor, "tensor")
        dst_gpu_index = arguments.check_non_negative(dst_gpu_index, "dst_gpu_index")
        n_elements = arguments.check_non_negative(n_elements, "n_elements")
        timeout = arguments.check_timeout(timeout)
        options = SendOptions(dst_rank, dst_gpu_index, n_elements, timeout)
    run, keep = group.prepare("send", ([tensor],), options)
    return (lambda args: _done(run(lambda: ([args[0]],)))), keep


def recv_multigpu(
    tensor: Any,
    src_rank: int,
    src_gpu_index: int,
    group_name: str = "default",
    n_elements: int = 0,
    *,
    timeout: timedelta | None = None,
) -> None:
    """Receive into ``tensor`` (its first ``n_elements``, if not 0) from a peer's GPU."""
    group = _gpu_group(group_name, "recv_multigpu")
    extra = (src_rank, src_gpu_index, n_elements)
    call(_build_recv, group, "recv_multigpu", (tensor,), extra, timeout, False)


def _build_recv(
    group: BaseGroup,
    tensor: Any,
    src_rank: Any,
    src_gpu_index: Any,
    n_elements: Any,
    timeout: Any,
    _: bool,
) -> tuple[Launch, bool]:
    src_rank = arguments.check_peer(src_rank, group, "src_rank")
    with checking(group, "recv", src_rank):
        arguments.check_tensor(group, tensor, "tensor")
        src_gpu_index = arguments.check_non_negative(src_gpu_index, "src_gpu_index")
        n_elements = arguments.check_non_negative(n_elements, "n_elements")
        timeout = arguments.check_timeout(timeout)
        options = RecvOptions(src_rank, src_gpu_index, n_elements, timeout)
        check_written(group, [("tensor", tensor)])
    run, keep = group.prepare("recv", ([tensor],), options)
    return (lambda args: _done(run(lambda: ([args[0]],)))), keep


def synchronize(gpu_id: int) -> None:
    """Block until all work queued on GPU ``gpu_id`` of this process has finished."""
    cuda_buffers.synchronize_device(arguments.check_non_negative(gpu_id, "gpu_id"))


def _tensor_lists(group: BaseGroup, xs: Any, name: str, length: int) -> list[list[Any]]:
    """Return ``xs`` as ``length`` lists of tensors that ``group`` takes."""
    if not isinstance(xs, (list, tuple)):
        raise ArgumentTypeError(
            f"{name} must be a list of lists of tensors, got {type(xs).__name__}"
        )
    if len(xs) != length:
        raise ArgumentValueError(f"{name} must hold {length} lists (one per GPU), got {len(xs)}")
    return [arguments.check_gpu_tensor_list(group, x, f"{name}[{i}]") for i, x in enumerate(xs)]


def _done(work: Work) -> None:
    """Return what a ``*_multigpu`` op returns once its blocking op has run: None."""
    return None


def _named(xs: list[Any], name: str) -> list[tuple[str, Any]]:
    """Return ``(name[i], xs[i])`` pairs, for the checks of the buffers an op writes."""
    return [(f"{name}[{i}]", x) for i, x in enumerate(xs)]
