"""Benchmark recovering a group after a member dies, and growing it back, side by side.

Usage: python -m benchmarks.elastic [--quick] [--nodes 1,2] [--rounds N]
       [--json PATH] [--markdown PATH] [--address ADDRESS]

Four ranks of a gloo group in Ray actors (shared memory on one node; with two nodes,
two ranks on each node of a ``ray.cluster_utils.Cluster`` on this machine) allreduce
in a loop, and the driver kills rank 2. The survivors recover with ``shrink_group``, or
with ``destroy_collective_group`` and a fresh ``init_collective_group`` of three; rows
give the seconds from each survivor's error to its first successful allreduce (the
worst survivor's) and from the kill to the last survivor's. Then the group gets back to
four ranks with a warm spare actor: by ``grow_group`` (the spare calls init), or by a
fresh init of all four after a destroy; the rows give the seconds from the start, the
same wall-clock instant on every rank, to the last rank's first allreduce. Each round
runs every row once, their order turning from round to round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.__main__ import ADDRESS_HELP
from benchmarks.bulk import goals_text, machine, on_cluster, page
from benchmarks.elastic_ranks import FRESH, GROW, REINIT, SHRINK, Round

SHRINK_BOUND_S = 0.5
"""Goal: the survivors' first op after a shrink within this many seconds of their error."""
RECOVERIES = {SHRINK: "shrink_group", REINIT: "destroy + init (3)"}
REJOINS = {GROW: "grow_group (3 -> 4)", FRESH: "destroy + init (4)"}
ROWS = [*RECOVERIES.values(), *REJOINS.values()]
"""The rows of each setting, in the table's order."""


def arguments(argv: list[str]) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.elastic", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one round, a short loop")
    parser.add_argument("--nodes", default="1,2", help="comma-separated node counts: 1, 2")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 5)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--address", default=None, help=ADDRESS_HELP + "; one node only")
    args = parser.parse_args(argv)
    try:
        args.nodes = [int(n) for n in args.nodes.split(",") if n]
    except ValueError:
        args.nodes = []
    if not args.nodes or not set(args.nodes) <= {1, 2}:
        parser.error(f"nodes must be 1 or 2, got {args.nodes}")
    if args.address is not None and args.nodes != [1]:
        parser.error(f"--address runs on one node: pass --nodes 1, got {args.nodes}")
    args.rounds = args.rounds or (1 if args.quick else 5)
    if args.rounds < 1:
        parser.error(f"rounds must be at least 1, got {args.rounds}")
    args.least_ops = 20 if args.quick else 200
    return args


def one_round(nodes: int, k: int, least_ops: int) -> tuple[dict[str, tuple[float, ...]], Round]:
    """Run every row once on fresh actors; return its samples (wrong count last) and the round."""
    done: dict[str, tuple[float, ...]] = {}
    recoveries = [SHRINK, REINIT] if k % 2 == 0 else [REINIT, SHRINK]
    rejoins = [GROW, FRESH] if k // 2 % 2 == 0 else [FRESH, GROW]
    trial = Round(nodes)
    try:
        for recovery, rejoin in zip(recoveries, rejoins, strict=True):
            sys.stderr.write(f"\r{nodes} node(s), round {k + 1}: {RECOVERIES[recovery]}   ")
            done[RECOVERIES[recovery]] = trial.kill_and_recover(recovery, least_ops)
            sys.stderr.write(f"\r{nodes} node(s), round {k + 1}: {REJOINS[rejoin]}   ")
            done[REJOINS[rejoin]] = trial.rejoin(rejoin)
    finally:
        trial.stop()
    return done, trial


