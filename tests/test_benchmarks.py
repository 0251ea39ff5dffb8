"""The benchmark CLI runs end to end in quick mode and writes a well-formed table, JSON and plot.

This checks the shape of the output, that every implementation computed the right
result, and that the goals and the latency probe are reported, never the speed. The
workloads' expected results are checked against a numpy simulation of each op.

The smoke runs (each CLI run once, as a user runs it) all start with the module, and run
one after another while its other tests run (``smoke_runs``); those that use Ray join
the session's Ray cluster, each as a job of its own, and ``ray_cluster`` checks after
the module that they left nothing in it.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks import workloads
from tests.conftest import Programs, SharedCluster, selected

ROOT = Path(__file__).resolve().parent.parent
OPS = set(workloads.OPS)
RAY_OPS = {"allreduce", "broadcast", "reduce", "allgather", "reducescatter"}
STORE_OPS = {"allreduce", "broadcast", "allgather"}
EVERYWHERE = {"collective", "collective_gloo", "torch_gloo", "shm_copy"}
GOALS = 7


def _impls(op: str) -> set[str]:
    return (
        EVERYWHERE
        | ({"ray_collective"} if op in RAY_OPS else set())
        | ({"object_store"} if op in STORE_OPS else set())
    )


def _quick(out: Path, address: str) -> list[str]:
    command = [sys.executable, "-m", "benchmarks", "--quick", "--sizes", "8,64K"]
    command += ["--iters", "2", "--warmup", "0", "--batch", "2", "--probe-ops", "20"]
    command += ["--json", str(out / "results.json"), "--plot", str(out / "busbw.png")]
    return [*command, "--markdown", str(out / "results.md"), "--address", address]


def _bulk(out: Path, address: str) -> list[str]:
    command = [sys.executable, "-m", "benchmarks.bulk", "--quick", "--nodes", "1"]
    command += ["--workloads", "uniform:12x1K,transformer:256K:20,gradients:128K:20"]
    command += ["--json", str(out / "bulk.json"), "--plot", str(out / "bulk.png")]
    return [*command, "--markdown", str(out / "bulk.md"), "--address", address]


def _elastic(out: Path, address: str) -> list[str]:
    command = [sys.executable, "-m", "benchmarks.elastic", "--quick", "--nodes", "1"]
    command += ["--json", str(out / "elastic.json"), "--markdown", str(out / "elastic.md")]
    return [*command, "--address", address]


def _rdt(out: Path, address: str) -> list[str]:
    # Two consumers, not the default three: a group of three, and every row with more
    # than one consumer, at one actor less per set of rows.
    command = [sys.executable, "-m", "benchmarks.rdt", "--quick", "--consumers", "1,2"]
    return [*command, "--json", str(out / "rdt.json"), "--address", address]


def _host_path(out: Path, address: str) -> list[str]:
    command = [sys.executable, "-m", "benchmarks.host_path", "--iters", "50"]
    return [*command, "--cpu-iters", "20", "--json", str(out / "host_path.json")]


def _crowded(out: Path, address: str) -> list[str]:
    # This checkout stands in as the baseline, so that its rows run the --baseline path.
    command = [sys.executable, "-m", "benchmarks.crowded", "--world-sizes", "3", "--sizes", "8"]
    command += ["--rounds", "2", "--ops", "3", "--warmup", "1", "--baseline", f"main={ROOT}"]
    return [*command, "--json", str(out / "crowded.json"), "--address", address]


def _torch_backend(out: Path, address: str) -> list[str]:
    command = [sys.executable, "-m", "benchmarks.torch_backend", "--world-sizes", "2"]
    command += ["--sizes", "8,64K", "--rounds", "2", "--ddp-steps", "1", "--ddp-layers", "1"]
    return [*command, "--binding-calls", "20", "--json", str(out / "torch_backend.json")]


SMOKE_RUNS: dict[str, tuple[Callable[[Path, str], list[str]], float]] = {
    "test_quick_benchmark_writes_table_goals_json_and_plot": (_quick, 400),
    "test_bulk_benchmark_runs_every_row_on_tiny_workloads": (_bulk, 400),
    "test_elastic_benchmark_runs_every_row_in_quick_mode": (_elastic, 300),
    "test_rdt_benchmark_runs_every_row_on_tiny_workloads": (_rdt, 400),
    "test_host_path_benchmark_writes_a_row_per_path": (_host_path, 300),
    "test_crowded_benchmark_runs_ours_ray_and_the_baseline_in_rounds": (_crowded, 300),
    "test_torch_backend_benchmark_writes_every_row_and_goal": (_torch_backend, 300),
}
"""By the test that checks it: each smoke run's command, given the folder it writes into
and the Ray cluster's address, and its timeout in seconds."""


