"""Statistics, the nccl-tests-style table, JSON and the results page (figures: ``plots``)."""

from __future__ import annotations

import json
import statistics
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import workloads

OURS = "collective"
"""Ours with the default CPU transport (``cpu_transport="auto"``)."""
OURS_GLOO = "collective_gloo"
"""Ours forced to Gloo over TCP (``cpu_transport="gloo"``)."""
TORCH = "torch_gloo"
"""Raw ``torch.distributed`` gloo in plain processes: the baseline of every ratio."""
RAY = "ray_collective"
STORE = "object_store"
COPY = "shm_copy"
"""The plain-copy peer: the op's bytes copied through one shared segment, no arithmetic.

It is a peer, not a bound: it makes its own copies, in its own order, and a group that
makes fewer copies beats it. What bounds a large op on one node is memory bandwidth
(``python -m benchmarks.membw``, ``membw_bound``).
"""
LOOP = "collective_loop"
"""The many-tensor run's per-tensor loop of our ops."""

IMPLS = (OURS, OURS_GLOO, TORCH, RAY, STORE, COPY)
COLORS = {
    OURS: "tab:blue",
    OURS_GLOO: "tab:purple",
    TORCH: "tab:red",
    RAY: "tab:green",
    STORE: "tab:orange",
    COPY: "black",
    LOOP: "tab:gray",
}
"""One color per implementation, the same in every panel."""

HOW_TO_READ = [
    "- Time is the median over the samples of the slowest rank's time per op, with the",
    "  min and max beside it. Below 1 MiB a sample times a batch of back-to-back ops",
    "  (`batch`, from the size) and counts their mean; the ranks meet before each sample.",
    f"  A point's samples are taken in up to {workloads.ROUNDS} rounds, each implementation"
    " once a round,",
    "  so that the machine's slow spells fall on every implementation alike.",
    "- algbw = size / time; busbw = algbw x nccl-tests' factor of the op.",
    f"- `t/gloo` is the median time over raw torch gloo's ({TORCH}) at the same point:",
    "  below 1 is faster. `bw/copy` is the bandwidth as a fraction of the plain-copy peer's",
    f"  ({COPY}: the op's bytes copied through one shared segment, no arithmetic): above 1",
    "  moves the op's data faster than those plain copies do. It is a peer, not a bound.",
]


def record(
    impl: str,
    op: str,
    world_size: int,
    size: int,
    times: list[float],
    wrong: int,
    batch: int,
) -> dict[str, Any]:
    """Summarise one implementation's run of ``op`` at ``size`` bytes (the size it really moved)."""
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
        "batch": batch,
        "time_us": {"median": median * 1e6, "min": min(times) * 1e6, "max": max(times) * 1e6},
        "algbw_gbs": algbw,
        "busbw_gbs": algbw * workloads.BUS_FACTOR[op](world_size),
        "wrong": wrong,
    }


def latency(impl: str, world_size: int, size: int, times: list[float]) -> dict[str, Any]:
    """Summarise a latency probe: single ops back to back, each timed by itself."""
    return {
        "impl": impl,
        "world_size": world_size,
        "size": size,
        "ops": len(times),
        "median_us": statistics.median(times) * 1e6,
        "min_us": min(times) * 1e6,
        "p90_us": statistics.quantiles(times, n=10)[-1] * 1e6 if len(times) > 1 else times[0] * 1e6,
    }


def _key(r: dict[str, Any]) -> tuple[str, int, int]:
    return r["op"], r["world_size"], r["size"]


def add_ratios(records: list[dict[str, Any]]) -> None:
    """Set each record's ``ratio_to_torch_gloo`` (time) and ``fraction_of_copy`` (bandwidth)."""
    medians = {(r["impl"], *_key(r)): r["time_us"]["median"] for r in records}
    for r in records:
        torch_time, copy_time = medians.get((TORCH, *_key(r))), medians.get((COPY, *_key(r)))
        mine = r["time_us"]["median"]
        r["ratio_to_torch_gloo"] = mine / torch_time if torch_time else None
        r["fraction_of_copy"] = copy_time / mine if copy_time else None


def _order(impl: str) -> int:
    return IMPLS.index(impl) if impl in IMPLS else len(IMPLS)


def _cell(value: float | None, width: int = 7) -> str:
    return f"{value:>{width}.2f}" if value is not None else f"{'-':>{width}}"


