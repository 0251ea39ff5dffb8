"""Numbers in sentences, and whole tables, read from the committed runs when the site builds.

A page never types a number that a committed run measured: it names the point, and the
build writes the number from the file, so the two cannot drift. Roles (MyST syntax
``{run}`results:allreduce/2/64M```):

- ``{run}`` the median time of a point, or ``a to b`` over several:
  ``results:op/ranks/size[/impl]`` (the op sweep, ``docs/performance/results.json``;
  ``impl`` defaults to ``collective``; a size of ``*`` is every size it recorded),
  ``latency:ranks[/impl]`` (its 8-byte latency probes), ``bulk:workload/nodes[/impl]``
  (the many-tensor run, ``bulk.json``).
- ``{ratio}`` the time of one implementation over another's at the same points, with two
  decimals: ``results:reduce/2/1M/collective|torch_gloo`` gives ``1.21``.
- ``{times}`` the same quotient, written as a factor: ``24`` or ``2.2``.
- ``{bound}`` a point's bus bandwidth as a fraction of the memory-bandwidth bound the
  op sweep measured: ``results:allreduce/2/64M,256M``.
- ``{meta}`` a fact of a run: ``results:load``, ``bulk:load``, ``rdt:load``,
  ``rdt-full:load``, ``gloo:load``, ``elastic:load``, ``results:copy`` (the copy rate of
  all ranks together), ``results:bound/allreduce/2`` (the bound, in GB/s).

Every slot takes a comma list, and the role then gives the range over every combination.
A point that no committed file holds is written as ``ABSENT``, so that the pages build
without the results files; ``tests/test_docs.py`` checks that the committed site has
none, and that every role of every page names a committed point. The directive
``{committed-table}`` with ``rdt``, ``rdt-full``, ``gloo-agreement`` or ``elastic`` writes
the tables of those runs.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable
from functools import cache
from pathlib import Path
from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from perf_pages import duration, human
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

from benchmarks.report import membw_bound

PERF = Path(__file__).resolve().parent.parent / "performance"
FILES = {
    "results": "results.json",
    "latency": "results.json",
    "bulk": "bulk.json",
    "rdt": "rdt.json",
    "rdt-full": "rdt-full.json",
    "gloo": "gloo_agreement.json",
    "elastic": "elastic.json",
}
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


ABSENT = "(no committed run)"
"""What a role writes for a point that no committed file holds; the committed site has none."""


class MissingPointError(LookupError):
    """A page names a point that the committed run does not hold."""


@cache
def run(name: str) -> Any:
    """Return the committed run ``name`` (a key of ``FILES``)."""
    path = PERF / FILES[name]
    if not path.is_file():
        raise MissingPointError(f"{path} is not committed")
    return json.loads(path.read_text(encoding="utf-8"))


def size(text: str) -> int:
    """Return a size written as ``8``, ``64K``, ``1M`` or ``1G``, in bytes."""
    unit = UNITS.get(text[-1:], 1)
    return int(text[:-1] if unit > 1 else text) * unit


def slots(key: str) -> list[list[str]]:
    """Return the slots of ``a,b/c/d``: each a list of its comma-separated values."""
    return [part.split(",") for part in key.split("/")]


RDT_KEYS = {"256M": "256 MiB x 1", "32Kx2000": "32 KiB x 2000", "4Kx16": "4 KiB x 16"}
"""The RDT runs' workloads as a page names them."""


def seconds(source: str, key: list[str], impl: str) -> dict[int, float]:
    """Return the median seconds of one point of a run, by the run's index (RDT: several)."""
    if source == "results":
        op, ranks, bytes_ = key
        found = dict(
            enumerate(
                r["time_us"]["median"] * 1e-6
                for r in run("results")["results"]
                if (r["op"], r["world_size"], r["size"], r["impl"])
                == (op, int(ranks), size(bytes_), impl)
            )
        )
    elif source == "latency":
        (ranks,) = key
        found = dict(
            enumerate(
                p["median_us"] * 1e-6
                for p in run("results")["latency"]
                if (p["world_size"], p["size"], p["impl"]) == (int(ranks), 8, impl)
            )
        )
    elif source == "bulk":
        workload, node_count = key
        found = dict(
            enumerate(
                r["time_ms"]["median"] * 1e-3
                for r in run("bulk")["results"]
                if (r["workload"], r["nodes"], r["impl"]) == (workload, int(node_count), impl)
            )
        )
    elif source in ("rdt", "rdt-full"):
        workload, consumers = key
        found = {
            r["run"]: r["time_ms"]["median"] * 1e-3
            for r in run(source)["results"]
            if (r["workload"], r["consumers"], r["impl"], r["status"])
            == (RDT_KEYS.get(workload, workload), int(consumers), impl, "ok")
        }
    else:
        raise MissingPointError(f"no run named {source!r}")
    if not found or (source not in ("rdt", "rdt-full") and len(found) > 1):
        raise MissingPointError(f"{source}:{'/'.join(key)}/{impl}: not one point of the run")
    return found


