"""Ranks that share one GPU: the shared-GPU transport beside the copy bound and NCCL over sockets.

Usage: python -m benchmarks.nccl --shared-gpu [--quick] [--json PATH] [--text PATH]

Ranks are spawned processes on GPU 0, meeting on a TCPStore, in a ``backend="nccl"``
group (which picks the shared-GPU transport) and, beside it, a plain ``NCCLGroup`` in
which each rank claims a host of its own (``NCCL_HOSTID``: what NCCL needs to put two
ranks of one communicator on one GPU; bytes then move through its sockets). In one
run it measures, each point the median of the slowest rank's repetitions:

- broadcast of 1 GiB from rank 0 to 3 ranks, beside 3 device-to-device copies of 1
  GiB by cupy in rank 0 (the copy bound; goal: at most 2x);
- ``broadcast_state_dict`` of 1 GiB in 400 tensors to 3 ranks (goal: within 1.5x of
  the broadcast);
- 8-byte allreduce between 2 ranks: 1,000 calls, then a stream sync, per call (goal:
  at most 25 us and 10x faster than NCCL over sockets);
- 1 GiB allreduce between 2 ranks (goal: 20x faster than NCCL over sockets);
- where NCCL is 2.30 or later, allreduce and broadcast from 8 B to 1 GiB between 2
  ranks on this transport and on NCCL's multi-rank mode, side by side; where older,
  that it is not installed (``benchmarks.multirank``);
- the host time of one 8-byte ``col.allreduce`` of a group of one rank beside a bare
  NCCL call (goal: within 5 us).

These groups pick the shared-GPU transport alone (``COLLECTIVE_GPU_ROUTES=off``),
whatever routes the package holds. The report prints each goal with what was measured.
With ``--json`` it adds its results under the key ``"shared_gpu"`` of that file,
keeping what else it holds, with the GPU, NCCL, cupy and torch versions. Without a
GPU it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks.nccl_ranks import RankError, RankPool

GIB = 1 << 30
STATE: dict[str, Any] = {}
"""What a rank process keeps between jobs: its groups and buffers."""


def _open(context: Any, name: str) -> str:
    """Build this rank's shared-GPU group and a plain NCCL group (a host each) on GPU 0."""
    import cupy
    import torch

    from collective.groups.gpu.connect import connect_gpu_group
    from collective.groups.nccl.group import NCCLGroup
    from collective.registry import held
    from collective.rendezvous.store import PrefixedRendezvousStore

    cupy.cuda.Device(0).use()
    torch.cuda.set_device(0)
    # What NCCL needs to hold two ranks of one communicator on one GPU: a host each.
    os.environ.setdefault("NCCL_HOSTID", f"collective-rank-{context.rank}")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    os.environ["COLLECTIVE_GPU_ROUTES"] = "off"  # the shared-GPU transport alone
    timeout = timedelta(seconds=120)
    store = PrefixedRendezvousStore(context.store, f"{name}/shared/")
    shared = connect_gpu_group(context.world_size, context.rank, name, store, timeout)
    held.create_group(name, lambda: (shared, store))
    plain = PrefixedRendezvousStore(context.store, f"{name}/nccl/")
    STATE.update(
        shared=shared,
        nccl=NCCLGroup(context.world_size, context.rank, f"{name}-nccl", plain, timeout),
        name=name,
    )
    return str(shared.transport)


def _close(context: Any) -> None:
    import collective as col

    STATE.pop("nccl").destroy_group()
    col.destroy_collective_group(STATE.pop("name"))
    STATE.clear()


def _timed(context: Any, calls: int, reps: int, fn: Any) -> list[float]:
    """Return ``reps`` times of ``calls`` calls of ``fn`` then a device sync, per call, in s."""
    import torch

    from collective.types import BarrierOptions

    out = []
    for _ in range(reps + 1):
        STATE["shared"].barrier(BarrierOptions())
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - start) / calls)
    return out[1:]


