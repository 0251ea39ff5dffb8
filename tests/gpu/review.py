"""Jobs for rank processes: the GPU review's NCCL findings as a real GPU runs them.

Each job runs in every rank process of a ``RankPool`` (``benchmarks.nccl_ranks``) and
returns what ``test_review.py`` checks; see ``../shared/GPU-REVIEW.md`` for each
finding. Importable without torch's CUDA, cupy or a GPU.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

from benchmarks.nccl_ranks import RankContext
from collective.types import (
    AllReduceOptions,
    GatherOptions,
    ReduceOp,
    SendOptions,
)
from tests.gpu import cases


def _outcome(fn: Any) -> tuple[float, str, str]:
    """Run ``fn()``; return how long it took and its error's type and message ("", "")."""
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:
        return time.monotonic() - start, type(exc).__name__, str(exc)
    return time.monotonic() - start, "", ""


def blocking_loop_on_rank(context: RankContext, count: int, nbytes: int) -> tuple[str, float]:
    """H1: ``count`` blocking allreduces (MAX) of ``nbytes`` with no synchronisation.

    Returns the group's error ("" if none) after a final synchronize, and the value
    every element then holds (the world size: rank r holds r + 1).
    """
    import torch

    group, device = cases._GROUPS[0], cases.gpu_of(context.rank)
    x = torch.full((nbytes // 4,), float(context.rank + 1), device=f"cuda:{device}")
    _, error, message = _outcome(
        lambda: [group.allreduce([x], AllReduceOptions(ReduceOp.MAX)) for _ in range(count)]
    )
    torch.cuda.synchronize(device)
    if error:
        return f"{error}: {message}", -1.0
    time.sleep(1.0)  # the watchdog reads the last checks
    found = group.error
    return ("" if found is None else str(found)), float(x.min().item())


def first_ops_differ_on_rank(context: RankContext, timeout_s: float) -> tuple[float, str, str]:
    """H3: on a fresh group rank 0 allreduces while rank 1 sends to rank 0.

    Returns how long the call took and what it raised (both must raise within the
    timeout: before the fix rank 0 blocked inside NCCL's first-use connect).
    """
    import torch

    group, device = cases._GROUPS[0], cases.gpu_of(context.rank)
    x = torch.ones(1024, device=f"cuda:{device}")
    timeout = timedelta(seconds=timeout_s)
    if context.rank == 0:
        return _outcome(lambda: group.allreduce([x], AllReduceOptions(timeout=timeout)))
    options = SendOptions(dst_rank=0, dst_gpu_index=cases.gpu_of(0), timeout=timeout)
    return _outcome(lambda: group.send([x], options))


def first_gather_without_peer_on_rank(
    context: RankContext, timeout_s: float
) -> tuple[float, str, str]:
    """H3: warm communicators; rank 0's first gather while rank 1 never calls (dead or busy).

    The gather's receives are NCCL's first send/recv between the ranks: before the fix
    rank 0 blocked in NCCL's connect with the op lock held, past any timeout.
    """
    import torch

    group, device = cases._GROUPS[0], cases.gpu_of(context.rank)
    x = torch.ones(1024, device=f"cuda:{device}")
    group.allreduce([x], AllReduceOptions())
    torch.cuda.synchronize(device)
    if context.rank != 0:
        return 0.0, "", "never called"
    outs = [torch.empty_like(x) for _ in range(context.world_size)]
    options = GatherOptions(root_rank=0, timeout=timedelta(seconds=timeout_s))
    return _outcome(lambda: group.gather([outs], [x], options))


def busy_stream_on_rank(context: RankContext, seconds: float, name: str) -> tuple[str, int]:
    """M4: ``seconds`` of matmul + allreduce on one stream, no synchronisation, no check.

    Opens its own group with ``COLLECTIVE_NCCL_CHECK=0`` and a 10 s timeout, shorter
    than the run: before the fix the one re-recorded event per stream read as
    unfinished all along and the group failed. Returns the group's error and the
    number of iterations issued.
    """
    import torch

    os.environ["COLLECTIVE_NCCL_CHECK"] = "0"
    cases.open_group(context, name, timeout_s=10.0)
    group, device = cases._GROUPS[0], cases.gpu_of(context.rank)
    a = torch.randn(2048, 2048, device=f"cuda:{device}")
    y = torch.empty_like(a)
    issued = 0
    start = time.monotonic()
    try:
        while time.monotonic() - start < seconds:
            torch.matmul(a, a, out=y)
            group.allreduce([y], AllReduceOptions())
            issued += 1
        torch.cuda.synchronize(device)
        time.sleep(1.0)  # the watchdog's last rounds
        error = group.error
        return ("" if error is None else str(error)), issued
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", issued
    finally:
        os.environ.pop("COLLECTIVE_NCCL_CHECK", None)
        cases.close_group(context)


def capture_while_pending_on_rank(context: RankContext) -> tuple[str, list[float]]:
    """M1: capture compute and an allreduce while the group's last op is still pending.

    ``torch.cuda.graph`` captures in CUDA's global mode: before the fix the
    watchdog's event query from its own thread could invalidate the capture. Returns
    the error ("" if none) and what the allreduce wrote on two replays.
    """
    import torch

    group, device = cases._GROUPS[0], cases.gpu_of(context.rank)
    big = torch.ones(64 << 20, device=f"cuda:{device}")  # 256 MiB: still running below
    x = torch.full((4,), float(context.rank + 1), device=f"cuda:{device}")
    group.allreduce([x], AllReduceOptions())  # its communicators and first use
    torch.cuda.synchronize(device)
    seen: list[float] = []
    try:
        stream = torch.cuda.Stream(device=device)
        group.allreduce([big], AllReduceOptions())  # pending while the capture starts
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.graph(graph, stream=stream):
                y = x * 1.0
                for _ in range(20):
                    y = y * 1.0
                group.allreduce([y], AllReduceOptions())
        for k in range(2):
            x.fill_(float(context.rank + 1 + k))
            graph.replay()
            group.watch_stream(stream.cuda_stream, device, timedelta(seconds=30))
            torch.cuda.synchronize(device)
            seen.append(float(y[0].item()))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", seen
    return "", seen


def async_in_capture_on_rank(context: RankContext) -> tuple[str, str]:
    """L2: an async allreduce inside ``torch.cuda.graph`` is refused; the group lives on.

    Returns the refusal's message and the next op's error ("" if it ran).
    """
    import torch

    group, device = cases._GROUPS[0], cases.gpu_of(context.rank)
    x = torch.ones(4, device=f"cuda:{device}")
    group.allreduce([x], AllReduceOptions())
    torch.cuda.synchronize(device)
    refusal = ""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            group.allreduce([x], AllReduceOptions(async_op=True))
    except Exception as exc:
        refusal = f"{type(exc).__name__}: {exc}"
    _, error, message = _outcome(lambda: group.allreduce([x], AllReduceOptions()))
    torch.cuda.synchronize(device)
    return refusal, f"{error} {message}".strip()


def default_streams_two_gpus_on_rank(context: RankContext) -> tuple[str, list[float]]:
    """M2: ``allreduce`` over cuda:0 and cuda:1 on their default streams, cuda:0 current.

    A world-size-1 group of this process's own (run it in ``RankPool(1)``). Before the
    fix the marker of cuda:1 was recorded on cuda:0's legacy stream:
    ``cudaErrorInvalidResourceHandle`` broke the group. Needs two GPUs.
    """
    import cupy
    import torch

    from collective.groups.nccl.group import NCCLGroup

    cupy.cuda.Device(0).use()
    torch.cuda.set_device(0)
    name = f"gpu-review-m2-{context.rank}"
    group = NCCLGroup(1, 0, name, context.store, cases.GROUP_TIMEOUT)
    try:
        xs = [torch.full((4,), float(d + 1), device=f"cuda:{d}") for d in (0, 1)]
        _, error, message = _outcome(lambda: group.allreduce(xs, AllReduceOptions()))
        for d in (0, 1):
            torch.cuda.synchronize(d)
        time.sleep(0.5)
        broken = "" if group.error is None else str(group.error)
        return f"{error} {message} {broken}".strip(), [float(x[0].item()) for x in xs]
    finally:
        group.destroy_group()
