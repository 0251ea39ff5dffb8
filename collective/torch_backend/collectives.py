"""The backend's collectives on one tensor or one list: torch's call in, the library's call out.

Each is a method of ``CollectiveProcessGroup`` (``process_group``), called by
``torch.distributed`` with its tensors and its options object. It reads the options,
hands the tensors to the library's op on the group's ``CpuGroup`` (whose launch,
checks included, is built on the first call of a signature and looked up after), and
returns ``DONE`` for a blocking call or a ``TorchWork`` for an async one. A tensor
that is not on the CPU goes to torch's own dispatch (``other_device``).

The results are written in place, as torch's Gloo writes them: all_reduce and
broadcast into every rank's tensor, reduce into the root's, all_gather into every
rank's outputs, reduce_scatter into every rank's output.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from collective.ops import list_calls
from collective.ops.calls import ALLREDUCE, BROADCAST, REDUCE, call
from collective.torch_backend import sparse
from collective.torch_backend.adapter import Adapter
from collective.torch_backend.options import REDUCE_OPS, reduce_op, timeout_of
from collective.torch_backend.overloads import listed, options
from collective.torch_backend.work import DONE
from collective.types import ArgumentValueError

_ZERO = timedelta(0)
_ALLREDUCE = dist.AllreduceOptions
"""torch's options class of ``allreduce``, as torch and DDP pass it."""


def one_tensor(tensors: list[Any], name: str) -> Any:
    """Return the one tensor of torch's list ``tensors``, as torch's Gloo takes on a CPU.

    Raises:
        ArgumentValueError: the list holds another number of tensors.

    """
    if len(tensors) != 1:
        raise ArgumentValueError(
            f"the collective backend takes one {name} per call, got {len(tensors)}"
        )
    return tensors[0]


def allreduce(self: Adapter, tensors: Any, *args: Any, **kwargs: Any) -> Any:
    """Reduce every rank's tensor by ``opts.reduceOp`` into each rank's tensor, in place.

    A sparse COO tensor is summed (``sparse``). Takes ``(tensors, opts)`` or torch's
    ``(tensor or tensors, op=SUM, timeout=None)``.
    """
    opts: Any = args[0] if len(args) == 1 else None
    if opts.__class__ is not _ALLREDUCE or kwargs:
        tensors, opts = listed(tensors), options("allreduce", args, kwargs)
    tensor = tensors[0] if len(tensors) == 1 else one_tensor(tensors, "tensor")
    if not tensor.is_cpu:
        return self.other_device("allreduce", tensor, tensors, opts)
    if tensor.is_sparse:
        return sparse.all_reduce(self, tensor, opts)
    op = REDUCE_OPS[opts.reduceOp.op.value] or reduce_op(opts)
    timeout = opts.timeout
    if opts.asyncOp:
        work = call(ALLREDUCE, self.group, tensor, op, -1, timeout_of(opts), True)
        return self.async_work(work, tensors)
    call(ALLREDUCE, self.group, tensor, op, -1, timeout if timeout > _ZERO else None, False)
    return DONE


def broadcast(self: Adapter, tensors: Any, *args: Any, **kwargs: Any) -> Any:
    """Copy ``opts.rootRank``'s tensor into every other rank's tensor, in place.

    Takes ``(tensors, opts)`` or torch's ``(tensor, root, timeout=None)``.
    """
    opts = options("broadcast", args, kwargs)
    tensors = listed(tensors)
    tensor = tensors[0] if len(tensors) == 1 else one_tensor(tensors, "tensor")
    if not tensor.is_cpu:
        return self.other_device("broadcast", tensor, tensors, opts)
    async_op = opts.asyncOp
    work = call(BROADCAST, self.group, tensor, None, opts.rootRank, timeout_of(opts), async_op)
    return self.async_work(work, tensors) if async_op else DONE


def reduce(self: Adapter, tensors: Any, *args: Any, **kwargs: Any) -> Any:
    """Reduce every rank's tensor onto ``opts.rootRank``'s; the others' stay unchanged.

    Takes ``(tensors, opts)`` or torch's ``(tensor, root, op=SUM, timeout=None)``.
    """
    opts = options("reduce", args, kwargs)
    tensors = listed(tensors)
    tensor = tensors[0] if len(tensors) == 1 else one_tensor(tensors, "tensor")
    if not tensor.is_cpu:
        return self.other_device("reduce", tensor, tensors, opts)
    op = REDUCE_OPS[opts.reduceOp.op.value] or reduce_op(opts)
    async_op = opts.asyncOp
    work = call(REDUCE, self.group, tensor, op, opts.rootRank, timeout_of(opts), async_op)
    return self.async_work(work, tensors) if async_op else DONE


def allgather(self: Adapter, output_lists: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
    """Write rank i's tensor into ``output_lists[0][i]`` on every rank.

    Takes ``(output_lists, inputs, opts)`` or torch's ``(outputs, input, timeout=None)``.
    """
    opts = options("allgather", args, kwargs)
    if isinstance(inputs, torch.Tensor):
        output_lists, inputs = [output_lists], [inputs]
    tensor = one_tensor(inputs, "input tensor")
    if not tensor.is_cpu:
        return self.other_device("allgather", tensor, output_lists, inputs, opts)
    outputs = one_tensor(output_lists, "output list")
    return self.run_list(
        list_calls.build_allgather, "allgather", (outputs, tensor), (), opts, outputs
    )


def all_gather_single(self: Adapter, output: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
    """Write rank i's ``input`` into the i-th chunk of every rank's ``output`` along dim 0."""
    opts = options("allgather", args, kwargs)
    if not input.is_cpu:
        return self.other_device("all_gather_single", input, output, input, opts)
    return self.run_list(
        list_calls.build_allgather, "allgather", (output, input), (), opts, [output]
    )


def reduce_scatter(self: Adapter, outputs: Any, input_lists: Any, *args: Any, **kwargs: Any) -> Any:
    """Reduce element i of every rank's ``input_lists[0]`` into rank i's output, in place.

    Takes ``(outputs, input_lists, opts)`` or torch's ``(output, inputs, op=SUM, timeout=None)``.
    """
    opts = options("reduce_scatter", args, kwargs)
    if isinstance(outputs, torch.Tensor):
        outputs, input_lists = [outputs], [input_lists]
    output = one_tensor(outputs, "output tensor")
    if not output.is_cpu:
        return self.other_device("reduce_scatter", output, outputs, input_lists, opts)
    inputs = one_tensor(input_lists, "input list")
    op = REDUCE_OPS[opts.reduceOp.op.value] or reduce_op(opts)
    return self.run_list(
        list_calls.build_reducescatter, "reducescatter", (output, inputs), (op,), opts, outputs
    )


def reduce_scatter_single(self: Adapter, output: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
    """Reduce chunk i (along dim 0) of every rank's ``input`` into rank i's ``output``."""
    opts = options("reduce_scatter_single", args, kwargs)
    if not output.is_cpu:
        return self.other_device("reduce_scatter_single", output, output, input, opts)
    op = REDUCE_OPS[opts.reduceOp.op.value] or reduce_op(opts)
    return self.run_list(
        list_calls.build_reducescatter, "reducescatter", (output, input), (op,), opts, [output]
    )


def barrier(self: Adapter, *args: Any, **kwargs: Any) -> Any:
    """Block until every rank has entered the barrier (with ``async_op``, return at once).

    Takes ``(opts)`` or torch's ``(timeout=None)``.
    """
    opts = options("barrier", args, kwargs)
    return self.run_list(list_calls.build_barrier, "barrier", (), (), opts, [])
