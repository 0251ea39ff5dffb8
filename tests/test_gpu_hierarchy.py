"""A ``backend="nccl"`` group over several GPUs with several ranks on some, on stood-in GPUs.

No machine here has two GPUs. Ranks are threads meeting on a TCPStore; the ranks of
each stood-in GPU (a ``HostGpu``) run the real shared-GPU transport over it, and NCCL
among the GPUs' leaders (and between ranks of different GPUs) is stood in for by Gloo
groups on host memory (``HostStages``), which compare an op's signature words as NCCL's
check does and tell each other of a failure as ``NCCLGroup`` does through the store. So
the picking, every stage of every op, the agreement on the whole op, the failures and
the teardown run for real on every rank; NCCL's own calls are checked by the contract
suite (``test_nccl_contract_mismatch.py``: ``NCCLGroup.agree``).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from collective.groups.gloo.group import GlooGroup
from collective.groups.gpu.connect import connect_gpu_group
from collective.groups.gpu.hierarchy import GpuHierarchyGroup
from collective.groups.gpu.multigpu import Gpus
from collective.groups.gpu.stages import Arrays
from collective.groups.nccl import mismatch
from collective.groups.shared_gpu import transport
from collective.groups.shared_gpu.running import Buffers
from collective.rendezvous.store import TCPRendezvousStore
from collective.types import (
    AllGatherOptions,
    AllReduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    CollectiveError,
    GatherOptions,
    RecvOptions,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
    SendOptions,
)
from tests.shared_gpu_standin import HostDevice, HostGpu, device_empty, host_stage
from tests.test_gloo_group import JOIN_TIMEOUT_S, _client_store, _master_store, _run_threads
from tests.test_shared_gpu_group import HOST_BUFFERS, _data, _our_files

TIMEOUT = timedelta(seconds=20)

HOST_ARRAYS = Arrays(
    lambda view, dtype: view.view(dtype),
    device_empty,
    lambda x, stream: host_stage(),
)
"""The stand-in GPU's arrays for the hierarchy's own device arrays; its stood-in NCCL calls
run on the host once the op's stream reached them."""


class HostStages:
    """NCCL among GPUs stood in by a Gloo group on host memory; see the module docstring."""

    boards: ClassVar[dict[str, list[HostStages]]] = {}
    """The groups of each name, which a failure reaches (as NCCL's through the store)."""
    _lock = threading.Lock()

    def __init__(self, *args: Any) -> None:
        self.gloo = GlooGroup(*args)
        self._listeners: list[Callable[[CollectiveError], None]] = []
        self._failure: CollectiveError | None = None
        with self._lock:
            self.boards.setdefault(self.gloo.group_name, []).append(self)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.gloo, name)

    @property
    def error(self) -> CollectiveError | None:
        return self._failure or self.gloo.error

    def agree(
        self, op: str, x: Any, root: int, reduce_op: ReduceOp | None, timeout: timedelta
    ) -> None:
        """Compare the words of ``op`` among the ranks, as ``mismatch.Check`` does."""
        found = torch.from_numpy(mismatch.words(op, x, root, reduce_op))
        self.gloo.allreduce([found], AllReduceOptions(ReduceOp.MAX, timeout))
        words = found.numpy()
        if words[0] != -words[mismatch.WORDS]:
            error = CollectiveError(
                f"group {self.gloo.group_name!r}: {op}: the ranks called different ops or "
                "arguments; " + "; ".join(mismatch.differences(words))
            )
            self.fail(error)
            raise error

    def on_failure(self, listener: Callable[[CollectiveError], None]) -> None:
        self._listeners.append(listener)

    def fail(self, error: CollectiveError) -> None:
        """Fail here and on every peer, each telling its listeners once."""
        with self._lock:
            peers = list(self.boards.get(self.gloo.group_name, []))
        for group in peers:
            if group._failure is None:
                group._failure = error
                group.gloo.abort(str(error))
                for listener in group._listeners:
                    listener(error)


