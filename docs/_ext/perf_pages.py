"""The benchmark numbers the landing and performance pages show, read from the committed runs.

``python -m benchmarks`` writes ``docs/performance/results.json`` (and ``results.md``,
``busbw.png``); ``python -m benchmarks.bulk`` writes ``bulk.json`` (and ``bulk.md``,
``bulk.png``). This module picks the headline points out of the JSON files, renders
them and the full tables as Markdown, and draws the summary plot, so every number on
the pages is one that a committed run measured.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.report import COPY, LOOP, OURS, RAY, TORCH, human, human_bytes

PEERS = (RAY, TORCH)
"""The two peers every summary row compares with, in column order."""
PEER_TITLES = {RAY: "`ray.util.collective`", TORCH: "raw Gloo"}
MIB = 1 << 20


@dataclass(frozen=True)
class Point:
    """One measured point: a label and the median seconds of ours and of each peer."""

    label: str
    ranks: str
    ours: float
    peers: dict[str, float | None]


@dataclass(frozen=True)
class Latency:
    """The 8-byte allreduce latency probe at a world size (single ops, back to back)."""

    world_size: int

    def point(self, results: dict[str, Any] | None, bulk: dict[str, Any] | None) -> Point | None:
        """Return this probe's point in ``results``, or None if the run lacks it."""
        if results is None:
            return None
        times = {
            p["impl"]: p["median_us"] * 1e-6
            for p in results.get("latency", [])
            if p["world_size"] == self.world_size and p["size"] == 8
        }
        if OURS not in times:
            return None
        return Point(
            "8-byte allreduce (latency)",
            f"{self.world_size}",
            times[OURS],
            {peer: times.get(peer) for peer in PEERS},
        )


@dataclass(frozen=True)
class Op:
    """One op at one size and world size of the op sweep."""

    op: str
    world_size: int
    size: int

    def point(self, results: dict[str, Any] | None, bulk: dict[str, Any] | None) -> Point | None:
        """Return this op's point in ``results``, or None if the run lacks it."""
        if results is None:
            return None
        times = {
            r["impl"]: r["time_us"]["median"] * 1e-6
            for r in results.get("results", [])
            if (r["op"], r["world_size"], r["size"]) == (self.op, self.world_size, self.size)
        }
        if OURS not in times:
            return None
        label = f"{human(self.size)} {self.op}"
        return Point(label, f"{self.world_size}", times[OURS], {p: times.get(p) for p in PEERS})


BULK_CALLS = {
    "uniform": "`broadcast_state_dict`",
    "transformer": "`broadcast_state_dict`",
    "gradients": "`allreduce_tensors`",
}


@dataclass(frozen=True)
class Bulk:
    """One workload of the many-tensor benchmark, on one node or two."""

    workload: str
    nodes: int

    def point(self, results: dict[str, Any] | None, bulk: dict[str, Any] | None) -> Point | None:
        """Return this workload's point in ``bulk``, or None if the run lacks it."""
        if bulk is None:
            return None
        rows = [
            r
            for r in bulk.get("results", [])
            if (r["workload"], r["nodes"]) == (self.workload, self.nodes)
        ]
        times = {r["impl"]: r["time_ms"]["median"] * 1e-3 for r in rows}
        if OURS not in times:
            return None
        first = rows[0]
        what = f"{first['tensors']:,} tensors, {human_bytes(first['bytes'])}"
        where = "" if self.nodes == 1 else f" on {nodes(self.nodes)}"
        label = f"{BULK_CALLS.get(self.workload, self.workload)}, {what}{where}"
        return Point(label, f"{first['world_size']}", times[OURS], {p: times.get(p) for p in PEERS})


Spec = Latency | Op | Bulk

SUMMARY: tuple[Spec, ...] = (
    Latency(2),
    Latency(4),
    Op("allreduce", 2, 1 * MIB),
    Op("allreduce", 2, 64 * MIB),
    Op("allreduce", 4, 64 * MIB),
    Op("broadcast", 4, 64 * MIB),
    Op("allgather", 4, 64 * MIB),
    Op("reducescatter", 4, 64 * MIB),
    Bulk("uniform", 1),
    Bulk("transformer", 1),
    Bulk("gradients", 1),
    Bulk("uniform", 2),
    Bulk("transformer", 2),
    Bulk("gradients", 2),
)
"""The performance page's summary rows, in order: every workload on two nodes too, the
losses with the wins."""

