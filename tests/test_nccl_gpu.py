"""NCCLGroup on real GPUs, without Ray: ranks are threads meeting on a torch TCPStore.

Skipped with a reason where cupy or a GPU is missing. World size 1 runs on one GPU;
the world-size-2-and-up tests run one rank per GPU where that many GPUs exist.
Results are read back through the caller's current stream without any explicit
synchronisation, so every check also checks the stream ordering of the ops.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="the nccl backend needs cupy: pip install cupy-cuda12x")
torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")


def _gpu_count() -> int:
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


GPUS = _gpu_count()
if GPUS < 1:
    pytest.skip("no CUDA GPU is visible to cupy", allow_module_level=True)

from collective.groups.nccl import NCCLGroup  # noqa: E402
from collective.store import TCPRendezvousStore  # noqa: E402
from collective.types import (  # noqa: E402
    AllGatherOptions,
    AllReduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    RecvOptions,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
    SendOptions,
)

pytestmark = pytest.mark.gpu

GROUP_TIMEOUT = timedelta(seconds=60)
JOIN_TIMEOUT_S = 120.0
WAIT = timedelta(seconds=60)
DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64"]
FLOATS = {"float16", "bfloat16", "float32", "float64"}
TORCH_CUDA = torch.cuda.is_available()
KINDS = ["cupy", "torch"] if TORCH_CUDA else ["cupy"]
needs_torch_cuda = pytest.mark.skipif(not TORCH_CUDA, reason="this torch build has no CUDA")
OPS = [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG]
SHAPE = (4, 8)
MULTI = [n for n in (2, 4) if GPUS >= n]
"""World sizes above 1 that this machine can run, one GPU per rank."""


def run_ranks(world_size: int, fn: Callable[[NCCLGroup, int], Any]) -> list[Any]:
    """Run ``fn(group, rank)`` in one thread per rank, rank r on GPU r; return every result.

    Each rank destroys its own group in its own thread, so that no rank's destroy
    waits on a peer that is not destroying at the same time.
    """
    master = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60))
    name = f"nccl-{uuid.uuid4().hex[:8]}"
    results: list[Any] = [None] * world_size
    failures: list[tuple[int, BaseException]] = []

    def body(rank: int) -> None:
        try:
            cupy.cuda.Device(rank).use()
            if TORCH_CUDA:
                torch.cuda.set_device(rank)
            store = master
            if rank:
                store = dist.TCPStore("127.0.0.1", master.port, None, False, GROUP_TIMEOUT)
            group = NCCLGroup(world_size, rank, name, TCPRendezvousStore(store), GROUP_TIMEOUT)
            try:
                results[rank] = fn(group, rank)
            finally:
                group.destroy_group()
        except BaseException as exc:
            failures.append((rank, exc))

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world_size)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    if failures:
        raise failures[0][1]
    alive = [r for r, t in enumerate(threads) if t.is_alive()]
    assert not alive, f"ranks {alive} still running after {JOIN_TIMEOUT_S}s"
    return results


def values(rank: int, offset: int = 0) -> np.ndarray:
    """Return rank's input: small integers 1..5, distinct across four ranks at each place."""
    j = np.arange(int(np.prod(SHAPE))).reshape(SHAPE)
    return ((j + 2 * rank + offset) % 5 + 1).astype(np.float64)


def make(kind: str, array: np.ndarray, dtype: str, device: int) -> Any:
    """Return ``array`` as a new cupy array or torch tensor of ``dtype`` on GPU ``device``."""
    if kind == "cupy":
        with cupy.cuda.Device(device):
            return cupy.asarray(array.astype(dtype))
    return torch.tensor(array, dtype=getattr(torch, dtype), device=f"cuda:{device}")


def host(x: Any) -> np.ndarray:
    """Copy ``x`` to the host through the caller's current stream, as float64."""
    if isinstance(x, torch.Tensor):
        return x.double().cpu().numpy()
    return cupy.asnumpy(x).astype(np.float64)


