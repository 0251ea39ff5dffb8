"""A crowded node: more ranks than cores, ours beside ``ray.util.collective``, in rounds.

Usage: python -m benchmarks.crowded [--world-sizes 2,4,8,16] [--sizes 8,4K,64K]
       [--rounds 5] [--ops 100] [--warmup 10] [--baseline NAME=PATH ...] [--json PATH]
       [--address ADDRESS]

Every rank is a Ray actor that asks for no CPU (``num_cpus=0``), all on this node: on a
machine of 2 cores, 16 ranks share 2 cores. For each world size the ranks of every
implementation start once; each round then runs, for each implementation in turn (who
goes first rotates from round to round), ``--ops`` single blocking allreduces of each
size back to back, each timed on every rank; an op counts its slowest rank. A round's
figure is its median op; a row gives the median of the rounds' figures and their range,
and the 1-minute load average as its world size began and ended. The last round checks
every rank's result.

Where the time goes: each row also gives, read by each rank from its own
``/proc/self/task/*/schedstat`` around its run, the CPU time per op and rank (every thread
of the rank's process) and the turns per op and rank (the times the scheduler put the
thread that runs the ops on a core), over a round's timed and warm-up ops: the median
rank's, median of the rounds.

The world sizes run one after another, so a ratio between two of them (the growth goal)
compares points measured minutes apart: on a machine shared with other work, read it
beside the load averages of both, and beside a baseline's same ratio in the same run.

``--baseline NAME=PATH`` adds an implementation: ours as imported from the ``collective``
package in the folder PATH (a checkout of main, say), run the same way in the same
rounds, so that a change is measured side by side with the code before it. It may be
given more than once; the goals compare with the first.

At the end it checks issue 49's goals (``goals``) on the 8-byte rows and says pass, fail,
or not measured; ``--json`` adds the run (its rows, goals, command, commit, machine and
load average before and after) to the runs the file holds, a list kept in order.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from benchmarks import peers, workloads
from benchmarks.__main__ import ADDRESS_HELP, init_ray, parse_size
from benchmarks.report import OURS, RAY

OP = "allreduce"
SPEEDUP = 5.0
"""Ours at 16 ranks is at least this many times faster than ``ray.util.collective``."""
GROWTH = 2.5
"""Ours at 16 ranks takes at most this many times its 8-rank time."""
SAME = 1.10
"""At 2 ranks, ours takes at most this many times the baseline's time (the rounds' noise)."""


@dataclass(frozen=True)
class Goal:
    """One of issue 49's goals, as this run measured it."""

    claim: str
    measured: str
    verdict: str


