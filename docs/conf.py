"""Sphinx configuration of the collective documentation site.

The site is split by what the reader came for (Diátaxis): get started, how-to guides,
reference and explanation, one section page each, listed in ``SECTIONS``. Parts of
some pages are generated when the site is built, from the code and the committed
benchmark runs, so they cannot drift:

- each section page's table of contents (``@generated@``), listing optional pages
  (``OPTIONAL``) only when their files exist;
- the API reference (``api``) and the backend internals page (``backends``), grouped
  by topic in ``API_TOPICS`` and ``BACKEND_NAMES``; every name of ``collective.__all__``
  is on exactly one of them, or the build fails;
- the landing page's numbers (``@headlines@``), the performance page's summary, plot
  and commands, and the detail page's full tables and figures, from
  ``docs/performance/results.json``, ``busbw*.png``, ``bulk.json`` and ``bulk.png``.
  Without them the pages say how to make them.
- the torch.distributed page's numbers (``@numbers@``), from
  ``docs/performance/torch_backend.json`` (``torch_pages``); without it the page says how
  to make it.
- every GPU number: the NCCL page's "How fast on GPUs" (``@gpu@``), the landing page's
  GPU rows (``@gpu_headlines@``) and the performance page's pointer (``@gpu_status@``),
  from ``docs/performance/gpu.json`` (``gpu_pages``); without it they say that no GPU
  run is committed, and how to make one.

Inline code that names a public function or class, such as ``allreduce`` or
``col.broadcast_state_dict``, links to its entry in the API reference (``api_links``).
"""

from __future__ import annotations

import inspect
import itertools
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from sphinx.application import Sphinx
from sphinx.errors import ExtensionError

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(DOCS.parent))

import gpu_pages  # noqa: E402
import perf_pages  # noqa: E402
import torch_pages  # noqa: E402

import collective  # noqa: E402
from benchmarks import gpu_results, plots  # noqa: E402

