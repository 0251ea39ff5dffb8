"""Run the benchmark: every op x size x world size x implementation, interleaved.

Usage: python -m benchmarks [--quick] [--sizes 8,4K,1M] [--ops allreduce,allgather]
       [--world-sizes 2,4] [--impls collective,collective_gloo,torch_gloo,...]
       [--iters N] [--warmup N] [--batch N] [--probe-ops N] [--json PATH] [--plot PATH]
       [--markdown PATH] [--address ADDRESS]

Before its ops it measures the machine's memory bandwidth (``benchmarks.membw``, about
a second), which its JSON records and its bus-bandwidth figures draw as a bound.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import ray

from benchmarks import goals, peers, plots, processes, report, workloads
from benchmarks.report import COPY, IMPLS, OURS, OURS_GLOO, RAY, STORE, TORCH

FULL_SIZES = "8,64,1K,4K,16K,64K,256K,1M,4M,16M,64M,256M"
QUICK_SIZES = "8,64K,1M"
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
PROBE_SIZE = 8
PROBED = (OURS, OURS_GLOO, TORCH, RAY, COPY)
"""The implementations the 8-byte allreduce latency probe runs."""
ADDRESS_HELP = "join the running Ray cluster at this address (default: start one of 2 CPUs)"


def parse_size(text: str) -> int:
    """Return ``text`` (``8``, ``4K``, ``1M``, ``64KB``) in bytes."""
    text = text.strip().upper().removesuffix("B")
    try:
        size = int(text[:-1]) * UNITS[text[-1]] if text[-1:] in UNITS else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"sizes must be like 8, 4K or 1M, got {text!r}") from None
    if size <= 0:
        raise argparse.ArgumentTypeError(f"sizes must be positive, got {text}")
    return size


def arguments(argv: list[str]) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="world size 2, 3 sizes, few iters")
    parser.add_argument("--sizes", help=f"comma-separated bytes (default {FULL_SIZES})")
    parser.add_argument("--ops", default=",".join(workloads.OPS))
    parser.add_argument("--world-sizes", default=None, help="comma-separated (default 2,4)")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--iters", type=int, default=None, help="timed samples, at most")
    parser.add_argument("--warmup", type=int, default=None, help="untimed batches first")
    parser.add_argument(
        "--batch", type=int, default=None, help="back-to-back ops per sample, at most"
    )
    parser.add_argument(
        "--probe-ops", type=int, default=None, help="single 8-byte allreduces timed (0: no probe)"
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None, help="write a results page")
    parser.add_argument("--address", default=None, help=ADDRESS_HELP)
    args = parser.parse_args(argv)
    try:
        args.sizes = [
            parse_size(s)
            for s in (args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)).split(",")
        ]
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    args.ops = [op for op in args.ops.split(",") if op]
    args.world_sizes = [
        int(n) for n in (args.world_sizes or ("2" if args.quick else "2,4")).split(",")
    ]
    args.impls = [i for i in args.impls.split(",") if i]
    args.iters = args.iters or (5 if args.quick else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.batch = args.batch or (8 if args.quick else workloads.MAX_BATCH)
    if args.probe_ops is None:
        args.probe_ops = 200 if args.quick else 2000
    for name, values, known in (("ops", args.ops, workloads.OPS), ("impls", args.impls, IMPLS)):
        unknown = sorted(set(values) - set(known))
        if unknown:
            parser.error(f"unknown {name}: {unknown}; known: {list(known)}")
    return args


def iterations(size: int, most: int) -> int:
    """Return ``most`` samples, fewer for big messages: about 512 MiB moved, 5 at least."""
    return min(most, max(5, (512 << 20) // size))


def rounds(samples: int, warmup: int) -> list[tuple[int, int]]:
    """Split ``samples`` into rounds of ``(samples, warm-up batches)``.

    The first round warms up ``warmup`` batches; the later ones one batch, which takes
    the page faults of the fresh buffers every round gets.
    """
    n = min(samples, workloads.ROUNDS)
    return [(samples // n + (r < samples % n), warmup if r == 0 else 1) for r in range(n)]


def init_ray(address: str | None, **job: Any) -> None:
    """Connect to the Ray cluster at ``address``, or start a private one of 2 CPUs (None).

    ``job`` goes to ``ray.init``: what a job may choose, such as its namespace.
    """
    if address is None:
        ray.init(address="local", num_cpus=2, include_dashboard=False, **job)
    else:
        ray.init(address=address, **job)


def make(impl: str) -> Any:
    """Return a fresh runner of ``impl``."""
    runners = {
        OURS: lambda: peers.RayActors("collective", "auto"),
        OURS_GLOO: lambda: peers.RayActors("collective", "gloo"),
        RAY: lambda: peers.RayActors("ray"),
        TORCH: processes.TorchGloo,
        STORE: peers.ObjectStore,
        COPY: processes.ShmCopy,
    }
    return runners[impl]()


def progress(done: int, total: int, what: str) -> None:
    """Draw a progress bar on stderr."""
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {what:<48}")
    sys.stderr.flush()


def rotated(items: list[str], k: int) -> list[str]:
    """Return ``items`` starting at the ``k``-th: who goes first alternates point to point."""
    shift = k % max(len(items), 1)
    return items[shift:] + items[:shift]


def measure_point(
    runners: dict[str, Any],
    op: str,
    size: int,
    n: int,
    k: int,
    args: argparse.Namespace,
    bar: tuple[int, int],
) -> list[dict[str, Any]]:
    """Time ``op`` at ``size`` on every runner that has it, in rounds; return its records.

    Every round runs each implementation once, who goes first rotating (``k`` is the
    point's index); ``bar`` is the progress bar's ``(done, total)``.
    """
    runs = [impl for impl, runner in runners.items() if op in runner.ops]
    times: dict[str, list[float]] = {impl: [] for impl in runs}
    wrong = dict.fromkeys(runs, 0)
    batch = {
        impl: min(workloads.batch_for(size), runners[impl].max_batch, args.batch) for impl in runs
    }
    plan = rounds(iterations(size, args.iters), args.warmup)
    for r, (samples, warmup) in enumerate(plan):
        for impl in rotated(runs, k + r):
            progress(*bar, f"{impl} {op} {size} B, {n} ranks, round {r + 1}")
            last = r == len(plan) - 1
            got, bad = runners[impl].run(
                op, size, workloads.Plan(samples, warmup, batch[impl], check=last)
            )
            times[impl] += got
            wrong[impl] = max(wrong[impl], bad)
    real = workloads.actual_size(op, size, n)
    return [report.record(i, op, n, real, times[i], wrong[i], batch[i]) for i in runs]


def run(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict]:
    """Measure every point, interleaving implementations; return records, probes and skips."""
    unavailable: dict[str, str] = {}
    why = peers.ray_collective_available()
    impls = list(args.impls)
    if RAY in impls and why:
        unavailable[RAY] = why
        impls.remove(RAY)
    import collective

    if not collective.nccl_available():
        unavailable["collective_nccl"] = "unavailable: no GPU with cupy and NCCL on this machine"
    runners: dict[str, Any] = {}
    cases = [(op, size) for op in args.ops for size in args.sizes]
    probed = [i for i in impls if i in PROBED] if args.probe_ops else []
    total = len(args.world_sizes) * len(probed)
    total += sum(1 for _ in args.world_sizes for op, _ in cases for i in impls if op in ops_of(i))
    records, probes, done = [], [], 0
    for n in args.world_sizes:
        runners = {impl: make(impl) for impl in impls}
        try:
            for impl, runner in runners.items():
                progress(done, total, f"starting {impl}, {n} ranks")
                runner.start(n)
            plan = workloads.Plan(args.probe_ops, args.warmup, batch=1, barrier=False)
            for impl in probed:
                progress(done, total, f"{impl} {PROBE_SIZE} B allreduce latency, {n} ranks")
                times, _ = runners[impl].run("allreduce", PROBE_SIZE, plan)
                probes.append(report.latency(impl, n, PROBE_SIZE, times))
                done += 1
            for k, (op, size) in enumerate(cases):
                point = measure_point(runners, op, size, n, k, args, (done, total))
                records += point
                done += len(point)
        finally:
            for runner in runners.values():
                runner.stop()
    progress(done, total, "done")
    sys.stderr.write("\n")
    report.add_ratios(records)
    return records, probes, unavailable


def ops_of(impl: str) -> tuple[str, ...]:
    """Return the ops ``impl`` takes part in."""
    if impl == STORE:
        return peers.ObjectStore.ops
    return peers.RAY_COLLECTIVE_OPS if impl == RAY else workloads.OPS


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write its table, goals, JSON, plot and page; return the status."""
    argv = sys.argv[1:] if argv is None else argv
    args = arguments(argv)
    start = time.monotonic()
    from benchmarks import membw

    counts = membw.counts_for(args.world_sizes)
    copy_rates = membw.measure(membw.SIZE, counts, membw.ROUNDS)
    bandwidth = membw.as_meta(
        membw.SIZE,
        membw.ROUNDS,
        copy_rates,
        f"python -m benchmarks.membw --processes {','.join(map(str, counts))}",
        "in this run (python -m benchmarks), before its ops",
    )
    init_ray(args.address, namespace="collective-bench", log_to_driver=False)
    try:
        records, probes, unavailable = run(args)
    finally:
        ray.shutdown()
    verdicts = goals.evaluate(records, probes)
    print(report.table(records, unavailable))
    if probes:
        print("\n" + report.latency_table(probes))
    print("\n" + goals.text(verdicts))
    print("\n" + "\n".join(membw.lines(membw.SIZE, membw.ROUNDS, copy_rates)))
    import torch

    meta = {
        "command": "python -m benchmarks " + " ".join(argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "seconds": round(time.monotonic() - start, 1),
        "unavailable": unavailable,
        "membw": bandwidth,
    }
    data = {"meta": meta, "results": records, "latency": probes, "goals": goals.as_json(verdicts)}
    if args.json:
        report.write_json(args.json, data)
    figures = plots.busbw(args.plot, records, bandwidth) if args.plot else []
    if args.markdown:
        names = [(path.name, ops) for path, ops in figures]
        args.markdown.write_text(report.markdown(data, goals.text(verdicts), names))
    print(f"\n# {len(records)} points and {len(probes)} probes in {meta['seconds']} s")
    return 0 if all(r["wrong"] == 0 for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
