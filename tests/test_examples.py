"""Every program in examples/ runs as a user runs it, passes its own checks, and is documented.

An example that cannot run on this machine (no GPU) prints ``skipped: <reason>`` as its
first line and exits with status 0; its test is then skipped with that reason. Such an
example is a GPU example: a line of its docstring starts with ``GPU_MARKER``, and
``tests/gpu/run.sh`` runs every example so marked on a GPU machine. The examples that
the session tests all start with the module, two at a time (``runs``), each
starting its own Ray cluster as it does for a user.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Programs, selected

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
RUN_TIMEOUT_S = 300
AT_ONCE = 2
"""Examples run at once: each waits often enough (for its cluster and actors to start)
that two at a time finish sooner on two cores than one at a time."""
RUN_ELSEWHERE = {
    "quickstart.py": "tests/test_docs.py::test_quickstart_runs_as_written",
    "elastic_sgd.py": "tests/test_elastic_example.py",
    "weight_sync.py": "tests/test_bulk_ray.py::test_weight_sync_example_runs",
    **{
        name: "tests/test_torch_clients.py"
        for name in (
            "torch_tutorial.py",
            "torch_ddp.py",
            "torch_fsdp.py",
            "torch_torchrun.py",
            "torch_ray_train.py",
        )
    },
}
"""Examples that another test already runs, and that test."""
HELPERS = {"spawned.py": "starts the ranks of torch_ddp.py and torch_fsdp.py"}
"""Modules in examples/ that examples import: not programs of their own."""
MUST_PRINT = {
    "demo.py": ["live groups in this job: []", "exits by itself"],
    "data_parallel_sgd.py": [
        "replicas identical on all 4 actors: True",
        "replicas match the model trained on all the data in one process: True",
        "loss fell by more than half: True",
    ],
    "parameter_server.py": [
        "same weights as the SGD run in one process: True",
        "weights within 0.05 of the truth: True",
    ],
    "multigpu.py": ["every GPU holds what it should: True"],
    "nccl_allreduce.py": ["every rank holds the sum: True"],
    "gpu_weight_sync.py": ["every rollout holds the trainer's weights after each step: True"],
    "colocated_weight_sync.py": [
        "transport of each rank: ['shared_gpu', 'shared_gpu', 'shared_gpu', 'shared_gpu']",
        "every rollout holds the trainer's weights after each step: True",
    ],
    "rdt_weight_sync.py": ["every rollout holds the trainer's weights after each step: True"],
    "sync_weights.py": ["every rollout holds the trainer's weights after each step: True"],
}
"""Lines each example prints when its checks pass, beyond its exit status."""
GPU_MARKER = "GPU example:"
"""How a line of a GPU example's docstring starts; ``tests/gpu/run.sh`` finds them by it."""


def programs() -> list[Path]:
    """Return the programs in examples/, the modules they import left out."""
    return [p for p in EXAMPLES.glob("*.py") if p.name not in HELPERS]


def examples() -> list[str]:
    return sorted(p.name for p in programs() if p.name not in RUN_ELSEWHERE)


def gpu_examples() -> list[str]:
    """Return the examples marked as GPU examples, which ``tests/gpu/run.sh`` runs."""
    return sorted(
        p.name
        for p in programs()
        if any(line.startswith(GPU_MARKER) for line in p.read_text().splitlines())
    )


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest) -> Iterator[Programs]:
    """Start every example that this session tests, two at a time in the tests' order."""
    programs = Programs(AT_ONCE)
    for item in selected(request):
        if isinstance(item, pytest.Function) and item.originalname == RUNS_AN_EXAMPLE:
            name = str(item.callspec.params["name"])
            programs.start(name, [sys.executable, str(EXAMPLES / name)], RUN_TIMEOUT_S, cwd=ROOT)
    yield programs
    programs.close()


@pytest.mark.parametrize("name", examples())
def test_example_runs_and_passes_its_checks(name: str, runs: Programs) -> None:
    result = runs.result(name)
    output = result.stdout[-4000:] + result.stderr[-4000:]
    assert result.returncode == 0, output
    if result.stdout.startswith("skipped: "):
        assert name in gpu_examples(), f"{name} skips here: mark it with {GPU_MARKER!r}"
        pytest.skip(f"{name}: {result.stdout.splitlines()[0].removeprefix('skipped: ')}")
    for line in MUST_PRINT.get(name, []):
        assert line in result.stdout, output


RUNS_AN_EXAMPLE = test_example_runs_and_passes_its_checks.__name__


def test_every_example_is_a_whole_program_shown_in_the_docs() -> None:
    pages = "".join(page.read_text() for page in (ROOT / "docs").glob("*.md"))
    for path in sorted(programs()):
        assert 'if __name__ == "__main__":' in path.read_text(), path.name
        assert f"../examples/{path.name}" in pages, path.name
    assert set(MUST_PRINT) <= {p.name for p in programs()}


def test_gpu_examples_are_marked_and_run_sh_runs_them_by_the_marker() -> None:
    assert "multigpu.py" in gpu_examples()
    script = (ROOT / "tests" / "gpu" / "run.sh").read_text()
    assert f"grep -l '^{GPU_MARKER}' examples/*.py" in script
    rows = {
        line.split("`")[1]: line
        for line in (ROOT / "docs" / "examples.md").read_text().splitlines()
        if line.startswith("| `")
    }
    assert sorted(rows) == sorted(p.name for p in programs())
    for name, row in rows.items():
        needs = row.rstrip(" |").rsplit("|", 1)[1]
        assert ("GPU" in needs) == (name in gpu_examples()), row
