"""The shared-GPU transport's step protocol, run by real ranks on a stood-in GPU.

Ranks are threads of this process meeting on a TCPStore; the GPU is host memory
(``shared_gpu_standin``), so every op's data is exactly what the protocol guarantees,
and every IPC call and stream wait is checked against CUDA's rules. What CUDA itself
does with these calls is checked against cupy's real binding in
``test_shared_gpu_contract.py`` and on a GPU by ``tests/gpu/test_shared_gpu.py``.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import pytest

from collective.groups.shared_gpu import transport as transport_module
from collective.groups.shared_gpu.transport import SharedGpu, slot_bytes_for
from collective.groups.shm.arena import NAME_PREFIX, SHM_DIR
from collective.groups.shm.steps import MismatchError
from collective.groups.shm.sync import AbortedError, StalledError
from collective.rendezvous.store import TCPRendezvousStore
from collective.types import ReduceOp
from tests.shared_gpu_standin import HostDevice, HostGpu, device_bytes
from tests.test_gloo_group import JOIN_TIMEOUT_S, _client_store, _master_store, _run_threads

TIMEOUT = timedelta(seconds=20)
SLOT_BYTES = 4096
"""Small slots, so that every message below takes many steps."""


def run_gpu(
    world_size: int,
    fn: Callable[[SharedGpu, HostDevice, int], Any],
    gpu: HostGpu | None = None,
    slot_bytes: int = SLOT_BYTES,
) -> list[Any]:
    """Run ``fn(transport, device, rank)`` on a fresh transport per rank; close it after."""
    gpu = gpu or HostGpu()
    master = _master_store()
    prefix = f"gpu/{uuid.uuid4().hex[:8]}"

    def target(rank: int) -> Callable[[], Any]:
        def run() -> Any:
            store = master if rank == 0 else _client_store(master, TIMEOUT)
            device = HostDevice(gpu, rank)
            ranks = list(range(world_size))
            transport = SharedGpu(
                device,
                TCPRendezvousStore(store),
                ranks,
                rank,
                TIMEOUT,
                prefix=prefix,
                slot_bytes=slot_bytes,
            )
            try:
                return fn(transport, device, rank)
            finally:
                transport.close()

        return run

    results = _run_threads([target(r) for r in range(world_size)], JOIN_TIMEOUT_S)
    assert gpu.misuse == [], gpu.misuse
    return results


def _deadline(seconds: float = 20.0) -> float:
    return time.monotonic() + seconds


def _inputs(rank: int, count: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng(rank + 7)
    if dtype.startswith("float"):
        return rng.uniform(0.5, 1.5, count).astype(dtype)
    return rng.integers(1, 1000, count).astype(dtype)


_REDUCTIONS: list[tuple[ReduceOp, str, Callable[..., np.ndarray]]] = [
    (ReduceOp.SUM, "float32", np.sum),
    (ReduceOp.PRODUCT, "float64", np.prod),
    (ReduceOp.MAX, "int64", np.max),
    (ReduceOp.MIN, "int32", np.min),
    (ReduceOp.BXOR, "int32", np.bitwise_xor.reduce),
    (ReduceOp.AVG, "float32", np.mean),
]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_op_gives_every_rank_numpys_answer(world_size: int) -> None:
    count = 3001  # 12 KB of float32: several steps of 4 KiB slots, and a ragged last one
    long_count = (300 << 10) // 4  # past SPLIT_ALLREDUCE_BYTES: the split reduction

    def fn(t: SharedGpu, device: HostDevice, rank: int) -> dict[str, Any]:
        c = t.collectives
        assert c is not None
        out: dict[str, Any] = {}
        for op, dtype, _ in _REDUCTIONS:
            x = _inputs(rank, count, dtype)
            t.run(7, c.allreduce, device_bytes(x), t.reducer(op, dtype), dtype, _deadline())
            out[f"allreduce-{op.name}"] = x
        x = _inputs(rank, long_count, "float32")
        t.run(
            7,
            c.allreduce,
            device_bytes(x),
            t.reducer(ReduceOp.SUM, "float32"),
            "float32",
            _deadline(),
        )
        out["allreduce-long"] = x
        root = world_size - 1
        x = _inputs(rank, count, "int64")
        t.run(
            7,
            c.reduce,
            device_bytes(x),
            root,
            t.reducer(ReduceOp.SUM, "int64"),
            "int64",
            _deadline(),
        )
        out["reduce"] = x
        x = _inputs(rank, count, "float64")
        t.run(7, c.broadcast, device_bytes(x), 1, "float64", _deadline())
        out["broadcast"] = x
        piece = _inputs(rank, count, "int32")
        gathered = [np.zeros(count, np.int32) for _ in range(world_size)]
        views = [device_bytes(g) for g in gathered]
        t.run(7, c.allgather, device_bytes(piece), views, "int32", _deadline())
        out["allgather"] = gathered
        pieces = [_inputs(rank * 10 + j, count, "float32") for j in range(world_size)]
        result = np.zeros(count, np.float32)
        reducer = t.reducer(ReduceOp.SUM, "float32")
        t.run(
            7,
            c.reducescatter,
            [device_bytes(p) for p in pieces],
            device_bytes(result),
            reducer,
            "float32",
            _deadline(),
        )
        out["reducescatter"] = result
        gathered = [np.zeros(count, np.int32) for _ in range(world_size)] if rank == 0 else []
        t.run(
            7,
            c.gather,
            device_bytes(piece),
            [device_bytes(g) for g in gathered],
            0,
            "int32",
            _deadline(),
        )
        out["gather"] = gathered
        scattered = np.zeros(count, np.int32)
        sources = [_inputs(100 + j, count, "int32") for j in range(world_size)]
        t.run(
            7,
            c.scatter,
            [device_bytes(s) for s in sources] if rank == 1 else [],
            device_bytes(scattered),
            1,
            "int32",
            _deadline(),
        )
        out["scatter"] = scattered
        t.run(7, c.barrier, _deadline())
        return out

    results = run_gpu(world_size, fn)
    for op, dtype, reference in _REDUCTIONS:
        want = reference(np.stack([_inputs(r, count, dtype) for r in range(world_size)]), axis=0)
        for rank, got in enumerate(results):
            np.testing.assert_allclose(
                got[f"allreduce-{op.name}"],
                want.astype(dtype),
                rtol=1e-5,
                err_msg=f"{op} rank {rank}",
            )
    want_long = np.sum([_inputs(r, long_count, "float32") for r in range(world_size)], axis=0)
    want_reduce = np.sum([_inputs(r, count, "int64") for r in range(world_size)], axis=0)
    for rank, got in enumerate(results):
        np.testing.assert_allclose(got["allreduce-long"], want_long, rtol=1e-5)
        expected_reduce = want_reduce if rank == world_size - 1 else _inputs(rank, count, "int64")
        np.testing.assert_array_equal(got["reduce"], expected_reduce)
        np.testing.assert_array_equal(got["broadcast"], _inputs(1, count, "float64"))
        for j in range(world_size):
            np.testing.assert_array_equal(got["allgather"][j], _inputs(j, count, "int32"))
            if rank == 0:
                np.testing.assert_array_equal(got["gather"][j], _inputs(j, count, "int32"))
        want_rs = np.sum(
            [_inputs(r * 10 + rank, count, "float32") for r in range(world_size)], axis=0
        )
        np.testing.assert_allclose(got["reducescatter"], want_rs, rtol=1e-5)
        np.testing.assert_array_equal(got["scatter"], _inputs(100 + rank, count, "int32"))


def test_each_stream_wait_captures_exactly_the_record_it_needs() -> None:
    """Every wait on a peer's event sees that event recorded exactly once more than last time.

    A wait that saw no new record would let the stream read a slot before its write
    (or overwrite it before its read); one that saw two would wait on a later step.
    """
    world_size = 3

    def fn(t: SharedGpu, device: HostDevice, rank: int) -> list[tuple[int, int, int]]:
        c = t.collectives
        assert c is not None
        for count in (10, 5000, (300 << 10) // 4, 64):
            x = _inputs(rank, count, "float32")
            t.run(
                3,
                c.allreduce,
                device_bytes(x),
                t.reducer(ReduceOp.SUM, "float32"),
                "float32",
                _deadline(),
            )
        return device.waits

    for rank, waits in enumerate(run_gpu(world_size, fn)):
        seen: dict[int, list[int]] = defaultdict(list)
        for event, owner, records in waits:
            assert owner != rank
            seen[event].append(records)
        assert len(seen) == 2 * 2 * (world_size - 1)  # posted and consumed, 2 slots, each peer
        for event, counts in seen.items():
            assert counts == list(range(1, len(counts) + 1)), (rank, event, counts)


def test_ranks_that_call_different_ops_raise_on_every_rank_and_write_nothing() -> None:
    def fn(t: SharedGpu, device: HostDevice, rank: int) -> tuple[str, np.ndarray]:
        c = t.collectives
        assert c is not None
        x = _inputs(rank, 1000 + rank, "float32")
        before = x.copy()
        with pytest.raises(MismatchError) as caught:
            t.run(
                1,
                c.allreduce,
                device_bytes(x),
                t.reducer(ReduceOp.SUM, "float32"),
                "float32",
                _deadline(),
            )
        np.testing.assert_array_equal(x, before)
        return str(caught.value), x

    messages = [m for m, _ in run_gpu(2, fn)]
    assert all("rank" in m for m in messages), messages


def test_a_rank_that_never_comes_is_named_when_the_deadline_passes() -> None:
    def fn(t: SharedGpu, device: HostDevice, rank: int) -> float | None:
        c = t.collectives
        assert c is not None
        if rank == 1:
            time.sleep(2.5)
            return None
        x = np.ones(100, np.float32)
        start = time.monotonic()
        with pytest.raises(StalledError) as caught:
            t.run(
                1,
                c.allreduce,
                device_bytes(x),
                t.reducer(ReduceOp.SUM, "float32"),
                "float32",
                start + 1.0,
            )
        assert caught.value.args and "1" in str(caught.value)
        return time.monotonic() - start

    waited = run_gpu(2, fn)[0]
    assert waited is not None and 1.0 <= waited < 2.0


def test_an_abort_ends_every_local_peers_wait_at_once() -> None:
    def fn(t: SharedGpu, device: HostDevice, rank: int) -> float:
        c = t.collectives
        assert c is not None
        start = time.monotonic()
        if rank == 0:
            time.sleep(0.3)
            t.abort("rank 0 gave up")
            return 0.0
        with pytest.raises(AbortedError, match="rank 0 gave up"):
            t.run(1, c.barrier, start + 15)
        return time.monotonic() - start

    assert run_gpu(2, fn)[1] < 5


def _our_files() -> set[str]:
    return {f for f in os.listdir(SHM_DIR) if f.startswith(f"{NAME_PREFIX}{os.getpid()}-")}


def test_connecting_and_closing_leaves_no_memory_event_mapping_or_file() -> None:
    gpu = HostGpu()
    before = _our_files()

    def fn(t: SharedGpu, device: HostDevice, rank: int) -> None:
        c = t.collectives
        assert c is not None
        x = _inputs(rank, 2000, "float32")
        t.run(
            1,
            c.allreduce,
            device_bytes(x),
            t.reducer(ReduceOp.SUM, "float32"),
            "float32",
            _deadline(),
        )

    for _ in range(20):
        run_gpu(3, fn, gpu)
        assert gpu.live() == (0, 0)
    assert gpu.misuse == []
    assert _our_files() == before


def test_a_rank_that_closes_late_finds_its_slots_still_mapped_and_freed_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 1 closes 1 s after rank 0 gave up waiting (0.2 s): rank 0 must not free the
    slots rank 1 still maps (CUDA leaves that undefined); a thread frees them later."""
    monkeypatch.setattr(transport_module, "CLOSE_WAIT_S", 0.2)
    gpu = HostGpu()

    def fn(t: SharedGpu, device: HostDevice, rank: int) -> None:
        if rank == 1:
            time.sleep(1.0)

    run_gpu(2, fn, gpu)
    deadline = time.monotonic() + 10
    while gpu.live() != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gpu.misuse == []
    assert gpu.live() == (0, 0)