HEADLINES: tuple[Spec, ...] = (
    Latency(2),
    Latency(4),
    Op("allreduce", 2, 64 * MIB),
    Op("allreduce", 4, 64 * MIB),
    Bulk("uniform", 1),
)
"""The landing page's numbers: small and large messages at 2 and 4 ranks, a whole model."""


def nodes(count: int) -> str:
    """Return where a run's ranks ran: ``one node``, or ``2 Ray nodes of one machine``.

    The many-tensor run's nodes are Ray nodes of a ``ray.cluster_utils.Cluster`` that
    share the machine it runs on.
    """
    return "one node" if count == 1 else f"{count} Ray nodes of one machine"


def provenance(meta: dict[str, Any], file: str) -> str:
    """Return, in a sentence, which run a file's tables come from: its machine and command."""
    versions = ", ".join(
        f"{title} {meta[key]}"
        for key, title in (("python", "Python"), ("torch", "torch"), ("ray", "Ray"))
        if key in meta
    )
    load = meta.get("load_average")
    return (
        f"The tables come from the run in `{file}`: `{meta.get('machine')}`"
        + (f", {meta['cpus']} CPUs" if "cpus" in meta else "")
        + (f", {versions}" if versions else "")
        + (f", {meta['seconds']} s" if "seconds" in meta else "")
        + (f", load average {load[0]} at its end" if load else "")
        + f", command `{command(meta)}`. "
        + (
            f"It was measured at commit `{meta['commit']}`."
            if meta.get("commit")
            else "The file records no commit: `git log` on it shows the commit that added it."
        )
    )


def load(path: Path) -> dict[str, Any] | None:
    """Return the JSON at ``path``, or None if there is none."""
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def duration(seconds: float) -> str:
    """Return a time with three significant digits: ``8.3 µs``, ``13.9 ms``, ``2.70 s``."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g}\u00a0{unit}"
    return f"{seconds * 1e9:.3g}\u00a0ns"


def times_as(ratio: float) -> str:
    """Return a ratio above 1 in words' precision: ``40x``, ``2.9x``."""
    return f"{ratio:.0f}x" if ratio >= 10 else f"{ratio:.1f}x"


def speedup(theirs: float, ours: float) -> str:
    """Return how the peer's time compares with ours: ``40x slower``, ``1.3x faster``."""
    if theirs >= ours:
        return f"{times_as(theirs / ours)}\u00a0slower"
    return f"{times_as(ours / theirs)}\u00a0faster"


def points(
    specs: tuple[Spec, ...], results: dict[str, Any] | None, bulk: dict[str, Any] | None
) -> list[Point]:
    """Return the points of ``specs`` that the runs measured, in order."""
    found = [spec.point(results, bulk) for spec in specs]
    return [p for p in found if p is not None]


def peer_cell(point: Point, peer: str) -> str:
    """Return a peer's time and how it compares with ours, or a dash if not measured."""
    theirs = point.peers.get(peer)
    if theirs is None:
        return "—"
    return f"{duration(theirs)}\u00a0({speedup(theirs, point.ours)})"


