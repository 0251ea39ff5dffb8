"""Measure the machine's memory bandwidth: what limits a large op on one node.

Usage: python -m benchmarks.membw [--size 64M] [--processes 1,2] [--iters 20]

Each process copies a ``SIZE``-byte numpy buffer into another, over and over; all the
processes of a line copy at once, as the ranks of a group do. A copy reads each byte
once and writes it once, so the memory traffic is twice the bytes copied (and more
where a write first reads its cache line). The output gives, per process count, the
median bytes copied per second by each process and the sum over them, and what that
means for a 2-rank allreduce of ``SIZE`` bytes through shared memory: each rank reads
and writes at least twice its buffer (it hands over half, reduces its half with the
peer's, and takes the peer's reduced half), the traffic of copying two buffers.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from typing import Any

import numpy as np

from benchmarks.__main__ import parse_size
from benchmarks.report import human

ALLREDUCE_COPIES = 2
"""Buffers' worth of copying per rank in a 2-rank shared-memory allreduce, at least."""


def copy_rates(size: int, iters: int, start: Any, out: Any) -> None:
    """Copy ``size`` bytes ``iters`` times once ``start`` is set; put the bytes per second."""
    src = np.ones(size, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    start.wait()
    rates = []
    for _ in range(iters):
        began = time.perf_counter()
        np.copyto(dst, src)
        rates.append(size / (time.perf_counter() - began))
    out.put(rates)


def measure(size: int, processes: int, iters: int) -> list[float]:
    """Return each process's median copy rate (bytes/s), ``processes`` copying at once."""
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=copy_rates, args=(size, iters, start, out)) for _ in range(processes)
    ]
    for p in procs:
        p.start()
    time.sleep(0.5)
    start.set()
    rates = [statistics.median(out.get(timeout=120)) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    return rates


def main(argv: list[str] | None = None) -> list[str]:
    """Print and return one line per process count."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.membw", description=__doc__)
    parser.add_argument("--size", type=parse_size, default=64 << 20)
    parser.add_argument("--processes", default="1,2")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    lines = [f"# numpy copy of {human(args.size)}, median over {args.iters} copies per process"]
    for n in (int(p) for p in args.processes.split(",")):
        rates = measure(args.size, n, args.iters)
        each = min(rates)
        floor = ALLREDUCE_COPIES * args.size / each
        lines.append(
            f"{n} process(es): {each / 1e9:.1f} GB/s copied per process (slowest), "
            f"{sum(rates) / 1e9:.1f} GB/s in all; a 2-rank allreduce of {human(args.size)} "
            f"copies {ALLREDUCE_COPIES}x its buffer per rank: {floor * 1e3:.1f} ms at this rate"
        )
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
