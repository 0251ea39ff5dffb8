"""torch's other ways to call a process group's op, turned into the one the backend runs.

Besides ``pg.allreduce(tensors, opts)``, which ``torch.distributed`` and DDP's C++ use,
torch's ``ProcessGroup`` takes convenience forms that programs and communication hooks
call: ``pg.allreduce(tensor)``, ``pg.allreduce([t], op=ReduceOp.MAX)``,
``pg.broadcast(tensor, root)``, ``pg.reduce_scatter(output, inputs, op)``,
``pg.barrier(timeout=...)``. ``options`` makes torch's options object of such a call,
with its fields in the order each form takes them; ``listed`` makes a lone tensor the
list the op takes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._C import _distributed_c10d

dist: Any = _distributed_c10d  # where torch defines every options class

FIELDS: dict[str, tuple[type, tuple[str, ...]]] = {
    "allreduce": (dist.AllreduceOptions, ("reduceOp", "timeout")),
    "allreduce_coalesced": (dist.AllreduceCoalescedOptions, ("reduceOp", "timeout")),
    "broadcast": (dist.BroadcastOptions, ("rootRank", "timeout")),
    "reduce": (dist.ReduceOptions, ("rootRank", "reduceOp", "timeout")),
    "allgather": (dist.AllgatherOptions, ("timeout",)),
    "reduce_scatter": (dist.ReduceScatterOptions, ("reduceOp", "timeout")),
    "reduce_scatter_single": (dist.ReduceScatterOptions, ("reduceOp", "timeout")),
    "gather": (dist.GatherOptions, ("rootRank", "timeout")),
    "scatter": (dist.ScatterOptions, ("rootRank", "timeout")),
    "alltoall": (dist.AllToAllOptions, ("timeout",)),
    "all_to_all_single": (dist.AllToAllOptions, ("timeout",)),
    "barrier": (dist.BarrierOptions, ("timeout",)),
}
"""Each op's options class, and the fields its convenience form takes, in order."""

_KEYWORDS = {"op": "reduceOp", "root": "rootRank"}
"""The keyword of each field in the convenience forms, where it differs from the field."""


def options(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Return the options object of a call of ``op`` whose arguments after the tensors are given.

    ``args`` (or ``kwargs``, as ``opts=``) is either torch's options object alone, or
    the convenience form's fields.

    Raises:
        TypeError: an argument the form does not take.

    """
    cls, fields = FIELDS[op]
    if len(args) == 1 and not kwargs and isinstance(args[0], cls):
        return args[0]
    if not args and list(kwargs) == ["opts"] and isinstance(kwargs["opts"], cls):
        return kwargs["opts"]
    if len(args) > len(fields):
        raise TypeError(f"{op}() takes at most {len(fields)} arguments after the tensors")
    opts = cls()
    values = dict(zip(fields, args, strict=False))
    for key, value in kwargs.items():
        field = _KEYWORDS.get(key, key)
        if field not in fields or field in values:
            raise TypeError(f"{op}() got an unexpected or repeated argument {key!r}")
        values[field] = value
    for field, value in values.items():
        if value is not None:
            setattr(opts, field, value)
    return opts


def listed(tensors: Any) -> list[Any]:
    """Return ``tensors`` as a list: a lone tensor becomes a list of one."""
    return [tensors] if isinstance(tensors, torch.Tensor) else tensors
