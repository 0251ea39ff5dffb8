"""torch.distributed on the ``"collective"`` backend beside ``"gloo"``, in one run.

Usage: python -m benchmarks.torch_backend [--world-sizes 2,4] [--rounds 5]
       [--sizes 8,1K,64K,1M,16M,64M,256M] [--ops all_reduce,...] [--ddp-steps 5]
       [--ddp-layers 16] [--binding-calls 500] [--json PATH]

For each world size the ranks run as spawned processes on this host, meeting on a
``TCPStore`` of the parent's (``init_process_group(store=...)``). Every rank holds a
default group on ``"collective"`` and a group on ``"gloo"`` over the same ranks, and
times, round by round with the two in alternating order (see ``torch_backend_ranks``):

- ``dist.all_reduce``, ``dist.broadcast``, ``dist.all_gather_into_tensor`` and
  ``dist.reduce_scatter_tensor`` of float32 buffers from 8 B to 256 MiB (sizes as in
  nccl-tests: the whole buffer of the chunked ops), time per call;
- DDP training steps of a model of 16 bias-free 1024 x 1024 linear layers (64 MiB of
  gradients) on a batch of 2, steps per second;
- the torch binding's cost per call: an 8-byte ``dist.all_reduce`` beside the
  library's own call (what ``col.allreduce`` runs) on the group the binding holds.

A round's value is the slowest rank's; the tables give the median of the rounds and
their range, and the goals compare medians at 2 ranks. Each rank runs torch on one
thread, as ``torchrun`` sets it up (``OMP_NUM_THREADS=1``). ``--json`` writes everything,
with the machine, the load and the command, to a results file.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import queue
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

from benchmarks.__main__ import parse_size
from benchmarks.goals import FAIL, NOT_MEASURED, PASS, Goal
from benchmarks.report import human
from benchmarks.torch_backend_ranks import (
    BACKENDS,
    DDP_BATCH,
    DDP_LAYERS,
    DDP_WIDTH,
    NO_COMMUNICATION,
    OPS,
    THREADS,
    Plan,
    run_rank,
)

SIZES = "8,1K,64K,1M,16M,64M,256M"
RESULT_TIMEOUT = timedelta(minutes=20)
SMALL_SPEEDUP = 20.0
LARGE_SPEEDUP = 3.0
DDP_SPEEDUP = 1.5
BINDING_US = 5.0


def spread(values: list[float], scale: float = 1.0) -> dict[str, float]:
    """Return the median, min and max of ``values`` times ``scale``."""
    return {
        "median": statistics.median(values) * scale,
        "min": min(values) * scale,
        "max": max(values) * scale,
    }


def measure(world_size: int, plan: Plan) -> dict[tuple[Any, ...], list[float]]:
    """Run ``plan`` on ``world_size`` spawned ranks; return the slowest rank's rounds."""
    import torch.distributed as dist

    context = multiprocessing.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, None, True, RESULT_TIMEOUT, wait_for_workers=False)
    results = context.Queue()
    ranks = [
        context.Process(target=run_rank, args=(r, world_size, store.port, plan, results))
        for r in range(world_size)
    ]
    for process in ranks:
        process.start()
    try:
        times = _collect(ranks, results)
    finally:
        for process in ranks:
            process.join(60)
            if process.is_alive():
                process.kill()
    return {
        key: [max(rounds) for rounds in zip(*(times[r][key] for r in times), strict=True)]
        for key in times[0]
    }


def _collect(ranks: list[Any], results: Any) -> dict[int, Any]:
    """Return each rank's times as it sends them; raise once a rank failed or time is up."""
    deadline = time.monotonic() + RESULT_TIMEOUT.total_seconds()
    times: dict[int, Any] = {}
    while len(times) < len(ranks):
        try:
            rank, value = results.get(timeout=1)
            times[rank] = value
        except queue.Empty:
            failed = {r: p.exitcode for r, p in enumerate(ranks) if p.exitcode not in (None, 0)}
            if failed:
                raise RuntimeError(f"ranks that failed, with their exit status: {failed}") from None
            if time.monotonic() > deadline:
                missing = sorted(set(range(len(ranks))) - set(times))
                raise TimeoutError(f"ranks {missing} sent nothing in {RESULT_TIMEOUT}") from None
    return times


