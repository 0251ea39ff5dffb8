"""NCCL's mismatch check, checked against cupy's real binding without a GPU.

Each rank hands NCCL, just ahead of each collective, an allreduce (MAX, int64) of its
op's signature words and their negatives, then a copy of the result to pinned host
memory and an event. These tests check those calls value for value, then play NCCL:
they reduce the words the ranks uploaded, write the result where each rank's copy
would land, and check that ranks that disagree all raise, naming what differs, and
that ranks that agree carry on. Ranks run as threads on ``ContractCupy`` (see
``tests/nccl_binding.py``).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from functools import partial
from typing import Any

import numpy as np
import pytest

from collective import signature
from collective.groups.nccl import mismatch
from collective.types import (
    AllReduceOptions,
    BroadcastOptions,
    CollectiveError,
    ReduceOp,
    ReduceOptions,
)
from tests.nccl_binding import (
    D2H,
    H2D,
    NOT_READY,
    ContractCupy,
    DeviceArray,
    Entry,
    check_calls,
    real_nccl,
)
from tests.nccl_threads import CONTRACT, Ranks, caller_stream, contract_ranks

pytestmark = CONTRACT

SLACK_S = 5.0


@pytest.fixture
def ranks(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Ranks]]:
    with contract_ranks(monkeypatch) as make:
        yield make


def checks(cupy: ContractCupy) -> list[tuple[Entry, Entry, Entry]]:
    """Return each signature check a rank made: its allreduce, copy to the host and event."""
    with cupy.trace.lock:
        entries = list(cupy.trace.entries)
    return check_calls(entries)


def hold_checks(r: Ranks, others: int = 0) -> set[int]:
    """Keep each check's event pending until ``play_nccl`` has written its result.

    A played check's event then says what the device clock says: the host never sees a
    check finished before the device has run it (and may still be reading its words).
    Returns the set of played events; every other event reports ``others``.
    """
    played: set[int] = set()
    for cupy in r.cupys:

        def status(handle: int, real: int, cupy: ContractCupy = cupy) -> int:
            if handle in {event.args[0] for _, _, event in checks(cupy)}:
                return cupy.gpu.query(handle) if handle in played else NOT_READY
            return others

        cupy.trace.event_status = status
    return played


def play_nccl(r: Ranks, played: set[int], k: int = -1) -> np.ndarray:
    """Reduce the k-th check of every rank as NCCL would; check that the stand-in's NCCL
    wrote that where each copy lands, once the device has run it; let the events say so.
    """
    made = [checks(c)[k] for c in r.cupys]
    sent = [
        c.uploaded(call.args[0], call.args[2])
        for c, (call, _, _) in zip(r.cupys, made, strict=True)
    ]
    reduced = np.max(np.stack(sent), axis=0).astype(np.int64)
    for cupy, (_, copy, event) in zip(r.cupys, made, strict=True):
        cupy.gpu.event_synchronize(event.args[0])
        landed = np.frombuffer(
            (ctypes.c_char * reduced.nbytes).from_address(copy.args[0]), np.int64
        )
        assert (landed == reduced).all(), "the stand-in's NCCL reduced other words"
        played.add(event.args[0])
    return reduced


def test_each_rank_hands_nccl_its_signature_words_ahead_of_the_op(
    ranks: Callable[..., Ranks],
) -> None:
    r = ranks(3)
    xs = [DeviceArray((4, 8), "float16") for _ in range(3)]
    r.run(lambda rank, g: g.reduce([xs[rank]], ReduceOptions(ReduceOp.MAX, root_rank=2)))
    for rank, cupy in enumerate(r.cupys):
        ((call, copy, event),) = checks(cupy)
        words = cupy.uploaded(call.args[0])
        (upload,) = [e for e in cupy.trace.named("memcpyAsync") if e.args[0] == call.args[0]]
        assert upload.args[4] == caller_stream(0), "the words go up on the op's own stream"
        assert cupy.trace.entries.index(upload) < cupy.trace.entries.index(call)
        fields = signature.of_call("reduce", 0, xs[rank], 2, ReduceOp.MAX)[: mismatch.FIELDS]
        assert words[1 : mismatch.WORDS].tolist() == fields
        assert (words[mismatch.WORDS :] == -words[: mismatch.WORDS]).all()
        count, stream = 2 * mismatch.WORDS, caller_stream(0)
        assert call.args[2:] == (count, int(real_nccl.NCCL_INT64), int(real_nccl.NCCL_MAX), stream)
        assert call.comm is not None and call.comm.nccl_rank == rank
        assert copy.args[1:] == (call.args[1], count * 8, D2H, stream)
        assert event.name == "eventRecord" and event.args[1] == stream
        names = [e.name for e in cupy.trace.entries]
        assert names.index("memcpyAsync") < len(names) - 1 - names[::-1].index("reduce")
    sent = [c.uploaded(checks(c)[0][0].args[0]) for c in r.cupys]
    assert all((s == sent[0]).all() for s in sent), "ranks that agree must send the same words"


@pytest.mark.parametrize(
    ("calls", "field"),
    [
        ((("allreduce", 32), ("allreduce", 36)), "shape"),
        ((("allreduce", 32), ("broadcast", 32)), "op"),
        ((("allreduce", 32), ("allreduce-max", 32)), "reduce op"),
        ((("broadcast", 32), ("broadcast-root1", 32)), "root"),
    ],
    ids=["count", "op", "reduce-op", "root"],
)
def test_ranks_that_disagree_all_raise_naming_the_field_and_the_group_breaks(
    ranks: Callable[..., Ranks], calls: tuple[tuple[str, int], ...], field: str
) -> None:
    """Both calls' first uses are agreed first: the check, not the agreement, finds it."""
    r = ranks(2)

    def call(rank: int, g: Any, which: int | None = None) -> None:
        kind, count = calls[rank if which is None else which]
        x = DeviceArray((count,), "float32")
        if kind.startswith("allreduce"):
            op = ReduceOp.MAX if kind.endswith("max") else ReduceOp.SUM
            g.allreduce([x], AllReduceOptions(op))
        else:
            g.broadcast([x], BroadcastOptions(root_rank=1 if kind.endswith("1") else 0))

    know(r, partial(call, which=0), partial(call, which=1))
    played = hold_checks(r)
    r.run(lambda _, g: g.allreduce([DeviceArray((8,), "float32")], AllReduceOptions()))
    play_nccl(r, played)
    r.run(call)
    play_nccl(r, played)
    errors = r.run(lambda _, g: _next_op_error(g))
    for rank, error in enumerate(errors):
        assert isinstance(error, CollectiveError), f"rank {rank} raised nothing"
        assert "different ops or arguments" in str(error) and f"{field}:" in str(error)
        assert r.name in str(error)
        assert r.groups[rank].error is not None
        assert [e.name for e in r.cupys[rank].trace.named("abort")] == ["abort"]


