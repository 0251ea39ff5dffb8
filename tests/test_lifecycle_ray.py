"""Group lifecycle in Ray actors: many groups, overlap, permuted ranks, re-creation, cleanup."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
import ray

import collective as col
from tests.conftest import RAY_TIMEOUT_S, live_groups, run_all, unique_name

pytestmark = pytest.mark.usefixtures("no_leaks")


def _init(world_size: int, rank: int, name: str) -> int:
    col.init_collective_group(world_size, rank, backend="gloo", group_name=name)
    return col.get_rank(name)


def _destroy(*names: str) -> list[bool]:
    for name in names:
        col.destroy_collective_group(name)
    return [col.is_group_initialized(name) for name in names]


def _allreduce_value(name: str, value: float) -> float:
    x = np.full(3, value, dtype=np.float64)
    col.allreduce(x, name)
    return float(x[0])


def test_several_groups_in_one_actor(members: list) -> None:
    names = [unique_name("multi") for _ in range(3)]
    for name in names:
        assert run_all(members, _init, [4] * 4, list(range(4)), [name] * 4) == [0, 1, 2, 3]

    def interleave(rank: int) -> list[float]:
        return [_allreduce_value(name, (k + 1) * (rank + 1)) for k, name in enumerate(names)]

    results = run_all(members, interleave, list(range(4)))
    assert results == [[10.0, 20.0, 30.0]] * 4
    assert run_all(members, _destroy, *[[n] * 4 for n in names]) == [[False] * 3] * 4


def test_overlapping_groups(members: list) -> None:
    a, b, c = members[:3]
    ab, bc = unique_name("ab"), unique_name("bc")
    refs = [a.run.remote(_init, 2, 0, ab), b.run.remote(_init, 2, 1, ab)]
    refs += [b.run.remote(_init, 2, 0, bc), c.run.remote(_init, 2, 1, bc)]
    assert ray.get(refs, timeout=RAY_TIMEOUT_S) == [0, 1, 0, 1]

    def both(value: float) -> list[float]:
        return [_allreduce_value(ab, value), _allreduce_value(bc, value)]

    refs = [
        a.run.remote(_allreduce_value, ab, 1.0),
        b.run.remote(both, 10.0),
        c.run.remote(_allreduce_value, bc, 100.0),
    ]
    assert ray.get(refs, timeout=RAY_TIMEOUT_S) == [11.0, [11.0, 110.0], 110.0]
    refs = [a.run.remote(_destroy, ab), b.run.remote(_destroy, ab, bc), c.run.remote(_destroy, bc)]
    ray.get(refs, timeout=RAY_TIMEOUT_S)


def test_permuted_ranks_and_p2p_use_the_groups_own_ranks(members: list) -> None:
    straight, permuted = unique_name("straight"), unique_name("perm")
    order = [3, 1, 0, 2]
    run_all(members, _init, [4] * 4, [0, 1, 2, 3], [straight] * 4)
    run_all(members, _init, [4] * 4, order, [permuted] * 4)

    def exchange(actor_index: int) -> dict[str, list[float]]:
        rank = col.get_rank(permuted)
        got: dict[str, list[float]] = {}
        x = np.full(2, 100.0 + actor_index)
        col.broadcast(x, src_rank=0, group_name=permuted)
        got["broadcast"] = x.tolist()
        parts = [np.zeros(1) for _ in range(4)]
        col.allgather(parts, np.array([float(actor_index)]), permuted)
        got["allgather"] = [float(p[0]) for p in parts]
        msg = np.array([float(actor_index)])
        if rank % 2 == 0:
            col.send(msg, dst_rank=rank + 1, group_name=permuted)
        else:
            col.recv(msg, src_rank=rank - 1, group_name=permuted)
        got["p2p"] = msg.tolist()
        y = np.array([float(actor_index)])
        col.broadcast(y, src_rank=0, group_name=straight)
        got["straight"] = y.tolist()
        return got

    results = run_all(members, exchange, list(range(4)))
    actor_of_rank = {rank: i for i, rank in enumerate(order)}
    for i, got in enumerate(results):
        assert got["broadcast"] == [100.0 + actor_of_rank[0]] * 2
        assert got["allgather"] == [float(actor_of_rank[r]) for r in range(4)]
        rank = order[i]
        sender = actor_of_rank[rank - 1] if rank % 2 else i
        assert got["p2p"] == [float(sender)]
        assert got["straight"] == [0.0]
    run_all(members, _destroy, [straight] * 4, [permuted] * 4)


def test_destroy_and_recreate_twenty_times_from_the_driver(members: list) -> None:
    name = unique_name("again")
    pair = members[:2]
    for cycle in range(20):
        run_all(pair, _init, [2, 2], [0, 1], [name, name])
        assert run_all(pair, _allreduce_value, [name, name], [cycle, 1.0]) == [cycle + 1.0] * 2
        assert run_all(pair, _destroy, [name, name]) == [[False], [False]]
        assert live_groups() == []


def test_destroy_and_recreate_twenty_times_without_driver_sync(members: list) -> None:
    name = unique_name("loop")

    def loop(rank: int) -> list[float]:
        sums = []
        for cycle in range(20):
            col.init_collective_group(2, rank, backend="gloo", group_name=name)
            sums.append(_allreduce_value(name, cycle * (rank + 1)))
            col.destroy_collective_group(name)
        return sums

    expected = [cycle * 3.0 for cycle in range(20)]
    assert run_all(members[:2], loop, [0, 1]) == [expected, expected]


def test_declared_group_reports_rank_before_use_and_builds_lazily(members: list) -> None:
    name = unique_name("declared")
    ranks = [2, 0, 3, 1]
    col.declare_collective_group(
        members, world_size=4, ranks=ranks, backend="gloo", group_name=name
    )

    def query() -> tuple[int, int, bool]:
        return (
            col.get_rank(name),
            col.get_collective_group_size(name),
            col.is_group_initialized(name),
        )

    assert run_all(members, query) == [(r, 4, False) for r in ranks]

    def use() -> tuple[float, bool]:
        value = _allreduce_value(name, float(col.get_rank(name)))
        return value, col.is_group_initialized(name)

    assert run_all(members, use) == [(6.0, True)] * 4
    run_all(members, _destroy, [name] * 4)


def test_declared_group_destroyed_from_the_driver_before_use(members: list) -> None:
    name = unique_name("unused")
    col.create_collective_group(members[:2], 2, [0, 1], backend="gloo", group_name=name)
    assert len(live_groups()) == 1
    col.destroy_collective_group(name)
    assert live_groups() == []

    def query() -> int:
        return col.get_rank(name)

    assert run_all(members[:2], query) == [-1, -1]


def test_destroy_from_the_driver_removes_the_store_of_a_live_group(members: list) -> None:
    name = unique_name("live")
    run_all(members[:2], _init, [2, 2], [0, 1], [name, name])
    col.destroy_collective_group(name)
    assert live_groups() == []
    run_all(members[:2], _destroy, [name, name])


def test_queries_on_unknown_group(members: list) -> None:
    def query() -> tuple[int, int, bool]:
        name = "never-made"
        return (
            col.get_rank(name),
            col.get_collective_group_size(name),
            col.is_group_initialized(name),
        )

    assert run_all(members[:1], query) == [(-1, -1, False)]
    col.destroy_collective_group("never-made")


def test_world_size_one_group(members: list) -> None:
    name = unique_name("solo")

    def solo() -> list[float]:
        col.init_collective_group(1, 0, backend="gloo", group_name=name)
        x = np.array([1.5, 2.5])
        col.allreduce(x, name)
        col.barrier(name)
        col.destroy_collective_group(name)
        return x.tolist()

    assert run_all(members[:1], solo) == [[1.5, 2.5]]


def test_recreate_while_an_old_member_still_holds_the_group_names_that_member(
    members: list,
) -> None:
    name = unique_name("held")
    pair = members[:2]
    run_all(pair, _init, [2, 2], [0, 1], [name, name])

    def destroy_then_init_again() -> tuple[str, str]:
        col.destroy_collective_group(name)
        try:
            col.init_collective_group(2, 1, "gloo", name, timeout=timedelta(seconds=3))
        except col.CollectiveError as exc:
            return type(exc).__name__, str(exc)
        return "no error", ""

    kind, message = ray.get(pair[1].run.remote(destroy_then_init_again), timeout=RAY_TIMEOUT_S)
    assert kind == "CollectiveTimeoutError"
    assert "still held by ranks [0]" in message
    assert "destroy_collective_group" in message
    assert ray.get(pair[0].run.remote(_destroy, name), timeout=RAY_TIMEOUT_S) == [False]
