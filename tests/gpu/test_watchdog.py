"""The watchdog, the mismatch check and CUDA-graph capture on a GPU, at world sizes 2 and 3.

A blocking op whose peer never calls leaves the caller's ``torch.cuda.synchronize``
hanging until the watchdog aborts the group's communicators, within the timeout
plus a few seconds, and the next call raises ``CollectiveTimeoutError`` naming the
rank that never issued the op. Ranks that
allreduce different counts both raise a ``CollectiveError`` naming the shape. An
allreduce captured in a CUDA graph replays right on changing inputs. A group with
``check_args`` raises the same argument error on every rank for a mismatched call. The ranks are
processes on a torch TCPStore, sharing GPUs where there are fewer than ranks.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from tests.gpu import cases, hangs

pytestmark = cases.torch_gpu_marks()

TIMEOUT_S = 5.0
SLACK_S = 10.0


@contextmanager
def _pool(timeout_s: float | None = None, world_size: int = 2) -> Iterator[Any]:
    """Yield ``world_size`` rank processes, each in one new NCCLGroup of timeout ``timeout_s``."""
    from benchmarks.nccl_ranks import RankPool

    with RankPool(world_size, timeout=timedelta(seconds=120)) as pool:
        pool.run(cases.open_group, f"gpu-watch-{uuid.uuid4().hex[:8]}", timeout_s)
        yield pool


def test_a_peer_that_never_calls_ends_at_the_timeout_and_breaks_the_group() -> None:
    with _pool(TIMEOUT_S) as pool:
        results = pool.run(hangs.stall_on_rank, 1, timeout=timedelta(seconds=120))
    took, error, message = results[0]
    assert TIMEOUT_S - 1 <= took < TIMEOUT_S + SLACK_S, f"synchronize took {took:.1f} s"
    assert error == "CollectiveTimeoutError", message
    assert "allreduce" in message and "gpu-watch-" in message
    assert "ranks that never joined it: [1] (rank 1 has issued 1 ops, the last allreduce)" in (
        message
    )


def test_at_three_ranks_both_ranks_left_waiting_name_the_one_that_never_called() -> None:
    """Ranks 0 and 2 time out together; each names rank 1, or raises the other's report."""
    with _pool(TIMEOUT_S, world_size=3) as pool:
        results = pool.run(hangs.stall_on_rank, 1, timeout=timedelta(seconds=120))
    for rank in (0, 2):
        took, error, message = results[rank]
        assert took < TIMEOUT_S + SLACK_S, f"rank {rank}: synchronize took {took:.1f} s"
        named = "ranks that never joined it: [1] (rank 1 has issued 1 ops" in message
        told = error == "CollectiveError" and "reported" in message
        assert (error == "CollectiveTimeoutError" and named) or told, (rank, error, message)
    assert any("never joined it: [1]" in message for _, _, message in (results[0], results[2]))


def test_ranks_that_allreduce_different_counts_both_raise() -> None:
    with _pool(30.0) as pool:
        results = pool.run(hangs.mismatch_on_rank, timeout=timedelta(seconds=120))
    for rank, (error, message) in enumerate(results):
        assert error == "CollectiveError", f"rank {rank}: {error} {message}"
        assert "different ops or arguments" in message and "shape" in message, message


def test_a_captured_allreduce_replays_right_on_changing_inputs() -> None:
    with _pool() as pool:
        seen = pool.run(hangs.capture_on_rank, 3, timeout=timedelta(seconds=120))
    want = hangs.expected_replays(2, 3)
    assert seen == [want, want]


def test_check_args_on_nccl_raises_the_same_argument_error_on_every_rank() -> None:
    with _pool(30.0) as pool:
        results = pool.run(hangs.checked_on_rank, timeout=timedelta(seconds=120))
    for rank, out in enumerate(results):
        (error, message), (_, before), (matched, _), (_, summed), (barrier, _) = out[:5]
        assert error == "ArgumentValueError", f"rank {rank}: {error} {message}"
        assert "different arguments" in message and "shape" in message, message
        assert before == str([1.0] * (8 + rank)), "the mismatched allreduce wrote"
        assert matched == "" and summed == str([3.0] * 4), (rank, out)
        assert barrier == "", (rank, out)
        sent = out[5]
        assert sent[0] == "ArgumentValueError" and "different arguments" in sent[1], sent
    assert results[1][6] == ("values", str([0.0] * 4)), "the mismatched recv wrote"


def test_a_watched_replay_whose_peer_never_replays_ends_at_the_timeout() -> None:
    with _pool(60.0) as pool:
        results = pool.run(
            hangs.watched_replay_on_rank, 1, TIMEOUT_S, timeout=timedelta(seconds=120)
        )
    took, message = results[0]
    assert TIMEOUT_S - 1 <= took < TIMEOUT_S + SLACK_S, f"synchronize took {took:.1f} s"
    assert "CUDA graph replay" in message, message
