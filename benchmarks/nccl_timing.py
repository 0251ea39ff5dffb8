"""The timed jobs of the NCCL benchmark, run in every rank process by ``nccl_ranks.RankPool``.

``measure`` times one op of one implementation as nccl-tests does: a burst of calls,
then a wait for the GPU. ``overhead`` times single 8-byte allreduces on the host, which
is where a wrapper's cost shows; ``profile`` says where that time goes in ours, and
``device_calls`` what each CUDA call on our path costs alone.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

from benchmarks.nccl_peers import buffers, count_wrong, library, op_call, rank_state, sync
from benchmarks.nccl_ranks import RankContext

BIG = 64 << 20
"""From this size on, the memory pools are emptied after each point."""


def _barrier() -> None:
    """Line the ranks up: a one-element allreduce on the raw communicator, then a sync."""
    state = rank_state()
    if state.context.world_size > 1:
        cupy = state.cupy
        flag = cupy.zeros(1, dtype=cupy.float32)
        f32, total = cupy.cuda.nccl.NCCL_FLOAT32, cupy.cuda.nccl.NCCL_SUM
        stream = cupy.cuda.get_current_stream().ptr
        state.comm.allReduce(flag.data.ptr, flag.data.ptr, 1, f32, total, stream)
    sync()


def _free_cached_memory() -> None:
    """Return the pools' cached blocks to the GPU, so that big sizes do not pile up."""
    state = rank_state()
    sync()
    state.cupy.get_default_memory_pool().free_all_blocks()
    if state.torch is not None:
        state.torch.cuda.empty_cache()


def measure(
    context: RankContext, impl: str, op: str, size: int, iters: int, warmup: int, reps: int
) -> tuple[list[float], int]:
    """Time ``op`` of ``impl`` at ``size`` bytes; return seconds per call of each rep, #wrong.

    Each rep issues ``iters`` calls back to back and waits for the GPU, as nccl-tests
    does. Then one call on fresh buffers is checked.
    """
    lib = library(impl)
    run = op_call(impl, op, buffers(lib, op, size))
    for _ in range(warmup):
        run()
    times = []
    for _ in range(reps):
        _barrier()
        start = time.perf_counter()
        for _ in range(iters):
            run()
        sync()
        times.append((time.perf_counter() - start) / iters)
    del run
    fresh = buffers(lib, op, size)
    op_call(impl, op, fresh)()
    sync()
    wrong = count_wrong(lib, fresh)
    del fresh
    if size >= BIG:
        _free_cached_memory()
    return times, wrong


def _tiny_allreduce(impl: str, warmup: int) -> Callable[[], Any]:
    """Return one 8-byte allreduce of ``impl``, warmed up."""
    run = op_call(impl, "allreduce", buffers(library(impl), "allreduce", 8))
    for _ in range(warmup):
        run()
    sync()
    return run


def overhead(context: RankContext, impl: str, calls: int) -> dict[str, float]:
    """Time each of ``calls`` 8-byte allreduces on the host; return its statistics in µs.

    The GPU is synchronised every 100 calls, outside the timed calls, so that the
    launch queue never fills. ``batch_us`` is the time per call of a burst of
    ``calls`` calls followed by one synchronisation.
    """
    run = _tiny_allreduce(impl, 200)
    each: list[float] = []
    for i in range(calls):
        start_ns = time.perf_counter_ns()
        run()
        each.append((time.perf_counter_ns() - start_ns) / 1e3)
        if i % 100 == 99:
            sync()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        run()
    sync()
    deciles = statistics.quantiles(each, n=10)
    return {
        "median_us": statistics.median(each),
        "p10_us": deciles[0],
        "p90_us": deciles[-1],
        "batch_us": (time.perf_counter() - start) / calls * 1e6,
    }


def profile(context: RankContext, impl: str, calls: int, lines: int = 40) -> str:
    """Return cProfile's top functions, by own time, over ``calls`` 8-byte allreduces."""
    run = _tiny_allreduce(impl, 100)
    profiler = cProfile.Profile()
    profiler.enable()
    for i in range(calls):
        run()
        if i % 100 == 99:
            sync()
    profiler.disable()
    sync()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(lines)
    return text.getvalue()


def device_calls(context: RankContext, calls: int) -> str:
    """Return a table of what each call our blocking 8-byte allreduce makes costs alone, in µs.

    Every CUDA and NCCL call of the path (see ``groups/nccl/running.py``), timed in a
    loop of ``calls``, next to the whole public call on a cupy array and a torch tensor.
    """
    from collective.frameworks import cuda_buffers

    state = rank_state()
    cupy, runtime = state.cupy, state.cupy.cuda.runtime
    c = buffers("cupy", "allreduce", 8)
    x = c.x
    stream = cupy.cuda.get_current_stream().ptr
    event = cupy.cuda.Event(disable_timing=True)
    f32, total = cupy.cuda.nccl.NCCL_FLOAT32, cupy.cuda.nccl.NCCL_SUM
    parts: dict[str, Callable[[], Any]] = {
        "public allreduce, cupy": op_call("collective", "allreduce", c),
        "raw NcclCommunicator.allReduce": lambda: state.comm.allReduce(
            x.data.ptr, x.data.ptr, 2, f32, total, stream
        ),
        "runtime.eventRecord": lambda: runtime.eventRecord(event.ptr, stream),
        "runtime.streamIsCapturing": lambda: runtime.streamIsCapturing(stream),
        "current_stream, cupy": lambda: cuda_buffers.current_stream(x),
        "launch_key, cupy": lambda: cuda_buffers.launch_key(x),
        "time.monotonic": time.monotonic,
    }
    if state.torch is not None:
        t = buffers("torch", "allreduce", 8)
        parts["public allreduce, torch"] = op_call("collective_torch", "allreduce", t)
        parts["current_stream, torch"] = lambda: cuda_buffers.current_stream(t.x)
        parts["launch_key, torch"] = lambda: cuda_buffers.launch_key(t.x)
    rows = [f"# each call alone, {calls} calls, best of 3 (µs per call)"]
    for name, fn in parts.items():
        best = float("inf")
        for _ in range(3):
            sync()
            start = time.perf_counter()
            for i in range(calls):
                fn()
                if i % 500 == 499:
                    sync()
            best = min(best, time.perf_counter() - start)
        rows.append(f"{name:>34} {best / calls * 1e6:8.3f}")
    sync()
    return "\n".join(rows) + "\n"
