"""Publish a GPU run as the committed GPU results file, and say where each of its rows ran.

Usage: python -m benchmarks.gpu_results --from $OUT/bench.json [--topology FILE]
       [--interconnect TEXT] [--to docs/performance/gpu.json] [--readme README.md]
       python -m benchmarks.gpu_results --tests $OUT/pytest.log --env $OUT/env.txt

``--tests`` records where each GPU feature ran (``benchmarks.gpu_runs``): the run's
passed, failed and skipped GPU tests per feature, appended to
``docs/performance/gpu-runs.json``, whose table ``docs/gpu-status.md`` shows.

``bash tests/gpu/run.sh`` writes ``$OUT/bench.json``: ``python -m benchmarks.nccl``'s
run, with the results of ranks that share one GPU under ``"shared_gpu"``. This command
checks that the run measured a GPU (the GPU, NCCL's version, the 8-byte per-call times,
no wrong result, an interconnect for every world size with a GPU per rank), writes it to
``docs/performance/gpu.json`` and rewrites the README's GPU lines from it. The docs build
draws every GPU table from that same file (``docs/_ext/gpu_pages.py``), so every GPU
number the pages and the README quote is one the file holds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks import gpu_runs

ROOT = Path(__file__).resolve().parent.parent
GPU_JSON = ROOT / "docs" / "performance" / "gpu.json"
README = ROOT / "README.md"
FILE = "docs/performance/gpu.json"
"""The committed file, as the pages name it."""
OURS, OURS_TORCH, RAW, TORCH = "collective", "collective_torch", "cupy_nccl", "torch_nccl"
TITLES = {
    OURS: "`collective`, cupy array",
    OURS_TORCH: "`collective`, torch tensor",
    "collective_sidecheck": "`collective`, mismatch check beside the op (`side`)",
    "collective_nocheck": "`collective`, mismatch check off",
    TORCH: "torch `ProcessGroupNCCL`",
    RAW: "bare `cupy.cuda.nccl`",
}
"""The implementations of ``benchmarks.nccl``, in the order the tables show them."""
BEGIN = "<!-- gpu-results: written by python -m benchmarks.gpu_results; do not edit -->"
END = "<!-- /gpu-results -->"
LINKS = {
    "NV": "NVLink",
    "PIX": "PCIe through one switch",
    "PXB": "PCIe through several switches",
    "PHB": "PCIe through the CPU's host bridge",
    "NODE": "PCIe across the host bridges of one NUMA node",
    "SYS": "PCIe across NUMA nodes",
}
"""What each link of ``nvidia-smi topo -m`` is, in words."""
ANSI = re.compile(r"\x1b\[[0-9;]*m")
WORDS = {1: "one", 2: "two", 3: "three", 4: "four"}


def load(path: Path = GPU_JSON) -> dict[str, Any] | None:
    """Return the GPU results at ``path``, or None if there are none."""
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def run_meta(world_sizes: list[int]) -> dict[str, Any]:
    """Return what a GPU run records besides its versions: date, commit, GPU topology."""
    meta: dict[str, Any] = {
        "world_sizes": world_sizes,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
    }
    for key, command in (
        ("commit", ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]),
        ("topology", ["nvidia-smi", "topo", "-m"]),
        ("driver", ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
    ):
        if shutil.which(command[0]) is None:
            continue
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            continue
        if done.returncode == 0 and done.stdout.strip():
            text = ANSI.sub("", done.stdout).rstrip()
            meta[key] = text.splitlines()[0].strip() if key != "topology" else text
    return meta


def links(topology: str, world_size: int) -> list[str]:
    """Return the links of ``nvidia-smi topo -m`` between GPUs 0 to ``world_size - 1``."""
    lines = [ANSI.sub("", line).split() for line in topology.splitlines()]
    header = next((cols for cols in lines if cols and cols[0] == "GPU0"), [])
    columns = {name: i + 1 for i, name in enumerate(header) if re.fullmatch(r"GPU\d+", name)}
    rows = {cols[0]: cols for cols in lines if cols and re.fullmatch(r"GPU\d+", cols[0])}
    found = set()
    for a in range(world_size):
        for b in range(a + 1, world_size):
            row, col = rows.get(f"GPU{a}"), columns.get(f"GPU{b}")
            if row is None or col is None or col >= len(row):
                return []
            found.add(row[col])
    return sorted(found)


def link_words(link: str) -> str:
    """Return a link of ``nvidia-smi topo -m`` in words: ``NVLink (NV18)``."""
    kind = "NV" if link.startswith("NV") else link
    return f"{LINKS.get(kind, 'a link')} ({link})"


def shared(meta: dict[str, Any], world_size: int) -> bool:
    """Return whether the ranks of ``world_size`` shared the run's GPUs."""
    return world_size > int(meta.get("gpus", 0))


