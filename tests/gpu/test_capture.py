"""The public ops captured in one CUDA graph through ``torch.cuda.graph``, then replayed.

allreduce, broadcast, reduce, allgather, reducescatter, send/recv and
``allreduce_tensors`` on torch CUDA tensors, called through the public functions
after a warm-up outside capture. Every replay on new inputs must leave every rank's
outputs right: the captured calls read the inputs' memory, not values frozen at
capture. World size 1 in one rank process, and 2 as two rank processes (sharing the
GPU, each claiming a host of its own, where there is one GPU).
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest

from tests.gpu import capture, cases

pytestmark = cases.torch_gpu_marks()

REPLAYS = 3


@pytest.mark.parametrize("world_size", [1, 2], ids=["ws1", "ws2"])
def test_the_public_ops_captured_in_one_graph_replay_right_on_new_inputs(world_size: int) -> None:
    from benchmarks.nccl_ranks import RankPool

    with RankPool(world_size, timeout=timedelta(seconds=120)) as pool:
        pool.run(cases.open_group, f"gpu-capture-{uuid.uuid4().hex[:8]}")
        seen = pool.run(capture.capture_public_ops_on_rank, REPLAYS)
    for rank in range(world_size):
        for k in range(REPLAYS):
            want = capture.expected(rank, world_size, k)
            names = [op for op in capture.OPS if world_size > 1 or op != "send/recv"]
            for op, got, expect in zip(names, seen[rank][k], want, strict=True):
                assert got == expect, f"rank {rank}, replay {k}, {op}: {got} != {expect}"


def test_a_bulk_call_never_made_outside_capture_raises_during_capture() -> None:
    from benchmarks.nccl_ranks import RankPool

    with RankPool(1, timeout=timedelta(seconds=120)) as pool:
        pool.run(cases.open_group, f"gpu-capture-{uuid.uuid4().hex[:8]}")
        ((error, message),) = pool.run(capture.capture_unseen_bulk_call_on_rank)
    assert error == "CollectiveError", (error, message)
    assert "make the same call once before capturing it" in message, message
