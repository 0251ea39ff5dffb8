"""Bool reductions on CPU groups: SUM and MAX are OR, PRODUCT and MIN are AND, bytes 0 and 1 only.

Every reduction in allreduce, reduce and reducescatter, on both sides of the
small-message limit (the Gloo agreement's records), over Gloo (tcp), shared memory
(shm) and two faked nodes. A result is compared byte for byte: a bool tensor that
holds byte 2 reads as True, so only its bytes show that it was added, not ORed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from collective.groups.base import BaseGroup
from collective.groups.gloo.agree import capacity
from collective.types import (
    AllReduceOptions,
    ArgumentTypeError,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
)
from tests.test_gloo_group import run_ranks, transport  # noqa: F401  (autouse: tcp and shm)
from tests.test_shm import run_cpu

BOOL_OPS = [op for op in ReduceOp if op is not ReduceOp.AVG]

_LOGICAL = {
    ReduceOp.SUM: np.logical_or,
    ReduceOp.MAX: np.logical_or,
    ReduceOp.BOR: np.logical_or,
    ReduceOp.PRODUCT: np.logical_and,
    ReduceOp.MIN: np.logical_and,
    ReduceOp.BAND: np.logical_and,
    ReduceOp.BXOR: np.logical_xor,
}


def _counts(world_size: int) -> list[int]:
    """Return a count that rides in the agreement's records and one well above the limit."""
    return [capacity(world_size) // 2, 4 * capacity(world_size) + 3]


def _mask(rank: int, count: int, offset: int = 0) -> np.ndarray:
    """Return rank's bool input: bit ``rank`` of each index, so every combination occurs."""
    return ((np.arange(count) + offset) >> rank) & 1 == 1


def _expected(world_size: int, op: ReduceOp, count: int, offset: int = 0) -> bytes:
    stack = np.stack([_mask(r, count, offset) for r in range(world_size)])
    return _LOGICAL[op].reduce(stack, axis=0).astype(np.uint8).tobytes()


def _bytes(x: torch.Tensor) -> bytes:
    return x.view(torch.uint8).numpy().tobytes()


def _reduce_all(group: BaseGroup, rank: int) -> dict[tuple[str, ReduceOp, int], bytes]:
    """Run every bool reduction of every op at both counts; return each result's bytes."""
    n = group.world_size
    out: dict[tuple[str, ReduceOp, int], bytes] = {}
    for count in _counts(n):
        for op in BOOL_OPS:
            x = torch.from_numpy(_mask(rank, count))
            group.allreduce([x], AllReduceOptions(op))
            out["allreduce", op, count] = _bytes(x)
            x = torch.from_numpy(_mask(rank, count))
            group.reduce([x], ReduceOptions(reduce_op=op, root_rank=n - 1))
            out["reduce", op, count] = _bytes(x)
            output = torch.zeros(count, dtype=torch.bool)
            inputs = [torch.from_numpy(_mask(rank, count, offset=j)) for j in range(n)]
            group.reducescatter([output], [inputs], ReduceScatterOptions(reduce_op=op))
            out["reducescatter", op, count] = _bytes(output)
    return out


def _check(results: list[dict[tuple[str, ReduceOp, int], bytes]]) -> None:
    n = len(results)
    for count in _counts(n):
        for op in BOOL_OPS:
            expected = _expected(n, op, count)
            for rank, result in enumerate(results):
                what = f"{op.name} on {count} bools, rank {rank} of {n}"
                assert result["allreduce", op, count] == expected, f"allreduce {what}"
                mine = _mask(rank, count).astype(np.uint8).tobytes()
                root = expected if rank == n - 1 else mine
                assert result["reduce", op, count] == root, f"reduce {what}"
                chunk = _expected(n, op, count, offset=rank)
                assert result["reducescatter", op, count] == chunk, f"reducescatter {what}"


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_bool_reduction_is_logical_on_both_sides_of_the_limit(world_size: int) -> None:
    _check(run_ranks(world_size, _reduce_all))


@pytest.mark.parametrize("nodes", [["a", "b"], ["a", "a", "b", "b"]])
def test_every_bool_reduction_is_logical_across_nodes(nodes: list[str]) -> None:
    _check(run_cpu(len(nodes), _reduce_all, nodes=nodes))


def test_a_mask_summed_in_place_again_and_again_stays_true() -> None:
    """An all-True mask above the limit, reduced by SUM in place 8 times at 2 ranks."""

    def fn(group: BaseGroup, rank: int) -> set[int]:
        x = torch.ones(4 * capacity(2), dtype=torch.bool)
        for _ in range(8):
            group.allreduce([x], AllReduceOptions(ReduceOp.SUM))
        return set(x.view(torch.uint8).tolist())

    assert run_ranks(2, fn) == [{1}, {1}]


def test_avg_on_bool_is_an_argument_error_naming_the_dtype() -> None:
    def fn(group: BaseGroup, rank: int) -> str:
        with pytest.raises(ArgumentTypeError, match="AVG does not take bool") as caught:
            group.check_reduce_op(ReduceOp.AVG, "bool")
        return str(caught.value)

    run_ranks(1, fn)
