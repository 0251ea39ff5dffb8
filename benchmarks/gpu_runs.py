"""Where each GPU feature last ran on a real GPU: the record of GPU test runs, and its page.

``bash tests/gpu/run.sh`` writes ``$OUT/pytest.log`` (pytest ``-v``: one line per test)
and ``$OUT/env.txt`` (date, commit, GPUs). ``python -m benchmarks.gpu_results --tests
$OUT/pytest.log --env $OUT/env.txt`` counts each feature's passed, failed and skipped GPU
tests (``FEATURES`` says which tests are whose), appends the run to ``RECORD`` and
rewrites the table of ``docs/gpu-status.md`` from it. The table is never written by hand:
``tests/test_gpu_status.py`` checks that the page holds what the record says.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "docs" / "performance" / "gpu-runs.json"
PAGE = ROOT / "docs" / "gpu-status.md"
RECORD_NAME = "docs/performance/gpu-runs.json"
BEGIN = "<!-- gpu-runs: written by python -m benchmarks.gpu_results --tests; do not edit -->"
END = "<!-- /gpu-runs -->"
NOT_YET = "not yet run on a GPU: tested on stand-ins"

FEATURES: dict[str, tuple[str, ...]] = {
    "Plain NCCL ops": (
        r"test_ops\.py::",
        r"test_out_of_place\.py::",
        r"test_public_api\.py::test_(single|repeated|a_negated)",
        r"test_bulk\.py::",
        r"test_streams\.py::",
        r"test_ray_actors\.py::",
    ),
    "CUDA graphs": (
        r"test_capture\.py::",
        r"test_watchdog\.py::test_a_(captured|watched_replay)",
        r"test_review\.py::test_(m1|l2)_",
    ),
    "The mismatch check": (
        r"test_watchdog\.py::test_(ranks_that_allreduce_different|check_args)",
        r"test_review\.py::test_h1_",
    ),
    "The watchdog": (
        r"test_watchdog\.py::test_(a_peer_that_never_calls|at_three_ranks|a_watched_replay)",
        r"test_review\.py::test_(h3|m4|m1)_",
    ),
    "The shared-GPU transport": (r"test_shared_gpu\.py::", r"test_review_shared_gpu\.py::"),
    "Several GPUs with shared ones": (r"test_gpu_hierarchy\.py::",),
    "`*_multigpu` lists": (r"test_public_api\.py::test_multigpu", r"test_review\.py::test_m2_"),
    "CUDA RDT (`COLLECTIVE_SHM`)": (r"test_rdt_cuda_ray\.py::",),
    "Routed ops (NCCL multi-rank)": (r"test_gpu_routed\.py::",),
}
"""Each GPU feature, and the GPU tests (node ids under ``tests/gpu/``, by pattern) of it."""

RESULT = re.compile(r"^(tests/gpu/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
"""A line of ``pytest -v``: the test's node id, then its outcome."""
OUTCOMES = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "failed"}


def features_of(node: str) -> list[str]:
    """Return the features whose tests include the GPU test ``node``."""
    name = node.removeprefix("tests/gpu/")
    return [f for f, patterns in FEATURES.items() if any(re.match(p, name) for p in patterns)]


def outcomes(log: str) -> dict[str, str]:
    """Return each test's outcome in a ``pytest -v`` log: passed, failed or skipped."""
    found = {}
    for line in log.splitlines():
        m = RESULT.match(line)
        if m:
            found[m.group(1)] = OUTCOMES.get(m.group(2), "skipped")
    return found


def counts(tests: dict[str, str]) -> dict[str, dict[str, int]]:
    """Return, per feature, how many of its tests passed, failed and were skipped."""
    found: dict[str, dict[str, int]] = {}
    for node, outcome in tests.items():
        for feature in features_of(node):
            tally = found.setdefault(feature, {"passed": 0, "failed": 0, "skipped": 0})
            tally[outcome] += 1
    return found


def environment(text: str) -> dict[str, Any]:
    """Return the date, commit and GPUs that ``run.sh``'s ``env.txt`` records."""
    lines = text.splitlines()
    field = {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in lines) if v}
    gpus = [ln.split(",")[1].strip() for ln in lines if re.match(r"^\d+, [^,]+,", ln)]
    return {
        "date": field.get("date", "")[:10],
        "commit": field.get("commit", "unknown"),
        "gpu": gpus[0] if gpus else "",
        "gpus": len(gpus),
    }


def run_of(log: str, env: str) -> dict[str, Any]:
    """Return the record of one ``run.sh`` run: where it ran, and each feature's counts.

    Raises:
        ValueError: the run names no GPU, or ran no GPU test.

    """
    run = environment(env)
    run["features"] = counts(outcomes(log))
    if not run["gpu"]:
        raise ValueError("env.txt names no GPU (no nvidia-smi line): not a GPU run")
    if not run["features"]:
        raise ValueError("pytest.log holds no GPU test's outcome (run.sh runs pytest -v)")
    return run


def load(path: Path = RECORD) -> list[dict[str, Any]]:
    """Return the recorded runs, oldest first."""
    return list(json.loads(path.read_text(encoding="utf-8"))["runs"])


def last_run(runs: list[dict[str, Any]], feature: str) -> str:
    """Return the cell of ``feature``: its last run in which any of its tests ran, or none."""
    for run in reversed(runs):
        tally = run["features"].get(feature, {})
        if tally.get("passed") or tally.get("failed"):
            said = ", ".join(f"{tally[k]} {k}" for k in ("failed", "passed") if tally.get(k))
            where = f"{run['gpus']} x {run['gpu']}" if run["gpus"] > 1 else run["gpu"]
            return f"{run['date']}, {where}, commit `{run['commit']}`: {said}"
    return NOT_YET


def table(runs: list[dict[str, Any]]) -> str:
    """Return the page's table: every feature and where it last ran."""
    lines = ["| feature | last run on a real GPU |", "|---|---|"]
    lines += [f"| {feature} | {last_run(runs, feature)} |" for feature in FEATURES]
    return "\n".join(lines)


def block(runs: list[dict[str, Any]]) -> str:
    """Return the page's generated part, markers included."""
    source = f"Generated from `{RECORD_NAME}` ({len(runs)} GPU runs recorded)."
    return f"{BEGIN}\n{table(runs)}\n\n{source}\n{END}"


def block_of(page: str) -> str:
    """Return the generated part of ``page``, markers included."""
    return BEGIN + page.split(BEGIN, 1)[1].split(END, 1)[0] + END


def record(log: str, env: str, path: Path = RECORD, page: Path = PAGE) -> dict[str, Any]:
    """Append the run of ``log`` and ``env`` to the record; rewrite the page's table."""
    run = run_of(log, env)
    runs = [*load(path), run]
    path.write_text(json.dumps({"runs": runs}, indent=2) + "\n", encoding="utf-8")
    text = page.read_text(encoding="utf-8")
    page.write_text(text.replace(block_of(text), block(runs)), encoding="utf-8")
    return run
