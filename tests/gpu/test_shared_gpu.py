"""Ranks that share one GPU: every op through device memory they all map, at world sizes 2-4.

The ranks are processes on GPU 0, built as a ``backend="nccl"`` group is
(``connect_gpu_group``), so they pick the shared-GPU transport themselves, with no
``NCCL_HOSTID`` and no NCCL. Every op, kind and dtype runs at world size 2 (async on
float32), float32 at 3 and 4; then send/recv, a broadcast of a list of tensors, a
long pipelined broadcast, torch's expandable segments, and 100 groups made and
destroyed with no GPU memory, IPC mapping or /dev/shm file left. No Ray.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import numpy as np
import pytest

from tests.gpu import cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bool(cases.no_gpu_reason()), reason=cases.no_gpu_reason() or "-"),
]

_SHARED: list[Any] = []
"""The shared-GPU group of the rank in this process, between jobs."""


def open_shared(context: Any, name: str) -> str:
    """Build this rank's group ``name`` on GPU 0 as ``backend="nccl"`` does; say its transport."""
    import cupy

    from collective.groups.gpu.connect import connect_gpu_group

    cupy.cuda.Device(0).use()
    if cases.torch_cuda():
        import torch

        torch.cuda.set_device(0)
    # the shared-GPU transport alone: test_gpu_routed.py runs the routes to NCCL's mode
    os.environ["COLLECTIVE_GPU_ROUTES"] = "off"
    group = connect_gpu_group(
        context.world_size, context.rank, name, context.store, cases.GROUP_TIMEOUT
    )
    _SHARED[:] = [group]
    return str(group.transport)


def close_shared(context: Any) -> None:
    """Destroy this rank's group."""
    _SHARED.pop().destroy_group()


def op_on_rank(context: Any, op: str, kind: str, dtype: str, async_op: bool) -> list[np.ndarray]:
    """Run ``cases.run_op`` on this rank's shared-GPU group."""
    return cases.run_op(_SHARED[0], 0, op, kind, dtype, async_op)


def _pool(world_size: int) -> Iterator[Any]:
    from benchmarks.nccl_ranks import RankPool

    with RankPool(world_size, timeout=timedelta(seconds=120)) as pool:
        transports = pool.run(open_shared, f"shared-ws{world_size}-{uuid.uuid4().hex[:8]}")
        assert transports == ["shared_gpu"] * world_size, transports
        yield pool
        pool.run(close_shared)


@pytest.fixture(scope="module", params=[2, 3, 4], ids=["ws2", "ws3", "ws4"])
def shared(request: pytest.FixtureRequest) -> Iterator[Any]:
    """Yield a pool of ranks sharing GPU 0 in one group (world sizes 2, 3 and 4)."""
    yield from _pool(request.param)


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize(("op", "kind", "dtype"), cases.op_cases())
def test_op(shared: Any, op: str, kind: str, dtype: str, async_op: bool) -> None:
    if kind == "torch" and not cases.torch_cuda():
        pytest.skip("this torch build has no CUDA")
    if async_op and dtype != "float32":
        pytest.skip("async ops take float32")
    if shared.world_size > 2 and (dtype != "float32" or async_op):
        pytest.skip("world sizes 3 and 4 take float32, blocking")
    cases.check(op, dtype, shared.run(op_on_rank, op, kind, dtype, async_op))


def send_recv_on_rank(context: Any, count: int) -> np.ndarray:
    """Rank 0 and rank 1 send each other ``count`` floats at once; return what arrived."""
    import cupy

    from collective.types import RecvOptions, SendOptions

    group, rank = _SHARED[0], context.rank
    if rank > 1:
        return np.zeros(0)
    mine = cupy.arange(count, dtype=cupy.float32) + 1000 * rank
    got = cupy.zeros(count, dtype=cupy.float32)
    sent = group.send([mine], SendOptions(dst_rank=1 - rank, async_op=True))
    group.recv([got], RecvOptions(src_rank=1 - rank))
    sent.wait(cases.WAIT)
    return cupy.asnumpy(got)


@pytest.mark.parametrize("count", [8, 3 << 20], ids=["8-floats", "12MiB"])
def test_send_recv_both_ways(shared: Any, count: int) -> None:
    results = shared.run(send_recv_on_rank, count)
    for rank in (0, 1):
        np.testing.assert_array_equal(results[rank], np.arange(count) + 1000 * (1 - rank))


def long_broadcast_on_rank(context: Any, nbytes: int) -> str:
    """Broadcast ``nbytes`` of torch uint8 from the last rank; return a digest of what arrived."""
    import torch

    from collective.types import BroadcastOptions

    root = context.world_size - 1
    x = torch.full((nbytes,), 0, dtype=torch.uint8, device="cuda")
    if context.rank == root:
        x.copy_(
            torch.arange(nbytes, device="cuda", dtype=torch.int64).remainder(251).to(torch.uint8)
        )
    _SHARED[0].broadcast([x], BroadcastOptions(root_rank=root))
    return str(int(x.to(torch.int64).sum().item()))


def test_a_long_broadcast_streams_through_the_slots(shared: Any) -> None:
    if not cases.torch_cuda():
        pytest.skip("this torch build has no CUDA")
    nbytes = 200 << 20  # several 32 MiB slots
    digests = shared.run(long_broadcast_on_rank, nbytes)
    want = int(np.arange(nbytes, dtype=np.int64).__mod__(251).sum())
    assert digests == [str(want)] * shared.world_size


