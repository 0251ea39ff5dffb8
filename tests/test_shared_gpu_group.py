"""A ``backend="nccl"`` group whose ranks share one GPU, built and run on a stood-in GPU.

Ranks are threads of this process meeting on a TCPStore, each with its own
``HostDevice`` over one ``HostGpu`` (``shared_gpu_standin``); their buffers are numpy
arrays, described as a GPU buffer would be. So the group's picking, every op, async
ops, send/recv, lists, failures and teardown run for real, on every rank; CUDA itself
is checked by ``test_shared_gpu_contract.py`` and on a GPU by ``tests/gpu``.
"""

from __future__ import annotations

import gc
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import pytest

from collective.frameworks import device_arrays
from collective.frameworks.bytelist import ByteList
from collective.frameworks.cuda_buffers import CudaBuffer
from collective.groups.gpu import connect
from collective.groups.gpu.connect import choose, connect_gpu_group, wished
from collective.groups.shared_gpu import transport
from collective.groups.shared_gpu.group import SharedGpuGroup
from collective.groups.shared_gpu.running import Buffers
from collective.groups.shm.arena import NAME_PREFIX, SHM_DIR
from collective.registry import backends
from collective.rendezvous.store import TCPRendezvousStore
from collective.types import (
    AllGatherOptions,
    AllReduceOptions,
    AllToAllOptions,
    ArgumentValueError,
    BarrierOptions,
    BroadcastOptions,
    CollectiveError,
    CollectiveTimeoutError,
    GatherOptions,
    RecvOptions,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
    SendOptions,
)
from tests.shared_gpu_standin import HostDevice, HostGpu, device_bytes
from tests.test_gloo_group import JOIN_TIMEOUT_S, _client_store, _master_store, _run_threads

TIMEOUT = timedelta(seconds=20)


def describe(x: Any, name: str) -> CudaBuffer:
    """Describe numpy array ``x`` as ``cuda_buffers.cuda_buffer`` describes a GPU buffer.

    The stand-in GPU then knows ``x``'s memory as a GPU buffer, while ``x`` lives.
    """
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be an array")
    if not x.flags.c_contiguous:
        raise ArgumentValueError(f"{name} is not contiguous")
    device_bytes(x)
    return CudaBuffer(int(x.ctypes.data), x.size, x.dtype.name, 0, x.dtype.itemsize)


def _contiguous_copy(x: np.ndarray) -> tuple[np.ndarray, Callable[[], None]]:
    """Return a contiguous copy of ``x``, and what writes it back on the current stream."""
    copy = np.ascontiguousarray(x)
    strided = device_bytes(x.base if x.base is not None else x)
    at = (int(x.ctypes.data) - int(strided.ctypes.data)) // x.itemsize

    def back() -> None:  # a device copy of the staged bytes into x's strided elements
        typed = strided.view(x.dtype)
        view = np.lib.stride_tricks.as_strided(typed[at:], x.shape, x.strides, subok=True)
        view[...] = device_bytes(copy).view(x.dtype).reshape(x.shape)

    return copy, back


HOST_BUFFERS = Buffers(describe, lambda x: 5, lambda x: False, _contiguous_copy)
"""numpy arrays standing in for a GPU's buffers, on stream 5, never captured."""


def run_group(
    world_size: int,
    fn: Callable[[SharedGpuGroup, int], Any],
    gpu: HostGpu | None = None,
    group_timeout: timedelta = TIMEOUT,
) -> list[Any]:
    """Run ``fn(group, rank)`` on a fresh group of ranks on one stand-in GPU; destroy it after."""
    gpu = gpu or HostGpu()
    master = _master_store()
    name = f"sgpu-{uuid.uuid4().hex[:8]}"

    def target(rank: int) -> Callable[[], Any]:
        def run() -> Any:
            store = master if rank == 0 else _client_store(master, TIMEOUT)
            group = connect_gpu_group(
                world_size,
                rank,
                name,
                TCPRendezvousStore(store),
                group_timeout,
                device=HostDevice(gpu, rank),
                buffers=HOST_BUFFERS,
            )
            assert isinstance(group, SharedGpuGroup)
            try:
                return fn(group, rank)
            finally:
                group.destroy_group()

        return run

    results = _run_threads([target(r) for r in range(world_size)], JOIN_TIMEOUT_S)
    assert gpu.misuse == [], gpu.misuse
    return results


