"""Two ranks on one GPU, each op on the shared-GPU transport or on NCCL's multi-rank mode.

Needs NCCL 2.30 or later (the one cupy loads). The ranks are processes on GPU 0, built
as a ``backend="nccl"`` group is (``connect_gpu_group``), with ``COLLECTIVE_GPU_ROUTES``
naming a table of this test's own: allreduce from 1 MiB and broadcast below 1 KiB on
NCCL's mode, everything else on the shared-GPU transport. Checks every rank's result on
both routes, that ops on one buffer stay in order across the transports, and that ranks
whose sizes route them apart both raise within the timeout. No Ray.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.gpu import cases

MIB = 1 << 20
TABLE = {
    "measured_on": None,
    "routes": {"allreduce": [[MIB, None]], "broadcast": [[0, 1024]]},
}


def _nccl_version() -> int:
    if cases.no_gpu_reason():
        return 0
    from collective.groups.gpu import routes
    from collective.groups.nccl.comm import cupy_module

    return routes.nccl_version(cupy_module())


def _no_mode() -> str:
    from collective.groups.gpu import routes

    code = _nccl_version()
    if code >= routes.MULTIRANK_VERSION:
        return ""
    return f"NCCL's multi-rank mode needs NCCL 2.30 or later, here {routes.version_text(code)}"


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bool(cases.no_gpu_reason()), reason=cases.no_gpu_reason() or "-"),
    pytest.mark.skipif(bool(_no_mode()), reason=_no_mode() or "-"),
]

_ROUTED: list[Any] = []
"""The group of the rank in this process, between jobs."""


def open_routed(context: Any, name: str, table: str) -> str:
    """Build this rank's group on GPU 0 with the routes in file ``table``; say its transport."""
    import cupy

    from collective.groups.gpu.connect import connect_gpu_group

    os.environ.pop("NCCL_HOSTID", None)
    os.environ["COLLECTIVE_GPU_ROUTES"] = table
    cupy.cuda.Device(0).use()
    timeout = timedelta(seconds=20)
    group = connect_gpu_group(context.world_size, context.rank, name, context.store, timeout)
    _ROUTED[:] = [group]
    return str(group.transport)


def close_routed(context: Any) -> None:
    """Destroy this rank's group."""
    _ROUTED.pop().destroy_group()


@pytest.fixture
def routed(tmp_path: Path) -> Iterator[Any]:
    """Yield a pool of 2 ranks on GPU 0 whose group routes by ``TABLE``."""
    from benchmarks.nccl_ranks import RankPool

    table = tmp_path / "routes.json"
    table.write_text(json.dumps(TABLE))
    with RankPool(2, timeout=timedelta(seconds=120)) as pool:
        name = f"routed-{uuid.uuid4().hex[:8]}"
        assert pool.run(open_routed, name, str(table)) == ["shared_gpu|nccl"] * 2
        yield pool
        pool.run(close_routed)


def ops_on_rank(context: Any) -> dict[str, list[float]]:
    """Run allreduce and broadcast on both routes, then ops on one buffer across both."""
    import cupy

    from collective.types import AllReduceOptions, BroadcastOptions

    group, rank, got = _ROUTED[0], context.rank, {}
    for count in (16, MIB):  # 64 B on the shared-GPU transport, 4 MiB on NCCL
        x = cupy.full(count, rank + 1, dtype=cupy.float32)
        group.allreduce([x], AllReduceOptions())
        got[f"allreduce {count}"] = [float(x[0]), float(x[-1])]
        y = cupy.full(count, 10 * rank + 1, dtype=cupy.float32)  # 64 B on NCCL, 4 MiB shared
        group.broadcast([y], BroadcastOptions(root_rank=1))
        got[f"broadcast {count}"] = [float(y[0]), float(y[-1])]
    z = cupy.ones(MIB, dtype=cupy.float32)
    group.allreduce([z], AllReduceOptions())  # NCCL: 2
    group.allreduce([z], AllReduceOptions(async_op=True)).wait(cases.WAIT)  # shared: 4
    group.allreduce([z], AllReduceOptions())  # NCCL: 8
    cupy.cuda.get_current_stream().synchronize()
    got["in order"] = [float(z[0]), float(z[-1])]
    return got


def test_each_route_gives_every_rank_the_result_and_ops_stay_in_order(routed: Any) -> None:
    for got in routed.run(ops_on_rank):
        assert got == {
            "allreduce 16": [3.0, 3.0],
            f"allreduce {MIB}": [3.0, 3.0],
            "broadcast 16": [11.0, 11.0],
            f"broadcast {MIB}": [11.0, 11.0],
            "in order": [8.0, 8.0],
        }


def mismatch_on_rank(context: Any) -> tuple[str, float]:
    """Rank 0 allreduces 4 MiB (NCCL), rank 1 64 B (shared-GPU); return the error and time."""
    import cupy

    from collective.types import AllReduceOptions, CollectiveError

    x = cupy.ones(MIB if context.rank == 0 else 16, dtype=cupy.float32)
    start = time.monotonic()
    try:
        _ROUTED[0].allreduce([x], AllReduceOptions())
    except CollectiveError as exc:
        return str(exc), time.monotonic() - start
    return "", time.monotonic() - start


def test_ranks_whose_sizes_route_apart_both_raise(routed: Any) -> None:
    for message, took in routed.run(mismatch_on_rank):
        assert "allreduce" in message and took < 10, (message, took)
