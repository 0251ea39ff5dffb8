"""Two ranks on one GPU routing each op to the shared-GPU transport or NCCL's multi-rank mode.

No machine here has a GPU or NCCL 2.30's multi-rank mode. Ranks are threads meeting
on a TCPStore; the shared-GPU transport runs for real on a stood-in GPU (``HostGpu``),
NCCL's multi-rank group is stood in by a Gloo group on host memory that logs every call
(``LoggedStages``), the NCCL version by a function, and the routes table by a file named
by ``COLLECTIVE_GPU_ROUTES``. So the decision, the routing of every op, the agreement
that catches ranks routed apart, the failures and the teardown run for real.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from collective.groups.gpu import routes
from collective.groups.gpu.routed import RoutedGpuGroup
from collective.groups.shared_gpu import transport
from collective.groups.shared_gpu.group import SharedGpuGroup
from collective.types import (
    AllGatherOptions,
    AllReduceOptions,
    BarrierOptions,
    BroadcastOptions,
    CollectiveError,
    RecvOptions,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
    SendOptions,
)
from tests.shared_gpu_standin import HostDevice, HostGpu
from tests.test_gpu_hierarchy import HostStages, run_on_gpus
from tests.test_shared_gpu_group import _data

TIMEOUT = timedelta(seconds=20)
TABLE = {
    "measured_on": {"gpu": "stand-in", "nccl": "2.30.0", "world_size": 2},
    "routes": {
        "allreduce": [[4096, None]],
        "broadcast": [[0, 1024]],
        "allgather": [[8192, None]],
        "reducescatter": [[0, None]],
    },
}
"""NCCL runs allreduce from 4 KiB, broadcast below 1 KiB, allgather of 8 KiB gathered and
more, every reducescatter; reduce and every other op stay on the shared-GPU transport."""


class LoggedStages(HostStages):
    """The stand-in NCCL group, logging every call it gets by name, per rank."""

    calls: ClassVar[dict[int, list[str]]] = {}

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.gloo, name)
        if not callable(attr):
            return attr
        log = self.calls.setdefault(self.gloo.rank, [])

        def logged(*args: Any) -> Any:
            log.append(name)
            return attr(*args)

        return logged


def write_table(tmp_path: Path, body: dict[str, Any]) -> Path:
    path = tmp_path / f"routes-{uuid.uuid4().hex[:6]}.json"
    path.write_text(json.dumps(body))
    return path


@pytest.fixture(autouse=True)
def stand_ins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """NCCL 2.30, the routes of ``TABLE``, small slots; the multi-rank variable restored after."""
    monkeypatch.setattr(transport, "MAIL_BYTES", 4096)
    monkeypatch.setattr(transport, "SLOT_BYTES", 8192)
    monkeypatch.setattr(routes, "nccl_version", lambda cupy: 23000)
    monkeypatch.setenv(routes.ROUTES_ENV, str(write_table(tmp_path, TABLE)))
    monkeypatch.setenv(routes.MULTIRANK_ENV, "unset")
    monkeypatch.delenv(routes.MULTIRANK_ENV)
    LoggedStages.calls = {}
    yield
    HostStages.boards.clear()


def run_routed(
    world_size: int,
    fn: Callable[[Any, int], Any],
    make: Callable[..., Any] = LoggedStages,
    group_timeout: timedelta = TIMEOUT,
) -> list[Any]:
    """Run ``fn(group, rank)`` on a group built as ``backend="nccl"`` does; destroy it after."""
    gpu = HostGpu(blocking=True)
    return run_on_gpus(
        world_size, fn, lambda rank: HostDevice(gpu, rank), make=make, group_timeout=group_timeout
    )


# --- the decision -----------------------------------------------------------------------------


def never_asked() -> int:
    raise AssertionError("the NCCL version was asked for")


def test_routes_apply_only_to_two_ranks_nccl_230_and_a_table_with_a_route(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    found = routes.table_for(2, lambda: 23000)
    assert found is not None and found.nccl_runs("allreduce", 4096)
    assert routes.table_for(2, lambda: 22803) is None, "NCCL 2.28.3 has no multi-rank mode"
    assert routes.table_for(2, lambda: 2708) is None, "NCCL 2.7.8, the old encoding"
    assert routes.table_for(3, never_asked) is None, "NCCL holds at most two ranks per GPU"
    assert routes.table_for(1, never_asked) is None
    empty = write_table(tmp_path, {"measured_on": None, "routes": {}})
    monkeypatch.setenv(routes.ROUTES_ENV, str(empty))
    assert routes.table_for(2, lambda: 23000) is None, "an empty table routes nothing"
    no_range = write_table(tmp_path, {"measured_on": None, "routes": {"allreduce": []}})
    monkeypatch.setenv(routes.ROUTES_ENV, str(no_range))
    assert routes.table_for(2, lambda: 23000) is None, "an op without a range routes nothing"
    monkeypatch.setenv(routes.ROUTES_ENV, "off")
    assert routes.table_for(2, lambda: 23000) is None, "COLLECTIVE_GPU_ROUTES=off"
    monkeypatch.setenv(routes.ROUTES_ENV, str(write_table(tmp_path, TABLE)))
    monkeypatch.setenv(routes.MULTIRANK_ENV, "0")
    assert routes.table_for(2, never_asked) is None, "NCCL_MULTI_RANK_GPU_ENABLE=0"
    monkeypatch.setenv(routes.MULTIRANK_ENV, "1")
    assert routes.table_for(2, lambda: 23000) is not None


def test_the_committed_table_routes_nothing_and_says_it_was_never_measured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    committed = json.loads(routes.TABLE.read_text())
    assert committed == {"measured_on": None, "routes": {}}
    monkeypatch.delenv(routes.ROUTES_ENV)
    assert routes.table_for(2, lambda: 23000) is None


def test_ranges_include_their_start_and_exclude_their_end() -> None:
    table = routes.Routes(None, {"allreduce": ((8, 64), (1024, None)), "broadcast": ()})
    assert [table.nccl_runs("allreduce", n) for n in (4, 8, 63, 64, 1023, 1024, 1 << 40)] == [
        False,
        True,
        True,
        False,
        False,
        True,
        True,
    ]
    assert not table.nccl_runs("broadcast", 8) and not table.nccl_runs("reduce", 8)
    assert routes.op_bytes("allgather", 100, 2) == 200 and routes.op_bytes("reduce", 100, 2) == 100
    assert routes.Routes.from_json(table.to_json()) == table
    assert routes.version_text(23000) == "2.30.0" and routes.version_text(22803) == "2.28.3"


@pytest.mark.parametrize(
    ("routes_of", "why"),
    [
        ({"alltoall": [[0, None]]}, "may route"),
        ({"allreduce": [[64, 8]]}, "holds no byte"),
        ({"allreduce": [[64, 128], [100, 200]]}, "ascending"),
        ({"allreduce": [[64, None], [100, 200]]}, "without an end"),
        ({"allreduce": [["8", None]]}, "expected"),
    ],
)
def test_a_table_that_is_not_one_is_refused(routes_of: dict[str, Any], why: str) -> None:
    with pytest.raises(CollectiveError, match=why):
        routes.Routes.from_json({"measured_on": None, "routes": routes_of})


def test_an_unreadable_table_named_by_the_variable_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(routes.ROUTES_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(CollectiveError, match="cannot read the routes table"):
        routes.table_for(2, lambda: 23000)


def refuse(*args: Any) -> Any:
    raise AssertionError("an NCCL group was made")


@pytest.mark.parametrize(
    ("world_size", "version", "table"),
    [
        pytest.param(2, 22803, TABLE, id="nccl-2.28"),
        pytest.param(3, 23000, TABLE, id="three-ranks"),
        pytest.param(2, 23000, {"measured_on": None, "routes": {}}, id="empty-table"),
    ],
)
def test_without_routes_the_group_is_the_shared_gpu_transport_alone(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    world_size: int,
    version: int,
    table: dict[str, Any],
) -> None:
    monkeypatch.setattr(routes, "nccl_version", lambda cupy: version)
    monkeypatch.setenv(routes.ROUTES_ENV, str(write_table(tmp_path, table)))

    def fn(g: Any, rank: int) -> list[float]:
        assert type(g) is SharedGpuGroup and g.transport == "shared_gpu"
        x = _data(rank, 2000)
        g.allreduce([x], AllReduceOptions())
        return x[:3].tolist()

    results = run_routed(world_size, fn, make=refuse)
    assert results == [results[0]] * world_size
    assert routes.MULTIRANK_ENV not in os.environ, "the variable is set only where NCCL runs"


# --- the routed group -------------------------------------------------------------------------


def test_each_op_runs_on_the_transport_its_routes_name_on_every_rank() -> None:
    ws = 2

    def fn(g: Any, rank: int) -> dict[str, Any]:
        assert isinstance(g, RoutedGpuGroup) and g.transport == "shared_gpu|nccl"
        assert os.environ[routes.MULTIRANK_ENV] == "1"
        out: dict[str, Any] = {}
        small, large = _data(rank, 100), _data(rank, 2000)  # 400 B and 8000 B
        g.allreduce([small], AllReduceOptions())
        g.allreduce([large], AllReduceOptions(ReduceOp.MAX))
        out["allreduce"] = (small, large)
        late = _data(rank + 5, 2000)
        g.allreduce([late], AllReduceOptions(async_op=True)).wait()
        out["async"] = late
        tiny, big = _data(rank + 1, 100, "int32"), _data(rank + 2, 2000, "int32")
        g.broadcast([tiny], BroadcastOptions(root_rank=1))
        g.broadcast([big], BroadcastOptions(root_rank=0))
        out["broadcast"] = (tiny, big)
        x = _data(rank + 3, 2000)
        g.reduce([x], ReduceOptions(ReduceOp.SUM, root_rank=1))
        out["reduce"] = x
        piece = _data(rank + 4, 1024)  # 4 KiB each, 8 KiB gathered: NCCL
        gathered = [np.zeros(1024, np.float32) for _ in range(ws)]
        g.allgather([gathered], [piece], AllGatherOptions())
        few = [np.zeros(10, np.float32) for _ in range(ws)]  # 80 B gathered: shared-GPU
        g.allgather([few], [piece[:10].copy()], AllGatherOptions())
        out["allgather"] = (gathered, few)
        chunks = [_data(rank * 10 + j, 500) for j in range(ws)]
        mine = np.zeros(500, np.float32)
        g.reducescatter([mine], [chunks], ReduceScatterOptions())
        out["reducescatter"] = mine
        g.barrier(BarrierOptions())
        peer = np.zeros(2000, np.float32)
        if rank == 0:
            g.send([_data(99, 2000)], SendOptions(dst_rank=1))
        else:
            g.recv([peer], RecvOptions(src_rank=0))
        out["recv"] = peer
        return out

    got = run_routed(ws, fn)
    for rank in range(ws):
        small, large = got[rank]["allreduce"]
        np.testing.assert_array_equal(small, _data(0, 100) + _data(1, 100))
        np.testing.assert_array_equal(large, np.maximum(_data(0, 2000), _data(1, 2000)))
        np.testing.assert_array_equal(got[rank]["async"], _data(5, 2000) + _data(6, 2000))
        tiny, big = got[rank]["broadcast"]
        np.testing.assert_array_equal(tiny, _data(2, 100, "int32"))
        np.testing.assert_array_equal(big, _data(2, 2000, "int32"))
        gathered, few = got[rank]["allgather"]
        for j in range(ws):
            np.testing.assert_array_equal(gathered[j], _data(j + 4, 1024))
            np.testing.assert_array_equal(few[j], _data(j + 4, 1024)[:10])
        want = sum(_data(r * 10 + rank, 500) for r in range(ws))
        np.testing.assert_array_equal(got[rank]["reducescatter"], want)
    np.testing.assert_array_equal(got[1]["reduce"], _data(3, 2000) + _data(4, 2000))
    np.testing.assert_array_equal(got[0]["reduce"], _data(3, 2000))
    np.testing.assert_array_equal(got[1]["recv"], _data(99, 2000))
    ran = ["allreduce", "broadcast", "allgather", "reducescatter"]
    for rank in range(ws):
        calls = LoggedStages.calls[rank]
        assert calls[0] == "skip_agreement", calls
        assert [c for c in calls if c in routes.ROUTED_OPS] == ran, calls
        assert calls[-2:] == ["abort", "destroy_group"], calls


@pytest.mark.parametrize(
    ("op", "sizes"),
    [
        pytest.param("allreduce", (2000, 100), id="allreduce-nccl-vs-shared"),
        pytest.param("allreduce", (100, 2000), id="allreduce-shared-vs-nccl"),
        pytest.param("broadcast", (100, 2000), id="broadcast-nccl-vs-shared"),
    ],
)
def test_ranks_whose_sizes_route_apart_both_raise_with_nothing_written(
    op: str, sizes: tuple[int, int]
) -> None:
    def fn(g: Any, rank: int) -> tuple[str, float]:
        x = _data(rank, sizes[rank])
        before = x.copy()
        start = time.monotonic()
        with pytest.raises(CollectiveError) as caught:
            if op == "allreduce":
                g.allreduce([x], AllReduceOptions())
            else:
                g.broadcast([x], BroadcastOptions(root_rank=1))
        took = time.monotonic() - start
        np.testing.assert_array_equal(x, before)
        with pytest.raises(CollectiveError):
            g.barrier(BarrierOptions())
        return str(caught.value), took

    results = run_routed(2, fn)
    for message, took in results:
        assert took < TIMEOUT.total_seconds() / 2, (message, took)
    assert any(op in m for m, _ in results), results
    for rank in range(2):
        ran = [c for c in LoggedStages.calls.get(rank, []) if c in routes.ROUTED_OPS]
        assert ran == [], "NCCL ran an op the ranks disagree on"


def test_a_failure_of_the_nccl_group_breaks_the_group_on_both_ranks() -> None:
    def fn(g: Any, rank: int) -> str:
        x = _data(rank, 2000)
        g.allreduce([x], AllReduceOptions())
        if rank == 0:
            (stages, *_) = HostStages.boards[f"{g.group_name}/multirank"]
            stages.fail(CollectiveError("the stand-in NCCL failed"))
        g_error = None
        deadline = time.monotonic() + 10
        while g_error is None and time.monotonic() < deadline:
            g_error = g.error
            time.sleep(0.01)
        with pytest.raises(CollectiveError) as caught:
            g.allreduce([_data(rank, 100)], AllReduceOptions())
        return str(caught.value)

    for message in run_routed(2, fn):
        assert "the stand-in NCCL failed" in message, message


def test_a_break_of_the_shared_gpu_transport_fails_the_nccl_group_on_both_ranks() -> None:
    def fn(g: Any, rank: int) -> bool:
        x = _data(rank, 100)
        with pytest.raises(CollectiveError):
            if rank == 0:
                g.allreduce([x], AllReduceOptions())
            else:
                g.broadcast([x], BroadcastOptions(root_rank=0))
        (mine,) = [s for s in HostStages.boards[f"{g.group_name}/multirank"] if s.rank == rank]
        return mine.error is not None

    assert run_routed(2, fn) == [True, True]


def test_retiring_the_group_retires_the_nccl_group_and_never_destroys_it() -> None:
    def fn(g: Any, rank: int) -> None:
        x = _data(rank, 2000)
        g.allreduce([x], AllReduceOptions())
        g.retire("replaced by a new incarnation")
        with pytest.raises(CollectiveError, match=r"destroyed|replaced"):
            g.allreduce([x], AllReduceOptions())

    run_routed(2, fn)
    for rank in range(2):
        calls = LoggedStages.calls[rank]
        assert calls[-1] == "retire" and "destroy_group" not in calls, calls
