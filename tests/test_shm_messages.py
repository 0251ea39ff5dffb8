"""What a CPU group's errors say, and which files the stale-arena sweep may remove.

Ranks are threads on a TCPStore (see ``test_shm.run_cpu``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import numpy as np
import pytest

from collective.groups.cpu.group import CpuGroup
from collective.groups.shm import arena
from collective.groups.shm.arena import SHM_DIR, Layout
from collective.rendezvous.store import TCPRendezvousStore
from collective.types import (
    AllReduceOptions,
    AllToAllOptions,
    ArgumentValueError,
    CollectiveError,
    CollectiveTimeoutError,
    RecvOptions,
    ReduceOptions,
    SendOptions,
)
from tests.test_gloo_group import JOIN_TIMEOUT_S, _client_store, _master_store, _run_threads
from tests.test_shm import run_cpu


def test_a_rank_stopped_by_another_says_what_that_rank_saw() -> None:
    """Rank 2 disagrees with the root; rank 1, which only waits, names that cause too."""

    def fn(group: CpuGroup, rank: int) -> str:
        x = np.ones(9 if rank == 2 else 8)
        try:
            group.allreduce([x], AllReduceOptions())
        except CollectiveError as exc:
            return str(exc)
        return "returned"

    messages = run_cpu(3, fn, slot_bytes=512)
    for message in messages:
        assert "9 float64 elements" in message or "8 float64 elements" in message, messages
        assert "called allreduce (SUM)" in message, messages


def test_an_init_timeout_names_the_ranks_that_never_arrived() -> None:
    master = _master_store()
    name = f"init-{uuid.uuid4().hex[:8]}"
    timeout = timedelta(seconds=2)

    def target(rank: int) -> Any:
        def run() -> str:
            store = master if rank == 0 else _client_store(master, timeout)
            try:
                CpuGroup(3, rank, name, TCPRendezvousStore(store), timeout).destroy_group()
            except CollectiveTimeoutError as exc:
                return str(exc)
            return "joined"

        return run

    messages = _run_threads([target(0), target(1)], JOIN_TIMEOUT_S)
    assert "ranks [2] never arrived; ranks [0, 1] did" in messages[0], messages
    assert "not every rank arrived" in messages[1], messages
    assert not any("cpu/" in m for m in messages), messages


def test_a_rank_that_joined_but_froze_mid_op_is_named() -> None:
    """Rank 1 enters a long allreduce and stops after its first step (a fault faked here)."""
    release = threading.Event()

    def fn(group: CpuGroup, rank: int) -> str:
        if rank == 1:
            steps = group._steps
            assert steps is not None
            done = steps.done

            def frozen(step: int) -> None:
                release.wait(10)
                done(step)

            steps.done = frozen  # type: ignore[method-assign]
        x = np.ones(4096)
        try:
            group.allreduce([x], AllReduceOptions(timeout=timedelta(seconds=1)))
        except CollectiveError as exc:
            release.set()
            return str(exc)
        return "returned"

    messages = run_cpu(2, fn, slot_bytes=512)
    assert "ranks that never joined it: []" in messages[0], messages
    assert "rank 1 joined it but did not take its step in time" in messages[0], messages


def test_an_alltoall_size_mismatch_is_the_public_error_counted_in_elements() -> None:
    def fn(group: CpuGroup, rank: int) -> tuple[str, str]:
        sends = [np.ones(3 if rank == 0 else 2, np.float32) for _ in range(2)]
        receives = [np.zeros(2, np.float32) for _ in range(2)]
        with pytest.raises(ArgumentValueError) as raised:
            group.alltoall(receives, sends, AllToAllOptions())
        return type(raised.value).__name__, str(raised.value)

    for kind, message in run_cpu(2, fn):
        assert kind == "ArgumentValueError"
        assert "rank 1 expects 2 elements from rank 0, which sends it 3" in message, message


def test_a_recv_unlike_its_send_names_both_dtypes_and_sizes() -> None:
    """Both buffers hold 32 bytes; only their dtypes and element counts tell them apart."""

    def fn(group: CpuGroup, rank: int) -> tuple[str, list[float]]:
        if rank == 0:
            group.send([np.arange(8, dtype=np.float32)], SendOptions(dst_rank=1))
            return "sent", []
        x = np.full(4, -1.0)
        try:
            group.recv([x], RecvOptions(src_rank=0))
        except CollectiveError as exc:
            return str(exc), x.tolist()
        return "returned", x.tolist()

    _, (message, x) = run_cpu(2, fn)
    assert "sent float32[8], but this rank receives into float64[4]" in message, message
    assert "dtype code" not in message, message
    assert x == [-1.0] * 4


def test_a_reduce_mismatch_names_the_reduction_and_the_root() -> None:
    def fn(group: CpuGroup, rank: int) -> str:
        try:
            group.reduce([np.ones(2)], ReduceOptions(root_rank=rank))
        except CollectiveError as exc:
            return str(exc)
        return "returned"

    messages = run_cpu(2, fn)
    assert any("reduce (SUM) of 2 float64 elements with root 1" in m for m in messages), messages


# --- the stale-arena sweep -------------------------------------------------------------------


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _place(name: str, content: bytes) -> str:
    path = os.path.join(SHM_DIR, name)
    with open(path, "wb") as f:
        f.write(content)
    return path


def test_the_sweep_removes_only_arenas_this_library_made() -> None:
    dead = _dead_pid()
    ours = arena.create(Layout.for_ranks(2, 4096))
    ours.close()
    stale = os.path.join(SHM_DIR, f"collective-{dead}-{uuid.uuid4().hex[:12]}")
    os.rename(ours.path, stale)
    foreign = [
        _place(f"collective-{dead}-{uuid.uuid4().hex[:12]}", b"not an arena" * 100),
        _place(f"collective-{dead}-notours", arena.MAGIC.to_bytes(8, "little")),
        _place(f"collective-{dead}-{uuid.uuid4().hex[:12]}-x", arena.MAGIC.to_bytes(8, "little")),
    ]
    try:
        assert arena.sweep_stale() >= 1
        assert not os.path.exists(stale)
        assert all(os.path.exists(p) for p in foreign), foreign
    finally:
        for path in [stale, *foreign]:
            arena.unlink(path)


def test_the_sweep_keeps_the_arena_of_a_live_creator() -> None:
    live = arena.create(Layout.for_ranks(2, 4096))
    try:
        time.sleep(0.01)
        arena.sweep_stale()
        assert os.path.exists(live.path)
    finally:
        arena.unlink(live.path)
        live.close()
