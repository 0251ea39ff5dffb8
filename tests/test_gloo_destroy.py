"""Destroying a gloo group with an op pending, ranks as threads over a TCPStore.

Rank 0 starts an op that rank 1 never joins, then destroys its group: the destroy
returns at once, the op ends with a CollectiveError that says the group was
destroyed, and no thread, socket or process group of the group is left.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import psutil
import pytest

from collective.groups.gloo.group import GlooGroup
from collective.types import (
    AllReduceOptions,
    CollectiveError,
    RecvOptions,
    ReduceScatterOptions,
    SendOptions,
)
from collective.work import Work
from tests.test_gloo_group import _master_store
from tests.test_watch import _build

DESTROY_LIMIT_S = 1.0
"""The longest a destroy may take; before the fix it took the group's timeout (20 s)."""

OPS: dict[str, Callable[[GlooGroup, bool], Work]] = {
    "allreduce": lambda g, a: g.allreduce([np.ones(4)], AllReduceOptions(async_op=a)),
    "reducescatter": lambda g, a: g.reducescatter(
        [np.zeros(4)], [[np.ones(4), np.ones(4)]], ReduceScatterOptions(async_op=a)
    ),
    "send": lambda g, a: g.send([np.ones(4)], SendOptions(dst_rank=1, async_op=a)),
    "recv": lambda g, a: g.recv([np.zeros(4)], RecvOptions(src_rank=1, async_op=a)),
}
"""Ops that rank 0 starts and rank 1 never joins."""


def _connections() -> tuple[int, int, int]:
    """Return this process's OS threads, listening sockets and established connections."""
    process = psutil.Process()
    sockets = process.net_connections("tcp")
    listening = sum(c.status == psutil.CONN_LISTEN for c in sockets)
    established = sum(c.status == psutil.CONN_ESTABLISHED for c in sockets)
    return process.num_threads(), listening, established


def _pend(op: str, mode: str) -> tuple[GlooGroup, Callable[[], tuple[BaseException | None, float]]]:
    """Build a group, leave ``op`` pending on rank 0; return rank 0's group and the op's outcome.

    ``mode`` is "async" (a Work nobody waits on), "polled" (an async Work polled once,
    so a thread may wait on it) or "blocked" (a blocking op in a thread of its own).
    The outcome function returns the op's error and the seconds from the call to it.
    """
    groups = _build(_master_store(), 2, f"pending-{op}-{mode}")
    ended: dict[str, Any] = {}
    if mode == "blocked":

        def blocked() -> None:
            try:
                OPS[op](groups[0], False)
            except CollectiveError as exc:
                ended["error"] = exc
            ended["at"] = time.monotonic()

        thread = threading.Thread(target=blocked)
        thread.start()
    else:
        work = OPS[op](groups[0], True)
        if mode == "polled":
            assert not work.is_completed()
    time.sleep(0.3)

    def outcome() -> tuple[BaseException | None, float]:
        destroyed = time.monotonic()
        groups[1].destroy_group()
        if mode == "blocked":
            thread.join(10.0)
            return ended.get("error"), ended.get("at", float("inf")) - destroyed
        assert work.is_completed(), "a destroyed group's op never turned completed"
        error = work.exception()
        with pytest.raises(CollectiveError) as raised:
            work.wait()
        assert raised.value is error
        return error, time.monotonic() - destroyed

    return groups[0], outcome


@pytest.mark.parametrize("mode", ["async", "polled", "blocked"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_destroy_with_an_op_pending_returns_at_once_and_ends_the_op(op: str, mode: str) -> None:
    group, outcome = _pend(op, mode)
    start = time.monotonic()
    group.destroy_group()
    elapsed = time.monotonic() - start
    error, ended_s = outcome()
    assert elapsed < DESTROY_LIMIT_S, f"destroy took {elapsed:.2f} s with {op} pending"
    assert type(error) is CollectiveError, repr(error)
    assert f"{op} on group " in str(error)
    assert f"group '{group.group_name}' was destroyed on rank 0" in str(error)
    assert ended_s < DESTROY_LIMIT_S, f"the pending {op} ended {ended_s:.2f} s after destroy"
    with pytest.raises(CollectiveError, match="destroyed"):
        OPS[op](group, False)


def test_destroy_with_ops_pending_leaves_no_thread_socket_or_connection() -> None:
    def cycle(op: str, mode: str) -> None:
        group, outcome = _pend(op, mode)
        group.destroy_group()
        outcome()

    cycle("allreduce", "async")  # warm up torch's thread pools
    gc.collect()
    before = _connections()
    for op, mode in [("allreduce", "blocked"), ("recv", "polled"), ("reducescatter", "async")]:
        cycle(op, mode)
    deadline = time.monotonic() + 2.0
    while True:
        gc.collect()  # the test's own closures hold the TCPStores in cycles
        after = _connections()
        if all(a <= b for a, b in zip(after, before, strict=True)):
            break
        assert time.monotonic() < deadline, f"threads, listeners, connections: {before} -> {after}"
        time.sleep(0.05)
    names = [t.name for t in threading.enumerate()]
    assert not [n for n in names if n.startswith("collective-")], names