def run_on_gpus(
    world_size: int,
    fn: Callable[[Any, int], Any],
    device_of: Callable[[int], HostDevice],
    *,
    make: Callable[..., Any] = HostStages,
    buffers: Buffers = HOST_BUFFERS,
    gpus_of: Callable[[int], Gpus | None] = lambda rank: None,
    group_timeout: timedelta = TIMEOUT,
) -> list[Any]:
    """Run ``fn(group, rank)`` on a group built as ``backend="nccl"`` does; destroy it after.

    Rank r's current GPU is ``device_of(r)``; ``make`` stands in for the NCCL groups
    (``HostStages``), ``gpus_of(r)`` for rank r's GPUs by ordinal (the ``*_multigpu``
    calls).
    """
    master, name = _master_store(), f"gpus-{uuid.uuid4().hex[:8]}"

    def target(rank: int) -> Callable[[], Any]:
        def run() -> Any:
            store = TCPRendezvousStore(master if rank == 0 else _client_store(master, TIMEOUT))

            def make_stages(size: int, index: int, stage_name: str, scoped: Any) -> Any:
                return make(size, index, stage_name, scoped, group_timeout, "127.0.0.1")

            group = connect_gpu_group(
                world_size,
                rank,
                name,
                store,
                group_timeout,
                device=device_of(rank),
                buffers=buffers,
                make_stages=make_stages,
                arrays=HOST_ARRAYS,
                gpus=gpus_of(rank),
            )
            try:
                return fn(group, rank)
            finally:
                group.destroy_group()

        return run

    try:
        return _run_threads([target(r) for r in range(world_size)], JOIN_TIMEOUT_S)
    finally:
        HostStages.boards.clear()


def run_layout(
    gpus: list[int],
    fn: Callable[[GpuHierarchyGroup, int], Any],
    group_timeout: timedelta = TIMEOUT,
    devices: list[HostGpu] | None = None,
) -> list[Any]:
    """Run ``fn(group, rank)`` with rank r on stood-in GPU ``gpus[r]``; destroy the group after."""
    found = devices or [HostGpu(f"gpu-{i}", blocking=True) for i in range(max(gpus) + 1)]

    def checked(group: Any, rank: int) -> Any:
        assert isinstance(group, GpuHierarchyGroup)
        return fn(group, rank)

    def device_of(rank: int) -> HostDevice:
        return HostDevice(found[gpus[rank]], rank)

    return run_on_gpus(len(gpus), checked, device_of, group_timeout=group_timeout)