ARITY = {"results": 3, "latency": 1, "bulk": 2, "rdt": 2, "rdt-full": 2}
"""How many slots name a point of each run, before the implementations."""


def parse(text: str) -> tuple[str, list[list[str]], list[str]]:
    """Split ``source:slot/slot/impl|impl`` into the source, the point slots and the impls."""
    source, _, key = text.strip().partition(":")
    parts = slots(key)
    arity = ARITY.get(source)
    if arity is None:
        raise MissingPointError(f"no run named {source!r} in {text!r}")
    impls = parts[arity][0].split("|") if len(parts) > arity else ["collective"]
    return source, parts[:arity], impls


def expand(source: str, parts: list[list[str]], impl: str) -> list[tuple[str, ...]]:
    """Return every point that ``parts`` names.

    A size of ``*`` is every size the op sweep recorded for that op, world size and
    ``impl`` (allgather at 4 ranks has 16 B, not 8 B).
    """
    if source != "results" or parts[2] != ["*"]:
        return list(itertools.product(*parts))
    return [
        (op, ranks, str(r["size"]))
        for op, ranks in itertools.product(parts[0], parts[1])
        for r in run("results")["results"]
        if (r["op"], r["world_size"], r["impl"]) == (op, int(ranks), impl)
    ]


def values(text: str, both: bool) -> list[float]:
    """Return each point's seconds, or each point's quotient of two implementations.

    A run of several repeats (RDT) gives a value per repeat: the quotient pairs the two
    implementations' medians of the same repeat.
    """
    source, parts, impls = parse(text)
    if both != (len(impls) == 2):
        raise MissingPointError(f"{text!r}: give {'two implementations, a|b' if both else 'one'}")
    found = []
    for key in expand(source, parts, impls[0]):
        times = [seconds(source, list(key), impl) for impl in impls]
        if both:
            found += [times[0][i] / times[1][i] for i in times[0] if i in times[1]]
        else:
            found += list(times[0].values())
    return found


def span(numbers: Iterable[float], fmt: Callable[[float], str]) -> str:
    """Return one formatted number, or ``low to high`` when they differ once formatted."""
    ordered = sorted(numbers)
    if not ordered:
        raise MissingPointError("no point of the committed run matches")
    low, high = fmt(ordered[0]), fmt(ordered[-1])
    return low if low == high else f"{low} to {high}"


def factor(value: float) -> str:
    """Return a quotient as a factor: ``24`` from 10 on, else ``2.2``."""
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def bound_fractions(text: str) -> list[float]:
    """Return each point's bus bandwidth over the bound its op and world size have."""
    _, parts, impls = parse(text)
    results = run("results")
    membw = results["meta"].get("membw")
    found = []
    for op, ranks, bytes_ in itertools.product(*parts):
        bound = membw_bound(membw, op, int(ranks))
        if bound is None:
            raise MissingPointError(f"{text!r}: the op sweep records no memory bandwidth")
        record = [
            r
            for r in results["results"]
            if (r["op"], r["world_size"], r["size"], r["impl"])
            == (op, int(ranks), size(bytes_), impls[0])
        ]
        if len(record) != 1:
            raise MissingPointError(f"{text!r}: {op}/{ranks}/{bytes_} is not in the op sweep")
        found.append(record[0]["busbw_gbs"] / bound.gbs)
    return found


def meta(text: str) -> str:
    """Return a fact of a run's description: its load at the end, a copy rate, a bound."""
    source, _, what = text.strip().partition(":")
    data = run(source)
    if what == "load":
        metas = [r["meta"] for r in data] if isinstance(data, list) else [data["meta"]]
        loads = [m.get("load_average", m.get("load_at_end", [None]))[0] for m in metas]
        if None in loads:
            raise MissingPointError(f"{text!r}: a run records no load")
        return span(loads, lambda v: f"{v:.1f}" if len(loads) > 1 else f"{v:g}")
    membw = data["meta"].get("membw") if isinstance(data, dict) else None
    if what == "copy" and membw:
        rates = {r["processes"]: r["fastest"] for r in membw["copy_gbs"]}
        return f"{rates[max(rates)]:.1f}\u00a0GB/s"
    if what.startswith("bound/") and membw:
        _, op, ranks = what.split("/")
        bound = membw_bound(membw, op, int(ranks))
        if bound is not None:
            return f"{bound.gbs:.1f}\u00a0GB/s"
    raise MissingPointError(f"{text!r}: no such fact of the run")


