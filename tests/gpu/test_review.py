"""The GPU review's NCCL findings (``../shared/GPU-REVIEW.md``), as a real GPU runs them.

``tests/gpu/run.sh`` runs these first, so that the first GPU settles them: H1 (200
blocking 64 MiB allreduces with no sync keep the group), H3 (a fresh group where rank 0
allreduces and rank 1 sends, and a first gather whose peer never calls, end within
their timeout), M4 (60 s of matmul + allreduce with no sync and no check, a 10 s
timeout: no false timeout), M1 (a capture that starts while the group's op is pending
is never invalidated), L2 (an async op in a capture is refused) and M2 (two GPUs on
their default streams; needs two GPUs). Rank processes on a torch TCPStore, no Ray;
where there are fewer GPUs than ranks, they share them (``cases.claim_own_host``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest

from tests.gpu import cases, review

pytestmark = cases.torch_gpu_marks()

SLACK_S = 10.0
"""How much later than its timeout an error may come (loaded machine, shared GPU)."""

JOB = timedelta(seconds=300)


@contextmanager
def _pool(timeout_s: float | None = None, world_size: int = 2) -> Iterator[Any]:
    """Yield ``world_size`` rank processes, each in one new NCCLGroup of timeout ``timeout_s``."""
    from benchmarks.nccl_ranks import RankPool

    with RankPool(world_size, timeout=JOB) as pool:
        pool.run(cases.open_group, f"gpu-review-{uuid.uuid4().hex[:8]}", timeout_s)
        yield pool


@pytest.mark.timeout(300)
def test_h1_200_blocking_64_mib_allreduces_without_a_sync_keep_the_group() -> None:
    """H1: before the fix, the 65th op found the check's ring full and broke the group."""
    with _pool() as pool:
        results = pool.run(review.blocking_loop_on_rank, 200, 64 << 20, timeout=JOB)
    for rank, (error, value) in enumerate(results):
        assert error == "", f"rank {rank}: {error}"
        assert value == 2.0, f"rank {rank} holds {value}"


def test_h3_a_fresh_group_whose_ranks_call_allreduce_and_send_ends_at_the_timeout() -> None:
    """H3: neither rank may block inside NCCL past its 5 s timeout."""
    with _pool(timeout_s=5.0) as pool:
        results = pool.run(review.first_ops_differ_on_rank, 5.0, timeout=JOB)
    for rank, (took, error, message) in enumerate(results):
        assert error in ("CollectiveTimeoutError", "CollectiveError"), (rank, error, message)
        assert took < 5.0 + SLACK_S, f"rank {rank} took {took:.1f} s"


def test_h3_a_first_gather_whose_peer_never_calls_ends_at_the_timeout() -> None:
    """H3: the gather's receives are the ranks' first send/recv: NCCL connects them."""
    with _pool(timeout_s=5.0) as pool:
        took, error, message = pool.run(review.first_gather_without_peer_on_rank, 5.0, timeout=JOB)[
            0
        ]
    assert error == "CollectiveTimeoutError", message
    assert "rank 1" in message and took < 5.0 + SLACK_S, (took, message)


@pytest.mark.timeout(300)
def test_m4_a_minute_of_matmul_and_allreduce_without_a_sync_is_no_timeout() -> None:
    """M4: the stream is never idle for a minute, each op finishes in far less than 10 s."""
    from benchmarks.nccl_ranks import RankPool

    name = f"gpu-review-m4-{uuid.uuid4().hex[:8]}"
    with RankPool(2, timeout=JOB) as pool:
        results = pool.run(review.busy_stream_on_rank, 60.0, name, timeout=JOB)
    for rank, (error, issued) in enumerate(results):
        assert error == "", f"rank {rank} after {issued} iterations: {error}"
        assert issued > 100, f"rank {rank} issued only {issued} iterations"


def test_m1_a_capture_started_while_an_op_is_pending_is_never_invalidated() -> None:
    """M1: ``torch.cuda.graph`` (global capture mode) and the watchdog's queries."""
    with _pool() as pool:
        results = pool.run(review.capture_while_pending_on_rank, timeout=JOB)
    for rank, (error, seen) in enumerate(results):
        assert error == "", f"rank {rank}: {error}"
        assert seen == [3.0, 5.0], f"rank {rank}: the replays wrote {seen}"


def test_l2_an_async_op_inside_a_capture_is_refused_and_the_group_lives_on() -> None:
    with _pool() as pool:
        results = pool.run(review.async_in_capture_on_rank, timeout=JOB)
    for rank, (refusal, after) in enumerate(results):
        assert "async_op=True cannot be captured" in refusal, (rank, refusal)
        assert after == "", (rank, after)


@pytest.mark.skipif(cases.gpu_count() < 2, reason="M2 needs two GPUs in one process")
def test_m2_two_gpus_on_their_default_streams_with_the_first_current() -> None:
    from benchmarks.nccl_ranks import RankPool

    with RankPool(1, timeout=JOB) as pool:
        error, values = pool.run(review.default_streams_two_gpus_on_rank, timeout=JOB)[0]
    assert error == "" and values == [3.0, 3.0], (error, values)
