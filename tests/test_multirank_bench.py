"""The benchmark of NCCL's multi-rank mode and the routes table derived from it, without a GPU.

The measurement itself needs a GPU (``tests/gpu/run.sh`` runs it); here: the path where
the installed NCCL has no such mode, the report's lines, the per-call goal, and the
derivation of routes from hand-written results, checked against what the groups read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import multirank, multirank_routes, shared_gpu
from collective.groups.gpu import routes

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


def results(rows: list[tuple[str, int, float, float]], **multi: Any) -> dict[str, Any]:
    """Return a results file whose multi-rank rows are ``(op, size, shared_us, multirank_us)``."""
    found = {
        "nccl": "2.30.1",
        "world_size": 2,
        "why": "",
        "rows": [
            {"op": op, "size": size, "shared_us": s, "multirank_us": m, "faster": "-"}
            for op, size, s, m in rows
        ],
        **multi,
    }
    return {
        "meta": {"gpu": "NVIDIA H200"},
        "shared_gpu": {"versions": {"gpu": "NVIDIA H200"}, "multirank": found},
    }


def test_an_nccl_without_the_mode_is_said_not_installed_and_starts_no_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_pool(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("ranks were started")

    monkeypatch.setattr(multirank, "RankPool", no_pool)
    found = multirank.measure_multirank(22803, multirank.sizes(GIB), 3)
    assert found["why"] == "not installed: NCCL 2.28.3"
    assert found["rows"] == [] and found["nccl"] == "2.28.3"
    lines = multirank.text(found)
    assert lines == [
        "# NCCL's multi-rank mode (NCCL_MULTI_RANK_GPU_ENABLE=1) beside the shared-GPU "
        "transport, 2 ranks on one GPU, NCCL 2.28.3: not installed: NCCL 2.28.3"
    ]
    assert multirank.installed(0) == "not installed: no NCCL"
    assert multirank.installed(23000) == "" and multirank.installed(23203) == ""
    with pytest.raises(ValueError, match=r"not installed: NCCL 2\.28\.3"):
        multirank_routes.derive({"shared_gpu": {"multirank": found}})


def test_the_sizes_are_the_fixed_ones_and_the_runs_up_to_its_largest() -> None:
    assert multirank.sizes(GIB, (8, GIB)) == [8, 64 * KIB, MIB, 16 * MIB, 256 * MIB, GIB]
    assert multirank.sizes(64 * MIB, (8, 64 * MIB)) == [8, 64 * KIB, MIB, 16 * MIB, 64 * MIB]
    assert multirank.calls_for(8) == 1000 and multirank.calls_for(GIB) == 1
    assert multirank.calls_for(MIB) == 64


def test_the_report_prints_every_goal_with_what_was_measured_and_the_mode_beside() -> None:
    found = results([("allreduce", 8, 20.0, 31.5), ("allreduce", GIB, 9000.0, 7000.0)])
    multi = dict(found["shared_gpu"]["multirank"])
    multi["rows"] = [dict(r, faster="?") for r in multi["rows"]]
    per_call = {
        "collective": {"median_us": 9.0},
        "cupy_nccl": {"median_us": 3.5},
        "over_us": 5.5,
    }
    goal, measured, met = multirank.per_call_goal(per_call)
    assert "within 5 us of bare NCCL" in goal and measured == "9.00 us vs 3.50 us, +5.50 us"
    assert not met
    assert multirank.per_call_goal(dict(per_call, over_us=5.0))[2]
    result = {
        "rows": [{"what": "allreduce 8 B x1000, shared", "world_size": 2, "us": 21.5}],
        "goals": {"8 B allreduce <= 25 us": True, goal: met},
        "measured": {"8 B allreduce <= 25 us": "21.5 us", goal: measured},
        "multirank": multi,
    }
    text = shared_gpu.text(result, {"gpu": "NVIDIA H200"})
    assert "goal: 8 B allreduce <= 25 us: measured 21.5 us: met" in text
    assert f"goal: {goal}: measured 9.00 us vs 3.50 us, +5.50 us: MISSED" in text
    assert "NCCL 2.30.1, time per call (us)" in text
    assert "allreduce     1 GiB       9000.0           7000.0" in text, text


@pytest.mark.parametrize(
    ("won", "expected"),
    [
        pytest.param([(8, True), (MIB, False), (GIB, False)], [[0, 2897]], id="small-only"),
        pytest.param([(8, False), (MIB, False), (GIB, True)], [[32 * MIB, None]], id="large-only"),
        pytest.param(
            [(8, False), (64 * KIB, True), (16 * MIB, True), (GIB, False)],
            [[725, 128 * MIB]],
            id="crossover-both-ways",
        ),
        pytest.param([(8, True), (GIB, True)], [[0, None]], id="every-size"),
        pytest.param([(8, False), (GIB, False)], [], id="no-size"),
        pytest.param(
            [(8, True), (KIB, False), (MIB, True)], [[0, 91], [32 * KIB, None]], id="alternating"
        ),
    ],
)
def test_ranges_cover_the_sizes_nearest_a_win_on_a_log_scale(
    won: list[tuple[int, bool]], expected: list[list[int | None]]
) -> None:
    assert multirank_routes.ranges(won) == expected
    assert multirank_routes.ranges(list(reversed(won))) == expected


def test_a_boundary_is_the_first_size_nearer_the_upper_measurement() -> None:
    assert multirank_routes.boundary(MIB, 16 * MIB) == 4 * MIB
    assert multirank_routes.boundary(8, MIB) == 2897  # sqrt(8 MiB) = 2896.3...
    assert multirank_routes.boundary(8, 8) == 8


def test_routes_from_results_route_each_op_where_nccl_was_faster_and_ties_stay_shared() -> None:
    body = results(
        [
            ("allreduce", 8, 20.0, 35.0),
            ("allreduce", MIB, 300.0, 300.0),  # a tie: shared-GPU
            ("allreduce", 16 * MIB, 900.0, 700.0),
            ("allreduce", GIB, 50000.0, 40000.0),
            ("broadcast", 8, 15.0, 12.0),
            ("broadcast", GIB, 30000.0, 45000.0),
        ]
    )
    table = multirank_routes.derive(body)
    assert table["routes"] == {"allreduce": [[4 * MIB, None]], "broadcast": [[0, 92682]]}
    assert table["measured_on"] == {
        "gpu": "NVIDIA H200",
        "nccl": "2.30.1",
        "world_size": 2,
        "sizes": [8, MIB, 16 * MIB, GIB],
        "command": "python -m benchmarks.nccl --shared-gpu",
    }
    loaded = routes.Routes.from_json(table)
    assert not loaded.nccl_runs("allreduce", 4 * MIB - 1) and loaded.nccl_runs("allreduce", 4 * MIB)
    assert not loaded.nccl_runs("allreduce", MIB), "a tie stays on the shared-GPU transport"
    assert loaded.nccl_runs("broadcast", 8) and not loaded.nccl_runs("broadcast", MIB)


def test_a_run_where_nccl_never_won_says_it_was_measured_with_no_route() -> None:
    table = multirank_routes.derive(results([("allreduce", 8, 20.0, 35.0)]))
    assert table["routes"] == {} and table["measured_on"]["nccl"] == "2.30.1"
    assert not routes.Routes.from_json(table)


def test_the_command_writes_the_table_and_leaves_it_alone_without_a_measurement(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "routes.json"
    target.write_text('{"measured_on": null, "routes": {}}\n')
    failed = tmp_path / "failed.json"
    failed.write_text(json.dumps(results([], failed="rank 1 died")))
    assert multirank_routes.main(["--from", str(failed), "--to", str(target)]) == 1
    assert "rank 1 died" in capsys.readouterr().err
    assert json.loads(target.read_text()) == {"measured_on": None, "routes": {}}
    good = tmp_path / "bench.json"
    good.write_text(json.dumps(results([("allreduce", 8, 20.0, 10.0)])))
    assert multirank_routes.main(["--from", str(good), "--to", str(target)]) == 0
    written = json.loads(target.read_text())
    assert written["routes"] == {"allreduce": [[0, None]]}
    assert routes.load(target).nccl_runs("allreduce", GIB)
