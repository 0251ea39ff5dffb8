"""Group lifetime in the shared store actor: driver destroys, dead ranks, re-used names, cost.

Each test is one item of issue 12, with real actors and real kills.
"""

from __future__ import annotations

import os
import statistics
import time
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import ray

import collective as col
from collective.rendezvous.actor import IDLE_GRACE_S, SWEEP_S
from tests.conftest import (
    RAY_TIMEOUT_S,
    Member,
    live_groups,
    our_named_actors,
    run_all,
    unique_name,
)
from tests.nccl_binding import no_driver

pytestmark = pytest.mark.usefixtures("no_leaks")

TIMEOUT = timedelta(seconds=20)


def _init(world_size: int, rank: int, name: str, timeout: timedelta = TIMEOUT) -> float:
    start = time.monotonic()
    col.init_collective_group(world_size, rank, backend="gloo", group_name=name, timeout=timeout)
    return time.monotonic() - start


def _destroy(name: str) -> bool:
    col.destroy_collective_group(name)
    return col.is_group_initialized(name)


def _allreduce(name: str, value: float) -> float:
    x = np.full(3, value)
    col.allreduce(x, name)
    return float(x[0])


def _outcome(fn: Any, *args: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(*args)
    except Exception as exc:
        return type(exc).__name__, str(exc)


def _identity_and_broadcast(name: str, value: float) -> tuple[int, int, float]:
    x = np.full(2, value)
    col.broadcast(x, 0, name)
    return col.get_rank(name), col.get_collective_group_size(name), float(x[0])


def test_driver_destroy_ends_the_group_in_members_and_a_new_declaration_is_honoured(
    members: list,
) -> None:
    """Item 1: destroyed from the driver, declared again with new ranks and a third member."""
    a, b, c = members[:3]
    name = unique_name("redeclared")
    col.declare_collective_group([a, b], 2, [0, 1], backend="gloo", group_name=name)
    assert run_all([a, b], _identity_and_broadcast, [name] * 2, [10.0, 20.0]) == [
        (0, 2, 10.0),
        (1, 2, 10.0),
    ]
    col.destroy_collective_group(name)
    after = run_all([a, b], _outcome, [_allreduce] * 2, [name] * 2, [1.0, 2.0])
    for kind, message in after:
        assert kind == "GroupNotFoundError", message
        assert f"group {name!r} was destroyed by the driver" in message
    assert name not in col.list_collective_groups()

    col.declare_collective_group([a, b, c], 3, [1, 0, 2], backend="gloo", group_name=name)
    got = run_all([a, b, c], _identity_and_broadcast, [name] * 3, [10.0, 20.0, 30.0])
    assert got == [(1, 3, 20.0), (0, 3, 20.0), (2, 3, 20.0)]
    assert run_all([a, b, c], _allreduce, [name] * 3, [1.0, 2.0, 4.0]) == [7.0] * 3
    assert run_all([a, b, c], _destroy, [name] * 3) == [False] * 3


def test_a_rank_that_died_between_ops_does_not_hold_the_name(ray_cluster: None) -> None:
    """Item 4: the recovery recipe after an idle death: survivors destroy, a replacement joins."""
    actors = [Member.remote() for _ in range(4)]
    name = unique_name("idle-death")
    run_all(actors[:3], _init, [3] * 3, range(3), [name] * 3)
    assert run_all(actors[:3], _allreduce, [name] * 3, [1.0, 2.0, 3.0]) == [6.0] * 3
    killed_at = time.monotonic()
    ray.kill(actors[2], no_restart=True)
    assert run_all(actors[:2], _destroy, [name] * 2) == [False] * 2
    group = [actors[0], actors[1], actors[3]]
    run_all(group, _init, [3] * 3, range(3), [name] * 3)
    freed_s = time.monotonic() - killed_at
    assert run_all(group, _allreduce, [name] * 3, [1.0, 2.0, 4.0]) == [7.0] * 3
    assert run_all(group, _destroy, [name] * 3) == [False] * 3
    print(f"\nkill, survivors' destroy and the re-init with a replacement took {freed_s:.2f} s")
    for actor in actors:
        ray.kill(actor)


def test_a_new_group_waits_for_a_slow_old_member_whatever_its_size_and_order(
    members: list,
) -> None:
    """Item 5: the new group has another world size and another rank order than the old one."""
    a, b, c = members[:3]
    name = unique_name("slow-leaver")
    run_all([a, b], _init, [2, 2], [0, 1], [name, name])
    assert ray.get(a.run.remote(_destroy, name), timeout=RAY_TIMEOUT_S) is False
    waiting = [a.run.remote(_init, 3, 1, name), c.run.remote(_init, 3, 0, name)]
    with pytest.raises(ray.exceptions.GetTimeoutError):
        ray.get(waiting, timeout=2.0)
    assert ray.get(b.run.remote(_destroy, name), timeout=RAY_TIMEOUT_S) is False
    waited = ray.get([*waiting, b.run.remote(_init, 3, 2, name)], timeout=RAY_TIMEOUT_S)
    assert min(waited[:2]) >= 2.0, waited
    assert run_all([c, a, b], _allreduce, [name] * 3, [1.0, 2.0, 4.0]) == [7.0] * 3
    assert run_all([a, b, c], _destroy, [name] * 3) == [False] * 3


def _destroy_then_query(name: str) -> tuple[int, bool]:
    col.destroy_collective_group(name)
    return col.get_rank(name), col.is_group_initialized(name)


def test_a_declared_members_destroy_before_first_use_keeps_the_declaration(
    members: list,
) -> None:
    """Item 7: for that member the group did not exist yet; the others still use it."""
    a, b = members[:2]
    name = unique_name("early-destroy")
    col.declare_collective_group([a, b], 2, [0, 1], backend="gloo", group_name=name)
    assert ray.get(b.run.remote(_destroy_then_query, name), timeout=RAY_TIMEOUT_S) == (1, False)
    assert name in col.list_collective_groups()
    assert run_all([a, b], _allreduce, [name] * 2, [1.0, 2.0]) == [3.0, 3.0]
    assert run_all([a, b], _destroy, [name] * 2) == [False] * 2


@ray.remote(num_cpus=0)
def _destroy_in_a_task(name: str) -> list[str]:
    col.destroy_collective_group(name)
    col.destroy_all_collective_groups()
    return col.list_collective_groups()


def test_a_non_member_cannot_end_a_live_group(members: list) -> None:
    """Item 8: a Ray task and an actor outside the group destroy it; nothing happens."""
    a, b, outsider = members[:3]
    name = unique_name("guarded")
    run_all([a, b], _init, [2, 2], [0, 1], [name, name])
    assert name in ray.get(_destroy_in_a_task.remote(name), timeout=RAY_TIMEOUT_S)
    assert ray.get(outsider.run.remote(_destroy, name), timeout=RAY_TIMEOUT_S) is False
    assert name in col.list_collective_groups()
    assert col.get_collective_groups([a, b]) == [name]
    assert run_all([a, b], _allreduce, [name] * 2, [1.0, 2.0]) == [3.0, 3.0]
    assert run_all([a, b], _destroy, [name] * 2) == [False] * 2


def test_more_groups_cost_no_process_and_little_time_and_the_idle_store_exits(
    members: list,
) -> None:
    """Item 10: one store actor serves every group; it exits once idle for the grace period."""
    pair, count = members[:2], 6
    names = [unique_name("cheap") for _ in range(count)]
    took = [max(run_all(pair, _init, [2, 2], [0, 1], [n, n])) for n in names]
    assert our_named_actors() == ["collective-tests"]
    assert sorted(names) == [n for n in live_groups() if n in names]
    later = statistics.median(took[1:])
    print(f"\ninit of group 1: {took[0]:.3f} s; groups 2..{count}: median {later:.3f} s")
    assert later < 0.3, took
    for n in names:
        assert run_all(pair, _destroy, [n, n]) == [False, False]
    print(f"the idle store actor exited {_store_exit_s():.2f} s after the last destroy")


def _store_exit_s() -> float:
    """Wait for the store actor to exit once idle; return how long it took."""
    idle_at = time.monotonic()
    while our_named_actors() and time.monotonic() - idle_at < IDLE_GRACE_S + 5 * SWEEP_S + 10:
        time.sleep(0.1)
    assert our_named_actors() == []
    return time.monotonic() - idle_at


def _nccl_group_life(world_size: int, rank: int, name: str) -> list[str]:
    """Make an NCCL group on a ``ContractCupy`` (no GPU), form its communicators, destroy it.

    The group runs every store call a real one makes: the meeting at init, the unique
    ID of its collective communicator (published by rank 0, read by the others), and
    the leave at destroy. Returns the NCCL calls, to show the communicator was made.
    """
    from collective.groups.nccl import comm
    from tests.nccl_binding import ContractCupy

    cupy = ContractCupy()
    comm._probe = lambda: (cupy, "")  # type: ignore[assignment]
    os.environ["COLLECTIVE_GPU_TRANSPORT"] = "nccl"  # no GPU to find: NCCL, as it was asked
    col.init_collective_group(world_size, rank, backend="nccl", group_name=name)
    group: Any = col.get_group_handle(name)
    group._collective_comms([0], group.timeout)
    col.destroy_collective_group(name)
    return sorted({entry.name for entry in cupy.trace.entries})


@pytest.mark.skipif(
    not no_driver(),
    reason="a CUDA driver is present: tests/gpu/test_ray_actors.py covers this on the GPU",
)
def test_the_store_actor_exits_after_an_nccl_groups_destroy_as_after_a_cpu_groups(
    members: list,
) -> None:
    """Issue 28 item 4: an NCCL group's keys and state keep the store no longer than a CPU one's.

    The store exits ``IDLE_GRACE_S`` after the last group of the namespace ends,
    whichever backend it had; a check right after the destroy is too early.
    """
    name = unique_name("nccl")
    calls = run_all(members[:2], _nccl_group_life, [2, 2], [0, 1], [name, name])
    assert calls == [
        ["NcclCommunicator", "destroy", "get_unique_id", "groupEnd", "groupStart"],
        ["NcclCommunicator", "destroy", "groupEnd", "groupStart"],
    ], calls
    assert live_groups() == []
    took = _store_exit_s()
    print(f"\nthe store actor exited {took:.2f} s after the NCCL group's destroy")
    assert took < IDLE_GRACE_S + 3 * SWEEP_S, took


def _init_checked(rank: int, name: str, check_args: bool) -> tuple[str, str, float, bool]:
    start = time.monotonic()
    try:
        col.init_collective_group(
            3, rank, backend="gloo", group_name=name, timeout=TIMEOUT, check_args=check_args
        )
        outcome = ("returned", "")
    except Exception as exc:
        outcome = (type(exc).__name__, str(exc))
    return (*outcome, time.monotonic() - start, col.is_group_initialized(name))


def test_ranks_that_pass_different_check_args_all_get_a_clear_error_before_any_group(
    members: list,
) -> None:
    """Issue 27: check_args is compared at init; every rank names each rank's value."""
    name = unique_name("checkargs")
    refs = [
        members[r].run.remote(_init_checked, r, name, check)
        for r, check in enumerate((True, False, True))
    ]
    outcomes = ray.get(refs, timeout=RAY_TIMEOUT_S)
    for kind, message, took, held in outcomes:
        assert kind == "ArgumentValueError", outcomes
        assert "must pass the same check_args" in message, outcomes
        assert "ranks [1] passed False" in message and "passed True" in message, outcomes
        assert took < TIMEOUT.total_seconds() / 2, outcomes
        assert not held, outcomes
