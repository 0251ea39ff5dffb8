"""NCCL's multi-rank mode beside the shared-GPU transport, and a group of one's per-call cost.

Two parts of ``python -m benchmarks.nccl --shared-gpu`` (``benchmarks.shared_gpu``):

- Where the NCCL that cupy loaded is 2.30 or later: 2 ranks on GPU 0, each process
  holding the shared-GPU group (``COLLECTIVE_GPU_ROUTES=off``: that transport alone)
  and a plain ``NCCLGroup`` of the same ranks made with
  ``NCCL_MULTI_RANK_GPU_ENABLE=1`` and no ``NCCL_HOSTID``. NCCL reads both variables
  once per process, so these ranks are a pool of their own, apart from the ranks that
  hold NCCL over sockets. Allreduce and broadcast are timed on both at ``SIZES`` and
  the sizes the run's other allreduce rows cover, side by side in the same processes.
  Where NCCL is older, the results say so: ``not installed: NCCL 2.28.3``.
  ``python -m benchmarks.multirank_routes`` turns these rows into the package's
  routes table.
- World size 1: the host time of one blocking 8-byte ``col.allreduce`` on an
  ``NCCLGroup`` beside one bare ``cupy.cuda.nccl`` allreduce on the same kind of
  buffer and the same stream, timed by ``nccl_timing.overhead`` in a
  ``nccl_peers.setup`` rank, as ``python -m benchmarks.nccl`` times it (goal: within
  ``PER_CALL_GOAL_US``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from benchmarks import nccl_peers, nccl_timing, shared_gpu
from benchmarks.nccl_ranks import RankError, RankPool
from collective.groups.gpu import routes

SIZES = (8, 64 << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30)
"""The sizes measured on both transports, besides those the run's allreduce rows cover."""
OPS = ("allreduce", "broadcast")
WORLD_SIZE = routes.MULTIRANK_RANKS
PER_CALL_GOAL_US = 5.0
"""The most host time per call ``col.allreduce`` may add to a bare NCCL call, world size 1."""
PER_CALL = "collective", nccl_peers.RAW
"""Ours and the bare call, as ``nccl_peers`` names them."""
BURST_BYTES = 64 << 20
"""About the bytes each timed burst of calls moves (at most 1,000 calls)."""


def installed(code: int) -> str:
    """Return "" where NCCL ``code`` has the multi-rank mode, else why not, in words."""
    if code >= routes.MULTIRANK_VERSION:
        return ""
    return f"not installed: NCCL {routes.version_text(code)}" if code else "not installed: no NCCL"


def sizes(largest: int, covered: Iterable[int] = ()) -> list[int]:
    """Return ``SIZES`` and ``covered``, ascending, up to ``largest`` bytes."""
    return sorted({s for s in (*SIZES, *covered) if s <= largest})