FORMATS: dict[str, Callable[[str], str]] = {
    "run": lambda text: span(values(text, both=False), duration),
    "ratio": lambda text: span(values(text, both=True), lambda v: f"{v:.2f}"),
    "times": lambda text: span(values(text, both=True), factor),
    "bound": lambda text: span(bound_fractions(text), lambda v: f"{v:.2f}"),
    "meta": meta,
}
"""Each role and what it writes for its text."""


def role(name: str) -> Callable[..., tuple[list[nodes.Node], list[nodes.system_message]]]:
    """Return the docutils role that writes ``FORMATS[name]`` of its text."""

    def write(
        _role: str, rawtext: str, text: str, lineno: int, inliner: Any, *_: Any, **__: Any
    ) -> tuple[list[nodes.Node], list[nodes.system_message]]:
        try:
            return [nodes.Text(FORMATS[name](text))], []
        except MissingPointError:
            return [nodes.emphasis(text=ABSENT)], []
        except (ValueError, KeyError) as error:
            message = inliner.reporter.error(f"{{{name}}}`{text}`: {error}", line=lineno)
            return [inliner.problematic(rawtext, rawtext, message)], [message]

    return write


RDT_IMPLS = {
    "collective_shm": "`COLLECTIVE_SHM`",
    "collective": "`COLLECTIVE`",
    "gloo": "Ray's `GLOO`",
    "object_store": "object store",
}
RDT_WORKLOADS = {
    "256 MiB x 1": "one 256 MiB tensor",
    "32 KiB x 2000": "2,000 tensors of 32 KiB",
    "4 KiB x 16": "16 tensors of 4 KiB",
}


def milliseconds(low: float, high: float) -> str:
    """Return a range of milliseconds as the RDT tables write it: ``99-172 ms``, ``8 ms``."""
    a, b = f"{low:.0f}", f"{high:.0f}"
    return f"{a}\u00a0ms" if a == b else f"{a}\u2013{b}\u00a0ms"


def rdt_table(name: str) -> str:
    """Return the range of each row's per-run medians of an RDT run, as a Markdown table."""
    data = run(name)
    records = [r for r in data["results"] if r["status"] == "ok"]
    impls = [i for i in RDT_IMPLS if any(r["impl"] == i for r in records)]
    lines = [
        "| workload | rollouts | " + " | ".join(RDT_IMPLS[i] for i in impls) + " |",
        "|---|---|" + "---|" * len(impls),
    ]
    for workload, consumers in dict.fromkeys((r["workload"], r["consumers"]) for r in records):
        cells = []
        for impl in impls:
            medians = [
                r["time_ms"]["median"]
                for r in records
                if (r["workload"], r["consumers"], r["impl"]) == (workload, consumers, impl)
            ]
            cells.append(milliseconds(min(medians), max(medians)) if medians else "not measured")
        title = RDT_WORKLOADS.get(workload, workload)
        lines.append(f"| {title} | {consumers} | " + " | ".join(cells) + " |")
    meta_ = data["meta"]
    lines += [
        "",
        f"The range of the medians of {meta_['runs']} runs of {meta_['rounds']} rounds each, "
        f"`{meta_['command']}`: {meta_['cpus']} CPUs, one node, Ray {meta_['ray']}, load "
        f"average {meta_['load_at_end'][0]:g} at its end.",
    ]
    return "\n".join(lines)