@pytest.fixture(autouse=True)
def small_slots(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Slots of 8 KiB and mailboxes of 4 KiB, so that a message takes many chunks."""
    monkeypatch.setattr(transport, "MAIL_BYTES", 4096)
    monkeypatch.setattr(transport, "SLOT_BYTES", 8192)
    yield


LAYOUTS = [
    pytest.param([0, 0, 1], id="2+1"),
    pytest.param([0, 1, 0, 1], id="interleaved-2+2"),
    pytest.param([1, 0, 2, 2], id="1+1+2"),
]


@pytest.mark.parametrize("gpus", LAYOUTS)
def test_every_op_on_every_rank(gpus: list[int]) -> None:
    n, ws = 3000, len(gpus)

    def fn(g: GpuHierarchyGroup, rank: int) -> dict[str, Any]:
        assert g.transport == "shared_gpu+nccl"
        assert not g.takes_lists
        out: dict[str, Any] = {}
        x = _data(rank, n)
        g.allreduce([x], AllReduceOptions(ReduceOp.SUM))
        out["allreduce"] = x
        x = _data(rank, n, "int64")
        g.allreduce([x], AllReduceOptions(ReduceOp.MAX, async_op=True)).wait()
        out["max"] = x
        x = _data(rank, n, "float64")
        g.allreduce([x], AllReduceOptions(ReduceOp.AVG))
        out["avg"] = x
        for root in range(ws):
            x = _data(rank + 7 * root, n)
            g.reduce([x], ReduceOptions(ReduceOp.SUM, root))
            out[f"reduce{root}"] = x
            x = _data(rank + 3 * root, n, "int32")
            g.broadcast([x], BroadcastOptions(root))
            out[f"broadcast{root}"] = x
        x = _data(rank, n)
        g.reduce([x], ReduceOptions(ReduceOp.AVG, ws - 1))
        out["reduce-avg"] = x
        outs = [np.zeros(n, np.int32) for _ in range(ws)]
        g.allgather([outs], [_data(rank, n, "int32")], AllGatherOptions())
        out["allgather"] = outs
        result = np.zeros(n, np.float32)
        inputs = [_data(rank * 10 + j, n) for j in range(ws)]
        g.reducescatter([result], [inputs], ReduceScatterOptions(ReduceOp.PRODUCT))
        out["reducescatter"] = result
        out["inputs-kept"] = all(
            np.array_equal(x, _data(rank * 10 + j, n)) for j, x in enumerate(inputs)
        )
        for root in (0, ws - 1):
            gathered = [np.zeros(n, np.int32) for _ in range(ws)] if rank == root else []
            g.gather([gathered], [_data(rank, n, "int32")], GatherOptions(root))
            out[f"gather{root}"] = gathered
            got = np.zeros(n, np.int32)
            sources = [_data(100 + j, n, "int32") for j in range(ws)] if rank == root else []
            g.scatter([got], [sources], ScatterOptions(root))
            out[f"scatter{root}"] = got
        sends = [_data(1000 * rank + j, 50, "int32") for j in range(ws)]
        receives = [np.zeros(50, np.int32) for _ in range(ws)]
        g.alltoall(receives, sends, AllToAllOptions())
        out["alltoall"] = receives
        g.barrier(BarrierOptions())
        return out

    results = run_layout(gpus, fn)
    rows = range(ws)
    for rank, got in enumerate(results):
        np.testing.assert_array_equal(got["allreduce"], np.sum([_data(r, n) for r in rows], 0))
        best = np.max([_data(r, n, "int64") for r in rows], 0)
        np.testing.assert_array_equal(got["max"], best)
        mean = np.sum([_data(r, n, "float64") for r in rows], 0) / ws
        np.testing.assert_allclose(got["avg"], mean)
        for root in rows:
            total = np.sum([_data(r + 7 * root, n) for r in rows], 0)
            want = total if rank == root else _data(rank + 7 * root, n)
            np.testing.assert_array_equal(got[f"reduce{root}"], want)
            np.testing.assert_array_equal(
                got[f"broadcast{root}"], _data(3 * root + root, n, "int32")
            )
        mean32 = np.sum([_data(r, n) for r in rows], 0) / np.float32(ws)
        want = mean32 if rank == ws - 1 else _data(rank, n)
        np.testing.assert_allclose(got["reduce-avg"], want, rtol=1e-6)
        for j in rows:
            np.testing.assert_array_equal(got["allgather"][j], _data(j, n, "int32"))
            np.testing.assert_array_equal(got["alltoall"][j], _data(1000 * j + rank, 50, "int32"))
        product = np.prod([_data(r * 10 + rank, n) for r in rows], 0)
        np.testing.assert_allclose(got["reducescatter"], product, rtol=1e-6)
        assert got["inputs-kept"]
        for root in (0, ws - 1):
            if rank == root:
                for j in rows:
                    np.testing.assert_array_equal(got[f"gather{root}"][j], _data(j, n, "int32"))
            np.testing.assert_array_equal(got[f"scatter{root}"], _data(100 + rank, n, "int32"))


def test_a_broadcast_root_keeps_its_buffer_and_no_one_else_is_written_by_reduce() -> None:
    n = 20_000  # many slots

    def fn(g: GpuHierarchyGroup, rank: int) -> tuple[np.ndarray, np.ndarray]:
        x = _data(rank, n)
        x.flags.writeable = rank != 1  # the root is only read
        g.broadcast([x], BroadcastOptions(1))
        y = _data(rank + 50, n)
        g.reduce([y], ReduceOptions(ReduceOp.MIN, 3))
        return x, y

    results = run_layout([0, 0, 1, 1], fn)
    for rank, (x, y) in enumerate(results):
        np.testing.assert_array_equal(x, _data(1, n))
        low = np.min([_data(r + 50, n) for r in range(4)], 0)
        np.testing.assert_array_equal(y, low if rank == 3 else _data(rank + 50, n))


def test_send_and_recv_on_one_gpu_and_across_gpus() -> None:
    n = 5000  # many 4 KiB mailbox chunks on one GPU

    def fn(g: GpuHierarchyGroup, rank: int) -> list[np.ndarray]:
        got = []
        for peer in range(4):
            if peer == rank:
                continue
            mine, theirs = _data(10 * rank + peer, n), np.zeros(n, np.float32)
            if rank < peer:
                g.send([mine], SendOptions(peer))
                g.recv([theirs], RecvOptions(peer))
            else:
                g.recv([theirs], RecvOptions(peer))
                g.send([mine], SendOptions(peer))
            got.append(theirs)
        return got

    results = run_layout([0, 0, 1, 1], fn)
    for rank, got in enumerate(results):
        peers = [p for p in range(4) if p != rank]
        for peer, theirs in zip(peers, got, strict=True):
            np.testing.assert_array_equal(theirs, _data(10 * peer + rank, n))


def test_a_root_that_differs_across_gpus_raises_on_every_rank() -> None:
    """Ranks 0 and 1 share GPU 0; GPU 0 says root 0, GPU 1 says root 1: each GPU agrees
    inside, the leaders' NCCL calls would be the same (both roots are on GPU 0), and only
    the agreement on the whole op tells them apart."""

    def fn(g: GpuHierarchyGroup, rank: int) -> str:
        root = 0 if rank in (0, 1) else 1
        x = _data(rank, 100)
        try:
            g.broadcast([x], BroadcastOptions(root))
        except CollectiveError as exc:
            with pytest.raises(CollectiveError):
                g.allreduce([x], AllReduceOptions())
            return str(exc)
        return "returned"

    results = run_layout([0, 0, 1, 1], fn, timedelta(seconds=5))
    assert "returned" not in results
    assert any("root" in message for message in results), results


def test_ops_that_differ_on_one_gpu_raise_on_every_rank_and_nothing_is_written() -> None:
    def fn(g: GpuHierarchyGroup, rank: int) -> tuple[str, np.ndarray]:
        x = _data(rank, 100)
        try:
            if rank == 3:
                g.allreduce([x], AllReduceOptions(ReduceOp.MAX))
            else:
                g.allreduce([x], AllReduceOptions(ReduceOp.SUM))
        except CollectiveError as exc:
            return str(exc), x
        return "returned", x

    results = run_layout([0, 0, 1, 1], fn, timedelta(seconds=5))
    for rank, (message, x) in enumerate(results):
        assert message != "returned"
        np.testing.assert_array_equal(x, _data(rank, 100))


def test_groups_made_and_destroyed_leave_nothing() -> None:
    devices = [HostGpu("gpu-0", blocking=True), HostGpu("gpu-1", blocking=True)]
    before = _our_files()

    def fn(g: GpuHierarchyGroup, rank: int) -> None:
        x = _data(rank, 300)
        g.allreduce([x], AllReduceOptions())

    for _ in range(10):
        run_layout([0, 1, 0], fn, devices=devices)
    for gpu in devices:
        assert gpu.live() == (0, 0)
        assert gpu.misuse == []
    assert _our_files() == before