def records(world_size: int, times: dict[tuple[Any, ...], list[float]]) -> dict[str, list]:
    """Return the run's rows of one world size: ops, DDP and the binding."""
    rows: dict[str, list] = {"ops": [], "ddp": [], "binding": []}
    for key, rounds in times.items():
        if key[0] == "op":
            _, op, size, backend = key
            rows["ops"].append(
                {"op": op, "size": size, "world_size": world_size, "backend": backend}
                | {"time_us": spread(rounds, 1e6)}
            )
        elif key[0] == "ddp":
            rate = spread([1 / s for s in rounds])
            rows["ddp"].append({"world_size": world_size, "backend": key[1], "steps_per_s": rate})
    if ("binding", "torch") in times:
        torch_s, library_s = times[("binding", "torch")], times[("binding", "library")]
        added = [t - c for t, c in zip(torch_s, library_s, strict=True)]
        rows["binding"].append(
            {
                "world_size": world_size,
                "size": 8,
                "torch_us": spread(torch_s, 1e6),
                "library_us": spread(library_s, 1e6),
                "added_us": spread(added, 1e6),
            }
        )
    return rows


def micros(us: float) -> str:
    """Return a time in microseconds as text in its best unit: ``9.7 us``, ``103 ms``."""
    return f"{us:.3g} us" if us < 1000 else f"{us / 1000:.3g} ms"


def _median(rows: list[dict], unit: str, **where: Any) -> float | None:
    found = [r for r in rows if all(r[k] == v for k, v in where.items())]
    return found[0][unit]["median"] if found else None


def goals(data: dict[str, Any]) -> list[Goal]:
    """Return the issue's four goals, each judged on this run's medians at 2 ranks."""
    verdicts = []
    for size, goal in ((8, SMALL_SPEEDUP), (64 << 20, LARGE_SPEEDUP)):
        claim = f"dist.all_reduce of {human(size)}, 2 ranks: >= {goal:g}x faster than gloo"
        ours, gloo = (
            _median(data["ops"], "time_us", op="all_reduce", size=size, world_size=2, backend=b)
            for b in BACKENDS
        )
        if ours is None or gloo is None:
            verdicts.append(Goal(claim, "not in this run", NOT_MEASURED))
            continue
        ratio = gloo / ours
        measured = f"{ratio:.1f}x ({micros(ours)} against {micros(gloo)})"
        verdicts.append(Goal(claim, measured, PASS if ratio >= goal else FAIL))
    claim = f"DDP, 64 MiB of gradients, 2 ranks: >= {DDP_SPEEDUP:g}x gloo's steps per second"
    ours, gloo = (_median(data["ddp"], "steps_per_s", world_size=2, backend=b) for b in BACKENDS)
    full = data["meta"]["ddp_gradient_bytes"] == 64 << 20 if data.get("meta") else False
    if ours is None or gloo is None or not full:
        verdicts.append(Goal(claim, "not in this run", NOT_MEASURED))
    else:
        measured = f"{ours / gloo:.2f}x ({ours:.3g} against {gloo:.3g} steps/s)"
        alone = _median(data["ddp"], "steps_per_s", world_size=2, backend=NO_COMMUNICATION)
        if alone is not None:
            measured += (
                f"; with no communication at all {alone:.3g} steps/s, "
                f"a ceiling of {alone / gloo:.2f}x over gloo"
            )
        verdicts.append(Goal(claim, measured, PASS if ours / gloo >= DDP_SPEEDUP else FAIL))
    claim = f"the torch binding adds <= {BINDING_US:g} us per call over the library's call"
    added = _median(data["binding"], "added_us", world_size=2)
    if added is None:
        verdicts.append(Goal(claim, "not in this run", NOT_MEASURED))
    else:
        verdicts.append(Goal(claim, f"{added:.2f} us", PASS if added <= BINDING_US else FAIL))
    return verdicts


