"""Async ops in Ray actors: every op's Work turns completed when polled, and can be awaited.

A polling loop (``is_completed``, then ``exception``) must end for every op,
without a ``wait``, and report a failed op's error; an async actor awaits a Work
without blocking its event loop.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray

import collective as col
from collective.work import Work
from tests.conftest import RAY_TIMEOUT_S, run_all, unique_name

pytestmark = pytest.mark.usefixtures("no_leaks")

EAGER_LIMIT_BYTES = 1 << 20
"""More than a pair's mailboxes hold: a send this long waits for its receiver on
shared memory too, where a shorter one completes before the receive is posted."""

POLL_LIMIT_S = 20.0
"""How long a poll may take before the op counts as never completing."""


def _poll(work: Work | None) -> tuple[bool, str | None]:
    """Poll ``work`` until it says it has finished; return whether it did, and its error."""
    assert work is not None
    deadline = time.monotonic() + POLL_LIMIT_S
    while not work.is_completed():
        if time.monotonic() > deadline:
            return False, None
        time.sleep(0.001)
    error = work.exception()
    return True, None if error is None else f"{type(error).__name__}: {error}"


def _every_op(rank: int, n: int, name: str) -> dict[str, Any]:
    """Issue every op with ``async_op=True`` on group ``name`` and poll each to completion."""
    col.init_collective_group(n, rank, backend="gloo", group_name=name)
    res: dict[Any, Any] = {}

    def run(op: str, issue: Callable[[], list[Work | None]], read: Callable[[], Any]) -> None:
        works = issue()
        res[op] = [_poll(w) for w in works]
        for work in works:
            assert work is not None
            work.wait()
        res[op, "value"] = read()

    def full(value: float) -> np.ndarray:
        return np.full(4, float(value))

    try:
        x = full(rank + 1.0)
        run("allreduce", lambda: [col.allreduce(x, name, async_op=True)], x.tolist)
        y = full(rank + 1.0)
        run("reduce", lambda: [col.reduce(y, 0, name, async_op=True)], y.tolist)
        b = full(rank + 1.0)
        run("broadcast", lambda: [col.broadcast(b, n - 1, name, async_op=True)], b.tolist)
        parts = [full(0.0) for _ in range(n)]
        run(
            "allgather",
            lambda: [col.allgather(parts, full(rank), name, async_op=True)],
            lambda: [p[0] for p in parts],
        )
        out = full(0.0)
        chunks = [full(10.0 * rank + i) for i in range(n)]
        run(
            "reducescatter",
            lambda: [col.reducescatter(out, chunks, name, async_op=True)],
            out.tolist,
        )
        got = full(-1.0)
        run(
            "send/recv",
            lambda: [
                col.send(full(rank), (rank + 1) % n, name, async_op=True),
                col.recv(got, (rank - 1) % n, name, async_op=True),
            ],
            got.tolist,
        )
        gathered = [full(0.0) for _ in range(n)] if rank == 0 else None
        run(
            "gather",
            lambda: [col.gather(full(rank), gathered, 0, name, async_op=True)],
            lambda: None if gathered is None else [g[0] for g in gathered],
        )
        scattered = full(-1.0)
        sources = [full(100.0 + i) for i in range(n)] if rank == 0 else None
        run(
            "scatter",
            lambda: [col.scatter(scattered, sources, 0, name, async_op=True)],
            scattered.tolist,
        )
        received = [full(0.0) for _ in range(n)]
        sent = [full(10.0 * rank + j) for j in range(n)]
        run(
            "alltoall",
            lambda: [col.alltoall(received, sent, name, async_op=True)],
            lambda: [r[0] for r in received],
        )
        run("barrier", lambda: [col.barrier(name, async_op=True)], lambda: None)
    finally:
        col.destroy_collective_group(name)
    return res


def test_every_async_op_turns_completed_when_polled(members: list) -> None:
    n = 4
    results = run_all(members, _every_op, list(range(n)), [n] * n, [unique_name("poll")] * n)
    total = float(sum(range(1, n + 1)))
    for rank, res in enumerate(results):
        for op in (
            "allreduce",
            "reduce",
            "broadcast",
            "allgather",
            "reducescatter",
            "send/recv",
            "gather",
            "scatter",
            "alltoall",
            "barrier",
        ):
            assert res[op] == [(True, None)] * len(res[op]), (op, rank, res[op])
        assert res["allreduce", "value"] == [total] * 4
        assert res["reduce", "value"] == ([total] if rank == 0 else [rank + 1.0]) * 4
        assert res["broadcast", "value"] == [float(n)] * 4
        assert res["allgather", "value"] == [float(i) for i in range(n)]
        assert res["reducescatter", "value"] == [sum(10.0 * r + rank for r in range(n))] * 4
        assert res["send/recv", "value"] == [float((rank - 1) % n)] * 4
        assert res["gather", "value"] == ([float(i) for i in range(n)] if rank == 0 else None)
        assert res["scatter", "value"] == [100.0 + rank] * 4
        assert res["alltoall", "value"] == [10.0 * j + rank for j in range(n)]


def _failing(rank: int, name: str, op: str, polled: str) -> tuple[bool, str | None, float]:
    """On rank 0, poll an op that rank 1 never joins; return whether it ended, its error, when.

    Rank 1 stays in the group, without calling, until rank 0 has created the file
    ``polled`` after its poll (or the poll's limit and more have passed).
    """
    col.init_collective_group(2, rank, backend="gloo", group_name=name)
    try:
        if rank == 1:
            deadline = time.monotonic() + POLL_LIMIT_S + 10.0
            while not os.path.exists(polled) and time.monotonic() < deadline:
                time.sleep(0.01)
            return True, None, 0.0
        short = timedelta(seconds=1)
        x = np.ones(4) if op != "send" else np.ones(EAGER_LIMIT_BYTES // 8 + 1)
        start = time.monotonic()
        if op == "allreduce":
            work = col.allreduce(x, name, timeout=short, async_op=True)
        elif op == "reducescatter":
            work = col.reducescatter(x, [x.copy(), x.copy()], name, timeout=short, async_op=True)
        elif op == "send":
            work = col.send(x, 1, name, timeout=short, async_op=True)
        else:
            work = col.recv(x, 1, name, timeout=short, async_op=True)
        done, error = _poll(work)
        elapsed = time.monotonic() - start
        open(polled, "w").close()
        return done, error, elapsed
    finally:
        col.destroy_collective_group(name)


@pytest.mark.parametrize("op", ["allreduce", "reducescatter", "send", "recv"])
def test_a_failed_async_op_turns_completed_and_reports_its_error(
    members: list, op: str, tmp_path: Path
) -> None:
    name, polled = unique_name(f"fail-{op}"), [str(tmp_path / "polled")] * 2
    done, error, elapsed = run_all(members[:2], _failing, [0, 1], [name] * 2, [op] * 2, polled)[0]
    print(f"\nfailed async {op} (1 s timeout) turned completed after {elapsed:.2f} s")
    assert done, f"polling the failed {op} never ended"
    assert error is not None and error.startswith("CollectiveTimeoutError"), error
    assert f"{op} on group {name!r} timed out on rank 0" in error
    assert elapsed < 6.0, elapsed


class _AsyncMember:
    """An async actor: its methods run as coroutines on one event loop."""

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await fn(*args)

    async def ping(self) -> float:
        return time.monotonic()


AsyncMember: Any = ray.remote(num_cpus=0)(_AsyncMember)  # Any: Ray's handles are untyped


async def _init(rank: int, name: str) -> int:
    col.init_collective_group(2, rank, backend="gloo", group_name=name)
    return col.get_rank(name)


def _work(work: Work | None) -> Work:
    """Return the handle an ``async_op=True`` call returned (never None)."""
    if work is None:
        raise AssertionError("an async op returned no Work")
    return work


async def _awaited(rank: int, name: str, delay_s: float) -> dict[str, Any]:
    """Await an allreduce (rank 1 joins it after ``delay_s``), a reducescatter and a send/recv."""
    res: dict[str, Any] = {}
    try:
        if rank == 1:
            await asyncio.sleep(delay_s)
        x = np.full(4, rank + 1.0)
        await _work(col.allreduce(x, name, async_op=True))
        res["allreduce"] = x.tolist()
        out = np.zeros(4)
        chunks = [np.full(4, 10.0 * rank + i) for i in range(2)]
        await _work(col.reducescatter(out, chunks, name, async_op=True))
        res["reducescatter"] = out.tolist()
        got = np.zeros(4)
        sent = _work(col.send(np.full(4, rank + 5.0), 1 - rank, name, async_op=True))
        await asyncio.gather(sent, _work(col.recv(got, 1 - rank, name, async_op=True)))
        res["recv"] = got.tolist()
    finally:
        col.destroy_collective_group(name)
    return res


def test_an_async_actor_awaits_ops_without_blocking_its_event_loop(ray_cluster: None) -> None:
    actors = [AsyncMember.remote() for _ in range(2)]
    try:
        ray.get([a.ping.remote() for a in actors], timeout=RAY_TIMEOUT_S)
        name, delay_s = unique_name("await"), 3.0
        inits = [a.run.remote(_init, r, name) for r, a in enumerate(actors)]
        assert ray.get(inits, timeout=RAY_TIMEOUT_S) == [0, 1]
        refs = [a.run.remote(_awaited, r, name, delay_s) for r, a in enumerate(actors)]
        time.sleep(1.0)  # rank 0 now awaits the allreduce that rank 1 joins later
        start = time.monotonic()
        ray.get(actors[0].ping.remote(), timeout=RAY_TIMEOUT_S)
        ping_s = time.monotonic() - start
        results = ray.get(refs, timeout=RAY_TIMEOUT_S)
    finally:
        for actor in actors:
            ray.kill(actor)
    assert ping_s < 1.0, f"the awaiting actor answered a ping after {ping_s:.2f} s"
    for rank, res in enumerate(results):
        assert res["allreduce"] == [3.0] * 4
        assert res["reducescatter"] == [float(rank + 10 + rank)] * 4
        assert res["recv"] == [1 - rank + 5.0] * 4
