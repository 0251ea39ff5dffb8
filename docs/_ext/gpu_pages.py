"""The GPU numbers of the NCCL, landing and performance pages, read from the committed GPU run.

``python -m benchmarks.gpu_results --from $OUT/bench.json`` writes
``docs/performance/gpu.json`` from a run of ``bash tests/gpu/run.sh``. This module renders
its tables as Markdown, every row saying its GPU, world size and interconnect; without
the file each page says that no GPU run is committed and how to make one, and quotes no
GPU number.
"""

from __future__ import annotations

import re
from typing import Any

from benchmarks.gpu_results import (
    FILE,
    OURS,
    RAW,
    TITLES,
    TORCH,
    against,
    cell,
    headline_table,
    human,
    largest,
    nccl_version,
    shared,
    us,
    where,
    world_sizes,
)

HOW = (
    "On a machine with a GPU, `bash tests/gpu/run.sh` and then "
    f"`python -m benchmarks.gpu_results --from $OUT/bench.json` write `{FILE}`, which every "
    "GPU table of these pages is written from ([contributing]"
    "(contributing.md#committing-a-gpu-run))."
)
ABSENT = "No GPU run is committed yet, so the docs quote no GPU number."
MIB = 1 << 20
OUTPUT = re.compile(r"(--(?:json|text|profile) )\S*/")
"""An output option of the benchmark's command, whose folder the pages write as ``$OUT``."""
BANDWIDTH_OPS = ("allreduce", "broadcast", "allgather", "reducescatter", "alltoall")


def cuda(code: object) -> str:
    """Return a CUDA runtime version as CUDA writes it: ``13000`` is ``13.0``."""
    text = str(code)
    return f"{int(text) // 1000}.{int(text) % 1000 // 10}" if text.isdigit() else text


def provenance(meta: dict[str, Any]) -> str:
    """Return, in a sentence, which run the GPU tables come from."""
    versions = ", ".join(
        f"{title} {meta[key]}"
        for key, title in (("cupy", "cupy"), ("torch", "torch"))
        if key in meta
    )
    if "cuda runtime" in meta:
        versions += f", CUDA runtime {cuda(meta['cuda runtime'])}"
    command = OUTPUT.sub(r"\1$OUT/", str(meta.get("command")))
    gpus = int(meta.get("gpus", 0))
    return (
        f"The GPU tables come from `{FILE}`: {gpus} x {meta.get('gpu')} on "
        f"`{meta.get('machine')}`, NCCL {nccl_version(meta)}, {versions}"
        + (f", driver {meta['driver']}" if "driver" in meta else "")
        + (f", on {meta['date']}" if "date" in meta else "")
        + (f" at commit `{meta['commit']}`" if "commit" in meta else "")
        + f"; command `{command}`, from `bash tests/gpu/run.sh`."
    )


def calls(meta: dict[str, Any]) -> str:
    """Return how many calls the per-call times are the median of."""
    count = meta.get("overhead_calls")
    return f"{count:,}" if isinstance(count, int) else "its"


def per_call_table(body: dict[str, Any]) -> str:
    """Return the 8-byte allreduce's host time per call of every implementation."""
    over = body.get("overhead", {})
    ours = over[OURS]["median_us"]
    lines = [
        "| implementation | median | 10th to 90th percentile | in a burst, per call | "
        "against `collective` |",
        "|---|---|---|---|---|",
    ]
    for impl in [i for i in TITLES if i in over]:
        s = over[impl]
        versus = "—" if impl == OURS else against(ours, s["median_us"])
        lines.append(
            f"| {TITLES[impl]} | {us(s['median_us'])} | {us(s['p10_us'])} to "
            f"{us(s['p90_us'])} | {us(s['batch_us'])} | {versus} |"
        )
    return "\n".join(lines)


CHECKS = {
    OURS: "on the op's stream (`1`, the default)",
    "collective_sidecheck": "beside the op (`side`)",
    "collective_nocheck": "off (`0`)",
}
"""The mismatch check on the op's stream, beside it, and off, as ``benchmarks.nccl`` runs it."""


