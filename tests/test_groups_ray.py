"""Subgroups, backend registration, group listing and async ops across groups, in Ray actors."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import ray
import torch

import collective as col
from collective.groups.gloo.group import GlooGroup
from collective.types import AllReduceOptions
from collective.work import Work
from tests.conftest import RAY_TIMEOUT_S, live_groups, run_all, unique_name

pytestmark = pytest.mark.usefixtures("no_leaks")


def _init(world_size: int, rank: int, name: str, backend: str = "gloo") -> int:
    col.init_collective_group(world_size, rank, backend=backend, group_name=name)
    return col.get_rank(name)


def _destroy(*names: str) -> list[bool]:
    for name in names:
        col.destroy_collective_group(name)
    return [col.is_group_initialized(name) for name in names]


# --- subgroups ----------------------------------------------------------------------------


def _subgroups(rank: int, parent: str) -> dict[str, Any]:
    """Make {3, 1} (in that order) and {0, 2} out of four ranks; use both; leave both."""
    res: dict[str, Any] = {}
    odd = col.new_group([3, 1], parent=parent)
    even = col.new_group([0, 2], group_name=f"{parent}-even", parent=parent)
    res["names"] = (odd, even)
    mine = odd or even
    assert mine is not None
    res["identity"] = (col.get_rank(mine), col.get_collective_group_size(mine))
    x = np.full(3, 10.0**rank)
    col.allreduce(x, mine)
    res["allreduce"] = x.tolist()
    y = torch.full((2,), float(rank))
    col.broadcast(y, 0, mine)
    res["broadcast"] = y.tolist()
    parts = [np.zeros(1, np.int64) for _ in range(2)]
    col.allgather(parts, np.array([rank]), mine)
    res["allgather"] = [int(p[0]) for p in parts]
    z = np.array([float(rank)])
    col.allreduce(z, parent)  # the parent still works beside its subgroups
    res["parent"] = z.tolist()
    res["after"] = _destroy(mine)
    return res


def test_subgroups_follow_the_order_of_ranks(members: list) -> None:
    parent = unique_name("parent")
    assert run_all(members, _init, [4] * 4, list(range(4)), [parent] * 4) == [0, 1, 2, 3]
    try:
        results = run_all(members, _subgroups, list(range(4)), [parent] * 4)
    finally:
        run_all(members, _destroy, [parent] * 4)
    odd_name = results[1]["names"][0]
    even_name = f"{parent}-even"
    assert odd_name.startswith(f"{parent}.sub0-") and len(odd_name) == len(parent) + 14
    for rank, res in enumerate(results):
        if rank % 2:
            assert res["names"] == (odd_name, None), rank
            assert res["identity"] == ([3, 1].index(rank), 2)
            assert res["allreduce"] == [1010.0] * 3
            assert res["broadcast"] == [3.0, 3.0]
            assert res["allgather"] == [3, 1]
        else:
            assert res["names"] == (None, even_name), rank
            assert res["identity"] == (rank // 2, 2)
            assert res["allreduce"] == [101.0] * 3
            assert res["broadcast"] == [0.0, 0.0]
            assert res["allgather"] == [0, 2]
        assert res["parent"] == [6.0]
        assert res["after"] == [False]


def _bad_subgroup(parent: str, ranks: Any) -> tuple[str, str]:
    try:
        col.new_group(ranks, parent=parent)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "none", ""


@pytest.mark.parametrize(
    "ranks", [[0, 4], [1, 1], [], [-1, 0], "01"], ids=["outside", "repeat", "empty", "neg", "str"]
)
def test_new_group_rejects_ranks_on_every_member(members: list, ranks: Any) -> None:
    parent = unique_name("badsub")
    run_all(members, _init, [4] * 4, list(range(4)), [parent] * 4)
    try:
        results = run_all(members, _bad_subgroup, [parent] * 4, [ranks] * 4)
    finally:
        run_all(members, _destroy, [parent] * 4)
    expected = "ArgumentTypeError" if isinstance(ranks, str) else "ArgumentValueError"
    for kind, message in results:
        assert kind == expected
        assert "ranks" in message


def _subgroup_of_new_parent(rank: int, parent: str) -> dict[str, Any]:
    """Make a subgroup, re-create its parent while rank 0 keeps it, and make another."""
    timeout = timedelta(seconds=10)
    col.init_collective_group(2, rank, backend="gloo", group_name=parent, timeout=timeout)
    old = col.new_group([0, 1], parent=parent)
    assert old is not None
    col.destroy_collective_group(parent)
    if rank == 1:
        col.destroy_collective_group(old)
    col.init_collective_group(2, rank, backend="gloo", group_name=parent, timeout=timeout)
    start, new = time.monotonic(), None
    try:
        new = col.new_group([0, 1], parent=parent)
        took = time.monotonic() - start
        assert new is not None
        x = np.array([rank + 1.0])
        col.allreduce(x, new)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "took": time.monotonic() - start}
    finally:
        held = col.is_group_initialized(old)
        _destroy(parent, old, *([new] if new else []))
    return {"names": (old, new), "took": took, "sum": x.tolist(), "old held": held}


def test_subgroups_of_a_recreated_parent_never_collide_with_the_old_ones(members: list) -> None:
    parent = unique_name("reparent")
    results = run_all(members[:2], _subgroup_of_new_parent, [0, 1], [parent] * 2)
    print(f"\nnew_group on a re-created parent took {[round(r['took'], 2) for r in results]} s")
    for rank, res in enumerate(results):
        assert "error" not in res, (rank, res)
        old, new = res["names"]
        assert old != new, res
        assert old.startswith(f"{parent}.sub0-") and new.startswith(f"{parent}.sub0-"), res
        assert res["names"] == results[0]["names"]
        assert res["sum"] == [3.0]
        assert res["old held"] == (rank == 0)
        assert res["took"] < 5.0, res


def _unbuildable(rank: int, parent: str, case: str) -> tuple[str, str, float]:
    """Make a subgroup that one member cannot build; return how it failed there, and when."""
    col.init_collective_group(
        2, rank, backend="gloo", group_name=parent, timeout=timedelta(seconds=15)
    )
    taken = f"{parent}-taken"
    col.new_group([0], group_name=taken, parent=parent)  # a group named so, on rank 0 only
    ranks = [0, 1] if case == "taken" or rank == 0 else [1, 0]
    start = time.monotonic()
    try:
        col.new_group(ranks, group_name=taken if case == "taken" else None, parent=parent)
        outcome = ("", "no error")
    except Exception as exc:
        outcome = (type(exc).__name__, str(exc))
    took = time.monotonic() - start
    _destroy(taken, parent)
    return (*outcome, took)


@pytest.mark.parametrize("case", ["taken", "ranks"])
def test_a_subgroup_one_member_cannot_build_fails_at_once_on_every_member(
    members: list, case: str
) -> None:
    parent = unique_name(f"unbuildable-{case}")
    results = run_all(members[:2], _unbuildable, [0, 1], [parent] * 2, [case] * 2)
    print(f"\nunbuildable subgroup ({case}): raised after {[round(r[2], 2) for r in results]} s")
    for rank, (kind, message, took) in enumerate(results):
        assert took < 5.0, (rank, kind, message, took)
        if case == "ranks":
            assert kind == "ArgumentValueError" and "same ranks" in message, (rank, message)
        elif rank == 0:
            assert kind == "CollectiveError" and "already initialized" in message, message
        else:
            assert kind == "CollectiveError" and "parent rank 0 failed" in message, message


# --- async ops across groups -----------------------------------------------------------------


def _overlap(rank: int, first: str, second: str) -> dict[str, Any]:
    big = torch.full((1 << 20,), float(rank + 1))
    work = col.allreduce(big, first, async_op=True)
    assert work is not None
    small = np.array([rank + 1.0])
    assert col.allreduce(small, second) is None
    done_before_wait = work.is_completed()
    work.wait()
    return {
        "type": isinstance(work, Work),
        "big": [big[0].item(), big[-1].item()],
        "small": small.tolist(),
        "done": (done_before_wait in (True, False), work.is_completed(), work.exception()),
    }


def test_async_allreduce_overlaps_a_sync_op_on_another_group(members: list) -> None:
    first, second = unique_name("a"), unique_name("b")
    pair = members[:2]
    run_all(pair, _init, [2, 2], [0, 1], [first] * 2)
    run_all(pair, _init, [2, 2], [0, 1], [second] * 2)
    try:
        results = run_all(pair, _overlap, [0, 1], [first] * 2, [second] * 2)
    finally:
        run_all(pair, _destroy, [first] * 2, [second] * 2)
    for res in results:
        assert res == {"type": True, "big": [3.0, 3.0], "small": [3.0], "done": (True, True, None)}


# --- backend registry -------------------------------------------------------------------------


class CountingGloo(GlooGroup):
    """A vendor-style backend for the tests: gloo underneath, counting its allreduces."""

    @classmethod
    def backend(cls) -> str:
        return "counting_gloo"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.allreduces = 0

    def allreduce(self, tensors: Any, options: AllReduceOptions) -> Work:
        self.allreduces += 1
        return super().allreduce(tensors, options)


def _use_registered(name: str) -> tuple[str, str, list[float], int]:
    x = np.array([1.0, 2.0])
    col.allreduce(x, name)
    col.allreduce(x, name)
    group = col.get_group_handle(name)
    assert isinstance(group, CountingGloo), type(group)
    return type(group).__name__, group.backend_name(), x.tolist(), group.allreduces


def test_backend_registered_on_the_driver_reaches_the_actors(members: list) -> None:
    col.register_collective_backend("counting_gloo", CountingGloo)
    pair = members[:2]
    initialized, declared = unique_name("reg-init"), unique_name("reg-decl")
    run_all(pair, _init, [2, 2], [0, 1], [initialized] * 2, ["COUNTING_GLOO"] * 2)
    col.declare_collective_group(
        pair, world_size=2, ranks=[1, 0], backend="counting_gloo", group_name=declared
    )
    try:
        for name in (initialized, declared):
            results = run_all(pair, _use_registered, [name] * 2)
            assert results == [("CountingGloo", "counting_gloo", [4.0, 8.0], 2)] * 2
        assert col.get_collective_groups(pair, backend="counting_gloo") == sorted(
            [initialized, declared]
        )
    finally:
        run_all(pair, _destroy, [initialized] * 2, [declared] * 2)


REGISTER_ERRORS: dict[str, tuple[Any, Any, type[Exception], str]] = {
    "builtin": ("gloo", CountingGloo, ValueError, "name"),
    "empty": ("", CountingGloo, ValueError, "name"),
    "not_a_group": ("x", dict, TypeError, "group_cls"),
    "name_not_str": (3, CountingGloo, TypeError, "name"),
}


@pytest.mark.parametrize("case", list(REGISTER_ERRORS))
def test_register_rejects_bad_arguments(ray_cluster: None, case: str) -> None:
    name, cls, error, argument = REGISTER_ERRORS[case]
    with pytest.raises(error) as raised:
        col.register_collective_backend(name, cls)
    assert str(raised.value).startswith(argument)


def _unknown_backend(name: str) -> str:
    try:
        col.init_collective_group(1, 0, backend="never_registered", group_name=name)
    except ValueError as exc:
        return str(exc)
    return ""


def test_unregistered_backend_name_is_a_clear_error(members: list) -> None:
    message = ray.get(
        members[0].run.remote(_unknown_backend, unique_name("unk")), timeout=RAY_TIMEOUT_S
    )
    assert "backend" in message
    assert "never_registered" in message


# --- listing and destroying every group -------------------------------------------------------


def _local_groups(backend: str | None = None) -> list[str]:
    return col.get_collective_groups(backend=backend)


def test_list_get_and_destroy_all_groups(members: list) -> None:
    pair, trio = members[:2], members[1:4]
    a, b = unique_name("la"), unique_name("lb")
    run_all(pair, _init, [2, 2], [0, 1], [a] * 2)
    col.declare_collective_group(trio, world_size=3, ranks=[0, 1, 2], backend="gloo", group_name=b)
    listed = col.list_collective_groups()
    assert a in listed and b in listed
    assert col.get_collective_groups(pair) == [a]
    assert col.get_collective_groups(members[1:2]) == sorted([a, b])
    assert col.get_collective_groups(members[1:2], backend="nccl") == []
    assert run_all(pair, _local_groups) == [[a], [a]]
    col.destroy_all_collective_groups()
    assert live_groups() == []
    assert a not in col.list_collective_groups()
    run_all(pair, _destroy, [a] * 2)
    assert run_all(pair, _local_groups) == [[], []]
