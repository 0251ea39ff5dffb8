"""Benchmark moving many tensors at once: weight sync and gradients, every peer side by side.

Usage: python -m benchmarks.bulk [--quick] [--world-size 4] [--nodes 1,2]
       [--workloads uniform:2000x32K,transformer:1G,gradients:256M]
       [--impls collective,collective_loop,...] [--iters N] [--warmup N] [--rounds N]
       [--json PATH] [--plot PATH] [--markdown PATH] [--address ADDRESS]

A workload is ``uniform:COUNTxSIZE`` (COUNT float32 tensors of SIZE bytes), or
``transformer:TOTAL[:COUNT]`` / ``gradients:TOTAL[:COUNT]`` (a transformer-like state
dict of about TOTAL bytes in about COUNT tensors, 400 by default; broadcast, or
allreduced in float32). Rows: ours bucketed (``broadcast_state_dict`` /
``allreduce_tensors``), our per-tensor loop, ``ray.util.collective`` per tensor, the
object store (put on the source, get and copy into the tensors on each receiver; weights
only) and the plain-copy peer: the same bytes copied through shared memory (one node
only). With two nodes the ranks are split evenly between two nodes of a
``ray.cluster_utils.Cluster`` on this machine.

torch (``bulk_workloads``, ``bulk_peers``) is imported inside the functions that use it:
the plain-copy peer's processes are spawned, and each imports this module again as
its main module, which then costs them no torch.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from benchmarks import plots, processes, workloads
from benchmarks.__main__ import ADDRESS_HELP, init_ray, parse_size
from benchmarks.report import COPY, LOOP, OURS, RAY, STORE

if TYPE_CHECKING:
    from benchmarks import bulk_workloads as bw

DEFAULT_WORKLOADS = "uniform:2000x32K,transformer:1G,gradients:256M"
QUICK_WORKLOADS = "uniform:64x4K,transformer:4M:40,gradients:2M:40"
GOALS = [
    ("uniform", 2000, 1, LOOP, 3.0, "2,000 x 32 KiB, one node: >= 3x our per-tensor loop"),
    ("uniform", 2000, 1, STORE, 5.0, "2,000 x 32 KiB, one node: >= 5x the object store"),
    ("uniform", 2000, 1, RAY, 10.0, "2,000 x 32 KiB, one node: >= 10x ray.util.collective"),
    ("transformer", 0, 1, STORE, 5.0, "~1 GiB in ~400 tensors, one node: >= 5x the object store"),
    ("transformer", 0, 1, RAY, 4.0, "~1 GiB in ~400 tensors, one node: >= 4x ray.util.collective"),
    (
        "transformer",
        0,
        1,
        COPY,
        0.5,
        "~1 GiB in ~400 tensors, one node: >= 1/2 the plain-copy peer's speed",
    ),
    ("uniform", 2000, 2, LOOP, 5.0, "2,000 x 32 KiB, two nodes: >= 5x our per-tensor loop"),
]
"""(workload kind, tensor count (0: any), nodes, baseline, least speedup, claim)."""


def parse_workload(text: str) -> bw.Workload:
    """Return the workload that ``text`` names (see the module docstring)."""
    from benchmarks import bulk_workloads as bw

    kind, _, rest = text.partition(":")
    try:
        if kind == "uniform":
            count, _, each = rest.partition("x")
            return bw.uniform(int(count), parse_size(each))
        if kind in ("transformer", "gradients"):
            total, _, count = rest.partition(":")
            return bw.transformer(parse_size(total), int(count or 400), kind)
    except (ValueError, argparse.ArgumentTypeError):
        pass
    raise argparse.ArgumentTypeError(
        f"workloads must be like uniform:2000x32K or transformer:1G[:400], got {text!r}"
    )


def arguments(argv: list[str]) -> argparse.Namespace:
    """Parse the command line."""
    from benchmarks.bulk_peers import IMPLS

    parser = argparse.ArgumentParser(prog="python -m benchmarks.bulk", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny workloads, 2 ranks, 2 iters")
    parser.add_argument("--world-size", type=int, default=None, help="ranks (default 4)")
    parser.add_argument("--nodes", default="1,2", help="comma-separated node counts: 1, 2")
    parser.add_argument("--workloads", default=None, help=f"default {DEFAULT_WORKLOADS}")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--iters", type=int, default=None, help="timed calls per round")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls per round")
    parser.add_argument("--rounds", type=int, default=None, help="rounds, impls taking turns")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--address", default=None, help=ADDRESS_HELP + "; one node only")
    args = parser.parse_args(argv)
    try:
        text = args.workloads or (QUICK_WORKLOADS if args.quick else DEFAULT_WORKLOADS)
        args.workloads = [parse_workload(w) for w in text.split(",") if w]
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    args.impls = [i for i in args.impls.split(",") if i]
    unknown = sorted(set(args.impls) - set(IMPLS))
    if unknown:
        parser.error(f"unknown impls: {unknown}; known: {list(IMPLS)}")
    args.nodes = [int(n) for n in args.nodes.split(",") if n]
    if not set(args.nodes) <= {1, 2}:
        parser.error(f"nodes must be 1 or 2, got {args.nodes}")
    if args.address is not None and args.nodes != [1]:
        parser.error(f"--address runs on one node: pass --nodes 1, got {args.nodes}")
    args.world_size = args.world_size or (2 if args.quick else 4)
    args.iters = args.iters or (2 if args.quick else 3)
    args.warmup = args.warmup if args.warmup is not None else 1
    args.rounds = args.rounds or (1 if args.quick else 3)
    return args


def impls_for(work: bw.Workload, nodes: int, impls: list[str]) -> list[str]:
    """Return the rows that run ``work`` on ``nodes`` nodes."""
    skip = {STORE} if work.op == "allreduce" else set()
    if nodes > 1:
        skip |= {COPY, STORE}
    return [i for i in impls if i not in skip]


def plain_copies(work: bw.Workload, world_size: int, samples: int) -> tuple[list[float], int]:
    """Time the op's bytes copied through shared memory, in plain processes (see copy_peer)."""
    ranks = processes.ShmCopy()
    ranks.start(world_size)
    try:
        plan = workloads.Plan(samples, 1, batch=1, check=work.op == "broadcast")
        return ranks.run(work.op, work.nbytes, plan)
    finally:
        ranks.stop()


