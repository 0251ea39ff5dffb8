"""Leaks: 100 create/allreduce/destroy cycles leave no actors, sockets, threads or memory."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import numpy as np
import psutil

import collective as col
from tests.conftest import our_named_actors, run_all, unique_name

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
        "listening": listening,
        "threads": process.num_threads(),
        "python_threads": sorted(t.name for t in threading.enumerate()),
        "rss_mb": process.memory_info().rss / 2**20,
    }


def _cycle(rank: int, name: str) -> float:
    col.init_collective_group(
        2, rank, backend="gloo", group_name=name, timeout=timedelta(seconds=30)
    )
    x = np.full(1024, rank + 1.0, dtype=np.float32)
    col.allreduce(x, name)
    col.destroy_collective_group(name)
    assert not col.is_group_initialized(name)
    return float(x[0])


def test_many_cycles_leave_nothing_behind(members: list, no_leaks: None) -> None:
    actors = members[:2]
    name = unique_name("cycle")
    for _ in range(WARM_UP):
        assert run_all(actors, _cycle, [0, 1], [name, name]) == [3.0, 3.0]
    before = run_all(actors, _usage)
    start = time.monotonic()
    counts = []
    for cycle in range(CYCLES):
        assert run_all(actors, _cycle, [0, 1], [name, name]) == [3.0, 3.0]
        if cycle % 25 == 24:
            counts.append([u["threads"] for u in run_all(actors, _usage)])
    elapsed = time.monotonic() - start
    after = run_all(actors, _usage)
    assert our_named_actors() == []
    for rank, (b, a) in enumerate(zip(before, after, strict=True)):
        growth = a["rss_mb"] - b["rss_mb"]
        print(
            f"\nrank {rank}: listening {b['listening']} -> {a['listening']}, threads "
            f"{b['threads']} -> {a['threads']}, rss +{growth:.1f} MB"
        )
        assert a["listening"] == b["listening"]
        assert a["python_threads"] == b["python_threads"]
        assert a["threads"] <= b["threads"] + THREAD_SLACK
        assert growth < RSS_LIMIT_MB
    print(f"OS threads every 25 cycles: {counts}")
    print(f"{CYCLES} cycles in {elapsed:.1f} s ({1000 * elapsed / CYCLES:.0f} ms per cycle)")
