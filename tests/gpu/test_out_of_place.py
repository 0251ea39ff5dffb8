"""Out-of-place ops on one GPU, into guarded buffers, so that a wrong count, dtype or offset shows.

At world size 1 an in-place allreduce, reduce or broadcast leaves its buffer as it
was, whatever count, dtype or reduction reached NCCL; the contract tests
(``tests/test_nccl_contract*.py``) check those arguments without a GPU. Here the ops
that write one buffer from another run through the public functions: allgather
(into a list and into one buffer), reducescatter, gather, scatter, alltoall,
alltoall_single, and the multigpu forms with lists of one. The source and the
destination are views into the middle of larger buffers whose ends hold sentinels,
and the destination starts filled with a third value: a count or element size too
large overwrites a sentinel, one too small leaves the fill, and an address without
the view's offset writes the head.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import collective as col
from tests.gpu import cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bool(cases.no_gpu_reason()), reason=cases.no_gpu_reason() or "-"),
]

N = 96
"""Elements of each source and destination view."""
PAD = 8 * N
"""Elements of sentinel on each side of a view."""
VALUES = (np.arange(N) % 100 + 1).astype(np.float64)
"""The source's elements: 1 to 100, exact in every dtype, and none of them a sentinel."""
FILL, OUT_GUARD, SOURCE_GUARD = 111.0, 122.0, 117.0

OPS: dict[str, Callable[[Any, Any, str], object]] = {
    "allgather": lambda out, x, name: col.allgather([out], x, name),
    "allgather_flat": lambda out, x, name: col.allgather(out, x, name),
    "reducescatter": lambda out, x, name: col.reducescatter(out, [x], name),
    "gather": lambda out, x, name: col.gather(x, [out], 0, name),
    "scatter": lambda out, x, name: col.scatter(out, [x], 0, name),
    "alltoall": lambda out, x, name: col.alltoall([out], [x], name),
    "alltoall_single": lambda out, x, name: col.alltoall_single(out, x, group_name=name),
    "allgather_multigpu": lambda out, x, name: col.allgather_multigpu([[out]], [x], name),
    "reducescatter_multigpu": lambda out, x, name: col.reducescatter_multigpu([out], [[x]], name),
}


def guarded(kind: str, dtype: str, middle: float | np.ndarray, guard: float) -> tuple[Any, Any]:
    """Return a buffer of ``guard`` with ``middle`` in elements PAD to PAD + N, and that view."""
    whole = np.full(N + 2 * PAD, guard)
    whole[PAD : PAD + N] = middle
    buffer = cases.make(kind, whole, dtype, 0)
    return buffer, buffer[PAD : PAD + N]


def assert_holds(buffer: Any, middle: np.ndarray, guard: float, what: str) -> None:
    """Assert that ``buffer`` holds ``middle`` in its view and ``guard`` on both sides."""
    got = cases.host(buffer)
    np.testing.assert_array_equal(got[PAD : PAD + N], middle, err_msg=f"{what}: the view")
    np.testing.assert_array_equal(got[:PAD], guard, err_msg=f"{what}: before the view")
    np.testing.assert_array_equal(got[PAD + N :], guard, err_msg=f"{what}: after the view")


def cases_of_ops() -> list[tuple[str, str, str]]:
    kinds_dtypes = {(kind, dtype) for _, kind, dtype in cases.op_cases()}
    return [(op, kind, dtype) for op in OPS for kind, dtype in sorted(kinds_dtypes)]


@pytest.mark.parametrize(("op", "kind", "dtype"), cases_of_ops())
def test_an_out_of_place_op_writes_exactly_its_view(
    solo: Any, op: str, kind: str, dtype: str
) -> None:
    if kind == "torch" and not cases.torch_cuda():
        pytest.skip("this torch build has no CUDA")
    source, x = guarded(kind, dtype, VALUES, SOURCE_GUARD)
    out_buffer, out = guarded(kind, dtype, FILL, OUT_GUARD)
    OPS[op](out, x, solo.group_name)
    assert_holds(out_buffer, VALUES, OUT_GUARD, f"{op} {kind} {dtype}: the output")
    assert_holds(source, VALUES, SOURCE_GUARD, f"{op} {kind} {dtype}: the input")