def know(r: Ranks, *calls: Callable[[int, Any], Any]) -> None:
    """Run each of ``calls`` on every rank, so that their first uses are agreed, then forget.

    A kind of op new on a communicator is agreed through the store before NCCL sees it
    (see ``collective/groups/nccl/first.py``), which finds a mismatch of new kinds before
    any check: tests of the check make the kinds known first.
    """
    for call in calls:
        r.run(call)
    r.settle()
    r.clear()


def _sized(rank: int, g: Any, n: int) -> None:
    g.allreduce([DeviceArray((n,), "float32")], AllReduceOptions())


def _hear(heard: list[str], error: CollectiveError) -> None:
    heard.append(str(error))


def _next_op_error(g: Any) -> BaseException | None:
    try:
        g.allreduce([DeviceArray((8,), "float32")], AllReduceOptions())
    except CollectiveError as exc:
        return exc
    return None


def test_ranks_that_agree_carry_on(ranks: Callable[..., Ranks]) -> None:
    r = ranks(2)
    played = hold_checks(r)
    for _ in range(3):
        r.run(lambda _, g: g.allreduce([DeviceArray((8,), "int64")], AllReduceOptions()))
        play_nccl(r, played)
    assert r.run(lambda _, g: _next_op_error(g)) == [None, None]
    assert all(g.error is None for g in r.groups)


def test_a_mismatch_that_hangs_the_op_is_reported_as_one_not_as_a_timeout(
    ranks: Callable[..., Ranks],
) -> None:
    """The check is its own NCCL call, so it completes though the op after it never does."""
    r = ranks(2)
    know(r, partial(_sized, n=8), partial(_sized, n=9))
    played = hold_checks(r)
    r.run(lambda _, g: g.allreduce([DeviceArray((8,), "float32")], AllReduceOptions()))
    play_nccl(r, played)
    time.sleep(0.1)
    fresh = hold_checks(r, others=NOT_READY)  # the op's kernels never finish
    fresh.update(played)
    played = fresh
    timeout = AllReduceOptions(timeout=timedelta(seconds=2))
    r.run(lambda rank, g: g.allreduce([DeviceArray((8 + rank,), "float32")], timeout))
    play_nccl(r, played)
    start = time.monotonic()
    while any(g.error is None for g in r.groups) and time.monotonic() - start < SLACK_S:
        time.sleep(0.01)
    assert time.monotonic() - start < 2, "the mismatch waited for the op's timeout"
    for group in r.groups:
        assert "different ops or arguments" in str(group.error)
        assert "shape:" in str(group.error)


