"""Elastic groups in Ray: survivors shrink a group and go on; newcomers grow it back.

Real actors are killed with ``ray.kill``; every survivor's result is asserted.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray

import collective as col
from collective.rendezvous.actor import STORE_ACTOR_NAME
from tests.conftest import (
    RAY_TIMEOUT_S,
    Member,
    allreduce_until_failure,
    live_groups,
    run_all,
    unique_name,
    wait_for_files,
)

TIMEOUT = timedelta(seconds=10)


@pytest.fixture
def fresh(ray_cluster: None) -> Iterator[list[Any]]:
    """Give a test its own actors (tests kill some), and kill what is left afterwards."""
    made: list[Any] = []

    def make(count: int) -> list[Any]:
        actors = [Member.remote() for _ in range(count)]
        ray.get([a.actor_id.remote() for a in actors], timeout=RAY_TIMEOUT_S)
        made.extend(actors)
        return actors

    yield make  # type: ignore[misc]
    for actor in made:
        ray.kill(actor)


def _init(world_size: int, rank: int, name: str) -> int:
    col.init_collective_group(world_size, rank, "gloo", name, timeout=TIMEOUT)
    return col.get_rank(name)


def _allreduce(name: str, value: float) -> tuple[int, int, float]:
    x = np.full(16, value)
    col.allreduce(x, name)
    return col.get_rank(name), col.get_collective_group_size(name), float(x[0])


def _shrink(name: str, exclude: list[int] | None = None) -> tuple[int, int, float]:
    start = time.monotonic()
    rank = col.shrink_group(name, exclude=exclude, timeout=TIMEOUT)
    return rank, col.get_collective_group_size(name), time.monotonic() - start


def _outcome(fn: Any, *args: Any, **kwargs: Any) -> str:
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "returned"


def _destroy(name: str) -> bool:
    col.destroy_collective_group(name)
    return col.is_group_initialized(name)


def _group(actors: list[Any], name: str) -> None:
    n = len(actors)
    assert run_all(actors, _init, [n] * n, range(n), [name] * n) == list(range(n))


def test_survivors_of_a_death_while_idle_shrink_and_keep_the_old_order(
    fresh: Any, no_leaks: None
) -> None:
    actors = fresh(4)
    name = unique_name("shrink")
    _group(actors, name)
    ray.kill(actors[1])
    survivors = [actors[0], actors[2], actors[3]]
    shrunk = run_all(survivors, _shrink, [name] * 3)
    assert [(rank, size) for rank, size, _ in shrunk] == [(0, 3), (1, 3), (2, 3)]
    results = run_all(survivors, _allreduce, [name] * 3, [1.0, 3.0, 4.0])
    assert results == [(0, 3, 8.0), (1, 3, 8.0), (2, 3, 8.0)]
    print(f"\nshrink took {[round(t, 3) for _, _, t in shrunk]} s")
    assert run_all(survivors, _destroy, [name] * 3) == [False] * 3


def _until_failure_then_shrink(name: str, started: str) -> tuple[str, int, float, float]:
    failed_at, kind, _ = allreduce_until_failure(name, started)
    rank = col.shrink_group(name, timeout=TIMEOUT)
    shrunk_at = time.time()
    x = np.ones(8)
    col.allreduce(x, name)
    return kind, rank, shrunk_at - failed_at, float(x[0])


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_survivors_of_a_death_mid_op_shrink_within_half_a_second(
    fresh: Any, no_leaks: None, transport: str, tmp_path: Path
) -> None:
    actors = fresh(4)
    name = unique_name("midop")
    n = 4

    def init(rank: int) -> None:
        col.init_collective_group(n, rank, "gloo", name, timeout=TIMEOUT, cpu_transport=transport)

    ray.get([a.run.remote(init, r) for r, a in enumerate(actors)], timeout=RAY_TIMEOUT_S)
    survivors = [actors[0], actors[1], actors[3]]
    started = [str(tmp_path / f"survivor{i}") for i in range(3)]
    refs = [
        a.run.remote(_until_failure_then_shrink, name, s)
        for a, s in zip(survivors, started, strict=True)
    ]
    wait_for_files(started)
    ray.kill(actors[2])
    results = ray.get(refs, timeout=RAY_TIMEOUT_S)
    assert [r[1] for r in results] == [0, 1, 2], results
    assert all(r[0] == "CollectiveError" and r[3] == 3.0 for r in results), results
    took = [round(r[2], 3) for r in results]
    print(f"\n{transport}: from each survivor's error to its shrunk group: {took} s")
    assert max(took) < 5.0, took
    run_all(survivors, _destroy, [name] * 3)


def _next_op(name: str) -> str:
    return _outcome(col.allreduce, np.ones(4), name)


def test_an_excluded_live_rank_gets_a_clear_error_and_destroys_the_group(
    fresh: Any, no_leaks: None
) -> None:
    actors = fresh(4)
    name = unique_name("exclude")
    _group(actors, name)
    shrunk = run_all(actors[:3], _shrink, [name] * 3, [[3]] * 3)
    assert [(r, s) for r, s, _ in shrunk] == [(0, 3), (1, 3), (2, 3)]
    message = ray.get(actors[3].run.remote(_next_op, name), timeout=RAY_TIMEOUT_S)
    assert message.startswith("GroupNotFoundError"), message
    assert "rank 3 was excluded" in message, message
    assert ray.get(actors[3].run.remote(_destroy, name), timeout=RAY_TIMEOUT_S) is False
    assert run_all(actors[:3], _allreduce, [name] * 3, [1.0] * 3) == [(r, 3, 3.0) for r in range(3)]
    run_all(actors[:3], _destroy, [name] * 3)


def test_members_that_disagree_on_exclude_get_the_same_error(fresh: Any, no_leaks: None) -> None:
    actors = fresh(3)
    name = unique_name("disagree")
    _group(actors, name)
    refs = [actors[0].run.remote(_outcome, col.shrink_group, name, exclude=[2], timeout=TIMEOUT)]
    time.sleep(0.5)
    refs.append(actors[1].run.remote(_outcome, col.shrink_group, name, exclude=[], timeout=TIMEOUT))
    messages = ray.get(refs, timeout=RAY_TIMEOUT_S)
    for message in messages:
        assert message.startswith("ArgumentValueError"), messages
        assert "every member must make the same call" in message, messages
    bad = ray.get(actors[0].run.remote(_outcome, col.shrink_group, name, exclude=[0]))
    assert bad.startswith("ArgumentValueError") and "caller" in bad, bad
    run_all(actors, _destroy, [name] * 3)


def test_a_live_member_that_never_calls_is_named_at_the_timeout(fresh: Any, no_leaks: None) -> None:
    actors = fresh(3)
    name = unique_name("absent")
    _group(actors, name)
    quick = timedelta(seconds=2)
    refs = [a.run.remote(_outcome, col.shrink_group, name, timeout=quick) for a in actors[:2]]
    messages = ray.get(refs, timeout=RAY_TIMEOUT_S)
    for message in messages:
        assert message.startswith("CollectiveTimeoutError"), messages
        assert "ranks [2] did not call shrink_group" in message, messages
    run_all(actors, _destroy, [name] * 3)


def test_a_second_death_during_the_shrink_is_dropped_too(fresh: Any, no_leaks: None) -> None:
    actors = fresh(4)
    name = unique_name("second")
    _group(actors, name)
    ray.kill(actors[1])
    refs = [a.run.remote(_shrink, name) for a in (actors[0], actors[2])]
    time.sleep(1.0)
    ray.kill(actors[3])
    shrunk = ray.get(refs, timeout=RAY_TIMEOUT_S)
    assert [(r, s) for r, s, _ in shrunk] == [(0, 2), (1, 2)], shrunk
    both = [actors[0], actors[2]]
    assert run_all(both, _allreduce, [name] * 2, [1.0, 2.0]) == [(0, 2, 3.0), (1, 2, 3.0)]
    run_all(both, _destroy, [name] * 2)


def _grow(name: str, world_size: int) -> tuple[int, int]:
    col.grow_group(name, world_size, timeout=TIMEOUT)
    return col.get_rank(name), col.get_collective_group_size(name)


def test_a_newcomer_joins_a_shrunk_group_with_grow(fresh: Any, no_leaks: None) -> None:
    actors = fresh(3)
    name = unique_name("grow")
    _group(actors, name)
    ray.kill(actors[0])
    survivors = actors[1:]
    run_all(survivors, _shrink, [name] * 2)
    newcomer = fresh(1)[0]
    refs = [a.run.remote(_grow, name, 3) for a in survivors]
    refs.append(newcomer.run.remote(_init, 3, 2, name))
    assert ray.get(refs, timeout=RAY_TIMEOUT_S) == [(0, 3), (1, 3), 2]
    everyone = [*survivors, newcomer]
    assert run_all(everyone, _allreduce, [name] * 3, [1.0, 2.0, 3.0]) == [
        (r, 3, 6.0) for r in range(3)
    ]
    run_all(everyone, _destroy, [name] * 3)


def _footprint() -> tuple[int, int]:
    segments = len([n for n in os.listdir("/dev/shm") if n.startswith("collective-")])
    return segments, threading.active_count()


def test_shrink_and_grow_cycles_leak_nothing(fresh: Any, no_leaks: None) -> None:
    actors = fresh(3)
    name = unique_name("cycles")
    _group(actors, name)
    keep = actors[:2]
    before = run_all(keep, _footprint)
    spare = actors[2]
    for cycle in range(4):
        ray.kill(spare)
        assert [r for r, _, _ in run_all(keep, _shrink, [name] * 2)] == [0, 1]
        spare = fresh(1)[0]
        refs = [a.run.remote(_grow, name, 3) for a in keep]
        refs.append(spare.run.remote(_init, 3, 2, name))
        ray.get(refs, timeout=RAY_TIMEOUT_S)
        values = run_all([*keep, spare], _allreduce, [name] * 3, [1.0] * 3)
        assert values == [(r, 3, 3.0) for r in range(3)], (cycle, values)
    after = run_all(keep, _footprint)
    print(f"\n(segments, threads) per survivor before {before} after 4 cycles {after}")
    for (seg0, threads0), (seg1, threads1) in zip(before, after, strict=True):
        assert seg1 <= seg0
        assert threads1 <= threads0 + 2
    assert live_groups() == [name]
    run_all([*keep, spare], _destroy, [name] * 3)


def _subgroup_then_op(name: str) -> str:
    sub = col.new_group([0, 1], parent=name)
    x = np.ones(2)
    if sub is not None:
        col.allreduce(x, sub)
    return sub or ""


def test_subgroups_of_a_shrunk_group_end_and_say_so(fresh: Any, no_leaks: None) -> None:
    actors = fresh(3)
    name = unique_name("parent")
    _group(actors, name)
    subs = run_all(actors, _subgroup_then_op, [name] * 3)
    ray.kill(actors[2])
    run_all(actors[:2], _shrink, [name] * 2)
    for actor, sub in zip(actors[:2], subs[:2], strict=True):
        message = ray.get(actor.run.remote(_next_op, sub), timeout=RAY_TIMEOUT_S)
        assert message.startswith("GroupNotFoundError"), message
        assert message.endswith("was reshaped by shrink_group; create it again to use it"), message
        assert "make it again" not in message, message
        ray.get(actor.run.remote(_destroy, sub), timeout=RAY_TIMEOUT_S)
    again = run_all(actors[:2], _subgroup_then_op, [name] * 2)
    assert all(again), again
    run_all(actors[:2], _destroy, again)
    run_all(actors[:2], _destroy, [name] * 2)


def _declared_op(name: str, value: float) -> tuple[int, int, float]:
    return _allreduce(name, value)


def test_the_driver_shrinks_and_grows_a_declared_group(fresh: Any, no_leaks: None) -> None:
    actors = fresh(4)
    name = unique_name("declared")
    col.declare_collective_group(actors, 4, [0, 1, 2, 3], "gloo", name, timeout=TIMEOUT)
    assert run_all(actors, _declared_op, [name] * 4, [1.0] * 4) == [(r, 4, 4.0) for r in range(4)]
    ray.kill(actors[2])
    ranks = col.shrink_declared_group(actors, name, exclude=[actors[0]])
    assert ranks == [None, 0, None, 1]
    kept = [actors[1], actors[3]]
    assert run_all(kept, _declared_op, [name] * 2, [1.0, 2.0]) == [(0, 2, 3.0), (1, 2, 3.0)]
    message = ray.get(actors[0].run.remote(_next_op, name), timeout=RAY_TIMEOUT_S)
    assert message.startswith("GroupNotFoundError"), message
    newcomer = fresh(1)[0]
    assert col.grow_declared_group([newcomer], name) == [2]
    everyone = [*kept, newcomer]
    assert run_all(everyone, _declared_op, [name] * 3, [1.0] * 3) == [(r, 3, 3.0) for r in range(3)]
    col.destroy_collective_group(name)


def test_bad_arguments_raise_before_anything_is_sent(fresh: Any, no_leaks: None) -> None:
    actors = fresh(2)
    name = unique_name("args")
    _group(actors, name)

    def calls(name: str) -> list[str]:
        return [
            _outcome(col.shrink_group, name, exclude=[5]),
            _outcome(col.shrink_group, name, exclude="1"),
            _outcome(col.shrink_group, name, exclude=[True]),
            _outcome(col.grow_group, name),
            _outcome(col.grow_group, name, 2),
            _outcome(col.grow_group, name, "3"),
            _outcome(col.shrink_group, "no-such-group"),
        ]

    messages = ray.get(actors[0].run.remote(calls, name), timeout=RAY_TIMEOUT_S)
    kinds = [m.split(":")[0] for m in messages]
    assert kinds == [
        "ArgumentValueError",
        "ArgumentTypeError",
        "ArgumentTypeError",
        "ArgumentTypeError",
        "ArgumentValueError",
        "ArgumentTypeError",
        "GroupNotFoundError",
    ], messages
    assert run_all(actors, _allreduce, [name] * 2, [1.0, 2.0]) == [(0, 2, 3.0), (1, 2, 3.0)]
    with pytest.raises(col.CollectiveError, match="made by init_collective_group"):
        col.shrink_declared_group(actors, name)
    run_all(actors, _destroy, [name] * 2)


def test_a_newcomer_that_never_comes_fails_the_grow_by_name_and_the_group_goes_on(
    fresh: Any, no_leaks: None
) -> None:
    actors = fresh(2)
    name = unique_name("nocomer")
    _group(actors, name)
    quick = timedelta(seconds=2)
    refs = [a.run.remote(_outcome, col.grow_group, name, 3, timeout=quick) for a in actors]
    messages = ray.get(refs, timeout=RAY_TIMEOUT_S)
    for message in messages:
        assert message.startswith("CollectiveTimeoutError"), messages
        assert "newcomer ranks [2] did not call init_collective_group(world_size=3)" in message, (
            messages
        )
    assert run_all(actors, _allreduce, [name] * 2, [1.0, 2.0]) == [(0, 2, 3.0), (1, 2, 3.0)]
    run_all(actors, _destroy, [name] * 2)


def test_a_newcomer_that_comes_before_the_grow_waits_for_it(fresh: Any, no_leaks: None) -> None:
    actors = fresh(3)
    name = unique_name("early")
    _group(actors[:2], name)
    early = actors[2].run.remote(_init, 3, 2, name)
    store = ray.get_actor(STORE_ACTOR_NAME)
    deadline = time.monotonic() + RAY_TIMEOUT_S
    while ray.get(store.waiting.remote(name), timeout=RAY_TIMEOUT_S) != [2]:
        assert time.monotonic() < deadline, "the newcomer never came to wait"
        time.sleep(0.05)
    refs = [a.run.remote(_grow, name, 3) for a in actors[:2]]
    assert ray.get([*refs, early], timeout=RAY_TIMEOUT_S) == [(0, 3), (1, 3), 2]
    assert run_all(actors, _allreduce, [name] * 3, [1.0] * 3) == [(r, 3, 3.0) for r in range(3)]
    run_all(actors, _destroy, [name] * 3)


def _grow_outcome(name: str, world_size: int) -> tuple[str, float]:
    message = _outcome(col.grow_group, name, world_size, timeout=TIMEOUT)
    return message, time.time()


def test_a_death_during_a_grow_fails_it_and_the_survivors_shrink(
    fresh: Any, no_leaks: None
) -> None:
    actors = fresh(3)
    name = unique_name("growdeath")
    _group(actors, name)
    refs = [a.run.remote(_grow_outcome, name, 4) for a in actors]
    time.sleep(1.0)
    killed = time.time()
    ray.kill(actors[1])
    results = ray.get([refs[0], refs[2]], timeout=RAY_TIMEOUT_S)
    for message, _ in results:
        assert message.startswith("CollectiveError"), results
        assert "ranks [1] left or died during grow_group; shrink the group first" in message
    took = [round(at - killed, 3) for _, at in results]
    print(f"\nfrom the kill to the failed grow: {took} s")
    assert max(took) < TIMEOUT.total_seconds() / 2, took
    survivors = [actors[0], actors[2]]
    assert [r for r, _, _ in run_all(survivors, _shrink, [name] * 2)] == [0, 1]
    assert run_all(survivors, _allreduce, [name] * 2, [1.0, 2.0]) == [(0, 2, 3.0), (1, 2, 3.0)]
    run_all(survivors, _destroy, [name] * 2)


def test_a_newcomer_without_a_grow_is_told_to_have_the_members_grow(
    fresh: Any, no_leaks: None
) -> None:
    actors = fresh(3)
    name = unique_name("nogrow")
    _group(actors[:2], name)

    def init() -> str:
        return _outcome(col.init_collective_group, 3, 2, "gloo", name, timeout=timedelta(seconds=2))

    message = ray.get(actors[2].run.remote(init), timeout=RAY_TIMEOUT_S)
    assert message.startswith("CollectiveTimeoutError"), message
    assert "its members call grow_group(world_size=3)" in message, message
    run_all(actors[:2], _destroy, [name] * 2)


def _die_once_joined(world_size: int, rank: int, name: str) -> None:
    """Join ``name`` as a newcomer, and let this process die right after the store took it."""
    from collective.registry import backends

    def exit_now(*args: Any, **kwargs: Any) -> None:
        os._exit(1)

    backends.builder = lambda name: exit_now  # type: ignore[assignment, return-value]
    col.init_collective_group(world_size, rank, "gloo", name, timeout=TIMEOUT)


def _grow_failure_then_old_group(name: str, world_size: int) -> tuple[str, float, tuple]:
    message, at = _grow_outcome(name, world_size)
    return message, at, _allreduce(name, float(col.get_rank(name) + 1))


def _assert_grow_failed_on_a_dead_newcomer(results: list, since: float) -> None:
    for message, _, _ in results:
        assert message.startswith("CollectiveError"), results
        assert "newcomer ranks [2] died" in message and "keeps its 2 ranks" in message, results
    took = [round(at - since, 3) for _, at, _ in results]
    print(f"\nfrom the newcomer's death to the failed grow: {took} s")
    assert max(took) < TIMEOUT.total_seconds() / 2, took
    assert [old for _, _, old in results] == [(0, 2, 3.0), (1, 2, 3.0)], results


def test_a_newcomer_that_dies_right_after_it_joins_fails_the_grow_and_the_group_goes_on(
    fresh: Any, no_leaks: None
) -> None:
    """Issue 27 item 4: the grow raises on every member, naming it; the old group works."""
    actors = fresh(3)
    name = unique_name("diejoin")
    _group(actors[:2], name)
    refs = [a.run.remote(_grow_failure_then_old_group, name, 3) for a in actors[:2]]
    time.sleep(1.0)
    newcomer = actors[2].run.remote(_die_once_joined, 3, 2, name)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(newcomer, timeout=RAY_TIMEOUT_S)
    died = time.time()
    _assert_grow_failed_on_a_dead_newcomer(ray.get(refs, timeout=RAY_TIMEOUT_S), died)
    run_all(actors[:2], _destroy, [name] * 2)


def test_a_newcomer_killed_while_it_waits_for_the_grow_fails_it_and_the_group_goes_on(
    fresh: Any, no_leaks: None
) -> None:
    """Issue 27 item 4: a newcomer dead before the grow began fails it at once, by name."""
    actors = fresh(3)
    name = unique_name("diewait")
    _group(actors[:2], name)
    waiting = actors[2].run.remote(_init, 3, 2, name)
    store = ray.get_actor(STORE_ACTOR_NAME)
    deadline = time.monotonic() + RAY_TIMEOUT_S
    while ray.get(store.waiting.remote(name), timeout=RAY_TIMEOUT_S) != [2]:
        assert time.monotonic() < deadline, "the newcomer never came to wait"
        time.sleep(0.05)
    ray.kill(actors[2])
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(waiting, timeout=RAY_TIMEOUT_S)
    started = time.time()
    refs = [a.run.remote(_grow_failure_then_old_group, name, 3) for a in actors[:2]]
    _assert_grow_failed_on_a_dead_newcomer(ray.get(refs, timeout=RAY_TIMEOUT_S), started)
    run_all(actors[:2], _destroy, [name] * 2)


def _timed_grow(name: str, world_size: int, seconds: float) -> tuple[str, float]:
    start = time.monotonic()
    message = _outcome(col.grow_group, name, world_size, timeout=timedelta(seconds=seconds))
    return message, time.monotonic() - start


def test_a_member_late_for_a_mismatched_grow_gets_the_mismatch_at_once(
    fresh: Any, no_leaks: None
) -> None:
    actors = fresh(3)
    name = unique_name("latemis")
    _group(actors, name)
    pairs = zip(actors[:2], (4, 5), strict=True)
    refs = [a.run.remote(_timed_grow, name, size, 5.0) for a, size in pairs]
    first = ray.get(refs, timeout=RAY_TIMEOUT_S)
    late, took = ray.get(actors[2].run.remote(_timed_grow, name, 4, 5.0), timeout=RAY_TIMEOUT_S)
    for message in [*(m for m, _ in first), late]:
        assert message.startswith("ArgumentValueError"), (first, late)
        assert "every member must make the same call" in message, (first, late)
    assert took < 2.0, (late, took)
    assert "did not call" not in late, late
    assert run_all(actors, _allreduce, [name] * 3, [1.0] * 3) == [(r, 3, 3.0) for r in range(3)]
    run_all(actors, _destroy, [name] * 3)


def _init_outcome(world_size: int, rank: int, name: str, seconds: float) -> str:
    timeout = timedelta(seconds=seconds)
    return _outcome(col.init_collective_group, world_size, rank, "gloo", name, timeout=timeout)


def test_a_newcomer_whose_grow_timed_out_is_told_the_grow_failed(
    fresh: Any, no_leaks: None
) -> None:
    actors = fresh(3)
    name = unique_name("growfail")
    _group(actors[:2], name)
    refs = [a.run.remote(_timed_grow, name, 4, 2.0) for a in actors[:2]]
    newcomer = actors[2].run.remote(_init_outcome, 4, 2, name, 10.0)
    members = ray.get(refs, timeout=RAY_TIMEOUT_S)
    message = ray.get(newcomer, timeout=RAY_TIMEOUT_S)
    assert all(m.startswith("CollectiveTimeoutError") for m, _ in members), members
    assert message.startswith("CollectiveTimeoutError"), message
    assert "grow_group(world_size=4) it came to failed" in message, message
    assert "newcomer ranks [3] did not call" in message, message
    assert "no store actor" not in message, message
    assert run_all(actors[:2], _allreduce, [name] * 2, [1.0, 2.0]) == [(0, 2, 3.0), (1, 2, 3.0)]
    run_all(actors[:2], _destroy, [name] * 2)


def _init_checked(world_size: int, rank: int, name: str, check_args: bool) -> str:
    return _outcome(
        col.init_collective_group,
        world_size,
        rank,
        "gloo",
        name,
        timeout=TIMEOUT,
        check_args=check_args,
    )


def test_a_newcomer_with_other_check_args_fails_the_grow_and_the_group_goes_on(
    fresh: Any, no_leaks: None
) -> None:
    """Issue 27: check_args is compared at grow; every rank names each rank's value."""
    actors = fresh(3)
    name = unique_name("growcheck")
    _group(actors[:2], name)
    refs = [a.run.remote(_grow_failure_then_old_group, name, 3) for a in actors[:2]]
    newcomer = ray.get(actors[2].run.remote(_init_checked, 3, 2, name, True), timeout=RAY_TIMEOUT_S)
    results = ray.get(refs, timeout=RAY_TIMEOUT_S)
    for message in [newcomer, *(m for m, _, _ in results)]:
        assert "must pass the same check_args" in message, (newcomer, results)
        assert "ranks [0, 1] passed False; ranks [2] passed True" in message, (newcomer, results)
    assert newcomer.startswith("ArgumentValueError"), newcomer
    assert [old for _, _, old in results] == [(0, 2, 3.0), (1, 2, 3.0)], results
    run_all(actors[:2], _destroy, [name] * 2)
