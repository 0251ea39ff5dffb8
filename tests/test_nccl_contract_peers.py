"""An NCCL timeout names the ranks that never issued the op, and a failure reaches every rank.

Ranks are threads on ``ContractCupy`` (see ``tests/nccl_threads.py``): an op that a peer
never joins is one whose events never complete. World size 3: rank 1 skips the second
allreduce; ranks 0 and 2 time out and name rank 1, how many collectives it issued and
the last one, or, when rank 1 is dead (its watch thread gone), name it as a rank that did
not answer; a rank that times out tells the others, whose groups fail at once.
The replay of a CUDA graph put under ``watch`` fails the group at its timeout, and the
watchdog keeps a busy group patrolled, lets an idle one go and takes it back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest

import collective as col
from collective.frameworks import cuda_buffers
from collective.groups import progress
from collective.groups.nccl import mismatch
from collective.groups.nccl.group import NCCLGroup
from collective.groups.nccl.watchdog import LINGER_S
from collective.types import (
    AllReduceOptions,
    BroadcastOptions,
    CollectiveError,
    CollectiveTimeoutError,
    GroupNotFoundError,
)
from tests.nccl_binding import NOT_READY, DeviceArray
from tests.nccl_threads import CONTRACT, Ranks, caller_stream, contract_ranks

pytestmark = CONTRACT

TIMEOUT = timedelta(seconds=1)


@pytest.fixture
def ranks(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Ranks]]:
    # What the peers answer is under test, not how soon: on a loaded 2-core machine a
    # peer thread can take longer than the 1 s timeout's share to answer.
    monkeypatch.setattr(progress, "LEAST_ANSWER_WAIT", progress.ANSWER_WAIT)
    with contract_ranks(monkeypatch) as make:
        yield make


def _allreduce(group: NCCLGroup, timeout: timedelta | None = None) -> Any:
    x = DeviceArray((4, 8), "float32", 0)
    return group.allreduce([x], AllReduceOptions(timeout=timeout, async_op=True))


def _skip_second_allreduce(r: Ranks, stuck: list[int]) -> dict[int, tuple[float, str]]:
    """Every rank issues one allreduce; then ranks ``stuck`` issue a second one, never done."""
    r.run(lambda _, g: _allreduce(g).wait())
    r.settle()
    for rank in stuck:
        r.cupys[rank].trace.event_status = lambda handle, real_status: NOT_READY

    def second(rank: int, group: NCCLGroup) -> tuple[float, str]:
        start = time.monotonic()
        with pytest.raises(CollectiveError) as info:
            _allreduce(group, TIMEOUT).wait()
        return time.monotonic() - start, str(info.value)

    return dict(zip(stuck, r.run(second, ranks=stuck), strict=True))


def test_a_timeout_names_the_rank_that_never_issued_the_op(ranks: Callable[..., Ranks]) -> None:
    r = ranks(3, timeout=timedelta(seconds=20))
    outcomes = _skip_second_allreduce(r, stuck=[0, 2])
    for rank, (took, message) in outcomes.items():
        assert took < TIMEOUT.total_seconds() + 2, (rank, took)
        assert "ranks that never joined it: [1] (rank 1 has issued 1 ops, the last allreduce)" in (
            message
        ), (rank, message)
        assert "(op 2 of the group): [0, 2]" in message, (rank, message)


def test_a_timeout_names_a_dead_rank_and_asks_the_peers_once(
    ranks: Callable[..., Ranks],
) -> None:
    """Rank 1's watch thread is gone, as when its process died, and rank 2 skips the op.

    Rank 0's ``wait`` and the watchdog find the same timeout at once; one of them asks
    the peers and waits for rank 1's answer, the other takes that error: rank 0 raises
    within the timeout and one answer wait, not two.
    """
    r = ranks(3, timeout=timedelta(seconds=20))
    peers = r.groups[1]._peers
    assert peers is not None
    peers.stop()
    took, message = _skip_second_allreduce(r, stuck=[0])[0]
    assert took < (TIMEOUT + progress.ANSWER_WAIT + timedelta(seconds=1)).total_seconds(), took
    assert "ranks that never joined it: [2] (rank 2 has issued 1 ops" in message, message
    assert "ranks that did not answer (dead or frozen): [1]" in message, message


def test_a_timeout_names_the_rank_whose_op_of_that_number_was_another(
    ranks: Callable[..., Ranks], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the mismatch check off, rank 1 broadcasts where ranks 0 and 2 allreduce."""
    monkeypatch.setenv(mismatch.CHECK_ENV, "0")
    r = ranks(3, timeout=timedelta(seconds=20))
    r.run(lambda _, g: _allreduce(g).wait())
    x = DeviceArray((4, 8), "float32", 0)
    r.run(lambda _, g: g.broadcast([x], BroadcastOptions(root_rank=1)))  # its first use
    r.settle()
    for rank in (0, 2):
        r.cupys[rank].trace.event_status = lambda handle, real_status: NOT_READY
    r.run(lambda _, g: g.broadcast([x], BroadcastOptions(root_rank=1)), ranks=[1])

    def second(rank: int, group: NCCLGroup) -> str:
        with pytest.raises(CollectiveError) as info:
            _allreduce(group, TIMEOUT).wait()
        return str(info.value)

    for message in r.run(second, ranks=[0, 2]):
        assert "ranks that joined it (op 3 of the group): [0, 2]" in message, message
        assert "ranks whose op 3 was another: rank 1 (broadcast)" in message, message


