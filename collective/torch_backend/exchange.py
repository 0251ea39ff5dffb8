"""The backend's gather, scatter, all-to-all and coalesced forms, as ``collectives`` are.

Each is a method of ``CollectiveProcessGroup``. gather writes the root's list, scatter
every rank's output, the all-to-alls every rank's outputs, in place. A coalesced form
runs its ops one after another on the group (all_reduce_coalesced as one bulk call,
whose ranks first agree on every tensor's dtype and shape); an async one returns the
``Work`` of the last, which ends after the others, as ops on one group end in order.
"""

from __future__ import annotations

from typing import Any

import torch

from collective.bulk import calls as bulk
from collective.ops.gather_scatter import (
    build_alltoall,
    build_alltoall_single,
    build_gather,
    build_scatter,
)
from collective.torch_backend.adapter import Adapter
from collective.torch_backend.collectives import (
    all_gather_single,
    allgather,
    one_tensor,
    reduce_scatter_single,
)
from collective.torch_backend.options import reduce_op, timeout_of
from collective.torch_backend.overloads import options
from collective.torch_backend.work import DONE
from collective.types import ArgumentValueError


def gather(self: Adapter, output_lists: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
    """Write rank i's tensor into element i of ``opts.rootRank``'s ``output_lists[0]``.

    torch passes one list on the root and none on the other ranks. Takes
    ``(output_lists, inputs, opts)`` or torch's ``(outputs, input, root, timeout=None)``.
    """
    opts = options("gather", args, kwargs)
    if isinstance(inputs, torch.Tensor):
        output_lists, inputs = ([output_lists] if output_lists else []), [inputs]
    tensor = one_tensor(inputs, "input tensor")
    if not tensor.is_cpu:
        return self.other_device("gather", tensor, output_lists, inputs, opts)
    gather_list = one_tensor(output_lists, "output list") if output_lists else None
    written = list(gather_list) if gather_list is not None else []
    args, root = (tensor, gather_list), (opts.rootRank,)
    return self.run_list(build_gather, "gather", args, root, opts, written)


def scatter(self: Adapter, outputs: Any, input_lists: Any, *args: Any, **kwargs: Any) -> Any:
    """Write element i of ``opts.rootRank``'s ``input_lists[0]`` into rank i's output.

    torch passes one list on the root and none on the other ranks. Takes
    ``(outputs, input_lists, opts)`` or torch's ``(output, inputs, root, timeout=None)``.
    """
    opts = options("scatter", args, kwargs)
    if isinstance(outputs, torch.Tensor):
        outputs, input_lists = [outputs], ([input_lists] if input_lists else [])
    output = one_tensor(outputs, "output tensor")
    if not output.is_cpu:
        return self.other_device("scatter", output, outputs, input_lists, opts)
    scatter_list = one_tensor(input_lists, "input list") if input_lists else None
    args, root = (output, scatter_list), (opts.rootRank,)
    return self.run_list(build_scatter, "scatter", args, root, opts, outputs)


def alltoall(
    self: Adapter, outputs: list[Any], inputs: list[Any], *args: Any, **kwargs: Any
) -> Any:
    """Exchange ``inputs[j]`` with rank j, whose tensor for this rank lands in ``outputs[j]``."""
    opts = options("alltoall", args, kwargs)
    if outputs and not outputs[0].is_cpu:
        return self.other_device("alltoall", outputs[0], outputs, inputs, opts)
    return self.run_list(build_alltoall, "alltoall", (outputs, inputs), (), opts, outputs)


def all_to_all_single(
    self: Adapter,
    output: Any,
    input: Any,
    output_split_sizes: list[int],
    input_split_sizes: list[int],
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Send block j of ``input`` (dim 0, ``input_split_sizes``) to rank j; receive into ``output``.

    Empty split sizes split evenly, as torch passes them. The last argument is torch's
    options object or a timeout.
    """
    opts = options("all_to_all_single", args, kwargs)
    if not output.is_cpu:
        return self.other_device(
            "all_to_all_single", output, output, input, output_split_sizes, input_split_sizes, opts
        )
    sizes = (list(output_split_sizes) or None, list(input_split_sizes) or None)
    args = (output, input)
    return self.run_list(build_alltoall_single, "alltoall_single", args, sizes, opts, [output])


def allreduce_coalesced(self: Adapter, tensors: list[Any], *args: Any, **kwargs: Any) -> Any:
    """Reduce each of ``tensors`` across ranks into every rank's, in place, in one bulk call."""
    opts = options("allreduce_coalesced", args, kwargs)
    if tensors and not tensors[0].is_cpu:
        return self.other_device("allreduce_coalesced", tensors[0], tensors, opts)
    op, async_op = reduce_op(opts), opts.asyncOp
    work = bulk.allreduce_tensors(
        self.group, list(tensors), op, timeout=timeout_of(opts), async_op=async_op
    )
    return self.async_work(work, tensors) if async_op else DONE


def allgather_coalesced(
    self: Adapter, output_lists: list[list[Any]], inputs: list[Any], *args: Any, **kwargs: Any
) -> Any:
    """Write rank j's ``inputs[i]`` into ``output_lists[j][i]`` on every rank, an op per input."""
    opts = options("allgather", args, kwargs)
    if len(output_lists) != self.size():
        raise ArgumentValueError(
            f"output_tensor_lists must hold {self.size()} lists (the world size), "
            f"got {len(output_lists)}"
        )
    works = [
        allgather(self, [[outputs[i] for outputs in output_lists]], [x], opts)
        for i, x in enumerate(inputs)
    ]
    return works[-1] if works else DONE


def all_gather_single_coalesced(
    self: Adapter, outputs: list[Any], inputs: list[Any], *args: Any, **kwargs: Any
) -> Any:
    """Run ``all_gather_single`` on each pair of ``outputs`` and ``inputs``, in order."""
    opts = options("allgather", args, kwargs)
    works = [all_gather_single(self, o, i, opts) for o, i in _pairs(outputs, inputs)]
    return works[-1] if works else DONE


def reduce_scatter_single_coalesced(
    self: Adapter, outputs: list[Any], inputs: list[Any], *args: Any, **kwargs: Any
) -> Any:
    """Run ``reduce_scatter_single`` on each pair of ``outputs`` and ``inputs``, in order."""
    opts = options("reduce_scatter_single", args, kwargs)
    works = [reduce_scatter_single(self, o, i, opts) for o, i in _pairs(outputs, inputs)]
    return works[-1] if works else DONE


def _pairs(outputs: list[Any], inputs: list[Any]) -> list[tuple[Any, Any]]:
    """Return ``outputs`` and ``inputs`` paired, or raise if their lengths differ."""
    if len(outputs) != len(inputs):
        raise ArgumentValueError(
            f"the coalesced call needs as many outputs as inputs, got {len(outputs)} "
            f"and {len(inputs)}"
        )
    return list(zip(outputs, inputs, strict=True))