def synchronize(group: Any) -> None:
    """Wait until the device ran what ``group``'s ops queued: before reading a result."""
    group._transport.device.synchronize()


def _data(seed: int, count: int, dtype: str = "float32") -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(1, 100, count).astype(dtype)


@pytest.fixture(autouse=True)
def small_mailboxes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mailboxes of 4 KiB, so that a message takes many chunks."""
    monkeypatch.setattr(transport, "MAIL_BYTES", 4096)
    monkeypatch.setattr(transport, "SLOT_BYTES", 8192)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_op_on_every_rank(world_size: int) -> None:
    n = 5000
    ws = world_size

    def fn(g: SharedGpuGroup, rank: int) -> dict[str, Any]:
        assert g.transport == "shared_gpu"
        out: dict[str, Any] = {}
        x = _data(rank, n)
        g.allreduce([x], AllReduceOptions(reduce_op=ReduceOp.SUM))
        out["allreduce"] = x
        x = _data(rank, n, "int64")
        g.allreduce([x], AllReduceOptions(reduce_op=ReduceOp.MAX, async_op=True)).wait()
        out["allreduce-async"] = x
        x = _data(rank, n)
        g.reduce([x], ReduceOptions(reduce_op=ReduceOp.PRODUCT, root_rank=ws - 1))
        out["reduce"] = x
        x = _data(rank, n, "float64")
        g.broadcast([x], BroadcastOptions(root_rank=1))
        out["broadcast"] = x
        outs = [np.zeros(n, np.int32) for _ in range(ws)]
        g.allgather([outs], [_data(rank, n, "int32")], AllGatherOptions())
        out["allgather"] = outs
        result = np.zeros(n, np.float32)
        g.reducescatter(
            [result], [[_data(rank * 10 + j, n) for j in range(ws)]], ReduceScatterOptions()
        )
        out["reducescatter"] = result
        gathered = [np.zeros(n, np.int32) for _ in range(ws)] if rank == 0 else []
        g.gather([gathered], [_data(rank, n, "int32")], GatherOptions(root_rank=0))
        out["gather"] = gathered
        got = np.zeros(n, np.int32)
        sources = [_data(100 + j, n, "int32") for j in range(ws)] if rank == 1 else []
        g.scatter([got], [sources], ScatterOptions(root_rank=1))
        out["scatter"] = got
        sends = [_data(1000 * rank + j, 10 * (rank + j + 1), "int32") for j in range(ws)]
        receives = [np.zeros(10 * (j + rank + 1), np.int32) for j in range(ws)]
        g.alltoall(receives, sends, AllToAllOptions())
        out["alltoall"] = receives
        tensors = [_data(500 + rank * 0 + i, 300 * i + 1) for i in range(5)]
        if rank != 0:
            tensors = [np.zeros_like(t) for t in tensors]
        g.broadcast_list(tensors, BroadcastOptions(root_rank=0))
        out["list"] = tensors
        g.barrier(BarrierOptions())
        return out

    results = run_group(world_size, fn)
    total = np.sum([_data(r, n) for r in range(ws)], axis=0)
    for rank, got in enumerate(results):
        np.testing.assert_array_equal(got["allreduce"], total)
        best = np.max([_data(r, n, "int64") for r in range(ws)], axis=0)
        np.testing.assert_array_equal(got["allreduce-async"], best)
        product = np.prod([_data(r, n) for r in range(ws)], axis=0)
        want = product if rank == ws - 1 else _data(rank, n)
        np.testing.assert_allclose(got["reduce"], want, rtol=1e-6)
        np.testing.assert_array_equal(got["broadcast"], _data(1, n, "float64"))
        for j in range(ws):
            np.testing.assert_array_equal(got["allgather"][j], _data(j, n, "int32"))
            if rank == 0:
                np.testing.assert_array_equal(got["gather"][j], _data(j, n, "int32"))
            sent = _data(1000 * j + rank, 10 * (j + rank + 1), "int32")
            np.testing.assert_array_equal(got["alltoall"][j], sent)
        want_rs = np.sum([_data(r * 10 + rank, n) for r in range(ws)], axis=0)
        np.testing.assert_array_equal(got["reducescatter"], want_rs)
        np.testing.assert_array_equal(got["scatter"], _data(100 + rank, n, "int32"))
        for i, t in enumerate(got["list"]):
            np.testing.assert_array_equal(t, _data(500 + i, 300 * i + 1))


def test_send_and_recv_both_ways_at_once_through_many_chunks() -> None:
    n = 10_000  # 40 KB through 4 KiB mailboxes

    def fn(g: SharedGpuGroup, rank: int) -> np.ndarray:
        peer = 1 - rank
        mine = _data(rank + 40, n)
        got = np.zeros(n, np.float32)
        sent = g.send([mine], SendOptions(dst_rank=peer, async_op=True))
        g.recv([got], RecvOptions(src_rank=peer))
        sent.wait()
        return got

    results = run_group(2, fn)
    for rank, got in enumerate(results):
        np.testing.assert_array_equal(got, _data(1 - rank + 40, n))


def test_a_receive_of_the_wrong_size_raises_and_writes_nothing() -> None:
    def fn(g: SharedGpuGroup, rank: int) -> str:
        if rank == 0:
            g.send([_data(1, 100)], SendOptions(dst_rank=1))
            return ""
        got = np.zeros(99, np.float32)
        with pytest.raises(CollectiveError, match="sent") as caught:
            g.recv([got], RecvOptions(src_rank=0))
        assert not got.any()
        return str(caught.value)

    assert "receives into" in run_group(2, fn)[1]


def test_ranks_that_call_different_ops_break_the_group_on_every_rank() -> None:
    def fn(g: SharedGpuGroup, rank: int) -> str:
        x = _data(rank, 100)
        before = x.copy()
        with pytest.raises(CollectiveError) as caught:
            if rank == 0:
                g.allreduce([x], AllReduceOptions())
            else:
                g.broadcast([x], BroadcastOptions(root_rank=1))
        if rank == 0:
            np.testing.assert_array_equal(x, before)
        with pytest.raises(CollectiveError):
            g.barrier(BarrierOptions())
        return str(caught.value)

    messages = run_group(2, fn)
    assert any("allreduce" in m and "broadcast" in m for m in messages), messages


def test_a_rank_that_skips_an_op_is_named_by_the_others_timeout() -> None:
    done = threading.Event()

    def fn(g: SharedGpuGroup, rank: int) -> str:
        if rank == 1:
            done.wait(JOIN_TIMEOUT_S / 2)
            return ""
        start = time.monotonic()
        try:
            with pytest.raises(CollectiveError) as caught:
                g.allreduce([_data(rank, 10)], AllReduceOptions(timeout=timedelta(seconds=1)))
        finally:
            if rank == 2:
                done.set()
        assert time.monotonic() - start < 5
        return f"{type(caught.value).__name__}: {caught.value}"

    messages = run_group(3, fn)
    for rank in (0, 2):
        assert "never joined it: [1]" in messages[rank], messages[rank]
    # The first rank to time out ends the others' wait at once, with its own message.
    assert any(m.startswith(CollectiveTimeoutError.__name__) for m in messages[::2]), messages


def test_one_buffer_per_rank() -> None:
    def fn(g: SharedGpuGroup, rank: int) -> None:
        with pytest.raises(ArgumentValueError, match="one tensor per rank, got 2"):
            g.allreduce([_data(0, 4), _data(1, 4)], AllReduceOptions())

    run_group(2, fn)


def _our_files() -> set[str]:
    return {f for f in os.listdir(SHM_DIR) if f.startswith(f"{NAME_PREFIX}{os.getpid()}-")}


def test_a_hundred_groups_made_used_and_destroyed_leave_nothing() -> None:
    gpu = HostGpu()
    before = _our_files()

    def fn(g: SharedGpuGroup, rank: int) -> None:
        g.allreduce([_data(rank, 300)], AllReduceOptions())

    for _ in range(100):
        run_group(2, fn, gpu)
    assert gpu.live() == (0, 0)
    assert gpu.misuse == []
    assert _our_files() == before


def test_the_layout_decides_the_transport() -> None:
    assert choose([["n", "a"], ["n", "b"], ["m", "a"]]) == "nccl"
    assert choose([["n", "a"]] * 3) == "shared_gpu"
    assert choose([["n", "a"], ["n", "b"], ["n", "a"]]) == "hierarchy"
    assert choose([["n", "a"], ["m", "a"], ["m", "a"]]) == "hierarchy"


def test_the_variable_forces_nccl_or_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    assert wished() == "auto"
    monkeypatch.setenv(connect.TRANSPORT_ENV, "NCCL")
    assert wished() == "nccl"
    monkeypatch.setenv(connect.TRANSPORT_ENV, "sockets")
    with pytest.raises(CollectiveError, match="must be one of"):
        wished()


def test_new_incarnations_and_subgroups_pick_their_transport_again() -> None:
    def fn(g: SharedGpuGroup, rank: int) -> None:
        assert backends.rebuilder(g) is connect_gpu_group

    run_group(2, fn)
    assert backends.builder("nccl") is connect_gpu_group


def test_a_list_with_strided_tensors_and_a_byte_list_move_whole() -> None:
    def fn(g: SharedGpuGroup, rank: int) -> list[np.ndarray]:
        base = [_data(60 + i, 40 * (i + 1)).reshape(2, -1) for i in range(4)]
        tensors = [b.T for b in base]  # none contiguous
        if rank != 0:
            tensors = [np.zeros_like(b).T for b in base]
        g.broadcast_list(tensors, BroadcastOptions(root_rank=0))
        raw = _data(7, 999) if rank == 0 else np.zeros(999, np.float32)
        g.broadcast_list(ByteList.of([device_bytes(raw)]), BroadcastOptions(root_rank=0))
        synchronize(g)
        return [np.ascontiguousarray(t) for t in tensors] + [raw]

    for got in run_group(3, fn):
        for i, t in enumerate(got[:4]):
            np.testing.assert_array_equal(t, _data(60 + i, 40 * (i + 1)).reshape(2, -1).T)
        np.testing.assert_array_equal(got[4], _data(7, 999))


def test_staged_tensors_are_written_back_on_the_ops_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An async list op runs on the group's thread, whose current torch stream is not the
    caller's: each write-back of a staged (strided) tensor runs with the op's stream made
    current for it (stream 5 here), on every rank that receives."""
    made: list[tuple[int, int]] = []
    real = device_arrays.on_stream

    def on_stream(x: Any, stream: int) -> Any:
        made.append((id(x), stream))
        return real(x, stream)

    monkeypatch.setattr(device_arrays, "on_stream", on_stream)

    def fn(g: SharedGpuGroup, rank: int) -> list[int]:
        base = [_data(60 + i, 40).reshape(2, -1) for i in range(2)]
        tensors = [b.T for b in base] if rank == 0 else [np.zeros_like(b).T for b in base]
        g.broadcast_list(tensors, BroadcastOptions(root_rank=0, async_op=True)).wait()
        return [id(t) for t in tensors]

    ids = run_group(2, fn)
    assert sorted(made) == sorted((i, 5) for i in ids[1])  # the receiver's two, nothing else


