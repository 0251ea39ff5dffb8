"""The benchmarks' figures, drawn to be read on a docs page 1280 px wide.

Every figure has at most ``MAX_PANELS`` panels, sizes in B, KiB, MiB or GiB, and text of
at least 11 pt at a width that the page shows at about its own size. Small messages are
drawn as time per op (a log axis: they span three decades), large ones as bus bandwidth
on a linear axis from zero, split at ``LARGE``. Each line is named at its end, in its
colour (direct labels, spread so that no two overlap), and has a marker of its own;
the plain copies are a dashed grey peer, not a bound. Where the run records the
machine's memory bandwidth (``meta["membw"]``), a bus-bandwidth panel draws the bound it
sets as a black line, named at its end, with the unreachable region above it hatched,
over the sizes it holds for (those of the measured copies and up: smaller messages fit
the caches): every byte that crosses between ranks is copied at least once, so the op's
bus bandwidth is at most the measured copy rate of all the ranks together over the
ranks' worth of bus bytes that cross (``report.membw_bound``). The many-tensor figure
is a dot per row and workload, with its time written beside it, and "not measured"
where the run has no such row. ``python -m benchmarks`` and
``python -m benchmarks.bulk`` draw them from their runs; ``python -m benchmarks.replot``
redraws the committed ones from the committed JSON, measuring nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks import workloads
from benchmarks.report import (
    COLORS,
    COPY,
    LOOP,
    OURS,
    OURS_GLOO,
    RAY,
    STORE,
    TORCH,
    Bound,
    human,
    human_bytes,
    membw_bound,
)

LABELS = {
    OURS: "collective",
    OURS_GLOO: "collective on Gloo",
    TORCH: "raw torch Gloo",
    RAY: "ray.util.collective",
    STORE: "object store",
    COPY: "plain copies (peer)",
}
"""Each implementation of the op sweep in words, as its line's label says it."""

MARKERS = {OURS: "o", OURS_GLOO: "s", TORCH: "^", RAY: "D", STORE: "v", COPY: "x"}
"""One marker per implementation, so lines that run together stay apart."""

LINE_COLORS = {**COLORS, COPY: "dimgray"}
"""The report's colours, with the plain-copy peer in grey."""

LARGE = 1 << 20
"""Messages from this size on are drawn as bus bandwidth; smaller ones as time per op."""

LABEL_GAP = 0.085
"""The least distance between two direct labels, in a panel's height."""

BULK_LABELS = {
    OURS: "collective, one call",
    LOOP: "collective, one op per tensor",
    RAY: "ray.util.collective, one op per tensor",
    STORE: "Ray object store",
    COPY: "plain copies of the same bytes",
}
"""Each row of the many-tensor run in words, in legend order."""

MAX_PANELS = 4
WIDTH_IN = 10.0
"""Figure width: at ``DPI`` it is about the article column of a 1280 px page."""
DPI = 90
Record = dict[str, Any]


@contextmanager
def pyplot() -> Iterator[Any]:
    """Yield ``matplotlib.pyplot`` on the file-only backend, in the figures' style."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with plt.rc_context(
        {"font.size": 14, "axes.titlesize": 14, "legend.fontsize": 12, "axes.labelsize": 14}
    ):
        yield plt


def size_axis(ax: Any, sizes: Sequence[int]) -> None:
    """Put ``sizes`` on ``ax``'s log x axis, labelled in B, KiB, MiB or GiB."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(sizes), [human(size) for size in sizes])
    ax.minorticks_off()
    for label in ax.get_xticklabels():
        label.set(rotation=40, ha="right", rotation_mode="anchor")
    ax.set_xlabel("message size")


def lines(ax: Any, records: list[Record], value: Callable[[Record], float]) -> None:
    """Draw ``value`` against size on ``ax``, a line per implementation of ``LABELS``."""
    for impl, label in LABELS.items():
        line = sorted((r["size"], value(r)) for r in records if r["impl"] == impl)
        if line:
            ax.plot(
                *zip(*line, strict=True),
                "--" if impl == COPY else "-",
                marker=MARKERS[impl],
                markersize=5,
                color=LINE_COLORS.get(impl),
                label=label,
            )
    size_axis(ax, sorted({r["size"] for r in records}))
    ax.grid(True, alpha=0.3)


