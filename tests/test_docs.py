"""The Sphinx site builds with warnings as errors, and its generated pages match the code."""

from __future__ import annotations

import ast
import html
import json
import re
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
from benchmarks import gpu_results
from collective.frameworks import kinds
from collective.groups.base import BaseGroup
from collective.groups.gloo.group import GlooGroup
from collective.groups.nccl.group import NCCLGroup
from collective.types import ReduceOp
from tests.test_gpu_results import run as gpu_run

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BUILD_TIMEOUT_S = 300
PAGES = [
    "index",
    "get-started",
    "install",
    "quickstart",
    "examples",
    "how-to",
    "weight-sync",
    "elastic",
    "nccl",
    "inside-ray",
    "torch-distributed",
    "migration",
    "debugging",
    "reference",
    "api",
    "backends",
    "support-matrix",
    "environment",
    "troubleshooting",
    "explanation",
    "concepts",
    "data-movement",
    "failure-model",
    "performance",
    "performance-detail",
    "design-notes",
]
TOPICS = [
    "Groups",
    "Ops",
    "Many tensors",
    "Elastic groups",
    "Several GPUs per actor",
    "Inside Ray",
    "Queries",
    "Errors",
]
HISTORY = ["/tmp/", "run5", "run 5", "before issue", "it never did", "we used to", "first design"]
"""Phrases that tell the story of the code, or point at a scratch directory, not the user's."""

sys.path.insert(0, str(DOCS / "_ext"))
import perf_pages  # noqa: E402
import run_numbers  # noqa: E402
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


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("html")
    build(DOCS, out)
    return out


def page(site: Path, name: str) -> str:
    return (site / f"{name}.html").read_text(encoding="utf-8")


def test_docs_build_with_warnings_as_errors(site: Path) -> None:
    for name in PAGES:
        assert (site / f"{name}.html").is_file(), name
    matrix = page(site, "support-matrix")
    assert matrix.count('class="support-matrix') == 2 + len(support_matrix.backend_classes())
    assert "init_collective_group" in page(site, "quickstart")


def test_api_lists_every_public_name_once_by_topic(site: Path) -> None:
    api, backends = page(site, "api"), page(site, "backends")
    for name in collective.__all__:
        anchor = f'id="collective.{name}"'
        assert api.count(anchor) + backends.count(anchor) == 1, name
    assert 'id="collective.BaseGroup"' in backends
    assert 'href="#collective.types.CpuTransport"' in api, "signatures link the type they take"
    assert 'id="collective.register_collective_backend"' in backends
    headings = [api.index(f'{topic}<a class="headerlink"') for topic in TOPICS]
    assert headings == sorted(headings)
    groups, ops = (
        api.index('id="collective.init_collective_group"'),
        api.index('id="collective.allreduce"'),
    )
    errors = api.index('id="collective.CollectiveError"')
    assert headings[0] < groups < headings[1] < ops < headings[2] < headings[-1] < errors


def test_sections_list_their_pages(site: Path) -> None:
    index = page(site, "index")
    for section, pages in {
        "get-started": ["install", "quickstart", "examples"],
        "how-to": [
            "weight-sync",
            "nccl",
            "inside-ray",
            "torch-distributed",
            "migration",
            "debugging",
        ],
        "reference": ["api", "backends", "support-matrix", "environment", "troubleshooting"],
        "explanation": [
            "concepts",
            "data-movement",
            "failure-model",
            "performance",
            "performance-detail",
            "design-notes",
        ],
    }.items():
        assert f'href="{section}.html"' in index, section
        listing = page(site, section)
        for name in pages:
            assert f'href="{name}.html"' in listing, (section, name)


def test_landing_numbers_come_from_the_runs_and_link_to_performance(site: Path) -> None:
    results = perf_pages.load(DOCS / "performance" / "results.json")
    bulk = perf_pages.load(DOCS / "performance" / "bulk.json")
    points = perf_pages.points(perf_pages.HEADLINES, results, bulk)
    assert [p.ranks for p in points] == ["2", "4", "2", "4", "4"]
    index = page(site, "index")
    assert index.count('href="performance.html#summary"') >= len(points) + 1
    for point in points:
        assert perf_pages.duration(point.ours) in index, point
        for peer in perf_pages.PEERS:
            assert perf_pages.peer_cell(point, peer) in index, (point, peer)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    example = readme.split("```python\n", 1)[1].split("```", 1)[0]
    shown = html.unescape(re.sub(r"<[^>]+>", "", index))
    for line in example.splitlines():
        assert line in shown, line