def test_a_graph_capture_is_refused_before_anything_moves() -> None:
    # The caller's stream captures while it holds an array of 8 elements.
    capturing = Buffers(
        describe, lambda x: 5, lambda x: getattr(x, "size", 0) == 8, _contiguous_copy
    )
    gpu = HostGpu()
    master = _master_store()

    def target(rank: int) -> Callable[[], str]:
        def run() -> str:
            store = master if rank == 0 else _client_store(master, TIMEOUT)
            group = connect_gpu_group(
                2,
                rank,
                "captured",
                TCPRendezvousStore(store),
                TIMEOUT,
                device=HostDevice(gpu, rank),
                buffers=capturing,
            )
            try:
                with pytest.raises(ArgumentValueError, match="cannot be captured") as caught:
                    group.allreduce([_data(rank, 8)], AllReduceOptions())
                group.barrier(BarrierOptions())  # the group is still whole
                return str(caught.value)
            finally:
                group.destroy_group()

        return run

    assert all(_run_threads([target(0), target(1)], JOIN_TIMEOUT_S))


def test_an_async_op_on_the_per_thread_default_stream_is_refused_before_anything_moves() -> None:
    """Handle 2 names each thread's own default stream: issued from the group's thread, the
    op would not follow the caller's work. A blocking op on it runs in the caller's thread."""
    per_thread = Buffers(describe, lambda x: 2, lambda x: False, _contiguous_copy)
    gpu = HostGpu()
    master = _master_store()

    def target(rank: int) -> Callable[[], np.ndarray]:
        def run() -> np.ndarray:
            store = master if rank == 0 else _client_store(master, TIMEOUT)
            group = connect_gpu_group(
                2,
                rank,
                "per-thread",
                TCPRendezvousStore(store),
                TIMEOUT,
                device=HostDevice(gpu, rank),
                buffers=per_thread,
            )
            try:
                x = _data(rank, 8)
                with pytest.raises(ArgumentValueError, match="per-thread default stream"):
                    group.allreduce([x], AllReduceOptions(async_op=True))
                group.allreduce([x], AllReduceOptions())  # blocking: fine, and the group whole
                return x
            finally:
                group.destroy_group()

        return run

    for x in _run_threads([target(0), target(1)], JOIN_TIMEOUT_S):
        np.testing.assert_array_equal(x, _data(0, 8) + _data(1, 8))