def spread(positions: list[float], gap: float = LABEL_GAP) -> list[float]:
    """Return ``positions`` (sorted, in 0..1) moved apart by at least ``gap``, kept in 0..1."""
    placed: list[float] = []
    for position in positions:
        placed.append(max(position, placed[-1] + gap) if placed else position)
    overflow = placed[-1] - 1.0 if placed else 0.0
    if overflow > 0:
        placed = [p - overflow for p in placed]
        for i in range(len(placed) - 2, -1, -1):
            placed[i] = min(placed[i], placed[i + 1] - gap)
    return placed


def direct_labels(ax: Any) -> None:
    """Name each line of ``ax`` at the right edge, level with its last point, in its colour."""
    ends = []
    for line in ax.get_lines():
        xs, ys = line.get_xdata(), line.get_ydata()
        if len(xs) and not line.get_label().startswith("_"):
            _, y = ax.transAxes.inverted().transform(ax.transData.transform((xs[-1], ys[-1])))
            ends.append((float(y), line.get_label(), line.get_color()))
    ends.sort()
    for (_, text, color), y in zip(ends, spread([e[0] for e in ends]), strict=True):
        ax.annotate(
            text,
            xy=(1.0, y),
            xycoords="axes fraction",
            xytext=(6, 0),
            textcoords="offset points",
            va="center",
            color=color,
            fontsize=11,
        )


def legend(fig: Any, axes: Any, order: list[str]) -> None:
    """Put one legend below ``fig``: each label of ``axes`` once, in ``order``."""
    entries: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            entries.setdefault(label, handle)
    labels = sorted(entries, key=order.index)
    handles = [entries[label] for label in labels]
    fig.legend(handles, labels, loc="outside lower center", ncol=2, frameon=False)


def microseconds(value: float, _: Any = None) -> str:
    """Return a tick's time, given in µs, in the unit that reads best: ``10 µs``, ``1 ms``."""
    for unit, scale in (("s", 1e6), ("ms", 1e3)):
        if value >= scale:
            return f"{value / scale:g} {unit}"
    return f"{value:g} µs"


Panel = tuple[str, Callable[[Any], None]]
"""One panel: its title, and what draws it on its axes."""


def latency_panel(ax: Any, records: list[Record]) -> None:
    """Draw the median time per op of ``records`` against size, on a log axis."""
    lines(ax, records, lambda r: r["time_us"]["median"])
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(microseconds)
    ax.set_ylabel("median time per op")


def bus_bandwidth(r: Record) -> float:
    """Return a point's bus bandwidth in GB/s, from its median time where it lacks one."""
    if "busbw_gbs" in r:
        return float(r["busbw_gbs"])
    algbw = r["size"] / (r["time_us"]["median"] * 1e-6) / 1e9
    return algbw * workloads.BUS_FACTOR[r["op"]](r["world_size"])


def bound_label(bound: Bound) -> str:
    """Return the memory-bandwidth bound's direct label: its value, on one line."""
    return f"bound {bound.gbs:.1f} GB/s"


def bandwidth_panel(ax: Any, records: list[Record], bound: Bound | None = None) -> None:
    """Draw the bus bandwidth of ``records`` against size, on a linear axis from zero.

    With ``bound``, draw the memory-bandwidth bound where it holds, from
    ``bound.from_bytes`` on (smaller messages fit the caches): a black line, named at
    its end as the other lines are, with the region above it hatched.
    """
    lines(ax, records, bus_bandwidth)
    top = max((bus_bandwidth(r) for r in records), default=1.0) * 1.1
    sizes = sorted({r["size"] for r in records})
    held = [size for size in sizes if size >= bound.from_bytes] if bound is not None else []
    if bound is not None and held:
        top = max(top, bound.gbs * 1.15)
        span = [held[0], held[-1]] if len(held) > 1 else [held[0], held[0] * 1.15]
        ax.fill_between(
            span, bound.gbs, top, facecolor="0.94", edgecolor="0.8", hatch="//", lw=0, zorder=0
        )
        ax.plot(
            span, [bound.gbs, bound.gbs], color="black", lw=2, zorder=1, label=bound_label(bound)
        )
    ax.set_ylim(0, top)
    ax.set_ylabel("bus bandwidth (GB/s)")


