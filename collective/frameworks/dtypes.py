"""The dtypes the library moves: one table of their names, codes and item sizes.

Every transport names a dtype by its code here when it tells other ranks about a
call (see ``signature``), and sizes its elements with this table; each backend
accepts a subset of ``DTYPES``. NCCL's own numbers for them are in ``cuda``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    """One dtype: its name (numpy's and torch's), its code, and the bytes of one element."""

    name: str
    code: int
    itemsize: int


TABLE = (
    DType("bool", 0, 1),
    DType("uint8", 1, 1),
    DType("int8", 2, 1),
    DType("int32", 3, 4),
    DType("int64", 4, 8),
    DType("float16", 5, 2),
    DType("bfloat16", 6, 2),
    DType("float32", 7, 4),
    DType("float64", 8, 8),
)
"""Every dtype the library moves; a dtype's code is its index."""

NAMES = tuple(d.name for d in TABLE)
"""The dtype name of each code."""

CODES = {d.name: d.code for d in TABLE}
"""The code of each dtype name."""

ITEMSIZE = {d.name: d.itemsize for d in TABLE}
"""The bytes of one element of each dtype name."""

DTYPES = frozenset(NAMES)
"""Every dtype name any backend may accept; each backend narrows this set."""