def test_no_memory_or_event_is_made_exported_or_opened_per_op() -> None:
    """Handles are made and opened once, at connect: the caller's buffers are never exported
    (so memory from any allocator, torch's expandable segments included, works), and no op
    makes, exports or opens anything."""

    def fn(g: SharedGpuGroup, rank: int) -> list[str]:
        assert g._transport is not None
        device = g._transport.device
        assert isinstance(device, HostDevice)
        at_connect = list(device.made)
        peer = 1 - rank
        for _ in range(2):  # a second round, after every view is made
            x = _data(rank, 3000)  # held: an async op keeps only the buffer's address
            g.allreduce([x], AllReduceOptions(ReduceOp.AVG, async_op=True)).wait()
            g.broadcast([_data(rank, 3000, "int64")], BroadcastOptions(root_rank=1))
            g.allgather(
                [[np.zeros(50, np.int32) for _ in range(2)]],
                [_data(rank, 50, "int32")],
                AllGatherOptions(),
            )
            tensors = [_data(9 + i, 700 * i + 1) for i in range(3)]
            g.broadcast_list(tensors, BroadcastOptions(root_rank=0))
            sent = g.send([x], SendOptions(dst_rank=peer, async_op=True))
            g.recv([np.zeros(3000, np.float32)], RecvOptions(src_rank=peer))
            sent.wait()
            g.barrier(BarrierOptions())
        assert device.made == at_connect, device.made[len(at_connect) :]
        return at_connect

    for made in run_group(2, fn):
        assert made.count("export_memory") == 1 and made.count("open_memory") == 1, made
        assert made.count("alloc") == 1, made