def table(records: list[dict[str, Any]], unavailable: dict[str, str]) -> str:
    """Return the results as nccl-tests-style text, one block per op and world size."""
    lines = []
    blocks = sorted(
        {(r["op"], r["world_size"]) for r in records},
        key=lambda b: (workloads.OPS.index(b[0]), b[1]),
    )
    header = (
        f"{'size(B)':>11} {'count':>10} {'type':>7} {'impl':>15} {'batch':>5} {'time(us)':>11} "
        f"{'min':>10} {'max':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6} {'t/gloo':>7} "
        f"{'bw/copy':>7}"
    )
    for op, world_size in blocks:
        lines += ["", f"# {op}, world size {world_size}", header]
        rows = [r for r in records if (r["op"], r["world_size"]) == (op, world_size)]
        for r in sorted(rows, key=lambda r: (r["size"], _order(r["impl"]))):
            t = r["time_us"]
            lines.append(
                f"{r['size']:>11} {r['count']:>10} {r['dtype']:>7} {r['impl']:>15} "
                f"{r['batch']:>5} {t['median']:>11.1f} {t['min']:>10.1f} {t['max']:>10.1f} "
                f"{r['algbw_gbs']:>7.3f} {r['busbw_gbs']:>7.3f} {r['wrong']:>6} "
                f"{_cell(r.get('ratio_to_torch_gloo'))} {_cell(r.get('fraction_of_copy'))}"
            )
    for impl, why in sorted(unavailable.items()):
        lines.append(f"# {impl}: {why}")
    return "\n".join(lines).lstrip("\n")


def latency_table(probes: list[dict[str, Any]]) -> str:
    """Return the latency probes as text: one line per implementation and world size."""
    if not probes:
        return ""
    size = probes[0]["size"]
    lines = [
        f"# {size}-byte allreduce, single ops back to back (ours and ray_collective in Ray actors)",
        f"{'ranks':>5} {'impl':>15} {'ops':>6} {'median(us)':>11} {'min':>9} {'p90':>9}",
    ]
    for p in sorted(probes, key=lambda p: (p["world_size"], _order(p["impl"]))):
        lines.append(
            f"{p['world_size']:>5} {p['impl']:>15} {p['ops']:>6} {p['median_us']:>11.1f} "
            f"{p['min_us']:>9.1f} {p['p90_us']:>9.1f}"
        )
    return "\n".join(lines)


BUS_COPIES: dict[str, Callable[[int], int]] = {
    "allreduce": lambda n: n,
    "broadcast": lambda n: n - 1,
    "reduce": lambda n: n - 1,
    "allgather": lambda n: n,
    "gather": lambda n: 1,
    "reducescatter": lambda n: n,
    "scatter": lambda n: 1,
    "alltoall": lambda n: n,
}
"""The bytes an op of ``n`` ranks must move from rank to rank, in all, in one rank's bus bytes.

For ``S`` bytes (nccl-tests' sizes) a rank's bus bytes are ``BUS_FACTOR * S``, and at
least this many bytes cross from one rank to another: allreduce ``2(n-1)S`` (combining
``n`` values takes ``n-1`` crossings, and the result reaches the ``n-1`` other ranks),
broadcast ``(n-1)S`` (``S`` to each other rank), reduce ``(n-1)S`` (combining ``n``
values), allgather, reducescatter and alltoall ``(n-1)S`` (``(n-1)/n S`` at each rank),
gather and scatter ``(n-1)/n S`` (at the root). Divided by the bus bytes, that is ``n``,
``n-1`` or 1.
"""


@dataclass(frozen=True)
class Bound:
    """The memory-bandwidth bound of one op and world size, and what it comes from."""

    copy_gbs: float
    """The measured copy rate of all the ranks together (GB/s)."""
    copies: int
    """The op's ``BUS_COPIES``: the rate is shared by this many ranks' bus bytes."""
    from_bytes: int = 0
    """The smallest message it holds for: the size of the copies that measured the rate.

    Smaller messages fit the caches, which copy faster than memory."""

    @property
    def gbs(self) -> float:
        """The most bus bandwidth memory allows the op, in GB/s."""
        return self.copy_gbs / self.copies


def membw_bound(membw: dict[str, Any] | None, op: str, world_size: int) -> Bound | None:
    """Return the most bus bandwidth memory allows ``op`` of ``world_size`` ranks.

    ``membw`` is a results file's ``meta["membw"]`` (``python -m benchmarks.membw``). On
    one node the ranks' tensors are their own memory, so every byte that crosses from one
    rank to another is read once and written once (into a shared segment, or by the
    kernel into the other rank): at least one copy. All the ranks together copy at most
    ``A`` bytes a second, the fastest round measured with as many processes as the ranks
    have cores for (or fewer, if fewer were faster). An op then takes at least
    ``BUS_COPIES * busbytes / A``, so its bus bandwidth is at most ``A / BUS_COPIES``:
    ``A / n`` for allreduce, ``A / (n-1)`` for broadcast. It holds for messages at least
    as large as the measured copies (``Bound.from_bytes``; smaller ones fit the caches,
    which copy faster), and while
    the machine copies as fast as it did when measured: other jobs share its memory, so
    the rate moves between sittings, and the fastest round is the one taken. Returns None
    where ``membw`` lacks the process count or no byte crosses (one rank).
    """
    if not membw or world_size < 2:
        return None
    rates = {r["processes"]: r["fastest"] for r in membw["copy_gbs"]}
    if min(world_size, membw["cpus"]) not in rates:
        return None
    fastest = max(rate for p, rate in rates.items() if p <= world_size)
    return Bound(fastest, BUS_COPIES[op](world_size), int(membw.get("size", 0)))


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write the run's description, records, latency probes and goals to ``path``."""
    path.write_text(json.dumps(data, indent=2) + "\n")


