"""What the torch binding adds per call: ``dist.all_reduce`` beside ``col.allreduce`` on one group.

Usage: python -m benchmarks.torch_binding [--world-size 2] [--bytes 8] [--iters 1000]
       [--rounds 15] [--import-runs 10] [--json PATH]

Each rank of a world of spawned processes builds one torch process group of the backend
"collective" and also names its library group for ``col.allreduce``; the ranks then time,
round after round and in turn, a loop of ``col.allreduce`` (the library's own call),
``dist.all_reduce`` (torch's function, through the backend) and ``pg.allreduce`` (the
backend's method, as DDP's C++ calls it), each on the same tensor of the same group.
It prints the median of each, per call, and the difference: what the binding adds.

It also times ``import torch`` in fresh interpreters, in turn with torch's entry point
that registers the backend (``TORCH_DEVICE_BACKEND_AUTOLOAD=1``, torch's default) and
without it: what the registration at import costs every process that imports torch.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

GOAL_US = 5.0
"""The most the binding may add per call over ``col.allreduce``."""
NAME = "torch-binding"
WAYS = ("col.allreduce", "dist.all_reduce", "pg.allreduce")


def _rank(rank: int, world_size: int, path: str, args: Any, results: Any) -> None:
    import torch
    import torch.distributed as dist

    import collective as col
    from collective.registry import held

    dist.init_process_group(
        "collective",
        init_method=f"file://{path}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=300),
    )
    pg: Any = dist.group.WORLD
    held.create_group(NAME, lambda: (pg.group, None))
    t = torch.zeros(max(args.bytes // 4, 1), dtype=torch.float32)
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    calls = {
        "col.allreduce": lambda: col.allreduce(t, group_name=NAME),
        "dist.all_reduce": lambda: dist.all_reduce(t),
        "pg.allreduce": lambda: pg.allreduce([t], opts),
    }
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(args.rounds):
        for way in WAYS:
            call = calls[way]
            for _ in range(args.iters // 10):
                call()
            dist.barrier()
            started = time.perf_counter()
            for _ in range(args.iters):
                call()
            times[way].append((time.perf_counter() - started) / args.iters * 1e6)
    held.forget(NAME)
    dist.destroy_process_group()
    results.put((rank, times))


def import_seconds(runs: int) -> dict[str, float]:
    """Return the median seconds of ``import torch`` with and without the entry point."""
    import subprocess
    import sys

    probe = "import time; t = time.perf_counter(); import torch; print(time.perf_counter() - t)"
    seconds: dict[str, list[float]] = {"with": [], "without": []}
    with tempfile.TemporaryDirectory() as elsewhere:  # not the checkout: its egg-info
        for _ in range(runs):
            for way, flag in (("with", "1"), ("without", "0")):
                env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD=flag)
                done = subprocess.run(
                    [sys.executable, "-c", probe],
                    capture_output=True,
                    text=True,
                    env=env,
                    cwd=elsewhere,
                    check=True,
                )
                seconds[way].append(float(done.stdout))
    return {way: round(statistics.median(values), 3) for way, values in seconds.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the timing; print and return the medians (and write them with ``--json``)."""
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(prog="python -m benchmarks.torch_binding")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--bytes", type=int, default=8)
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--import-runs", type=int, default=10, help="0: skip the import timing")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    imports = import_seconds(args.import_runs) if args.import_runs else {}
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as temp:
        path = str(Path(temp) / "store")
        procs = [
            context.Process(target=_rank, args=(r, args.world_size, path, args, results))
            for r in range(args.world_size)
        ]
        for proc in procs:
            proc.start()
        per_rank = dict(results.get(timeout=1800) for _ in procs)
        for proc in procs:
            proc.join(60)
    medians = {
        way: round(statistics.median(t for r in per_rank.values() for t in r[way]), 2)
        for way in WAYS
    }
    added = {way: round(medians[way] - medians["col.allreduce"], 2) for way in WAYS[1:]}
    found = {
        "what": f"allreduce of {args.bytes} B, {args.world_size} ranks on one host (shm), "
        f"{args.rounds} rounds of {args.iters} calls each way, in turn; medians over "
        "rounds and ranks, us per call",
        "machine": f"{platform.node()}: {os.cpu_count()} cores",
        "load_before": os.getloadavg()[0],
        "us_per_call": medians,
        "added_over_col_allreduce_us": added,
        "goal_us": GOAL_US,
        "import_torch_s": imports,
        "import_torch_what": f"median of {args.import_runs} fresh interpreters each way, in "
        "turn: with the entry point that registers the backend, and without",
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print(json.dumps(found, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(found, indent=1) + "\n")
    return found


if __name__ == "__main__":
    main()