def arguments(argv: list[str]) -> argparse.Namespace:
    """Parse the command line; a bad value exits with a message, before anything starts."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.crowded", description=__doc__)
    parser.add_argument("--world-sizes", default="2,4,8,16")
    parser.add_argument("--sizes", default="8,4K,64K")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ops", type=int, default=100, help="timed ops per point and round")
    parser.add_argument("--warmup", type=int, default=10, help="untimed ops first, each round")
    parser.add_argument(
        "--baseline", action="append", default=[], help="NAME=PATH: ours from PATH, too"
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--address", default=None, help=ADDRESS_HELP)
    args = parser.parse_args(argv)
    try:
        args.world_sizes = [int(n) for n in args.world_sizes.split(",")]
        args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    except (ValueError, argparse.ArgumentTypeError) as exc:
        parser.error(str(exc))
    if min(args.world_sizes) < 2:
        parser.error(f"--world-sizes must be at least 2, got {args.world_sizes}")
    for name in ("rounds", "ops"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {args.warmup}")
    args.sources = {}
    for given in args.baseline:
        name, _, path = given.partition("=")
        taken = (OURS, RAY, *args.sources)
        if not name or name in taken or not (Path(path) / "collective").is_dir():
            parser.error(
                f"--baseline must be NAME=PATH, NAME not one of {list(taken)}, and PATH a "
                f"folder holding a collective package; got {given!r}"
            )
        args.sources[name] = str(Path(path).resolve())
    args.baseline = next(iter(args.sources), None)
    return args


def _scheduled() -> tuple[int, int] | None:
    """Return this process's CPU time (ns, every thread) and this thread's turns, from /proc.

    A turn is a time the scheduler put the thread on a core. None where /proc cannot be
    read (not Linux).
    """
    cpu = 0
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/schedstat") as stat:
                cpu += int(stat.read().split()[0])
        with open("/proc/thread-self/schedstat") as stat:
            turns = int(stat.read().split()[2])
    except (OSError, ValueError, IndexError):
        return None
    return cpu, turns


class _Rank(peers._CollectiveRank):
    """A rank that also says what its run cost: CPU us and turns per op (see ``_scheduled``)."""

    def run_costed(self, op: str, size: int, plan: Any) -> tuple[list[float], int, Any]:
        before = _scheduled()
        times, wrong = self.run(op, size, plan)
        after = _scheduled()
        if before is None or after is None:
            return times, wrong, None
        ops = plan.iters + plan.warmup
        return times, wrong, ((after[0] - before[0]) / 1e3 / ops, (after[1] - before[1]) / ops)


_Costed: Any = ray.remote(num_cpus=0)(_Rank)  # Any: Ray's handles are untyped


class Runner(peers.RayActors):
    """``peers.RayActors`` whose runs also say their CPU time and turns per op and rank."""

    actor = _Costed

    def run(self, op: str, size: int, plan: workloads.Plan) -> Any:
        """Return the per-op times (slowest rank's), wrong elements, and costs per op.

        The costs are the median rank's CPU us and turns per op; None where unread.
        """
        refs = [a.run_costed.remote(op, size, plan) for a in self.ranks]
        results = ray.get(refs, timeout=peers.RAY_TIMEOUT_S)
        costs = [c for _, _, c in results if c is not None]
        spent = None
        if len(costs) == len(results):
            spent = (statistics.median(c for c, _ in costs), statistics.median(t for _, t in costs))
        return peers.slowest([t for t, _, _ in results]), sum(w for _, w, _ in results), spent


def runners(args: argparse.Namespace) -> dict[str, Runner]:
    """Return a fresh runner per implementation: ours, ``ray.util.collective``, the baselines."""
    found = {OURS: Runner("collective", "auto"), RAY: Runner("ray")}
    for name, source in args.sources.items():
        found[name] = Runner("collective", "auto", source)
    return found


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run every world size's rounds; return one row per (implementation, world size, size)."""
    rows = []
    for n in args.world_sizes:
        load = round(os.getloadavg()[0], 2)
        started = runners(args)
        try:
            for impl, runner in started.items():
                _say(f"starting {impl}, {n} ranks")
                runner.start(n)
            figures: dict[tuple[str, int], list[float]] = {}
            costs: dict[tuple[str, int], list[tuple[float, float]]] = {}
            wrong: dict[tuple[str, int], int] = {}
            for r in range(args.rounds):
                check = r == args.rounds - 1
                order = list(started)
                shift = r % len(order)
                for impl in order[shift:] + order[:shift]:
                    for size in args.sizes:
                        _say(f"{impl}, {n} ranks, {size} B, round {r + 1}/{args.rounds}")
                        plan = workloads.Plan(args.ops, args.warmup, 1, barrier=False, check=check)
                        times, bad, spent = started[impl].run(OP, size, plan)
                        if spent is not None:
                            costs.setdefault((impl, size), []).append(spent)
                        figures.setdefault((impl, size), []).append(statistics.median(times))
                        wrong[(impl, size)] = wrong.get((impl, size), 0) + bad
            loads = [load, round(os.getloadavg()[0], 2)]
            rows += [
                {
                    **row(impl, n, size, f, wrong[(impl, size)]),
                    **_cost_fields(costs.get((impl, size), [])),
                    "load_average": loads,
                }
                for (impl, size), f in figures.items()
            ]
        finally:
            for runner in started.values():
                runner.stop()
    return rows


def _cost_fields(costs: list[tuple[float, float]]) -> dict[str, float | None]:
    """Return a row's median CPU us and turns per op and rank over its rounds (None: unread)."""
    if not costs:
        return {"cpu_us_per_rank_op": None, "turns_per_rank_op": None}
    return {
        "cpu_us_per_rank_op": round(statistics.median(c for c, _ in costs), 1),
        "turns_per_rank_op": round(statistics.median(t for _, t in costs), 2),
    }


def row(impl: str, world_size: int, size: int, rounds: list[float], wrong: int) -> dict[str, Any]:
    """Return the row of one point: its rounds' median ops (seconds) summarised in us."""
    us = [t * 1e6 for t in rounds]
    return {
        "impl": impl,
        "world_size": world_size,
        "size": size,
        "median_us": statistics.median(us),
        "min_us": min(us),
        "max_us": max(us),
        "rounds_us": [round(t, 1) for t in us],
        "wrong": wrong,
    }


def _median(rows: list[dict[str, Any]], impl: str, world_size: int, size: int) -> float | None:
    for r in rows:
        if (r["impl"], r["world_size"], r["size"]) == (impl, world_size, size):
            return float(r["median_us"])
    return None


def _verdict(ok: bool) -> str:
    return "pass" if ok else "fail"


def goals(rows: list[dict[str, Any]], baseline: str | None) -> list[Goal]:
    """Return issue 49's goals on the 8-byte rows: speed-up over Ray, growth, no loss at 2."""
    ours16, ray16 = _median(rows, OURS, 16, 8), _median(rows, RAY, 16, 8)
    ours8 = _median(rows, OURS, 8, 8)
    claim = f"16 ranks, 8 B: ours >= {SPEEDUP:g}x faster than {RAY}"
    found = [Goal(claim, "not in this run", "not measured")]
    if ours16 and ray16:
        speedup = ray16 / ours16
        text = f"{speedup:.1f}x ({ours16:.0f} us against {ray16:.0f} us)"
        found = [Goal(claim, text, _verdict(speedup >= SPEEDUP))]
    claim = f"16 ranks, 8 B: ours takes <= {GROWTH:g}x its 8-rank time"
    if ours16 and ours8:
        growth = ours16 / ours8
        text = f"{growth:.2f}x ({ours16:.0f} us against {ours8:.0f} us)"
        then16, then8 = (_median(rows, baseline, n, 8) if baseline else None for n in (16, 8))
        if then16 and then8:
            text += f"; {baseline} in the same run: {then16 / then8:.2f}x"
        found.append(Goal(claim, text, _verdict(growth <= GROWTH)))
    else:
        found.append(Goal(claim, "not in this run", "not measured"))
    claim = f"2 ranks, 8 B: ours takes <= {SAME:g}x the baseline's time"
    before = _median(rows, baseline, 2, 8) if baseline else None
    ours2 = _median(rows, OURS, 2, 8)
    if before and ours2:
        text = f"{ours2 / before:.2f}x ({ours2:.1f} us against {baseline} {before:.1f} us)"
        found.append(Goal(claim, text, _verdict(ours2 <= SAME * before)))
    else:
        found.append(Goal(claim, "not in this run (no --baseline)", "not measured"))
    return found


def table(rows: list[dict[str, Any]]) -> str:
    """Return the rows as text, by world size and size, with each one's ratio to Ray's."""
    lines = [
        f"# {OP}, single blocking ops back to back; median of the rounds' median op, and "
        "the range of the rounds",
        f"{'ranks':>5} {'size(B)':>8} {'impl':>15} {'median(us)':>11} {'range(us)':>19} "
        f"{'x faster than ray':>18} {'#wrong':>6}",
    ]
    for r in sorted(rows, key=lambda r: (r["world_size"], r["size"], r["impl"] != OURS)):
        theirs = _median(rows, RAY, r["world_size"], r["size"])
        ratio = f"{theirs / r['median_us']:.1f}" if theirs and r["impl"] != RAY else "-"
        span = f"{r['min_us']:.0f}-{r['max_us']:.0f}"
        lines.append(
            f"{r['world_size']:>5} {r['size']:>8} {r['impl']:>15} {r['median_us']:>11.1f} "
            f"{span:>19} {ratio:>18} {r['wrong']:>6}"
        )
    return "\n".join(lines)


def _commit() -> str | None:
    """Return the commit of the checkout ``collective`` is imported from, or None."""
    import collective

    folder = Path(collective.__file__).parent
    try:
        done = subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True
        )
    except OSError:
        return None
    return done.stdout.strip() or None


