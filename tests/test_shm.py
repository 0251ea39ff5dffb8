"""The shared-memory transport without Ray: pipelining, layout, fallback, faked nodes, failures.

Ranks are threads of this process meeting on a TCPStore; a ``node`` per rank fakes
several nodes on this machine, so the hierarchical path (shared memory inside a node,
Gloo among the nodes' leaders) runs for real.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch

from collective.groups.cpu.group import CpuGroup
from collective.groups.shm import algorithms
from collective.groups.shm.algorithms import SPLIT_ALLREDUCE_BYTES
from collective.groups.shm.arena import SHM_DIR, Layout
from collective.rendezvous.store import TCPRendezvousStore
from collective.types import (
    AllGatherOptions,
    AllReduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    CollectiveError,
    CpuTransport,
    GatherOptions,
    GroupOptions,
    RecvOptions,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
    SendOptions,
)
from tests.test_gloo_group import (
    JOIN_TIMEOUT_S,
    Absence,
    _client_store,
    _master_store,
    _run_threads,
)

TIMEOUT = timedelta(seconds=20)


def run_cpu(
    world_size: int,
    fn: Callable[[CpuGroup, int], Any],
    nodes: list[str] | None = None,
    timeout: timedelta = TIMEOUT,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(group, rank)`` on a fresh ``CpuGroup``, one thread per rank; destroy it after."""
    master = _master_store()
    name = f"shm-{uuid.uuid4().hex[:8]}"
    groups: list[CpuGroup] = []

    def target(rank: int) -> Callable[[], Any]:
        def run() -> Any:
            store = master if rank == 0 else _client_store(master, timeout)
            node = nodes[rank] if nodes else None
            group = CpuGroup(
                world_size, rank, name, TCPRendezvousStore(store), timeout, node=node, **kwargs
            )
            groups.append(group)
            return fn(group, rank)

        return run

    try:
        return _run_threads([target(r) for r in range(world_size)], JOIN_TIMEOUT_S)
    finally:
        for group in groups:
            group.destroy_group()


def _our_segments() -> list[str]:
    """Return the arenas this process made (their names hold its pid): not other runs' arenas."""
    mine = f"collective-{os.getpid()}-"
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(mine))


# --- layout ---------------------------------------------------------------------------------


def test_default_arena_of_eight_ranks_fits_dockers_shm_with_room_to_spare() -> None:
    layout = Layout.for_ranks(8)
    assert layout.size <= 32 << 20, layout.size
    assert layout.slot_bytes >= 64 << 10


def test_slot_size_must_leave_room_for_every_rank() -> None:
    with pytest.raises(ValueError, match="slot_bytes"):
        Layout.for_ranks(4, 128)
    with pytest.raises(ValueError, match="slot_bytes"):
        Layout.for_ranks(2, 200)


# --- transport choice -----------------------------------------------------------------------


def test_one_node_uses_shared_memory_and_unlinks_its_arena_at_once() -> None:
    before = _our_segments()

    def fn(group: CpuGroup, rank: int) -> tuple[str, list[str]]:
        return group.transport, _our_segments()

    results = run_cpu(3, fn)
    assert [t for t, _ in results] == ["shm"] * 3
    assert all(segments == before for _, segments in results), results
    assert _our_segments() == before