def test_the_check_can_be_turned_off(
    ranks: Callable[..., Ranks], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(mismatch.CHECK_ENV, "0")
    r = ranks(1)
    r.run(lambda _, g: g.allreduce([DeviceArray((8,), "float32")], AllReduceOptions()))
    assert checks(r.cupys[0]) == []
    assert not [e for e in r.cupys[0].trace.named("memcpyAsync") if e.args[3] == H2D]


def test_a_checked_group_skips_the_check_it_makes_itself(ranks: Callable[..., Ranks]) -> None:
    """``check_args=True`` compares every call before it: no second check on the GPU."""
    r = ranks(1)
    r.groups[0].skip_agreement()
    r.run(lambda _, g: g.allreduce([DeviceArray((8,), "float32")], AllReduceOptions()))
    assert checks(r.cupys[0]) == []


def test_agree_compares_the_given_op_even_where_the_group_skips_its_checks(
    ranks: Callable[..., Ranks],
) -> None:
    """``agree`` hands NCCL the words of the op it names, on the caller's stream, and nothing
    else; a group across GPUs calls it on its leaders, whose own ops skip their checks."""
    r = ranks(2)
    for g in r.groups:
        g.skip_agreement()
    xs = [DeviceArray((6,), "float64") for _ in range(2)]
    wait = timedelta(seconds=5)
    know(
        r,
        lambda rank, g: g.agree("reducescatter", xs[rank], -1, ReduceOp.AVG, wait),
        lambda rank, g: g.agree("broadcast", xs[rank], 0, None, wait),
        lambda rank, g: g.agree("broadcast", xs[rank], 1, None, wait),
    )
    played = hold_checks(r)
    r.run(lambda rank, g: g.agree("reducescatter", xs[rank], -1, ReduceOp.AVG, wait))
    for rank, cupy in enumerate(r.cupys):
        ((call, copy, _),) = checks(cupy)
        words = cupy.uploaded(call.args[0], call.args[2])
        fields = signature.of_call("reducescatter", 0, xs[rank], -1, ReduceOp.AVG)
        assert words[1 : mismatch.WORDS].tolist() == fields[: mismatch.FIELDS]
        assert call.args[5] == caller_stream(0) and copy.args[4] == caller_stream(0)
        assert not cupy.trace.named("reduce") and len(cupy.trace.named("allReduce")) == 1
    play_nccl(r, played)
    r.run(lambda _, g: g.allreduce([DeviceArray((8,), "float32")], AllReduceOptions()))
    assert all(len(checks(c)) == 1 for c in r.cupys), "the op itself stays unchecked"

    r.run(lambda rank, g: g.agree("broadcast", xs[rank], rank, None, wait))
    play_nccl(r, played)
    heard: list[list[str]] = [[], []]
    for rank, g in enumerate(r.groups):
        g.on_failure(partial(_hear, heard[rank]))
    errors = r.run(lambda _, g: _next_op_error(g))
    for rank, error in enumerate(errors):
        assert isinstance(error, CollectiveError) and "root:" in str(error)
        assert len(heard[rank]) == 1 and "root:" in heard[rank][0], heard


def test_the_results_go_round_a_ring_of_64_slots_each_copied_to_its_own_host_words(
    ranks: Callable[..., Ranks],
) -> None:
    """Each check reduces into the next slot of the ring and copies that slot down; after
    the 64th it starts again at the first, whose result has been read by then."""
    r = ranks(2)
    x = [DeviceArray((8,), "float32") for _ in range(2)]
    for _ in range(mismatch.SLOTS + 2):
        r.run(lambda rank, g: g.allreduce([x[rank]], AllReduceOptions()))
    for cupy in r.cupys:
        made = checks(cupy)
        results = [call.args[1] for call, _, _ in made]
        hosts = [copy.args[0] for _, copy, _ in made]
        events = [event.args[0] for _, _, event in made]
        for column in (results, hosts, events):
            assert len(set(column[: mismatch.SLOTS])) == mismatch.SLOTS
            assert column[mismatch.SLOTS :] == column[:2]
        assert all(copy.args[1] == call.args[1] for call, copy, _ in made)
    assert all(g.error is None for g in r.groups)