def interconnect(meta: dict[str, Any], world_size: int) -> str:
    """Return what joined the GPUs of a world size, in words, or that nothing did."""
    if world_size == 1:
        return "no interconnect"
    if shared(meta, world_size):
        return "no interconnect: NCCL over sockets on the host"
    if meta.get("interconnect"):
        return str(meta["interconnect"])
    found = links(str(meta.get("topology", "")), world_size)
    return ", ".join(map(link_words, found)) if found else "interconnect not recorded"


def where(meta: dict[str, Any], world_size: int) -> str:
    """Return where a row ran: the GPU, the world size and the interconnect, in words."""
    gpu = meta.get("gpu", "an unnamed GPU")
    gpus = int(meta.get("gpus", 0))
    if world_size == 1:
        ranks = "one GPU, world size 1"
    elif shared(meta, world_size):
        held = "one GPU" if gpus == 1 else f"{WORDS.get(gpus, gpus)} GPUs"
        ranks = f"{WORDS.get(world_size, world_size)} ranks sharing {held}, world size {world_size}"
    else:
        ranks = f"{WORDS.get(world_size, world_size)} GPUs, world size {world_size}"
    return f"{gpu}, {ranks}, {interconnect(meta, world_size)}"


def nccl_version(meta: dict[str, Any]) -> str:
    """Return the NCCL version the run's cupy loaded: ``2.28.5``."""
    code = str(meta.get("nccl (cupy)", ""))
    if not code.isdigit():
        return str(meta.get("nccl (torch)", "unknown"))
    value = int(code)
    major, rest = (value // 10000, value % 10000) if value >= 20900 else divmod(value, 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def world_sizes(body: dict[str, Any]) -> list[int]:
    """Return the world sizes the run measured; 1 wherever it timed the per-call cost."""
    found = {int(r["world_size"]) for r in body.get("results", [])}
    return sorted(found | ({1} if body.get("overhead") else set()))


def problems(body: dict[str, Any]) -> list[str]:
    """Return why ``body`` cannot be the committed GPU run; empty if it can."""
    meta = body.get("meta", {})
    found = []
    if meta.get("unavailable"):
        found.append(f"the run measured no GPU: {meta['unavailable']}")
    for key in ("gpu", "gpus", "nccl (cupy)", "cupy", "command"):
        if key not in meta:
            found.append(f"meta has no {key!r}")
    for impl in (OURS, RAW):
        if impl not in body.get("overhead", {}):
            found.append(f"no 8-byte per-call time of {impl}")
    if not body.get("results"):
        found.append("no op was measured")
    wrong = [r for r in body.get("results", []) if r.get("wrong")]
    if wrong:
        found.append(f"{len(wrong)} points computed a wrong result, the first {wrong[0]}")
    for n in world_sizes(body):
        if n > 1 and "not recorded" in interconnect(meta, n):
            found.append(
                f"world size {n} had a GPU per rank but no interconnect is recorded: pass "
                "--topology FILE (what nvidia-smi topo -m printed there) or --interconnect TEXT"
            )
    return found


def human(size: int) -> str:
    """Return ``size`` bytes as text: ``8 B``, ``64 KiB``, ``1 GiB``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size} B"


def us(value: float) -> str:
    """Return microseconds with three significant digits: ``3.43 µs``."""
    return f"{value:.3g} µs" if value < 1000 else f"{value:,.0f} µs"


def against(ours: float, theirs: float, higher_is_faster: bool = False) -> str:
    """Return how a peer compares with ours: ``4.1x slower``, ``1.3% faster``."""
    ratio = ours / theirs if higher_is_faster else theirs / ours
    if abs(ratio - 1) < 0.1:
        pct = abs(ratio - 1) * 100
        return "the same" if pct < 0.05 else f"{pct:.1f}% {'slower' if ratio > 1 else 'faster'}"
    if ratio >= 1:
        return f"{ratio:.2g}x slower" if ratio < 10 else f"{ratio:.0f}x slower"
    return f"{1 / ratio:.2g}x faster" if ratio > 0.1 else f"{1 / ratio:.0f}x faster"


def cell(value: float | None, ours: float, text: str, higher_is_faster: bool = False) -> str:
    """Return a peer's value and how it compares with ours, or a dash if not measured."""
    if value is None:
        return "—"
    return f"{text} ({against(ours, value, higher_is_faster)})"


def largest(body: dict[str, Any], op: str, world_size: int) -> dict[str, dict[str, Any]]:
    """Return each implementation's record of ``op`` at the world size's largest size."""
    rows = [r for r in body.get("results", []) if (r["op"], r["world_size"]) == (op, world_size)]
    if not rows:
        return {}
    size = max(r["size"] for r in rows)
    return {r["impl"]: r for r in rows if r["size"] == size}


def headline_rows(body: dict[str, Any]) -> list[list[str]]:
    """Return the headline rows: what, where, ours, torch's and bare NCCL's, each compared."""
    meta, rows = body.get("meta", {}), []
    over = body.get("overhead", {})
    if OURS in over:
        ours = over[OURS]["median_us"]
        peers = [over.get(i, {}).get("median_us") for i in (TORCH, RAW)]
        rows.append(
            ["8-byte allreduce, host time per call", where(meta, 1), us(ours)]
            + [cell(p, ours, us(p)) if p is not None else "—" for p in peers]
        )
    for n in world_sizes(body):
        at = largest(body, "allreduce", n)
        if n == 1 or shared(meta, n) or OURS not in at:
            continue
        ours = at[OURS]["busbw_gbs"]
        peers = [at[i]["busbw_gbs"] if i in at else None for i in (TORCH, RAW)]
        rows.append(
            [
                f"{human(at[OURS]['size'])} allreduce, bus bandwidth",
                where(meta, n),
                f"{ours:.1f} GB/s",
            ]
            + [cell(p, ours, f"{p:.1f} GB/s", True) if p is not None else "—" for p in peers]
        )
    return rows


def headline_table(body: dict[str, Any], link: str) -> str:
    """Return the headline rows as a Markdown table, each label linked to ``link``."""
    lines = [
        "| what | where | `collective` | torch `ProcessGroupNCCL` | bare NCCL |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| [{r[0]}]({link}) | " + " | ".join(r[1:]) + " |" for r in headline_rows(body)]
    return "\n".join(lines)


def readme_block(body: dict[str, Any] | None) -> str:
    """Return the README's GPU lines, between their markers, from the committed GPU run."""
    link = "docs/nccl.md#how-fast-on-gpus"
    if body is None:
        text = (
            f"On GPUs: no GPU run is committed yet, so no GPU number is quoted here. [How "
            f"fast on GPUs]({link}) says how a GPU machine makes `{FILE}`, which every GPU "
            "table is generated from."
        )
    else:
        text = (
            f"On GPUs, from `{FILE}` (NCCL {nccl_version(body['meta'])}; in brackets, how "
            "the peer compares with `collective`):\n\n" + headline_table(body, link)
        )
    return f"{BEGIN}\n{text}\n{END}"


def with_readme_block(readme: str, block: str) -> str:
    """Return ``readme`` with its GPU lines replaced by ``block``."""
    head, rest = readme.split(BEGIN, 1)
    return head + block + rest.split(END, 1)[1]


def readme_block_of(readme: str) -> str:
    """Return the GPU lines of ``readme``, markers included."""
    return BEGIN + readme.split(BEGIN, 1)[1].split(END, 1)[0] + END


def main(argv: list[str] | None = None) -> int:
    """Check a run, write it as the committed GPU run and rewrite the README's GPU lines."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_results", description=__doc__)
    parser.add_argument("--from", dest="source", type=Path, help="bench.json")
    parser.add_argument("--tests", type=Path, help="pytest.log: record where each feature ran")
    parser.add_argument("--env", type=Path, help="env.txt of the same run, with --tests")
    parser.add_argument("--topology", type=Path, help="what nvidia-smi topo -m printed")
    parser.add_argument("--interconnect", help="the interconnect in words, if no topology")
    parser.add_argument("--to", type=Path, default=GPU_JSON)
    parser.add_argument("--readme", type=Path, default=README)
    args = parser.parse_args(argv)
    if args.tests is not None:
        if args.env is None:
            parser.error("--tests needs --env (the env.txt of the same run)")
        try:
            gpu_runs.record(
                args.tests.read_text(encoding="utf-8"), args.env.read_text(encoding="utf-8")
            )
        except ValueError as exc:
            print(f"{args.tests} is not a GPU run to record: {exc}", file=sys.stderr)
            return 1
        print(f"recorded the run in {gpu_runs.RECORD_NAME} and its table; commit both")
    if args.source is None:
        if args.tests is None:
            parser.error("give --from bench.json, --tests pytest.log, or both")
        return 0
    body = json.loads(args.source.read_text(encoding="utf-8"))
    meta = body.setdefault("meta", {})
    if args.topology:
        meta["topology"] = ANSI.sub("", args.topology.read_text(encoding="utf-8")).rstrip()
    if args.interconnect:
        meta["interconnect"] = args.interconnect
    found = problems(body)
    if found:
        print(f"{args.source} is not a GPU run to publish:", file=sys.stderr)
        print("\n".join(f"- {p}" for p in found), file=sys.stderr)
        return 1
    args.to.parent.mkdir(parents=True, exist_ok=True)
    args.to.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
    readme = args.readme.read_text(encoding="utf-8")
    args.readme.write_text(with_readme_block(readme, readme_block(body)), encoding="utf-8")
    print(f"wrote {args.to} and the GPU lines of {args.readme}; commit both")
    return 0


if __name__ == "__main__":
    sys.exit(main())