def test_the_variable_builds_plain_nccl_without_asking_where_the_gpu_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``COLLECTIVE_GPU_TRANSPORT=nccl``: an ``NCCLGroup`` whatever the layout; no exchange
    of GPUs (a store that refuses every call) and no question to the device."""
    built: list[tuple[Any, ...]] = []

    class Plain:
        def __init__(self, *args: Any) -> None:
            built.append(args)

    class NoDevice(HostDevice):
        def uuid(self) -> str:
            raise AssertionError("the GPU's UUID was asked for")

    monkeypatch.setattr(connect, "NCCLGroup", Plain)
    monkeypatch.setenv(connect.TRANSPORT_ENV, "nccl")
    refusing: Any = object()  # a store with no methods: any exchange would raise
    group = connect_gpu_group(2, 1, "forced", refusing, TIMEOUT, device=NoDevice(HostGpu(), 1))
    assert isinstance(group, Plain)
    assert built == [(2, 1, "forced", refusing, TIMEOUT, "127.0.0.1", None)]


def test_an_async_op_holds_the_callers_buffer_until_it_is_issued() -> None:
    """A caller may drop its buffer after an async call: the op must not write freed memory."""
    came = threading.Event()

    def fn(g: SharedGpuGroup, rank: int) -> Any:
        if rank == 1:
            came.wait(JOIN_TIMEOUT_S / 2)  # joins the op late
            y = np.ones(64, dtype=np.float32)
            g.allreduce([y], AllReduceOptions())
            synchronize(g)
            return y[:2].tolist()
        x = np.full(64, 2.0, dtype=np.float32)
        dropped = weakref.ref(x)
        work = g.allreduce([x], AllReduceOptions(async_op=True))
        del x
        gc.collect()
        held_while_pending = dropped() is not None
        came.set()
        work.wait()
        synchronize(g)  # the device work queued also held it (stream-ordered memory)
        gc.collect()
        return held_while_pending, dropped() is None

    held, released = run_group(2, fn)[0]
    assert held, "the async op let go of the caller's buffer before it was issued"
    assert released, "the op kept the caller's buffer after it completed"
