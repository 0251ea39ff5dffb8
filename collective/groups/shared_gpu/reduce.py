"""Reductions on device memory, for the shared-GPU transport.

The shared-memory ``Reducer`` already reduces through numpy's ufuncs, and numpy
hands a ufunc on cupy arrays to cupy (``__array_ufunc__``), which runs it on the
current stream: every dtype cupy has, every reduction, as kernels. bfloat16, which
neither numpy nor cupy has, goes through ``_BF16_KERNELS``: elementwise CUDA kernels
on the raw 16-bit words that widen to float, combine, and round back to nearest even
(NaN stays NaN), as torch rounds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from collective.groups.shm.kernels import Reducer
from collective.types import ReduceOp

_COMBINE = {
    ReduceOp.SUM: "x + y",
    ReduceOp.AVG: "x + y",
    ReduceOp.PRODUCT: "x * y",
    ReduceOp.MIN: "(x < y || x != x) ? x : y",
    ReduceOp.MAX: "(x > y || x != x) ? x : y",
}
"""The float expression of each reduction that bfloat16 takes (min and max keep NaN, as
torch's do)."""

_WIDEN = "__uint_as_float(((unsigned int)a) << 16)"
_ROUND = """
unsigned int u = __float_as_uint(r);
if ((u & 0x7fffffffu) > 0x7f800000u) {
    out = (unsigned short)((u >> 16) | 0x40u);
} else {
    out = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
"""


def _bf16_combine(cupy: Any, op: ReduceOp) -> Callable[[Any, Any, Any], None]:
    """Return a function that writes ``a op b`` into ``out``, three bfloat16 word arrays."""
    body = (
        f"float x = {_WIDEN}; float y = {_WIDEN.replace('a)', 'b)')}; "
        f"float r = {_COMBINE[op]};" + _ROUND
    )
    kernel = cupy.ElementwiseKernel(
        "uint16 a, uint16 b", "uint16 out", body, f"collective_bf16_{op.name.lower()}"
    )

    def combine(a: Any, b: Any, out: Any) -> None:
        kernel(a.view(cupy.uint16), b.view(cupy.uint16), out.view(cupy.uint16))

    return combine


def _bf16_divide(cupy: Any) -> Callable[[Any, int], None]:
    """Return a function that divides a bfloat16 word array by an integer, in place."""
    body = f"float r = {_WIDEN} / (float)n;" + _ROUND
    kernel = cupy.ElementwiseKernel("uint16 a, int32 n", "uint16 out", body, "collective_bf16_div")

    def divide(out: Any, n: int) -> None:
        words = out.view(cupy.uint16)
        kernel(words, n, words)

    return divide


class DeviceReducer(Reducer):
    """A ``Reducer`` whose byte buffers are cupy arrays on the current stream."""

    def __init__(self, op: ReduceOp, dtype: str, world_size: int, cupy: Any) -> None:
        """Reduce by ``op`` on ``dtype`` with ``cupy``; AVG divides by ``world_size``."""
        self._divide: Callable[[Any, int], None] | None = None
        if dtype == "bfloat16":
            if op not in _COMBINE:
                raise ValueError(f"bfloat16 takes sum, product, min, max and avg, got {op.name}")
            super().__init__(op, "int16", world_size)
            self._combine = _bf16_combine(cupy, op)
            self._divide = _bf16_divide(cupy)
        else:
            super().__init__(op, dtype, world_size)

    def finish(self, out: Any) -> None:
        """Complete a reduction in ``out``: divide by the world size for AVG."""
        if self._divide is None:
            super().finish(out)
        elif self.op is ReduceOp.AVG and self._world_size > 1:
            self._divide(out, self._world_size)
