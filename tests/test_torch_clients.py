"""torch code written for torch.distributed runs on the "collective" backend, client by client.

Each client is a program in ``examples/`` that the test runs as a user runs it: the
tutorial's programs in ``torch.multiprocessing`` processes, DDP and FSDP2 in
``torch.multiprocessing.spawn`` children, a script under ``torchrun``, and Ray Train's
``TorchTrainer`` in its own Ray cluster. Every program checks each rank's result
itself (against Gloo's, or against what the tutorial says each rank holds) and prints
one line per rank; the tests assert every rank's line and the program's exit status.
The programs all start with the module, two at a time (``runs``), the longest first.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Programs, selected

ROOT = Path(__file__).resolve().parent.parent
RUN_TIMEOUT_S = 300
AT_ONCE = 2


def _ranks(line: str, count: int) -> list[str]:
    return [line.format(rank=rank) for rank in range(count)]


CLIENTS: dict[str, list[str]] = {
    "torch_ray_train.py": [
        *_ranks("worker {rank}: backend 'collective', world size 2, loss", 2),
        "every worker holds the same parameters: True",
        "every worker trained on 'collective': True",
    ],
    "torch_tutorial.py": [
        *_ranks("rank {rank} printed what the tutorial says it holds: True", 2),
        "Rank  1  has data  tensor(20.)",
        "Rank  0  has data  [1.0, 2.0]",
        "the tutorial's programs ran on 'collective': True",
    ],
    "torch_ddp.py": [
        *_ranks("rank {rank}, DDP's own averaging: parameters equal to Gloo's: True", 2),
        *_ranks("rank {rank}, a comm hook's future: parameters equal to Gloo's: True", 2),
        "every rank holds the same parameters: True",
        "training changed the parameters: True",
    ],
    "torch_fsdp.py": [
        *_ranks("rank {rank}: full parameters equal to Gloo's: True (largest difference 0)", 2),
        "every rank gathers the same parameters: True",
        "training changed the parameters: True",
    ],
    "torch_torchrun.py": [
        *_ranks(
            "rank {rank} of 4 on 'collective', local rank {rank}: every op's result is right: True",
            4,
        ),
        "every rank ran every op right under torchrun: True",
    ],
}
"""Each client's example, in the order they start, and the lines it prints when every
rank's result is right."""


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest) -> Iterator[Programs]:
    """Start the examples of the tests this session runs, two at a time in ``CLIENTS``' order."""
    programs = Programs(AT_ONCE)
    chosen = {
        str(item.callspec.params["name"])
        for item in selected(request)
        if isinstance(item, pytest.Function) and item.originalname == RUNS_A_CLIENT
    }
    for name in CLIENTS:
        if name in chosen:
            command = [sys.executable, str(ROOT / "examples" / name)]
            programs.start(name, command, RUN_TIMEOUT_S, cwd=ROOT)
    yield programs
    programs.close()


@pytest.mark.parametrize("name", list(CLIENTS))
def test_client_runs_on_collective_with_every_rank_right(name: str, runs: Programs) -> None:
    result = runs.result(name)
    output = result.stdout[-6000:] + result.stderr[-6000:]
    assert result.returncode == 0, output
    for line in CLIENTS[name]:
        assert line in result.stdout, (line, output)


RUNS_A_CLIENT = test_client_runs_on_collective_with_every_rank_right.__name__


def test_every_torch_example_is_a_client_here() -> None:
    examples = sorted(p.name for p in (ROOT / "examples").glob("torch_*.py"))
    assert examples == sorted(CLIENTS)
    for name in examples:
        assert 'BACKEND = "collective"' in (ROOT / "examples" / name).read_text(), name