def markdown(data: dict[str, Any], goals_text: str, figures: list[tuple[str, list[str]]]) -> str:
    """Return a results page: machine and command, goals, latency, ratios, figures and table.

    ``figures`` holds each bus-bandwidth figure's file name and ops.
    """
    meta, records = data["meta"], data["results"]
    lines = [
        "## Machine and command",
        "",
        f"- Machine: {meta['machine']}, {meta['cpus']} CPUs; Python {meta['python']}, "
        f"torch {meta['torch']}, Ray {meta['ray']}.",
        f"- Command: `{meta['command']}` ({meta['seconds']} s).",
        *HOW_TO_READ,
        *membw_lines(meta.get("membw")),
    ]
    lines += [f"- {impl}: {why}" for impl, why in sorted(meta["unavailable"].items())]
    lines += ["", "## Goals", "", "```text", goals_text, "```"]
    if data["latency"]:
        lines += ["", "## Latency", "", "```text", latency_table(data["latency"]), "```"]
    for title, field in (
        ("Median time relative to raw torch gloo (below 1 is faster)", "ratio_to_torch_gloo"),
        ("Bandwidth as a fraction of the plain-copy peer's", "fraction_of_copy"),
    ):
        lines += ["", f"## {title}", "", *_grid(records, field)]
    if figures:
        lines += ["", "## Bus bandwidth", ""]
        lines += [f"![bus bandwidth of {', '.join(ops)}]({name})" for name, ops in figures]
    lines += ["", "## Table", "", "```text", table(records, {}), "```", ""]
    return "\n".join(lines)


def membw_lines(membw: dict[str, Any] | None) -> list[str]:
    """Return the results page's lines on the machine's measured copy rate, if the run has it."""
    if not membw:
        return []
    rates = ", ".join(f"{r['fastest']:.1f} GB/s with {r['processes']}" for r in membw["copy_gbs"])
    text = (
        f"- Memory bandwidth: all processes together copy {rates} processes at once (the "
        f"fastest of {membw['rounds']} rounds of {human(membw['size'])} copies; "
        f"`{membw['command']}` on `{membw['machine']}`, {membw['date']}, measured "
        f"{membw['when']}). The bus-bandwidth figures draw the bound it sets (a black line, "
        "hatched above): each byte that crosses between ranks is copied at least once, so an "
        "op's bus bandwidth is at most that rate over the ranks' bus bytes that cross: n for "
        "allreduce, allgather, reducescatter and alltoall, n-1 for broadcast and reduce, 1 "
        "for gather and scatter."
    )
    return textwrap.wrap(text, width=88, subsequent_indent="  ", break_on_hyphens=False)


def _grid(records: list[dict[str, Any]], field: str) -> list[str]:
    """Return a markdown table of ``field``: a row per op, ranks and size, a column per impl."""
    impls = sorted({r["impl"] for r in records if r.get(field) is not None}, key=_order)
    impls = [i for i in impls if i not in (TORCH if field == "ratio_to_torch_gloo" else COPY,)]
    if not impls:
        return ["No baseline in this run."]
    cells = {(r["impl"], *_key(r)): r.get(field) for r in records}
    points = sorted(
        {_key(r) for r in records}, key=lambda k: (workloads.OPS.index(k[0]), k[1], k[2])
    )
    lines = ["| op | ranks | size | " + " | ".join(impls) + " |"]
    lines.append("|---|---|---|" + "---|" * len(impls))
    for op, world_size, size in points:
        row = [cells.get((impl, op, world_size, size)) for impl in impls]
        text = [f"{v:.2f}" if v is not None else "-" for v in row]
        lines.append(f"| {op} | {world_size} | {human(size)} | " + " | ".join(text) + " |")
    return lines


def human(size: int) -> str:
    """Return ``size`` bytes as text: ``8 B``, ``64 KiB``, ``256 MiB``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size} B"


def human_bytes(size: int) -> str:
    """Return a byte count in the unit that reads best: ``62.5 MiB``, ``1011 MiB``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            value = size / scale
            return f"{value:.3g}\u00a0{unit}" if value < 1000 else f"{value:.0f}\u00a0{unit}"
    return f"{size}\u00a0B"