def test_device_work_that_never_finishes_leaves_the_slots_and_never_hangs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stream waiting on a dead peer's event never goes idle: close gives up on it after
    ``SETTLE_S`` and leaves its memory allocated and mapped (never freed under queued
    work); rank 1 then cannot free the slots rank 0 still maps, and its thread gives up
    after ``REAP_S``."""
    monkeypatch.setattr(transport_module, "SETTLE_S", 0.1)
    monkeypatch.setattr(transport_module, "CLOSE_WAIT_S", 0.1)
    monkeypatch.setattr(transport_module, "REAP_S", 0.3)
    gpu = HostGpu()

    def fn(t: SharedGpu, device: HostDevice, rank: int) -> None:
        if rank == 0:  # a kernel that never ends, then one op's worth of work behind it
            device.gate(1)
            with device.on_stream(1):
                pass

    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match="did not finish"):
        run_gpu(2, fn, gpu)
    assert time.monotonic() - start < 15
    assert gpu.misuse == []
    assert {memory.owner for memory in gpu.memory.values()} == {0, 1}
    deadline = time.monotonic() + 10
    while _reapers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _reapers()
    assert {memory.owner for memory in gpu.memory.values()} == {0, 1}
    assert gpu.misuse == []


def _reapers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "collective-free-slots"]


def test_the_slots_zero_fill_is_finished_once_at_connect_and_never_per_op() -> None:
    """``cudaMemset`` runs on the legacy stream, which a torch stream does not wait for:
    the device is synchronised after the slots are made, before any peer maps them (and by
    the check of the mappings), never per op."""

    def fn(t: SharedGpu, device: HostDevice, rank: int) -> int:
        at_connect = device.synchronized
        c = t.collectives
        assert c is not None
        x = _inputs(rank, 100, "float32")
        for _ in range(3):
            t.run(
                1,
                c.allreduce,
                device_bytes(x),
                t.reducer(ReduceOp.SUM, "float32"),
                "float32",
                _deadline(),
            )
        assert device.synchronized == at_connect
        return at_connect

    assert all(at_connect >= 1 for at_connect in run_gpu(2, fn))


def test_slot_size_is_checked() -> None:
    assert slot_bytes_for(4, 1024) == 1024
    with pytest.raises(ValueError, match="multiple of 256"):
        slot_bytes_for(2, 1000)
    with pytest.raises(ValueError, match="at least 256 per rank"):
        slot_bytes_for(8, 1024)
