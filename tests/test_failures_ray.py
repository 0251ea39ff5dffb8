"""Failures end in a clear error on every surviving rank, in time, and leave nothing behind.

Real actors are killed with ``ray.kill`` and real timeouts run out. Each test
measures how long the survivors took to notice, on the wall clock shared by the
driver and the actors of this one machine.
"""

from __future__ import annotations

import re
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import ray

import collective as col
from collective.registry.held import group_entry
from collective.rendezvous.actor import STORE_ACTOR_NAME
from collective.rendezvous.client import RayRendezvousStore
from tests.conftest import (
    RAY_TIMEOUT_S,
    Member,
    allreduce_until_failure,
    live_groups,
    run_all,
    unique_name,
    wait_for_files,
)

GROUP_TIMEOUT = timedelta(seconds=20)
"""Long enough that detection by timeout and detection by the transport differ clearly."""

DETECT_S = 8.0
"""Survivors must notice a dead peer within this many seconds, well under GROUP_TIMEOUT."""

BROKEN_S = 1.0
"""An op on a broken group must raise within this many seconds."""


def _fresh_members(count: int) -> list[Any]:
    actors = [Member.remote() for _ in range(count)]
    ray.get([a.actor_id.remote() for a in actors], timeout=RAY_TIMEOUT_S)
    return actors


def _init(world_size: int, rank: int, name: str, timeout: timedelta = GROUP_TIMEOUT) -> int:
    col.init_collective_group(world_size, rank, backend="gloo", group_name=name, timeout=timeout)
    return col.get_rank(name)


def _destroy(name: str) -> bool:
    col.destroy_collective_group(name)
    return col.is_group_initialized(name)


def _allreduce(name: str, value: float) -> float:
    x = np.full(4, value, dtype=np.float64)
    col.allreduce(x, name)
    return float(x[0])


def _timed_op(name: str) -> tuple[float, str, str]:
    start = time.monotonic()
    try:
        col.allreduce(np.ones(4), name)
    except Exception as exc:
        return time.monotonic() - start, type(exc).__name__, str(exc)
    return time.monotonic() - start, "", ""


def test_killed_member_breaks_the_group_fast_and_it_can_be_rebuilt(
    ray_cluster: None, tmp_path: Path
) -> None:
    actors, name = _fresh_members(4), unique_name("killed")
    assert run_all(actors, _init, [4] * 4, range(4), [name] * 4) == [0, 1, 2, 3]
    survivors, victim = actors[:3], actors[3]
    started = [str(tmp_path / f"rank{r}") for r in range(4)]
    refs = [
        a.run.remote(allreduce_until_failure, name, s) for a, s in zip(actors, started, strict=True)
    ]
    wait_for_files(started)
    killed_at = time.time()
    ray.kill(victim, no_restart=True)
    outcomes = ray.get(refs[:3], timeout=RAY_TIMEOUT_S)
    for rank, (failed_at, kind, message) in enumerate(outcomes):
        assert kind == "CollectiveError", (rank, kind, message)
        assert name in message and "allreduce" in message, message
        assert failed_at - killed_at < DETECT_S, (rank, failed_at - killed_at, message)
    print(f"\ndetection after kill: {[round(o[0] - killed_at, 3) for o in outcomes]} s")

    # Broken: every later op raises at once, without a wait.
    later = run_all(survivors, _timed_op, [name] * 3)
    for elapsed, kind, message in later:
        assert kind == "CollectiveError" and "unusable" in message, message
        assert elapsed < BROKEN_S, elapsed
    print(f"op on broken group: {[round(e, 4) for e, _, _ in later]} s")

    # Destroy works and removes the store, though the dead rank never leaves.
    assert run_all(survivors, _destroy, [name] * 3) == [False] * 3
    assert live_groups() == []

    # Elastic recovery: the same name with a replacement for the dead actor.
    group = [*survivors, _fresh_members(1)[0]]
    assert run_all(group, _init, [4] * 4, range(4), [name] * 4) == [0, 1, 2, 3]
    assert run_all(group, _allreduce, [name] * 4, [1.0, 2.0, 3.0, 4.0]) == [10.0] * 4
    assert run_all(group, _destroy, [name] * 4) == [False] * 4
    assert live_groups() == []
    for actor in group:
        ray.kill(actor)


def _init_outcome(world_size: int, rank: int, name: str, timeout: timedelta) -> Any:
    start = time.monotonic()
    try:
        col.init_collective_group(
            world_size, rank, backend="gloo", group_name=name, timeout=timeout
        )
    except Exception as exc:
        return (
            type(exc).__name__,
            str(exc),
            time.monotonic() - start,
            col.is_group_initialized(name),
        )
    return "", "", time.monotonic() - start, True


