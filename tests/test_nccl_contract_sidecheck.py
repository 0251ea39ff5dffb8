"""NCCL's mismatch check beside the op (``COLLECTIVE_NCCL_CHECK=side``), against cupy's binding.

The check's allreduce, its words' upload, the copy of its result and its event go to
a communicator of their own and to the group's comm stream, never to the op's stream
or communicator, and nothing orders that stream after the caller's. The words and
what a mismatch does are those of the default check: these tests play NCCL as
``test_nccl_contract_mismatch.py`` does. Ranks run as threads on ``ContractCupy``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from functools import partial
from typing import Any

import pytest

from collective import signature
from collective.groups.nccl import mismatch
from collective.groups.nccl.cuda import STREAMS
from collective.types import AllReduceOptions, ArgumentValueError, CollectiveError, ReduceOp
from tests.nccl_binding import H2D, NOT_READY, ContractCupy, DeviceArray, Entry, real_nccl
from tests.nccl_threads import CONTRACT, Ranks, caller_stream, contract_ranks
from tests.test_nccl_contract_mismatch import checks, hold_checks, know, play_nccl

pytestmark = CONTRACT


@pytest.fixture
def ranks(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Ranks]]:
    monkeypatch.setenv(mismatch.CHECK_ENV, "side")
    monkeypatch.setenv(mismatch.ORDER_ENV, "1")
    with contract_ranks(monkeypatch) as make:
        yield make


def _sized(rank: int, g: Any, shape: tuple[int, ...], async_op: bool = False) -> None:
    options = AllReduceOptions(async_op=async_op)
    work = g.allreduce([DeviceArray(shape, "float32")], options)
    work.wait()


def _op_calls(cupy: ContractCupy) -> list[Entry]:
    """Return the op's own allreduces: every allreduce but the checks'."""
    theirs = {id(call) for call, _, _ in checks(cupy)}
    return [e for e in cupy.trace.named("allReduce") if id(e) not in theirs]


def _next_op_error(g: Any) -> BaseException | None:
    try:
        g.allreduce([DeviceArray((8,), "float32")], AllReduceOptions())
    except CollectiveError as exc:
        return exc
    return None


def test_the_check_reduces_on_its_own_communicator_on_the_comm_stream(
    ranks: Callable[..., Ranks],
) -> None:
    r = ranks(2)
    xs = [DeviceArray((4, 8), "float16") for _ in range(2)]
    r.run(lambda rank, g: g.allreduce([xs[rank]], AllReduceOptions(ReduceOp.MAX)))
    for rank, cupy in enumerate(r.cupys):
        ((call, copy, event),) = checks(cupy)
        (op,) = _op_calls(cupy)
        side = cupy.streams()[0]
        assert side != caller_stream(0)
        assert op.args[5] == caller_stream(0), "the op runs on the caller's stream"
        assert call.comm is not None and op.comm is not None and call.comm is not op.comm
        assert call.comm.nccl_rank == op.comm.nccl_rank == rank
        made = cupy.trace.named("NcclCommunicator")
        assert len(made) == 2 and made[0].args[1] != made[1].args[1], "two communicators"
        count = 2 * mismatch.WORDS
        assert call.args[2:] == (count, int(real_nccl.NCCL_INT64), int(real_nccl.NCCL_MAX), side)
        (upload,) = [e for e in cupy.trace.named("memcpyAsync") if e.args[0] == call.args[0]]
        assert upload.args[3:] == (H2D, side), "the words go up on the check's stream"
        assert copy.args[3:] == (2, side) and event.args[1] == side
        assert not cupy.trace.named("streamWaitEvent"), "the check's stream waits for nothing"
        entries = cupy.trace.entries
        assert entries.index(call) < entries.index(op), "every rank issues check k, then op k"
        words = cupy.uploaded(call.args[0])
        fields = signature.of_call("allreduce", 0, xs[rank], -1, ReduceOp.MAX)[: mismatch.FIELDS]
        assert words[1 : mismatch.WORDS].tolist() == fields
        assert (words[mismatch.WORDS :] == -words[: mismatch.WORDS]).all()
    sent = [c.uploaded(checks(c)[0][0].args[0]) for c in r.cupys]
    assert (sent[0] == sent[1]).all(), "ranks that agree must send the same words"


def test_ranks_that_disagree_all_raise_at_the_next_op_and_both_communicators_abort(
    ranks: Callable[..., Ranks],
) -> None:
    r = ranks(2)
    know(r, *[partial(_sized, shape=(n,)) for n in (32, 33)])
    played = hold_checks(r)
    r.run(lambda _, g: g.allreduce([DeviceArray((8,), "float32")], AllReduceOptions()))
    play_nccl(r, played)
    r.run(lambda rank, g: g.allreduce([DeviceArray((32 + rank,), "float32")], AllReduceOptions()))
    play_nccl(r, played)
    errors = r.run(lambda _, g: _next_op_error(g))
    for rank, error in enumerate(errors):
        assert isinstance(error, CollectiveError), f"rank {rank} raised nothing"
        assert "different ops or arguments" in str(error) and "shape:" in str(error)
        aborted = {id(e.comm) for e in r.cupys[rank].trace.named("abort")}
        assert len(aborted) == 2, "the op's and the check's communicators are aborted"


def test_ranks_that_agree_carry_on(ranks: Callable[..., Ranks]) -> None:
    r = ranks(2)
    played = hold_checks(r)
    for _ in range(3):
        r.run(lambda _, g: g.allreduce([DeviceArray((8,), "int64")], AllReduceOptions()))
        play_nccl(r, played)
    assert r.run(lambda _, g: _next_op_error(g)) == [None, None]
    assert all(g.error is None for g in r.groups)
    assert all(len(c.trace.named("NcclCommunicator")) == 2 for c in r.cupys), "made once"


def test_a_mismatch_that_hangs_the_op_is_reported_as_one_not_as_a_timeout(
    ranks: Callable[..., Ranks],
) -> None:
    """The check is its own NCCL call on its own communicator: it completes though the op
    beside it never does."""
    r = ranks(2)
    know(r, *[partial(_sized, shape=(n,)) for n in (8, 9)])
    played = hold_checks(r)
    r.run(lambda _, g: g.allreduce([DeviceArray((8,), "float32")], AllReduceOptions()))
    play_nccl(r, played)
    time.sleep(0.1)
    fresh = hold_checks(r, others=NOT_READY)  # the op's kernels never finish
    fresh.update(played)
    timeout = AllReduceOptions(timeout=timedelta(seconds=2))
    r.run(lambda rank, g: g.allreduce([DeviceArray((8 + rank,), "float32")], timeout))
    play_nccl(r, fresh)
    start = time.monotonic()
    while any(g.error is None for g in r.groups) and time.monotonic() - start < 5:
        time.sleep(0.01)
    assert time.monotonic() - start < 2, "the mismatch waited for the op's timeout"
    for group in r.groups:
        assert "different ops or arguments" in str(group.error)
        assert "shape:" in str(group.error)


def test_ranks_that_disagree_on_an_async_op_all_raise_at_its_wait(
    ranks: Callable[..., Ranks],
) -> None:
    r = ranks(2)
    know(r, *[partial(_sized, shape=(8, n), async_op=True) for n in (2, 3)])
    played = hold_checks(r)
    r.run(lambda _, g: g.allreduce([DeviceArray((8,), "float32")], AllReduceOptions()))
    play_nccl(r, played)
    works = r.run(
        lambda rank, g: g.allreduce(
            [DeviceArray((8, 2 + rank), "float32")], AllReduceOptions(async_op=True)
        )
    )
    play_nccl(r, played)
    for rank, work in enumerate(works):
        with pytest.raises(CollectiveError, match="different ops or arguments") as info:
            work.wait()
        assert "elements: 16 .. 24" in str(info.value), (rank, str(info.value))
        assert "shape:" in str(info.value), (rank, str(info.value))


def test_an_async_op_and_an_agreement_check_on_the_check_communicator(
    ranks: Callable[..., Ranks],
) -> None:
    r = ranks(2)
    xs = [DeviceArray((6,), "float64") for _ in range(2)]
    works = r.run(lambda rank, g: g.allreduce([xs[rank]], AllReduceOptions(async_op=True)))
    r.run(lambda rank, _: works[rank].wait())
    wait = timedelta(seconds=5)
    r.run(lambda rank, g: g.agree("broadcast", xs[rank], 0, None, wait))
    for cupy in r.cupys:
        (op,) = _op_calls(cupy)
        side = cupy.streams()[0]
        found = checks(cupy)
        assert len(found) == 2
        for call, copy, _ in found:
            assert call.comm is not op.comm and call.args[5] == side and copy.args[4] == side
        assert found[0][0].comm is found[1][0].comm, "one check communicator per GPU"
        waits = [e for e in cupy.trace.named("streamWaitEvent") if e.args[0] == side]
        entries = cupy.trace.entries
        assert entries.index(found[0][0]) < entries.index(waits[0]) < entries.index(op), (
            "the async op's check goes ahead of the comm stream's wait for the caller"
        )


def test_destroy_releases_the_check_communicator_and_the_comm_stream(
    ranks: Callable[..., Ranks],
) -> None:
    r = ranks(2)
    r.run(lambda rank, g: g.allreduce([DeviceArray((8,), "float32")], AllReduceOptions()))
    r.settle()
    sides = [c.streams()[0] for c in r.cupys]
    r.run(lambda _, g: g.destroy_group())
    for cupy, side in zip(r.cupys, sides, strict=True):
        destroyed = {id(e.comm) for e in cupy.trace.named("destroy")}
        assert len(destroyed) == 2 and not cupy.trace.named("abort")
        again = STREAMS.acquire(cupy.cuda, 0)
        STREAMS.release(cupy.cuda, {0: again})
        assert again == side, "the comm stream went back to the process's pool"


def test_nothing_of_the_check_runs_while_the_callers_stream_captures(
    ranks: Callable[..., Ranks],
) -> None:
    """The op ran once before the capture: its communicators and first use exist."""
    r = ranks(2)
    x = [DeviceArray((8,), "float32") for _ in range(2)]
    know(r, partial(_sized, shape=(8,)))
    for cupy in r.cupys:
        cupy.trace.capturing.add(caller_stream(0))
    try:
        r.run(lambda rank, g: g.allreduce([x[rank]], AllReduceOptions()))
    finally:
        for cupy in r.cupys:
            cupy.trace.capturing.clear()
    for cupy in r.cupys:
        assert checks(cupy) == [] and not cupy.trace.named("NcclCommunicator")
    r.run(lambda rank, g: g.allreduce([x[rank]], AllReduceOptions()))
    assert all(len(checks(c)) == 1 for c in r.cupys)


@pytest.mark.parametrize("value", ["sideways", "2", ""])
def test_another_value_fails_every_rank_at_once_saying_what_is_allowed(
    ranks: Callable[..., Ranks], monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(mismatch.CHECK_ENV, value)
    start = time.monotonic()
    with pytest.raises(ArgumentValueError, match=r"COLLECTIVE_NCCL_CHECK must be 0, 1 or side"):
        ranks(2, timeout=timedelta(seconds=20))
    assert time.monotonic() - start < 10, "a rank waited for its peers before refusing"


@pytest.mark.parametrize(
    ("value", "mode"),
    [("1", mismatch.STREAM), ("on", mismatch.STREAM), (" Side ", mismatch.SIDE), ("0", "off")],
)
def test_the_values_of_the_variable(monkeypatch: pytest.MonkeyPatch, value: str, mode: str) -> None:
    monkeypatch.setenv(mismatch.CHECK_ENV, value)
    assert mismatch.mode() == mode
    assert mismatch.enabled() == (mode != mismatch.OFF)