def words(html_text: str) -> int:
    """Return the words of a page's article, without its navigation."""
    article = html_text.split('<article class="bd-article">', 1)[1].split("</article>", 1)[0]
    return len(html.unescape(re.sub(r"<[^>]+>", " ", article)).split())


def test_performance_page_is_short_and_opens_with_the_summary_and_the_plot(site: Path) -> None:
    performance = page(site, "performance")
    summary = performance.index('id="summary"')
    table = performance.index("<table", summary)
    plot = performance.index('src="_images/allreduce.png"')
    means = performance.index('id="what-this-means-for-your-actors"')
    limit = performance.index('id="what-limits-a-large-op"')
    method = performance.index('id="method-in-short"')
    rerun = performance.index('id="rerun-it"')
    assert summary < table < plot < means < limit < method < rerun
    assert performance.count("<img") == 1
    assert 'href="performance-detail.html"' in performance
    assert words(performance) < 2000, words(performance)
    assert "No benchmark results" not in performance
    assert "copy bound" not in performance


def test_detail_page_holds_the_method_and_the_runs_tables_and_the_notes_the_rest(
    site: Path,
) -> None:
    detail = page(site, "performance-detail")
    method = detail.index('id="method"')
    bulk = detail.index('id="many-tensors-at-once"')
    full = detail.index('id="full-results"')
    assert method < bulk < detail.index("2,000 tensors, 62.5\u00a0MiB, 4 ranks on one node") < full
    for name in ("busbw.png", "busbw-2.png", "busbw-3.png", "busbw-4.png"):
        assert detail.index(f'src="_images/{name}"') > full, name
    assert detail.count("The tables come from the run in") == 2
    for file in ("results.json", "bulk.json"):
        assert f"docs/performance/{file}" in detail, file
    assert "copy bound" not in detail
    assert 'id="where-the-time-goes"' not in detail
    assert words(detail) - words_of_tables(detail) < 1800, words(detail)
    notes = page(site, "design-notes")
    assert 'id="where-the-time-goes"' in notes
    assert 'id="host-time-per-call-on-one-gpu"' in notes


def words_of_tables(html_text: str) -> int:
    """Return the words inside the tables of a page's article."""
    article = html_text.split('<article class="bd-article">', 1)[1].split("</article>", 1)[0]
    tables = re.findall(r"<table.*?</table>", article, flags=re.S)
    return sum(len(html.unescape(re.sub(r"<[^>]+>", " ", t)).split()) for t in tables)


def test_summary_shows_every_many_tensor_workload_on_two_nodes_losses_included(
    site: Path,
) -> None:
    bulk = perf_pages.load(DOCS / "performance" / "bulk.json")
    assert bulk is not None
    measured = {(r["workload"], r["nodes"]) for r in bulk["results"]}
    shown = {(s.workload, s.nodes) for s in perf_pages.SUMMARY if isinstance(s, perf_pages.Bulk)}
    assert measured <= shown
    performance = page(site, "performance")
    points = perf_pages.points(perf_pages.SUMMARY, None, bulk)
    losses = [p for p in points if (p.peers.get(perf_pages.RAY) or p.ours) < p.ours]
    assert losses, "the committed run has a row where ray.util.collective is faster"
    for point in points:
        assert perf_pages.peer_cell(point, perf_pages.RAY) in performance, point
    assert 'id="where-it-loses"' in performance


ROLE = re.compile(r"\{(run|ratio|times|bound|meta)\}`([^`]+)`")
"""A number the build writes from a committed run (``docs/_ext/run_numbers.py``)."""
CITES = re.compile(r"committed|op sweep|many-tensor run|[\w-]+\.json", re.I)
"""Words that say a sentence's numbers come from a committed run."""
MEASURED = re.compile(
    r"(?<![\w.])\d[\d,]*(?:\.\d+)? ?(?:µs|ms|s|GB/s)(?![\w/])"
    r"|(?<![\w.])\d+(?:\.\d+)?(?:x|\u00a0?times)(?!\w)"
    r"|(?<![\w.])0\.\d+(?![\w.])"
    r"|load average \d"
)
"""A figure that a run measures: a time, a rate, a factor, a fraction, a load."""
STRICT = {"performance.md", "performance-detail.md"}
"""Pages whose every figure must be written from a committed run, cited or not."""


