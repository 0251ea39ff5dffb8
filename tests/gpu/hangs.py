"""Jobs for rank processes: a peer that never comes, ranks that disagree, a captured graph.

Each job runs in every rank process of a ``RankPool`` (see ``benchmarks.nccl_ranks``)
on the group ``cases.open_group`` built there, and returns what the test checks.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from benchmarks.nccl_ranks import RankContext
from collective.types import AllReduceOptions
from tests.gpu import cases


def _next_op(group: Any, device: int) -> tuple[str, str]:
    """Run one more blocking allreduce; return its error's type and message, or ("", "")."""
    import torch

    try:
        group.allreduce([torch.ones(4, device=f"cuda:{device}")], AllReduceOptions())
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "", ""


def stall_on_rank(context: RankContext, absent: int) -> tuple[float, str, str]:
    """Allreduce once together, then again with rank ``absent`` never calling.

    Returns how long this rank's ``torch.cuda.synchronize`` took after its blocking
    allreduce, and what the next call on the group raised (the absent rank: -1, "", "").
    """
    import torch

    group, device = cases._GROUPS[0], cases.gpu_of(context.rank)
    x = torch.ones(4, device=f"cuda:{device}")
    group.allreduce([x], AllReduceOptions())
    torch.cuda.synchronize(device)
    if context.rank == absent:
        return -1.0, "", ""
    start = time.monotonic()
    group.allreduce([x], AllReduceOptions())  # returns at once: queued on the stream
    torch.cuda.synchronize(device)  # ends when the watchdog aborts the communicator
    took = time.monotonic() - start
    time.sleep(0.5)
    return (took, *_next_op(group, device))


def mismatch_on_rank(context: RankContext) -> tuple[str, str]:
    """Allreduce 8 + rank elements on each rank; return what the group then raises."""
    import torch

    group, device = cases._GROUPS[0], cases.gpu_of(context.rank)
    x = torch.ones(8 + context.rank, device=f"cuda:{device}")
    try:
        group.allreduce([x], AllReduceOptions())
        torch.cuda.synchronize(device)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    deadline = time.monotonic() + 10
    while group.error is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return _next_op(group, device)


def checked_on_rank(context: RankContext) -> list[tuple[str, str]]:
    """Run allreduces, a barrier and a send/recv through ``CheckedGroup`` (``check_args=True``).

    Returns, per call: the error's type and message ("", "" when it returned), and
    for the matched allreduce the sum it wrote. The mismatched calls must raise the
    same argument error on every rank before any data moves, and leave the group usable.
    """
    import torch

    from collective.checks.check_args import CheckedGroup
    from collective.types import BarrierOptions, RecvOptions, SendOptions

    group = CheckedGroup(cases._GROUPS[0])
    device = f"cuda:{cases.gpu_of(context.rank)}"
    out: list[tuple[str, str]] = []

    def attempt(call: Any) -> None:
        try:
            call()
            torch.cuda.synchronize(device)
        except Exception as exc:
            out.append((type(exc).__name__, str(exc)))
            return
        out.append(("", ""))

    x = torch.ones(8 + context.rank, device=device)
    attempt(lambda: group.allreduce([x], AllReduceOptions()))
    out.append(("values", str(x.tolist())))
    y = torch.full((4,), float(context.rank + 1), device=device)
    attempt(lambda: group.allreduce([y], AllReduceOptions()))
    out.append(("values", str(y.tolist())))
    attempt(lambda: group.barrier(BarrierOptions()))
    z = torch.full((3,), 5.0, device=device)
    if context.rank == 0:
        attempt(lambda: group.send([z], SendOptions(1)))
    else:
        w = torch.zeros(4, device=device)
        attempt(lambda: group.recv([w], RecvOptions(0)))
        out.append(("values", str(w.tolist())))
    return out


def capture_on_rank(context: RankContext, replays: int) -> list[list[float]]:
    """Capture a blocking allreduce in a CUDA graph; replay it on changing inputs.

    Returns what each replay left in the captured tensor.
    """
    import torch

    group, device = cases._GROUPS[0], cases.gpu_of(context.rank)
    static = torch.zeros(4, device=f"cuda:{device}")
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm up: communicators, launch, signature check
        for _ in range(3):
            group.allreduce([static], AllReduceOptions())
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    time.sleep(0.1)  # the watchdog sees the warm-up finish: it queries nothing during capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        group.allreduce([static], AllReduceOptions())
    seen = []
    for k in range(replays):
        static.copy_(torch.full((4,), float(context.rank + 1 + k), device=f"cuda:{device}"))
        graph.replay()
        seen.append(static.cpu().tolist())
    return seen


def expected_replays(world_size: int, replays: int) -> list[list[float]]:
    """Return what ``capture_on_rank`` must see on every rank: the sums of the ranks' inputs."""
    return [[float(np.sum([r + 1 + k for r in range(world_size)]))] * 4 for k in range(replays)]


def watched_replay_on_rank(
    context: RankContext, absent: int, timeout_s: float
) -> tuple[float, str]:
    """Capture an allreduce; replay it, watched for ``timeout_s``, except on rank ``absent``.

    Returns how long this rank's ``synchronize`` after the replay took, and what the
    group's next call raised (the absent rank: -1, "").
    """
    from datetime import timedelta

    import torch

    group, device = cases._GROUPS[0], cases.gpu_of(context.rank)
    static = torch.ones(4, device=f"cuda:{device}")
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        group.allreduce([static], AllReduceOptions())
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    time.sleep(0.1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        group.allreduce([static], AllReduceOptions())
    if context.rank == absent:
        return -1.0, ""
    start = time.monotonic()
    graph.replay()
    stream = torch.cuda.current_stream(device)
    group.watch_stream(stream.cuda_stream, device, timedelta(seconds=timeout_s))
    torch.cuda.synchronize(device)  # ends when the watchdog aborts the communicators
    took = time.monotonic() - start
    return took, _next_op(group, device)[1]
