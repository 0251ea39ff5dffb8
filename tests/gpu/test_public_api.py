"""The public functions on a world-size-1 NCCL group, one GPU, without Ray.

``solo`` is registered in this process under its name, so ``collective.allreduce(x,
name)`` and the ``*_multigpu`` functions reach it through their argument checks, as
they reach any group inside an actor.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import collective as col
from tests.gpu import cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bool(cases.no_gpu_reason()), reason=cases.no_gpu_reason() or "-"),
]


def _needs(kind: str) -> None:
    if kind == "torch" and not cases.torch_cuda():
        pytest.skip("this torch build has no CUDA")


@pytest.mark.parametrize("kind", cases.KINDS)
def test_multigpu_functions_with_one_element_lists(solo: Any, kind: str) -> None:
    _needs(kind)
    name = solo.group_name

    def new(offset: int = 0) -> Any:
        return cases.make(kind, cases.values(0, offset), "float32", 0)

    x = new()
    col.allreduce_multigpu([x], name)
    col.reduce_multigpu([x], 0, 0, name, op=col.ReduceOp.MAX)
    col.broadcast_multigpu([x], 0, 0, name)
    gathered = [[new(9)]]
    col.allgather_multigpu(gathered, [new(1)], name)
    scattered = [new(9)]
    col.reducescatter_multigpu(scattered, [[new(3)]], name)
    col.synchronize(0)
    cases.close(cases.host(x), cases.values(0), "float32", "allreduce, reduce, broadcast")
    cases.close(cases.host(gathered[0][0]), cases.values(0, 1), "float32", "allgather")
    cases.close(cases.host(scattered[0]), cases.values(0, 3), "float32", "reducescatter")
    with pytest.raises(ValueError, match="dst_rank"):
        col.send_multigpu(x, 0, 0, name)
    with pytest.raises(ValueError, match="src_rank"):
        col.recv_multigpu(x, 0, 0, name)


@pytest.mark.parametrize("kind", cases.KINDS)
def test_single_gpu_functions(solo: Any, kind: str) -> None:
    _needs(kind)
    name = solo.group_name

    def new(offset: int = 0) -> Any:
        return cases.make(kind, cases.values(0, offset), "float32", 0)

    x = new()
    col.allreduce(x, name, op="max")
    work = col.allreduce(x, name, async_op=True)
    assert work is not None
    work.wait(cases.WAIT)
    col.reduce(x, 0, name)
    col.broadcast(x, 0, name)
    parts = [new(9)]
    col.allgather(parts, new(1), name)
    flat = new(9)
    col.allgather(flat, new(2), name)
    out = new(9)
    col.reducescatter(out, [new(3)], name)
    gathered = [new(9)]
    col.gather(new(4), gathered, 0, name)
    got = new(9)
    col.scatter(got, [new(5)], 0, name)
    received = [new(9)]
    col.alltoall(received, [new(6)], name)
    col.barrier(name)
    for buffer, offset, what in [
        (x, 0, "allreduce, reduce, broadcast"),
        (parts[0], 1, "allgather into a list"),
        (flat, 2, "allgather into one buffer"),
        (out, 3, "reducescatter"),
        (gathered[0], 4, "gather"),
        (got, 5, "scatter"),
        (received[0], 6, "alltoall"),
    ]:
        np.testing.assert_array_equal(cases.host(buffer), cases.values(0, offset), what)
    with pytest.raises(ValueError, match="dst_rank"):
        col.send(x, 0, name)


@pytest.mark.parametrize("kind", cases.KINDS)
def test_repeated_list_calls_on_the_same_buffers_carry_each_calls_data(
    solo: Any, kind: str
) -> None:
    """A repeated list op runs its launch, found once, on whatever its buffers now hold.

    ``x`` and every output stay the same buffers, so from the second round each call is
    a cached launch; ``x`` gets new values each round from an allgather of a new buffer,
    and every output must show them.
    """
    _needs(kind)
    name = solo.group_name

    def new(offset: int = 0) -> Any:
        return cases.make(kind, cases.values(0, offset), "float32", 0)

    x, flat, out, gathered, got, received = new(9), new(9), new(9), [new(9)], new(9), [new(9)]
    parts = [new(9)]
    for offset in range(4):
        col.allgather([x], new(offset), name)
        col.allgather(parts, x, name)
        col.allgather(flat, x, name)
        col.reducescatter(out, [x], name)
        col.gather(x, gathered, 0, name)
        col.scatter(got, [x], 0, name)
        col.alltoall(received, [x], name)
        work = col.allgather(parts, x, name, async_op=True)
        assert work is not None
        work.wait(cases.WAIT)
        expected = cases.values(0, offset)
        for buffer, what in [
            (x, "allgather of a new buffer"),
            (parts[0], "allgather into a list"),
            (flat, "allgather into one buffer"),
            (out, "reducescatter"),
            (gathered[0], "gather"),
            (got, "scatter"),
            (received[0], "alltoall"),
        ]:
            np.testing.assert_array_equal(cases.host(buffer), expected, f"round {offset}: {what}")


def test_a_negated_view_is_refused_on_every_call_and_the_group_stays_usable(solo: Any) -> None:
    if not cases.torch_cuda():
        pytest.skip("this torch build has no CUDA")
    import torch

    name = solo.group_name
    plain = torch.ones(4, device="cuda")
    negated = torch._neg_view(torch.ones(4, device="cuda"))
    for _ in range(2):  # a buffer of the same key is kept first; the negated one never is
        col.allreduce(plain, name)
        with pytest.raises(ValueError, match=r"tensor has its negative bit set.*resolve_neg"):
            col.allreduce(negated, name)
        col.allreduce_tensors([plain, negated], name)  # staged: torch's copies negate
    col.allreduce(negated.resolve_neg(), name)
    torch.cuda.synchronize()
    assert plain.tolist() == [1.0] * 4
    assert negated.tolist() == [1.0] * 4
