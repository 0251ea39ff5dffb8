"""What each benchmarked op sends and must produce, and how it is timed: shared by every peer.

Sizes follow nccl-tests: for allreduce, broadcast, reduce and alltoall ``size`` is the
buffer each rank holds; for allgather and gather it is the gathered output, for
reducescatter and scatter the input, each ``world_size`` chunks of ``size / world_size``
bytes. A size too small for one float32 per chunk is rounded up to one (see ``shape``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

OPS = (
    "allreduce",
    "broadcast",
    "reduce",
    "allgather",
    "gather",
    "reducescatter",
    "scatter",
    "alltoall",
)
DTYPE = np.float32
ITEM = np.dtype(DTYPE).itemsize
ROOT = 0
"""The root of the rooted ops: broadcast, reduce, gather and scatter."""

CHUNKED = frozenset({"allgather", "gather", "reducescatter", "scatter", "alltoall"})
"""The ops whose buffers are world-size chunks."""

BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "allgather": lambda n: (n - 1) / n,
    "gather": lambda n: (n - 1) / n,
    "reducescatter": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
}
"""nccl-tests' bus bandwidth factor of each op for ``n`` ranks."""

BATCH_BYTES = 1 << 20
"""A timed sample runs back-to-back ops until about this many bytes have gone by."""

MAX_BATCH = 64
"""At most this many back-to-back ops per timed sample."""

ROUNDS = 3
"""Each point's samples are taken in up to this many rounds, every implementation once a
round, so that a slow spell of the machine (this VM's speed drifts by 30% over seconds)
falls on all of them rather than on the one that happened to run then. The last round
checks the result."""


@dataclass(frozen=True)
class Plan:
    """How one point is timed on every rank.

    ``iters`` samples follow ``warmup`` untimed batches; each sample times ``batch``
    back-to-back ops and reports their mean. With ``barrier`` the ranks meet before
    each sample; without it they meet once, and the samples are single ops run back
    to back (the latency probe). With ``check``, one more op on fresh buffers is
    checked against the expected result afterwards.
    """

    iters: int
    warmup: int
    batch: int = 1
    barrier: bool = True
    check: bool = True


def batch_for(size: int) -> int:
    """Return how many back-to-back ops one timed sample of ``size`` bytes runs."""
    return max(1, min(MAX_BATCH, BATCH_BYTES // max(size, 1)))


def shape(op: str, size: int, world_size: int) -> tuple[int, int]:
    """Return ``(chunk, total)`` elements for ``op`` at ``size`` bytes on ``world_size`` ranks.

    ``total`` is what the size counts (see the module docstring); chunked ops round it
    down to a multiple of ``world_size`` elements, and up to one element per chunk.
    """
    total = max(1, size // ITEM)
    if op not in CHUNKED:
        return total, total
    chunk = max(1, total // world_size)
    return chunk, chunk * world_size


def actual_size(op: str, size: int, world_size: int) -> int:
    """Return the bytes really measured for a requested ``size`` (see ``shape``)."""
    return shape(op, size, world_size)[1] * ITEM


def count(op: str, size: int, world_size: int) -> int:
    """Return the element count nccl-tests reports for ``op`` at ``size`` bytes."""
    return shape(op, size, world_size)[1]


def _alltoall_input(rank: int, world_size: int, chunk: int) -> np.ndarray:
    """Return rank's alltoall input: chunk j holds ``rank * world_size + j + 1``."""
    values = np.arange(1, world_size + 1, dtype=DTYPE) + rank * world_size
    return np.repeat(values, chunk)


def buffers(op: str, size: int, world_size: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Return this rank's fresh ``(input, output)`` for ``op``; output is input when in place."""
    chunk, total = shape(op, size, world_size)
    n = world_size
    if op in ("allreduce", "reduce"):
        x = np.full(total, rank + 1, DTYPE)
        return x, x
    if op == "broadcast":
        x = np.full(total, 1 if rank == ROOT else 0, DTYPE)
        return x, x
    if op in ("allgather", "gather"):
        return np.full(chunk, rank + 1, DTYPE), np.zeros(total, DTYPE)
    if op == "reducescatter":
        return np.full(total, rank + 1, DTYPE), np.zeros(chunk, DTYPE)
    if op == "scatter":
        x = np.repeat(np.arange(1, n + 1, dtype=DTYPE), chunk)
        return (x if rank == ROOT else np.zeros(total, DTYPE)), np.zeros(chunk, DTYPE)
    return _alltoall_input(rank, n, chunk), np.zeros(total, DTYPE)


def expected(op: str, size: int, world_size: int, rank: int) -> np.ndarray | None:
    """Return what ``rank`` must hold after one ``op`` on fresh buffers; None: not checked.

    Only the root's output of reduce and gather is checked.
    """
    chunk, total = shape(op, size, world_size)
    n = world_size
    if op in ("reduce", "gather") and rank != ROOT:
        return None
    if op in ("allreduce", "reduce"):
        return np.full(total, n * (n + 1) / 2, DTYPE)
    if op == "broadcast":
        return np.ones(total, DTYPE)
    if op in ("allgather", "gather"):
        return np.repeat(np.arange(1, n + 1, dtype=DTYPE), chunk)
    if op == "reducescatter":
        return np.full(chunk, n * (n + 1) / 2, DTYPE)
    if op == "scatter":
        return np.full(chunk, rank + 1, DTYPE)
    sources = np.arange(n, dtype=DTYPE) * n + rank + 1
    return np.repeat(sources, chunk)


def wrong(op: str, output: np.ndarray, size: int, world_size: int, rank: int) -> int:
    """Return how many elements of ``rank``'s ``output`` differ from the expected result."""
    want = expected(op, size, world_size, rank)
    if want is None:
        return 0
    if output.shape != want.shape:
        return int(want.size)
    return int(np.count_nonzero(output != want))


def time_loop(run: Callable[[], Any], barrier: Callable[[], Any], plan: Plan) -> list[float]:
    """Return the seconds per op of each of ``plan.iters`` samples, past the warm-up."""
    for _ in range(plan.warmup * plan.batch):
        run()
    barrier()
    times = []
    for _ in range(plan.iters):
        if plan.barrier:
            barrier()
        start = time.perf_counter()
        for _ in range(plan.batch):
            run()
        times.append((time.perf_counter() - start) / plan.batch)
    return times


def measure(
    op: str,
    size: int,
    world_size: int,
    rank: int,
    plan: Plan,
    call: Callable[[str, np.ndarray, np.ndarray], Callable[[], Any]],
    barrier: Callable[[], Any],
) -> tuple[list[float], int]:
    """Time ``call(op, input, output)`` by ``plan``, then run it once on fresh buffers and check.

    Returns the per-op seconds of each sample and the count of wrong output elements
    (0 without ``plan.check``).
    """
    x, out = buffers(op, size, world_size, rank)
    times = time_loop(call(op, x, out), barrier, plan)
    if not plan.check:
        return times, 0
    x, out = buffers(op, size, world_size, rank)
    call(op, x, out)()
    return times, wrong(op, out, size, world_size, rank)
