"""Benchmark the nccl backend against raw cupy.cuda.nccl and torch.distributed, without Ray.

Usage: python -m benchmarks.nccl [--quick] [--sizes 8,1G] [--ops allreduce,gather]
       [--world-sizes 1,2,4,8] [--impls collective,collective_torch,cupy_nccl,torch_nccl]
       [--iters N] [--warmup N] [--reps N] [--overhead-calls N] [--budget-s S]
       [--json PATH] [--text PATH] [--profile PATH]

Ranks are spawned processes, rank r on GPU r, meeting on a TCPStore; by default at world
sizes 1, then 2, 4, 8 up to the GPU count (on one GPU 2 to 4, sharing it). For every op,
size and implementation it prints an nccl-tests-style row; then, at each world size, the
per-call host time of an 8-byte allreduce (from world size 2, check on, beside and off),
and the large-message bandwidth gap of each implementation to raw cupy.cuda.nccl. Where
cupy, NCCL or a GPU is missing it prints why and exits 0.

``python -m benchmarks.nccl --shared-gpu`` measures ranks that share one GPU instead
(see ``benchmarks.shared_gpu``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks import gpu_results, nccl_peers, nccl_timing, shared_gpu
from benchmarks.nccl_peers import IMPLS, OPS, RAW
from benchmarks.nccl_ranks import RankError, RankPool

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
FULL_SIZES = [8 << i for i in range(28)]
"""8 B to 1 GiB, doubling, as nccl-tests' ``-b 8 -e 1G -f 2``."""
QUICK_SIZES = [8, 4 << 10, 1 << 20, 64 << 20]
OVERHEAD_GOAL_US = 10.0
SHARED_MOST_BYTES = 1 << 20
"""Where ranks share a GPU (NCCL over sockets), the largest allreduce measured."""
GAP_GOAL_PCT = 2.0
CHECK_GOAL_US = 1.0
"""The most host time per call the mismatch check may add (``collective`` over ``_nocheck``)."""
NOCHECK = "collective_nocheck"
SPREAD, SHARED_SPREAD = (2, 4, 8), (2, 3, 4)
"""The world sizes measured by default: one rank per GPU where there are the GPUs; on one GPU."""


def default_world_sizes(gpus: int) -> list[int]:
    """Return 1, then ``SPREAD`` up to ``gpus``; on one GPU (or none) ``SHARED_SPREAD``."""
    spread = [n for n in SPREAD if n <= gpus] if gpus > 1 else list(SHARED_SPREAD)
    return [1, *spread]


def size_arg(text: str) -> int:
    """Return ``text`` (``8``, ``4K``, ``1M``, ``1G``) in bytes."""
    text = text.strip().upper().removesuffix("B")
    size = int(text[:-1]) * UNITS[text[-1]] if text[-1:] in UNITS else int(text)
    if size < nccl_peers.ITEM:
        raise argparse.ArgumentTypeError(f"sizes must be at least 4 bytes, got {text}")
    return size


def arguments(argv: list[str]) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.nccl", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="4 sizes, few iterations")
    parser.add_argument("--sizes", help="comma-separated bytes (default 8 B to 1 GiB, doubling)")
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--world-sizes", default="", help="default: 1, 2, 4, 8 up to the GPUs")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--iters", type=int, default=None, help="calls per timed repetition")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per point")
    parser.add_argument("--overhead-calls", type=int, default=None)
    parser.add_argument("--budget-s", type=float, default=480.0, help="stop measuring after")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--text", type=Path, default=None, help="write the tables here too")
    parser.add_argument("--profile", type=Path, default=None, help="profile ours, 8 B, here")
    args = parser.parse_args(argv)
    default_sizes = QUICK_SIZES if args.quick else FULL_SIZES
    args.sizes = [size_arg(s) for s in args.sizes.split(",")] if args.sizes else default_sizes
    args.ops = [op for op in args.ops.split(",") if op]
    args.impls = [i for i in args.impls.split(",") if i]
    args.world_sizes = [int(n) for n in args.world_sizes.split(",") if n]
    args.iters = args.iters or (5 if args.quick else 20)
    args.reps = args.reps or (3 if args.quick else 5)
    args.overhead_calls = args.overhead_calls or (200 if args.quick else 2000)
    for name, values, known in (("ops", args.ops, OPS), ("impls", args.impls, IMPLS)):
        unknown = sorted(set(values) - set(known))
        if unknown:
            parser.error(f"unknown {name}: {unknown}; known: {list(known)}")
    if RAW not in args.impls:
        parser.error(f"--impls must include {RAW}, the baseline")
    if any(n < 1 for n in args.world_sizes):
        parser.error(f"world sizes must be at least 1, got {args.world_sizes}")
    return args


