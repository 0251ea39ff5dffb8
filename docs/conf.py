"""Sphinx configuration of the collective documentation site.

Pages that another step may or may not have produced are handled here, so that
``sphinx-build -W`` passes either way: the toctree lists optional pages only when
their files exist, and the performance page shows the benchmark results only when
``docs/performance/results.md`` and ``docs/performance/busbw.png`` exist.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

from sphinx.application import Sphinx

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(DOCS.parent))

import collective  # noqa: E402

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
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "guide.md", "performance/**"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
myst_heading_anchors = 3
html_theme = "alabaster"
html_title = f"collective {release}"

PAGES = [
    "quickstart",
    "examples",
    "concepts",
    "data-movement",
    "support-matrix",
    "weight-sync",
    "migration",
    "nccl",
    "performance",
    "troubleshooting",
    "failure-model",
    "api",
]
"""The toctree's pages, in order."""

RESULTS = DOCS / "performance" / "results.md"
PLOT = DOCS / "performance" / "busbw.png"
MARKER = "@generated@"
"""The line in a page's source that ``generate`` replaces."""
BULK_RESULTS = DOCS / "performance" / "bulk.md"
BULK_PLOT = DOCS / "performance" / "bulk.png"
BULK_MARKER = "@bulk@"
"""The line of the performance page that the many-tensor results replace."""


def toctree_pages() -> list[str]:
    """Return the toctree's entries, in order."""
    return list(PAGES)


def performance_body() -> str:
    """Return the performance page's body: the results if present, else how to make them.

    The plot is shown above the results unless ``results.md`` shows it itself.
    """
    if RESULTS.is_file() and PLOT.is_file():
        include = "```{include} performance/results.md\n:relative-images:\n```\n"
        if PLOT.name in RESULTS.read_text(encoding="utf-8"):
            return include
        plot = "```{image} performance/busbw.png\n:alt: bus bandwidth against message size\n```\n"
        return f"{plot}\n{include}"
    return (
        "No benchmark results are checked in yet: run `python -m benchmarks` from the "
        "repository root to produce results, which it writes to `docs/performance/`.\n"
    )


def bulk_body() -> str:
    """Return the many-tensor results if ``python -m benchmarks.bulk`` wrote them, else how to."""
    if BULK_RESULTS.is_file() and BULK_PLOT.is_file():
        return "```{include} performance/bulk.md\n:relative-images:\n```\n"
    return (
        "No many-tensor results are checked in yet: run `python -m benchmarks.bulk "
        "--json docs/performance/bulk.json --plot docs/performance/bulk.png "
        "--markdown docs/performance/bulk.md`.\n"
    )


def api_body() -> str:
    """Return autodoc directives for every name in ``collective.__all__``."""
    lines = []
    for name in collective.__all__:
        if inspect.isclass(getattr(collective, name)):
            lines += [f".. autoclass:: collective.{name}", "   :members:", ""]
        else:
            lines += [f".. autofunction:: collective.{name}", ""]
    return "\n".join(lines)


GENERATORS = {
    "index": lambda: "\n".join(toctree_pages()),
    "performance": performance_body,
    "api": api_body,
}


def generate(app: Sphinx, docname: str, source: list[str]) -> None:
    """Replace the marker line of a generated page with its generated text."""
    if docname in GENERATORS:
        source[0] = source[0].replace(MARKER, GENERATORS[docname]())
    if docname == "performance":
        source[0] = source[0].replace(BULK_MARKER, bulk_body())


def setup(app: Sphinx) -> None:
    """Connect the page generators to the reading of sources."""
    app.connect("source-read", generate)
