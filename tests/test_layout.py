"""The house keeps its shape: no import cycle, no module over 400 lines, no re-export-only file.

Read from the source with ``ast``; nothing of ``collective`` is imported or run. Every
import counts, wherever it stands: at module level, inside a function, or under
``if TYPE_CHECKING:``. Each failure names the rule it breaks and every offender.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "collective"
MAX_LINES = 400
PUBLIC_SURFACES = {
    f"{PACKAGE}/__init__.py": "import collective as col",
    f"{PACKAGE}/ray_plugins/__init__.py": "docs/inside-ray.md: from collective.ray_plugins import",
    f"{PACKAGE}/groups/gloo/__init__.py": "docs/backends.rst: from collective.groups.gloo import",
    f"{PACKAGE}/groups/nccl/__init__.py": "docs/nccl.md: collective.groups.nccl.NCCLGroup",
}
"""The import paths the docs give users, the only files that may only re-export (with where
the docs give each). Nothing inside the package imports through them (see
``through_surfaces``)."""

BASE = {"_version", "types"}
ROOMS: dict[str, set[str]] = {
    "_version": set(),
    "types": set(),
    "work": BASE,
    "frameworks": BASE,
    "signature": BASE | {"frameworks"},
    "rendezvous": BASE,
    "groups": BASE | {"work", "frameworks", "rendezvous"},
    "groups.shm": BASE | {"frameworks", "signature"},
    "groups.gloo": BASE | {"work", "frameworks", "signature", "rendezvous", "groups"},
    "groups.nccl": BASE | {"work", "frameworks", "signature", "rendezvous", "groups"},
    "groups.shared_gpu": BASE
    | {"work", "frameworks", "signature", "rendezvous", "groups", "groups.shm"},
    "groups.gpu": BASE
    | {"work", "frameworks", "rendezvous", "groups", "groups.nccl", "groups.shared_gpu"},
    "groups.cpu": BASE
    | {"work", "frameworks", "signature", "rendezvous", "groups", "groups.shm", "groups.gloo"},
    "checks": BASE | {"work", "frameworks", "signature", "groups"},
    "registry": BASE
    | {"work", "frameworks", "rendezvous", "groups", "groups.cpu", "groups.gloo", "groups.nccl"}
    | {"groups.gpu"}
    | {"checks"},
    "ops": BASE | {"work", "frameworks", "groups", "checks", "registry"},
    "bulk": BASE | {"work", "frameworks", "signature", "groups", "checks", "registry"},
    "ray_plugins": BASE
    | {"work", "frameworks", "groups", "groups.shm", "groups.shared_gpu", "checks", "registry"}
    | {"ops"},
    "torch_backend": BASE
    | {"work", "frameworks", "rendezvous", "groups", "groups.cpu", "ops", "bulk"},
}
"""Every room of the package (a top-level module, a folder, or one transport in ``groups/``)
and the rooms it may import: imports point down, and never across transports (the CPU
group is the one place that knows both CPU transports), except that the shared-GPU
transport is built on shared memory's step protocol, which runs its host side.
``collective`` itself, the public surface, may import every room."""


def modules(root: Path, package: str = PACKAGE) -> dict[str, Path]:
    """Return every module of ``package`` under ``root``, by dotted name (a package by its own)."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _targets(
    node: ast.Import | ast.ImportFrom, name: str, is_package: bool, found: dict[str, Path]
) -> set[str]:
    """Return the modules that ``node``, found in module ``name``, imports.

    ``from a import b`` imports module ``a.b`` when there is one, else module ``a``.
    """
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    here = name.split(".") if is_package else name.split(".")[:-1]
    base = ".".join(here[: len(here) - node.level + 1]) if node.level else ""
    base = ".".join(part for part in (base, node.module or "") if part)
    named = (f"{base}.{alias.name}" for alias in node.names)
    return {target if target in found else base for target in named}