def allreduce_job(context: Any, which: str, nbytes: int, calls: int, reps: int) -> list[float]:
    """Time an allreduce of ``nbytes`` float32 on this rank's ``which`` group."""
    import torch

    from collective.types import AllReduceOptions

    group = STATE[which]
    x = torch.ones(max(nbytes // 4, 1), device="cuda")
    options = AllReduceOptions()
    return _timed(context, calls, reps, lambda: group.allreduce([x], options))


def broadcast_job(
    context: Any, nbytes: int, reps: int, which: str = "shared", calls: int = 1
) -> list[float]:
    """Time ``calls`` broadcasts of ``nbytes`` from rank 0 on this rank's ``which`` group."""
    import torch

    from collective.types import BroadcastOptions

    group = STATE[which]
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    options = BroadcastOptions(root_rank=0)
    return _timed(context, calls, reps, lambda: group.broadcast([x], options))


def state_dict_job(context: Any, nbytes: int, tensors: int, reps: int) -> list[float]:
    """Time ``broadcast_state_dict`` of ``tensors`` float32 tensors of ``nbytes`` in all."""
    import torch

    import collective as col

    each = nbytes // tensors // 4
    state = {f"w{i}": torch.empty(each, device="cuda") for i in range(tensors)}
    name = STATE["name"]
    return _timed(context, 1, reps, lambda: col.broadcast_state_dict(state, 0, name))


def copies_job(context: Any, nbytes: int, copies: int, reps: int) -> list[float]:
    """On rank 0, time ``copies`` device-to-device copies of ``nbytes`` by cupy."""
    import cupy

    if context.rank != 0:
        return [0.0]
    src = cupy.empty(nbytes, dtype=cupy.uint8)
    dsts = [cupy.empty(nbytes, dtype=cupy.uint8) for _ in range(copies)]
    out = []
    for _ in range(reps + 1):
        cupy.cuda.Device().synchronize()
        start = time.perf_counter()
        for dst in dsts:
            dst[...] = src
        cupy.cuda.Device().synchronize()
        out.append(time.perf_counter() - start)
    return out[1:]


def slowest(per_rank: list[list[float]]) -> float:
    """Return the median over repetitions of the slowest rank's time."""
    return statistics.median(max(times) for times in zip(*per_rank, strict=True))


def versions() -> dict[str, str]:
    """Return the GPU, NCCL, cupy and torch versions of this machine."""
    import cupy
    import torch

    props = cupy.cuda.runtime.getDeviceProperties(0)
    return {
        "gpu": props["name"].decode(),
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "cupy_nccl": str(cupy.cuda.nccl.get_version()),
        "cupy": cupy.__version__,
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
    }


def picked(transports: list[str]) -> None:
    """Refuse to time a group that did not pick the shared-GPU transport on every rank."""
    if any(t != "shared_gpu" for t in transports):
        raise RuntimeError(f"the ranks' groups picked {transports}, not the shared-GPU transport")


def measure(quick: bool, info: dict[str, str]) -> dict[str, Any]:
    """Run every point on the machine ``info`` describes; return the rows and the goals."""
    size = (64 << 20) if quick else GIB
    reps = 3 if quick else 5
    rows: list[dict[str, Any]] = []

    def row(what: str, world_size: int, seconds: float, **extra: Any) -> float:
        rows.append({"what": what, "world_size": world_size, "us": seconds * 1e6, **extra})
        return seconds

    with RankPool(4, timeout=timedelta(seconds=600)) as pool:
        name = f"bench-shared-{uuid.uuid4().hex[:6]}"
        picked(pool.run(_open, name))
        bound = row(
            f"3 cupy copies of {size >> 20} MiB (rank 0)",
            1,
            statistics.median(pool.run(copies_job, size, 3, reps)[0]),
        )
        bcast = row(
            f"broadcast {size >> 20} MiB, rank 0 to 3",
            4,
            slowest(pool.run(broadcast_job, size, reps)),
        )
        sd = row(
            f"broadcast_state_dict {size >> 20} MiB in 400 tensors",
            4,
            slowest(pool.run(state_dict_job, size, 400, reps)),
        )
        pool.run(_close)
    rows[1]["vs_copy_bound"] = bcast / bound
    rows[2]["vs_broadcast"] = sd / bcast
    with RankPool(2, timeout=timedelta(seconds=600)) as pool:
        name = f"bench-shared2-{uuid.uuid4().hex[:6]}"
        picked(pool.run(_open, name))
        small = {
            w: row(
                f"allreduce 8 B x1000, {w}", 2, slowest(pool.run(allreduce_job, w, 8, 1000, reps))
            )
            for w in ("shared", "nccl")
        }
        large = {
            w: row(
                f"allreduce {size >> 20} MiB, {w}",
                2,
                slowest(pool.run(allreduce_job, w, size, 1, reps)),
            )
            for w in ("shared", "nccl")
        }
        pool.run(_close)
    from benchmarks import multirank

    points = multirank.sizes(size, (8, size))
    multi = multirank.measure_multirank(int(info["cupy_nccl"]), points, reps)
    per_call = multirank.measure_per_call(200 if quick else 2000)
    socket_small, socket_large = small["nccl"] / small["shared"], large["nccl"] / large["shared"]
    checks = [
        ("broadcast <= 2x the copy bound", f"{bcast / bound:.2f}x", bcast <= 2 * bound),
        ("broadcast_state_dict <= 1.5x broadcast", f"{sd / bcast:.2f}x", sd <= 1.5 * bcast),
        ("8 B allreduce <= 25 us", f"{small['shared'] * 1e6:.1f} us", small["shared"] <= 25e-6),
        ("8 B allreduce >= 10x NCCL over sockets", f"{socket_small:.1f}x", socket_small >= 10),
        ("large allreduce >= 20x NCCL over sockets", f"{socket_large:.1f}x", socket_large >= 20),
        multirank.per_call_goal(per_call),
    ]
    for impl in multirank.PER_CALL:
        row(f"8 B allreduce host time per call, {impl}", 1, per_call[impl]["median_us"] / 1e6)
    return {
        "rows": rows,
        "goals": {goal: met for goal, _, met in checks},
        "measured": {goal: measured for goal, measured, _ in checks},
        "size_bytes": size,
        "multirank": multi,
        "per_call": per_call,
    }


def text(result: dict[str, Any], info: dict[str, str]) -> str:
    """Return the results as a table, then each goal with what was measured."""
    from benchmarks import multirank

    lines = ["# ranks sharing one GPU: " + ", ".join(f"{k} {v}" for k, v in info.items())]
    lines.append(f"{'what':<48} {'ranks':>5} {'time (us)':>12}")
    lines += [f"{r['what']:<48} {r['world_size']:>5} {r['us']:>12.1f}" for r in result["rows"]]
    if "multirank" in result:
        lines += multirank.text(result["multirank"])
    measured = result.get("measured", {})
    lines += [
        f"goal: {goal}: measured {measured.get(goal, '-')}: {'met' if met else 'MISSED'}"
        for goal, met in result["goals"].items()
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Run the benchmark; print the table and merge the JSON into ``--json``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.nccl --shared-gpu")
    parser.add_argument("--quick", action="store_true", help="64 MiB instead of 1 GiB")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--text", type=Path, default=None)
    args = parser.parse_args(argv)
    from collective.groups.nccl.comm import unavailable_reason

    why = unavailable_reason()
    if why:
        print(f"# ranks sharing one GPU: unavailable: no GPU: {why}")
        return 0
    info = versions()
    try:
        result = measure(args.quick, info)
    except RankError as exc:
        print(f"# ranks sharing one GPU: failed: {exc}")
        return 1
    table = text(result, info)
    print(table, flush=True)
    if args.text:
        with args.text.open("a") as out:
            out.write(table + "\n")
    if args.json:
        body = json.loads(args.json.read_text()) if args.json.exists() else {}
        body["shared_gpu"] = {"versions": info, **result}
        args.json.write_text(json.dumps(body, indent=2) + "\n")
    return 1 if "failed" in result["multirank"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