@dataclass(frozen=True)
class SmokeRun:
    """A smoke run: the folder it writes into, and ``done``, which waits for its end."""

    folder: Path
    done: Callable[[], subprocess.CompletedProcess[str]]


@pytest.fixture(scope="module")
def smoke_runs(
    request: pytest.FixtureRequest,
    ray_cluster: None,
    shared_cluster: SharedCluster,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, SmokeRun]]:
    """Start the smoke runs of the tests this session runs, one at a time in their order.

    They run while the module's other tests do. One at a time: each keeps two cores busy
    already, and on two cores this module took 84 s with two at once, 71 s with one.
    """
    programs, runs = Programs(1), {}
    for item in selected(request):
        if item.name in SMOKE_RUNS:
            command, timeout_s = SMOKE_RUNS[item.name]
            folder = tmp_path_factory.mktemp("smoke")
            programs.start(item.name, command(folder, shared_cluster.address), timeout_s, cwd=ROOT)
            runs[item.name] = SmokeRun(folder, partial(programs.result, item.name))
    yield runs
    programs.close()


@pytest.fixture
def smoke(request: pytest.FixtureRequest, smoke_runs: dict[str, SmokeRun]) -> SmokeRun:
    """Return the smoke run that this test checks."""
    return smoke_runs[request.node.name]


def test_quick_benchmark_writes_table_goals_json_and_plot(smoke: SmokeRun) -> None:
    out_json, out_png = smoke.folder / "results.json", smoke.folder / "busbw.png"
    out_md = smoke.folder / "results.md"
    done = smoke.done()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    for op in OPS:
        assert f"# {op}, world size 2" in done.stdout
    for column in ("size(B)", "busbw", "#wrong", "t/gloo", "bw/copy"):
        assert column in done.stdout
    assert "# 8-byte allreduce, single ops" in done.stdout
    assert "# goals" in done.stdout
    data = json.loads(out_json.read_text())
    assert set(data["meta"]) >= {"command", "torch", "ray", "seconds", "unavailable", "membw"}
    from benchmarks import membw

    copies = data["meta"]["membw"]["copy_gbs"]
    assert [r["processes"] for r in copies] == membw.counts_for([2])
    assert all(0 < r["median"] <= r["fastest"] for r in copies), copies
    assert "process(es): " in done.stdout
    missing = set(data["meta"]["unavailable"])
    results = data["results"]
    for op in OPS:
        for size in (8, 65536):
            impls = {r["impl"] for r in results if (r["op"], r["size"]) == (op, size)}
            assert impls == _impls(op) - missing, (op, size, impls)
    for r in results:
        assert r["wrong"] == 0, r
        assert r["world_size"] == 2 and r["dtype"] == "float32"
        assert r["time_us"]["min"] <= r["time_us"]["median"] <= r["time_us"]["max"]
        assert r["busbw_gbs"] > 0 and r["algbw_gbs"] > 0
        assert r["ratio_to_torch_gloo"] > 0 and r["fraction_of_copy"] > 0
        assert 1 <= r["batch"] <= 2 and r["iters"] == 2
        if r["impl"] == "torch_gloo":
            assert r["ratio_to_torch_gloo"] == 1.0
        if r["impl"] == "shm_copy":
            assert r["fraction_of_copy"] == 1.0
    assert {r["batch"] for r in results if r["impl"] != "object_store"} == {2}
    probes = data["latency"]
    assert {p["impl"] for p in probes} == {
        "collective",
        "collective_gloo",
        "torch_gloo",
        "ray_collective",
        "shm_copy",
    } - missing
    for p in probes:
        assert (p["size"], p["ops"], p["world_size"]) == (8, 20, 2)
        assert 0 < p["min_us"] <= p["median_us"] <= p["p90_us"]
    verdicts = data["goals"]
    assert len(verdicts) == GOALS
    assert {g["verdict"] for g in verdicts} <= {"pass", "fail", "not measured"}
    assert verdicts[0]["verdict"] != "not measured", "the latency goal had its probe"
    if "ray_collective" not in missing:
        assert verdicts[-1]["verdict"] != "not measured", "the reducescatter goal had its rows"
    for g in verdicts:
        assert g["claim"] in done.stdout
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = out_md.read_text()
    for heading in ("## Machine and command", "## Goals", "## Latency", "## Bus bandwidth"):
        assert heading in page
    assert "## Median time relative to raw torch gloo" in page and "## Table" in page
    assert "](busbw.png)" in page