def test_missing_rank_times_out_naming_who_arrived(members: list, no_leaks: None) -> None:
    name, timeout = unique_name("missing"), timedelta(seconds=3)
    present = [0, 1, 3]
    refs = [members[r].run.remote(_init_outcome, 4, r, name, timeout) for r in present]
    outcomes = ray.get(refs, timeout=RAY_TIMEOUT_S)
    for rank, (kind, message, elapsed, exists) in zip(present, outcomes, strict=True):
        assert kind == "CollectiveTimeoutError", message
        assert name in message and "init" in message and f"rank {rank}" in message
        assert re.search(r"arrived[^\[]*\[0, 1, 3\]", message), message
        assert re.search(r"did not[^\[]*\[2\]", message), message
        assert timeout.total_seconds() - 0.5 < elapsed < timeout.total_seconds() + 6, elapsed
        assert not exists
    print(f"\nmissing rank noticed after {[round(o[2], 2) for o in outcomes]} s (timeout 3 s)")


def test_store_actor_killed_during_init(members: list, no_leaks: None) -> None:
    name = unique_name("storedies")
    refs = [members[r].run.remote(_init_outcome, 3, r, name, GROUP_TIMEOUT) for r in (0, 1)]
    deadline = time.monotonic() + 30
    while True:
        store = ray.get_actor(STORE_ACTOR_NAME) if STORE_ACTOR_NAME in _named() else None
        if store is not None and len(ray.get(store.arrivals.remote(name), timeout=60)[1]) == 2:
            break
        assert time.monotonic() < deadline, "ranks 0 and 1 never joined"
        time.sleep(0.1)
    killed_at = time.monotonic()
    ray.kill(store, no_restart=True)
    outcomes = ray.get(refs, timeout=RAY_TIMEOUT_S)
    noticed = time.monotonic() - killed_at
    for kind, message, _, exists in outcomes:
        assert kind == "CollectiveError", message
        assert name in message and "store actor" in message and "died" in message, message
        assert not exists
    assert noticed < DETECT_S, noticed
    print(f"\nstore death noticed by both waiting ranks within {noticed:.3f} s")


def _named() -> list[str]:
    return ray.util.list_named_actors()


def _old_incarnation(name: str) -> str:
    """Return the incarnation of the group this member holds."""
    return group_entry(name)[1].incarnation


def _stale_member_meddles(name: str, incarnation: str) -> dict[str, Any]:
    """Use the old incarnation's keys in the store that now hosts the name's new group."""
    stale = RayRendezvousStore(ray.get_actor(STORE_ACTOR_NAME), name, incarnation)
    found: dict[str, Any] = {"writes": []}
    forged = {"abort/0": b"stale member says the group failed", "gloo/address": b"10.0.0.1:1"}
    for key, value in forged.items():
        try:
            stale.set(key, value)
            found["writes"].append("written")
        except col.CollectiveError as exc:
            found["writes"].append(str(exc))
    try:
        stale.get("gloo/arrived/0", timedelta(seconds=1))
        found["read_new_keys"] = True
    except (TimeoutError, col.CollectiveError):
        found["read_new_keys"] = False
    op_time, kind, message = _timed_op_with_timeout(name)
    found["old_group_op"] = kind
    found["old_group_op_message"] = message
    found["old_group_op_s"] = op_time
    col.destroy_collective_group(name)
    try:
        col.init_collective_group(
            2, 1, backend="gloo", group_name=name, timeout=timedelta(seconds=3)
        )
        found["rejoin"] = "joined"
    except col.CollectiveError as exc:
        found["rejoin"] = str(exc)
    return found


def _timed_op_with_timeout(name: str) -> tuple[float, str, str]:
    start = time.monotonic()
    try:
        col.allreduce(np.ones(4), name, timeout=timedelta(seconds=2))
    except Exception as exc:
        return time.monotonic() - start, type(exc).__name__, str(exc)
    return time.monotonic() - start, "", ""


def test_stale_incarnation_can_neither_join_nor_corrupt_the_new_group(
    members: list, no_leaks: None
) -> None:
    a, stale, c = members[:3]
    name = unique_name("stale")
    ray.get([a.run.remote(_init, 2, 0, name), stale.run.remote(_init, 2, 1, name)], timeout=60)
    old = ray.get(stale.run.remote(_old_incarnation, name), timeout=RAY_TIMEOUT_S)
    col.destroy_collective_group(name)
    assert ray.get(a.run.remote(_destroy, name), timeout=RAY_TIMEOUT_S) is False
    fresh = [a, c]
    assert run_all(fresh, _init, [2, 2], [0, 1], [name, name]) == [0, 1]
    try:
        found = ray.get(stale.run.remote(_stale_member_meddles, name, old), timeout=RAY_TIMEOUT_S)
        assert all("is over" in w for w in found["writes"]), found["writes"]
        assert found["read_new_keys"] is False
        assert found["old_group_op"] == "GroupNotFoundError", found
        assert "destroyed by the driver" in found["old_group_op_message"]
        assert "already taken" in found["rejoin"], found["rejoin"]
        assert run_all(fresh, _allreduce, [name, name], [1.0, 2.0]) == [3.0, 3.0]
        assert ray.get(stale.run.remote(col.is_group_initialized, name), timeout=60) is False
    finally:
        assert run_all(fresh, _destroy, [name, name]) == [False, False]