def measure(args: argparse.Namespace, nodes: int, with_ray: bool) -> list[dict[str, Any]]:
    """Run every workload on ``nodes`` nodes; return one record per workload and row."""
    from benchmarks.bulk_peers import Ranks

    n = args.world_size
    place = None if nodes == 1 else [{f"node{r * 2 // n}": 1} for r in range(n)]
    ranks = Ranks(n, with_ray, place)
    records = []
    try:
        for k, work in enumerate(args.workloads):
            rows = impls_for(work, nodes, args.impls)
            times: dict[str, list[float]] = {i: [] for i in rows}
            wrong = dict.fromkeys(rows, 0)
            for r in range(args.rounds):
                shift = (k + r) % len(rows)
                for impl in rows[shift:] + rows[:shift]:
                    sys.stderr.write(f"\r{work.label}, {nodes} node(s): {impl}, round {r + 1}   ")
                    if impl == COPY:
                        got, bad = plain_copies(work, n, args.iters)
                    else:
                        got, bad = ranks.run(impl, work, args.iters, args.warmup)
                    times[impl] += got
                    wrong[impl] = max(wrong[impl], bad)
            for impl in rows:
                records.append(record(work, nodes, n, impl, times[impl], wrong[impl]))
            sys.stderr.write("\n")
    finally:
        ranks.stop()
    add_speedups(records)
    for done in records:
        done["transport"] = ranks.transports[0]
    return records


def record(
    work: bw.Workload, nodes: int, n: int, impl: str, times: list[float], wrong: int
) -> dict[str, Any]:
    """Summarise one row's samples."""
    median = statistics.median(times)
    return {
        "workload": work.kind,
        "label": work.label,
        "op": work.op,
        "tensors": len(work.tensors),
        "bytes": work.nbytes,
        "nodes": nodes,
        "world_size": n,
        "impl": impl,
        "samples": len(times),
        "time_ms": {"median": median * 1e3, "min": min(times) * 1e3, "max": max(times) * 1e3},
        "gbs": work.nbytes / median / 1e9,
        "wrong": wrong,
    }


def add_speedups(records: list[dict[str, Any]]) -> None:
    """Set each record's ``speedup_of_ours``: its median time over ours at the same point."""
    ours = {(r["label"], r["nodes"]): r["time_ms"]["median"] for r in records if r["impl"] == OURS}
    for r in records:
        mine = ours.get((r["label"], r["nodes"]))
        r["speedup_of_ours"] = r["time_ms"]["median"] / mine if mine else None


