"""What the Gloo path's agreement costs: each op with it and without it, interleaved.

Usage: python -m benchmarks.gloo_agreement [--world-size N] [--rounds N]
       [--sizes 8,64K,16M] [--iters N] [--json PATH]

The ranks (2 unless told) run as processes on this host and meet on a TCPStore.
They build one ``GlooGroup`` per mode: "with" as built, "without" told to skip the
agreement (``skip_agreement``), which leaves the op alone, and from
``agree.GATHER_FROM`` ranks on "ring", whose agreement allgathers the records round
gloo's ring instead of gathering them at rank 0 and broadcasting them back. Every op
runs on each, in alternating blocks, so that all see the same load. Prints, per op
and size, the median over every iteration and the range of the per-round medians,
in microseconds; an iteration counts the slowest rank. ``--json`` also writes them,
with the machine and the load, to a results file.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import time
import uuid
from datetime import timedelta
from typing import Any

import numpy as np

MODES = ("without", "with")
OPS = ("allreduce", "broadcast")
TIMEOUT = timedelta(seconds=120)


def _rank(rank: int, port: int, name: str, args: argparse.Namespace, results: Any) -> None:
    """Time every (op, size, mode) block of every round; send the times back."""
    import torch.distributed as dist

    from collective.groups.gloo.group import GlooGroup
    from collective.rendezvous.store import PrefixedRendezvousStore, TCPRendezvousStore
    from collective.types import AllReduceOptions, BroadcastOptions

    store = TCPRendezvousStore(dist.TCPStore("127.0.0.1", port, None, False, TIMEOUT))
    groups = {
        mode: GlooGroup(
            args.world_size, rank, name, PrefixedRendezvousStore(store, f"{mode}/"), TIMEOUT
        )
        for mode in _modes(args.world_size)
    }
    groups["without"].skip_agreement()
    if "ring" in groups:
        groups["ring"]._agreement.gather_from = args.world_size + 1
    calls = {
        "allreduce": lambda g, x: g.allreduce([x], AllReduceOptions()),
        "broadcast": lambda g, x: g.broadcast([x], BroadcastOptions(root_rank=0)),
    }
    times: dict[tuple[str, int, str], list[list[float]]] = {}
    for _ in range(args.rounds):
        for size in args.sizes:
            x = np.ones(max(size // 4, 1), dtype=np.float32)
            iters = args.iters if size < 1 << 20 else max(args.iters // 10, 2)
            for op in OPS:
                for mode, group in groups.items():
                    calls[op](group, x)
                    block = []
                    for _ in range(iters):
                        start = time.perf_counter()
                        calls[op](group, x)
                        block.append(time.perf_counter() - start)
                    times.setdefault((op, size, mode), []).append(block)
    results.put((rank, times))
    for group in groups.values():
        group.destroy_group()


def _modes(world_size: int) -> tuple[str, ...]:
    from collective.groups.gloo.agree import GATHER_FROM

    return (*MODES, "ring") if world_size >= GATHER_FROM else MODES


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    text = text.strip().upper()
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def main(argv: list[str] | None = None) -> list[str]:
    """Run the benchmark; print and return one line per op, size and mode."""
    import torch.distributed as dist

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--sizes", type=lambda s: [_size(p) for p in s.split(",")])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.world_size < 2:
        parser.error(f"--world-size must be at least 2, got {args.world_size}")
    args.sizes = args.sizes or [8, 64 << 10, 16 << 20]
    context = multiprocessing.get_context("spawn")
    master = dist.TCPStore("127.0.0.1", 0, None, True, TIMEOUT, wait_for_workers=False)
    results = context.Queue()
    name = f"agreement-{uuid.uuid4().hex[:8]}"
    ranks = [
        context.Process(target=_rank, args=(r, master.port, name, args, results))
        for r in range(args.world_size)
    ]
    for process in ranks:
        process.start()
    times = dict(results.get(timeout=1800) for _ in ranks)
    for process in ranks:
        process.join(60)
    lines, rows = [], []
    for key in times[0]:
        per_rank = [times[r][key] for r in range(args.world_size)]
        slowest = [np.max(np.stack(b), axis=0) for b in zip(*per_rank, strict=True)]
        median = float(np.median(np.concatenate(slowest))) * 1e6
        rounds = [float(np.median(b)) * 1e6 for b in slowest]
        op, size, mode = key
        rows.append(
            {
                "op": op,
                "size": size,
                "mode": mode,
                "median_us": median,
                "rounds_us": [min(rounds), max(rounds)],
            }
        )
        lines.append(
            f"{op:10s} {size:>9d} B  {mode:8s} median {median:9.0f} us, "
            f"rounds {min(rounds):.0f}-{max(rounds):.0f} us"
        )
    print("\n".join(lines))
    if args.json:
        _write(args, rows)
    return lines


def _write(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """Add this run to the results file ``args.json`` (a list of runs, kept in order)."""
    run = {
        "meta": {
            "command": "python -m benchmarks.gloo_agreement "
            f"--world-size {args.world_size} --rounds {args.rounds} --iters {args.iters}",
            "machine": platform.platform(),
            "cpus": os.cpu_count(),
            "world_size": args.world_size,
            "load_at_end": list(os.getloadavg()),
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        },
        "results": rows,
    }
    try:
        with open(args.json) as file:
            runs = json.load(file)
    except FileNotFoundError:
        runs = []
    with open(args.json, "w") as file:
        json.dump([*runs, run], file, indent=1)
        file.write("\n")


if __name__ == "__main__":
    main()