def test_a_rank_that_times_out_tells_the_others_at_once(ranks: Callable[..., Ranks]) -> None:
    r = ranks(2, timeout=timedelta(seconds=20))
    outcomes = _skip_second_allreduce(r, stuck=[0])
    took, message = outcomes[0]
    assert isinstance(message, str) and took < TIMEOUT.total_seconds() + 2
    assert "ranks that never joined it: [1]" in message
    deadline = time.monotonic() + 5
    while r.groups[1]._error is None:
        assert time.monotonic() < deadline, "rank 1 never heard of rank 0's failure"
        time.sleep(0.01)
    with pytest.raises(CollectiveError, match=r"rank 0 reported: allreduce .* timed out"):
        r.run(lambda _, g: _allreduce(g).wait(), ranks=[1])
    assert isinstance(r.groups[0]._error, CollectiveTimeoutError)


def test_a_replay_put_under_watch_fails_the_group_at_its_timeout(
    ranks: Callable[..., Ranks],
) -> None:
    r = ranks(1, timeout=timedelta(seconds=20))
    r.run(lambda _, g: _allreduce(g).wait())
    r.settle()
    group = r.groups[0]
    r.cupys[0].trace.event_status = lambda handle, real_status: NOT_READY
    start = time.monotonic()
    r.run(lambda _, g: g.watch_stream(caller_stream(0), 0, TIMEOUT))
    deadline = start + TIMEOUT.total_seconds() + 5
    while group._error is None:
        assert time.monotonic() < deadline, "the watched replay never timed out"
        time.sleep(0.01)
    assert time.monotonic() - start >= TIMEOUT.total_seconds() - 0.05
    with pytest.raises(CollectiveTimeoutError, match="CUDA graph replay on group"):
        r.run(lambda _, g: _allreduce(g).wait())
    assert [e.name for e in r.cupys[0].trace.named("abort")] == ["abort"]


def test_watch_refuses_what_it_cannot_watch() -> None:
    with pytest.raises(TypeError, match=r"stream must be a torch\.cuda\.Stream.*got str"):
        cuda_buffers.stream_of("stream")
    with pytest.raises(TypeError, match="got bool"):
        cuda_buffers.stream_of(True)
    with pytest.raises(GroupNotFoundError):
        col.watch("no-such-group")


def test_the_watchdog_lets_an_idle_group_go_and_takes_it_back_with_its_next_op(
    ranks: Callable[..., Ranks],
) -> None:
    r = ranks(1, timeout=timedelta(seconds=20))
    group = r.groups[0]
    for _ in range(50):  # back to back: the group stays patrolled, nothing wakes the thread
        r.run(lambda _, g: g.allreduce([DeviceArray((4, 8), "float32", 0)], AllReduceOptions()))
        assert group._watch.patrolled
    deadline = time.monotonic() + LINGER_S + 5
    while group._watch.patrolled:
        assert time.monotonic() < deadline, "the watchdog never let the idle group go"
        time.sleep(0.02)
    r.cupys[0].trace.event_status = lambda handle, real_status: NOT_READY
    start = time.monotonic()
    x = DeviceArray((4, 8), "float32", 0)
    r.run(lambda _, g: g.allreduce([x], AllReduceOptions(timeout=TIMEOUT)))  # blocking
    while group._error is None:  # only the watchdog can find it
        assert time.monotonic() - start < TIMEOUT.total_seconds() + 2, "never timed out"
        time.sleep(0.01)
    assert isinstance(group._error, CollectiveTimeoutError)