def evaluate(records: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Return each goal's claim, measured value and verdict on this run."""
    out = []
    for kind, count, nodes, base, least, claim in GOALS:
        found = [
            r
            for r in records
            if (r["workload"], r["nodes"], r["impl"]) == (kind, nodes, base)
            and (count == 0 or r["tensors"] == count)
            and r["world_size"] == 4
        ]
        if not found or found[0]["speedup_of_ours"] is None:
            out.append({"claim": claim, "measured": "not in this run", "verdict": "not measured"})
            continue
        value = found[0]["speedup_of_ours"]
        shown = f"{value:.2f}x" if base != COPY else f"{value:.2f} of its speed"
        verdict = "pass" if value >= least else "fail"
        out.append({"claim": claim, "measured": shown, "verdict": verdict})
    return out


def table(records: list[dict[str, Any]]) -> str:
    """Return the results as text: a block per workload and node count."""
    lines = []
    for label, nodes in dict.fromkeys((r["label"], r["nodes"]) for r in records):
        rows = [r for r in records if (r["label"], r["nodes"]) == (label, nodes)]
        lines += ["", f"# {label}, {rows[0]['world_size']} ranks on {nodes} node(s)"]
        lines.append(
            f"{'impl':>16} {'median(ms)':>11} {'min':>9} {'max':>9} {'GB/s':>7} "
            f"{'x ours':>7} {'#wrong':>6}"
        )
        for r in rows:
            t, x = r["time_ms"], r["speedup_of_ours"]
            lines.append(
                f"{r['impl']:>16} {t['median']:>11.1f} {t['min']:>9.1f} {t['max']:>9.1f} "
                f"{r['gbs']:>7.3f} {(f'{x:.2f}' if x else '-'):>7} {r['wrong']:>6}"
            )
    return "\n".join(lines).lstrip("\n")


def goals_text(
    goals: list[dict[str, str]],
    heading: str = "# goals (x: the baseline's median time over ours; plain-copy peer: its "
    "time over ours)",
) -> str:
    """Return the goals as lines under ``heading``: verdict, claim, measured value."""
    lines = [heading]
    lines += [f"{g['verdict'].upper():>12}  {g['claim']}: {g['measured']}" for g in goals]
    return "\n".join(lines)


def start_ray(nodes: int, address: str | None = None) -> Any:
    """Start a private Ray cluster of ``nodes`` nodes on this machine; return it, or None.

    With ``address`` (one node only), join the cluster that runs there instead.
    """
    if nodes == 1:
        init_ray(address, log_to_driver=False)
        return None
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        connect=True,
        head_node_args={"num_cpus": 2, "resources": {"node0": 100}, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=2, resources={"node1": 100})
    cluster.wait_for_nodes()
    return cluster


def on_cluster(
    nodes: int, run: Callable[[int], list[dict[str, Any]]], address: str | None = None
) -> list[dict[str, Any]]:
    """Call ``run(nodes)`` on a private cluster of ``nodes`` nodes; stop the cluster after.

    With ``address`` (one node only), on the cluster that runs there, which is left running.
    """
    cluster = start_ray(nodes, address)
    try:
        return run(nodes)
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


def machine(program: str, argv: list[str], started: float) -> dict[str, Any]:
    """Return the run's command, machine, Ray version, load and seconds since ``started``."""
    return {
        "command": " ".join([program, *argv]),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "ray": ray.__version__,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "seconds": round(time.monotonic() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table and goals, write JSON, plot and page; return status."""
    args = arguments(sys.argv[1:] if argv is None else argv)
    from benchmarks.peers import ray_collective_available

    started, records = time.monotonic(), []
    missing = ray_collective_available()
    with_ray = RAY in args.impls and not missing
    if RAY in args.impls and missing:
        args.impls.remove(RAY)
    for nodes in args.nodes:
        records += on_cluster(nodes, partial(measure, args, with_ray=with_ray), args.address)
    goals = evaluate(records)
    text = table(records) + "\n\n" + goals_text(goals)
    print(text)
    meta = machine("python -m benchmarks.bulk", sys.argv[1:] if argv is None else argv, started)
    meta["unavailable"] = {RAY: missing} if missing else {}
    if args.json:
        data = {"meta": meta, "results": records, "goals": goals}
        args.json.write_text(json.dumps(data, indent=2) + "\n")
    if args.plot:
        plots.bulk(args.plot, records)
    if args.markdown:
        args.markdown.write_text(page(meta, text, args.plot))
    return 0 if all(r["wrong"] == 0 for r in records) else 1


def page(meta: dict[str, Any], text: str, plot_path: Path | None) -> str:
    """Return the results page: machine and command, plot, table and goals."""
    lines = [
        "## Machine and command",
        "",
        f"- {meta['machine']}, {meta['cpus']} CPUs, Ray {meta['ray']}; load average at the "
        f"end {meta['load_average']}.",
        f"- `{meta['command']}` ({meta['seconds']} s).",
        "",
    ]
    if plot_path is not None:
        lines += [f"![median time per call]({plot_path.name})", ""]
    return "\n".join([*lines, "```text", text, "```", ""])


if __name__ == "__main__":
    sys.exit(main())
