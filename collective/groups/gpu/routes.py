"""Which transport runs each op of two ranks on one GPU: the routes table, and when it applies.

NCCL 2.30 and later can hold two ranks of one communicator on one GPU
(``NCCL_MULTI_RANK_GPU_ENABLE=1``, experimental, at most two ranks per GPU). Whether
it beats the shared-GPU transport depends on the op, its size and the GPU, so it is
measured (``python -m benchmarks.nccl --shared-gpu``) and the measurement is turned
into a table of byte ranges per op where NCCL was faster
(``python -m benchmarks.multirank_routes``), committed as ``multirank_routes.json``
beside this module. A group of ranks that all share one GPU routes its ops by that
table (``routed``) only where all of these hold; anywhere else it is the shared-GPU
transport alone and makes no NCCL communicator:

- the group has exactly two ranks (NCCL's limit);
- the NCCL that cupy loaded is 2.30 or later;
- ``NCCL_MULTI_RANK_GPU_ENABLE`` is unset or ``1`` (another value turns the mode off);
- the table holds at least one route.

``COLLECTIVE_GPU_ROUTES`` picks the table: unset (or empty) the committed one, ``off``
none (every op on the shared-GPU transport), anything else the path of a table file.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collective.types import CollectiveError

MULTIRANK_VERSION = 23000
"""NCCL 2.30.0 as ``ncclGetVersion`` (cupy's ``nccl.get_version``) encodes it."""

MULTIRANK_RANKS = 2
"""The ranks of one GPU NCCL's multi-rank mode holds by default."""

MULTIRANK_ENV = "NCCL_MULTI_RANK_GPU_ENABLE"
"""NCCL's switch of the mode; NCCL reads it when it first initialises in a process."""

ROUTES_ENV = "COLLECTIVE_GPU_ROUTES"
"""Unset or empty: the committed table; ``off``: no routes; else the path of a table."""

TABLE = Path(__file__).with_name("multirank_routes.json")
"""The committed table."""

ROUTED_OPS = ("allreduce", "broadcast", "reduce", "allgather", "reducescatter")
"""The ops a table may route to NCCL: those NCCL runs as one collective call."""

WHOLE_OPS = frozenset(("allgather", "reducescatter"))
"""The ops whose size is the whole of every rank's piece, as nccl-tests counts it."""

Range = tuple[int, "int | None"]
"""Bytes from ``lo`` (included) to ``hi`` (excluded; None: no end)."""


def version_text(code: int) -> str:
    """Return NCCL's version code as text: 23000 is ``2.30.0``, 2708 is ``2.7.8``."""
    major, rest = (code // 10000, code % 10000) if code >= 20900 else divmod(code, 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def nccl_version(cupy: Any) -> int:
    """Return the version code of the NCCL that ``cupy`` loaded; 0 without cupy or NCCL."""
    if cupy is None:
        return 0
    try:
        return int(cupy.cuda.nccl.get_version())
    except Exception:
        return 0


def op_bytes(op: str, nbytes: int, world_size: int) -> int:
    """Return the size an op is routed by: its buffer's, or every rank's piece for a whole."""
    return nbytes * world_size if op in WHOLE_OPS else nbytes


@dataclass(frozen=True)
class Routes:
    """The byte ranges of each op where NCCL's multi-rank mode runs it; see the module doc."""

    measured_on: Mapping[str, Any] | None = None
    """The GPU, NCCL version and world size the routes were measured on; None: never."""
    ops: Mapping[str, tuple[Range, ...]] = field(default_factory=dict)
    """Each routed op's ranges, ascending and apart."""

    def __bool__(self) -> bool:
        """Return whether any op has a route."""
        return any(self.ops.values())

    def nccl_runs(self, op: str, nbytes: int) -> bool:
        """Return whether NCCL runs ``op`` of ``nbytes`` (as ``op_bytes`` counts them)."""
        return any(lo <= nbytes and (hi is None or nbytes < hi) for lo, hi in self.ops.get(op, ()))

    def to_json(self) -> dict[str, Any]:
        """Return the table as its file holds it."""
        routes = {op: [[lo, hi] for lo, hi in ranges] for op, ranges in self.ops.items()}
        return {"measured_on": self.measured_on, "routes": routes}

    @classmethod
    def from_json(cls, body: Any, where: str = "the routes table") -> Routes:
        """Return the table ``body`` holds.

        Raises:
            CollectiveError: ``body`` is not a table: an unknown op, or ranges that are
                not ascending and apart.

        """
        if not isinstance(body, dict) or not isinstance(body.get("routes"), dict):
            raise CollectiveError(f"{where} must be an object with 'routes', got {body!r}")
        ops: dict[str, tuple[Range, ...]] = {}
        for op, ranges in body["routes"].items():
            if op not in ROUTED_OPS:
                raise CollectiveError(f"{where} routes {op!r}; it may route {list(ROUTED_OPS)}")
            ops[op] = _ranges(ranges, f"{where}, {op}")
        measured_on = body.get("measured_on")
        return cls(dict(measured_on) if measured_on else None, ops)


def _ranges(ranges: Any, where: str) -> tuple[Range, ...]:
    """Return ``[[lo, hi], ...]`` as ranges, checked ascending and apart."""
    found: list[Range] = []
    end = 0
    for item in ranges if isinstance(ranges, list) else [ranges]:
        ok = isinstance(item, list) and len(item) == 2 and isinstance(item[0], int)
        lo, hi = item if ok else (-1, None)
        if not ok or not (hi is None or isinstance(hi, int)) or lo < end:
            raise CollectiveError(f"{where}: expected [from, to or null], ascending, got {item!r}")
        if hi is not None and hi <= lo:
            raise CollectiveError(f"{where}: range {item!r} holds no byte")
        if found and found[-1][1] is None:
            raise CollectiveError(f"{where}: range {item!r} follows one without an end")
        found.append((lo, hi))
        end = lo if hi is None else hi
    return tuple(found)


@functools.cache
def load(path: Path) -> Routes:
    """Return the table in the file at ``path``, read once per process.

    Raises:
        CollectiveError: the file cannot be read, or holds no table.

    """
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CollectiveError(f"{ROUTES_ENV}: cannot read the routes table {path}: {exc}") from exc
    return Routes.from_json(body, str(path))


def wanted() -> Routes:
    """Return the table ``COLLECTIVE_GPU_ROUTES`` asks for; see the module doc."""
    value = os.environ.get(ROUTES_ENV, "").strip()
    if value.lower() == "off":
        return Routes()
    return load(Path(value) if value else TABLE)


def multirank_allowed() -> bool:
    """Return whether ``NCCL_MULTI_RANK_GPU_ENABLE`` leaves NCCL's mode on: unset or ``1``."""
    return os.environ.get(MULTIRANK_ENV, "1").strip() == "1"


def enable_multirank() -> None:
    """Set ``NCCL_MULTI_RANK_GPU_ENABLE=1`` for the NCCL communicators made after this."""
    os.environ[MULTIRANK_ENV] = "1"


def table_for(world_size: int, version: Callable[[], int]) -> Routes | None:
    """Return the routes of a group of ``world_size`` ranks on one GPU, or None: no NCCL.

    ``version`` returns the NCCL version code; it and the table are read only where the
    world size leaves routing possible.

    Raises:
        CollectiveError: ``COLLECTIVE_GPU_ROUTES`` names a file that holds no table.

    """
    if world_size != MULTIRANK_RANKS or not multirank_allowed():
        return None
    if version() < MULTIRANK_VERSION:
        return None
    routes = wanted()
    return routes if routes else None
