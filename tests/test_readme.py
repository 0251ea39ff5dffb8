"""The README's test command is the one CI runs, its demo a real script, its GPU lines a run."""

from __future__ import annotations

from pathlib import Path

from benchmarks import gpu_results

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command() -> None:
    ci_command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    readme_commands = [
        line.strip() for line in (ROOT / "README.md").read_text().splitlines() if "venv" in line
    ]
    assert ci_command in readme_commands


def test_readme_demo_command_names_an_existing_script() -> None:
    readme = (ROOT / "README.md").read_text()
    demo = next(line for line in readme.splitlines() if "examples/" in line and "venv" in line)
    script = demo.split()[-1]
    assert (ROOT / script).is_file()
    assert "-c constraints.txt" in demo
    assert (ROOT / "constraints.txt").read_text().split() == ["torch==2.13.0"]


def test_readme_install_lines_are_the_docs_snippet() -> None:
    """The README cannot include a file, so its copy of the install lines must match it."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    assert block == (ROOT / "docs" / "_snippets" / "install.txt").read_text()


def test_readme_gpu_lines_are_those_of_the_committed_gpu_run() -> None:
    """The README cannot be generated at build time: its GPU lines must match the file."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    committed = gpu_results.load(ROOT / "docs" / "performance" / "gpu.json")
    assert gpu_results.readme_block_of(readme) == gpu_results.readme_block(committed), (
        "run python -m benchmarks.gpu_results --from docs/performance/gpu.json"
    )
