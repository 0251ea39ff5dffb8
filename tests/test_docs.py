"""The Sphinx site builds with warnings as errors, and its generated pages match the code."""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import collective
import collective.types
from collective import tensor
from collective.groups.base import BaseGroup
from collective.groups.gloo import GlooGroup
from collective.groups.nccl import NCCLGroup
from collective.types import ReduceOp

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BUILD_TIMEOUT_S = 300
PAGES = [
    "index",
    "quickstart",
    "concepts",
    "support-matrix",
    "weight-sync",
    "migration",
    "nccl",
    "performance",
    "troubleshooting",
    "api",
]

sys.path.insert(0, str(DOCS / "_ext"))
import support_matrix  # noqa: E402


def build(source: Path, out: Path) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "-b", "html", str(source), str(out)],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


def test_docs_build_with_warnings_as_errors(tmp_path: Path) -> None:
    build(DOCS, tmp_path)
    for page in PAGES:
        assert (tmp_path / f"{page}.html").is_file(), page
    api = (tmp_path / "api.html").read_text()
    for name in collective.__all__:
        assert f'id="collective.{name}"' in api, name
    matrix = (tmp_path / "support-matrix.html").read_text()
    assert matrix.count('class="support-matrix') == 2 + len(support_matrix.backend_classes())
    quickstart = (tmp_path / "quickstart.html").read_text()
    assert "init_collective_group" in quickstart


def tiny_png() -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\x00\x00"))
        + chunk(b"IEND", b"")
    )


def copy_of_docs(tmp_path: Path, with_optional: bool, results_show_plot: bool) -> Path:
    shutil.copytree(DOCS, tmp_path / "docs", ignore=shutil.ignore_patterns("_build"))
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    docs = tmp_path / "docs"
    shutil.rmtree(docs / "performance", ignore_errors=True)
    if with_optional:
        (docs / "performance").mkdir()
        plot = "![busbw](busbw.png)\n\n" if results_show_plot else ""
        (docs / "performance" / "results.md").write_text(
            f"## Results\n\n{plot}| size | busbw |\n|---|---|\n| 1 MiB | 1.5 GB/s |\n"
        )
        (docs / "performance" / "busbw.png").write_bytes(tiny_png())
    return docs


@pytest.mark.parametrize(
    ("with_optional", "results_show_plot"),
    [(False, False), (True, False), (True, True)],
    ids=["without", "with", "with-plot-in-results"],
)
def test_optional_pages_build_either_way(
    tmp_path: Path, with_optional: bool, results_show_plot: bool
) -> None:
    out = tmp_path / "html"
    build(copy_of_docs(tmp_path, with_optional, results_show_plot), out)
    performance = (out / "performance.html").read_text()
    index = (out / "index.html").read_text()
    assert ("No benchmark results" in performance) is not with_optional
    assert ("1.5 GB/s" in performance) is with_optional
    assert performance.count('src="_images/busbw.png"') == int(with_optional)
    assert 'href="failure-model.html"' in index


def bare(cls: type[BaseGroup]) -> BaseGroup:
    """Return an unconnected instance, enough to call its argument checks."""
    return object.__new__(cls)


def accepted(check: object, *args: object) -> bool:
    try:
        check(*args)  # type: ignore[operator]
    except (TypeError, ValueError):
        return False
    return True


def test_ops_table_matches_the_backend_classes() -> None:
    header, rows = support_matrix.ops_table()
    assert header == ["op", "gloo", "nccl"]
    ops = [row[0] for row in rows]
    assert set(ops) == {
        name
        for name in BaseGroup.__abstractmethods__
        if name not in {"backend", "check_backend_availability", "destroy_group"}
    }
    for op in ops:
        assert op in collective.__all__, f"{op} has no public function"
    for cls in (GlooGroup, NCCLGroup):
        assert not cls.__abstractmethods__
    assert all(cell == support_matrix.YES for row in rows for cell in row[1:])


def test_dtypes_table_matches_what_the_checks_accept() -> None:
    header, rows = support_matrix.dtypes_table()
    assert [row[0] for row in rows] == sorted(tensor.DTYPES)
    columns = {title: i for i, title in enumerate(header)}
    gloo, nccl = bare(GlooGroup), bare(NCCLGroup)
    for row in rows:
        dtype = row[0]
        torch_dtype = getattr(torch, dtype)
        numpy_ok = accepted(lambda d=dtype: tensor.spec(np.zeros(1, dtype=d), "x"))
        cpu = tensor.spec(torch.zeros(1, dtype=torch_dtype), "x")
        cuda = tensor.TensorSpec("torch", (1,), dtype, "cuda:0")
        expected = {
            "gloo (numpy.ndarray on cpu)": numpy_ok
            and accepted(gloo.check_tensor, tensor.spec(np.zeros(1, dtype=dtype), "x"), "x"),
            "gloo (torch.Tensor on cpu)": accepted(gloo.check_tensor, cpu, "x"),
            "nccl (torch.Tensor on cuda)": accepted(nccl.check_tensor, cuda, "x"),
            "nccl (cupy.ndarray on cuda)": numpy_ok and accepted(nccl.check_tensor, cuda, "x"),
        }
        assert set(expected) == set(header[1:])
        for title, ok in expected.items():
            cell = row[columns[title]]
            assert cell == (support_matrix.YES if ok else support_matrix.NO), (dtype, title)
    on_cuda = tensor.TensorSpec("torch", (1,), "float32", "cuda:0")
    assert accepted(gloo.check_tensor, tensor.spec(torch.zeros(1), "x"), "x")
    assert not accepted(gloo.check_tensor, on_cuda, "x")


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_reduce_ops_table_matches_the_reduction_checks(backend: str) -> None:
    classes: dict[str, type[GlooGroup] | type[NCCLGroup]] = {"gloo": GlooGroup, "nccl": NCCLGroup}
    cls = classes[backend]
    group = bare(cls)
    header, rows = support_matrix.reduce_ops_table(backend)
    assert header[1:] == sorted(cls.dtypes)
    assert [row[0] for row in rows] == [op.name for op in ReduceOp]
    for row in rows:
        op = ReduceOp[row[0]]
        for dtype, cell in zip(header[1:], row[1:], strict=True):
            ok = accepted(group.check_reduce_op, op, dtype)
            assert cell == (support_matrix.YES if ok else support_matrix.NO), (op, dtype)


def test_troubleshooting_covers_every_exception_type() -> None:
    page = (DOCS / "troubleshooting.md").read_text()
    defined = [
        name
        for name, value in vars(collective.types).items()
        if isinstance(value, type)
        and issubclass(value, BaseException)
        and value.__module__ == "collective.types"
    ]
    assert {"CollectiveError", "CollectiveTimeoutError", "GroupNotFoundError"} <= set(defined)
    headings = [line for line in page.splitlines() if line.startswith("## ")]
    for name in [*defined, "ValueError", "TypeError"]:
        assert any(f"`{name}`" in heading for heading in headings), name


def test_quickstart_runs_as_written() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    for rank in range(2):
        assert f"rank {rank}: {{'sum': [3.0, 3.0, 3.0, 3.0]" in result.stdout
    page = (DOCS / "quickstart.md").read_text()
    assert "../examples/quickstart.py" in page