def iterations(size: int, most: int) -> int:
    """Return the calls per repetition: fewer for big messages, about 1 GiB per repetition."""
    return max(2, min(most, (1 << 30) // size))


def record(
    impl: str, op: str, n: int, size: int, per_rank: list[tuple[list[float], int]], iters: int
) -> dict[str, Any]:
    """Summarise one point: each repetition's slowest rank, then the median over repetitions."""
    slowest = [max(reps) for reps in zip(*(times for times, _ in per_rank), strict=True)]
    median = statistics.median(slowest)
    algbw = size / median / 1e9
    return {
        "impl": impl,
        "op": op,
        "world_size": n,
        "size": size,
        "count": nccl_peers.elements(op, size, n),
        "type": "float",
        "iters": iters,
        "reps": len(slowest),
        "time_us": {"median": median * 1e6, "min": min(slowest) * 1e6, "max": max(slowest) * 1e6},
        "algbw_gbs": algbw,
        "busbw_gbs": algbw * nccl_peers.BUS_FACTOR[op](n),
        "wrong": sum(wrong for _, wrong in per_rank),
    }


class Run:
    """One benchmark run: its records, notes and the time it may take."""

    def __init__(self, args: argparse.Namespace) -> None:
        """Start the clock."""
        self.args = args
        self.records: list[dict[str, Any]] = []
        self.overhead: dict[str, dict[str, float]] = {}
        self.overhead_at: dict[int, dict[str, dict[str, float]]] = {}
        """The per-call host times at each world size above 1, where the check runs."""
        self.notes: list[str] = []
        self.info: dict[str, str] = {}
        self.failed = False
        self.deadline = time.monotonic() + args.budget_s
        self.gpus = 0
        """The GPUs this machine shows; set before the first world size runs."""

    def note(self, text: str, failure: bool = False) -> None:
        """Record a line for the table's footer; a failure makes the run exit 1."""
        self.notes.append(text)
        self.failed = self.failed or failure
        print(f"# {text}", file=sys.stderr, flush=True)

    def world(self, n: int) -> None:
        """Measure every point at world size ``n`` in a fresh pool of ranks."""
        with RankPool(n) as pool:
            name = f"bench-{uuid.uuid4().hex[:8]}"
            unavailable = {k: v for d in pool.run(nccl_peers.setup, name) for k, v in d.items()}
            self.info = self.info or pool.run(nccl_peers.describe)[0]
            impls = [i for i in self.args.impls if i not in unavailable]
            for impl in self.args.impls:
                if impl in unavailable:
                    self.note(f"{impl}: unavailable: {unavailable[impl]}")
            self.measure_overhead(pool, impls, n)
            self.sweep(pool, n, impls)
            pool.run(nccl_peers.teardown)

    def measure_overhead(self, pool: RankPool, impls: list[str], n: int = 1) -> None:
        """Time each implementation's 8-byte allreduce at world size ``n``, slowest rank's.

        A group of one skips the mismatch check: what it costs shows from 2 ranks on.
        """
        found = self.overhead if n == 1 else self.overhead_at.setdefault(n, {})
        for impl in impls:
            try:
                per_rank = pool.run(nccl_timing.overhead, impl, self.args.overhead_calls)
            except RankError as exc:
                if pool.broken:
                    raise
                self.note(f"{impl} 8-byte allreduce overhead, world size {n}: failed: {exc}", True)
                continue
            found[impl] = max(per_rank, key=lambda stats: stats["median_us"])
        if n == 1 and self.args.profile and "collective" in self.overhead:
            calls = self.args.overhead_calls
            text = pool.run(nccl_timing.profile, "collective", calls)[0]
            parts = pool.run(nccl_timing.device_calls, calls)[0]
            self.args.profile.write_text(f"{parts}\n# ours, {calls} 8-byte allreduces\n{text}")

    def sweep(self, pool: RankPool, n: int, impls: list[str]) -> None:
        """Measure every op and size, rotating which implementation goes first."""
        broken: set[tuple[str, str]] = set()
        said: set[tuple[str, str]] = set()
        shared = n > self.gpus
        for k, (op, size) in enumerate((op, s) for op in self.args.ops for s in self.args.sizes):
            why = nccl_peers.skip_reason(op, size, n)
            if shared and not why and (op != "allreduce" or size > SHARED_MOST_BYTES):
                why = "ranks share a GPU: only allreduce up to 1 MiB, for the per-call costs"
            if why:
                if (op, why) not in said:
                    self.note(f"{op}, world size {n}: skipped where {why}")
                said.add((op, why))
                continue
            if time.monotonic() > self.deadline:
                spent = f"the budget of {self.args.budget_s:g} s is spent"
                self.note(f"stopped before {op} {size} B, world size {n}: {spent}", True)
                return
            print(f"# {op} {size} B, world size {n}", file=sys.stderr, flush=True)
            shift = k % len(impls)
            for impl in impls[shift:] + impls[:shift]:
                if (impl, op) in broken:
                    continue
                iters = iterations(size, self.args.iters)
                job = (impl, op, size, iters, self.args.warmup, self.args.reps)
                try:
                    per_rank = pool.run(nccl_timing.measure, *job)
                except RankError as exc:
                    if pool.broken:
                        raise
                    self.note(f"{impl} {op} {size} B, world size {n}: failed: {exc}", True)
                    broken.add((impl, op))
                    continue
                self.records.append(record(impl, op, n, size, per_rank, iters))


HEADER = (
    f"{'size(B)':>12} {'count':>11} {'type':>6} {'impl':>17} {'time(us)':>11} "
    f"{'min(us)':>10} {'max(us)':>10} {'algbw(GB/s)':>11} {'busbw(GB/s)':>11} "
    f"{'#wrong':>6} {'vs raw':>7}"
)


def unavailable_table(ops: list[str], world_sizes: list[int], why: str) -> str:
    """Return the table's frame, one line per op and world size, saying why it is empty."""
    lines = [f"# unavailable: {why}", HEADER]
    for n in world_sizes:
        lines += [f"# {op}, world size {n}: unavailable: no GPU" for op in ops]
    return "\n".join(lines)


def table(records: list[dict[str, Any]]) -> str:
    """Return the records as nccl-tests-style text, one block per op and world size."""
    header = HEADER
    raw = {(r["op"], r["world_size"], r["size"]): r for r in records if r["impl"] == RAW}
    lines = []
    for op, n in sorted({(r["op"], r["world_size"]) for r in records}, key=_block_order):
        lines += ["", f"# {op}, world size {n}", header]
        rows = [r for r in records if (r["op"], r["world_size"]) == (op, n)]
        for r in sorted(rows, key=lambda r: (r["size"], IMPLS.index(r["impl"]))):
            t, base = r["time_us"], raw.get((op, n, r["size"]))
            ratio = f"{t['median'] / base['time_us']['median']:.2f}x" if base else "-"
            lines.append(
                f"{r['size']:>12} {r['count']:>11} {r['type']:>6} {r['impl']:>17} "
                f"{t['median']:>11.2f} {t['min']:>10.2f} {t['max']:>10.2f} "
                f"{r['algbw_gbs']:>11.3f} {r['busbw_gbs']:>11.3f} {r['wrong']:>6} {ratio:>7}"
            )
    return "\n".join(lines).lstrip("\n")


def _block_order(block: tuple[str, int]) -> tuple[int, int]:
    return block[1], OPS.index(block[0])


def overhead_table(overhead: dict[str, dict[str, float]], calls: int, world_size: int = 1) -> str:
    """Return each implementation's 8-byte allreduce host time; from 2 ranks, over _nocheck's."""
    if not overhead:
        return ""
    base = overhead.get(RAW, {}).get("median_us")
    unchecked = overhead.get(NOCHECK, {}).get("median_us") if world_size > 1 else None
    goals = f"ours at most {OVERHEAD_GOAL_US:g} us above {RAW}"
    if unchecked is not None:
        goals += f"; the check at most {CHECK_GOAL_US:g} us above {NOCHECK}"
    lines = [
        f"# per-call host time of an 8-byte float32 allreduce, world size {world_size}, "
        f"{calls} calls, the slowest rank (goal: {goals})",
        f"{'impl':>20} {'median(us)':>11} {'p10(us)':>9} {'p90(us)':>9} "
        f"{'burst(us/call)':>15} {'over raw(us)':>13}"
        + (f" {'over nocheck(us)':>17}" if unchecked is not None else ""),
    ]
    for impl in sorted(overhead, key=IMPLS.index):
        s = overhead[impl]
        over = f"{s['median_us'] - base:+.2f}" if base is not None else "-"
        line = (
            f"{impl:>20} {s['median_us']:>11.2f} {s['p10_us']:>9.2f} {s['p90_us']:>9.2f} "
            f"{s['batch_us']:>15.2f} {over:>13}"
        )
        if unchecked is not None:
            line += f" {s['median_us'] - unchecked:>+17.2f}"
        lines.append(line)
    return "\n".join(lines)


def gap_table(records: list[dict[str, Any]]) -> str:
    """Return each implementation's bandwidth shortfall to raw NCCL at the largest size."""
    lines = []
    for n in sorted({r["world_size"] for r in records}):
        rows = [r for r in records if r["world_size"] == n]
        largest = max(r["size"] for r in rows)
        at = {(r["op"], r["impl"]): r for r in rows if r["size"] == largest}
        others = [i for i in IMPLS if i != RAW and any(k[1] == i for k in at)]
        if not others:
            continue
        lines += [
            "",
            f"# bandwidth gap to {RAW} at {largest} B, world size {n}: "
            f"(1 - algbw / raw algbw) in %, positive = slower (goal: ours within "
            f"{GAP_GOAL_PCT:g}%)",
            f"{'op':>14} " + " ".join(f"{i:>17}" for i in others),
        ]
        for op in [op for op in OPS if (op, RAW) in at]:
            raw = at[op, RAW]["algbw_gbs"]
            cells = [
                f"{(1 - at[op, i]['algbw_gbs'] / raw) * 100:>+16.2f}%" if (op, i) in at else "-"
                for i in others
            ]
            lines.append(f"{op:>14} " + " ".join(f"{c:>17}" for c in cells))
    return "\n".join(lines).lstrip("\n")


def report(run: Run, why: str) -> str:
    """Return everything the run measured, as text; ``why`` says why nothing could run."""
    args = run.args
    parts = [
        "# nccl benchmark: time is the median over repetitions of the slowest rank's mean "
        "time per call; algbw = size / time; busbw = algbw x nccl-tests' factor; "
        f"'vs raw' = time / {RAW}'s time",
        *(f"# {k}: {v}" for k, v in run.info.items()),
        table(run.records) if not why else unavailable_table(args.ops, args.world_sizes, why),
        overhead_table(run.overhead, run.args.overhead_calls),
        *(
            overhead_table(run.overhead_at[n], run.args.overhead_calls, n)
            for n in sorted(run.overhead_at)
        ),
        gap_table(run.records),
        *(f"# {note}" for note in run.notes),
    ]
    return "\n".join(p for p in parts if p)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print its tables and write its JSON; return the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if "--shared-gpu" in argv:
        return shared_gpu.main([a for a in argv if a != "--shared-gpu"])
    args = arguments(argv)
    start = time.monotonic()
    run = Run(args)
    from collective.groups.nccl.comm import unavailable_reason

    why = unavailable_reason()
    gpus = 0 if why else int(nccl_peers.cupy_module().cuda.runtime.getDeviceCount())
    if why:
        why = f"no GPU: {why}"
    run.gpus = gpus
    args.world_sizes = args.world_sizes or default_world_sizes(gpus)
    for n in args.world_sizes:
        if why:
            break
        if n > gpus:
            run.note(
                f"world size {n}: {n} ranks share {gpus} GPU(s), each a host of its own "
                "(NCCL_HOSTID): NCCL moves the bytes over its sockets, so only the per-call "
                "and check costs of these rows mean anything"
            )
        try:
            run.world(n)
        except RankError as exc:
            run.note(f"world size {n}: failed: {exc}", failure=True)
    text = report(run, why)
    print(text, flush=True)
    if args.text:
        args.text.write_text(text + "\n")
    wrong = sum(r["wrong"] for r in run.records)
    if args.json:
        meta = {
            "command": " ".join(["python -m benchmarks.nccl", *argv]),
            "python": platform.python_version(),
            "machine": platform.platform(),
            "seconds": round(time.monotonic() - start, 1),
            "gpus": gpus,
            "unavailable": why,
            "overhead_calls": args.overhead_calls,
            **gpu_results.run_meta(args.world_sizes),
            **run.info,
        }
        body = {
            "meta": meta,
            "results": run.records,
            "overhead": run.overhead,
            "overhead_by_world_size": {str(n): o for n, o in sorted(run.overhead_at.items())},
            "notes": run.notes,
        }
        args.json.write_text(json.dumps(body, indent=2) + "\n")
    print(f"\n# {len(run.records)} points, {wrong} wrong, in {time.monotonic() - start:.1f} s")
    return 1 if run.failed or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
