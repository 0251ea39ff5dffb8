"""The plain-copy peer: each op's bytes copied through one shared segment, no arithmetic.

Every rank copies what the op sends into its own slot of the segment, the ranks meet,
and every rank copies out of the others' slots what the op delivers to it: broadcast is
one write and ``n - 1`` reads; allgather ``n`` chunk writes and ``n`` reads each;
allreduce copies reducescatter's bytes, then allgather's. The ranks meet on counters in
the segment, spinning with ``sched_yield``: the cheapest synchronisation there is. A big
buffer streams through in pieces of at most ``SLOT_BYTES`` per rank, so the segment
stays small. The data-moving ops deliver the real result and are checked; the reducing
ones (allreduce, reduce, reducescatter) compute nothing and are not.

Ordering between a rank's data copies and its counter store relies on the stores
staying in program order, as on x86 (TSO).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks import workloads
from benchmarks.workloads import ROOT

SLOT_BYTES = 8 << 20
"""Bytes of one rank's slot, at most: a bigger buffer goes through in pieces."""

CONTROL_BYTES = 4096
"""The head of the segment: one counter per rank, each on its own cache lines."""

STRIDE = 16
"""int64 elements between two ranks' counters (128 bytes)."""

IN_ROWS = {"allreduce": -1, "scatter": -1, "reducescatter": -1, "alltoall": -1}
"""Rows of an input matrix: -1 is world-size rows (chunks), else one row."""

OUT_ROWS = {"allreduce": -1, "allgather": -1, "gather": -1, "alltoall": -1}
"""Rows of an output matrix, as ``IN_ROWS``."""

SLOT_ROWS = {"allreduce": -1, "scatter": -1, "reducescatter": -1, "alltoall": -1}
"""Rows of one rank's slot, as ``IN_ROWS``."""

DATA_OPS = frozenset({"broadcast", "allgather", "gather", "scatter", "alltoall"})
"""The ops whose copy delivers the real result, so it is checked."""


def _rows(table: dict[str, int], op: str, n: int) -> int:
    return n if table.get(op, 1) == -1 else 1


def row_bytes(op: str, size: int, n: int) -> int:
    """Return the bytes of one row: a chunk, or the whole buffer of the unchunked ops."""
    chunk, total = workloads.shape(op, size, n)
    if op == "allreduce":
        return -(-total * workloads.ITEM // n)
    return (chunk if op in workloads.CHUNKED else total) * workloads.ITEM


def layout(op: str, size: int, n: int) -> tuple[int, int]:
    """Return ``(piece, slot)``: bytes of each row a piece covers, bytes of one rank's slot."""
    rows = _rows(SLOT_ROWS, op, n)
    piece = min(row_bytes(op, size, n), max(64, SLOT_BYTES // rows))
    slot = -(-rows * piece // 64) * 64
    return piece, slot


def segment_bytes(op: str, size: int, n: int) -> int:
    """Return the size of the segment ``op`` at ``size`` bytes needs on ``n`` ranks."""
    return CONTROL_BYTES + n * layout(op, size, n)[1]


class Meeting:
    """A barrier on per-rank counters in shared memory: bump mine, wait for all."""

    def __init__(self, counters: np.ndarray, rank: int, world_size: int) -> None:
        self._counters, self._rank, self._n = counters, rank, world_size
        self._generation = 0

    def __call__(self) -> None:
        """Return once every rank has called as often as this one."""
        self._generation += 1
        generation, counters = self._generation, self._counters
        counters[self._rank * STRIDE] = generation
        for j in range(self._n):
            while counters[j * STRIDE] < generation:
                os.sched_yield()


def _piece(
    op: str,
    rank: int,
    n: int,
    x: np.ndarray,
    y: np.ndarray,
    slots: list[np.ndarray],
    meet: Callable[[], None],
) -> None:
    """Move one piece of ``op``: ``x``/``y`` are this rank's input/output rows, cut to it."""
    mine, root = slots[rank], rank == ROOT
    if op in ("broadcast", "scatter"):
        if root:
            mine[:] = x
        meet()
        if op == "scatter":
            y[0] = slots[ROOT][rank]
        elif not root:
            y[:] = slots[ROOT]
    elif op in ("allgather", "gather"):
        mine[0] = x[0]
        meet()
        if op == "allgather" or root:
            for j in range(n):
                y[j] = slots[j][0]
    else:
        mine[:] = x
        meet()
        if op == "reduce":
            if root:
                for j in range(n):
                    y[:] = slots[j]
        elif op == "alltoall":
            for j in range(n):
                y[j] = slots[j][rank]
        else:
            for j in range(n):
                y[0 if op == "reducescatter" else rank] = slots[j][rank]
            if op == "allreduce":
                mine[rank] = y[rank]
                meet()
                for j in range(n):
                    y[j] = slots[j][j]
    meet()


def _matrices(op: str, x: np.ndarray, out: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Return this rank's ``x`` and ``out`` as byte matrices of whole rows.

    An allreduce whose buffer does not split into ``n`` equal rows copies a padded
    stand-in instead: it is not checked anyway.
    """
    if op == "allreduce" and x.nbytes % n:
        padded = np.zeros((n, -(-x.nbytes // n)), np.uint8)
        return padded, padded
    rows_in, rows_out = _rows(IN_ROWS, op, n), _rows(OUT_ROWS, op, n)
    return x.view(np.uint8).reshape(rows_in, -1), out.view(np.uint8).reshape(rows_out, -1)


def serve(pipe: Any, world_size: int, rank: int) -> None:
    """Run copies as told through ``pipe``: each run maps the segment the driver made.

    The mapping goes when the last array on it does, after the run.
    """
    pipe.send("ready")
    while True:
        message = pipe.recv()
        if message[0] == "stop":
            return
        _, op, size, plan, path = message
        with open(path, "r+b") as file:
            segment = mmap.mmap(file.fileno(), segment_bytes(op, size, world_size))
        pipe.send(_run(segment, op, size, plan, world_size, rank))
        del segment


def _run(
    segment: mmap.mmap, op: str, size: int, plan: workloads.Plan, n: int, rank: int
) -> tuple[list[float], int]:
    """Time ``op`` through ``segment`` by ``plan``; return the times and the wrong count."""
    piece, slot = layout(op, size, n)
    meet = Meeting(np.frombuffer(segment, np.int64, CONTROL_BYTES // 8), rank, n)
    rows = _rows(SLOT_ROWS, op, n)
    slots = [
        np.frombuffer(segment, np.uint8, rows * piece, CONTROL_BYTES + j * slot) for j in range(n)
    ]
    slots = [s.reshape(rows, piece) for s in slots]

    def call(op: str, x: np.ndarray, out: np.ndarray) -> Callable[[], None]:
        xs, ys = _matrices(op, x, out, n)
        width = xs.shape[1]

        def once() -> None:
            for start in range(0, width, piece):
                stop = min(width, start + piece)
                cut = [s[:, : stop - start] for s in slots] if stop - start < piece else slots
                _piece(op, rank, n, xs[:, start:stop], ys[:, start:stop], cut, meet)

        return once

    times, wrong = workloads.measure(op, size, n, rank, plan, call, meet)
    return times, (wrong if op in DATA_OPS else 0)
