"""Run the benchmark: every op x size x world size x implementation, alternating.

Usage: python -m benchmarks [--quick] [--sizes 4K,1M] [--ops allreduce,allgather]
       [--world-sizes 2,4] [--impls collective,torch_gloo,ray_collective,object_store]
       [--iters N] [--warmup N] [--json PATH] [--plot PATH]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from typing import Any

import ray

from benchmarks import peers, report, workloads

IMPLS = ("collective", "torch_gloo", "ray_collective", "object_store")
FULL_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M,256M"
QUICK_SIZES = "4K,64K,1M"
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """Return ``text`` (``4096``, ``4K``, ``1M``) in bytes; a multiple of 4 per rank chunk."""
    text = text.strip().upper().removesuffix("B")
    size = int(text[:-1]) * UNITS[text[-1]] if text[-1] in UNITS else int(text)
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
    parser.add_argument("--iters", type=int, default=None, help="timed iterations, at most")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None, help="write a results page")
    args = parser.parse_args(argv)
    args.sizes = [
        parse_size(s)
        for s in (args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)).split(",")
    ]
    args.ops = [op for op in args.ops.split(",") if op]
    args.world_sizes = [
        int(n) for n in (args.world_sizes or ("2" if args.quick else "2,4")).split(",")
    ]
    args.impls = [i for i in args.impls.split(",") if i]
    args.iters = args.iters or (5 if args.quick else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    for name, values, known in (("ops", args.ops, workloads.OPS), ("impls", args.impls, IMPLS)):
        unknown = sorted(set(values) - set(known))
        if unknown:
            parser.error(f"unknown {name}: {unknown}; known: {list(known)}")
    return args


def iterations(size: int, most: int) -> int:
    """Return fewer timed iterations for big messages: about 512 MiB moved per point."""
    return max(3, min(most, (512 << 20) // size))


def make(impl: str) -> Any:
    """Return a fresh runner of ``impl``."""
    if impl == "collective":
        return peers.RayActors("collective")
    if impl == "ray_collective":
        return peers.RayActors("ray")
    if impl == "torch_gloo":
        return peers.TorchGloo()
    return peers.ObjectStore()


def measures(impl: str, op: str) -> bool:
    """Return whether ``impl`` takes part in ``op`` (the object store does two ops)."""
    return impl != "object_store" or op in peers.ObjectStore.ops


def progress(done: int, total: int, what: str) -> None:
    """Draw a progress bar on stderr."""
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {what:<48}")
    sys.stderr.flush()


def run(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Measure every point, alternating implementations; return the records and skips."""
    unavailable: dict[str, str] = {}
    why = peers.ray_collective_available()
    impls = list(args.impls)
    if "ray_collective" in impls and why:
        unavailable["ray_collective"] = why
        impls.remove("ray_collective")
    import collective

    if not collective.nccl_available():
        unavailable["collective_nccl"] = "unavailable: no GPU with cupy and NCCL on this machine"
    cases = [(op, size) for op in args.ops for size in args.sizes]
    total = sum(
        1 for _ in args.world_sizes for op, _ in cases for impl in impls if measures(impl, op)
    )
    records, done = [], 0
    for n in args.world_sizes:
        runners = {impl: make(impl) for impl in impls}
        try:
            for impl, runner in runners.items():
                progress(done, total, f"starting {impl}, {n} ranks")
                runner.start(n)
            for k, (op, size) in enumerate(cases):
                shift = k % len(impls)  # alternate who goes first, so noise hits each alike
                for impl in impls[shift:] + impls[:shift]:
                    if not measures(impl, op):
                        continue
                    progress(done, total, f"{impl} {op} {size} B, {n} ranks")
                    iters = iterations(size, args.iters)
                    times, wrong = runners[impl].run(op, size, iters, args.warmup)
                    records.append(report.record(impl, op, n, size, times, wrong))
                    done += 1
        finally:
            for runner in runners.values():
                runner.stop()
    progress(done, total, "done")
    sys.stderr.write("\n")
    report.add_ratios(records)
    return records, unavailable


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write its table, JSON and plot; return the exit status."""
    args = arguments(sys.argv[1:] if argv is None else argv)
    start = time.monotonic()
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        namespace="collective-bench",
        log_to_driver=False,
    )
    try:
        records, unavailable = run(args)
    finally:
        ray.shutdown()
    print(report.table(records, unavailable))
    import torch

    meta = {
        "command": "python -m benchmarks " + " ".join(sys.argv[1:] if argv is None else argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "machine": platform.platform(),
        "cpus": __import__("os").cpu_count(),
        "seconds": round(time.monotonic() - start, 1),
        "unavailable": unavailable,
    }
    if args.json:
        report.write_json(args.json, records, meta)
    if args.plot:
        report.plot(args.plot, records)
    if args.markdown:
        plot_name = args.plot.name if args.plot else None
        args.markdown.write_text(report.markdown(records, meta, plot_name))
    print(f"\n# {len(records)} points in {meta['seconds']} s")
    return 0 if all(r["wrong"] == 0 for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