project = "collective"
author = "collective authors"
copyright = "collective authors"
release = collective.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "support_matrix",
    "api_links",
    "run_numbers",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_generated", "guide.md", "performance/**"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
toc_object_entries = False
"""The page tables of contents list the API's topics, not every function."""
myst_heading_anchors = 3
myst_enable_extensions = ["attrs_block"]

html_theme = "pydata_sphinx_theme"
html_title = f"collective {release}"
html_static_path = ["_static"]
html_css_files = ["collective.css"]
html_theme_options = {
    "navbar_align": "left",
    "header_links_before_dropdown": 4,
    "show_toc_level": 2,
    "navigation_with_keys": False,
    "secondary_sidebar_items": ["page-toc"],
    "footer_start": ["copyright"],
    "footer_end": ["theme-version"],
}
html_sidebars = {"index": []}
html_context = {"default_mode": "light"}

SECTIONS = {
    "get-started": ["install", "quickstart", "examples"],
    "how-to": [
        "weight-sync",
        "elastic",
        "nccl",
        "inside-ray",
        "torch-distributed",
        "migration",
        "debugging",
    ],
    "reference": [
        "api",
        "backends",
        "support-matrix",
        "gpu-status",
        "environment",
        "troubleshooting",
        "contributing",
    ],
    "explanation": [
        "concepts",
        "data-movement",
        "failure-model",
        "performance",
        "performance-detail",
        "design-notes",
    ],
}
"""Each section page's pages, in order: what the navigation bar and sidebars show."""

PAGES = [page for pages in SECTIONS.values() for page in pages]
"""Every page below a section, in order."""

API_TOPICS: list[tuple[str, str, list[str]]] = [
    (
        "Groups",
        "Make a group of your actors, declare one from the driver, split one, end one.",
        [
            "init_collective_group",
            "declare_collective_group",
            "create_collective_group",
            "new_group",
            "destroy_collective_group",
            "destroy_all_collective_groups",
            "Backend",
        ],
    ),
    (
        "Ops",
        "One buffer per rank. Every op writes its outputs in place and returns ``None``, "
        "or a ``Work`` with ``async_op=True``. A buffer is a numpy array or a CPU torch "
        "tensor on a Gloo group, a cupy array or a CUDA torch tensor on an NCCL group "
        "(:doc:`support-matrix` lists the dtypes of each).",
        [
            "allreduce",
            "reduce",
            "broadcast",
            "allgather",
            "reducescatter",
            "send",
            "recv",
            "barrier",
            "gather",
            "scatter",
            "alltoall",
            "alltoall_single",
            "ReduceOp",
            "Work",
        ],
    ),
    (
        "Many tensors",
        "A whole model in one call: weights matched by name or by index, gradients in buckets.",
        ["broadcast_state_dict", "broadcast_tensors", "allreduce_tensors"],
    ),
    (
        "Elastic groups",
        "Go on without a dead rank, or take in new ones, under the same group name.",
        ["shrink_group", "grow_group", "shrink_declared_group", "grow_declared_group"],
    ),
    (
        "Several GPUs per actor",
        "Ray's ``*_multigpu`` calls, one tensor per local GPU, on NCCL groups, and ``watch``"
        " for the replay of a CUDA graph holding a group's ops.",
        [
            "allreduce_multigpu",
            "reduce_multigpu",
            "broadcast_multigpu",
            "allgather_multigpu",
            "reducescatter_multigpu",
            "send_multigpu",
            "recv_multigpu",
            "synchronize",
            "watch",
        ],
    ),
    (
        "Inside Ray",
        "Run Ray's own ``ray.util.collective`` and Ray Direct Transport on this library.",
        ["register_ray_backend", "register_tensor_transport", "register_shm_transport"],
    ),
    (
        "Inside torch.distributed",
        'Run torch code on this library: ``torch.distributed.init_process_group("collective")``.',
        ["register_torch_backend"],
    ),
    (
        "Queries",
        "Ask which groups exist, who is in them, and which backends this process can run.",
        [
            "get_rank",
            "get_collective_group_size",
            "is_group_initialized",
            "list_collective_groups",
            "get_collective_groups",
            "get_group_handle",
            "is_backend_available",
            "gloo_available",
            "nccl_available",
        ],
    ),
    (
        "Errors",
        "Every error is a ``RuntimeError``; argument errors are also a ``ValueError`` or "
        "``TypeError``. :doc:`troubleshooting` says what each means and what to do.",
        [
            "CollectiveError",
            "CollectiveTimeoutError",
            "GroupNotFoundError",
            "ArgumentError",
            "ArgumentValueError",
            "ArgumentTypeError",
        ],
    ),
]
"""The API reference's topics: a title, a one-line summary and the names, in order."""

TOPIC_TYPES = {"Groups": ["collective.types.CpuTransport"]}
"""Types the public functions take that ``collective`` does not export, by topic: their
entries let the signatures that name them link there."""

BACKEND_NAMES = ["register_collective_backend", "BaseGroup"]
"""The names on the backend internals page."""

PERF = DOCS / "performance"
RESULTS_JSON = PERF / "results.json"
PLOT = PERF / "busbw.png"
BULK_JSON = PERF / "bulk.json"
BULK_PLOT = PERF / "bulk.png"
TORCH_JSON = PERF / "torch_backend.json"
"""The committed run of ``python -m benchmarks.torch_backend``: the torch.distributed page."""
GPU_JSON = PERF / "gpu.json"
"""The committed GPU run: ``python -m benchmarks.gpu_results --from $OUT/bench.json``."""
SUMMARY_PLOT = DOCS / "_generated" / "allreduce.png"
"""Drawn from ``results.json`` at each build; not committed."""

MARKER = "@generated@"
"""The line in a page's source that its generator replaces."""


SECTION_SUMMARIES = {
    "get-started": "your first op, then whole programs to copy",
    "how-to": "one job each",
    "reference": "every name, knob and error, and what maintainers run",
    "explanation": "how it works and how fast",
}


def source(page: str) -> Path:
    """Return a page's source file."""
    return next(path for path in DOCS.glob(f"{page}.*") if path.suffix in source_suffix)


def title(page: str) -> str:
    """Return a page's title: the first heading of its source."""
    path = source(page)
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix == ".rst":
        return next(a for a, b in itertools.pairwise(lines) if b and set(b) == {"="})
    return next(line[2:] for line in lines if line.startswith("# "))


def next_body() -> str:
    """Return the landing page's list of sections, each with its pages."""
    lines = []
    for section in SECTIONS:
        pages = ", ".join(f"[{title(p)}]({source(p).name})" for p in SECTIONS[section])
        lines.append(
            f"- **[{title(section)}]({section}.md)**, {SECTION_SUMMARIES[section]}: {pages}."
        )
    return "\n".join(lines)


def check_api_names() -> None:
    """Fail the build unless the API pages show every public name exactly once."""
    shown = [name for _, _, names in API_TOPICS for name in names] + BACKEND_NAMES
    twice = sorted(name for name, n in Counter(shown).items() if n > 1)
    missing = sorted(set(collective.__all__) - set(shown))
    unknown = sorted(set(shown) - set(collective.__all__))
    if twice or missing or unknown:
        raise ExtensionError(
            f"docs/conf.py API_TOPICS: shown twice {twice}, missing {missing}, "
            f"not in collective.__all__ {unknown}"
        )


def autodoc(names: list[str]) -> list[str]:
    """Return autodoc directives for ``names`` of the ``collective`` package."""
    lines = []
    for name in names:
        if inspect.isclass(getattr(collective, name)):
            lines += [f".. autoclass:: collective.{name}", "   :members:", ""]
        else:
            lines += [f".. autofunction:: collective.{name}", ""]
    return lines


def api_body() -> str:
    """Return the API reference's topics, each a section with its summary and names."""
    check_api_names()
    lines = []
    for title, summary, names in API_TOPICS:
        lines += [title, "-" * len(title), "", summary, ""]
        lines += [", ".join(f":func:`~collective.{n}`" for n in names if not _is_class(n))]
        lines += [""]
        lines += autodoc(names)
        for path in TOPIC_TYPES.get(title, []):
            lines += [f".. autoclass:: {path}", ""]
    return "\n".join(lines)


def _is_class(name: str) -> bool:
    return inspect.isclass(getattr(collective, name))


def backends_body() -> str:
    """Return the backend internals' autodoc directives."""
    check_api_names()
    return "\n".join(autodoc(BACKEND_NAMES))


def runs() -> tuple[dict | None, dict | None]:
    """Return the committed op sweep and many-tensor run, each None if absent."""
    return perf_pages.load(RESULTS_JSON), perf_pages.load(BULK_JSON)


def load_clause(results: dict | None, bulk: dict | None) -> str:
    """Return the load the committed runs ended at, as a clause: ``, load average 8.0 ...``."""
    loads = [
        f"{load[0]:g} ({name})"
        for name, run in (("op sweep", results), ("many-tensor run", bulk))
        if run is not None and (load := run["meta"].get("load_average"))
    ]
    return f", load average at the end of the run {' and '.join(loads)}" if loads else ""


def headlines_body() -> str:
    """Return the landing page's numbers, each linked to the performance page."""
    results, bulk = runs()
    rows = perf_pages.points(perf_pages.HEADLINES, results, bulk)
    if not rows:
        return "See [performance](performance.md) for how to measure it on your machine.\n"
    meta = (results or bulk or {}).get("meta", {})
    return (
        perf_pages.table(rows, link="performance.md#summary")
        + "\n\nMedian time per call; in brackets, how the peer's time compares with "
        + "`collective`'s. Ranks in Ray actors on one node of "
        + perf_pages.machine(meta)
        + f"{load_clause(results, bulk)}; raw Gloo is torch's `ProcessGroupGloo` in plain "
        + "processes. **4 ranks run on the machine's 2 cores, so each rank waits for a core "
        + "and the 4-rank gains shrink.** The [performance page](performance.md#summary) "
        + "has every op and size, and the commands that measure them.\n"
    )


def summary_body() -> str:
    """Return the performance page's summary table, the plot and where they come from."""
    results, bulk = runs()
    rows = perf_pages.points(perf_pages.SUMMARY, results, bulk)
    if not rows:
        return (
            "No benchmark results are checked in yet: run `python -m benchmarks` from the "
            "repository root to produce results, which it writes to `docs/performance/`.\n"
        )
    meta = (results or bulk or {}).get("meta", {})
    text = [
        perf_pages.table(rows),
        "",
        "Median time per call of `collective` and of each peer; in brackets, how the "
        "peer's time compares with `collective`'s. Ranks are Ray actors, on one node of "
        f"{perf_pages.machine(meta)}{load_clause(results, bulk)}, unless the row says 2 "
        "Ray nodes: two Ray nodes of a `ray.cluster_utils.Cluster` on that same machine, "
        "2 ranks each. Raw Gloo is "
        "torch's `ProcessGroupGloo` in plain processes, not in Ray. The 8-byte latency "
        "times single ops back to back; the other rows are medians of the "
        "[full tables](performance-detail.md#full-results). CPU only: the committed runs "
        "have no GPU.",
        "",
    ]
    membw = None if results is None else results.get("meta", {}).get("membw")
    if results is not None and plots.times(SUMMARY_PLOT, results, membw=membw):
        text += [
            "```{image} _generated/allreduce.png",
            ":alt: allreduce at 2 and 4 ranks: median time per op below 1 MiB, bus "
            "bandwidth from 1 MiB, for collective, collective on Gloo, raw torch Gloo, "
            "ray.util.collective, the object store and plain copies",
            "```",
            "",
            "Allreduce in the op sweep: on the left, the time per op of messages below "
            "1 MiB (lower is faster); on the right, the bus bandwidth of 1 MiB and up "
            "(higher is faster). Each line is named at its end. The plain copies (dashed) "
            "are a peer, not a bound; the black line is the bound the machine's measured "
            "memory bandwidth sets, with the unreachable region above it shaded, drawn "
            "where it holds: from the size of the measured copies on (smaller messages fit "
            "the caches).",
            "",
        ]
    return "\n".join(text)


def method_body() -> str:
    """Return the machines and commands of the committed runs."""
    results, bulk = runs()
    lines = []
    for name, run in (("The op sweep", results), ("The many-tensor run", bulk)):
        if run is None:
            continue
        meta = run["meta"]
        versions = ", ".join(
            f"{name} {meta[key]}"
            for key, name in (("python", "Python"), ("torch", "torch"), ("ray", "Ray"))
            if key in meta
        )
        load = meta.get("load_average")
        lines += [
            f"{name} ran on `{meta.get('machine')}`, {meta.get('cpus')} CPUs"
            + (f"; {versions}" if versions else "")
            + f"; {meta.get('seconds')} s"
            + (f", load average {load[0]} at its end" if load else "")
            + ":",
            "",
            "```bash",
            perf_pages.wrapped(perf_pages.command(meta)),
            "```",
            "",
        ]
    return "\n".join(lines) or "No run is checked in yet.\n"


def full_body() -> str:
    """Return the op sweep's goals, latency, bus-bandwidth plot and tables, if a run wrote them."""
    results = perf_pages.load(RESULTS_JSON)
    if results is None:
        return (
            "No benchmark results are checked in yet: run `python -m benchmarks` from the "
            "repository root to produce results, which it writes to `docs/performance/`.\n"
        )
    parts = [
        perf_pages.provenance(results["meta"], "docs/performance/results.json"),
        "",
        "The op tables give the median time per op at every size; a ✗ marks a point "
        "whose result was wrong on some rank. `docs/performance/results.json` and "
        "`results.md` also hold each point's min, max, algbw and busbw, in nccl-tests' "
        "columns.",
        "",
    ]
    for dropped in results["meta"].get("dropped", []):
        parts += [
            f"Rows dropped from the file: {dropped['rows']}, {dropped['why']}; "
            f"`{dropped['command']}` measures them again.",
            "",
        ]
    if results.get("goals"):
        parts += ["### Goals", "", perf_pages.goals_table(results["goals"]), ""]
    if results.get("latency"):
        parts += [
            "### Latency",
            "",
            "8-byte allreduces, single ops back to back, each timed by itself:",
            "",
            perf_pages.latency_table(results),
            "",
        ]
    groups = plots.op_groups(results.get("results", []))
    figures = zip(plots.figure_paths(PLOT, len(groups)), groups, strict=True)
    shown = [(path, ops) for path, ops in figures if path.is_file()]
    if shown:
        parts += [
            "### Bus bandwidth",
            "",
            "Bus bandwidth, nccl-tests' measure of how fast an op moves data, of "
            "messages of 1 MiB and up, on a linear axis; higher is faster. The op tables "
            "below give the smaller messages' times. Each line is named at its end; the "
            "plain copies (dashed) are a peer, not a bound; the black line is the "
            "memory-bandwidth bound, from the size of the measured copies on.",
            "",
        ]
    for path, ops in shown:
        parts += [
            f"```{{image}} performance/{path.name}",
            f":alt: bus bandwidth against message size, 1 MiB and up, of "
            f"{' and '.join(ops)}, a panel per op and world size",
            "```",
            "",
        ]
    parts += [perf_pages.op_tables(results)]
    return "\n".join(parts)


def bulk_body() -> str:
    """Return the many-tensor run's plot and tables, if ``python -m benchmarks.bulk`` wrote them."""
    bulk = perf_pages.load(BULK_JSON)
    if bulk is None:
        return (
            "No many-tensor results are checked in yet: run `python -m benchmarks.bulk "
            "--json docs/performance/bulk.json --plot docs/performance/bulk.png "
            "--markdown docs/performance/bulk.md`.\n"
        )
    text = perf_pages.provenance(bulk["meta"], "docs/performance/bulk.json") + "\n\n"
    if BULK_PLOT.is_file():
        text += "```{image} performance/bulk.png\n:alt: median time per call, by workload\n```\n\n"
    return text + perf_pages.bulk_tables(bulk)


def gpu(render: Callable[[dict | None], str]) -> Callable[[], str]:
    """Return a generator that renders the committed GPU run, or its absence, with ``render``."""
    return lambda: render(gpu_results.load(GPU_JSON))


GENERATORS: dict[str, dict[str, Callable[[], str]]] = {
    **{
        section: {MARKER: lambda section=section: "\n".join(SECTIONS[section])}
        for section in SECTIONS
    },
    "index": {
        "@headlines@": headlines_body,
        "@gpu_headlines@": gpu(gpu_pages.index_body),
        "@next@": next_body,
    },
    "nccl": {"@gpu@": gpu(gpu_pages.nccl_body)},
    "api": {MARKER: api_body},
    "backends": {MARKER: backends_body},
    "performance": {
        "@summary@": summary_body,
        "@method@": method_body,
        "@gpu_status@": gpu(gpu_pages.performance_body),
    },
    "performance-detail": {"@bulk@": bulk_body, MARKER: full_body},
    "torch-distributed": {
        "@numbers@": lambda: torch_pages.numbers_body(perf_pages.load(TORCH_JSON))
    },
}
"""Each generated page's markers and what replaces them."""


def generate(app: Sphinx, docname: str, source: list[str]) -> None:
    """Replace the marker lines of a generated page with their generated text."""
    for marker, body in GENERATORS.get(docname, {}).items():
        if marker in source[0]:
            source[0] = source[0].replace(marker, body())


def setup(app: Sphinx) -> None:
    """Connect the page generators to the reading of sources."""
    app.connect("source-read", generate)