def split_panels(title: str, records: list[Record], bound: Bound | None = None) -> list[Panel]:
    """Return a time panel of ``records`` below ``LARGE`` and a bandwidth panel of the rest.

    The bandwidth panel draws ``bound``, the memory-bandwidth bound, where there is one.
    """
    small = [r for r in records if r["size"] < LARGE]
    large = [r for r in records if r["size"] >= LARGE]
    panels: list[Panel] = []
    if small:
        panels.append((f"{title}: below {human(LARGE)}", partial(latency_panel, records=small)))
    if large:
        draw = partial(bandwidth_panel, records=large, bound=bound)
        panels.append((f"{title}: {human(LARGE)} and up", draw))
    return panels


def figure(path: Path, panels: list[Panel]) -> None:
    """Draw ``panels``, two a row, each line named at its end, into ``path``."""
    if not 0 < len(panels) <= MAX_PANELS:
        raise ValueError(f"a figure takes 1 to {MAX_PANELS} panels, got {len(panels)}")
    rows, cols = (len(panels) + 1) // 2, min(2, len(panels))
    with pyplot() as plt:
        fig, axes = plt.subplots(
            rows, cols, figsize=(WIDTH_IN, 3.9 * rows + 0.4), squeeze=False, layout="constrained"
        )
        for ax, (title, draw) in zip(axes.flat, panels, strict=False):
            draw(ax)
            ax.set_title(title)
            direct_labels(ax)
        for ax in list(axes.flat)[len(panels) :]:
            ax.set_visible(False)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=DPI, bbox_inches="tight")
        plt.close(fig)


def panels_figure(
    path: Path,
    panels: list[tuple[str, list[Record]]],
    value: Callable[[Record], float],
    ylabel: str,
    ticks: Callable[[float, Any], str] | None = None,
) -> None:
    """Draw ``value`` of each panel's records against size, on a log axis, into ``path``."""

    def draw(records: list[Record]) -> Callable[[Any], None]:
        def on(ax: Any) -> None:
            lines(ax, records, value)
            ax.set_yscale("log")
            ax.set_ylabel(ylabel)
            if ticks is not None:
                ax.yaxis.set_major_formatter(ticks)

        return on

    figure(path, [(title, draw(records)) for title, records in panels])


