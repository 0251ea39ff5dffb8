"""Concurrency: many groups built at once, ops from threads, and init racing declare."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import ray

import collective as col
from tests.conftest import RAY_TIMEOUT_S, Member, live_groups, run_all, unique_name

pytestmark = pytest.mark.usefixtures("no_leaks")

GROUPS = 8
TIMEOUT = timedelta(seconds=60)


@pytest.fixture(scope="module")
def threaded(ray_cluster: None) -> Iterator[list[Any]]:
    """Yield four members that run up to 16 calls at once, each in its own thread."""
    actors = [Member.options(max_concurrency=16).remote() for _ in range(4)]
    ray.get([a.actor_id.remote() for a in actors], timeout=RAY_TIMEOUT_S)
    yield actors
    for actor in actors:
        ray.kill(actor)


def _init(world_size: int, rank: int, name: str) -> int:
    col.init_collective_group(world_size, rank, backend="gloo", group_name=name, timeout=TIMEOUT)
    return col.get_rank(name)


def _allreduce(name: str, value: float) -> float:
    x = np.full(1000, value)
    col.allreduce(x, name)
    return float(x[0])


def _destroy(name: str) -> bool:
    col.destroy_collective_group(name)
    return col.is_group_initialized(name)


def test_eight_groups_initialised_at_once_from_four_actors(threaded: list) -> None:
    names = [unique_name(f"many{k}") for k in range(GROUPS)]
    start = time.monotonic()
    refs = [a.run.remote(_init, 4, r, n) for n in names for r, a in enumerate(threaded)]
    assert ray.get(refs, timeout=RAY_TIMEOUT_S) == [0, 1, 2, 3] * GROUPS
    print(f"\n{GROUPS} groups of 4 initialised at once in {time.monotonic() - start:.2f} s")
    refs = [
        a.run.remote(_allreduce, n, (k + 1) * (r + 1.0))
        for k, n in enumerate(names)
        for r, a in enumerate(threaded)
    ]
    got = ray.get(refs, timeout=RAY_TIMEOUT_S)
    assert got == [10.0 * (k + 1) for k in range(GROUPS) for _ in range(4)]
    refs = [a.run.remote(_destroy, n) for n in names for a in threaded]
    assert ray.get(refs, timeout=RAY_TIMEOUT_S) == [False] * (4 * GROUPS)


def _two_threads(rank: int, names: list[str], rounds: int) -> dict[str, list[float]]:
    """Run ``rounds`` allreduces on each group, one thread per group, at the same time."""
    results: dict[str, list[float]] = {}
    errors: list[BaseException] = []

    def work(k: int, name: str) -> None:
        try:
            results[name] = [
                _allreduce(name, (k + 1) * (i + 1) * (rank + 1.0)) for i in range(rounds)
            ]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k, n)) for k, n in enumerate(names)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(RAY_TIMEOUT_S)
    if errors:
        raise errors[0]
    return results


def test_ops_from_two_threads_on_two_groups_in_one_actor(members: list) -> None:
    actors, names, rounds = members[:2], [unique_name("ta"), unique_name("tb")], 50
    for name in names:
        run_all(actors, _init, [2, 2], [0, 1], [name, name])
    try:
        results = run_all(actors, _two_threads, [0, 1], [names] * 2, [rounds] * 2)
        expected = {
            n: [3.0 * (k + 1) * (i + 1) for i in range(rounds)] for k, n in enumerate(names)
        }
        assert results == [expected, expected]
    finally:
        for name in names:
            run_all(actors, _destroy, [name, name])


def _try_init(rank: int, name: str, delay_s: float) -> str:
    time.sleep(delay_s)
    try:
        _init(2, rank, name)
    except col.CollectiveError as exc:
        return str(exc)
    return "ok"


@pytest.mark.parametrize(
    ("init_delay_s", "declare_delay_s"), [(0.0, 0.0), (0.0, 0.05), (0.05, 0.0), (0.5, 0.0)]
)
def test_init_racing_declare_exactly_one_wins(
    init_delay_s: float, declare_delay_s: float, members: list
) -> None:
    actors, name = members[:2], unique_name("race")
    refs = [a.run.remote(_try_init, r, name, init_delay_s) for r, a in enumerate(actors)]
    time.sleep(declare_delay_s)
    try:
        col.declare_collective_group(actors, 2, [0, 1], backend="gloo", group_name=name)
        declared = "ok"
    except col.CollectiveError as exc:
        declared = str(exc)
    inits = ray.get(refs, timeout=RAY_TIMEOUT_S)
    if declared == "ok":
        for message in inits:
            assert name in message and "declared from the driver" in message, message
        assert run_all(actors, _allreduce, [name] * 2, [1.0, 2.0]) == [3.0, 3.0]
        run_all(actors, _destroy, [name] * 2)
        col.destroy_collective_group(name)
    else:
        assert name in declared and "already exists" in declared, declared
        assert inits == ["ok", "ok"]
        assert run_all(actors, _allreduce, [name] * 2, [1.0, 2.0]) == [3.0, 3.0]
        run_all(actors, _destroy, [name] * 2)
    winner = "declare" if declared == "ok" else "init"
    print(f"\ninit after {init_delay_s}s, declare after {declare_delay_s}s: {winner} won")
    assert live_groups() == []