def prose(text: str) -> str:
    """Return a page's text without code blocks, directives, inline code and roles."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = ROLE.sub("", text)
    return re.sub(r"`[^`]*`", "", text)


def hand_typed_figures(path: Path) -> list[str]:
    """Return each paragraph's figures typed by hand where the paragraph cites a committed run."""
    found = []
    for paragraph in prose(path.read_text(encoding="utf-8")).split("\n\n"):
        if path.name in STRICT or CITES.search(paragraph):
            found += [
                f"{path.name}: {m.group(0)!r} in {paragraph.strip()[:160]!r}"
                for m in MEASURED.finditer(paragraph)
            ]
    return found


def test_no_page_types_a_figure_of_a_committed_run_by_hand(tmp_path: Path) -> None:
    """A sentence that cites a committed run names its points; the build writes the numbers.

    ``{run}`results:allreduce/2/64M``` becomes ``9.44 ms`` from ``results.json`` at each
    build, so no figure can drift from its file; a figure typed by hand beside a citation
    fails here. The performance pages may type no measured figure at all.
    """
    typed = [
        f
        for path in [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]
        for f in hand_typed_figures(path)
    ]
    assert not typed, "\n".join(typed)
    assert hand_typed_figures(DOCS / "performance.md") == []
    example = tmp_path / "example.md"
    example.write_text("In the committed op sweep it takes 13.9 ms, 0.36 of raw Gloo's time.")
    assert len(hand_typed_figures(example)) == 2


def test_every_number_a_page_names_is_in_a_committed_run(site: Path) -> None:
    """Each role names a point that a committed file holds; none is written as absent."""
    named = [
        (path.name, role, key)
        for path in [*sorted(DOCS.glob("*.md"))]
        for role, key in ROLE.findall(path.read_text(encoding="utf-8"))
    ]
    assert len(named) > 40, named
    for page_name, role, key in named:
        try:
            run_numbers.FORMATS[role](key)
        except run_numbers.MissingPointError as error:
            raise AssertionError(f"{page_name}: {{{role}}}`{key}`: {error}") from error
    for path in site.glob("*.html"):
        assert run_numbers.ABSENT not in path.read_text(encoding="utf-8"), path.name
    assert "9.44\u00a0ms" in page(site, "performance")


NOT_USER_PAGES = {"contributing.md"}
"""Pages for maintainers, which the word counts leave out."""
PAGE_WORDS = 3000
"""The most words one user page may hold."""
ALL_WORDS = 28000
"""The most words all the user pages together may hold."""
FIRST_PAGES = {
    "concepts.md", "data-movement.md", "debugging.md", "design-notes.md", "elastic.md",
    "environment.md", "examples.md", "explanation.md", "failure-model.md", "get-started.md",
    "how-to.md", "index.md", "inside-ray.md", "install.md", "migration.md", "nccl.md",
    "performance-detail.md", "performance.md", "quickstart.md", "reference.md",
    "support-matrix.md", "troubleshooting.md", "weight-sync.md",
}  # fmt: skip
FIRST_WORDS = 25000
"""The pages of the site before it gave GPU status and torch.distributed pages their own,
and their budget within ``ALL_WORDS``, which leaves those pages room."""
INCLUDE = re.compile(r"^```\{include\} (\S+)", flags=re.M)


def page_words(path: Path) -> int:
    """Return the words of a page's Markdown source, with the files it includes."""
    text = path.read_text(encoding="utf-8")
    return len(text.split()) + sum(page_words(path.parent / name) for name in INCLUDE.findall(text))


def user_pages() -> list[Path]:
    """Return every user page of the site: each Markdown page but the maintainers'."""
    pages = sorted(DOCS.glob("*.md"))
    included = {name for page in pages for name in INCLUDE.findall(page.read_text())}
    return [p for p in pages if p.name not in NOT_USER_PAGES | included]