def table(rows: list[Point], link: str | None = None) -> str:
    """Return a Markdown table of ``rows``: ours, then each peer and how it compares with ours.

    With ``link``, each label links there.
    """
    header = ["what", "ranks", "`collective`", *(PEER_TITLES[p] for p in PEERS)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for p in rows:
        label = f"[{p.label}]({link})" if link else p.label
        cells = [label, p.ranks, duration(p.ours), *(peer_cell(p, peer) for peer in PEERS)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine(meta: dict[str, Any]) -> str:
    """Return the machine of a run in words: ``a 2-CPU x86-64 Linux machine``."""
    arch = "x86-64" if "x86_64" in meta.get("machine", "") else "Linux"
    return f"a {meta.get('cpus', '?')}-CPU {arch} Linux machine".replace("Linux Linux", "Linux")


OUTPUT_OPTION = re.compile(r"(--(?:json|plot|markdown) )(\S*/)?(\S+)")


def command(meta: dict[str, Any]) -> str:
    """Return a run's command, writing its outputs where the docs read them."""
    return OUTPUT_OPTION.sub(r"\1docs/performance/\3", str(meta.get("command", "")))


def wrapped(cmd: str, width: int = 72) -> str:
    """Return a shell command broken before options, each line at most ``width`` long."""
    lines: list[str] = []
    current = ""
    for word in re.split(r" (?=--)", cmd):
        if current and len(current) + 1 + len(word) > width:
            lines.append(current + " \\")
            current = "    " + word
        else:
            current = f"{current} {word}" if current else word
    lines.append(current)
    return "\n".join(lines)


IMPL_TITLES = {
    OURS: "`collective`",
    "collective_gloo": "`collective` on Gloo",
    TORCH: "raw torch Gloo",
    RAY: "`ray.util.collective`",
    "object_store": "object store",
    COPY: "plain copies",
}
"""Column titles of the implementations, in the order the tables show them."""


def goals_table(goals: list[dict[str, Any]]) -> str:
    """Return a run's goals as a Markdown table: the verdict, the goal and what it measured."""
    lines = ["| verdict | goal | measured |", "|---|---|---|"]
    for goal in goals:
        claim = str(goal["claim"]).replace("|", "\\|")
        lines.append(f"| {str(goal['verdict']).upper()} | {claim} | {goal['measured']} |")
    return "\n".join(lines)


def latency_table(results: dict[str, Any]) -> str:
    """Return the 8-byte latency probes as a Markdown table."""
    lines = [
        "| ranks | implementation | ops | median | min | 90th percentile |",
        "|---|---|---|---|---|---|",
    ]
    order = list(IMPL_TITLES)
    for p in sorted(
        results.get("latency", []),
        key=lambda p: (p["world_size"], order.index(p["impl"]) if p["impl"] in order else 99),
    ):
        times = (duration(p[key] * 1e-6) for key in ("median_us", "min_us", "p90_us"))
        lines.append(
            f"| {p['world_size']} | {IMPL_TITLES.get(p['impl'], p['impl'])} | {p['ops']:,} | "
            + " | ".join(times)
            + " |"
        )
    return "\n".join(lines)


def op_tables(results: dict[str, Any]) -> str:
    """Return each op's median time per size and implementation, a table per world size."""
    records = results.get("results", [])
    ops = list(dict.fromkeys(r["op"] for r in records))
    parts = []
    for op in ops:
        parts.append(f"### {op}\n")
        for world_size in sorted({r["world_size"] for r in records if r["op"] == op}):
            rows = [r for r in records if (r["op"], r["world_size"]) == (op, world_size)]
            impls = [i for i in IMPL_TITLES if any(r["impl"] == i for r in rows)]
            cells = {(r["impl"], r["size"]): r for r in rows}
            lines = [
                f"{op}, {world_size} ranks:",
                "",
                "| size | " + " | ".join(IMPL_TITLES[i] for i in impls) + " |",
                "|---|" + "---|" * len(impls),
            ]
            for size in sorted({r["size"] for r in rows}):
                row = [cells.get((impl, size)) for impl in impls]
                text = [
                    duration(r["time_us"]["median"] * 1e-6) + (" ✗" if r["wrong"] else "")
                    if r
                    else "—"
                    for r in row
                ]
                lines.append(f"| {human(size)} | " + " | ".join(text) + " |")
            parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)


BULK_TITLES = {
    OURS: "`collective`, one call",
    LOOP: "`collective`, one op per tensor",
    RAY: "`ray.util.collective`, one op per tensor",
    "object_store": "object store",
    COPY: "plain copies of the same bytes",
}
"""Row titles of the many-tensor run's implementations, in order."""


def bulk_tables(bulk: dict[str, Any]) -> str:
    """Return the many-tensor run's goals and a table per workload and node count."""
    parts = []
    if bulk.get("goals"):
        parts += ["Goals:", "", goals_table(bulk["goals"]), ""]
    records = bulk.get("results", [])
    for key in dict.fromkeys((r["workload"], r["nodes"]) for r in records):
        rows = [r for r in records if (r["workload"], r["nodes"]) == key]
        first = rows[0]
        parts += [
            f"`{first['workload']}`: {first['tensors']:,} tensors, "
            f"{human_bytes(first['bytes'])}, {first['world_size']} ranks on "
            f"{nodes(first['nodes'])}:",
            "",
            "| implementation | median | min | max | GB/s | against `collective`'s one call |",
            "|---|---|---|---|---|---|",
        ]
        order = list(BULK_TITLES)
        for r in sorted(rows, key=lambda r: order.index(r["impl"]) if r["impl"] in order else 99):
            times = [duration(r["time_ms"][k] * 1e-3) for k in ("median", "min", "max")]
            title = BULK_TITLES.get(r["impl"], r["impl"]) + (" ✗" if r["wrong"] else "")
            ours = r["time_ms"]["median"] / r["speedup_of_ours"]
            faster = "—" if r["impl"] == OURS else speedup(r["time_ms"]["median"], ours)
            parts.append(f"| {title} | " + " | ".join(times) + f" | {r['gbs']:.3g} | {faster} |")
        parts.append("")
    return "\n".join(parts)
