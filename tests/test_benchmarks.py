"""The benchmark CLI runs end to end in quick mode and writes a well-formed table, JSON and plot.

This checks the shape of the output and that every implementation computed the right
result, never the speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPS = {"allreduce", "allgather", "broadcast", "reducescatter"}
IMPLS = {"collective", "torch_gloo", "ray_collective", "object_store"}


def test_quick_benchmark_writes_table_json_and_plot(tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "results.json", tmp_path / "busbw.png"
    command = [sys.executable, "-m", "benchmarks", "--quick", "--sizes", "4K,64K"]
    out_md = tmp_path / "results.md"
    command += ["--json", str(out_json), "--plot", str(out_png), "--markdown", str(out_md)]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    for op in OPS:
        assert f"# {op}, world size 2" in done.stdout
    assert "size(B)" in done.stdout and "busbw" in done.stdout and "#wrong" in done.stdout
    data = json.loads(out_json.read_text())
    assert set(data["meta"]) >= {"command", "torch", "ray", "seconds", "unavailable"}
    results = data["results"]
    for op in OPS:
        for size in (4096, 65536):
            impls = {r["impl"] for r in results if (r["op"], r["size"]) == (op, size)}
            expected = IMPLS if op in {"allreduce", "allgather"} else IMPLS - {"object_store"}
            assert impls == expected - set(data["meta"]["unavailable"]), (op, size, impls)
    for r in results:
        assert r["wrong"] == 0, r
        assert r["world_size"] == 2 and r["dtype"] == "float32"
        assert r["time_us"]["min"] <= r["time_us"]["median"] <= r["time_us"]["max"]
        assert r["busbw_gbs"] > 0 and r["algbw_gbs"] > 0
        assert r["ratio_to_ours"] > 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = out_md.read_text()
    for heading in ("## Machine and command", "## Bus bandwidth", "## Table"):
        assert heading in page
    assert "](busbw.png)" in page


def test_bad_arguments_are_rejected_before_anything_starts() -> None:
    command = [sys.executable, "-m", "benchmarks", "--ops", "allreduce,scan"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "unknown ops" in done.stderr and "scan" in done.stderr
