"""Sphinx extension: the ``support-matrix`` directive, generated from the code at build time.

Every table comes from the backend classes themselves (``dtypes``, ``supported_ops``,
``device_type``, which ops they implement) and from ``ReduceOp.accepts``, so the page
cannot drift from what the library does.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

from collective.frameworks.kinds import DTYPES
from collective.groups.base import BaseGroup
from collective.registry.backends import group_class
from collective.types import Backend, ReduceOp

YES = "✓"
NO = "—"


@dataclass(frozen=True)
class TensorType:
    """A buffer type the library accepts: where it lives and whose dtypes it can express."""

    name: str
    devices: tuple[str, ...]
    dtype_module: str


TENSOR_TYPES = (
    TensorType("numpy.ndarray", ("cpu",), "numpy"),
    TensorType("torch.Tensor", ("cpu", "cuda"), "torch"),
    TensorType("cupy.ndarray", ("cuda",), "numpy"),
)
"""Buffer types by device; cupy arrays take numpy's dtypes, so numpy decides for them."""

Table = tuple[list[str], list[list[str]]]
"""A header row and body rows of cell texts."""


def backend_classes() -> dict[str, type[BaseGroup]]:
    """Return the built-in backends' group classes by backend name."""
    return {member.value: group_class(member.value, here=False) for member in Backend}


def op_names() -> list[str]:
    """Return the ops every backend must implement: ``BaseGroup``'s abstract op methods."""
    return [
        name
        for name in sorted(BaseGroup.__abstractmethods__)
        if "options" in inspect.signature(getattr(BaseGroup, name)).parameters
    ]


def implements(cls: type[BaseGroup], op: str) -> bool:
    """Return whether ``cls`` has a concrete implementation of op method ``op``."""
    return op not in getattr(cls, "__abstractmethods__", frozenset()) and not getattr(
        getattr(cls, op), "__isabstractmethod__", False
    )


def library_has_dtype(module: str, dtype: str) -> bool:
    """Return whether tensors of ``module`` (numpy or torch) can have dtype ``dtype``."""
    lib: Any = importlib.import_module(module)
    if module == "numpy":
        try:
            lib.dtype(dtype)
        except TypeError:
            return False
        return True
    return isinstance(getattr(lib, dtype, None), lib.dtype)


def ops_table() -> Table:
    """Return the op x backend table."""
    classes = backend_classes()
    header = ["op", *classes]
    rows = [
        [op, *(YES if implements(cls, op) else NO for cls in classes.values())] for op in op_names()
    ]
    return header, rows


def dtypes_table() -> Table:
    """Return the dtype x (backend, tensor type) table."""
    columns = [
        (name, cls, tensor_type)
        for name, cls in backend_classes().items()
        for tensor_type in TENSOR_TYPES
        if cls.device_type in tensor_type.devices
    ]
    header = ["dtype"] + [
        f"{name} ({tensor_type.name} on {cls.device_type})" for name, cls, tensor_type in columns
    ]
    rows = [
        [dtype]
        + [
            YES
            if dtype in cls.dtypes and library_has_dtype(tensor_type.dtype_module, dtype)
            else NO
            for _, cls, tensor_type in columns
        ]
        for dtype in sorted(DTYPES)
    ]
    return header, rows


def reduce_ops_table(backend: str) -> Table:
    """Return the ReduceOp x dtype table of ``backend``."""
    cls = backend_classes()[backend]
    dtypes = sorted(cls.dtypes)
    header = ["ReduceOp", *dtypes]
    rows = [
        [op.name]
        + [YES if op in cls.supported_ops and op.accepts(dtype) else NO for dtype in dtypes]
        for op in ReduceOp
    ]
    return header, rows


def _table(table: Table) -> nodes.table:
    header, rows = table
    group = nodes.tgroup(cols=len(header))
    for column in zip(header, *rows, strict=True):
        group += nodes.colspec(colwidth=max(len(text) for text in column))

    def row(cells: list[str]) -> nodes.row:
        line = nodes.row()
        for text in cells:
            line += nodes.entry("", nodes.paragraph(text=text))
        return line

    head = nodes.thead()
    head += row(header)
    body = nodes.tbody()
    for cells in rows:
        body += row(cells)
    group += head
    group += body
    result = nodes.table(classes=["support-matrix"])
    result += group
    return result


class SupportMatrix(SphinxDirective):
    """Render one of the generated tables: ``ops``, ``dtypes`` or ``reduce-ops <backend>``."""

    required_arguments = 1
    optional_arguments = 1

    def run(self) -> list[nodes.Node]:
        """Build the table this directive's arguments name."""
        kind = self.arguments[0]
        if kind == "ops":
            return [_table(ops_table())]
        if kind == "dtypes":
            return [_table(dtypes_table())]
        if kind == "reduce-ops" and len(self.arguments) == 2:
            return [_table(reduce_ops_table(self.arguments[1]))]
        raise self.error(f"support-matrix takes ops, dtypes or reduce-ops <backend>, got {kind}")


def setup(app: Sphinx) -> dict[str, Any]:
    """Register the directive."""
    app.add_directive("support-matrix", SupportMatrix)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