def test_the_user_pages_stay_short() -> None:
    """Every user page, included files and code too, counts: each page and all of them
    have a ceiling, so that the pages cannot grow back unnoticed."""
    counts = {page.name: page_words(page) for page in user_pages()}
    assert FIRST_PAGES <= set(counts), FIRST_PAGES - set(counts)
    assert "concepts.md" in counts and "guide.md" not in counts
    too_long = {name: n for name, n in counts.items() if n > PAGE_WORDS}
    assert not too_long, too_long
    assert sum(counts.values()) <= ALL_WORDS, sorted(counts.items(), key=lambda c: -c[1])
    first = sum(n for name, n in counts.items() if name in FIRST_PAGES)
    assert first <= FIRST_WORDS, first


def test_gpu_numbers_say_the_gpu_and_the_world_size() -> None:
    for path in sorted(DOCS.glob("*.md")):
        for paragraph in path.read_text(encoding="utf-8").split("\n\n"):
            if re.search(r"H[12]00", paragraph) and re.search(r"\d ?(µs|ms|GB/s)", paragraph):
                assert "world size 1" in paragraph, (path.name, paragraph[:200])


HAND_GPU_NUMBER = re.compile(r"H[12]00|A100|B200|one GPU|ProcessGroupNCCL|cupy\.cuda\.nccl|NCCL")
GOAL = re.compile(r"goal at most \d+ ?µs")


def test_only_the_design_notes_quote_gpu_numbers_by_hand() -> None:
    """Every other GPU number is generated from ``docs/performance/gpu.json``."""
    for path in [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]:
        if path.name == "design-notes.md":
            continue
        text = path.read_text(encoding="utf-8")
        if path.name == "README.md":
            text = text.replace(gpu_results.readme_block_of(text), "")
        for paragraph in text.split("\n\n"):
            if HAND_GPU_NUMBER.search(paragraph):
                assert not re.search(r"\d ?(µs|GB/s)", GOAL.sub("", paragraph)), (
                    path.name,
                    paragraph[:300],
                )
    notes = (DOCS / "design-notes.md").read_text(encoding="utf-8")
    section = notes.split("## Host time per call on one GPU", 1)[1].split("\n## ", 1)[0]
    assert "from uncommitted runs" in section and "nccl.md#how-fast-on-gpus" in section


def test_inline_names_link_to_the_api_reference(site: Path) -> None:
    weight_sync = page(site, "weight-sync")
    assert 'href="api.html#collective.broadcast_state_dict"' in weight_sync
    assert 'href="api.html#collective.allreduce"' in page(site, "quickstart") + page(
        site, "concepts"
    )
    index = page(site, "index")
    assert 'href="api.html#collective.nccl_available"' in index


def test_torch_page_quotes_the_committed_run_and_stays_short(site: Path) -> None:
    """Every number of the torch.distributed page is generated from ``torch_backend.json``."""
    data = perf_pages.load(DOCS / "performance" / "torch_backend.json")
    assert data is not None
    text = html.unescape(re.sub(r"<[^>]+>", "", page(site, "torch-distributed")))
    for row in data["ops"]:
        assert perf_pages.duration(row["time_us"]["median"] * 1e-6) in text, row
    for row in data["ddp"]:
        assert f"{row['steps_per_s']['median']:.3g}" in text, row
    for goal in data["goals"]:
        assert goal["measured"] in text and goal["verdict"].upper() in text, goal
    assert perf_pages.command(data["meta"]) in text.replace("\\\n    ", "")
    source = (DOCS / "torch-distributed.md").read_text(encoding="utf-8")
    typed = MEASURED.findall(prose(source))
    assert not typed, f"figures typed by hand: generate them from the results file: {typed}"
    torch_page = page(site, "torch-distributed")
    code = words_of_tables(torch_page.replace("<pre", "<table").replace("</pre>", "</table>"))
    assert words(torch_page) - code < 1500, (words(torch_page), code)


def test_pages_speak_to_the_user_not_of_the_code_history(site: Path) -> None:
    for name in PAGES:
        text = page(site, name)
        for phrase in HISTORY:
            assert phrase not in text, (name, phrase)


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


RESULTS = {
    "meta": {"command": "python -m benchmarks --json /x/results.json", "machine": "Linux-x86_64"},
    "results": [
        {
            "impl": impl,
            "op": "allreduce",
            "world_size": 2,
            "size": 64 << 20,
            "time_us": {"median": median},
            "wrong": 0,
        }
        for impl, median in (("collective", 1.5e4), ("ray_collective", 4.25e4), ("torch_gloo", 4e4))
    ],
    "latency": [],
    "goals": [{"claim": "allreduce is fast", "measured": "0.38", "verdict": "pass"}],
}


