"""all_reduce of a sparse COO tensor: the sum of every rank's, written into each rank's tensor.

As torch's Gloo does on a CPU, and with its one reduction, SUM. The ranks first gather
how many elements each holds, then every rank's indices and values (padded to the
largest count) through the group's allgather, and each rank sums them. Ranks whose
tensors differ in their number of sparse or dense dimensions, or in their dtypes,
disagree in those allgathers, which raise on every rank before anything is written.
"""

from __future__ import annotations

from typing import Any

import torch

from collective.ops import list_calls
from collective.torch_backend.adapter import Adapter
from collective.torch_backend.options import reduce_op
from collective.torch_backend.work import DONE
from collective.types import ArgumentValueError, ReduceOp


def all_reduce(self: Adapter, tensor: torch.Tensor, opts: Any) -> Any:
    """Sum every rank's sparse ``tensor`` into each rank's, in place; return ``DONE``.

    It has finished when it returns, with or without ``async_op``.

    Raises:
        ArgumentValueError: the reduction is not SUM, or the layout is not COO.

    """
    if reduce_op(opts) is not ReduceOp.SUM or tensor.layout is not torch.sparse_coo:
        raise ArgumentValueError(
            "all_reduce of a sparse tensor takes a sparse COO tensor and ReduceOp.SUM, as "
            f"Gloo does; got a {tensor.layout} tensor and {opts.reduceOp.op.name}"
        )
    local = tensor.coalesce()
    indices, values = local.indices(), local.values()
    n = self.size()
    counts = torch.zeros(n, dtype=torch.int64)
    _allgather(self, counts, torch.tensor([indices.shape[1]], dtype=torch.int64))
    most = int(counts.max())
    padded_indices = torch.zeros(indices.shape[0], most, dtype=torch.int64)
    padded_indices[:, : indices.shape[1]] = indices
    padded_values = torch.zeros((most, *values.shape[1:]), dtype=values.dtype)
    padded_values[: values.shape[0]] = values
    every_index = torch.zeros((n, *padded_indices.shape), dtype=torch.int64)
    every_value = torch.zeros((n, *padded_values.shape), dtype=values.dtype)
    _allgather(self, every_index, padded_indices)
    _allgather(self, every_value, padded_values)
    counted = [int(c) for c in counts]
    summed = torch.sparse_coo_tensor(
        torch.cat([every_index[r][:, :c] for r, c in enumerate(counted)], dim=1),
        torch.cat([every_value[r][:c] for r, c in enumerate(counted)]),
        tensor.shape,
    ).coalesce()
    tensor.copy_(summed)
    return DONE


def _allgather(self: Adapter, output: torch.Tensor, tensor: torch.Tensor) -> None:
    """Gather every rank's ``tensor`` into the rows of ``output``, on the group."""
    list_calls.call(
        list_calls.build_allgather, self.group, "allgather", (output, tensor), (), None, False
    )