def summary(samples: list[float]) -> dict[str, float]:
    """Return the median, least and most of ``samples``."""
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def measure(args: argparse.Namespace, nodes: int) -> list[dict[str, Any]]:
    """Run every round on ``nodes`` nodes; return one record per row."""
    samples: dict[str, list[tuple[float, ...]]] = {row: [] for row in ROWS}
    transport, at_init, placed = "", 0, nodes
    for k in range(args.rounds):
        done, trial = one_round(nodes, k, args.least_ops)
        for row, seconds in done.items():
            samples[row].append(seconds)
        transport, at_init, placed = trial.transport, at_init + trial.wrong, trial.nodes
    sys.stderr.write("\n")
    if placed != nodes:
        raise RuntimeError(f"the ranks landed on {placed} node(s), not {nodes}")
    records = []
    for row in ROWS:
        record: dict[str, Any] = {"row": row, "nodes": nodes, "world_size": 4}
        record |= {"transport": transport, "rounds": args.rounds, "wrong_at_init": at_init}
        record["wrong"] = sum(int(s[-1]) for s in samples[row])
        if row in RECOVERIES.values():
            record["from_error_s"] = summary([s[0] for s in samples[row]])
            record["from_kill_s"] = summary([s[1] for s in samples[row]])
        else:
            record["to_first_op_s"] = summary([s[0] for s in samples[row]])
        records.append(record)
    return records


def _find(records: list[dict[str, Any]], nodes: int, row: str) -> dict[str, Any]:
    return next(r for r in records if (r["nodes"], r["row"]) == (nodes, row))


def evaluate(records: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Return each goal's claim, measured value and verdict, per node count measured."""
    goals = []
    for nodes in dict.fromkeys(r["nodes"] for r in records):
        shrink = _find(records, nodes, RECOVERIES[SHRINK])
        reinit = _find(records, nodes, RECOVERIES[REINIT])
        error = shrink["from_error_s"]["median"]
        goals.append(
            {
                "claim": f"{nodes} node(s): shrink_group, survivors' error to first op "
                f"<= {SHRINK_BOUND_S} s (median of the worst survivor)",
                "measured": f"{error:.3f} s",
                "verdict": "pass" if error <= SHRINK_BOUND_S else "fail",
            }
        )
        ours, theirs = shrink["from_kill_s"]["median"], reinit["from_kill_s"]["median"]
        goals.append(
            {
                "claim": f"{nodes} node(s): shrink_group faster than destroy + init "
                "(kill to first op, medians)",
                "measured": f"{ours:.3f} s against {theirs:.3f} s ({theirs / ours:.1f}x)",
                "verdict": "pass" if ours < theirs else "fail",
            }
        )
    return goals


def _cell(value: dict[str, float] | None) -> str:
    if value is None:
        return "-"
    return f"{value['median']:.3f} [{value['min']:.3f}, {value['max']:.3f}]"


def table(records: list[dict[str, Any]]) -> str:
    """Return the results as text: a block per node count, seconds as median [min, max]."""
    lines = []
    for nodes in dict.fromkeys(r["nodes"] for r in records):
        rows = [r for r in records if r["nodes"] == nodes]
        first = rows[0]
        lines += [
            "",
            f"# 4 ranks on {nodes} node(s), transport {first['transport']}, rank 2 killed, "
            f"{first['rounds']} round(s): seconds, median [min, max]",
            f"{'row':>20} {'error -> first op':>24} {'kill -> first op':>24} "
            f"{'start -> first op':>24} {'#wrong':>6}",
        ]
        for r in rows:
            cells = [_cell(r.get(k)) for k in ("from_error_s", "from_kill_s", "to_first_op_s")]
            lines.append(
                f"{r['row']:>20} {cells[0]:>24} {cells[1]:>24} {cells[2]:>24} {r['wrong']:>6}"
            )
    return "\n".join(lines).lstrip("\n")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table and goals, write JSON and page; return status."""
    given = sys.argv[1:] if argv is None else argv
    args = arguments(given)
    started, records = time.monotonic(), []
    for nodes in args.nodes:
        records += on_cluster(nodes, partial(measure, args), args.address)
    goals = evaluate(records)
    text = table(records) + "\n\n" + goals_text(goals, "# goals")
    print(text)
    meta = machine("python -m benchmarks.elastic", given, started)
    if args.json:
        data = {"meta": meta, "results": records, "goals": goals}
        args.json.write_text(json.dumps(data, indent=2) + "\n")
    if args.markdown:
        args.markdown.write_text(page(meta, text, None))
    return 0 if all(r["wrong"] == r["wrong_at_init"] == 0 for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