def copy_of_docs(tmp_path: Path, with_optional: bool) -> Path:
    ignore = shutil.ignore_patterns("_build", "_generated")
    shutil.copytree(DOCS, tmp_path / "docs", ignore=ignore)
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    docs = tmp_path / "docs"
    shutil.rmtree(docs / "performance", ignore_errors=True)
    if with_optional:
        (docs / "performance").mkdir()
        (docs / "performance" / "results.json").write_text(json.dumps(RESULTS))
        (docs / "performance" / "busbw.png").write_bytes(tiny_png())
        (docs / "performance" / "gpu.json").write_text(json.dumps(gpu_run()))
    return docs


@pytest.mark.parametrize("with_optional", [False, True], ids=["without", "with"])
def test_optional_pages_build_either_way(tmp_path: Path, with_optional: bool) -> None:
    out = tmp_path / "html"
    build(copy_of_docs(tmp_path, with_optional), out)
    performance = (out / "performance.html").read_text()
    index = (out / "index.html").read_text()
    how_to = (out / "how-to.html").read_text()
    assert ("No benchmark results" in performance) is not with_optional
    assert ("15\u00a0ms" in performance) is with_optional
    detail = (out / "performance-detail.html").read_text()
    assert ("42.5\u00a0ms\u00a0(2.8x\u00a0slower)" in index) is with_optional
    assert ("allreduce is fast" in detail) is with_optional
    text = html.unescape(re.sub(r"<[^>]+>", "", performance))
    assert ("--json docs/performance/results.json" in text) is with_optional
    assert detail.count('src="_images/busbw.png"') == int(with_optional)
    assert performance.count('src="_images/allreduce.png"') == int(with_optional)
    assert 'href="elastic.html"' in how_to
    assert 'href="failure-model.html"' in index
    nccl = (out / "nccl.html").read_text()
    for name, text in (("nccl", nccl), ("index", index), ("performance", performance)):
        assert ("No GPU run is committed" in text or "no GPU run is committed" in text) is not (
            with_optional
        ), name
    assert ("<p>4.1x slower</p>" in nccl and "<p>9.5x faster</p>" in nccl) is with_optional
    assert ("14.4 µs (4.1x slower)" in index) is with_optional
    assert ("one GPU, world size 1, no interconnect" in nccl) is with_optional
    assert ("two GPUs, world size 2, NVLink (NV18)" in index) is with_optional
    assert ("µs" in nccl.split('id="how-fast-on-gpus"')[1].split("<section")[0]) is with_optional


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
    assert [row[0] for row in rows] == sorted(kinds.DTYPES)
    columns = {title: i for i, title in enumerate(header)}
    gloo, nccl = bare(GlooGroup), bare(NCCLGroup)
    for row in rows:
        dtype = row[0]
        torch_dtype = getattr(torch, dtype)
        numpy_ok = accepted(lambda d=dtype: kinds.spec(np.zeros(1, dtype=d), "x"))
        cpu = kinds.spec(torch.zeros(1, dtype=torch_dtype), "x")
        cuda = kinds.TensorSpec("torch", (1,), dtype, "cuda:0")
        expected = {
            "gloo (numpy.ndarray on cpu)": numpy_ok
            and accepted(gloo.check_tensor, kinds.spec(np.zeros(1, dtype=dtype), "x"), "x"),
            "gloo (torch.Tensor on cpu)": accepted(gloo.check_tensor, cpu, "x"),
            "nccl (torch.Tensor on cuda)": accepted(nccl.check_tensor, cuda, "x"),
            "nccl (cupy.ndarray on cuda)": numpy_ok and accepted(nccl.check_tensor, cuda, "x"),
        }
        assert set(expected) == set(header[1:])
        for title, ok in expected.items():
            cell = row[columns[title]]
            assert cell == (support_matrix.YES if ok else support_matrix.NO), (dtype, title)
    on_cuda = kinds.TensorSpec("torch", (1,), "float32", "cuda:0")
    assert accepted(gloo.check_tensor, kinds.spec(torch.zeros(1), "x"), "x")
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


