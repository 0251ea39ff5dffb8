"""Statistics, the nccl-tests-style table, JSON and the bus-bandwidth plot."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks import workloads

OURS = "collective"
COLORS = {
    "collective": "tab:blue",
    "torch_gloo": "tab:red",
    "ray_collective": "tab:green",
    "object_store": "tab:orange",
}
"""One color per implementation, the same in every panel."""


def record(
    impl: str, op: str, world_size: int, size: int, times: list[float], wrong: int
) -> dict[str, Any]:
    """Summarise one implementation's run of ``op`` at ``size`` bytes."""
    median = statistics.median(times)
    algbw = size / median / 1e9
    return {
        "impl": impl,
        "op": op,
        "world_size": world_size,
        "size": size,
        "count": workloads.count(op, size, world_size),
        "dtype": "float32",
        "iters": len(times),
        "time_us": {"median": median * 1e6, "min": min(times) * 1e6, "max": max(times) * 1e6},
        "algbw_gbs": algbw,
        "busbw_gbs": algbw * workloads.BUS_FACTOR[op](world_size),
        "wrong": wrong,
    }


def add_ratios(records: list[dict[str, Any]]) -> None:
    """Set each record's ``ratio_to_ours``: its median time over ours at the same point."""
    ours = {
        (r["op"], r["world_size"], r["size"]): r["time_us"]["median"]
        for r in records
        if r["impl"] == OURS
    }
    for r in records:
        base = ours.get((r["op"], r["world_size"], r["size"]))
        r["ratio_to_ours"] = r["time_us"]["median"] / base if base else None


def table(records: list[dict[str, Any]], unavailable: dict[str, str]) -> str:
    """Return the results as nccl-tests-style text, one block per op and world size."""
    lines = []
    blocks = sorted({(r["op"], r["world_size"]) for r in records})
    header = (
        f"{'size(B)':>11} {'count':>10} {'type':>7} {'impl':>16} {'time(us)':>11} "
        f"{'min':>10} {'max':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6} {'vs ours':>7}"
    )
    for op, world_size in blocks:
        lines += ["", f"# {op}, world size {world_size}", header]
        rows = [r for r in records if (r["op"], r["world_size"]) == (op, world_size)]
        for r in sorted(rows, key=lambda r: (r["size"], r["impl"] != OURS, r["impl"])):
            t = r["time_us"]
            ratio = f"{r['ratio_to_ours']:.2f}x" if r["ratio_to_ours"] else "-"
            lines.append(
                f"{r['size']:>11} {r['count']:>10} {r['dtype']:>7} {r['impl']:>16} "
                f"{t['median']:>11.1f} {t['min']:>10.1f} {t['max']:>10.1f} "
                f"{r['algbw_gbs']:>7.3f} {r['busbw_gbs']:>7.3f} {r['wrong']:>6} {ratio:>7}"
            )
    for impl, why in sorted(unavailable.items()):
        lines.append(f"# {impl}: {why}")
    return "\n".join(lines).lstrip("\n")


def write_json(path: Path, records: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """Write the records and the run's description to ``path``."""
    path.write_text(json.dumps({"meta": meta, "results": records}, indent=2) + "\n")


def plot(path: Path, records: list[dict[str, Any]]) -> None:
    """Draw busbw against size, one line per implementation, one panel per op and world size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [op for op in workloads.OPS if any(r["op"] == op for r in records)]
    sizes = sorted({r["world_size"] for r in records})
    fig, axes = plt.subplots(
        len(sizes), len(ops), figsize=(4 * len(ops), 3.2 * len(sizes)), squeeze=False
    )
    for i, world_size in enumerate(sizes):
        for j, op in enumerate(ops):
            ax = axes[i][j]
            rows = [r for r in records if (r["op"], r["world_size"]) == (op, world_size)]
            for impl in sorted({r["impl"] for r in rows}):
                points = sorted((r["size"], r["busbw_gbs"]) for r in rows if r["impl"] == impl)
                color = COLORS.get(impl)
                ax.plot(*zip(*points, strict=True), marker="o", label=impl, color=color)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{op}, {world_size} ranks")
            ax.set_xlabel("size (bytes)")
            ax.set_ylabel("busbw (GB/s)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def markdown(records: list[dict[str, Any]], meta: dict[str, Any], plot_name: str | None) -> str:
    """Return a results page: the machine, the command, headline ratios, the plot, the table."""
    lines = [
        "## Machine and command",
        "",
        f"- Machine: {meta['machine']}, {meta['cpus']} CPUs; Python {meta['python']}, "
        f"torch {meta['torch']}, Ray {meta['ray']}.",
        f"- Command: `{meta['command']}` ({meta['seconds']} s).",
        "- Time is the median over the timed iterations of the slowest rank's time, with the",
        "  min and max beside it; algbw = size / time; busbw = algbw x nccl-tests' factor.",
        "  `vs ours` is a peer's median time over ours: above 1 means ours is faster.",
    ]
    lines += [f"- {impl}: {why}" for impl, why in sorted(meta["unavailable"].items())]
    lines += ["", "## Median time of each peer relative to ours", ""]
    lines += ["| op | ranks | size | " + " | ".join(_peers(records)) + " |"]
    lines += ["|---|---|---|" + "---|" * len(_peers(records))]
    for r in sorted(
        (r for r in records if r["impl"] == OURS),
        key=lambda r: (r["op"], r["world_size"], r["size"]),
    ):
        cells = [_ratio(records, r, impl) for impl in _peers(records)]
        lines.append(
            f"| {r['op']} | {r['world_size']} | {_human(r['size'])} | " + " | ".join(cells) + " |"
        )
    if plot_name:
        lines += ["", "## Bus bandwidth", "", f"![busbw against size]({plot_name})"]
    lines += ["", "## Table", "", "```text", table(records, {}), "```", ""]
    return "\n".join(lines)


def _peers(records: list[dict[str, Any]]) -> list[str]:
    return sorted({r["impl"] for r in records} - {OURS})


def _ratio(records: list[dict[str, Any]], ours: dict[str, Any], impl: str) -> str:
    for r in records:
        same = (r["op"], r["world_size"], r["size"]) == (
            ours["op"],
            ours["world_size"],
            ours["size"],
        )
        if same and r["impl"] == impl:
            return f"{r['ratio_to_ours']:.2f}"
    return "-"


def _human(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size} B"