def gloo_table() -> str:
    """Return the Gloo path's time per op without and with its agreement check, per world size."""
    runs = sorted(run("gloo"), key=lambda r: r["meta"]["world_size"])
    medians = {
        (data["meta"]["world_size"], r["op"], r["size"], r["mode"]): r["median_us"] * 1e-6
        for data in runs
        for r in data["results"]
    }
    points = list(dict.fromkeys((r["op"], r["size"]) for data in runs for r in data["results"]))
    ranks = [data["meta"]["world_size"] for data in runs]
    lines = [
        "| op | size | " + " | ".join(f"{n} ranks" for n in ranks) + " |",
        "|---|---|" + "---|" * len(ranks),
    ]
    for op, bytes_ in points:
        row = []
        for n in ranks:
            pair = [medians.get((n, op, bytes_, mode)) for mode in ("without", "with")]
            row.append(
                "not measured"
                if None in pair
                else " → ".join(duration(t) for t in pair if t is not None)
            )
        lines.append(f"| {op} | {human(bytes_)} | " + " | ".join(row) + " |")
    loads = ", ".join(f"{data['meta']['load_at_end'][0]:.1f}" for data in runs)
    lines += [
        "",
        "Median time per op without the check → with it, from "
        "`docs/performance/gloo_agreement.json` (`python -m benchmarks.gloo_agreement "
        "--world-size N --rounds 5 --iters 40`; the file also holds each round): the ranks "
        f"are processes on one host over loopback TCP, {runs[0]['meta']['cpus']} CPUs, so "
        f"from 3 ranks processes share a core; load average at the end of the runs: {loads}.",
    ]
    return "\n".join(lines)


ELASTIC_ROWS = {
    ("shrink_group", "from_error_s"): "`shrink_group`: the worst survivor's error to its first op",
    ("shrink_group", "from_kill_s"): "`shrink_group`: the kill to the last survivor's first op",
    ("destroy + init (3)", "from_error_s"): "destroy + init of 3: the worst survivor's error "
    "to its first op",
    ("destroy + init (3)", "from_kill_s"): "destroy + init of 3: the kill to the last "
    "survivor's first op",
    ("grow_group (3 -> 4)", "to_first_op_s"): "`grow_group` from 3 to 4: the start to the "
    "last rank's first op",
    ("destroy + init (4)", "to_first_op_s"): "destroy + init of 4: the start to the last "
    "rank's first op",
}
"""The elastic run's rows: a recovery and what its time runs from and to."""


def elastic_table() -> str:
    """Return the elastic run's recovery times, one column per node count."""
    data = run("elastic")
    records = {(r["row"], r["nodes"]): r for r in data["results"]}
    node_counts = sorted({r["nodes"] for r in data["results"]})
    titles = {1: "one node (shared memory)", 2: "two Ray nodes (hierarchical)"}
    lines = [
        "| | " + " | ".join(titles.get(n, f"{n} nodes") for n in node_counts) + " |",
        "|---|" + "---|" * len(node_counts),
    ]
    for (row, field), title in ELASTIC_ROWS.items():
        cells = []
        for n in node_counts:
            times = records.get((row, n), {}).get(field)
            cells.append(
                "not measured"
                if not times
                else f"{duration(times['median'])} ({duration(times['min'])} to "
                f"{duration(times['max'])})"
            )
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    meta_ = data["meta"]
    rounds = data["results"][0]["rounds"]
    lines += [
        "",
        f"The median of {rounds} rounds, and in brackets the fastest and slowest, from "
        "`docs/performance/elastic.json` (`python -m benchmarks.elastic --rounds "
        f"{rounds}`): {meta_['cpus']} CPUs shared with other work, load average "
        f"{meta_['load_average'][0]:g} at its end, Ray {meta_['ray']}; two nodes are a "
        "`ray.cluster_utils.Cluster` on the same machine, two ranks on each.",
    ]
    return "\n".join(lines)


TABLES: dict[str, Callable[[], str]] = {
    "rdt": lambda: rdt_table("rdt"),
    "rdt-full": lambda: rdt_table("rdt-full"),
    "gloo-agreement": gloo_table,
    "elastic": elastic_table,
}


class CommittedTable(SphinxDirective):
    """Write the table of a committed run: ``rdt``, ``rdt-full`` or ``gloo-agreement``."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        """Parse the generated Markdown table and its caption in place."""
        make = TABLES.get(self.arguments[0])
        if make is None:
            raise self.error(f"committed-table takes one of {sorted(TABLES)}")
        try:
            text = make()
        except MissingPointError:
            text = f"*{ABSENT} for this table.*"
        container = nodes.container()
        self.state.nested_parse(StringList(text.splitlines()), self.content_offset, container)
        return list(container.children)


def quoted_values(text: str) -> list[float]:
    """Return the seconds ``{run}`` writes for ``text``: for tests that check a page's numbers."""
    return values(text, both=False)


def setup(app: Sphinx) -> dict[str, Any]:
    """Register the roles and the directive."""
    for name in FORMATS:
        app.add_role(name, role(name))
    app.add_directive("committed-table", CommittedTable)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