def test_the_failure_model_gives_each_transport_a_row_for_mismatches_and_timeouts() -> None:
    page = (DOCS / "failure-model.md").read_text()
    for section in ("## Ranks that disagree", "## Ranks that never join an op"):
        assert section in page, section
        body = page.split(section, 1)[1].split("\n## ", 1)[0]
        rows = [line.split("|")[1].strip() for line in body.splitlines() if line.startswith("| ")]
        for transport in ("Shared memory", "Gloo", "NCCL"):
            assert any(row.startswith(transport) for row in rows), (section, transport)


FALSE_CLAIMS = {
    "index.md": ["a timeout that says which rank is missing"],
    "../README.md": ["get an error on every transport instead of mixed data"],
    "guide.md": ["raise an error instead of mixing data, on every transport"],
    "failure-model.md": ["get an error on every transport, whether or not"],
}
"""Claims the pages once made that a transport does not hold (NCCL: the op runs first)."""


def test_no_page_claims_what_a_transport_does_not_do() -> None:
    for page, claims in FALSE_CLAIMS.items():
        text = " ".join((DOCS / page).read_text().split())
        for claim in claims:
            assert claim not in text, (page, claim)
    send = " ".join((collective.send.__doc__ or "").split())
    assert "returns once the peer has it" not in send
    for transport in ("Shared memory", "Gloo", "NCCL"):
        assert transport in send, transport


def dotted(node: ast.AST) -> str:
    """Return ``a.b.c`` for a name or an attribute chain, else an empty string."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = dotted(node.value)
        return f"{inner}.{node.attr}" if inner else ""
    return ""


def environment_reads() -> dict[str, str]:
    """Return every environment variable the package reads, with where it reads it.

    A read is ``os.environ.get(X)``, ``os.environ[X]``, ``os.getenv(X)`` or
    ``X in os.environ``, where ``X`` is a string or a module-level string constant.
    """
    found: dict[str, str] = {}
    for path in sorted((ROOT / "collective").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        constants = {
            target.id: node.value.value
            for node in tree.body
            if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        for node in ast.walk(tree):
            name: ast.AST | None = None
            if isinstance(node, ast.Call) and dotted(node.func) in {"os.environ.get", "os.getenv"}:
                name = node.args[0]
            elif isinstance(node, ast.Subscript) and dotted(node.value) == "os.environ":
                name = node.slice
            elif (
                isinstance(node, ast.Compare)
                and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)
                and any(dotted(c) == "os.environ" for c in node.comparators)
            ):
                name = node.left
            if name is None:
                continue
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                found[name.value] = where
            elif isinstance(name, ast.Name) and name.id in constants:
                found[constants[name.id]] = where
            else:
                raise AssertionError(f"{where}: an environment variable the test cannot name")
    return found


def table_names(page_text: str) -> set[str]:
    """Return the names in the first column of a page's tables: ``| `NAME` | ...``."""
    return set(re.findall(r"^\| `([A-Za-z_][A-Za-z0-9_]*)` \|", page_text, flags=re.M))


def test_environment_page_lists_every_variable_the_code_reads() -> None:
    reads = environment_reads()
    assert {
        "COLLECTIVE_CPU_TRANSPORT",
        "COLLECTIVE_STRICT_BUFFERS",
        "COLLECTIVE_NCCL_CHECK",
        "COLLECTIVE_SHM_SLOT_BYTES",
    } <= set(reads)
    text = (DOCS / "environment.md").read_text(encoding="utf-8")
    listed = table_names(text)
    for name, where in reads.items():
        assert name in listed, f"{name} (read at {where}) is not on docs/environment.md"
    ours = table_names(text.split("## The library's variables", 1)[1].split("\n## ", 1)[0])
    assert ours == set(reads), "the library's table lists exactly what the code reads"


def test_one_install_snippet_is_included_wherever_the_install_lines_appear() -> None:
    snippet = (DOCS / "_snippets" / "install.txt").read_text(encoding="utf-8")
    lines = [line.split("#")[0].strip() for line in snippet.splitlines()]
    for name in ("index", "install", "nccl"):
        assert "```{literalinclude} _snippets/install.txt" in (DOCS / f"{name}.md").read_text()
    for path in sorted(DOCS.glob("*.md")):
        text = path.read_text(encoding="utf-8")
        written = {line.split("#")[0].strip() for line in text.splitlines()}
        written |= set(re.findall(r"`([^`]+)`", text))
        for line in lines:
            assert line not in written, (path.name, line)