@pytest.mark.parametrize(
    ("module", "flags", "message"),
    [
        ("__main__", ["--ops", "allreduce,scan"], "unknown ops"),
        ("__main__", ["--impls", "collective,mpi"], "unknown impls"),
        ("__main__", ["--sizes", "8,4X"], "sizes must be like"),
        ("torch_backend", ["--ops", "all_reduce,scan"], "unknown ops ['scan']"),
        ("torch_backend", ["--world-sizes", "1"], "world sizes must be at least 2"),
        ("torch_backend", ["--sizes", "8,4X"], "sizes must be like"),
    ],
)
def test_bad_arguments_are_rejected_before_anything_starts(
    module: str, flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m benchmarks[.module]`` with these flags exits with status 2 from its checks.

    Its ``main`` runs here, as ``-m`` runs it (the smoke tests run it so); nothing
    else starts, so no process needs to.
    """
    main = importlib.import_module(f"benchmarks.{module}").main

    with pytest.raises(SystemExit) as exit_:
        main(flags)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def _simulate(op: str, inputs: list[np.ndarray], chunk: int) -> list[np.ndarray | None]:
    """Return what each rank must hold after ``op``, computed directly from the inputs."""
    n, root = len(inputs), workloads.ROOT
    chunks = [np.split(x, n) if x.size == n * chunk else [] for x in inputs]
    if op in ("allreduce", "reduce"):
        total = np.sum(inputs, axis=0)
        return [total if op == "allreduce" or r == root else None for r in range(n)]
    if op == "broadcast":
        return [inputs[root]] * n
    if op in ("allgather", "gather"):
        gathered = np.concatenate(inputs)
        return [gathered if op == "allgather" or r == root else None for r in range(n)]
    if op == "reducescatter":
        return [np.sum([c[r] for c in chunks], axis=0) for r in range(n)]
    if op == "scatter":
        return [chunks[root][r] for r in range(n)]
    return [np.concatenate([c[r] for c in chunks]) for r in range(n)]


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("size", [8, 24, 4096])
def test_expected_results_match_a_numpy_simulation(world_size: int, size: int) -> None:
    for op in workloads.OPS:
        chunk, total = workloads.shape(op, size, world_size)
        assert total >= 1 and chunk >= 1
        assert workloads.actual_size(op, size, world_size) == total * workloads.ITEM
        inputs = [workloads.buffers(op, size, world_size, r)[0] for r in range(world_size)]
        for rank, want in enumerate(_simulate(op, inputs, chunk)):
            expected = workloads.expected(op, size, world_size, rank)
            if want is None:
                assert expected is None, (op, rank)
                continue
            np.testing.assert_array_equal(expected, want, f"{op} rank {rank}")
            out = workloads.buffers(op, size, world_size, rank)[1]
            assert out.shape == want.shape, (op, rank)
            assert workloads.wrong(op, want, size, world_size, rank) == 0
            assert workloads.wrong(op, np.zeros_like(want), size, world_size, rank) > 0


@pytest.mark.parametrize("samples", [1, 2, 3, 5, 8, 20])
def test_rounds_take_every_sample_once_and_warm_up_each_round(samples: int) -> None:
    from benchmarks.__main__ import rounds
    from benchmarks.workloads import ROUNDS

    plan = rounds(samples, warmup=3)
    assert len(plan) == min(samples, ROUNDS)
    assert sum(n for n, _ in plan) == samples
    assert all(n >= 1 for n, _ in plan)
    assert max(n for n, _ in plan) - min(n for n, _ in plan) <= 1
    assert [w for _, w in plan] == [3] + [1] * (len(plan) - 1)


def test_only_a_checking_plan_counts_wrong_results() -> None:
    def call(op: str, x: np.ndarray, out: np.ndarray) -> Any:
        return lambda: None  # an allreduce that does nothing leaves every element wrong

    for check, want in ((True, 4), (False, 0)):
        plan = workloads.Plan(iters=2, warmup=0, check=check)
        times, wrong = workloads.measure("allreduce", 16, 2, 0, plan, call, lambda: None)
        assert len(times) == 2
        assert wrong == want


BULK_ROWS = {"collective", "collective_loop", "ray_collective", "object_store", "shm_copy"}


def test_bulk_benchmark_runs_every_row_on_tiny_workloads(smoke: SmokeRun) -> None:
    out_json, out_png = smoke.folder / "bulk.json", smoke.folder / "bulk.png"
    out_md = smoke.folder / "bulk.md"
    done = smoke.done()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    data = json.loads(out_json.read_text())
    missing = set(data["meta"]["unavailable"])
    results = data["results"]
    for kind in ("uniform", "transformer", "gradients"):
        rows = {r["impl"] for r in results if r["workload"] == kind}
        expected = BULK_ROWS - missing - ({"object_store"} if kind == "gradients" else set())
        assert rows == expected, (kind, rows)
    for r in results:
        assert r["wrong"] == 0, r
        assert r["world_size"] == 2 and r["nodes"] == 1 and r["samples"] == 2
        assert 0 < r["time_ms"]["min"] <= r["time_ms"]["median"] <= r["time_ms"]["max"]
        assert r["speedup_of_ours"] > 0
    assert len(data["goals"]) == 7
    assert {g["verdict"] for g in data["goals"]} == {"not measured"}, "no goal point is tiny"
    assert "# uniform: 12 tensors, 12 KiB, 2 ranks on 1 node(s)" in done.stdout
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "](bulk.png)" in out_md.read_text()


@pytest.mark.parametrize(("total", "count"), [(1 << 30, 400), (256 << 20, 400), (1 << 20, 20)])
def test_transformer_workloads_come_near_their_size_and_count(total: int, count: int) -> None:
    from benchmarks import bulk_workloads

    for kind in ("transformer", "gradients"):
        work = bulk_workloads.transformer(total, count, kind)
        assert 0.8 * total <= work.nbytes <= 1.05 * total, (kind, work.nbytes)
        assert abs(len(work.tensors) - count) <= 10
        assert {d for _, _, d in work.tensors} == (
            {"float32"} if kind == "gradients" else {"bfloat16", "float32"}
        )


def test_gloo_agreement_benchmark_times_every_op_with_and_without_the_check(
    tmp_path: Path,
) -> None:
    from benchmarks import gloo_agreement

    out = tmp_path / "agreement.json"
    argv = ["--world-size", "3", "--rounds", "1", "--sizes", "8,16K", "--iters", "3"]
    lines = gloo_agreement.main([*argv, "--json", str(out)])
    assert len(lines) == 2 * 2 * 3, lines
    for op in ("allreduce", "broadcast"):
        for size in ("8 B", "16384 B"):
            for mode in ("without", "with ", "ring"):
                assert any(op in line and size in line and mode in line for line in lines), (
                    op,
                    size,
                    mode,
                    lines,
                )
    (run,) = json.loads(out.read_text())
    assert run["meta"]["world_size"] == 3 and run["meta"]["cpus"]
    assert len(run["results"]) == len(lines)
    assert all(r["median_us"] > 0 for r in run["results"])


def test_elastic_benchmark_runs_every_row_in_quick_mode(smoke: SmokeRun) -> None:
    out_json, out_md = smoke.folder / "elastic.json", smoke.folder / "elastic.md"
    done = smoke.done()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    data = json.loads(out_json.read_text())
    results = data["results"]
    recoveries, rejoins = ["shrink_group", "destroy + init (3)"], ["grow_group (3 -> 4)"]
    rejoins.append("destroy + init (4)")
    assert [r["row"] for r in results] == recoveries + rejoins
    for r in results:
        assert (r["nodes"], r["world_size"], r["rounds"], r["transport"]) == (1, 4, 1, "shm")
        assert r["wrong"] == r["wrong_at_init"] == 0, r
        recovery = r["row"] in recoveries
        fields = ["from_error_s", "from_kill_s"] if recovery else ["to_first_op_s"]
        assert [k for k in r if k.endswith("_s")] == fields, r
        for field in fields:
            t = r[field]
            assert 0 < t["min"] <= t["median"] <= t["max"] < 60, (field, r)
    goals = data["goals"]
    assert len(goals) == 2 and {g["verdict"] for g in goals} <= {"pass", "fail"}, goals
    for g in goals:
        assert g["claim"] in done.stdout
    assert "# 4 ranks on 1 node(s), transport shm, rank 2 killed" in done.stdout
    assert "## Machine and command" in out_md.read_text()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nodes", "3"], "nodes must be 1 or 2"),
        (["--rounds", "-1"], "rounds must be"),
        (["--address", "127.0.0.1:1"], "--address runs on one node: pass --nodes 1"),
    ],
)
def test_elastic_benchmark_rejects_bad_arguments(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """As ``test_bad_arguments_are_rejected_before_anything_starts``, for ``benchmarks.elastic``."""
    from benchmarks.elastic import main

    with pytest.raises(SystemExit) as exit_:
        main(flags)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_bulk_benchmark_joins_a_running_cluster_on_one_node_only(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--address`` with the default nodes (1,2) exits with status 2 before anything starts."""
    from benchmarks.bulk import main

    with pytest.raises(SystemExit) as exit_:
        main(["--address", "127.0.0.1:1"])
    assert exit_.value.code == 2
    assert "--address runs on one node: pass --nodes 1" in capsys.readouterr().err


def test_membw_reports_each_process_count_and_records_it_in_a_results_file(
    tmp_path: Path,
) -> None:
    from benchmarks import membw

    lines = membw.main(["--size", "1M", "--processes", "1,2", "--rounds", "3"])
    assert lines[0] == "# numpy copies of 1 MiB, 3 rounds, every process copying once a round"
    for n, line in zip((1, 2), lines[1:], strict=True):
        assert line.startswith(f"{n} process(es): "), line
        rate = float(line.split(": ")[1].split(" GB/s")[0])
        assert rate > 0, line
    results = tmp_path / "results.json"
    committed = json.loads((ROOT / "docs" / "performance" / "results.json").read_text())
    committed["meta"].pop("membw", None)
    results.write_text(json.dumps(committed))
    membw.main(["--size", "1M", "--rounds", "3", "--json", str(results)])
    data = json.loads(results.read_text())
    recorded = data["meta"].pop("membw")
    assert data == committed, "only meta.membw is added"
    assert [r["processes"] for r in recorded["copy_gbs"]] == membw.counts_for([2, 4])
    for r in recorded["copy_gbs"]:
        assert 0 < r["median"] <= r["fastest"], r
    assert (
        recorded["command"] == f"python -m benchmarks.membw --size 1M --rounds 3 --json {results}"
    )
    assert recorded["when"].startswith("separately")
    assert {"units", "method", "machine", "cpus", "date", "size", "rounds"} <= set(recorded)


MEMBW = {"copy_gbs": [{"processes": 1, "fastest": 12.0}, {"processes": 2, "fastest": 16.0}]}


@pytest.mark.parametrize(
    ("op", "world_size", "cpus", "gbs"),
    [
        ("allreduce", 2, 2, 8.0),
        ("allreduce", 4, 2, 4.0),
        ("broadcast", 2, 2, 16.0),
        ("broadcast", 4, 2, 16.0 / 3),
        ("gather", 4, 2, 16.0),
        ("alltoall", 2, 1, 8.0),
        ("allreduce", 1, 2, None),
        ("allreduce", 4, 4, None),
    ],
)
def test_memory_bandwidth_bound_shares_the_copy_rate_among_the_bytes_that_cross(
    op: str, world_size: int, cpus: int, gbs: float | None
) -> None:
    """The bound is the copy rate of the ranks' cores over the ranks' bus bytes that cross.

    None for one rank (nothing crosses) and where the rate of as many processes as the
    ranks have cores for was not measured.
    """
    from benchmarks.report import membw_bound

    bound = membw_bound({**MEMBW, "cpus": cpus}, op, world_size)
    assert (bound.gbs if bound else None) == (pytest.approx(gbs) if gbs else None)
    assert membw_bound(None, op, world_size) is None


def _bandwidth_axes(membw: dict[str, Any] | None) -> tuple[list[Any], list[str], float]:
    """Draw the committed 2-rank allreduce panel; return its bound lines, texts and top."""
    from benchmarks import plots
    from benchmarks.report import membw_bound

    data = json.loads((ROOT / "docs" / "performance" / "results.json").read_text())
    records = [
        r
        for r in data["results"]
        if (r["op"], r["world_size"]) == ("allreduce", 2) and r["size"] >= plots.LARGE
    ]
    with plots.pyplot() as plt:
        fig, ax = plt.subplots()
        plots.bandwidth_panel(ax, records, membw_bound(membw, "allreduce", 2))
        plots.direct_labels(ax)
        bounds = [line for line in ax.get_lines() if line.get_label().startswith("bound ")]
        texts = [t.get_text() for t in ax.texts]
        top = ax.get_ylim()[1]
        plt.close(fig)
    return bounds, texts, top


def test_bus_bandwidth_panels_draw_the_memory_bandwidth_bound_where_the_run_has_it(
    tmp_path: Path,
) -> None:
    membw = {**MEMBW, "cpus": 2}
    bounds, texts, top = _bandwidth_axes(membw)
    assert [list(line.get_ydata()) for line in bounds] == [[8.0, 8.0]]
    assert bounds[0].get_color() == "black"
    assert "bound 8.0 GB/s" in texts
    assert top > 8.0
    assert "collective" in texts and not any(t.startswith("_") for t in texts), texts

    bounds, texts, _ = _bandwidth_axes(None)
    assert bounds == [] and not any("bound" in t for t in texts), texts

    from benchmarks import replot

    for name in ("results.json", "bulk.json"):
        (tmp_path / name).write_text((ROOT / "docs" / "performance" / name).read_text())
    data = json.loads((tmp_path / "results.json").read_text())
    data["meta"].pop("membw", None)
    (tmp_path / "results.json").write_text(json.dumps(data))
    written = replot.main([str(tmp_path)])
    assert (tmp_path / "busbw.png") in written
    assert "Memory bandwidth" not in (tmp_path / "results.md").read_text()


def test_the_bound_is_drawn_only_where_it_holds_and_no_measured_point_lies_above_it() -> None:
    """The committed run measured its copy rate on 64 MiB copies: smaller messages fit the
    caches and may beat the bound (the 2-rank allreduce of 1 MiB does), so the bound and
    its hatched region start at that size, and every point it spans lies below it."""
    data = json.loads((ROOT / "docs" / "performance" / "results.json").read_text())
    membw = data["meta"]["membw"]
    bounds, _, _ = _bandwidth_axes(membw)
    [line] = bounds
    start, end = line.get_xdata()
    assert (start, end) == (membw["size"], 256 << 20)
    from benchmarks import plots
    from benchmarks.report import membw_bound

    for r in data["results"]:
        bound = membw_bound(membw, r["op"], r["world_size"])
        if bound is not None and r["size"] >= bound.from_bytes:
            assert plots.bus_bandwidth(r) <= bound.gbs, r


def test_the_many_tensor_figure_says_which_rows_were_not_measured(tmp_path: Path) -> None:
    """Dots, not bars on a log axis (whose lengths misstate ratios), and a row the run
    lacks is written as "not measured" rather than left out."""
    from benchmarks import plots

    records = json.loads((ROOT / "docs" / "performance" / "bulk.json").read_text())["results"]
    missing = plots.bulk(tmp_path / "bulk.png", records)
    held = {(r["nodes"], r["workload"], r["impl"]) for r in records}
    every = {
        (n, w, i)
        for n in {r["nodes"] for r in records}
        for w in {r["workload"] for r in records}
        for i in {r["impl"] for r in records}
    }
    assert set(missing) == every - held
    assert (2, "uniform", "object_store") in missing


def test_replot_redraws_the_committed_figures_and_pages(tmp_path: Path) -> None:
    from benchmarks import replot

    for name in ("results.json", "bulk.json"):
        (tmp_path / name).write_text((ROOT / "docs" / "performance" / name).read_text())
    written = replot.main([str(tmp_path)])
    figures = ["busbw.png", "busbw-2.png", "busbw-3.png", "busbw-4.png", "bulk.png"]
    assert sorted(p.name for p in written) == sorted([*figures, "results.md", "bulk.md"])
    for name in figures:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    page = (tmp_path / "results.md").read_text()
    assert all(f"]({name})" in page for name in figures[:4])
    assert "- Memory bandwidth: all processes together copy" in page
    for text in (page, (tmp_path / "bulk.md").read_text()):
        assert "copy bound" not in text


@pytest.mark.parametrize(("world_sizes", "per_figure"), [([2], 4), ([2, 4], 2), ([2, 3, 4], 1)])
def test_figures_hold_at_most_four_panels(world_sizes: list[int], per_figure: int) -> None:
    from benchmarks import plots

    records = [{"op": op, "world_size": n} for op in workloads.OPS for n in world_sizes]
    groups = plots.op_groups(records)
    assert [op for group in groups for op in group] == list(workloads.OPS)
    assert all(len(group) == per_figure for group in groups[:-1])
    assert all(len(group) * len(world_sizes) <= plots.MAX_PANELS for group in groups)
    with pytest.raises(ValueError, match="1 to 4 panels, got 5"):
        plots.panels_figure(Path("unused.png"), [("x", [])] * 5, lambda r: 0.0, "y")


def test_rdt_benchmark_runs_every_row_on_tiny_workloads(smoke: SmokeRun) -> None:
    out_json = smoke.folder / "rdt.json"
    done = smoke.done()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    data = json.loads(out_json.read_text())
    rows = {(r["workload"], r["impl"], r["consumers"]): r for r in data["results"]}
    impls = ("collective_shm", "collective", "gloo", "object_store")
    assert set(rows) == {
        (w, i, n) for w in ("1 MiB x 1", "4 KiB x 50") for i in impls for n in (1, 2)
    }
    for row in rows.values():
        assert row["wrong"] == 0, row
        assert row["status"] == "ok" or row["impl"] == "gloo", row
    assert {g["verdict"] for g in data["goals"]} == {"not measured"}, "no goal point is tiny"


NCCL_MODES = ("blocking", "async", "allgather", "reducescatter")


def test_host_path_benchmark_writes_a_row_per_path(smoke: SmokeRun) -> None:
    """``benchmarks.host_path`` runs every path and writes its rows; the speed is not checked."""
    out = smoke.folder / "host_path.json"
    done = smoke.done()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = json.loads(out.read_text())
    paths = [row["path"] for row in rows]
    assert paths == [
        *(f"nccl/{kind}/{mode}" for kind in ("torch", "cupy") for mode in NCCL_MODES),
        "shm/allreduce",
        "gloo/allreduce",
    ]
    for row in rows:
        assert set(row) == {"path", "us_per_call", "bare_us_per_call", "python_calls"}
        assert row["us_per_call"] > 0 and row["python_calls"] > 0
        assert (row["bare_us_per_call"] is None) == (not row["path"].startswith("nccl/"))


def test_crowded_benchmark_runs_ours_ray_and_the_baseline_in_rounds(smoke: SmokeRun) -> None:
    done = smoke.done()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    (data,) = json.loads((smoke.folder / "crowded.json").read_text())
    assert data["meta"]["baselines"] == {"main": str(ROOT)}
    assert len(data["meta"]["load_average_before"]) == 3
    rows = data["rows"]
    assert {r["impl"] for r in rows} == {"collective", "ray_collective", "main"}
    for r in rows:
        assert (r["world_size"], r["size"], r["wrong"]) == (3, 8, 0), r
        assert len(r["rounds_us"]) == 2
        assert 0 < r["min_us"] <= r["median_us"] <= r["max_us"]
        assert r["turns_per_rank_op"] > 0 and r["cpu_us_per_rank_op"] > 0, r
    assert [g["verdict"] for g in data["goals"]] == ["not measured"] * 3
    assert "# goals (issue 49)" in done.stdout


def _crowded_row(impl: str, world_size: int, median: float) -> dict[str, Any]:
    return {"impl": impl, "world_size": world_size, "size": 8, "median_us": median}


@pytest.mark.parametrize(
    ("ours16", "verdicts"),
    [(500.0, ["pass", "pass", "pass"]), (1500.0, ["fail", "fail", "pass"])],
)
def test_crowded_goals_compare_ray_the_8_rank_time_and_the_baseline(
    ours16: float, verdicts: list[str]
) -> None:
    from benchmarks import crowded

    rows = [
        _crowded_row("collective", 2, 10.0),
        _crowded_row("main", 2, 9.5),
        _crowded_row("collective", 8, 300.0),
        _crowded_row("collective", 16, ours16),
        _crowded_row("ray_collective", 16, 5000.0),
    ]
    assert [g.verdict for g in crowded.goals(rows, "main")] == verdicts
    assert crowded.goals(rows, None)[2].verdict == "not measured"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--world-sizes", "1,2"], "at least 2"),
        (["--rounds", "0"], "--rounds must be at least 1"),
        (["--sizes", "8,4X"], "sizes must be like"),
        (["--baseline", "main=/nonexistent"], "holding a collective package"),
        (["--baseline", "collective=."], "NAME not"),
        (["--baseline", f"a={ROOT}", "--baseline", f"a={ROOT}"], "NAME not"),
    ],
)
def test_crowded_benchmark_rejects_bad_arguments(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks import crowded

    with pytest.raises(SystemExit):
        crowded.arguments(flags)
    assert message in capsys.readouterr().err


def _exit_with(status: int) -> None:
    """A rank of ``benchmarks.torch_backend`` that dies before it sends its times."""
    sys.exit(status)


def test_torch_backend_benchmark_stops_at_once_when_a_rank_dies() -> None:
    """The parent names a rank that exited without its times, not after its 20-minute wait."""
    import multiprocessing
    import time

    from benchmarks import torch_backend

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=_exit_with, args=(3,)) for _ in range(2)]
    for process in ranks:
        process.start()
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"ranks that failed, with their exit status"):
            torch_backend._collect(ranks, results)
    finally:
        for process in ranks:
            process.join(60)
    assert time.monotonic() - started < 60
    assert [p.exitcode for p in ranks] == [3, 3]


