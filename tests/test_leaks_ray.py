"""Leaks: create/allreduce/destroy cycles and killed members leave nothing behind.

Counted in each member: listening sockets, open file descriptors, threads and RSS;
on the machine: this library's named actors and its shared-memory segments in /dev/shm.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import ray

import collective as col
from collective.groups.shm.arena import NAME_PREFIX, SHM_DIR
from tests.conftest import (
    Member,
    allreduce_until_failure,
    live_groups,
    run_all,
    unique_name,
    wait_for_files,
)

CYCLES = 100
WARM_UP = 3
"""Cycles run before the baseline is taken: imports, torch's thread pools, first buffers."""

THREAD_SLACK = 4
"""OS threads Ray's and torch's own pools may add over a run; our threads must all be gone."""
RSS_LIMIT_MB = 50.0


def _usage() -> dict[str, Any]:
    """Return this process's listening sockets, thread count and RSS."""
    process = psutil.Process()
    listening = sorted(
        f"{c.laddr.ip}:{c.laddr.port}"
        for c in process.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    )
    return {
        "fds": process.num_fds(),
        "listening": listening,
        "threads": process.num_threads(),
        "python_threads": sorted(t.name for t in threading.enumerate()),
        "rss_mb": process.memory_info().rss / 2**20,
    }


def _segments() -> list[str]:
    """Return this library's shared-memory segments on the machine."""
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(NAME_PREFIX))


def _cycle(rank: int, name: str) -> float:
    col.init_collective_group(
        2, rank, backend="gloo", group_name=name, timeout=timedelta(seconds=30)
    )
    x = np.full(1024, rank + 1.0, dtype=np.float32)
    col.allreduce(x, name)
    assert col.get_group_handle(name).transport == "shm"
    col.destroy_collective_group(name)
    assert not col.is_group_initialized(name)
    return float(x[0])


def test_many_cycles_leave_nothing_behind(members: list, no_leaks: None) -> None:
    actors = members[:2]
    name = unique_name("cycle")
    for _ in range(WARM_UP):
        assert run_all(actors, _cycle, [0, 1], [name, name]) == [3.0, 3.0]
    before = run_all(actors, _usage)
    segments = _segments()
    start = time.monotonic()
    counts = []
    for cycle in range(CYCLES):
        assert run_all(actors, _cycle, [0, 1], [name, name]) == [3.0, 3.0]
        if cycle % 25 == 24:
            counts.append([u["threads"] for u in run_all(actors, _usage)])
    elapsed = time.monotonic() - start
    after = run_all(actors, _usage)
    assert live_groups() == []
    assert _segments() == segments
    for rank, (b, a) in enumerate(zip(before, after, strict=True)):
        growth = a["rss_mb"] - b["rss_mb"]
        print(
            f"\nrank {rank}: listening {b['listening']} -> {a['listening']}, threads "
            f"{b['threads']} -> {a['threads']}, rss +{growth:.1f} MB"
        )
        assert a["listening"] == b["listening"]
        assert a["fds"] == b["fds"], f"rank {rank}: {b['fds']} open files before, {a['fds']} after"
        assert a["python_threads"] == b["python_threads"]
        assert a["threads"] <= b["threads"] + THREAD_SLACK
        assert growth < RSS_LIMIT_MB
    print(f"OS threads every 25 cycles: {counts}")
    print(f"{CYCLES} cycles in {elapsed:.1f} s ({1000 * elapsed / CYCLES:.0f} ms per cycle)")


def _init_and_report(world_size: int, rank: int, name: str) -> tuple[str, dict[str, Any]]:
    col.init_collective_group(
        world_size, rank, backend="gloo", group_name=name, timeout=timedelta(seconds=20)
    )
    x = np.ones(16)
    col.allreduce(x, name)
    return col.get_group_handle(name).transport, _usage()


def _destroy_and_report(name: str) -> dict[str, Any]:
    col.destroy_collective_group(name)
    return _usage()


def test_a_killed_member_leaves_no_segment_and_the_survivors_no_files(
    ray_cluster: None, no_leaks: None, tmp_path: Path
) -> None:
    actors = [Member.remote() for _ in range(3)]
    name = unique_name("killed")
    segments = _segments()
    warm = run_all(actors, _init_and_report, [3] * 3, range(3), [name] * 3)
    assert [t for t, _ in warm] == ["shm"] * 3
    run_all(actors, _destroy_and_report, [name] * 3)
    ray.kill(actors[2])
    survivors = actors[:2]
    name = unique_name("killed")
    victim = Member.remote()
    trio = [*survivors, victim]
    before = run_all(survivors, _usage)
    run_all(trio, _init_and_report, [3] * 3, range(3), [name] * 3)
    assert _segments() == segments  # unlinked as soon as every rank mapped it
    started = [str(tmp_path / f"rank{r}") for r in range(2)]
    refs = [
        a.run.remote(allreduce_until_failure, name, s)
        for a, s in zip(survivors, started, strict=True)
    ]
    wait_for_files(started)
    ray.kill(victim)
    outcomes = ray.get(refs, timeout=120)
    assert all(kind == "CollectiveError" for _, kind, _ in outcomes), outcomes
    after = run_all(survivors, _destroy_and_report, [name] * 2)
    assert _segments() == segments
    for b, a in zip(before, after, strict=True):
        assert a["fds"] == b["fds"], f"{b['fds']} open files before, {a['fds']} after"
        assert a["python_threads"] == b["python_threads"]
    for actor in survivors:
        ray.kill(actor)
