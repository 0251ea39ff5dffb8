"""The benchmarks' figures, drawn to be read on a docs page 1280 px wide.

Every figure has at most ``MAX_PANELS`` panels, sizes in B, KiB, MiB or GiB, legends in
words, and text of at least 12 pt at a width that the page shows at about its own size.
``python -m benchmarks`` and ``python -m benchmarks.bulk`` draw them from their runs;
``python -m benchmarks.replot`` redraws the committed ones from the committed JSON.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
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
    human,
    human_bytes,
)

LABELS = {
    OURS: "collective (shared memory)",
    OURS_GLOO: "collective on Gloo (TCP)",
    TORCH: "raw torch Gloo",
    RAY: "ray.util.collective",
    STORE: "Ray object store",
    COPY: "plain copies through shared memory",
}
"""Each implementation of the op sweep in words, in legend order."""

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
                marker="o",
                markersize=4,
                color=COLORS.get(impl),
                label=label,
            )
    size_axis(ax, sorted({r["size"] for r in records}))
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)


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


def panels_figure(
    path: Path,
    panels: list[tuple[str, list[Record]]],
    value: Callable[[Record], float],
    ylabel: str,
    ticks: Callable[[float, Any], str] | None = None,
) -> None:
    """Draw ``panels`` (title, records), two a row, with one legend below them, into ``path``."""
    if not 0 < len(panels) <= MAX_PANELS:
        raise ValueError(f"a figure takes 1 to {MAX_PANELS} panels, got {len(panels)}")
    rows, cols = (len(panels) + 1) // 2, min(2, len(panels))
    with pyplot() as plt:
        fig, axes = plt.subplots(
            rows,
            cols,
            figsize=(WIDTH_IN, 4.2 * rows + 1.0),
            squeeze=False,
            sharey=True,
            layout="constrained",
        )
        for ax, (title, records) in zip(axes.flat, panels, strict=False):
            lines(ax, records, value)
            ax.set_title(title)
            if ticks is not None:
                ax.yaxis.set_major_formatter(ticks)
        for ax in axes[:, 0]:
            ax.set_ylabel(ylabel)
        for ax in list(axes.flat)[len(panels) :]:
            ax.set_visible(False)
        legend(fig, axes.flat, list(LABELS.values()))
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=DPI, bbox_inches="tight")
        plt.close(fig)


def times(path: Path, results: dict[str, Any], op: str = "allreduce") -> bool:
    """Draw the median time of ``op`` against size, a panel per world size, into ``path``.

    Returns False, drawing nothing, when the run has no ``op`` or matplotlib is missing.
    """
    records = [r for r in results.get("results", []) if r["op"] == op]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    world_sizes = sorted({r["world_size"] for r in records})[:MAX_PANELS]
    if not world_sizes:
        return False
    panels = [
        (f"{op}, {n} ranks on one node", [r for r in records if r["world_size"] == n])
        for n in world_sizes
    ]
    panels_figure(
        path, panels, lambda r: r["time_us"]["median"], "median time per op", microseconds
    )
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


def busbw(path: Path, records: list[Record]) -> list[tuple[Path, list[str]]]:
    """Draw bus bandwidth against size, a panel per op and world size, ``MAX_PANELS`` a figure.

    Returns each figure's file and ops, the first in ``path``.
    """
    groups = op_groups(records)
    drawn = []
    for file, ops in zip(figure_paths(path, len(groups)), groups, strict=True):
        panels = []
        for op in ops:
            for n in sorted({r["world_size"] for r in records})[:MAX_PANELS]:
                rows = [r for r in records if (r["op"], r["world_size"]) == (op, n)]
                if rows:
                    panels.append((f"{op}, {n} ranks", rows))
        panels_figure(file, panels, lambda r: r["busbw_gbs"], "bus bandwidth (GB/s)")
        drawn.append((file, ops))
    return drawn


def bulk(path: Path, records: list[Record]) -> None:
    """Draw each workload's median time per row as grouped bars, a panel per node count."""
    node_counts = sorted({r["nodes"] for r in records})[:MAX_PANELS]
    impls = [i for i in BULK_LABELS if any(r["impl"] == i for r in records)]
    width = 0.8 / max(1, len(impls))
    with pyplot() as plt:
        fig, axes = plt.subplots(
            1,
            len(node_counts),
            figsize=(WIDTH_IN, 5.4),
            squeeze=False,
            sharey=True,
            layout="constrained",
        )
        for ax, nodes in zip(axes[0], node_counts, strict=True):
            rows = [r for r in records if r["nodes"] == nodes]
            workloads_here = list(dict.fromkeys(r["workload"] for r in rows))
            for j, impl in enumerate(impls):
                bars = [
                    (i + j * width, r["time_ms"]["median"])
                    for i, kind in enumerate(workloads_here)
                    for r in rows
                    if (r["workload"], r["impl"]) == (kind, impl)
                ]
                if bars:
                    xs, ys = zip(*bars, strict=True)
                    label = BULK_LABELS[impl]
                    ax.bar(xs, ys, width, label=label, color=COLORS.get(impl, "tab:gray"))
            ticks = []
            for kind in workloads_here:
                first = next(r for r in rows if r["workload"] == kind)
                ticks.append(f"{kind}\n{first['tensors']:,} tensors\n{human_bytes(first['bytes'])}")
            ax.set_xticks([i + width * (len(impls) - 1) / 2 for i in range(len(ticks))], ticks)
            ranks = rows[0]["world_size"]
            ax.set_title(f"{ranks} ranks on {'one node' if nodes == 1 else f'{nodes} nodes'}")
            ax.set_yscale("log")
            ax.grid(True, axis="y", alpha=0.3)
        axes[0][0].set_ylabel("median time per call (ms)")
        legend(fig, axes.flat, list(BULK_LABELS.values()))
        fig.savefig(path, dpi=DPI, bbox_inches="tight")
        plt.close(fig)