def test_torch_backend_benchmark_writes_every_row_and_goal(smoke: SmokeRun) -> None:
    """``benchmarks.torch_backend`` times each op, DDP and the binding on both backends."""
    from benchmarks.torch_backend_ranks import BACKENDS, NO_COMMUNICATION, OPS

    done = smoke.done()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    data = json.loads((smoke.folder / "torch_backend.json").read_text())
    rows = {(r["op"], r["size"], r["backend"]): r for r in data["ops"]}
    assert set(rows) == {(op, size, b) for op in OPS for size in (8, 65536) for b in BACKENDS}
    for row in [*rows.values(), *data["binding"]]:
        assert row["world_size"] == 2, row
        for spread in (v for k, v in row.items() if k.endswith("_us") and k != "added_us"):
            assert 0 < spread["min"] <= spread["median"] <= spread["max"], row
    assert {r["backend"] for r in data["ddp"]} == {*BACKENDS, NO_COMMUNICATION}
    assert all(r["steps_per_s"]["median"] > 0 for r in data["ddp"])
    meta = data["meta"]
    assert meta["rounds"] == 2 and meta["ddp_gradient_bytes"] == 4 << 20
    assert meta["command"].startswith("python -m benchmarks.torch_backend --world-sizes 2")
    assert {"machine", "cpus", "torch", "load_average", "when", "seconds"} <= set(meta)
    verdicts = [g["verdict"] for g in data["goals"]]
    # No 64 MiB buffer and no 64 MiB model in a smoke run: two goals are not measured.
    assert verdicts[1:3] == ["not measured", "not measured"], data["goals"]
    assert verdicts[0] in ("pass", "fail") and verdicts[3] in ("pass", "fail")
    for goal in data["goals"]:
        assert goal["claim"] in done.stdout