def list_on_rank(context: Any) -> list[bool]:
    """Broadcast 400 torch tensors of mixed sizes and dtypes from rank 0, as one message."""
    import torch

    from collective.types import BroadcastOptions

    shapes = [(1 + (i * 37) % 5000,) for i in range(400)]
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.float16]
    made = []
    for i, shape in enumerate(shapes):
        value = torch.arange(shape[0], device="cuda").to(dtypes[i % 4]) + i
        made.append(value if context.rank == 0 else torch.zeros_like(value))
    _SHARED[0].broadcast_list(made, BroadcastOptions(root_rank=0))
    return [
        bool(torch.equal(t, torch.arange(s[0], device="cuda").to(dtypes[i % 4]) + i))
        for i, (t, s) in enumerate(zip(made, shapes, strict=True))
    ]


def test_a_list_of_tensors_moves_as_one_message(shared: Any) -> None:
    if not cases.torch_cuda():
        pytest.skip("this torch build has no CUDA")
    for rank, oks in enumerate(shared.run(list_on_rank)):
        assert all(oks), f"rank {rank}: tensors {[i for i, ok in enumerate(oks) if not ok]}"


def public_api_on_rank(context: Any) -> dict[str, list[float]]:
    """Run the public functions on this rank's group, registered under its name."""
    import torch

    import collective as col
    from collective.registry import held

    group, rank, n = _SHARED[0], context.rank, context.world_size
    name = group.group_name
    if not col.is_group_initialized(name):
        held.create_group(name, lambda: (group, context.store))
    got: dict[str, list[float]] = {}
    x = torch.full((4,), float(rank + 1), device="cuda")
    col.allreduce(x, name)
    got["allreduce"] = x.tolist()
    x = torch.full((4,), float(rank), device="cuda")
    col.broadcast(x, src_rank=n - 1, group_name=name)
    got["broadcast"] = x.tolist()
    state = {f"w{i}": torch.full((i + 1,), float(rank * 10 + i), device="cuda") for i in range(5)}
    state["t"] = torch.arange(6.0, device="cuda").reshape(2, 3).t() * (rank + 1)  # strided
    col.broadcast_state_dict(state, src_rank=0, group_name=name)
    got["state"] = [v for t in state.values() for v in t.flatten().tolist()]
    if rank == 0:
        col.send(torch.arange(5.0, device="cuda"), 1, name)
    elif rank == 1:
        y = torch.zeros(5, device="cuda")
        col.recv(y, 0, name)
        got["recv"] = y.tolist()
    col.barrier(name)
    return got


def test_the_public_functions_reach_the_shared_gpu_group(shared: Any) -> None:
    if not cases.torch_cuda():
        pytest.skip("this torch build has no CUDA")
    n = shared.world_size
    state = [float(i) for i in range(5) for _ in range(i + 1)] + [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]
    for rank, got in enumerate(shared.run(public_api_on_rank)):
        assert got["allreduce"] == [n * (n + 1) / 2] * 4, rank
        assert got["broadcast"] == [float(n - 1)] * 4, rank
        assert got["state"] == state, rank
        if rank == 1:
            assert got["recv"] == [0.0, 1.0, 2.0, 3.0, 4.0]


def cycles_on_rank(context: Any, cycles: int) -> tuple[int, int, int, int]:
    """Make, use and destroy ``cycles`` groups; return GPU memory and files before and after."""
    import cupy
    import torch

    from collective.groups.gpu.connect import connect_gpu_group
    from collective.rendezvous.store import PrefixedRendezvousStore
    from collective.types import AllReduceOptions

    def state() -> tuple[int, int]:
        torch.cuda.synchronize()
        free, _ = cupy.cuda.runtime.memGetInfo()
        return int(
            free
        ), torch.cuda.memory_allocated() + cupy.get_default_memory_pool().used_bytes()

    x = torch.ones(1024, device="cuda")
    free_before, held_before = state()
    for i in range(cycles):
        store = PrefixedRendezvousStore(context.store, f"cycle/{i}/")
        group = connect_gpu_group(
            context.world_size, context.rank, "cycles", store, cases.GROUP_TIMEOUT
        )
        group.allreduce([x], AllReduceOptions())
        group.destroy_group()
    free_after, held_after = state()
    return free_before, free_after, held_before, held_after


def test_a_hundred_groups_leave_no_gpu_memory_or_file(shared: Any) -> None:
    if not cases.torch_cuda():
        pytest.skip("this torch build has no CUDA")
    before = set(os.listdir("/dev/shm"))
    for rank, (free0, free1, held0, held1) in enumerate(shared.run(cycles_on_rank, 100)):
        assert held1 == held0, f"rank {rank}: torch and cupy hold {held1 - held0} more bytes"
        assert free0 - free1 < 1 << 30, f"rank {rank}: {free0 - free1} fewer bytes free"
    assert not {f for f in set(os.listdir("/dev/shm")) - before if f.startswith("collective-")}


def test_torch_expandable_segments_buffers_move(monkeypatch: pytest.MonkeyPatch) -> None:
    """User buffers from a VMM allocator move in place: only the group's own slots are shared."""
    if not cases.torch_cuda():
        pytest.skip("this torch build has no CUDA")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    for pool in _pool(2):
        cases.check(
            "allreduce_sum",
            "float32",
            pool.run(op_on_rank, "allreduce_sum", "torch", "float32", False),
        )
        digests = pool.run(long_broadcast_on_rank, 40 << 20)
        assert len(set(digests)) == 1
