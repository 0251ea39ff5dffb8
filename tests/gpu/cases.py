"""What the GPU tests run on each rank, and what each rank must then hold.

Importable without cupy, torch's CUDA or a GPU, so that the tests collect (and skip,
saying why) anywhere. ``run_op`` issues one op of ``OPS`` on a rank's group and returns
what the rank holds afterwards, copied to the host through the caller's current
stream with no explicit synchronisation, so every check also checks stream ordering.
``expected`` says what that must be. The world-size-2 tests run the same functions in
rank processes (``benchmarks.nccl_ranks``), each rank on its own GPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np

from benchmarks.nccl_ranks import RankContext
from collective.groups.nccl.comm import unavailable_reason
from collective.types import (
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

GROUP_TIMEOUT = timedelta(seconds=60)
WAIT = timedelta(seconds=60)
SHAPE = (4, 8)
KINDS = ("cupy", "torch")
DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64")
FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})
REDUCTIONS = {
    "allreduce_sum": ReduceOp.SUM,
    "allreduce_product": ReduceOp.PRODUCT,
    "allreduce_min": ReduceOp.MIN,
    "allreduce_max": ReduceOp.MAX,
    "allreduce_avg": ReduceOp.AVG,
}
OPS = (
    *REDUCTIONS,
    "reduce",
    "broadcast",
    "allgather",
    "allgather_flat",
    "reducescatter",
    "reducescatter_flat",
    "gather",
    "scatter",
    "alltoall",
    "barrier",
)


@functools.cache
def gpu_count() -> int:
    """Return how many GPUs cupy sees with NCCL usable, or 0 when the backend cannot run."""
    if unavailable_reason():
        return 0
    import cupy

    return int(cupy.cuda.runtime.getDeviceCount())


def no_gpu_reason() -> str:
    """Return why the GPU tests cannot run here ("no GPU: ..."), or ""."""
    why = unavailable_reason()
    return f"no GPU: {why}" if why else ""


@functools.cache
def torch_cuda() -> bool:
    """Return whether torch is installed with CUDA and sees a GPU."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def torch_gpu_marks() -> list[Any]:
    """Return the marks of a module of GPU tests on torch CUDA tensors: skip, saying why."""
    import pytest

    return [
        pytest.mark.gpu,
        pytest.mark.skipif(bool(no_gpu_reason()), reason=no_gpu_reason() or "-"),
        pytest.mark.skipif(
            not no_gpu_reason() and not torch_cuda(),
            reason="these tests use torch CUDA tensors; this torch has no CUDA",
        ),
    ]


def op_cases() -> list[tuple[str, str, str]]:
    """Return every (op, kind, dtype) the backend claims.

    cupy has no bfloat16; AVG takes floats only; a barrier moves no caller data, so it
    runs once per kind.
    """
    out = []
    for op in OPS:
        for kind in KINDS:
            for dtype in DTYPES:
                if kind == "cupy" and dtype == "bfloat16":
                    continue
                if op == "allreduce_avg" and dtype not in FLOATS:
                    continue
                if op == "barrier" and dtype != "float32":
                    continue
                out.append((op, kind, dtype))
    return out


def values(rank: int, offset: int = 0) -> np.ndarray:
    """Return a rank's input: small integers 1..5, distinct across ranks at each place."""
    j = np.arange(int(np.prod(SHAPE))).reshape(SHAPE)
    return ((j + 2 * rank + offset) % 5 + 1).astype(np.float64)


def make(kind: str, array: np.ndarray, dtype: str, device: int) -> Any:
    """Return ``array`` as a new cupy array or torch tensor of ``dtype`` on GPU ``device``."""
    if kind == "cupy":
        import cupy

        with cupy.cuda.Device(device):
            return cupy.asarray(array.astype(dtype))
    import torch

    return torch.tensor(array, dtype=getattr(torch, dtype), device=f"cuda:{device}")


def host(x: Any) -> np.ndarray:
    """Copy ``x`` to the host as float64, through the caller's current stream."""
    if type(x).__module__.startswith("torch"):
        return np.asarray(x.double().cpu().numpy())
    import cupy

    return np.asarray(cupy.asnumpy(x).astype(np.float64))