def reduced(inputs: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    stack = np.stack(inputs)
    functions: dict[ReduceOp, Callable[..., np.ndarray]] = {
        ReduceOp.SUM: np.sum,
        ReduceOp.PRODUCT: np.prod,
        ReduceOp.MIN: np.min,
        ReduceOp.MAX: np.max,
        ReduceOp.AVG: np.mean,
    }
    return functions[op](stack, axis=0)


def cases(with_ops: bool) -> list[Any]:
    """Return (kind, dtype[, op]) cases; cupy has no bfloat16, AVG takes floats only."""
    out: list[tuple[Any, ...]] = []
    for kind in KINDS:
        for dtype in DTYPES:
            if kind == "cupy" and dtype == "bfloat16":
                continue
            if not with_ops:
                out.append((kind, dtype))
                continue
            out.extend((kind, dtype, op) for op in OPS if op is not ReduceOp.AVG or dtype in FLOATS)
    return out


def close(got: np.ndarray, expected: np.ndarray, dtype: str) -> None:
    if dtype not in FLOATS:
        expected = np.trunc(expected)
    np.testing.assert_allclose(got, expected, rtol=1e-2 if dtype in FLOATS else 0)


# --- world size 1 and up: every op -------------------------------------------------------

SIZES = [1, *MULTI]


@pytest.mark.parametrize("world_size", SIZES)
@pytest.mark.parametrize(("kind", "dtype", "op"), cases(with_ops=True))
def test_allreduce(world_size: int, kind: str, dtype: str, op: ReduceOp) -> None:
    def fn(group: NCCLGroup, rank: int) -> np.ndarray:
        x = make(kind, values(rank), dtype, rank)
        group.allreduce([x], AllReduceOptions(op))
        return host(x)

    expected = reduced([values(r) for r in range(world_size)], op)
    for got in run_ranks(world_size, fn):
        close(got, expected, dtype)


@pytest.mark.parametrize("world_size", SIZES)
@pytest.mark.parametrize(("kind", "dtype"), cases(with_ops=False))
def test_reduce_broadcast_allgather_reducescatter(world_size: int, kind: str, dtype: str) -> None:
    root = world_size - 1

    def fn(group: NCCLGroup, rank: int) -> list[np.ndarray]:
        reduce_in = make(kind, values(rank), dtype, rank)
        group.reduce([reduce_in], ReduceOptions(ReduceOp.SUM, root_rank=root))
        bcast = make(kind, values(rank, offset=1), dtype, rank)
        group.broadcast([bcast], BroadcastOptions(root_rank=root))
        source = make(kind, values(rank), dtype, rank)
        gathered = [make(kind, np.zeros(SHAPE), dtype, rank) for _ in range(world_size)]
        group.allgather([gathered], [source], AllGatherOptions())
        chunks = [make(kind, values(rank, offset=j), dtype, rank) for j in range(world_size)]
        out = make(kind, np.zeros(SHAPE), dtype, rank)
        group.reducescatter([out], [chunks], ReduceScatterOptions(ReduceOp.MAX))
        return [host(reduce_in), host(bcast), *map(host, gathered), host(out), host(chunks[0])]

    results = run_ranks(world_size, fn)
    for rank, (reduce_out, bcast, *rest) in enumerate(results):
        gathered, out, chunk0 = rest[:world_size], rest[world_size], rest[world_size + 1]
        own = values(rank)
        close(
            reduce_out,
            reduced([values(r) for r in range(world_size)], ReduceOp.SUM) if rank == root else own,
            dtype,
        )
        close(bcast, values(root, offset=1), dtype)
        for r in range(world_size):
            close(gathered[r], values(r), dtype)
        close(
            out, reduced([values(r, offset=rank) for r in range(world_size)], ReduceOp.MAX), dtype
        )
        close(chunk0, values(rank, offset=0), dtype)


@pytest.mark.parametrize("world_size", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_gather_scatter_alltoall_barrier(world_size: int, kind: str) -> None:
    root, dtype = 0, "float32"

    def fn(group: NCCLGroup, rank: int) -> list[np.ndarray]:
        source = make(kind, values(rank), dtype, rank)
        outs = [make(kind, np.zeros(SHAPE), dtype, rank) for _ in range(world_size)]
        group.gather([outs if rank == root else []], [source], GatherOptions(root_rank=root))
        pieces = [make(kind, values(j, offset=5), dtype, rank) for j in range(world_size)]
        got = make(kind, np.zeros(SHAPE), dtype, rank)
        group.scatter([got], [pieces if rank == root else []], ScatterOptions(root_rank=root))
        sent = [make(kind, values(rank, offset=j), dtype, rank) for j in range(world_size)]
        received = [make(kind, np.zeros(SHAPE), dtype, rank) for _ in range(world_size)]
        group.alltoall(received, sent, AllToAllOptions())
        group.barrier(BarrierOptions())
        return [*map(host, outs), host(got), *map(host, received)]

    for rank, result in enumerate(run_ranks(world_size, fn)):
        gathered, got, received = result[:world_size], result[world_size], result[world_size + 1 :]
        for r in range(world_size):
            close(gathered[r], values(r) if rank == root else np.zeros(SHAPE), dtype)
            close(received[r], values(r, offset=rank), dtype)
        close(got, values(rank, offset=5), dtype)


@pytest.mark.skipif(not MULTI, reason="send/recv needs two ranks, so two GPUs")
@pytest.mark.parametrize("kind", KINDS)
def test_send_recv_between_gpus(kind: str) -> None:
    """Rank 0 sends to GPU 1 of rank 1; rank 1 sends 8 elements back (gpu index = ordinal)."""

    def fn(group: NCCLGroup, rank: int) -> np.ndarray:
        x = make(kind, values(rank), "float32", rank)
        if rank == 0:
            group.send([x], SendOptions(dst_rank=1, dst_gpu_index=1))
            group.recv([x], RecvOptions(src_rank=1, src_gpu_index=1, n_elements=8))
        else:
            group.recv([x], RecvOptions(src_rank=0, src_gpu_index=0))
            reply = make(kind, values(1, offset=3), "float32", rank)
            group.send([reply], SendOptions(dst_rank=0, dst_gpu_index=0, n_elements=8))
        return host(x)

    first, second = run_ranks(2, fn)
    close(second, values(0), "float32")
    expected = values(0).reshape(-1)
    expected[:8] = values(1, offset=3).reshape(-1)[:8]
    close(first.reshape(-1), expected, "float32")


def test_send_recv_is_impossible_at_world_size_1() -> None:
    pytest.skip("send and recv need a peer; world size 1 has none")


# --- multigpu variants, async handles, stream safety --------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_multigpu_variants_with_one_element_lists(kind: str) -> None:
    def fn(group: NCCLGroup, rank: int) -> list[np.ndarray]:
        x = make(kind, values(0), "float32", 0)
        group.allreduce([x], AllReduceOptions(ReduceOp.SUM))
        group.reduce([x], ReduceOptions(ReduceOp.MAX, root_rank=0, root_tensor=0))
        group.broadcast([x], BroadcastOptions(root_rank=0, root_tensor=0))
        outs = [[make(kind, np.zeros(SHAPE), "float32", 0)]]
        group.allgather(outs, [x], AllGatherOptions())
        scattered = [make(kind, np.zeros(SHAPE), "float32", 0)]
        group.reducescatter(
            scattered, [[make(kind, values(0, 3), "float32", 0)]], ReduceScatterOptions()
        )
        return [host(x), host(outs[0][0]), host(scattered[0])]

    x, gathered, scattered = run_ranks(1, fn)[0]
    close(x, values(0), "float32")
    close(gathered, values(0), "float32")
    close(scattered, values(0, 3), "float32")


@pytest.mark.parametrize("kind", KINDS)
def test_async_handles(kind: str) -> None:
    def fn(group: NCCLGroup, rank: int) -> tuple[np.ndarray, bool, Any]:
        source = make(kind, values(0), "float64", 0)
        out = make(kind, np.zeros(SHAPE), "float64", 0)
        work = group.allgather([[out]], [source], AllGatherOptions(async_op=True))
        work.wait(WAIT)
        barrier = group.barrier(BarrierOptions(async_op=True))
        barrier.wait(WAIT)
        return host(out), work.is_completed() and barrier.is_completed(), work.exception()

    got, completed, error = run_ranks(1, fn)[0]
    close(got, values(0), "float64")
    assert completed
    assert error is None


@needs_torch_cuda
def test_freeing_the_input_right_after_an_async_call_is_safe() -> None:
    n = 1 << 24

    def fn(group: NCCLGroup, rank: int) -> list[float]:
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            source = torch.arange(n, dtype=torch.float32, device="cuda:0")
            out = torch.empty_like(source)
            work = group.allgather([[out]], [source], AllGatherOptions(async_op=True))
            del source
            garbage = torch.full((n,), -1.0, device="cuda:0")
            work.wait(WAIT)
            total = out.double().sum().item()
            del garbage
        cupy_source = cupy.arange(n, dtype=cupy.float32)
        cupy_out = cupy.empty_like(cupy_source)
        work = group.allgather([[cupy_out]], [cupy_source], AllGatherOptions(async_op=True))
        del cupy_source
        cupy_garbage = cupy.full((n,), -1.0, dtype=cupy.float32)
        work.wait(WAIT)
        del cupy_garbage
        return [total, float(cupy_out.astype(cupy.float64).sum())]

    expected = float(n) * (n - 1) / 2
    assert run_ranks(1, fn)[0] == [expected, expected]


@needs_torch_cuda
def test_a_blocking_op_is_ordered_on_the_callers_stream() -> None:
    n = 1 << 26

    def fn(group: NCCLGroup, rank: int) -> float:
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            source = torch.empty(n, device="cuda:0")
            source.fill_(3.0)
            out = torch.zeros_like(source)
            group.allgather([[out]], [source], AllGatherOptions())
            doubled = out * 2
            return doubled.sum().item()

    assert run_ranks(1, fn)[0] == 6.0 * n


# --- through Ray and the public API, one GPU per actor -------------------------------------


@pytest.fixture(scope="module")
def gpu_ray() -> Any:
    """Start a Ray cluster that offers this machine's GPUs, and stop it afterwards."""
    ray = pytest.importorskip("ray")
    ray.init(
        address="local",
        num_cpus=2,
        num_gpus=GPUS,
        namespace="collective-gpu-tests",
        include_dashboard=False,
    )
    yield ray
    ray.shutdown()


def _public_api_ops(world_size: int, rank: int, name: str) -> list[list[float]]:
    import collective as col

    col.init_collective_group(world_size, rank, backend="nccl", group_name=name)
    try:
        x = cupy.asarray(values(rank).reshape(-1)[:8])
        col.allreduce(x, name)
        col.allreduce_multigpu([x], name, op=ReduceOp.MAX)
        col.broadcast_multigpu([x], src_rank=0, src_tensor=0, group_name=name)
        outs = [[cupy.zeros(8) for _ in range(world_size)]]
        col.allgather_multigpu(outs, [cupy.full(8, float(rank))], name)
        got = cupy.zeros(8)
        col.reducescatter_multigpu(
            [got], [[cupy.full(8, float(j)) for j in range(world_size)]], name
        )
        peer = cupy.zeros(8)
        if world_size > 1 and rank == 0:
            col.send_multigpu(cupy.full(8, 7.0), 1, 0, name)
        elif world_size > 1 and rank == 1:
            col.recv_multigpu(peer, 0, 0, name)
        col.barrier(name)
        col.synchronize(0)
        rows = [x, *outs[0], got, peer]
        return [cupy.asnumpy(r).tolist() for r in rows]
    finally:
        col.destroy_collective_group(name)


@pytest.mark.parametrize("world_size", [1, *MULTI[:1]])
def test_public_api_in_ray_actors(gpu_ray: Any, world_size: int) -> None:
    from tests.conftest import Member, our_named_actors

    actors = [Member.options(num_gpus=1).remote() for _ in range(world_size)]
    name = f"nccl-ray-{uuid.uuid4().hex[:8]}"
    refs = [a.run.remote(_public_api_ops, world_size, r, name) for r, a in enumerate(actors)]
    results = gpu_ray.get(refs, timeout=300)
    summed = sum(values(r).reshape(-1)[:8] for r in range(world_size))
    for rank, rows in enumerate(results):
        np.testing.assert_array_equal(rows[0], summed)
        for r in range(world_size):
            assert rows[1 + r] == [float(r)] * 8
        assert rows[1 + world_size] == [float(rank * world_size)] * 8
        assert rows[2 + world_size] == ([7.0] * 8 if world_size > 1 and rank == 1 else [0.0] * 8)
    assert our_named_actors() == []
    for actor in actors:
        gpu_ray.kill(actor)