def _say(what: str) -> None:
    sys.stderr.write(f"\r{what:<60}")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print its table and goals, write ``--json``; 1 if any result was wrong."""
    argv = sys.argv[1:] if argv is None else argv
    args = arguments(argv)
    start, load = time.monotonic(), [round(x, 2) for x in os.getloadavg()]
    why = peers.ray_collective_available()
    if why:
        raise SystemExit(f"{RAY} is needed beside ours: {why}")
    init_ray(args.address, namespace="collective-crowded", log_to_driver=False)
    try:
        rows = measure(args)
    finally:
        ray.shutdown()
    sys.stderr.write("\n")
    found = goals(rows, args.baseline)
    print(table(rows))
    print("\n# goals (issue 49)")
    print("\n".join(f"{g.verdict.upper():>12}  {g.claim}: {g.measured}" for g in found))
    meta = {
        "command": "python -m benchmarks.crowded " + " ".join(argv),
        "commit": _commit(),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "ray": ray.__version__,
        "load_average_before": load,
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "seconds": round(time.monotonic() - start, 1),
        "baselines": args.sources,
    }
    if args.json:
        data = {"meta": meta, "rows": rows, "goals": [g.__dict__ for g in found]}
        runs = json.loads(args.json.read_text()) if args.json.exists() else []
        args.json.write_text(json.dumps([*runs, data], indent=1) + "\n")
    print(f"\n# {len(rows)} rows in {meta['seconds']} s")
    return 0 if all(r["wrong"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
