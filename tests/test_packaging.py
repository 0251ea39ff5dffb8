"""The wheel holds the package and its type marker, and installs and imports on its own.

The wheel is built offline from a copy of the repository, with this environment's
setuptools. It is installed without dependencies into a fresh virtual environment that
sees this environment's packages through a path file, so torch and Ray are reused, not
downloaded; ``--system-site-packages`` would not do, as it exposes the base interpreter's
packages, not those of the virtual environment the tests run in.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import collective
from collective._version import DISTRIBUTION

ROOT = Path(__file__).resolve().parent.parent
STEP_TIMEOUT_S = 120
LEFT_OUT = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "_build", ".*_cache"
)


def run(*command: str | Path, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [str(c) for c in command],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


def build_wheel(tmp_path: Path) -> Path:
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=LEFT_OUT)
    out = tmp_path / "dist"
    pip_wheel: list[str | Path] = [sys.executable, "-m", "pip", "wheel", "--no-deps"]
    run(
        *pip_wheel,
        "--no-build-isolation",
        "--no-cache-dir",
        "--no-index",
        "-w",
        out,
        source,
        cwd=tmp_path,
    )
    (wheel,) = out.glob("*.whl")
    return wheel


def fresh_venv(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    site = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=venv)
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(site.strip()) / "reuse-test-env.pth").write_text("\n".join(sorted(ours)) + "\n")
    return python


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the wheel once for the module."""
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def test_wheel_holds_the_package_its_type_marker_and_no_tests(wheel: Path) -> None:
    dist_info = f"{DISTRIBUTION.replace('-', '_')}-{collective.__version__}"
    assert wheel.name == f"{dist_info}-py3-none-any.whl"
    names = zipfile.ZipFile(wheel).namelist()
    assert "collective/py.typed" in names
    assert "collective/groups/base.py" in names
    top = {"collective", "collective_torch_backend.py", f"{dist_info}.dist-info"}
    assert {name.split("/")[0] for name in names} == top, "torch's entry point is a module"
    metadata = zipfile.ZipFile(wheel).read(f"{dist_info}.dist-info/METADATA").decode()
    assert f"Name: {DISTRIBUTION}\n" in metadata
    assert "Provides-Extra: nccl\n" in metadata


def extra(metadata: str, name: str) -> set[str]:
    """Return the requirements of extra ``name`` in a wheel's METADATA."""
    marker = f'; extra == "{name}"'
    return {
        line.removeprefix("Requires-Dist: ").removesuffix(marker).replace(" ", "")
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist: ") and line.endswith(marker)
    }


def test_wheel_declares_a_docs_extra_that_the_tests_install_and_its_classifiers(
    wheel: Path,
) -> None:
    dist_info = f"{DISTRIBUTION.replace('-', '_')}-{collective.__version__}"
    metadata = zipfile.ZipFile(wheel).read(f"{dist_info}.dist-info/METADATA").decode()
    assert "Provides-Extra: docs\n" in metadata
    docs = extra(metadata, "docs")
    assert {"sphinx>=7.2", "myst-parser>=2.0", "pydata-sphinx-theme>=0.15"} <= docs
    assert docs <= extra(metadata, "test"), "the test suite builds the docs"
    classifiers = [
        line.removeprefix("Classifier: ")
        for line in metadata.splitlines()
        if line.startswith("Classifier: ")
    ]
    assert "Typing :: Typed" in classifiers
    assert "Programming Language :: Python :: 3 :: Only" in classifiers
    assert not [c for c in classifiers if c.startswith("License ::")], "license is SPDX"
    assert len(classifiers) == len(set(classifiers))


def test_wheel_installs_and_imports_in_a_fresh_venv(wheel: Path, tmp_path: Path) -> None:
    python = fresh_venv(tmp_path)
    pip_install: list[str | Path] = [sys.executable, "-m", "pip", "--python", python, "install"]
    run(*pip_install, "--no-deps", "--no-index", wheel, cwd=tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = (
        "import importlib.metadata, importlib.resources, collective, ray; "
        "print(collective.__version__); print(collective.__file__); "
        f"print(importlib.metadata.version({DISTRIBUTION!r})); "
        "print(importlib.resources.files('collective').joinpath('py.typed').is_file()); "
        "print(collective.gloo_available()); print(ray.__file__)"
    )
    out = run(python, "-c", probe, cwd=elsewhere).split()
    version, location, installed, typed, gloo, ray_location = out
    assert version == installed == collective.__version__
    assert Path(location).is_relative_to(tmp_path / "venv")
    assert typed == "True"
    assert gloo == "True"
    assert not Path(ray_location).is_relative_to(tmp_path / "venv")
