"""The GPU tables are drawn from one committed GPU run, and say where each row ran."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import gpu_results

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs" / "_ext"))
import gpu_pages  # noqa: E402

MIB = 1 << 20
TOPOLOGY = (
    "\x1b[4m\tGPU0\tGPU1\tGPU2\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
    "GPU0\t X \tNV18\tSYS\t0-47\t0\t\tN/A\n"
    "GPU1\tNV18\t X \tSYS\t0-47\t0\t\tN/A\n"
    "GPU2\tSYS\tSYS\t X \t48-95\t1\t\tN/A\n"
    "\nLegend:\n\n  X    = Self\n  NV#  = Connection traversing a bonded set of # NVLinks\n"
)
OVERHEAD_US = {
    "collective": 3.5,
    "collective_torch": 3.4,
    "collective_nocheck": 3.45,
    "cupy_nccl": 0.37,
    "torch_nccl": 14.4,
}
BUSBW = {"collective": 300.0, "torch_nccl": 297.0, "cupy_nccl": 301.0}


def record(impl: str, op: str, n: int, size: int, us: float, busbw: float) -> dict[str, Any]:
    return {
        "impl": impl,
        "op": op,
        "world_size": n,
        "size": size,
        "count": size // 4,
        "type": "float",
        "iters": 20,
        "reps": 5,
        "time_us": {"median": us, "min": us * 0.9, "max": us * 1.1},
        "algbw_gbs": busbw,
        "busbw_gbs": busbw,
        "wrong": 0,
    }


def run(gpus: int = 2) -> dict[str, Any]:
    """Return a run of ``bash tests/gpu/run.sh`` as ``bench.json`` holds it, made up."""
    results = []
    for n in (1, 2, 3):
        for impl, bw in BUSBW.items():
            results.append(record(impl, "allreduce", n, 8, 10.0 + n + len(impl), 0.0))
            if n == 2:
                results += [
                    record(impl, "allreduce", n, size, size / bw / 1e3, bw * (size / (1 << 30)))
                    for size in (MIB, 16 * MIB, 1 << 30)
                ]
                results.append(record(impl, "allgather", n, 1 << 30, 4000.0, bw - 20))
    return {
        "meta": {
            "command": "python -m benchmarks.nccl --budget-s 200 --json /tmp/out/bench.json",
            "python": "3.12.3",
            "machine": "Linux-6.8-x86_64-with-glibc2.39",
            "seconds": 190.0,
            "gpus": gpus,
            "unavailable": "",
            "overhead_calls": 2000,
            "world_sizes": [1, 2, 3],
            "date": "2026-11-28",
            "commit": "abc1234",
            "topology": TOPOLOGY,
            "gpu": "NVIDIA H100 80GB HBM3",
            "cupy": "14.2.0",
            "nccl (cupy)": "22805",
            "cuda runtime": "13000",
            "torch": "2.11.0+cu130",
            "nccl (torch)": "2.28.5",
        },
        "results": results,
        "overhead": {
            impl: {"median_us": v, "p10_us": v * 0.9, "p90_us": v * 1.2, "batch_us": v * 0.8}
            for impl, v in OVERHEAD_US.items()
        },
        "overhead_by_world_size": {
            "2": {
                impl: {"median_us": v, "p10_us": v, "p90_us": v, "batch_us": v}
                for impl, v in {
                    "collective": 4.1,
                    "collective_sidecheck": 4.0,
                    "collective_nocheck": 3.6,
                    "cupy_nccl": 0.4,
                }.items()
            }
        },
        "notes": ["world size 3: 3 ranks share 2 GPU(s), each a host of its own"],
        "shared_gpu": {
            "versions": {"gpu": "NVIDIA H100 80GB HBM3"},
            "rows": [
                {"what": "allreduce 8 B x1000, shared", "world_size": 2, "us": 21.5},
                {"what": "allreduce 8 B x1000, nccl", "world_size": 2, "us": 412.0},
            ],
            "goals": {"8 B allreduce <= 25 us": True, "large allreduce >= 20x": False},
            "size_bytes": 1 << 30,
        },
    }


def test_topology_gives_the_links_between_the_ranks_gpus() -> None:
    assert gpu_results.links(TOPOLOGY, 2) == ["NV18"]
    assert gpu_results.links(TOPOLOGY, 3) == ["NV18", "SYS"]
    assert gpu_results.links("", 2) == []
    meta = run()["meta"]
    assert gpu_results.interconnect(meta, 2) == "NVLink (NV18)"
    assert gpu_results.interconnect(meta, 1) == "no interconnect"
    assert "sockets" in gpu_results.interconnect(meta, 3)


def test_every_row_says_its_gpu_world_size_and_interconnect() -> None:
    meta = run()["meta"]
    assert gpu_results.where(meta, 1) == (
        "NVIDIA H100 80GB HBM3, one GPU, world size 1, no interconnect"
    )
    assert gpu_results.where(meta, 2) == "NVIDIA H100 80GB HBM3, two GPUs, world size 2, " + (
        "NVLink (NV18)"
    )
    assert "three ranks sharing two GPUs, world size 3" in gpu_results.where(meta, 3)
    assert gpu_results.nccl_version(meta) == "2.28.5"


def test_nccl_section_shows_ours_beside_torch_and_bare_nccl_losses_included() -> None:
    text = gpu_pages.nccl_body(run())
    assert "No GPU run is committed" not in text
    assert "`docs/performance/gpu.json`" in text and "NCCL 2.28.5" in text
    per_call = next(line for line in text.splitlines() if "torch `ProcessGroupNCCL`" in line)
    assert "14.4 µs" in per_call and "4.1x slower" in per_call
    bare = next(line for line in text.splitlines() if line.startswith("| bare `cupy"))
    assert "0.37 µs" in bare and "9.5x faster" in bare
    assert "one GPU, world size 1, no interconnect" in text
    assert "allreduce, bus bandwidth, NVIDIA H100 80GB HBM3, two GPUs, world size 2, " in text
    row = next(line for line in text.splitlines() if line.startswith("| 1 GiB |"))
    assert "300.0 GB/s" in row and "297.0 GB/s (1.0% slower)" in row
    assert "301.0 GB/s (0.3% faster)" in row
    assert "three ranks sharing two GPUs, world size 3" in text
    assert "Ranks sharing one NVIDIA H100 80GB HBM3, no interconnect" in text
    assert "21.5 µs" in text and "large allreduce >= 20x: MISSED" in text
    assert "world size 3: 3 ranks share 2 GPU(s)" in text


def test_one_gpu_run_has_no_bandwidth_row_and_says_why() -> None:
    body = run(gpus=1)
    body["results"] = [r for r in body["results"] if r["world_size"] == 1]
    body["meta"].pop("topology")
    assert gpu_results.problems(body) == []
    text = gpu_pages.nccl_body(body)
    assert "GB/s" not in text
    assert "No row gives bandwidth between GPUs" in text
    index = gpu_pages.index_body(body)
    assert "one GPU, world size 1" in index and "GB/s" not in index


def test_an_absent_file_gives_no_number_and_says_how_to_make_one() -> None:
    for text in (
        gpu_pages.nccl_body(None),
        gpu_pages.index_body(None),
        gpu_pages.performance_body(None),
        gpu_results.readme_block(None),
    ):
        assert "no gpu run is committed" in text.lower(), text
        assert not any(unit in text for unit in ("µs", "GB/s")), text
    assert "python -m benchmarks.gpu_results --from $OUT/bench.json" in gpu_pages.nccl_body(None)


def test_landing_and_readme_rows_are_the_headlines_of_the_file() -> None:
    body = run()
    index = gpu_pages.index_body(body)
    readme = gpu_results.readme_block(body)
    for row in gpu_results.headline_rows(body):
        for text in (index, readme):
            assert " | ".join(row[1:]) in text, row
    rows = gpu_results.headline_rows(body)
    assert [r[1] for r in rows] == [gpu_results.where(body["meta"], n) for n in (1, 2)]
    assert "docs/nccl.md#how-fast-on-gpus" in readme and "(nccl.md#how-fast-on-gpus)" in index


def test_publishing_checks_the_run_then_writes_the_file_and_the_readme(tmp_path: Path) -> None:
    source, to, readme = tmp_path / "bench.json", tmp_path / "gpu.json", tmp_path / "README.md"
    readme.write_text(f"# x\n\n{gpu_results.readme_block(None)}\n\n## Install\n")
    args = ["--from", str(source), "--to", str(to), "--readme", str(readme)]
    body = run()
    body["meta"].pop("topology")
    source.write_text(json.dumps(body))
    assert gpu_results.main(args) == 1
    assert not to.exists()
    topology = tmp_path / "topo.txt"
    topology.write_text(TOPOLOGY)
    assert gpu_results.main([*args, "--topology", str(topology)]) == 0
    published = json.loads(to.read_text())
    assert gpu_results.links(published["meta"]["topology"], 2) == ["NV18"]
    text = readme.read_text()
    assert gpu_results.readme_block_of(text) == gpu_results.readme_block(published)
    assert text.startswith("# x\n\n") and text.endswith("\n\n## Install\n")


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda b: b["meta"].update(unavailable="no GPU: none"), "measured no GPU"),
        (lambda b: b["overhead"].pop("collective"), "per-call time of collective"),
        (lambda b: b["results"][0].update(wrong=1), "wrong result"),
        (lambda b: b["meta"].pop("gpu"), "no 'gpu'"),
    ],
)
def test_a_run_that_measured_no_gpu_or_wrongly_is_refused(change: Any, problem: str) -> None:
    body = copy.deepcopy(run())
    change(body)
    assert any(problem in p for p in gpu_results.problems(body)), gpu_results.problems(body)


def test_the_run_without_a_gpu_is_refused() -> None:
    """What ``tests/gpu/run.sh`` writes on a machine without a GPU cannot be published."""
    body = {"meta": {"unavailable": "no GPU: no CUDA", "gpus": 0}, "results": [], "overhead": {}}
    assert any("measured no GPU" in p for p in gpu_results.problems(body))


def test_the_mismatch_checks_cost_is_a_table_of_its_own_from_two_ranks() -> None:
    body = run()
    body["results"].append(record("collective_sidecheck", "allreduce", 2, 8, 11.5, 0.0))
    text = gpu_pages.nccl_body(body)
    rows = [line for line in text.splitlines() if line.startswith("| NVIDIA") and "`side`" in line]
    assert len(rows) == 1 and "world size 2" in rows[0], rows
    assert "| 4 µs | +0.40 µs | 11.5 µs |" in rows[0], rows[0]
    on = next(line for line in text.splitlines() if "(`1`, the default) |" in line)
    assert "| 4.1 µs | +0.50 µs |" in on, on
    off = next(line for line in text.splitlines() if "off (`0`) |" in line)
    assert "| 3.6 µs | — |" in off, off
    del body["overhead_by_world_size"]
    assert "What the mismatch check costs" not in gpu_pages.nccl_body(body)