def reduced(inputs: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    """Reduce ``inputs`` elementwise with numpy."""
    functions: dict[ReduceOp, Callable[..., np.ndarray]] = {
        ReduceOp.SUM: np.sum,
        ReduceOp.PRODUCT: np.prod,
        ReduceOp.MIN: np.min,
        ReduceOp.MAX: np.max,
        ReduceOp.AVG: np.mean,
    }
    return functions[op](np.stack(inputs), axis=0)


def close(got: np.ndarray, expected: np.ndarray, dtype: str, what: str) -> None:
    """Assert ``got`` holds ``expected`` in ``dtype``: exactly for integers, to 1% for floats."""
    if dtype not in FLOATS:
        expected = np.trunc(expected)
    np.testing.assert_allclose(got, expected, rtol=1e-2 if dtype in FLOATS else 0, err_msg=what)


def _root(op: str, world_size: int) -> int:
    """Return the root of ``op``: the last rank for reduce and broadcast, else rank 0."""
    return world_size - 1 if op in {"reduce", "broadcast"} else 0


def run_op(group: Any, device: int, op: str, kind: str, dtype: str, async_op: bool) -> list[Any]:
    """Issue ``op`` on this rank's ``group`` and return what the rank holds after it.

    With ``async_op`` the returned handle is waited on, and must then report completion
    and no failure. Returns host arrays, in the order ``expected`` lists them.
    """
    rank, n = group.rank, group.world_size
    root = _root(op, n)

    def new(array: np.ndarray) -> Any:
        return make(kind, array, dtype, device)

    zeros = np.zeros(SHAPE)
    if op in REDUCTIONS:
        outs = [new(values(rank))]
        work = group.allreduce(outs, AllReduceOptions(REDUCTIONS[op], async_op=async_op))
    elif op == "reduce":
        outs = [new(values(rank))]
        work = group.reduce(outs, ReduceOptions(ReduceOp.SUM, root, async_op=async_op))
    elif op == "broadcast":
        outs = [new(values(rank, offset=1))]
        work = group.broadcast(outs, BroadcastOptions(root, async_op=async_op))
    elif op == "allgather":
        outs = [new(zeros) for _ in range(n)]
        work = group.allgather([outs], [new(values(rank))], AllGatherOptions(async_op=async_op))
    elif op == "allgather_flat":  # chunks of one buffer: one NCCL allgather, no copy
        flat = new(np.zeros((n, *SHAPE)))
        outs = [flat[j] for j in range(n)]
        work = group.allgather([outs], [new(values(rank))], AllGatherOptions(async_op=async_op))
    elif op == "reducescatter_flat":
        flat = new(np.stack([values(rank, offset=j) for j in range(n)]))
        chunks = [flat[j] for j in range(n)]
        outs = [new(zeros), *chunks]
        summing = ReduceScatterOptions(ReduceOp.SUM, async_op=async_op)
        work = group.reducescatter(outs[:1], [chunks], summing)
    elif op == "reducescatter":
        chunks = [new(values(rank, offset=j)) for j in range(n)]
        outs = [new(zeros), *chunks]
        summing = ReduceScatterOptions(ReduceOp.SUM, async_op=async_op)
        work = group.reducescatter(outs[:1], [chunks], summing)
    elif op == "gather":
        outs = [new(zeros) for _ in range(n)] if rank == root else []
        to_root = GatherOptions(root, async_op=async_op)
        work = group.gather([outs], [new(values(rank))], to_root)
    elif op == "scatter":
        pieces = [new(values(j, offset=5)) for j in range(n)] if rank == root else []
        outs = [new(zeros)]
        work = group.scatter(outs, [pieces], ScatterOptions(root, async_op=async_op))
    elif op == "alltoall":
        sent = [new(values(rank, offset=j)) for j in range(n)]
        outs = [new(zeros) for _ in range(n)] + sent
        work = group.alltoall(outs[:n], sent, AllToAllOptions(async_op=async_op))
    else:
        outs = []
        work = group.barrier(BarrierOptions(async_op=async_op))
    if async_op:
        work.wait(WAIT)
        assert work.is_completed(), f"{op}: the waited handle is not completed"
        assert work.exception() is None, f"{op}: {work.exception()}"
    return [host(x) for x in outs]


def expected(op: str, rank: int, world_size: int) -> list[np.ndarray]:
    """Return what rank ``rank`` must hold after ``run_op``'s ``op``, as float64."""
    n, root = world_size, _root(op, world_size)
    inputs = [values(r) for r in range(n)]
    if op in REDUCTIONS:
        return [reduced(inputs, REDUCTIONS[op])]
    if op == "reduce":
        return [reduced(inputs, ReduceOp.SUM) if rank == root else values(rank)]
    if op == "broadcast":
        return [values(root, offset=1)]
    if op in ("allgather", "allgather_flat"):
        return inputs
    if op in ("reducescatter", "reducescatter_flat"):
        summed = reduced([values(r, offset=rank) for r in range(n)], ReduceOp.SUM)
        return [summed, *(values(rank, offset=j) for j in range(n))]
    if op == "gather":
        return inputs if rank == root else []
    if op == "scatter":
        return [values(rank, offset=5)]
    if op == "alltoall":
        return [values(j, offset=rank) for j in range(n)] + [
            values(rank, offset=j) for j in range(n)
        ]
    return []


def check(op: str, dtype: str, results: list[list[np.ndarray]]) -> None:
    """Assert that every rank's ``run_op`` results are what ``expected`` says."""
    n = len(results)
    for rank, got in enumerate(results):
        want = expected(op, rank, n)
        assert len(got) == len(want), f"rank {rank}: {len(got)} buffers, expected {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            close(g, w, dtype, f"{op} {dtype}: rank {rank}, buffer {i}")


# --- jobs for rank processes (world size 2 and up) -------------------------------------------

_GROUPS: list[Any] = []
"""The group of the rank in this process, between jobs."""


def gpu_of(rank: int) -> int:
    """Return the GPU of ``rank``: its own where there are enough, else shared round-robin."""
    return rank % max(1, gpu_count())


def claim_own_host(rank: int) -> None:
    """Make NCCL in this rank process take it for a host of its own, before its first call.

    NCCL refuses two ranks of one communicator on one GPU; ranks that claim different
    hosts (``NCCL_HOSTID``) talk over NCCL's socket transport on the loopback
    interface instead, which is right, if slow. Variables already set are kept.
    """
    import os

    os.environ.setdefault("NCCL_HOSTID", f"collective-rank-{rank}")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")


def open_group(context: RankContext, name: str, timeout_s: float | None = None) -> None:
    """Select this rank's GPU for cupy and torch, and build this rank's NCCLGroup ``name``.

    Where fewer GPUs are visible than ranks, the ranks share them, each claiming a
    host of its own (see ``claim_own_host``).
    """
    import cupy

    from collective.groups.nccl.group import NCCLGroup

    if gpu_count() < context.world_size:
        claim_own_host(context.rank)
    device = gpu_of(context.rank)
    cupy.cuda.Device(device).use()
    if torch_cuda():
        import torch

        torch.cuda.set_device(device)
    timeout = GROUP_TIMEOUT if timeout_s is None else timedelta(seconds=timeout_s)
    group = NCCLGroup(context.world_size, context.rank, name, context.store, timeout)
    _GROUPS[:] = [group]


def close_group(context: RankContext) -> None:
    """Destroy this rank's group."""
    _GROUPS.pop().destroy_group()


def run_op_on_rank(
    context: RankContext, op: str, kind: str, dtype: str, async_op: bool
) -> list[np.ndarray]:
    """Run ``run_op`` on this rank's group and GPU."""
    return run_op(_GROUPS[0], gpu_of(context.rank), op, kind, dtype, async_op)


def send_recv_on_rank(context: RankContext, kind: str) -> np.ndarray:
    """Rank 0 sends to rank 1's GPU; rank 1 sends its first 8 elements back."""
    group, rank = _GROUPS[0], context.rank
    mine, theirs = gpu_of(rank), gpu_of(1 - rank)
    x = make(kind, values(rank), "float32", mine)
    if rank == 0:
        group.send([x], SendOptions(dst_rank=1, dst_gpu_index=theirs))
        group.recv([x], RecvOptions(src_rank=1, src_gpu_index=theirs, n_elements=8))
    elif rank == 1:
        group.recv([x], RecvOptions(src_rank=0, src_gpu_index=theirs))
        reply = make(kind, values(1, offset=3), "float32", mine)
        group.send([reply], SendOptions(dst_rank=0, dst_gpu_index=theirs, n_elements=8))
    return host(x)


def wait_outcome(work: Any, timeout: timedelta) -> tuple[str, str]:
    """Wait for ``work``; return its failure's type and message, or ("", "the wait returned")."""
    try:
        work.wait(timeout)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "", "the wait returned"


def time_out_on_rank(context: RankContext, busy_cycles: int) -> tuple[str, str, bool, str]:
    """Wait 50 ms for an allreduce queued behind ``busy_cycles`` of GPU work; report the outcome.

    Returns the wait's error type and message, whether the group then holds an error,
    and what the next op raised.
    """
    import torch

    open_group(context, f"gpu-timeout-{context.rank}")
    group = _GROUPS[0]
    x = torch.ones(4, device="cuda:0")
    group.allreduce([x], AllReduceOptions())
    torch.cuda.synchronize(0)
    torch.cuda._sleep(busy_cycles)
    work = group.allreduce([x], AllReduceOptions(async_op=True))
    error, message = wait_outcome(work, timedelta(milliseconds=50))
    try:
        group.allreduce([x], AllReduceOptions())
    except Exception as exc:
        refusal = str(exc)
    else:
        refusal = "the next op ran"
    broken = group.error is not None
    close_group(context)
    return error, message, broken, refusal