def lines(data: dict[str, Any]) -> list[str]:
    """Return the run as text: a table per op and world size, DDP, the binding, the goals."""
    out = []
    for op, world_size in dict.fromkeys((r["op"], r["world_size"]) for r in data["ops"]):
        out.append(f"# {op}, {world_size} ranks: median us per call [range of rounds]")
        rows = [r for r in data["ops"] if (r["op"], r["world_size"]) == (op, world_size)]
        for size in dict.fromkeys(r["size"] for r in rows):
            cells = {r["backend"]: r["time_us"] for r in rows if r["size"] == size}
            text = "  ".join(
                f"{b} {t['median']:10.1f} [{t['min']:.1f}-{t['max']:.1f}]" for b, t in cells.items()
            )
            ratio = cells["gloo"]["median"] / cells["collective"]["median"]
            out.append(f"{human(size):>9}  {text}  gloo/collective {ratio:.1f}x")
    for r in data["ddp"]:
        s = r["steps_per_s"]
        out.append(
            f"# DDP, {r['world_size']} ranks, {r['backend']}: {s['median']:.2f} steps/s "
            f"[{s['min']:.2f}-{s['max']:.2f}]"
        )
    for r in data["binding"]:
        t, c, a = r["torch_us"], r["library_us"], r["added_us"]
        out.append(
            f"# binding, {r['world_size']} ranks, 8 B: dist.all_reduce {t['median']:.2f} us, "
            f"library call {c['median']:.2f} us, added {a['median']:.2f} us "
            f"[{a['min']:.2f}-{a['max']:.2f}]"
        )
    out.append("# goals")
    out += [f"{g.verdict.upper():13s} {g.claim}: {g.measured}" for g in goals(data)]
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Return the checked arguments."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", default=SIZES)
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--ddp-steps", type=int, default=5, help="timed steps a round; 0: none")
    parser.add_argument("--ddp-layers", type=int, default=DDP_LAYERS)
    parser.add_argument("--binding-calls", type=int, default=500, help="calls a block; 0: none")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    try:
        args.world_sizes = [int(n) for n in args.world_sizes.split(",")]
        args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    except (ValueError, argparse.ArgumentTypeError) as error:
        parser.error(str(error))
    args.ops = args.ops.split(",")
    unknown = sorted(set(args.ops) - set(OPS))
    if unknown:
        parser.error(f"unknown ops {unknown}: pick from {', '.join(OPS)}")
    if min(args.world_sizes) < 2 or args.rounds < 1:
        parser.error("world sizes must be at least 2 and --rounds at least 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print it and return its results."""
    args = parse(argv)
    plan = Plan(
        tuple(args.ops),
        tuple(args.sizes),
        args.rounds,
        args.ddp_steps,
        args.ddp_layers,
        args.binding_calls,
    )
    started, load_before = time.time(), os.getloadavg()
    data: dict[str, Any] = {"ops": [], "ddp": [], "binding": []}
    for world_size in args.world_sizes:
        for key, rows in records(world_size, measure(world_size, plan)).items():
            data[key] += rows
    import torch

    data["meta"] = {
        "command": "python -m benchmarks.torch_backend "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average_before": list(load_before),
        "load_average": list(os.getloadavg()),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "seconds": round(time.time() - started),
        "rounds": args.rounds,
        "ddp_gradient_bytes": args.ddp_layers * DDP_WIDTH * DDP_WIDTH * 4,
        "ddp_steps_per_round": args.ddp_steps,
        "ddp_batch": DDP_BATCH,
        "threads_per_rank": THREADS,
        "binding_calls_per_block": args.binding_calls,
    }
    data["goals"] = [g.__dict__ for g in goals(data)]
    print("\n".join(lines(data)))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(data, file, indent=1)
            file.write("\n")
    return data


if __name__ == "__main__":
    main()
