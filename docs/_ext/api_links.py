"""Link inline code that names a public function or class to its API reference entry.

On every page, inline code such as ``allreduce``, ``col.allreduce``, ``allreduce()``
or ``collective.Work`` becomes a link to the entry of that name on the API reference
(or, for the backend internals, on ``backends``), so guides need no cross-reference
roles. Code in code blocks, in headings and in existing links stays as it is, and so do
names with arguments (``allreduce(x)``) and names right after "Ray's", which are Ray's
own (``Ray's `BaseGroup` ``): only a bare name of this library is a reference.
"""

from __future__ import annotations

import re
from typing import Any

from docutils import nodes
from sphinx.application import Sphinx

import collective

PREFIX = re.compile(r"^(?:col|collective)\.")
RAYS = re.compile("Ray['\u2019]s\\s*$")
"""Text that ends right before a name of Ray's, not of this library."""
PAGES = {"register_collective_backend": "backends", "BaseGroup": "backends"}
"""Names documented on a page other than ``api``."""


def target(text: str) -> str | None:
    """Return the public name that inline code ``text`` refers to, or None."""
    name = PREFIX.sub("", text.strip()).removesuffix("()")
    return name if name in collective.__all__ else None


def link(app: Sphinx, doctree: nodes.document, docname: str) -> None:
    """Wrap each inline literal naming a public name in a link to its API entry."""
    for literal in list(doctree.findall(nodes.literal)):
        name = target(literal.astext())
        if (
            name is None
            or any(isinstance(a, nodes.title | nodes.reference) for a in _ancestors(literal))
            or _after_rays(literal)
        ):
            continue
        page = PAGES.get(name, "api")
        uri = app.builder.get_relative_uri(docname, page) + f"#collective.{name}"
        reference = nodes.reference("", "", internal=True, refuri=uri, reftitle=name)
        literal.replace_self(reference)
        reference += literal


def _after_rays(literal: nodes.Node) -> bool:
    """Return whether the text just before ``literal`` ends with "Ray's"."""
    parent = literal.parent
    if parent is None:
        return False
    before = "".join(node.astext() for node in parent[: parent.index(literal)])
    return bool(RAYS.search(before[-40:]))


def _ancestors(node: nodes.Node) -> list[nodes.Node]:
    found = []
    while node.parent is not None:
        node = node.parent
        found.append(node)
    return found


def setup(app: Sphinx) -> dict[str, Any]:
    """Run the linking on each page once it is resolved for its builder."""
    app.connect("doctree-resolved", link)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
