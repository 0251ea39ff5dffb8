"""Turn a GPU run's measurement of NCCL's multi-rank mode into the package's routes table.

Usage: python -m benchmarks.multirank_routes --from $OUT/bench.json
       [--to collective/groups/gpu/multirank_routes.json]

``python -m benchmarks.nccl --shared-gpu`` times allreduce and broadcast on the
shared-GPU transport and on NCCL's multi-rank mode at the same sizes, 2 ranks on one
GPU (``benchmarks.multirank``). This command reads those rows and writes, per op, the
byte ranges where NCCL's mode was faster, with the GPU, the NCCL version and the world
size they were measured on: the table a group of two ranks on one GPU routes its ops
by (``collective.groups.gpu.routes``). Between two measured sizes the boundary is
their geometric mean: every size takes the transport that won at the nearest
measured size on a log scale, the smallest and largest extending to 0 and to no end.
A tie goes to the shared-GPU transport, which needs no NCCL communicator. A run that
did not measure the mode (NCCL older than 2.30, or a failure) writes nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from collective.groups.gpu import routes


def boundary(below: int, above: int) -> int:
    """Return the first size nearer ``above`` than ``below`` on a log scale: ceil(sqrt(ab))."""
    product = below * above
    root = math.isqrt(product)
    return root if root * root == product else root + 1


def ranges(won: list[tuple[int, bool]]) -> list[list[int | None]]:
    """Return ``[from, to]`` ranges (to None: no end) where NCCL won, from (size, won) pairs."""
    won = sorted(won)
    found: list[list[int | None]] = []
    for i, (size, nccl) in enumerate(won):
        if not nccl:
            continue
        starts = i == 0 or not won[i - 1][1]
        if starts:
            found.append([0 if i == 0 else boundary(won[i - 1][0], size), None])
        if i + 1 < len(won) and not won[i + 1][1]:
            found[-1][1] = boundary(size, won[i + 1][0])
    return found


def measurement(body: dict[str, Any]) -> dict[str, Any]:
    """Return the multi-rank measurement of a results file (``bench.json``).

    Raises:
        ValueError: the file holds no measurement of the mode, and why.

    """
    run = body.get("shared_gpu", body)
    found = run.get("multirank")
    if not isinstance(found, dict):
        raise ValueError("the results hold no measurement of NCCL's multi-rank mode")
    if found.get("why"):
        raise ValueError(f"NCCL's multi-rank mode was not measured: {found['why']}")
    if found.get("failed"):
        raise ValueError(f"NCCL's multi-rank mode failed: {found['failed']}")
    if not found.get("rows"):
        raise ValueError("NCCL's multi-rank mode was measured at no size")
    return dict(found, gpu=run.get("versions", {}).get("gpu", "unknown"))


def derive(body: dict[str, Any]) -> dict[str, Any]:
    """Return the routes table of the multi-rank measurement in ``body``; see the module doc.

    Raises:
        ValueError: ``body`` holds no measurement of the mode.

    """
    found = measurement(body)
    by_op: dict[str, list[tuple[int, bool]]] = {}
    for row in found["rows"]:
        if row["op"] in routes.ROUTED_OPS:
            won = row["multirank_us"] < row["shared_us"]
            by_op.setdefault(row["op"], []).append((int(row["size"]), won))
    table = {op: ranges(won) for op, won in sorted(by_op.items())}
    measured_on = {
        "gpu": found["gpu"],
        "nccl": found["nccl"],
        "world_size": found.get("world_size", routes.MULTIRANK_RANKS),
        "sizes": sorted({size for won in by_op.values() for size, _ in won}),
        "command": "python -m benchmarks.nccl --shared-gpu",
    }
    return {"measured_on": measured_on, "routes": {op: r for op, r in table.items() if r}}


def main(argv: list[str] | None = None) -> int:
    """Write the routes table of a results file; return the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.multirank_routes", description=__doc__
    )
    parser.add_argument("--from", dest="source", type=Path, required=True, help="bench.json")
    parser.add_argument("--to", type=Path, default=routes.TABLE)
    args = parser.parse_args(argv)
    try:
        table = derive(json.loads(args.source.read_text(encoding="utf-8")))
    except ValueError as exc:
        print(f"{args.source}: {exc}; {args.to} is left as it is", file=sys.stderr)
        return 1
    routes.Routes.from_json(table, str(args.to))  # what the groups will read must load
    args.to.write_text(json.dumps(table, indent=2) + "\n", encoding="utf-8")
    summary = ", ".join(f"{op} {r}" for op, r in table["routes"].items()) or "no op"
    print(f"wrote {args.to}: NCCL's multi-rank mode runs {summary}; commit it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
