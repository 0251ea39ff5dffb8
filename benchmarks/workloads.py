"""What each benchmarked op sends and what it must produce: shared by every implementation.

Sizes follow nccl-tests: for allreduce and broadcast ``size`` is the buffer each rank
holds; for allgather it is the gathered output, for reducescatter the input, each
``world_size`` chunks of ``size / world_size`` bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

OPS = ("allreduce", "allgather", "broadcast", "reducescatter")
DTYPE = np.float32
ITEM = np.dtype(DTYPE).itemsize

BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "reducescatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}
"""nccl-tests' bus bandwidth factor of each op for ``n`` ranks."""


def count(op: str, size: int, world_size: int) -> int:
    """Return the element count nccl-tests reports for ``op`` at ``size`` bytes."""
    return size // ITEM


def buffers(op: str, size: int, world_size: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Return this rank's fresh ``(input, output)`` for ``op``; output is input when in place."""
    total = size // ITEM
    chunk = total // world_size
    if op == "allreduce":
        x = np.full(total, rank + 1, DTYPE)
        return x, x
    if op == "broadcast":
        x = np.full(total, 1 if rank == 0 else 0, DTYPE)
        return x, x
    if op == "allgather":
        return np.full(chunk, rank + 1, DTYPE), np.zeros(chunk * world_size, DTYPE)
    return np.full(chunk * world_size, rank + 1, DTYPE), np.zeros(chunk, DTYPE)


def expected(op: str, size: int, world_size: int) -> np.ndarray:
    """Return the output every rank must hold after one ``op`` on fresh buffers."""
    total, n = size // ITEM, world_size
    chunk = total // n
    if op == "allreduce":
        return np.full(total, n * (n + 1) / 2, DTYPE)
    if op == "broadcast":
        return np.ones(total, DTYPE)
    if op == "allgather":
        return np.repeat(np.arange(1, n + 1, dtype=DTYPE), chunk)
    return np.full(chunk, n * (n + 1) / 2, DTYPE)


def wrong(op: str, output: np.ndarray, size: int, world_size: int) -> int:
    """Return how many elements of ``output`` differ from the expected result."""
    want = expected(op, size, world_size)
    if output.shape != want.shape:
        return int(want.size)
    return int(np.count_nonzero(output != want))


def time_loop(
    run: Callable[[], Any], barrier: Callable[[], Any], iters: int, warmup: int
) -> list[float]:
    """Return the seconds of each of ``iters`` runs, each after a barrier, past ``warmup`` runs."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(iters):
        barrier()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return times