def imports(root: Path, package: str = PACKAGE) -> dict[str, set[str]]:
    """Return, for every module of ``package``, the modules of ``package`` it imports."""
    found = modules(root, package)
    graph = {}
    for name, path in found.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets |= _targets(node, name, path.name == "__init__.py", found)
        graph[name] = targets & found.keys()
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Return one cycle (``[a, b, ..., a]``) through each set of modules that import each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1 or node in graph[node]:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(_cycle_in(graph, group) for group in groups)


def _cycle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """Return the shortest cycle from the first module of ``group`` back to itself."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & group):
                if target == start:
                    return [*paths[node], start]
                if target not in paths:
                    paths[target] = [*paths[node], target]
                    following.append(target)
        frontier = following
    raise AssertionError(f"no cycle through {start}")


def too_long(root: Path, package: str = PACKAGE) -> list[str]:
    """Return ``path (N lines)`` for every module of ``package`` over ``MAX_LINES`` lines."""
    long = []
    for path in modules(root, package).values():
        count = len(path.read_text().splitlines())
        if count > MAX_LINES:
            long.append(f"{path.relative_to(root)} ({count} lines)")
    return sorted(long)


def _is_reexport(statement: ast.stmt) -> bool:
    """Return whether ``statement`` is an import, ``__all__``, or a string (a docstring)."""
    if isinstance(statement, (ast.Import, ast.ImportFrom)):
        return True
    if isinstance(statement, ast.Expr):
        return isinstance(statement.value, ast.Constant) and isinstance(statement.value.value, str)
    if isinstance(statement, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
        return all(isinstance(t, ast.Name) and t.id == "__all__" for t in targets)
    return False


def only_reexports(root: Path, package: str = PACKAGE) -> list[str]:
    """Return every module of ``package`` whose body is imports, ``__all__`` and a docstring.

    A module with no import at all (a package's docstring) re-exports nothing.
    """
    found = []
    for path in modules(root, package).values():
        body = ast.parse(path.read_text(), str(path)).body
        has_import = any(isinstance(s, (ast.Import, ast.ImportFrom)) for s in body)
        relative = path.relative_to(root).as_posix()
        if has_import and all(map(_is_reexport, body)) and relative not in PUBLIC_SURFACES:
            found.append(relative)
    return sorted(found)


def through_surfaces(root: Path, package: str = PACKAGE) -> list[str]:
    """Return ``module: from surface import name`` for every import of a re-exported name
    through a public surface by a module of ``package`` other than that surface itself."""
    found_modules = modules(root, package)
    surfaces = {
        name
        for name, path in found_modules.items()
        if path.relative_to(root).as_posix() in PUBLIC_SURFACES
    }
    found = []
    for name, path in found_modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom) or node.module not in surfaces:
                continue
            if name == node.module:
                continue
            for alias in node.names:
                if f"{node.module}.{alias.name}" not in found_modules:
                    found.append(f"{name}: from {node.module} import {alias.name}")
    return sorted(found)


def room(module: str) -> str:
    """Return the room of ``module``: its top-level module or folder, or its transport."""
    parts = module.split(".")[1:]
    if ".".join(parts[:2]) in ROOMS:
        return ".".join(parts[:2])
    return parts[0] if parts else PACKAGE


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Return ``module -> target`` for every import into a room that ``ROOMS`` does not allow.

    A module in a room that ``ROOMS`` does not list is reported too, so that a new room
    gets its place in the table.
    """
    found = []
    for name, targets in sorted(graph.items()):
        here = room(name)
        if here == PACKAGE:
            continue
        if here not in ROOMS:
            found.append(f"{name}: its room {here!r} is not in ROOMS")
            continue
        for target in sorted(targets):
            there = room(target)
            if there != here and there not in ROOMS[here]:
                found.append(f"{name} -> {target} ({here} may not import {there})")
    return found


def test_no_import_cycle_counting_type_checking_and_function_imports() -> None:
    found = [" -> ".join(cycle) for cycle in cycles(imports(ROOT))]
    assert not found, "rule: no import cycle; these modules import each other:\n" + "\n".join(found)


def test_no_module_over_400_lines() -> None:
    found = too_long(ROOT)
    assert not found, f"rule: no module over {MAX_LINES} lines; over it:\n" + "\n".join(found)


def test_no_file_only_reexports_another() -> None:
    found = only_reexports(ROOT)
    assert not found, (
        f"rule: no file only re-exports another (only {sorted(PUBLIC_SURFACES)} may); "
        "these hold only imports, __all__ and a docstring:\n" + "\n".join(found)
    )


def test_rooms_import_only_the_rooms_below_them() -> None:
    found = upward_imports(imports(ROOT))
    assert not found, "rule: a room imports only the rooms ROOMS lists for it:\n" + "\n".join(found)


def test_the_package_never_imports_through_its_public_surfaces() -> None:
    found = through_surfaces(ROOT)
    assert not found, (
        "rule: inside the package, import a name from the module that defines it, not "
        "through a public surface:\n" + "\n".join(found)
    )


# --- the checks themselves, on small made-up packages ------------------------------------------


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = tmp_path / PACKAGE / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    "importer",
    [
        "from collective.b import thing\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from collective.b import thing\n",
        "def later():\n    from collective import b\n",
        "from . import b\n",
        "import collective.b\n",
    ],
)
def test_a_cycle_is_found_however_the_import_is_written(tmp_path: Path, importer: str) -> None:
    root = _package(
        tmp_path,
        {"__init__.py": "", "a.py": importer, "b.py": "from collective.a import other\n"},
    )
    assert cycles(imports(root)) == [["collective.a", "collective.b", "collective.a"]]


