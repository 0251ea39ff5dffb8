"""NCCLGroup's stream semantics on one GPU: ordering, async handles, frees, timeouts, errors.

Each test keeps the GPU busy on the caller's current stream (torch's ``_sleep``) before
and around the op, so that an op that ignored the caller's stream, or a result read
before the op finished, would show wrong values rather than pass by luck.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import numpy as np
import pytest

from collective.types import AllGatherOptions, AllReduceOptions
from tests.gpu import cases, faults

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bool(cases.no_gpu_reason()), reason=cases.no_gpu_reason() or "-"),
    pytest.mark.skipif(
        not cases.no_gpu_reason() and not cases.torch_cuda(),
        reason="these tests keep the GPU busy with torch.cuda._sleep; this torch has no CUDA",
    ),
]

BUSY_CYCLES = 100_000_000
"""GPU clock cycles to spin: tens of milliseconds, far longer than the ops under test."""
N = 1 << 22


def side_stream(kind: str) -> Any:
    """Return a new non-default stream of ``kind`` on GPU 0, usable as a context manager."""
    if kind == "cupy":
        import cupy

        with cupy.cuda.Device(0):
            return cupy.cuda.Stream(non_blocking=True)
    import torch

    return torch.cuda.stream(torch.cuda.Stream(device=0))


def busy(kind: str, cycles: int = BUSY_CYCLES) -> None:
    """Keep the caller's current stream of ``kind`` busy for ``cycles`` GPU clock cycles."""
    import torch

    if kind == "torch":
        torch.cuda._sleep(cycles)
        return
    import cupy

    current = torch.cuda.ExternalStream(cupy.cuda.get_current_stream().ptr, device=0)
    with torch.cuda.stream(current):
        torch.cuda._sleep(cycles)


def full(kind: str, value: float) -> Any:
    """Return a new float32 buffer of N ``value`` on GPU 0, made on the current stream."""
    if kind == "cupy":
        import cupy

        return cupy.full(N, value, dtype=cupy.float32)
    import torch

    return torch.full((N,), value, dtype=torch.float32, device="cuda:0")


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("kind", cases.KINDS)
def test_an_op_follows_and_precedes_work_on_the_callers_stream(
    solo: Any, kind: str, async_op: bool
) -> None:
    with side_stream(kind):
        source = full(kind, 3.0)
        busy(kind)
        source *= 2  # 6.0, but only once the busy kernel is done
        out = full(kind, 0.0)
        work = solo.allgather([[out]], [source], AllGatherOptions(async_op=async_op))
        if async_op:
            work.wait(cases.WAIT)
        after = out + 1  # queued on the caller's stream: must see the gathered 6.0
        got = cases.host(after)
    np.testing.assert_array_equal(got, np.full(N, 7.0))


@pytest.mark.parametrize("kind", cases.KINDS)
def test_is_completed_polls_an_async_op_without_blocking(solo: Any, kind: str) -> None:
    with side_stream(kind):
        x = full(kind, 2.0)
        busy(kind)
        work = solo.allreduce([x], AllReduceOptions(async_op=True))
        pending = work.is_completed()
        work.wait(cases.WAIT)
        got = cases.host(x)
    assert pending is False, "the op cannot have finished while the GPU was busy before it"
    assert work.is_completed() is True
    assert work.exception() is None
    np.testing.assert_array_equal(got, np.full(N, 2.0))


@pytest.mark.parametrize("kind", cases.KINDS)
def test_inputs_freed_right_after_an_async_call_are_not_reused_early(solo: Any, kind: str) -> None:
    with side_stream(kind):
        busy(kind)
        source = full(kind, 5.0)
        out = full(kind, 0.0)
        work = solo.allgather([[out]], [source], AllGatherOptions(async_op=True))
        del source
        garbage = full(kind, -1.0)  # may take the freed block if the group did not hold it
        work.wait(cases.WAIT)
        got = cases.host(out)
        del garbage
    np.testing.assert_array_equal(got, np.full(N, 5.0))


def test_a_timed_out_wait_raises_and_leaves_the_group_unusable() -> None:
    """In a rank process of its own, as the timeout aborts communicators with work queued."""
    from benchmarks.nccl_ranks import RankPool

    with RankPool(1, timeout=timedelta(seconds=120)) as pool:
        error, message, broken, refusal = pool.run(cases.time_out_on_rank, BUSY_CYCLES * 20)[0]
    assert error == "CollectiveTimeoutError", message
    assert "allreduce" in message
    assert broken
    assert "unusable" in refusal


def test_a_torch_tensor_freed_after_its_group_is_destroyed_is_freed_cleanly() -> None:
    """In a rank process of its own: torch records on the comm stream when the block is freed."""
    from benchmarks.nccl_ranks import RankPool

    with RankPool(1, timeout=timedelta(seconds=120)) as pool:
        trouble = pool.run(faults.free_after_destroy_on_rank)[0]
    assert trouble == []


def test_a_device_side_error_fails_the_wait_at_once_not_after_its_timeout() -> None:
    """In a rank process of its own, as the error ruins the process's CUDA context."""
    from benchmarks.nccl_ranks import RankPool

    with RankPool(1, timeout=timedelta(seconds=120)) as pool:
        error, message, took, broken = pool.run(faults.device_error_on_rank, BUSY_CYCLES * 10)[0]
    assert error == "CollectiveError", message
    assert took < 30, f"the wait took {took:.1f} s of its 60 s: {message}"
    assert broken
