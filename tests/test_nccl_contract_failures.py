"""How the nccl backend fails, checked against cupy's real binding, without a GPU.

CUDA errors, NCCL errors, timeouts, a call that fails in the middle of an NCCL group,
a unique ID the binding refuses, abort and destroy while a communicator forms, ops
from several threads, and what destroy does with communicators and streams. The
ranks run as threads on ``ContractCupy`` (see ``tests/nccl_binding.py``); the CUDA
error is the one this machine's real runtime reports (it has no driver), the NCCL
errors are the real NCCL's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest

from collective.groups.nccl import comm as nccl_comm
from collective.types import AllGatherOptions, AllReduceOptions, CollectiveError
from collective.types import CollectiveTimeoutError as Timeout
from tests.nccl_binding import (
    NOT_READY,
    DeviceArray,
    Entry,
    group_blocks,
    real_nccl,
)
from tests.nccl_threads import CONTRACT, Ranks, contract_ranks

pytestmark = CONTRACT

INVALID_USAGE = 5
"""``ncclInvalidUsage``: what ``groupEnd`` says outside a group call."""
SHAPE = (4, 8)
LONG = timedelta(seconds=30)


@pytest.fixture
def ranks(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Ranks]]:
    with contract_ranks(monkeypatch) as make:
        yield make


def _x(device: int = 0) -> DeviceArray:
    return DeviceArray(SHAPE, "float32", device)


def _warm(r: Ranks) -> None:
    """Form every rank's communicators with one allreduce, then forget the calls.

    The allreduce is waited for, which reads its signature check, so that no check is
    pending when a test makes the events fail.
    """
    r.run(lambda _, g: g.allreduce([_x()], AllReduceOptions(async_op=True)).wait())
    r.settle()
    r.clear()


def _aborted_comms(r: Ranks, rank: int = 0) -> list[tuple[str, int | None]]:
    return [
        (e.name, e.comm.nccl_rank) for e in r.cupys[rank].trace.named("abort", "destroy") if e.comm
    ]


def _async_allreduce(r: Ranks, timeout: timedelta = LONG) -> Any:
    return r.run(
        lambda _, g: g.allreduce([_x()], AllReduceOptions(timeout=timeout, async_op=True))
    )[0]


def test_a_cuda_error_fails_the_op_at_once_not_after_its_timeout(
    ranks: Callable[..., Ranks],
) -> None:
    r = ranks(1)
    _warm(r)
    r.cupys[0].trace.event_status = lambda handle, real_status: real_status
    work = _async_allreduce(r)
    assert work.is_completed() is True
    error = work.exception()
    start = time.monotonic()
    with pytest.raises(CollectiveError) as info:
        work.wait()
    assert time.monotonic() - start < 5
    assert info.value is error and not isinstance(error, Timeout)
    assert "cudaError" in str(error) and "allreduce" in str(error)
    assert r.groups[0].error is error
    assert _aborted_comms(r) == [("abort", 0)]
    with pytest.raises(CollectiveError, match="unusable"):
        r.run(lambda _, g: g.allreduce([_x()], AllReduceOptions()))


def test_an_async_nccl_error_fails_the_op_at_once(ranks: Callable[..., Ranks]) -> None:
    r = ranks(1)
    _warm(r)
    r.cupys[0].trace.event_status = lambda handle, real_status: NOT_READY
    r.cupys[0].trace.let_through = lambda entry: entry.name == "check_async_error"
    work = _async_allreduce(r)
    start = time.monotonic()
    with pytest.raises(CollectiveError, match="invalid argument") as info:
        work.wait()
    assert time.monotonic() - start < 5 and not isinstance(info.value, Timeout)
    assert _aborted_comms(r) == [("abort", 0)]


def test_an_op_that_does_not_finish_times_out_and_aborts(ranks: Callable[..., Ranks]) -> None:
    r = ranks(1)
    _warm(r)
    r.cupys[0].trace.event_status = lambda handle, real_status: NOT_READY
    work = _async_allreduce(r, timeout=timedelta(seconds=0.5))
    assert work.is_completed() is False
    start = time.monotonic()
    with pytest.raises(Timeout, match="allreduce"):
        work.wait()
    assert 0.5 <= time.monotonic() - start < 5
    assert r.cupys[0].trace.named("check_async_error")
    assert _aborted_comms(r) == [("abort", 0)]


def test_a_call_that_fails_inside_a_group_discards_the_whole_group(
    ranks: Callable[..., Ranks],
) -> None:
    r = ranks(3)
    _warm(r)
    warm = [[_x() for _ in range(3)] for _ in range(3)]  # the op's first use, on every rank
    r.run(lambda rank, g: g.allgather([warm[rank]], [_x()], AllGatherOptions()))
    r.settle()
    r.clear()
    broadcasts: list[Entry] = []

    def second_fails(entry: Entry) -> bool:
        broadcasts.extend([entry] if entry.name == "broadcast" else [])
        return len(broadcasts) == 2

    r.cupys[0].trace.let_through = second_fails

    def allgather_then_group_depth(rank: int, g: Any) -> int:
        outs = [_x() for _ in range(3)]
        with pytest.raises(CollectiveError, match=r"allgather.*invalid argument"):
            g.allgather([outs], [_x()], AllGatherOptions())
        with pytest.raises(real_nccl.NcclError) as info:
            real_nccl.groupEnd()  # no group call is left open on this thread
        return int(info.value.status)

    assert r.run(allgather_then_group_depth, ranks=[0]) == [INVALID_USAGE]
    (block,) = group_blocks(r.cupys[0].trace.entries)
    names = [(e.name, e.comm.nccl_rank if e.comm else None) for e in block]
    assert names == [
        ("groupStart", None),
        ("broadcast", 0),
        ("broadcast", 0),
        ("send", None),  # on a communicator never initialised: NCCL drops the group
        ("groupEnd", None),
    ]
    assert r.groups[0].error is not None
    assert _aborted_comms(r) == [("abort", 0)]


def test_a_unique_id_the_binding_refuses_fails_the_op_and_the_group(
    ranks: Callable[..., Ranks], monkeypatch: pytest.MonkeyPatch
) -> None:
    taken = nccl_comm.unique_id_argument

    def other_form(communicator: Any, uid: bytes) -> Any:
        form = taken(communicator, uid)
        return tuple(form) if isinstance(form, bytes) else bytes(b & 0xFF for b in form)

    monkeypatch.setattr(nccl_comm, "unique_id_argument", other_form)
    r = ranks(1)
    with pytest.raises(CollectiveError, match=r"allreduce \(nccl init\).*TypeError.*commId"):
        r.run(lambda _, g: g.allreduce([_x()], AllReduceOptions()))
    assert r.groups[0].error is not None


@pytest.mark.parametrize("end", ["abort", "destroy_group"])
def test_abort_and_destroy_return_at_once_while_a_communicator_waits_for_peers(
    ranks: Callable[..., Ranks], end: str
) -> None:
    r = ranks(2, timeout=timedelta(seconds=3))
    outcome: dict[str, Any] = {}

    def alone() -> None:
        try:  # rank 0 never publishes the unique ID
            r.run(lambda _, g: g.allreduce([_x()], AllReduceOptions()), ranks=[1])
        except Exception as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=alone)
    thread.start()
    time.sleep(0.5)
    start = time.monotonic()
    if end == "abort":
        r.groups[1].abort("stopped by the test")
    else:
        r.groups[1].destroy_group()
    took = time.monotonic() - start
    thread.join(30)
    assert took < 1.0, f"{end} took {took:.1f} s"
    error = outcome["error"]
    assert isinstance(error, CollectiveError)
    assert ("stopped by the test" if end == "abort" else "was destroyed") in str(error)
    assert not r.cupys[1].trace.named("NcclCommunicator")


def test_ops_from_several_threads_never_interleave_their_nccl_calls(
    ranks: Callable[..., Ranks],
) -> None:
    r = ranks(1)
    group, trace = r.groups[0], r.cupys[0].trace
    group.allreduce([_x(0), _x(1)], AllReduceOptions())
    trace.clear()
    trace.pause_s = 0.002

    def issue() -> None:
        for _ in range(5):
            group.allreduce([_x(0), _x(1)], AllReduceOptions())

    threads = [threading.Thread(target=issue) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    blocks = list(group_blocks(trace.entries))
    assert len(blocks) == 10
    owner: int | None = None
    for entry in trace.entries:
        if entry.name == "groupStart":
            owner = entry.thread
        assert owner is None or entry.thread == owner, "another thread's call inside a group"
        if entry.name == "groupEnd":
            owner = None


def test_destroy_destroys_each_communicator_and_a_later_group_reuses_its_streams(
    ranks: Callable[..., Ranks],
) -> None:
    r = ranks(1)
    r.groups[0].allreduce([_x(0), _x(1)], AllReduceOptions(async_op=True)).wait()
    streams = r.cupys[0].streams()
    r.groups[0].destroy_group()
    assert _aborted_comms(r) == [("destroy", 0), ("destroy", 1)]
    again = ranks(1, cupys=r.cupys)
    again.clear()
    again.groups[0].allreduce([_x(0), _x(1)], AllReduceOptions(async_op=True)).wait()
    assert not again.cupys[0].trace.named("streamCreateWithFlags")
    assert {e.args[-1] for e in again.cupys[0].trace.named("allReduce")} == set(streams.values())


def test_destroy_after_a_failure_aborts_and_never_hands_the_streams_on(
    ranks: Callable[..., Ranks],
) -> None:
    r = ranks(1)
    _warm(r)
    r.cupys[0].trace.event_status = lambda handle, real_status: NOT_READY
    with pytest.raises(Timeout):
        _async_allreduce(r, timeout=timedelta(seconds=0.2)).wait()
    r.groups[0].destroy_group()
    assert [name for name, _ in _aborted_comms(r)] == ["abort"] * len(_aborted_comms(r))
    r.cupys[0].trace.event_status = lambda handle, real_status: 0
    again = ranks(1, cupys=r.cupys)
    again.clear()
    again.groups[0].allreduce([_x()], AllReduceOptions(async_op=True)).wait()
    assert again.cupys[0].trace.named("streamCreateWithFlags")


def test_retire_aborts_every_communicator_and_never_destroys_one(
    ranks: Callable[..., Ranks],
) -> None:
    """A shrink or grow retires the old group while a peer may be dead: no ncclCommDestroy."""
    r = ranks(2)
    _warm(r)
    assert all(group._launches for group in r.groups)
    for group in r.groups:
        group.retire("replaced by a shrink")
    assert not any(group._launches for group in r.groups), "a retired group kept its launches"
    for rank in range(2):
        assert _aborted_comms(r, rank) == [("abort", rank)], r.cupys[rank].trace.named("destroy")
    with pytest.raises(CollectiveError, match=r"replaced by a shrink|destroyed"):
        r.groups[0].allreduce([_x()], AllReduceOptions())