def test_imports_that_point_one_way_make_no_cycle(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "__init__.py": "from collective.top import run\n",
            "top.py": "from collective.room import low\n",
            "room/__init__.py": '"""A room."""\n',
            "room/low.py": "from collective.room.lower import x\n",
            "room/lower.py": "x = 1\n",
        },
    )
    assert imports(root)["collective.top"] == {"collective.room.low"}
    assert cycles(imports(root)) == []


def test_a_long_module_and_a_reexport_only_file_are_named(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "__init__.py": "from collective.a import x\n__all__ = ['x']\n",
            "a.py": "x = 1\n" * (MAX_LINES + 1),
            "b.py": '"""Only re-exports."""\nfrom collective.a import x\n__all__ = ["x"]\n',
            "c.py": '"""Re-exports and does one thing."""\nfrom collective.a import x\ny = x\n',
            "room/__init__.py": '"""A room: a docstring and nothing else."""\n',
        },
    )
    assert too_long(root) == [f"collective/a.py ({MAX_LINES + 1} lines)"]
    assert only_reexports(root) == ["collective/b.py"]


def test_an_import_through_a_public_surface_is_named(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "__init__.py": "from collective.a import x\n",
            "a.py": "x = 1\n",
            "b.py": "from collective import a\n",
            "c.py": "from collective import x\n",
        },
    )
    assert through_surfaces(root) == ["collective.c: from collective import x"]


def test_an_upward_or_sideways_import_and_an_unlisted_room_are_named(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "__init__.py": "from collective.ops import run\n",
            "types.py": "from collective.groups.base import BaseGroup\n",
            "ops/__init__.py": '"""A room."""\n',
            "ops/run.py": "from collective.groups.nccl import group\n",
            "groups/__init__.py": '"""A room."""\n',
            "groups/base.py": "from collective import types\n",
            "groups/nccl/__init__.py": '"""A transport."""\n',
            "groups/nccl/group.py": "from collective.groups.gloo import group\n",
            "groups/gloo/__init__.py": '"""A transport."""\n',
            "groups/gloo/group.py": "from collective.groups import base\n",
            "attic/__init__.py": '"""Not a room."""\n',
        },
    )
    assert upward_imports(imports(root)) == [
        "collective.attic: its room 'attic' is not in ROOMS",
        "collective.groups.nccl.group -> collective.groups.gloo.group "
        "(groups.nccl may not import groups.gloo)",
        "collective.ops.run -> collective.groups.nccl.group (ops may not import groups.nccl)",
        "collective.types -> collective.groups.base (types may not import groups)",
    ]
