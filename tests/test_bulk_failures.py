"""The bulk calls when used roughly: two threads on one group, a wait that runs out, odd keys.

Ranks are threads on a TCPStore, on each CPU path (see ``test_bulk.run``).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch

from collective.bulk import calls
from collective.groups.base import BaseGroup
from collective.types import (
    AllReduceOptions,
    ArgumentValueError,
    CollectiveError,
    CollectiveTimeoutError,
)
from collective.work import Work
from tests.test_bulk import run, transport  # noqa: F401  (the fixture of the three CPU paths)
from tests.test_shm import run_cpu

# --- one bulk call at a time ----------------------------------------------------------------


def _first(rank: int) -> list[torch.Tensor]:
    """Six float32 tensors of 100: many buckets of 256 bytes."""
    return [torch.full((100,), float(10 * rank + i)) for i in range(6)]


def _second(rank: int) -> list[torch.Tensor]:
    """Four int64 tensors of 50, unlike the first call's in dtype and size."""
    return [torch.full((50,), 100 * rank + i, dtype=torch.int64) for i in range(4)]


def _broadcast(group: BaseGroup, xs: list[torch.Tensor], async_op: bool) -> None:
    work = calls.broadcast_tensors(group, xs, 0, bucket_bytes=256, async_op=async_op)
    if isinstance(work, Work):
        work.wait()


@pytest.mark.parametrize("modes", [("blocking", "blocking"), ("blocking", "async")])
def test_bulk_calls_from_two_threads_run_one_after_the_other(
    transport: str,  # noqa: F811
    modes: tuple[str, str],
) -> None:
    """Rank 0 issues two calls from two threads while rank 1 has not yet joined the first."""

    def fn(group: BaseGroup, rank: int) -> list[list[float]]:
        first, second = _first(rank), _second(rank)
        if rank == 0:
            threads = [
                threading.Thread(target=_broadcast, args=(group, xs, mode == "async"))
                for xs, mode in zip((first, second), modes, strict=True)
            ]
            for thread in threads:
                thread.start()
                time.sleep(0.3)  # the first call is in its agreement, waiting for rank 1
            for thread in threads:
                thread.join(30)
        else:
            time.sleep(0.8)
            _broadcast(group, first, modes[0] == "async")
            _broadcast(group, second, modes[1] == "async")
        return [x.tolist() for x in first + second]

    expected = [x.tolist() for x in _first(0) + _second(0)]
    assert run(transport, 2, fn) == [expected, expected]


# --- a wait that runs out ---------------------------------------------------------------------


def test_an_expired_wait_aborts_the_group_and_the_call_writes_no_more(
    transport: str,  # noqa: F811
) -> None:
    """Rank 0 gives up on an async broadcast whose source stalls after the agreement.

    The source's data ops wait until rank 0's wait has expired: a stalled peer,
    faked by holding back its group's ``broadcast`` and ``broadcast_list``.
    """
    expired, joined = threading.Event(), threading.Event()

    def fn(group: BaseGroup, rank: int) -> dict[str, Any]:
        xs = [torch.full((1000,), float(rank)) for _ in range(8)]
        if rank == 1:
            broadcast, broadcast_list = group.broadcast, group.broadcast_list

            def stalled(tensors: Any, options: Any) -> Work:
                expired.wait(30)
                return broadcast(tensors, options)

            def stalled_list(tensors: Any, options: Any) -> Work:
                expired.wait(30)
                return broadcast_list(tensors, options)

            group.broadcast = stalled  # type: ignore[method-assign]
            group.broadcast_list = stalled_list  # type: ignore[method-assign]
            try:
                calls.broadcast_tensors(
                    group, xs, 1, bucket_bytes=1024, timeout=timedelta(seconds=2)
                )
            except CollectiveError:
                pass
            joined.set()
            return {}
        work = calls.broadcast_tensors(group, xs, 1, bucket_bytes=1024, async_op=True)
        assert isinstance(work, Work)
        started = time.monotonic()
        with pytest.raises(CollectiveTimeoutError) as raised:
            work.wait(timedelta(seconds=0.3))
        waited = time.monotonic() - started
        expired.set()
        joined.wait(30)
        time.sleep(0.3)
        with pytest.raises(CollectiveTimeoutError):
            work.wait()
        with pytest.raises(CollectiveError) as later:
            group.allreduce([torch.ones(2)], AllReduceOptions()).wait()
        return {
            "message": str(raised.value),
            "waited": waited,
            "written": [x.tolist() != [0.0] * 1000 for x in xs],
            "later": str(later.value),
            "completed": work.is_completed(),
        }

    result = run(transport, 2, fn)[0]
    assert "broadcast_tensors" in result["message"] and "rank 0" in result["message"], result
    assert "aborted" in result["message"], result
    assert result["written"] == [False] * 8, result
    assert "broadcast_tensors" in result["later"], result
    assert result["completed"], result
    assert result["waited"] < 5.0, result


# --- keys that cannot travel ------------------------------------------------------------------


@pytest.mark.parametrize("odd_rank", [0, 2])
def test_a_key_utf8_cannot_encode_is_the_same_argument_error_on_every_rank(odd_rank: int) -> None:
    def fn(group: BaseGroup, rank: int) -> str:
        sd = {"a": torch.full((3,), float(rank)), "b": torch.full((2,), float(rank))}
        if rank == odd_rank:
            sd["\ud800"] = torch.zeros(1)
        with pytest.raises(ArgumentValueError) as raised:
            calls.broadcast_state_dict(group, sd, 0)
        assert sd["a"].tolist() == [float(rank)] * 3
        x = [torch.ones(2)]
        calls.allreduce_tensors(group, x)  # the group stays usable
        assert x[0].tolist() == [3.0, 3.0]
        return str(raised.value)

    messages = run_cpu(3, fn, timeout=timedelta(seconds=5))
    assert len(set(messages)) == 1, messages
    assert f"rank {odd_rank} passed an invalid argument" in messages[0], messages
    assert "'\\ud800'" in messages[0] and "UTF-8" in messages[0], messages


# --- views of one buffer ----------------------------------------------------------------------


def test_views_that_share_a_buffer_but_no_element_are_reduced() -> None:
    def fn(group: BaseGroup, rank: int) -> list[list[float]]:
        x = torch.arange(8.0) + rank
        y = np.arange(12.0).reshape(3, 4) + rank
        calls.allreduce_tensors(group, [x[0::2], x[1::2], y[:, :2], y[:, 2:]], "sum")
        return [x.tolist(), y.ravel().tolist()]

    want = [[2 * v + 1 for v in range(8)], [2 * v + 1.0 for v in range(12)]]
    assert run_cpu(2, fn) == [want, want]


def test_views_that_share_an_element_are_refused() -> None:
    def fn(group: BaseGroup, rank: int) -> str:
        x = torch.zeros(12)
        with pytest.raises(ArgumentValueError) as raised:
            calls.allreduce_tensors(group, [x[0::2], x[1::2], x[0::3]])
        return str(raised.value)

    assert all("tensors[0] and tensors[2] share memory" in m for m in run_cpu(2, fn))