@pytest.mark.parametrize("how", ["option", "environment"])
def test_gloo_can_be_forced(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kwargs: dict[str, Any] = {}
    if how == "option":
        kwargs["options"] = GroupOptions(cpu_transport=CpuTransport.GLOO)
    else:
        monkeypatch.setenv("COLLECTIVE_CPU_TRANSPORT", "GLOO")

    def fn(group: CpuGroup, rank: int) -> tuple[str, float]:
        x = np.full(3, rank + 1.0)
        group.allreduce([x], AllReduceOptions())
        return group.transport, float(x[0])

    assert run_cpu(2, fn, **kwargs) == [("gloo", 3.0), ("gloo", 3.0)]


def test_an_arena_that_cannot_be_made_falls_back_to_gloo_and_says_why_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    huge = 1 << 40  # far beyond /dev/shm: posix_fallocate refuses it up front

    def fn(group: CpuGroup, rank: int) -> tuple[str, float]:
        x = np.full(3, rank + 1.0)
        group.allreduce([x], AllReduceOptions())
        return group.transport, float(x[0])

    with caplog.at_level(logging.WARNING, logger="collective"):
        assert run_cpu(2, fn, slot_bytes=huge) == [("gloo", 3.0), ("gloo", 3.0)]
        assert run_cpu(2, fn, slot_bytes=huge) == [("gloo", 3.0), ("gloo", 3.0)]
    falls = [r.getMessage() for r in caplog.records if "fall back to Gloo" in r.getMessage()]
    assert len(falls) == 1, falls
    assert "could not be created" in falls[0]
    assert _our_segments() == []


def test_required_shared_memory_that_cannot_be_made_raises_on_every_rank() -> None:
    options = GroupOptions(cpu_transport=CpuTransport.SHM)
    with pytest.raises(CollectiveError, match="cannot use shared memory"):
        run_cpu(2, lambda g, r: None, slot_bytes=1 << 40, options=options)


# --- pipelining through small slots ---------------------------------------------------------


def _inputs(rank: int, count: int, dtype: str) -> np.ndarray:
    values = (np.arange(count) * 7 + rank * 3) % 11 + 1
    return values.astype(dtype) if dtype != "bool" else values % 2 == rank % 2


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_long_messages_stream_through_small_slots(world_size: int) -> None:
    count = 5000  # 40 KB of float64 through 512-byte slots: hundreds of steps per op
    n = world_size

    def fn(group: CpuGroup, rank: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        x = _inputs(rank, count, "float64")
        group.allreduce([x], AllReduceOptions())
        out["allreduce"] = x
        y = _inputs(rank, count, "int32")
        group.reduce([y], ReduceOptions(ReduceOp.MAX, root_rank=n - 1))
        out["reduce"] = y
        z = _inputs(rank, count, "uint8")
        group.broadcast([z], BroadcastOptions(root_rank=n - 1))
        out["broadcast"] = z
        gathered = [np.zeros(count, np.float32) for _ in range(n)]
        group.allgather([gathered], [_inputs(rank, count, "float32")], AllGatherOptions())
        out["allgather"] = gathered
        chunks = [_inputs(rank + j, count, "int64") for j in range(n)]
        mine = np.zeros(count, np.int64)
        group.reducescatter([mine], [chunks], ReduceScatterOptions(ReduceOp.SUM))
        out["reducescatter"] = mine
        sends = [np.full(100 * (rank + j + 1), rank * 10 + j, np.int16) for j in range(n)]
        receives = [np.zeros(100 * (j + rank + 1), np.int16) for j in range(n)]
        group.alltoall(receives, sends, AllToAllOptions())
        out["alltoall"] = receives
        return out

    results = run_cpu(n, fn, slot_bytes=512)
    total = sum(_inputs(r, count, "float64") for r in range(n))
    top = np.max([_inputs(r, count, "int32") for r in range(n)], axis=0)
    for rank, out in enumerate(results):
        np.testing.assert_array_equal(out["allreduce"], total)
        want = top if rank == n - 1 else _inputs(rank, count, "int32")
        np.testing.assert_array_equal(out["reduce"], want)
        np.testing.assert_array_equal(out["broadcast"], _inputs(n - 1, count, "uint8"))
        for r in range(n):
            np.testing.assert_array_equal(out["allgather"][r], _inputs(r, count, "float32"))
            np.testing.assert_array_equal(
                out["alltoall"][r], np.full(100 * (r + rank + 1), r * 10 + rank)
            )
        chunk = sum(_inputs(r + rank, count, "int64") for r in range(n))
        np.testing.assert_array_equal(out["reducescatter"], chunk)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_long_allreduce_splits_the_reduction_among_the_ranks(world_size: int) -> None:
    count = SPLIT_ALLREDUCE_BYTES // 4 + 777  # float32: past the threshold, uneven pieces

    def fn(group: CpuGroup, rank: int) -> dict[str, Any]:
        x = _inputs(rank, count, "float32")
        group.allreduce([x], AllReduceOptions())
        y = _inputs(rank, count // 2, "int64")
        group.allreduce([y], AllReduceOptions(ReduceOp.MIN))
        z = _inputs(rank, count // 2 + 1, "float64")
        group.allreduce([z], AllReduceOptions(ReduceOp.AVG))
        return {"sum": x, "min": y, "avg": z}

    results = run_cpu(world_size, fn, slot_bytes=4096)
    ranks = range(world_size)
    want_sum = np.sum([_inputs(r, count, "float32") for r in ranks], axis=0)
    want_min = np.min([_inputs(r, count // 2, "int64") for r in ranks], axis=0)
    want_avg = np.mean([_inputs(r, count // 2 + 1, "float64") for r in ranks], axis=0)
    for out in results:
        np.testing.assert_array_equal(out["sum"], results[0]["sum"])
        np.testing.assert_allclose(out["sum"], want_sum)
        np.testing.assert_array_equal(out["min"], want_min)
        np.testing.assert_array_equal(out["avg"], results[0]["avg"])
        np.testing.assert_allclose(out["avg"], want_avg)


def test_two_rank_allreduce_reduces_each_half_in_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(algorithms, "REDUCE_BLOCK_BYTES", 4096)
    count = (
        SPLIT_ALLREDUCE_BYTES // 2 + 13
    )  # 16 blocks a half of a 64 KiB-slot chunk, and a short one
    inputs = {r: _inputs(r, count, "float32") * (r + 0.5) for r in range(2)}

    def fn(group: CpuGroup, rank: int) -> dict[str, np.ndarray]:
        x = inputs[rank].copy()
        group.allreduce([x], AllReduceOptions())
        y = torch.from_numpy(inputs[rank]).to(torch.bfloat16)
        group.allreduce([y], AllReduceOptions(ReduceOp.AVG))
        return {"sum": x, "avg": y.float().numpy()}

    results = run_cpu(2, fn, slot_bytes=64 << 10)
    want_avg = (
        torch.from_numpy(inputs[0]).to(torch.bfloat16)
        + torch.from_numpy(inputs[1]).to(torch.bfloat16)
    ) / 2
    for out in results:
        np.testing.assert_array_equal(out["sum"], inputs[0] + inputs[1])
        np.testing.assert_array_equal(out["avg"], want_avg.float().numpy())


def test_send_recv_longer_than_the_mailboxes_both_ways_at_once() -> None:
    count = 300_000  # 1.2 MB each way, many mailbox chunks

    def fn(group: CpuGroup, rank: int) -> np.ndarray:
        peer = 1 - rank
        out = np.zeros(count, np.float32)
        sent = group.send(
            [np.arange(count, dtype=np.float32) * (rank + 1)], SendOptions(peer, async_op=True)
        )
        group.recv([out], RecvOptions(peer))
        sent.wait()
        return out

    a, b = run_cpu(2, fn)
    np.testing.assert_array_equal(a, np.arange(count, dtype=np.float32) * 2)
    np.testing.assert_array_equal(b, np.arange(count, dtype=np.float32))


# --- randomized properties ------------------------------------------------------------------

_DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool"]
_SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 0, 3), (33, 17)]


def _random_case(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    dtype = str(rng.choice(_DTYPES))
    floats = dtype in ("float16", "bfloat16", "float32", "float64")
    ops = [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX]
    ops += [ReduceOp.AVG] if floats else [ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR]
    return {
        "dtype": dtype,
        "shape": _SHAPES[int(rng.integers(len(_SHAPES)))],
        "op": ops[int(rng.integers(len(ops)))],
        "world_size": int(rng.integers(1, 5)),
        "seed": seed,
    }


def _tensor(array: np.ndarray, dtype: str) -> Any:
    if dtype == "bfloat16":
        return torch.tensor(array.astype(np.float32)).to(torch.bfloat16).reshape(array.shape)
    return array.astype(dtype)


def _as_float64(x: Any) -> np.ndarray:
    return (
        x.float().numpy().astype(np.float64)
        if isinstance(x, torch.Tensor)
        else x.astype(np.float64)
    )


def _reference(inputs: list[np.ndarray], op: ReduceOp, dtype: str) -> np.ndarray:
    stack = np.stack(inputs)
    if dtype == "bool":
        if op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.BOR):
            return np.logical_or.reduce(stack)
        if op is ReduceOp.BXOR:
            return np.logical_xor.reduce(stack)
        return np.logical_and.reduce(stack)
    wide = stack.astype(np.float64 if dtype.startswith(("float", "bfloat")) else np.int64)
    table: dict[ReduceOp, Callable[..., np.ndarray]] = {
        ReduceOp.SUM: np.sum,
        ReduceOp.AVG: np.mean,
        ReduceOp.PRODUCT: np.prod,
        ReduceOp.MIN: np.min,
        ReduceOp.MAX: np.max,
        ReduceOp.BAND: np.bitwise_and.reduce,
        ReduceOp.BOR: np.bitwise_or.reduce,
        ReduceOp.BXOR: np.bitwise_xor.reduce,
    }
    return table[op](wide, axis=0)


@pytest.mark.parametrize("seed", range(int(os.environ.get("SHM_SEEDS", "12"))))
def test_random_dtype_shape_op_world_size_and_root_match_numpy(seed: int) -> None:
    case = _random_case(seed)
    dtype, shape, op, n = case["dtype"], case["shape"], case["op"], case["world_size"]
    rng = np.random.default_rng(seed)
    root = int(rng.integers(n))
    inputs = [np.asarray(rng.integers(1, 4, size=shape)) for _ in range(n)]
    if dtype == "bool":
        inputs = [np.asarray(i % 2 == 0) for i in inputs]

    def fn(group: CpuGroup, rank: int) -> dict[str, Any]:
        x, y = _tensor(inputs[rank], dtype), _tensor(inputs[rank], dtype)
        group.allreduce([x], AllReduceOptions(op))
        group.reduce([y], ReduceOptions(op, root_rank=root))
        b = _tensor(inputs[rank], dtype)
        group.broadcast([b], BroadcastOptions(root_rank=root))
        gathered = [_tensor(np.zeros(shape), dtype) for _ in range(n)]
        group.allgather([gathered], [_tensor(inputs[rank], dtype)], AllGatherOptions())
        return {"allreduce": x, "reduce": y, "broadcast": b, "allgather": gathered}

    results = run_cpu(n, fn, slot_bytes=max(256, 64 * n))
    want = _reference([i.astype(np.float64) if dtype != "bool" else i for i in inputs], op, dtype)
    tolerance = {"float16": 1e-2, "bfloat16": 5e-2}.get(dtype, 1e-9)
    first = results[0]["allreduce"]
    for rank, out in enumerate(results):
        what = f"case {case} rank {rank}"
        got = out["allreduce"]
        assert tuple(got.shape) == tuple(shape), what
        np.testing.assert_allclose(
            _as_float64(got), want.astype(np.float64), rtol=tolerance, err_msg=what
        )
        np.testing.assert_array_equal(
            _as_float64(got), _as_float64(first), err_msg=f"{what}: ranks differ"
        )
        reduced = _as_float64(out["reduce"])
        if rank == root:
            np.testing.assert_allclose(
                reduced, want.astype(np.float64), rtol=tolerance, err_msg=what
            )
        else:
            np.testing.assert_array_equal(
                reduced, _as_float64(_tensor(inputs[rank], dtype)), err_msg=what
            )
        np.testing.assert_array_equal(
            _as_float64(out["broadcast"]), _as_float64(_tensor(inputs[root], dtype)), err_msg=what
        )
        for r in range(n):
            np.testing.assert_array_equal(
                _as_float64(out["allgather"][r]),
                _as_float64(_tensor(inputs[r], dtype)),
                err_msg=what,
            )


# --- several nodes, faked ---------------------------------------------------------------------

NODES = ["a", "b", "a", "b"]
"""Ranks 0 and 2 share node a, ranks 1 and 3 node b: neither node's ranks are contiguous."""


def test_hierarchical_ops_match_a_flat_group_for_every_root() -> None:
    n = 4

    def fn(group: CpuGroup, rank: int) -> dict[str, Any]:
        out: dict[str, Any] = {"transport": group.transport}
        x = np.full(1000, rank + 1.0)
        group.allreduce([x], AllReduceOptions())
        out["allreduce"] = x
        a = torch.full((5,), float(rank + 1), dtype=torch.bfloat16)
        group.allreduce([a], AllReduceOptions(ReduceOp.AVG))
        out["avg"] = a.float().numpy()
        for root in range(n):
            b = np.full(700, 100 + root if rank == root else -1, np.int64)
            group.broadcast([b], BroadcastOptions(root_rank=root))
            out[f"broadcast{root}"] = b
            r = np.full(300, rank + 1, np.int32)
            group.reduce([r], ReduceOptions(ReduceOp.PRODUCT, root_rank=root))
            out[f"reduce{root}"] = r
        gathered = [np.zeros(200, np.float32) for _ in range(n)]
        group.allgather([gathered], [np.full(200, rank, np.float32)], AllGatherOptions())
        out["allgather"] = gathered
        chunks = [np.full(150, rank * 10 + j, np.int64) for j in range(n)]
        mine = np.zeros(150, np.int64)
        group.reducescatter([mine], [chunks], ReduceScatterOptions(ReduceOp.MAX))
        out["reducescatter"] = mine
        group.barrier(BarrierOptions())
        pieces = [np.zeros(3) for _ in range(n)] if rank == 3 else []
        group.gather([pieces], [np.full(3, float(rank))], GatherOptions(root_rank=3))
        out["gather"] = pieces
        scattered = np.zeros(2)
        source = [np.full(2, 50.0 + j) for j in range(n)] if rank == 2 else []
        group.scatter([scattered], [source], ScatterOptions(root_rank=2))
        out["scatter"] = scattered
        received = [np.zeros(4, np.int8) for _ in range(n)]
        group.alltoall(
            received, [np.full(4, rank * 4 + j, np.int8) for j in range(n)], AllToAllOptions()
        )
        out["alltoall"] = received
        peer = {0: 2, 2: 0, 1: 3, 3: 1}[rank]  # same node
        far = {0: 1, 1: 0, 2: 3, 3: 2}[rank]  # other node
        for other in (peer, far):
            got = np.zeros(6, np.float64)
            if rank < other:
                group.send([np.full(6, rank * 100.0 + other)], SendOptions(other))
                group.recv([got], RecvOptions(other))
            else:
                group.recv([got], RecvOptions(other))
                group.send([np.full(6, rank * 100.0 + other)], SendOptions(other))
            out[f"p2p{other}"] = got
        return out

    results = run_cpu(n, fn, nodes=NODES, slot_bytes=512)
    for rank, out in enumerate(results):
        assert out["transport"] == "hierarchical"
        np.testing.assert_array_equal(out["allreduce"], np.full(1000, 10.0))
        np.testing.assert_array_equal(out["avg"], np.full(5, 2.5))
        for root in range(n):
            np.testing.assert_array_equal(out[f"broadcast{root}"], np.full(700, 100 + root))
            want = np.full(300, 24 if rank == root else rank + 1)
            np.testing.assert_array_equal(out[f"reduce{root}"], want, err_msg=f"root {root}")
        for r in range(n):
            np.testing.assert_array_equal(out["allgather"][r], np.full(200, r))
            np.testing.assert_array_equal(out["alltoall"][r], np.full(4, r * 4 + rank))
        np.testing.assert_array_equal(out["reducescatter"], np.full(150, 30 + rank))
        if rank == 3:
            for r in range(n):
                np.testing.assert_array_equal(out["gather"][r], np.full(3, float(r)))
        np.testing.assert_array_equal(out["scatter"], np.full(2, 50.0 + rank))
        for other in ({0: 2, 2: 0, 1: 3, 3: 1}[rank], {0: 1, 1: 0, 2: 3, 3: 2}[rank]):
            np.testing.assert_array_equal(out[f"p2p{other}"], np.full(6, other * 100.0 + rank))


def test_nodes_of_one_rank_each_use_plain_gloo() -> None:
    def fn(group: CpuGroup, rank: int) -> tuple[str, float]:
        x = np.full(2, rank + 1.0)
        group.allreduce([x], AllReduceOptions())
        return group.transport, float(x[0])

    assert run_cpu(2, fn, nodes=["a", "b"]) == [("gloo", 3.0), ("gloo", 3.0)]


def test_a_node_of_one_rank_beside_a_shared_node() -> None:
    def fn(group: CpuGroup, rank: int) -> tuple[str, list[float]]:
        x = np.full(3, rank + 1.0)
        group.allreduce([x], AllReduceOptions())
        b = np.full(2, 7.0 if rank == 2 else 0.0)
        group.broadcast([b], BroadcastOptions(root_rank=2))
        return group.transport, [float(x[0]), float(b[0])]

    results = run_cpu(3, fn, nodes=["a", "a", "b"])
    assert results == [("hierarchical", [6.0, 7.0])] * 3


# --- mismatches, timeouts, async, destroy ---------------------------------------------------


def test_ranks_passing_different_sizes_fail_instead_of_reading_wrong_data() -> None:
    def fn(group: CpuGroup, rank: int) -> str:
        x = np.ones(4 if rank == 0 else 6)
        try:
            group.allreduce([x], AllReduceOptions(timeout=timedelta(seconds=5)))
        except CollectiveError as exc:
            return str(exc)
        return "no error"

    for message in run_cpu(2, fn):
        assert "called allreduce (SUM) of 6 float64 elements" in message, message
        assert "called allreduce (SUM) of 4 float64 elements" in message, message


def test_alltoall_sizes_that_do_not_pair_up_raise_on_every_rank_and_keep_the_group() -> None:
    def fn(group: CpuGroup, rank: int) -> tuple[str, float]:
        sends = [np.ones(3 if rank == 0 else 2) for _ in range(2)]
        receives = [np.zeros(2) for _ in range(2)]
        with pytest.raises(ValueError, match="do not pair up") as raised:
            group.alltoall(receives, sends, AllToAllOptions())
        assert isinstance(raised.value, RuntimeError)
        x = np.full(2, rank + 1.0)
        group.allreduce([x], AllReduceOptions())
        return str(raised.value), float(x[0])

    results = run_cpu(2, fn)
    assert results[0] == results[1]
    assert results[0][1] == 3.0


def test_a_timeout_names_the_rank_that_never_reached_the_op() -> None:
    absence = Absence(present=2)

    def fn(group: CpuGroup, rank: int) -> tuple[str, str, float] | None:
        group.barrier(BarrierOptions())
        if rank == 2:
            absence.stay()
            return None
        try:
            start = time.monotonic()
            with pytest.raises(CollectiveError) as raised:
                group.allreduce([np.ones(3)], AllReduceOptions(timeout=timedelta(seconds=1)))
            return type(raised.value).__name__, str(raised.value), time.monotonic() - start
        finally:
            absence.done()

    results = [r for r in run_cpu(3, fn) if r is not None]
    timeouts = [message for kind, message, _ in results if kind == "CollectiveTimeoutError"]
    assert timeouts, results  # the first rank to time out; the other may be aborted by it
    for message in timeouts:
        assert "ranks that never joined it: [2] (rank 2 has issued 1 ops)" in message, message
        assert "ranks that joined it (op 2 of the group): [0, 1]" in message, message
    assert all(took < 2.5 for _, _, took in results), results


def test_async_ops_run_in_issue_order_and_a_blocking_op_waits_for_them() -> None:
    def fn(group: CpuGroup, rank: int) -> list[float]:
        xs = [np.full(10_000, float(rank + i)) for i in range(5)]
        works = [group.allreduce([x], AllReduceOptions(async_op=True)) for x in xs]
        y = np.full(3, 1.0)
        group.allreduce([y], AllReduceOptions())  # queued behind the five
        assert all(w.is_completed() for w in works)
        for w in works:
            w.wait()
            assert w.exception() is None
        return [float(x[0]) for x in xs] + [float(y[0])]

    results = run_cpu(2, fn, slot_bytes=1024)
    assert results == [[1.0, 3.0, 5.0, 7.0, 9.0, 2.0]] * 2


def test_two_threads_drive_two_groups_of_the_same_ranks() -> None:
    master_a, master_b = _master_store(), _master_store()
    names = (f"a-{uuid.uuid4().hex[:6]}", f"b-{uuid.uuid4().hex[:6]}")
    results: dict[tuple[int, int], float] = {}

    def rank_body(rank: int) -> None:
        groups = []
        for master, name in zip((master_a, master_b), names, strict=True):
            store = master if rank == 0 else _client_store(master, TIMEOUT)
            groups.append((master, name, store))

        def drive(which: int) -> None:
            _, name, store = groups[which]
            group = CpuGroup(2, rank, name, TCPRendezvousStore(store), TIMEOUT)
            try:
                total = 0.0
                for i in range(200):
                    x = np.full(8, float(rank + which + i))
                    group.allreduce([x], AllReduceOptions())
                    total += float(x[0])
                results[(rank, which)] = total
            finally:
                group.destroy_group()

        threads = [threading.Thread(target=drive, args=(w,)) for w in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(JOIN_TIMEOUT_S)

    _run_threads([functools.partial(rank_body, r) for r in range(2)], JOIN_TIMEOUT_S)
    for which in (0, 1):
        want = sum(2 * i + 1 + 2 * which for i in range(200))
        assert results[(0, which)] == results[(1, which)] == want


def test_destroy_with_a_pending_op_returns_at_once_and_ends_the_op() -> None:
    absence = Absence()

    def fn(group: CpuGroup, rank: int) -> tuple[float, str] | None:
        if rank == 1:
            absence.stay()  # never joins
            return None
        try:
            work = group.allreduce([np.ones(4)], AllReduceOptions(async_op=True))
            time.sleep(0.2)
            start = time.monotonic()
            group.destroy_group()
            took = time.monotonic() - start
            with pytest.raises(CollectiveError, match="destroyed") as raised:
                work.wait()
            return took, str(raised.value)
        finally:
            absence.done()

    took, message = run_cpu(2, fn, timeout=timedelta(seconds=30))[0]
    assert took < 1.0, took
    assert "allreduce" in message
