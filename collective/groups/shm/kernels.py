"""Elementwise reductions over raw bytes, for the shared-memory algorithms.

The algorithms move bytes; only a reduction needs to know the dtype. numpy's
ufuncs reduce every dtype numpy has (they release the GIL and cost about a
microsecond a call, a third of a torch op's cost); bfloat16, which numpy lacks,
goes through torch on the same memory. Every rank applies the same ufuncs in
the same order to the same bytes, so every rank's result is bit for bit the same.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from collective.types import ReduceOp

warnings.filterwarnings(
    "ignore",
    category=RuntimeWarning,
    module=r"collective\.groups\.shm\.",
    message=".*encountered in",
)
"""A float reduction that overflows gives inf, as gloo's does, without numpy's warning
(here and in ``short``, which calls the same ufuncs)."""

UFUNCS: dict[ReduceOp, Any] = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}
"""numpy's ufunc of each reduction; on bool, add is OR and multiply is AND, as in gloo."""

_TORCH_OPS = {
    ReduceOp.SUM: "add",
    ReduceOp.AVG: "add",
    ReduceOp.PRODUCT: "mul",
    ReduceOp.MIN: "minimum",
    ReduceOp.MAX: "maximum",
}
"""torch's function of each reduction that bfloat16 takes."""


def numpy_dtype(dtype: str) -> np.dtype:
    """Return the numpy dtype that holds ``dtype``'s bytes (int16 for bfloat16)."""
    return np.dtype(np.int16) if dtype == "bfloat16" else np.dtype(dtype)


class Reducer:
    """Combine byte buffers elementwise by one ``ReduceOp`` on one dtype."""

    def __init__(self, op: ReduceOp, dtype: str, world_size: int) -> None:
        """Reduce by ``op`` on ``dtype``; AVG divides by ``world_size`` in ``finish``."""
        self.op = op
        self.dtype = numpy_dtype(dtype)
        self.itemsize = self.dtype.itemsize
        self._world_size = world_size
        self._combine: Callable[[np.ndarray, np.ndarray, np.ndarray], Any]
        if dtype == "bfloat16":
            self._combine = self._torch_combine(op)
        else:
            ufunc = UFUNCS[op]
            typed = self.dtype
            self._combine = lambda a, b, out: ufunc(
                a.view(typed), b.view(typed), out=out.view(typed)
            )
        self._bfloat16 = dtype == "bfloat16"

    @staticmethod
    def _torch_combine(op: ReduceOp) -> Callable[[np.ndarray, np.ndarray, np.ndarray], Any]:
        import torch

        function = getattr(torch, _TORCH_OPS[op])

        def combine(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
            view = [torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) for x in (a, b, out)]
            function(view[0], view[1], out=view[2])

        return combine

    def __call__(self, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        """Write ``a`` op ``b`` into ``out``; all three are byte arrays of one length.

        ``out`` may be ``a`` or ``b``.
        """
        self._combine(a, b, out)

    def fold(self, parts: list[np.ndarray], out: np.ndarray) -> None:
        """Reduce the two or more ``parts`` in their order into ``out``, then ``finish`` it.

        Every rank that folds the same parts gets the same bits.
        """
        self._combine(parts[0], parts[1], out)
        for contribution in parts[2:]:
            self._combine(out, contribution, out)
        self.finish(out)

    def finish(self, out: np.ndarray) -> None:
        """Complete a reduction in ``out``: divide by the world size for AVG."""
        if self.op is not ReduceOp.AVG or self._world_size == 1:
            return
        if self._bfloat16:
            import torch

            torch.from_numpy(out.view(np.int16)).view(torch.bfloat16).div_(self._world_size)
        else:
            typed = out.view(self.dtype)
            np.divide(typed, self._world_size, out=typed)
