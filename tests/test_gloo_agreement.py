"""The Gloo path's agreement at 3 and 4 ranks, where the records go to rank 0 and back.

From ``agree.GATHER_FROM`` ranks on, each op's records are gathered at rank 0 and
broadcast back instead of allgathered round a ring. These tests hold what the
allgather gave: every rank raises the same error and nothing is written when one
rank differs, whether the op's data rode in the records or not; an alltoall's
elements per peer are checked from the records, or from an exchange of their own
when they do not fit; a rank that never comes ends the op within its timeout on
every rank, whichever stage it was missing from. Ranks are threads (``run_ranks``).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch

from collective.groups import progress
from collective.groups.gloo import agree
from collective.groups.gloo.group import GlooGroup
from collective.types import (
    AllReduceOptions,
    AllToAllOptions,
    ArgumentValueError,
    BroadcastOptions,
    CollectiveError,
)
from tests.test_gloo_group import Absence, run_ranks

WORLD_SIZES = [3, 4]
LARGE = 1 << 16
"""Elements of a float32 op too big to ride in the records at any world size here."""


def test_the_exchange_changes_at_three_ranks() -> None:
    assert agree.GATHER_FROM == 3


@pytest.mark.parametrize("count", [8, LARGE], ids=["carried", "not-carried"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_one_rank_unlike_the_others_raises_on_every_rank_and_writes_nothing(
    world_size: int, count: int
) -> None:
    odd = world_size - 1

    def fn(group: GlooGroup, rank: int) -> dict[str, Any]:
        x = np.full(count, rank + 1, dtype=np.float64 if rank == odd else np.float32)
        before = x.tobytes()
        try:
            group.allreduce([x], AllReduceOptions())
        except ArgumentValueError as exc:
            error = str(exc)
        else:
            error = ""
        after = np.ones(4, dtype=np.float32)
        group.allreduce([after], AllReduceOptions())
        return {"error": error, "unchanged": x.tobytes() == before, "after": after.tolist()}

    results = run_ranks(world_size, fn)
    others = list(range(odd))
    expected = f"dtype: float32 on ranks {others}, float64 on rank {odd}"
    for rank, result in enumerate(results):
        assert expected in result["error"], (rank, result["error"])
        assert result["unchanged"], f"rank {rank}'s buffer was written"
        assert result["after"] == [float(world_size)] * 4, (rank, result["after"])
    assert len({r["error"] for r in results}) == 1


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_carried_and_large_ops_give_every_rank_the_result(world_size: int) -> None:
    def fn(group: GlooGroup, rank: int) -> list[list[float]]:
        small = np.full(8, rank + 1.0, dtype=np.float32)
        group.allreduce([small], AllReduceOptions())
        large = np.full(LARGE, float(rank), dtype=np.float32) if rank == 1 else None
        large = large if large is not None else np.zeros(LARGE, dtype=np.float32)
        group.broadcast([large], BroadcastOptions(root_rank=1))
        return [small[:2].tolist(), [float(large.min()), float(large.max())]]

    total = float(sum(range(1, world_size + 1)))
    for rank, (small, large) in enumerate(run_ranks(world_size, fn)):
        assert small == [total, total], rank
        assert large == [1.0, 1.0], rank


def _alltoall(group: GlooGroup, rank: int, world_size: int, skew: bool) -> dict[str, Any]:
    """Rank r sends r * 10 + peer to each peer; with ``skew``, rank 2 sends one element more."""
    sends = [
        torch.full((2 if skew and rank == 2 and peer == 0 else 1,), float(rank * 10 + peer))
        for peer in range(world_size)
    ]
    outs = [torch.full((1,), -1.0) for _ in range(world_size)]
    try:
        group.alltoall(outs, sends, AllToAllOptions())
    except ArgumentValueError as exc:
        return {"error": str(exc), "outs": [o.tolist() for o in outs]}
    return {"error": "", "outs": [o.tolist() for o in outs]}


@pytest.mark.parametrize("fits", [True, False], ids=["sizes-in-records", "sizes-exchanged"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_alltoall_sizes_pair_up_or_raise_on_every_rank(
    world_size: int, fits: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not fits:
        # Records of 8 bytes of data: no table of elements per peer fits in them.
        monkeypatch.setattr(agree, "CARRY_BUDGET", 8 * world_size)

    def fn(group: GlooGroup, rank: int) -> list[dict[str, Any]]:
        return [_alltoall(group, rank, world_size, skew) for skew in (True, False)]

    results = run_ranks(world_size, fn)
    for rank, (skewed, paired) in enumerate(results):
        assert "rank 0 expects 1 elements from rank 2, which sends it 2" in skewed["error"], (
            rank,
            skewed["error"],
        )
        assert skewed["outs"] == [[-1.0]] * world_size, "an output was written"
        assert paired["error"] == "", paired["error"]
        assert paired["outs"] == [[float(peer * 10 + rank)] for peer in range(world_size)]


@pytest.mark.parametrize("absent", [0, 2], ids=["rank-0-absent", "rank-2-absent"])
def test_a_rank_that_never_comes_ends_the_op_within_its_timeout_on_every_rank(
    absent: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Which ranks answer is under test, not how soon: three ranks time out at once here,
    # and the absent rank's watch thread answers each of them in turn (a CI run under
    # load once saw it miss a 2 s wait).
    monkeypatch.setattr(progress, "ANSWER_WAIT", timedelta(seconds=6))
    monkeypatch.setattr(progress, "LEAST_ANSWER_WAIT", progress.ANSWER_WAIT)
    world_size, timeout = 4, timedelta(seconds=2)
    absence = Absence(present=world_size - 1)

    def fn(group: GlooGroup, rank: int) -> tuple[str, float] | None:
        if rank == absent:
            absence.stay()
            return None
        try:
            start = time.monotonic()
            with pytest.raises(CollectiveError) as raised:
                group.allreduce([np.ones(8)], AllReduceOptions(timeout=timeout))
            return str(raised.value), time.monotonic() - start
        finally:
            absence.done()

    outcomes = [o for o in run_ranks(world_size, fn) if o is not None]
    assert len(outcomes) == world_size - 1
    for message, took in outcomes:
        assert took < (timeout + progress.ANSWER_WAIT).total_seconds() + 1.5, (took, message)
    named = [m for m, _ in outcomes if "ranks that never joined it" in m]
    assert named, [m for m, _ in outcomes]
    for message in named:
        assert f"ranks that never joined it: [{absent}]" in message, message
