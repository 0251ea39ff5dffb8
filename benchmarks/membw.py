"""Measure the machine's memory bandwidth: what bounds a large op on one node.

Usage: python -m benchmarks.membw [--size 64M] [--processes 1,2] [--rounds 20] [--json PATH]

Each process copies a ``SIZE``-byte numpy buffer into another, once a round; the
processes of a line start every round together, as the ranks of a group do. A copy
reads each byte once and writes it once, so the memory traffic is at least twice the
bytes copied (more where a write first reads its cache line). A round's rate is the
bytes all the processes copied over the time from the first start to the last end. The
output gives, per process count, the fastest and the median round's rate, and what the
fastest means for a 2-rank allreduce of ``SIZE`` bytes through shared memory: each rank
reads and writes at least twice its buffer (it hands over half, reduces its half with
the peer's, and takes the peer's reduced half), the traffic of copying two buffers.

With ``--json``, the figures go into that results file's ``meta["membw"]``, where the
bus-bandwidth figures draw the bound they set (``report.membw_bound``); ``python -m
benchmarks`` measures and records them itself, before its ops. Without ``--processes``
it then measures 1 process and, per world size of the file, as many as the machine has
cores for.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.__main__ import parse_size
from benchmarks.report import human, write_json

ALLREDUCE_COPIES = 2
"""Buffers' worth of copying per rank in a 2-rank shared-memory allreduce, at least."""
SIZE = 64 << 20
"""Bytes each process copies a round: well above the caches of the machines we run on."""
ROUNDS = 20


@dataclass(frozen=True)
class Rate:
    """The copy rate of ``processes`` processes copying at once, all of them together."""

    processes: int
    fastest_gbs: float
    median_gbs: float


def copy_rounds(
    index: int, size: int, counts: list[int], rounds: int, barrier: Any, out: Any
) -> None:
    """Copy ``size`` bytes once a round while ``index`` is below the round's process count.

    Every process meets the others at ``barrier`` before each round; put the start and
    end of each copy, with its process count and round.
    """
    src = np.ones(size, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    spans = []
    for count in counts:
        for r in range(rounds):
            barrier.wait(timeout=120)
            if index < count:
                began = time.perf_counter()
                np.copyto(dst, src)
                spans.append((count, r, began, time.perf_counter()))
    out.put(spans)


def measure(size: int, counts: list[int], rounds: int) -> list[Rate]:
    """Return the copy rate of each process count in ``counts``, ``rounds`` rounds each.

    One set of processes serves every count. They are forked, which takes milliseconds
    where spawning them would import the caller's main module again in each.
    """
    ctx = multiprocessing.get_context("fork")
    workers = max(counts)
    barrier, out = ctx.Barrier(workers), ctx.Queue()
    procs = [
        ctx.Process(target=copy_rounds, args=(i, size, counts, rounds, barrier, out))
        for i in range(workers)
    ]
    for p in procs:
        p.start()
    spans = [span for _ in procs for span in out.get(timeout=300)]
    for p in procs:
        p.join(timeout=30)
    rates = []
    for count in counts:
        per_round = []
        for r in range(rounds):
            mine = [(began, ended) for c, n, began, ended in spans if (c, n) == (count, r)]
            took = max(e for _, e in mine) - min(b for b, _ in mine)
            per_round.append(count * size / took / 1e9)
        rates.append(Rate(count, max(per_round), statistics.median(per_round)))
    return rates


def as_meta(size: int, rounds: int, rates: list[Rate], command: str, when: str) -> dict[str, Any]:
    """Return the figures as a results file's ``meta["membw"]``: rates, method, machine, date."""
    return {
        "copy_gbs": [
            {
                "processes": r.processes,
                "fastest": round(r.fastest_gbs, 2),
                "median": round(r.median_gbs, 2),
            }
            for r in rates
        ],
        "units": "GB/s: 1e9 bytes copied per second by all the processes together; the memory "
        "traffic is at least twice that (each byte read once and written once)",
        "method": f"numpy copies (np.copyto) of {human(size)} per process, {rounds} rounds per "
        "process count; each round every process copies once, all starting together; a "
        "round's rate is the bytes copied over the time from the first start to the last "
        "end; fastest and median round",
        "size": size,
        "rounds": rounds,
        "command": command,
        "when": when,
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def counts_for(world_sizes: list[int]) -> list[int]:
    """Return the process counts the bound of each world size needs: 1 and up to the cores."""
    cores = os.cpu_count() or 1
    return sorted({1} | {min(n, cores) for n in world_sizes})


def lines(size: int, rounds: int, rates: list[Rate]) -> list[str]:
    """Return the figures as text: a header, then a line per process count."""
    text = [f"# numpy copies of {human(size)}, {rounds} rounds, every process copying once a round"]
    for r in rates:
        each = r.fastest_gbs * 1e9 / r.processes
        floor = ALLREDUCE_COPIES * size / each
        text.append(
            f"{r.processes} process(es): {r.fastest_gbs:.1f} GB/s copied in all in the fastest "
            f"round ({each / 1e9:.1f} per process), {r.median_gbs:.1f} GB/s in the median one; "
            f"a 2-rank allreduce of {human(size)} copies {ALLREDUCE_COPIES}x its buffer per "
            f"rank: {floor * 1e3:.1f} ms at the fastest round's rate"
        )
    return text


def main(argv: list[str] | None = None) -> list[str]:
    """Print and return one line per process count; with ``--json``, record them there."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks.membw", description=__doc__)
    parser.add_argument("--size", type=parse_size, default=SIZE)
    parser.add_argument("--processes", default=None, help="comma-separated (default 1,2)")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--json", type=Path, default=None, help="a results file to record into")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"rounds must be at least 1, got {args.rounds}")
    data = json.loads(args.json.read_text()) if args.json else None
    if args.processes:
        counts = sorted({int(p) for p in args.processes.split(",")})
    elif data is not None:
        counts = counts_for([r["world_size"] for r in data["results"]])
    else:
        counts = [1, 2]
    rates = measure(args.size, counts, args.rounds)
    text = lines(args.size, args.rounds, rates)
    print("\n".join(text))
    if data is not None:
        command = "python -m benchmarks.membw " + " ".join(argv)
        when = "separately, after the run that wrote these results"
        data["meta"]["membw"] = as_meta(args.size, args.rounds, rates, command, when)
        write_json(args.json, data)
    return text


if __name__ == "__main__":
    main()