def check_table(body: dict[str, Any]) -> str:
    """Return what the mismatch check costs an 8-byte allreduce, from world size 2 on.

    Host time per call (each call timed alone, the slowest rank) and the op sweep's
    time per call of a burst, with the check on the op's stream, beside it and off.
    """
    meta = body["meta"]
    lines = [
        "| where | check | host time per call | over the check off | 8-byte allreduce, "
        "per call of a burst |",
        "|---|---|---|---|---|",
    ]
    for n, over in sorted((int(k), v) for k, v in body.get("overhead_by_world_size", {}).items()):
        off = over.get("collective_nocheck", {}).get("median_us")
        sweep = {
            r["impl"]: r["time_us"]["median"]
            for r in body.get("results", [])
            if (r["op"], r["world_size"], r["size"]) == ("allreduce", n, 8)
        }
        for impl in [i for i in CHECKS if i in over]:
            host = over[impl]["median_us"]
            extra = "—" if off is None or impl == "collective_nocheck" else f"{host - off:+.2f} µs"
            burst = us(sweep[impl]) if impl in sweep else "—"
            lines.append(f"| {where(meta, n)} | {CHECKS[impl]} | {us(host)} | {extra} | {burst} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def latency_table(body: dict[str, Any]) -> str:
    """Return the 8-byte allreduce of the op sweep, bursts then a sync, at every world size."""
    meta = body["meta"]
    lines = [
        f"| where | {TITLES[OURS]} | {TITLES[TORCH]} | {TITLES[RAW]} |",
        "|---|---|---|---|",
    ]
    for n in world_sizes(body):
        at = {
            r["impl"]: r["time_us"]["median"]
            for r in body.get("results", [])
            if (r["op"], r["world_size"], r["size"]) == ("allreduce", n, 8)
        }
        if OURS not in at:
            continue
        ours = at[OURS]
        cells = [cell(at.get(i), ours, us(at[i])) if i in at else "—" for i in (TORCH, RAW)]
        lines.append(f"| {where(meta, n)} | {us(ours)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


def bandwidth_tables(body: dict[str, Any]) -> list[str]:
    """Return, per world size with a GPU per rank, allreduce's bus bandwidth and every op's."""
    meta, parts = body["meta"], []
    records = body.get("results", [])
    for n in [n for n in world_sizes(body) if n > 1 and not shared(meta, n)]:
        rows = {
            (r["size"], r["impl"]): r["busbw_gbs"]
            for r in records
            if (r["op"], r["world_size"]) == ("allreduce", n) and r["size"] >= MIB
        }
        sizes = sorted({size for size, _ in rows})
        if sizes:
            parts += [f"allreduce, bus bandwidth, {where(meta, n)}:", ""]
            parts += [f"| size | {TITLES[OURS]} | {TITLES[TORCH]} | {TITLES[RAW]} |"]
            parts += ["|---|---|---|---|"]
            for size in [s for s in sizes if s in (MIB, 16 * MIB, 256 * MIB) or s == sizes[-1]]:
                ours = rows.get((size, OURS))
                cells = [
                    "—" if v is None or ours is None else cell(v, ours, f"{v:.1f} GB/s", True)
                    for v in (rows.get((size, TORCH)), rows.get((size, RAW)))
                ]
                shown = "—" if ours is None else f"{ours:.1f} GB/s"
                parts.append(f"| {human(size)} | {shown} | " + " | ".join(cells) + " |")
            parts.append("")
        ops = [(op, largest(body, op, n)) for op in BANDWIDTH_OPS]
        ops = [(op, at) for op, at in ops if OURS in at]
        if ops:
            parts += [f"Every op at its largest size, bus bandwidth, {where(meta, n)}:", ""]
            parts += [
                f"| op | {TITLES[OURS]} | {TITLES[TORCH]} | {TITLES[RAW]} |",
                "|---|---|---|---|",
            ]
            for op, at in ops:
                ours = at[OURS]["busbw_gbs"]
                cells = [
                    cell(at[i]["busbw_gbs"], ours, f"{at[i]['busbw_gbs']:.1f} GB/s", True)
                    if i in at
                    else "—"
                    for i in (TORCH, RAW)
                ]
                label = f"{op}, {human(at[OURS]['size'])}"
                parts.append(f"| {label} | {ours:.1f} GB/s | " + " | ".join(cells) + " |")
            parts.append("")
    return parts


def shared_table(body: dict[str, Any]) -> list[str]:
    """Return the results of ranks sharing one GPU, with the goals they meet and miss."""
    run = body.get("shared_gpu")
    if not run:
        return []
    gpu = run.get("versions", {}).get("gpu", body["meta"].get("gpu"))
    lines = [
        f"Ranks sharing one {gpu}, no interconnect (the transport of "
        "[ranks that share a GPU](#ranks-that-share-a-gpu); the `nccl` rows are NCCL over "
        "sockets, each rank a host of its own), median of the slowest rank:",
        "",
        "| what | world size | time |",
        "|---|---|---|",
    ]
    lines += [f"| {r['what']} | {r['world_size']} | {us(r['us'])} |" for r in run.get("rows", [])]
    goals = run.get("goals", {})
    if goals:
        verdicts = "; ".join(f"{goal}: {'met' if met else 'MISSED'}" for goal, met in goals.items())
        lines += ["", f"Goals: {verdicts}."]
    return [*lines, ""]


def nccl_body(body: dict[str, Any] | None) -> str:
    """Return the NCCL page's "How fast on GPUs": the committed GPU run's tables."""
    if body is None:
        return f"{ABSENT} {HOW}\n"
    meta = body["meta"]
    parts = [
        provenance(meta),
        "Every row names its GPU, world size and interconnect; in brackets, how the peer "
        "compares with `collective`, slower or faster.",
        "",
    ]
    if OURS in body.get("overhead", {}):
        parts += [
            f"Host time of one blocking 8-byte allreduce (`col.allreduce(x, name)`), "
            f"{where(meta, 1)}: the median of {calls(meta)} calls, each timed alone; the "
            "burst column is a run of calls then one sync:",
            "",
            per_call_table(body),
            "",
        ]
    checks = check_table(body)
    if checks:
        parts += [
            "What the mismatch check costs where there are peers to compare with (a group "
            "of one skips it), from the same run:",
            "",
            checks,
            "",
        ]
    latency = latency_table(body)
    if latency:
        parts += [
            "8-byte allreduce in the op sweep, time per call of a burst of calls then a "
            "sync, as nccl-tests times it:",
            "",
            latency,
            "",
        ]
    bandwidth = bandwidth_tables(body)
    parts += bandwidth or [
        "No row gives bandwidth between GPUs: the run had no world size with a GPU per "
        "rank above 1. At world size 1 an allreduce in place moves no byte.",
        "",
    ]
    parts += shared_table(body)
    notes = body.get("notes", [])
    if notes:
        parts += ["The run's notes:", "", *(f"- {note}" for note in notes), ""]
    parts += [f"`{FILE}` holds every op and size, with min, max and algbw.", ""]
    return "\n".join(parts)


def index_body(body: dict[str, Any] | None) -> str:
    """Return the landing page's GPU rows, or where they will come from."""
    link = "nccl.md#how-fast-on-gpus"
    if body is None:
        return (
            f"On GPUs: no GPU run is committed yet, so this page quotes no GPU number; "
            f"[how fast on GPUs]({link}) says how to make one.\n"
        )
    return (
        f"On GPUs, from `{FILE}` (NCCL {nccl_version(body['meta'])}); in brackets, how "
        "the peer compares with `collective`:\n\n" + headline_table(body, link) + "\n"
    )


def performance_body(body: dict[str, Any] | None) -> str:
    """Return the performance page's one sentence on GPUs."""
    if body is None:
        return "no GPU run is committed yet: the section says how to make one"
    meta = body["meta"]
    *rest, last = map(str, world_sizes(body))
    sizes = f"{', '.join(rest)} and {last}" if rest else last
    return f"`{FILE}`: {meta.get('gpus')} x {meta.get('gpu')}, world sizes {sizes}"
