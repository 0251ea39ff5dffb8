"""destroy_collective_group with an op pending, in Ray actors.

Rank 0 of a two-rank group starts an op that rank 1 never joins: an async op it
does not wait on, or a blocking op in another thread of the actor. Its destroy
must return within a second (it took the group's timeout), the op must end with
a CollectiveError that says the group was destroyed, and the actor must be left
with the threads and listening sockets it had before the group.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import numpy as np
import psutil
import pytest
import ray

import collective as col
from tests.conftest import RAY_TIMEOUT_S, Member, run_all, unique_name

pytestmark = pytest.mark.usefixtures("no_leaks")

TIMEOUT = timedelta(seconds=20)
"""The group's timeout: what a destroy with an op pending used to take."""

DESTROY_LIMIT_S = 1.0


@pytest.fixture(scope="module")
def pair(ray_cluster: None) -> Iterator[list[Any]]:
    """Yield two members that run two calls at once, each in its own thread."""
    actors = [Member.options(max_concurrency=2).remote() for _ in range(2)]
    ray.get([a.actor_id.remote() for a in actors], timeout=RAY_TIMEOUT_S)
    yield actors
    for actor in actors:
        ray.kill(actor)


PROCESS_THREADS = {"collective-notices"}
"""Library threads of the process, not of a group: the notices listener lives as
long as the namespace's store actor, which outlives any one group."""


def _usage() -> tuple[list[str], list[str]]:
    """Return this actor's listening sockets and the names of its groups' threads."""
    listening = sorted(
        f"{c.laddr.ip}:{c.laddr.port}"
        for c in psutil.Process().net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    )
    threads = (t.name for t in threading.enumerate() if t.name not in PROCESS_THREADS)
    return listening, sorted(name for name in threads if "collective" in name)


def _init(rank: int, name: str) -> tuple[list[str], list[str]]:
    before = _usage()
    col.init_collective_group(2, rank, backend="gloo", group_name=name, timeout=TIMEOUT)
    return before


def _blocked_allreduce(name: str) -> tuple[str, str, float]:
    """Run an allreduce that rank 1 never joins; return how it ended and when."""
    try:
        col.allreduce(np.ones(4), name)
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic()
    return "", "no error", time.monotonic()


def _destroy(name: str) -> tuple[float, float]:
    """Destroy ``name``; return when the destroy began and how long it took."""
    start = time.monotonic()
    col.destroy_collective_group(name)
    return start, time.monotonic() - start


def _unwaited_then_destroy(name: str) -> dict[str, Any]:
    """Start an async reducescatter nobody joins, destroy, then look at its Work."""
    out = np.zeros(4)
    work = col.reducescatter(out, [np.ones(4), np.ones(4)], name, async_op=True)
    assert work is not None
    time.sleep(0.3)
    _, took = _destroy(name)
    completed, error = work.is_completed(), work.exception()
    try:
        work.wait()
        waited = "no error"
    except Exception as exc:
        waited = f"{type(exc).__name__}: {exc}"
    return {
        "took": took,
        "completed": completed,
        "exception": f"{type(error).__name__}: {error}",
        "wait": waited,
    }


def _finish(name: str) -> tuple[list[str], list[str]]:
    col.destroy_collective_group(name)
    return _usage()


def test_destroy_ends_a_blocked_op_in_another_thread_at_once(pair: list) -> None:
    name = unique_name("blocked")
    before = run_all(pair, _init, [0, 1], [name] * 2)[0]
    blocked = pair[0].run.remote(_blocked_allreduce, name)
    time.sleep(0.5)
    began, took = ray.get(pair[0].run.remote(_destroy, name), timeout=RAY_TIMEOUT_S)
    kind, message, ended = ray.get(blocked, timeout=RAY_TIMEOUT_S)
    after = run_all(pair, _finish, [name] * 2)[0]
    print(f"\ndestroy with a blocked allreduce took {took:.3f} s; it ended {ended - began:.3f} s")
    assert took < DESTROY_LIMIT_S, f"destroy took {took:.2f} s"
    assert kind == "CollectiveError", (kind, message)
    assert f"allreduce on group {name!r} ended on rank 0" in message
    assert f"group {name!r} was destroyed on rank 0" in message
    assert ended - began < DESTROY_LIMIT_S
    assert after == before


def test_destroy_ends_an_unwaited_async_op_at_once(pair: list) -> None:
    name = unique_name("unwaited")
    before = run_all(pair, _init, [0, 1], [name] * 2)[0]
    res = ray.get(pair[0].run.remote(_unwaited_then_destroy, name), timeout=RAY_TIMEOUT_S)
    after = run_all(pair, _finish, [name] * 2)[0]
    print(f"\ndestroy with an unwaited reducescatter took {res['took']:.3f} s")
    assert res["took"] < DESTROY_LIMIT_S, res
    assert res["completed"] is True
    expected = (
        f"CollectiveError: reducescatter on group {name!r} ended on rank 0: "
        f"group {name!r} was destroyed on rank 0"
    )
    assert res["exception"] == res["wait"] == expected
    assert after == before
