"""torch's option objects in the library's terms: the reduction, the timeout, the root.

Built once, at import of the backend: a call reads its options' fields and indexes these
tables, nothing more.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from torch.distributed import ReduceOp as TorchReduceOp

from collective.types import ArgumentValueError, ReduceOp

_NO_TIMEOUT = timedelta(0)

_TORCH_OPS = TorchReduceOp.RedOpType.__members__

REDUCE_OPS: list[ReduceOp | None] = [None] * (max(v.value for v in _TORCH_OPS.values()) + 1)
"""The library's reduction of each torch ``RedOpType``, by its value; None where it has none."""
for _name, _value in _TORCH_OPS.items():
    REDUCE_OPS[_value.value] = ReduceOp.__members__.get(_name)


def reduce_op(opts: Any) -> ReduceOp:
    """Return the library's reduction of ``opts.reduceOp``.

    Raises:
        ArgumentValueError: it is one the backend lacks (``PREMUL_SUM``, which Gloo lacks too).

    """
    torch_op = opts.reduceOp.op
    found = REDUCE_OPS[torch_op.value]
    if found is None:
        raise ArgumentValueError(
            f"the collective backend does not support ReduceOp.{torch_op.name}; supported: "
            + ", ".join(op.name for op in ReduceOp)
        )
    return found


def timeout_of(opts: Any) -> timedelta | None:
    """Return the timeout ``opts`` sets for one call, or None for the group's own.

    torch marks an unset timeout with a negative one.
    """
    timeout = opts.timeout
    return timeout if timeout > _NO_TIMEOUT else None


def wait_timeout(timeout: timedelta | None) -> timedelta | None:
    """Return the limit of a torch ``Work.wait(timeout)``: None for torch's "no timeout" (0)."""
    if timeout is None or timeout <= _NO_TIMEOUT:
        return None
    return timeout
