"""The GPU status page says where each GPU feature last ran, from the committed record only.

``docs/gpu-status.md``'s table is generated from ``docs/performance/gpu-runs.json``
(``benchmarks.gpu_runs``): these tests hold the page to the record, check how a run of
``tests/gpu/run.sh`` is read and recorded, and that every GPU test belongs to a feature.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from benchmarks import gpu_results, gpu_runs

ROOT = Path(__file__).resolve().parent.parent

ENV = """date: 2027-01-15T10:20:30Z
host: Linux gpu-box 6.8.0 x86_64
commit: 1a2b3c4
0, NVIDIA H200, 570.86.15, 143771 MiB
python: 3.11.9
"""
"""What ``run.sh`` writes to ``env.txt`` on a machine with one GPU."""

LOG = """============================= test session starts ==============================
tests/gpu/test_ops.py::test_op[allreduce-torch-float32-1] PASSED         [  1%]
tests/gpu/test_ops.py::test_op[broadcast-cupy-int8-2] PASSED             [  2%]
tests/gpu/test_watchdog.py::test_ranks_that_allreduce_different_counts_both_raise FAILED [  3%]
tests/gpu/test_watchdog.py::test_check_args_on_nccl_raises_the_same_argument_error_on_every_rank PASSED [  4%]
tests/gpu/test_gpu_routed.py::test_ranks_whose_sizes_route_apart_both_raise SKIPPED (needs NCCL 2.30) [  5%]
tests/gpu/test_shared_gpu.py::test_op[allreduce-torch-float32-False] ERROR [  6%]
=========================== short test summary info ============================
FAILED tests/gpu/test_watchdog.py::test_ranks_that_allreduce_different_counts_both_raise - x
"""  # noqa: E501
"""A ``pytest -v`` log of a few GPU tests: passes, a failure, a skip and an error."""


def test_the_page_holds_the_table_of_the_committed_record() -> None:
    page = gpu_runs.PAGE.read_text(encoding="utf-8")
    assert gpu_runs.block_of(page) == gpu_runs.block(gpu_runs.load())
    for feature in gpu_runs.FEATURES:
        assert f"| {feature} |" in page


def test_a_run_is_read_per_feature_and_recorded_with_its_gpu_date_and_commit(
    tmp_path: Path,
) -> None:
    record, page = tmp_path / "gpu-runs.json", tmp_path / "gpu-status.md"
    shutil.copy(gpu_runs.RECORD, record)
    shutil.copy(gpu_runs.PAGE, page)
    run = gpu_runs.record(LOG, ENV, record, page)
    assert run["date"] == "2027-01-15" and run["commit"] == "1a2b3c4"
    assert (run["gpu"], run["gpus"]) == ("NVIDIA H200", 1)
    assert run["features"]["Plain NCCL ops"] == {"passed": 2, "failed": 0, "skipped": 0}
    assert run["features"]["The mismatch check"] == {"passed": 1, "failed": 1, "skipped": 0}
    assert run["features"]["The shared-GPU transport"]["failed"] == 1  # an error fails too
    text = page.read_text(encoding="utf-8")
    assert gpu_runs.block_of(text) == gpu_runs.block(gpu_runs.load(record))
    rows = dict(re.findall(r"^\| (.+?) \| (.+?) \|$", text, flags=re.M))
    where = "2027-01-15, NVIDIA H200, commit `1a2b3c4`"
    assert rows["Plain NCCL ops"] == f"{where}: 2 passed"
    assert rows["The mismatch check"] == f"{where}: 1 failed, 1 passed"
    assert rows["Routed ops (NCCL multi-rank)"] == gpu_runs.NOT_YET  # skipped: not run
    assert rows["CUDA graphs"] == gpu_runs.NOT_YET
    later = LOG.replace("PASSED", "SKIPPED").replace("FAILED", "SKIPPED")
    gpu_runs.record(later, ENV.replace("1a2b3c4", "9f9f9f9"), record, page)
    rows = dict(re.findall(r"^\| (.+?) \| (.+?) \|$", page.read_text(), flags=re.M))
    assert rows["Plain NCCL ops"] == f"{where}: 2 passed"  # the last run in which it ran


def test_a_run_without_a_gpu_or_without_a_test_outcome_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="names no GPU"):
        gpu_runs.run_of(LOG, "date: 2027-01-15\nnvidia-smi: not found\n")
    with pytest.raises(ValueError, match="no GPU test's outcome"):
        gpu_runs.run_of("tests/gpu/test_ops.py ..F.  [100%]\n", ENV)
    log, env = tmp_path / "pytest.log", tmp_path / "env.txt"
    log.write_text(LOG)
    env.write_text("nvidia-smi: not found\n")
    assert gpu_results.main(["--tests", str(log), "--env", str(env)]) == 1


def test_every_gpu_test_belongs_to_a_feature() -> None:
    """A new GPU test says which feature it runs, or the page could never show it."""
    unclaimed = []
    for path in sorted((ROOT / "tests" / "gpu").glob("test_*.py")):
        for name in re.findall(r"^def (test_\w+)", path.read_text(encoding="utf-8"), re.M):
            node = f"tests/gpu/{path.name}::{name}"
            if not gpu_runs.features_of(node):
                unclaimed.append(node)
    assert not unclaimed, f"add these to benchmarks/gpu_runs.FEATURES: {unclaimed}"


def test_the_page_is_in_the_docs_and_the_readme_and_landing_page_link_it() -> None:
    conf = (ROOT / "docs" / "conf.py").read_text(encoding="utf-8")
    assert '"gpu-status"' in conf.split("\nSECTIONS = {", 1)[1].split("}", 1)[0]
    assert "docs/gpu-status.md" in (ROOT / "README.md").read_text(encoding="utf-8")
    assert "(gpu-status.md)" in (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
