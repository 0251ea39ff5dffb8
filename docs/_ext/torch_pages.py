"""The torch.distributed page's numbers, read from the committed ``benchmarks.torch_backend`` run.

``python -m benchmarks.torch_backend --json docs/performance/torch_backend.json`` writes
the file; this module renders its goals, the op tables (``collective`` beside ``gloo``
at each world size), DDP's steps per second and the binding's cost per call as
Markdown. Without the file the page says how to make it and quotes no number.
"""

from __future__ import annotations

from typing import Any

from perf_pages import command, duration, goals_table, times_as, wrapped

from benchmarks.report import human
from benchmarks.torch_backend_ranks import NO_COMMUNICATION

FILE = "docs/performance/torch_backend.json"
OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter")
OURS, GLOO = "collective", "gloo"


def provenance(meta: dict[str, Any]) -> str:
    """Return, in a sentence, where and how the run was measured."""
    before, after = meta["load_average_before"][0], meta["load_average"][0]
    return (
        f"Measured on `{meta['machine']}`, {meta['cpus']} CPUs, shared with other jobs "
        f"(load average {before:.1f} at the start, {after:.1f} at the end), torch "
        f"{meta['torch']}, {meta['rounds']} rounds, {meta['seconds']} s, on {meta['when']}; "
        f"every rank a process on that one host. Each value is the median of the rounds "
        f"(a round counts the slowest rank), with the range of the rounds in brackets. "
        f"The results are in `{FILE}`, from:"
    )


def spread(cell: dict[str, float], scale: float = 1e-6) -> str:
    """Return a median and its range of times: ``9.1 µs [8.7 to 12 µs]`` (an en dash between)."""
    low, high = (duration(cell[k] * scale) for k in ("min", "max"))
    return f"{duration(cell['median'] * scale)} [{low}\u2013{high}]"


def against(ours: float, gloo: float) -> str:
    """Return how ``collective``'s time compares with gloo's: ``21x faster``, ``1.3x slower``."""
    if gloo >= ours:
        return f"{times_as(gloo / ours)}\u00a0faster"
    return f"{times_as(ours / gloo)}\u00a0slower"


def op_table(rows: list[dict[str, Any]], world_size: int) -> str:
    """Return the median time per call of every op and size at ``world_size``, both backends."""
    cells = {(r["op"], r["size"], r["backend"]): r["time_us"] for r in rows}
    ops = [op for op in OPS if any(key[0] == op for key in cells)]
    header = ["size", *(f"`{op}`" for op in ops)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for size in sorted({r["size"] for r in rows}):
        row = [human(size)]
        for op in ops:
            ours, gloo = cells.get((op, size, OURS)), cells.get((op, size, GLOO))
            if ours is None or gloo is None:
                row.append("—")
                continue
            times = (duration(t["median"] * 1e-6) for t in (ours, gloo))
            row.append(" / ".join(times) + f" ({against(ours['median'], gloo['median'])})")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def ddp_table(rows: list[dict[str, Any]]) -> str:
    """Return DDP's steps per second on each backend, and with no communication, by world size.

    Runs from before the no-communication row have no such column.
    """
    alone = any(r["backend"] == NO_COMMUNICATION for r in rows)
    head = "| ranks | `collective` | `gloo` | `collective` / `gloo` |"
    lines = [head + (" no communication |" if alone else ""), "|---|---|---|---|" + "---|" * alone]
    for world_size in sorted({r["world_size"] for r in rows}):
        rate = {r["backend"]: r["steps_per_s"] for r in rows if r["world_size"] == world_size}
        cells = [
            f"{rate[b]['median']:.3g} [{rate[b]['min']:.3g}\u2013{rate[b]['max']:.3g}]"
            for b in (OURS, GLOO, NO_COMMUNICATION)
            if b in rate
        ]
        ratio = rate[OURS]["median"] / rate[GLOO]["median"]
        extra = f" {cells[2]} |" if len(cells) > 2 else (" |" if alone else "")
        lines.append(f"| {world_size} | {cells[0]} | {cells[1]} | {ratio:.2f}x |" + extra)
    return "\n".join(lines)


def binding_table(rows: list[dict[str, Any]]) -> str:
    """Return what the torch binding adds per 8-byte call over ``col.allreduce``."""
    lines = [
        "| ranks | `dist.all_reduce` | `col.allreduce` | added by the binding |",
        "|---|---|---|---|",
    ]
    for r in rows:
        cells = [spread(r[k]) for k in ("torch_us", "library_us")]
        added = r["added_us"]
        cells.append(
            f"{added['median']:.2f}\u00a0µs [{added['min']:.2f} to {added['max']:.2f}\u00a0µs]"
        )
        lines.append(f"| {r['world_size']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def numbers_body(data: dict[str, Any] | None) -> str:
    """Return the page's numbers: goals, ops, DDP and the binding, from the committed run."""
    if data is None:
        return (
            "No run is committed yet: run `python -m benchmarks.torch_backend --json "
            f"{FILE}` from the repository root.\n"
        )
    meta = data["meta"]
    parts = [
        provenance(meta),
        "",
        "```bash",
        wrapped(command(meta)),
        "```",
        "",
        "Goals, at 2 ranks:",
        "",
        goals_table(data["goals"]),
        "",
    ]
    for world_size in sorted({r["world_size"] for r in data["ops"]}):
        rows = [r for r in data["ops"] if r["world_size"] == world_size]
        parts += [
            f"Median time per call at {world_size} ranks, `collective` / `gloo`:",
            "",
            op_table(rows, world_size),
            "",
        ]
    gradients = meta["ddp_gradient_bytes"] / (1 << 20)
    parts += [
        f"DDP training steps per second, a model with {gradients:g} MiB of gradients "
        f"(bias-free 1024 x 1024 linear layers, SGD) on a batch of {meta['ddp_batch']}, "
        f"torch on {meta['threads_per_rank']} thread per rank"
        + (
            "; the last column is DDP's step with a comm hook that sends nothing, "
            "faster than any backend can be:"
            if any(r["backend"] == NO_COMMUNICATION for r in data["ddp"])
            else ":"
        ),
        "",
        ddp_table(data["ddp"]),
        "",
        "The torch binding's cost: an 8-byte all-reduce through `dist.all_reduce` beside "
        "`col.allreduce` on the same group, per call:",
        "",
        binding_table(data["binding"]),
        "",
    ]
    return "\n".join(parts)