def calls_for(size: int) -> int:
    """Return the calls of one timed burst at ``size`` bytes."""
    return max(1, min(1000, BURST_BYTES // size))


def open_multirank(context: Any, name: str) -> str:
    """Build this rank's shared-GPU group and an NCCL group in NCCL's multi-rank mode."""
    import cupy
    import torch

    from collective.groups.gpu.connect import connect_gpu_group
    from collective.groups.nccl.group import NCCLGroup
    from collective.rendezvous.store import PrefixedRendezvousStore

    cupy.cuda.Device(0).use()
    torch.cuda.set_device(0)
    os.environ.pop("NCCL_HOSTID", None)  # one host: NCCL's own mode, not its sockets
    os.environ[routes.MULTIRANK_ENV] = "1"
    os.environ[routes.ROUTES_ENV] = "off"  # the shared-GPU transport alone, to compare
    timeout = timedelta(seconds=120)
    store = PrefixedRendezvousStore(context.store, f"{name}/shared/")
    group = connect_gpu_group(context.world_size, context.rank, name, store, timeout)
    plain = PrefixedRendezvousStore(context.store, f"{name}/multirank/")
    nccl = NCCLGroup(context.world_size, context.rank, f"{name}-multirank", plain, timeout)
    shared_gpu.STATE.update(shared=group, multirank=nccl, name=name)
    return str(group.transport)


def close_multirank(context: Any) -> None:
    """Destroy both groups of this rank."""
    state = shared_gpu.STATE
    state.pop("multirank").destroy_group()
    state.pop("shared").destroy_group()
    state.clear()


def _time(pool: RankPool, op: str, which: str, size: int, reps: int) -> float:
    """Return the time per call of ``op`` of ``size`` bytes on ``which``, the slowest rank's."""
    calls = calls_for(size)
    if op == "allreduce":
        per_rank = pool.run(shared_gpu.allreduce_job, which, size, calls, reps)
    else:
        per_rank = pool.run(shared_gpu.broadcast_job, size, reps, which, calls)
    return shared_gpu.slowest(per_rank)


def measure_multirank(code: int, points: list[int], reps: int) -> dict[str, Any]:
    """Time ``OPS`` at ``points`` on both transports where NCCL ``code`` has the mode.

    Returns the NCCL version, why nothing was measured ("" if it was), and a row per
    op and size: both times in µs and which was faster. A failure of the ranks is
    recorded in ``failed``, with the rows measured before it.
    """
    found: dict[str, Any] = {
        "nccl": routes.version_text(code),
        "world_size": WORLD_SIZE,
        "why": installed(code),
        "rows": [],
    }
    if found["why"]:
        return found
    rows: list[dict[str, Any]] = found["rows"]
    try:
        with RankPool(WORLD_SIZE, timeout=timedelta(seconds=600)) as pool:
            transports = pool.run(open_multirank, f"bench-multirank-{uuid.uuid4().hex[:6]}")
            shared_gpu.picked(transports)
            for op in OPS:
                for k, size in enumerate(points):
                    order = ("shared", "multirank") if k % 2 == 0 else ("multirank", "shared")
                    us = {which: _time(pool, op, which, size, reps) * 1e6 for which in order}
                    faster = "multirank" if us["multirank"] < us["shared"] else "shared"
                    rows.append(
                        {
                            "op": op,
                            "size": size,
                            "shared_us": us["shared"],
                            "multirank_us": us["multirank"],
                            "faster": faster,
                        }
                    )
            pool.run(close_multirank)
    except RankError as exc:
        found["failed"] = str(exc)
    return found


def measure_per_call(calls: int) -> dict[str, Any]:
    """Time ``PER_CALL``'s 8-byte allreduce on the host at world size 1; µs statistics each."""
    with RankPool(1, timeout=timedelta(seconds=300)) as pool:
        pool.run(nccl_peers.setup, f"bench-one-{uuid.uuid4().hex[:6]}")
        stats = {impl: pool.run(nccl_timing.overhead, impl, calls)[0] for impl in PER_CALL}
        pool.run(nccl_peers.teardown)
    ours, bare = (stats[impl]["median_us"] for impl in PER_CALL)
    return {"world_size": 1, "calls": calls, **stats, "over_us": ours - bare}


def per_call_goal(per_call: dict[str, Any]) -> tuple[str, str, bool]:
    """Return the per-call goal, what was measured, and whether it is met."""
    ours, bare = (per_call[impl]["median_us"] for impl in PER_CALL)
    goal = f"col.allreduce host time within {PER_CALL_GOAL_US:g} us of bare NCCL, world size 1"
    measured = f"{ours:.2f} us vs {bare:.2f} us, {per_call['over_us']:+.2f} us"
    return goal, measured, per_call["over_us"] <= PER_CALL_GOAL_US


def human(size: int) -> str:
    """Return ``size`` bytes as text: ``8 B``, ``64 KiB``, ``1 GiB``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def text(found: dict[str, Any]) -> list[str]:
    """Return the multi-rank measurement as lines of the report."""
    head = (
        f"# NCCL's multi-rank mode ({routes.MULTIRANK_ENV}=1) beside the shared-GPU transport, "
        f"{found['world_size']} ranks on one GPU, NCCL {found['nccl']}"
    )
    if found["why"]:
        return [f"{head}: {found['why']}"]
    lines = [f"{head}, time per call (us), the slowest rank:"]
    lines.append(
        f"{'op':<10} {'size':>8} {'shared_gpu':>12} {'nccl multi-rank':>16} {'faster':>10}"
    )
    lines += [
        f"{r['op']:<10} {human(r['size']):>8} {r['shared_us']:>12.1f} "
        f"{r['multirank_us']:>16.1f} {r['faster']:>10}"
        for r in found["rows"]
    ]
    if "failed" in found:
        lines.append(f"# NCCL's multi-rank mode: failed: {found['failed']}")
    return lines
