"""The GPU tooling runs in its no-GPU mode here, without Ray, so that it cannot rot unseen.

``tests/gpu/run.sh`` is what a lent GPU machine runs; CI has no GPU, so it checks that
the script, the GPU suite's collection and the NCCL benchmark still work and say why
they skip, with Ray hidden as it is on that machine. The rank processes the benchmark
and the world-size-2 tests use are checked with plain CPU jobs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from benchmarks import nccl, nccl_peers
from benchmarks.nccl_ranks import RankContext, RankError, RankPool
from tests.gpu import cases

ROOT = Path(__file__).resolve().parent.parent
needs_no_gpu = pytest.mark.skipif(
    not cases.no_gpu_reason(), reason="a GPU is here: run bash tests/gpu/run.sh for real"
)


@pytest.fixture
def without_ray(tmp_path: Path) -> dict[str, str]:
    """Return an environment in which ``import ray`` fails, as on the lent GPU machines."""
    hidden = tmp_path / "hide"
    hidden.mkdir()
    (hidden / "ray.py").write_text('raise ImportError("ray is hidden for this test")\n')
    env = dict(os.environ, PYTHONPATH=str(hidden), PYTHON=sys.executable)
    env.pop("RAY_ADDRESS", None)
    return env


@needs_no_gpu
def test_run_sh_without_gpu_or_ray_says_why_and_succeeds(
    tmp_path: Path, without_ray: dict[str, str]
) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", "tests/gpu/run.sh"],
        cwd=ROOT,
        env=dict(without_ray, OUT=str(out)),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == [
        "bench.json",
        "bench.log",
        "bench.txt",
        "bench_check.txt",
        "env.txt",
        "pytest.log",
        "summary.md",
    ]
    summary = (out / "summary.md").read_text()
    assert "ray: not importable" in summary
    assert "## pytest tests/gpu (exit 0)" in summary
    assert " skipped in " in summary and "no GPU: the nccl backend is not available" in summary
    assert "failed" not in summary.lower().split("## python -m benchmarks.nccl")[0]
    assert "## GPU examples (exit 0)" in summary
    reason = "skipped: Ray is not importable (GPU_WHEELS=DIR installs it)"
    assert f"examples/multigpu.py: {reason}" in summary
    assert f"===== examples/multigpu.py: {reason}" in (out / "pytest.log").read_text()
    assert "## python -m benchmarks.nccl (exit 0)" in summary
    assert nccl.HEADER in summary
    for op in nccl_peers.OPS:
        assert f"# {op}, world size 1: unavailable: no GPU" in summary


@needs_no_gpu
def test_run_sh_runs_only_the_parts_asked_for(tmp_path: Path, without_ray: dict[str, str]) -> None:
    """A machine lent for less than the whole run takes its parts in separate calls."""
    out = tmp_path / "out"
    env = dict(without_ray, OUT=str(out), RUN_PARTS="tests", GPU_TESTS="tests/gpu/test_ops.py")
    done = subprocess.run(
        ["bash", "tests/gpu/run.sh"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = (out / "summary.md").read_text()
    assert "## pytest tests/gpu (exit 0)" in summary and " skipped in " in summary
    assert "examples/multigpu.py: skipped: not run (RUN_PARTS=tests)" in summary
    assert "benchmark: not run (RUN_PARTS=tests)" in summary
    assert "test_ops.py" in (out / "pytest.log").read_text()
    assert not (out / "bench.json").exists()


def test_run_sh_parses() -> None:
    done = subprocess.run(
        ["bash", "-n", "tests/gpu/run.sh"], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr


def test_gpu_suite_collects_every_case() -> None:
    assert len(cases.op_cases()) == 4 * 15 + 7 + 9 * 15 + 2
    assert ("allreduce_avg", "torch", "bfloat16") in cases.op_cases()
    assert ("allreduce_avg", "torch", "int8") not in cases.op_cases()
    assert not any(kind == "cupy" and dtype == "bfloat16" for _, kind, dtype in cases.op_cases())


def _exchange(context: RankContext, salt: str) -> list[str]:
    context.store.set(f"{salt}/{context.rank}", f"{salt}{context.rank}".encode())
    got = [context.store.get(f"{salt}/{r}", timedelta(seconds=30)) for r in range(2)]
    return [value.decode() for value in got]


def _fail_on_rank_1(context: RankContext) -> int:
    if context.rank == 1:
        raise ValueError("rank 1 refuses")
    return context.rank


def _sleep(context: RankContext, seconds: float) -> None:
    time.sleep(seconds)


def test_rank_pool_runs_jobs_and_names_failing_and_hung_ranks() -> None:
    pool = RankPool(2, timeout=timedelta(seconds=60))
    with pool:
        assert pool.run(_exchange, "a") == [["a0", "a1"], ["a0", "a1"]]
        with pytest.raises(RankError, match=r"(?s)failed on ranks \[1\].*rank 1 refuses"):
            pool.run(_fail_on_rank_1)
        assert pool.run(_exchange, "b") == [["b0", "b1"], ["b0", "b1"]]
        start = time.monotonic()
        with pytest.raises(RankError, match="did not finish _sleep within"):
            pool.run(_sleep, 60.0, timeout=timedelta(seconds=1))
        assert time.monotonic() - start < 20
        with pytest.raises(RankError, match="stopped"):
            pool.run(_exchange, "c")


def _record(impl: str, op: str, size: int, seconds: float) -> dict[str, Any]:
    return nccl.record(impl, op, 1, size, [([seconds, seconds * 2, seconds / 2], 0)], 5)


def test_benchmark_tables_read_as_nccl_tests_and_compare_with_raw_nccl() -> None:
    records = [
        _record("cupy_nccl", "allreduce", 1 << 30, 0.010),
        _record("collective", "allreduce", 1 << 30, 0.0102),
        _record("torch_nccl", "allreduce", 1 << 30, 0.0101),
        _record("cupy_nccl", "allreduce", 8, 10e-6),
        _record("collective", "allreduce", 8, 15e-6),
    ]
    text = nccl.table(records)
    assert "# allreduce, world size 1" in text and nccl.HEADER in text
    assert "1.50x" in text and "1.02x" in text
    gaps = nccl.gap_table(records)
    assert "at 1073741824 B, world size 1" in gaps
    assert "+1.96%" in gaps and "+0.99%" in gaps
    stats = {"median_us": 9.0, "p10_us": 8.0, "p90_us": 12.0, "batch_us": 7.0}
    overhead = nccl.overhead_table(
        {"cupy_nccl": stats, "collective": {**stats, "median_us": 14}}, 9
    )
    assert "+5.00" in overhead


def test_benchmark_rejects_bad_arguments_before_starting_anything() -> None:
    with pytest.raises(SystemExit):
        nccl.arguments(["--ops", "allreduce,scan"])
    with pytest.raises(SystemExit):
        nccl.arguments(["--impls", "collective"])
    args = nccl.arguments(["--sizes", "8,4K,1G"])
    assert args.sizes == [8, 4096, 1 << 30]
    assert nccl.FULL_SIZES[0] == 8 and nccl.FULL_SIZES[-1] == 1 << 30
    assert nccl_peers.skip_reason("sendrecv", 8, 1) != ""
    assert nccl_peers.skip_reason("allgather", 4, 2) != ""
    assert nccl_peers.elements("allgather", 100, 3) == 24