def times(
    path: Path,
    results: dict[str, Any],
    op: str = "allreduce",
    membw: dict[str, Any] | None = None,
) -> bool:
    """Draw ``op``: small messages' time per op, large ones' bus bandwidth, a row per world size.

    With ``membw`` (a run's ``meta["membw"]``), the bandwidth panels draw the bound it
    sets. Returns False, drawing nothing, when the run has no ``op`` or matplotlib is
    missing.
    """
    records = [r for r in results.get("results", []) if r["op"] == op]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    world_sizes = sorted({r["world_size"] for r in records})[: MAX_PANELS // 2]
    if not world_sizes:
        return False
    panels = [
        panel
        for n in world_sizes
        for panel in split_panels(
            f"{op}, {n} ranks",
            [r for r in records if r["world_size"] == n],
            membw_bound(membw, op, n),
        )
    ]
    figure(path, panels)
    return True


def op_groups(records: list[Record]) -> list[list[str]]:
    """Return the ops of each bus-bandwidth figure: as many as fit ``MAX_PANELS`` panels."""
    ops = [op for op in workloads.OPS if any(r["op"] == op for r in records)]
    world_sizes = len({r["world_size"] for r in records})
    each = max(1, MAX_PANELS // max(1, world_sizes))
    return [ops[i : i + each] for i in range(0, len(ops), each)]


def figure_paths(path: Path, count: int) -> list[Path]:
    """Return the files of ``count`` figures: ``path``, then ``<stem>-2<suffix>`` and on."""
    return [path] + [path.with_name(f"{path.stem}-{i}{path.suffix}") for i in range(2, count + 1)]


def busbw(
    path: Path, records: list[Record], membw: dict[str, Any] | None = None
) -> list[tuple[Path, list[str]]]:
    """Draw the bus bandwidth of messages of ``LARGE`` and up, a panel per op and world size.

    ``MAX_PANELS`` panels a figure; smaller messages are in the tables, as times, and a
    panel of a run without large messages shows its times. With ``membw``, the run's
    ``meta["membw"]``, each bandwidth panel draws the bound it sets. Returns each
    figure's file and ops, the first in ``path``.
    """
    groups = op_groups(records)
    drawn = []
    for file, ops in zip(figure_paths(path, len(groups)), groups, strict=True):
        panels: list[Panel] = []
        for op in ops:
            for n in sorted({r["world_size"] for r in records})[:MAX_PANELS]:
                rows = [r for r in records if (r["op"], r["world_size"]) == (op, n)]
                large = [r for r in rows if r["size"] >= LARGE]
                if large:
                    bound = membw_bound(membw, op, n)
                    draw = partial(bandwidth_panel, records=large, bound=bound)
                    panels.append((f"{op}, {n} ranks", draw))
                elif rows:
                    panels.append((f"{op}, {n} ranks", partial(latency_panel, records=rows)))
        figure(file, panels)
        drawn.append((file, ops))
    return drawn


BULK_MARKERS = {OURS: "o", LOOP: "s", RAY: "D", STORE: "v", COPY: "x"}
"""One marker per row of the many-tensor run."""


def bulk_rows(records: list[Record]) -> list[tuple[str, str | None]]:
    """Return the figure's rows, top down: a workload's heading, then a row per implementation."""
    impls = [i for i in BULK_LABELS if any(r["impl"] == i for r in records)]
    rows: list[tuple[str, str | None]] = []
    for kind in dict.fromkeys(r["workload"] for r in records):
        rows += [(kind, None)] + [(kind, impl) for impl in impls]
    return rows


def bulk_heading(records: list[Record], kind: str) -> str:
    """Return a workload's heading: its name, tensor count and size."""
    first = next(r for r in records if r["workload"] == kind)
    return f"{kind}: {first['tensors']:,} tensors, {human_bytes(first['bytes'])}"


def milliseconds(value: float) -> str:
    """Return a time given in ms with three significant digits: ``68.1 ms``, ``1.57 s``."""
    return f"{value / 1e3:.2f} s" if value >= 1e3 else f"{value:.3g} ms"


def bulk(path: Path, records: list[Record]) -> list[tuple[int, str, str]]:
    """Draw each row's median time per call as a dot, a panel per node count.

    A dot per implementation and workload on a log time axis, its time written beside
    it; a row the run did not measure says "not measured". Returns those rows, as
    ``(nodes, workload, implementation)``.
    """
    missing = []
    node_counts = sorted({r["nodes"] for r in records})[:MAX_PANELS]
    rows = bulk_rows(records)
    times = [r["time_ms"]["median"] for r in records]
    with pyplot() as plt:
        fig, axes = plt.subplots(
            1,
            len(node_counts),
            figsize=(WIDTH_IN, 0.36 * len(rows) + 1.4),
            squeeze=False,
            sharey=True,
            layout="constrained",
        )
        for ax, nodes in zip(axes[0], node_counts, strict=True):
            here = {(r["workload"], r["impl"]): r for r in records if r["nodes"] == nodes}
            for y, (kind, impl) in enumerate(rows):
                if impl is None:
                    continue
                r = here.get((kind, impl))
                if r is None:
                    missing.append((nodes, kind, impl))
                    ax.annotate(
                        "not measured",
                        xy=(0.02, y),
                        xycoords=("axes fraction", "data"),
                        va="center",
                        color="0.45",
                        fontsize=11,
                        style="italic",
                    )
                    continue
                t = r["time_ms"]["median"]
                ax.plot(
                    [t], [y], BULK_MARKERS.get(impl, "o"), color=COLORS.get(impl, "tab:gray"), ms=8
                )
                ax.annotate(
                    milliseconds(t),
                    xy=(t, y),
                    xytext=(7, 0),
                    textcoords="offset points",
                    va="center",
                    fontsize=11,
                )
            ax.set_xscale("log")
            ax.set_xlim(min(times) / 1.6, max(times) * 4)
            ax.xaxis.set_major_formatter(lambda v, _: microseconds(v * 1e3))
            ax.grid(True, axis="x", alpha=0.3)
            ranks = next(r["world_size"] for r in records if r["nodes"] == nodes)
            where = "one node" if nodes == 1 else f"{nodes} Ray nodes"
            ax.set_title(f"{where}, {ranks} ranks")
        fig.supxlabel("median time per call (log scale)")
        first = axes[0][0]
        first.set_yticks(
            range(len(rows)),
            [
                bulk_heading(records, kind) if impl is None else BULK_LABELS[impl]
                for kind, impl in rows
            ],
        )
        for label, (_, impl) in zip(first.get_yticklabels(), rows, strict=True):
            if impl is None:
                label.set_fontweight("bold")
        first.set_ylim(len(rows) - 0.5, -0.5)
        fig.savefig(path, dpi=DPI, bbox_inches="tight")
        plt.close(fig)
    return missing
