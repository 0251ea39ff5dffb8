"""The NCCL implementations the benchmark compares, as they run inside one rank process.

- ``collective``: our public functions (``col.allreduce`` ...) on an ``NCCLGroup`` of
  cupy arrays, as a user calls them;
- ``collective_torch``: the same functions and group on CUDA torch tensors;
- ``collective_sidecheck``, ``collective_nocheck``: ``collective`` on groups whose check
  runs beside each op (``COLLECTIVE_NCCL_CHECK=side``) or not at all, so that what the
  check costs on the op's stream and beside it shows in one run;
- ``cupy_nccl``: raw ``cupy.cuda.nccl`` calls on one communicator (the floor we measure
  our overhead against);
- ``torch_nccl``: torch.distributed's ProcessGroupNCCL, as most users know it.

``setup``, ``describe`` and ``teardown`` are jobs for ``nccl_ranks.RankPool``; the timed
jobs are in ``nccl_timing``. Sizes follow nccl-tests:
for allreduce, broadcast, reduce, alltoall and sendrecv ``size`` is each rank's buffer; for
allgather and gather it is the gathered output, for reducescatter and scatter the
scattered input, ``world_size`` chunks of ``size / world_size`` bytes. Every buffer is
float32, filled so that each op's result is exact, and checked on the GPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any

from benchmarks.nccl_ranks import RankContext
from collective.groups.nccl import mismatch
from collective.groups.nccl.comm import cupy_module, encode_unique_id, unique_id_argument
from collective.rendezvous.store import PrefixedRendezvousStore

OPS = (
    "allreduce",
    "broadcast",
    "reduce",
    "allgather",
    "reducescatter",
    "alltoall",
    "gather",
    "scatter",
    "sendrecv",
)
IMPLS = (
    "collective",
    "collective_sidecheck",
    "collective_nocheck",
    "collective_torch",
    "cupy_nccl",
    "torch_nccl",
)
VARIANTS = {"collective_sidecheck": "side", "collective_nocheck": "0"}
"""Our implementations on a group of their own, made with ``COLLECTIVE_NCCL_CHECK`` set so."""
RAW = "cupy_nccl"
"""The implementation every other is compared with."""
ROOT = 0
ITEM = 4
"""Bytes per float32 element."""
TIMEOUT = timedelta(seconds=120)

BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "allgather": lambda n: (n - 1) / n,
    "reducescatter": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
    "gather": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
    "sendrecv": lambda n: 1.0,
}
"""nccl-tests' bus bandwidth factor of each op for ``n`` ranks."""

_SPLIT = {"allgather", "reducescatter", "alltoall", "gather", "scatter"}


def elements(op: str, size: int, world_size: int) -> int:
    """Return the element count of ``size`` bytes, a multiple of ``world_size`` for split ops."""
    count = size // ITEM
    return count - count % world_size if op in _SPLIT else count


def skip_reason(op: str, size: int, world_size: int) -> str:
    """Return why ``op`` cannot run at this size and world size, or ""."""
    if op == "sendrecv" and world_size % 2:
        return "sendrecv pairs rank 2k with 2k+1, so it needs an even world size"
    if elements(op, size, world_size) < (world_size if op in _SPLIT else 1):
        return f"{size} B holds fewer than one float32 per rank"
    return ""


@dataclass
class _Rank:
    """The state of the rank in this process: its GPU, our group, raw NCCL, torch's group."""

    context: RankContext
    cupy: Any
    torch: Any = None
    group: Any = None
    variants: dict[str, Any] = field(default_factory=dict)
    """Our group of each of ``VARIANTS``."""
    comm: Any = None
    unavailable: dict[str, str] = field(default_factory=dict)


_STATE: list[_Rank] = []
"""The rank's state between jobs (empty before ``setup``)."""


def rank_state() -> _Rank:
    """Return this process's rank, as ``setup`` left it."""
    if not _STATE:
        raise RuntimeError("setup has not run on this rank")
    return _STATE[0]


def _register(group: Any, store: Any) -> Any:
    """Make ``group`` this process's group of its name, as ``col`` finds it; return it."""
    from collective.registry import held

    held.create_group(group.group_name, lambda: (group, store))
    return group


def setup(context: RankContext, group_name: str) -> dict[str, str]:
    """Select GPU ``rank``, connect every implementation; return the unavailable ones and why."""
    from collective.groups.nccl.group import NCCLGroup

    cupy = cupy_module()
    rank, n = context.rank, context.world_size
    gpus = int(cupy.cuda.runtime.getDeviceCount())
    if gpus < n:
        # Ranks share the GPUs: NCCL takes two ranks on one GPU only as two hosts, over
        # its sockets (right, and slow; the rows say so).
        os.environ.setdefault("NCCL_HOSTID", f"bench-rank-{rank}")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    device = rank % gpus
    cupy.cuda.Device(device).use()
    state = _Rank(context, cupy)
    state.group = NCCLGroup(n, rank, group_name, context.store, TIMEOUT)
    _register(state.group, context.store)
    before = os.environ.get(mismatch.CHECK_ENV)
    for impl, check in VARIANTS.items():
        name, store = f"{group_name}-{impl}", PrefixedRendezvousStore(context.store, f"{impl}/")
        os.environ[mismatch.CHECK_ENV] = check  # a group reads it once, as it is made
        state.variants[impl] = _register(NCCLGroup(n, rank, name, store, TIMEOUT), store)
    os.environ.pop(mismatch.CHECK_ENV)
    if before is not None:
        os.environ[mismatch.CHECK_ENV] = before
    nccl = cupy.cuda.nccl
    key = f"{group_name}/raw-unique-id"
    if rank == 0:
        context.store.set(key, encode_unique_id(nccl.get_unique_id()))
    uid = unique_id_argument(nccl.NcclCommunicator, context.store.get(key, TIMEOUT))
    state.comm = nccl.NcclCommunicator(n, uid, rank)
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        state.unavailable["collective_torch"] = state.unavailable["torch_nccl"] = str(exc)
    else:
        if not torch.cuda.is_available():
            why = "this torch build sees no CUDA GPU"
            state.unavailable["collective_torch"] = state.unavailable["torch_nccl"] = why
        elif not dist.is_nccl_available():
            state.torch = torch
            state.unavailable["torch_nccl"] = "this torch build has no NCCL"
        else:
            state.torch = torch
            torch.cuda.set_device(device)
            dist.init_process_group(
                "nccl",
                store=dist.PrefixStore(f"{group_name}/torch/", context.c10d_store),
                rank=rank,
                world_size=n,
                timeout=TIMEOUT,
                device_id=torch.device("cuda", device),
            )
    _STATE[:] = [state]
    return state.unavailable


def describe(context: RankContext) -> dict[str, str]:
    """Return the versions and the GPU this rank runs on."""
    state = rank_state()
    cupy = state.cupy
    properties = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = properties["name"]
    info = {
        "gpu": name.decode() if isinstance(name, bytes) else str(name),
        "cupy": cupy.__version__,
        "nccl (cupy)": str(cupy.cuda.nccl.get_version()),
        "cuda runtime": str(cupy.cuda.runtime.runtimeGetVersion()),
    }
    if state.torch is not None:
        info["torch"] = state.torch.__version__
        version = state.torch.cuda.nccl.version()
        info["nccl (torch)"] = (
            ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        )
    return info


def teardown(context: RankContext) -> None:
    """Destroy our group, the raw communicator and torch's group."""
    import collective as col

    state = rank_state()
    col.destroy_collective_group(state.group.group_name)
    for group in state.variants.values():
        col.destroy_collective_group(group.group_name)
    state.comm.destroy()
    if "torch_nccl" not in state.unavailable:
        import torch.distributed as dist

        dist.destroy_process_group()
    _STATE.clear()


# --- buffers --------------------------------------------------------------------------------


@dataclass
class Buffers:
    """One op's buffers on this rank, flat and as ``world_size`` chunk views."""

    x: Any
    out: Any
    xs: list[Any]
    outs: list[Any]
    expected: list[float] | None
    """The value of each chunk of ``out`` after one op, or None where it is not checked."""


def _values(op: str, rank: int, n: int) -> tuple[list[float], list[float] | None]:
    """Return the value of each input chunk and of each expected output chunk of ``op``."""
    total = n * (n + 1) / 2
    if op == "allreduce":
        return [rank + 1.0], [total]
    if op == "broadcast":
        return [1.0 if rank == ROOT else 0.0], [1.0]
    if op == "reduce":
        return [rank + 1.0], [total if rank == ROOT else rank + 1.0]
    if op == "allgather":
        return [rank + 1.0], [j + 1.0 for j in range(n)]
    if op == "reducescatter":
        return [rank + 1.0] * n, [total]
    if op == "alltoall":
        return [rank * n + j + 1.0 for j in range(n)], [j * n + rank + 1.0 for j in range(n)]
    if op == "gather":
        return [rank + 1.0], ([j + 1.0 for j in range(n)] if rank == ROOT else None)
    if op == "scatter":
        return [j + 1.0 for j in range(n)], [rank + 1.0]
    return [rank + 1.0], ([float(rank)] if rank % 2 else None)


def _fill(lib: str, values: list[float], each: int) -> Any:
    """Return a new float32 GPU buffer of ``values``, each repeated ``each`` times."""
    state = rank_state()
    if lib == "torch":
        torch = state.torch
        tensor = torch.tensor(values, dtype=torch.float32, device="cuda")
        return tensor.repeat_interleave(each)
    cupy = state.cupy
    return cupy.repeat(cupy.asarray(values, dtype=cupy.float32), each)


def _chunks(x: Any, n: int) -> list[Any]:
    each = x.shape[0] // n
    return [x[j * each : (j + 1) * each] for j in range(n)]


def buffers(lib: str, op: str, size: int) -> Buffers:
    """Return this rank's fresh ``lib`` buffers of ``op`` at ``size`` bytes (as nccl-tests)."""
    state = rank_state()
    rank, n = state.context.rank, state.context.world_size
    count = elements(op, size, n)
    inputs, expected = _values(op, rank, n)
    x_count = count // n if op in {"allgather", "gather"} else count
    x = _fill(lib, inputs, x_count // len(inputs))
    if op in {"allreduce", "broadcast", "reduce"}:
        out = x
    else:
        out_count = count // n if op in {"reducescatter", "scatter"} else count
        out = _fill(lib, [-1.0], out_count)
    return Buffers(x, out, _chunks(x, n), _chunks(out, n), expected)


def count_wrong(lib: str, b: Buffers) -> int:
    """Return how many elements of ``b.out`` differ from the expected result."""
    if b.expected is None:
        return 0
    want = _fill(lib, b.expected, b.out.shape[0] // len(b.expected))
    return int((b.out != want).sum())


def sync() -> None:
    """Wait until all work queued on this rank's GPU, on every stream, has finished."""
    rank_state().cupy.cuda.runtime.deviceSynchronize()


# --- one op of each implementation ------------------------------------------------------------


def _ours(op: str, b: Buffers, impl: str = "collective") -> Callable[[], Any]:
    import collective as col

    state = rank_state()
    group = state.variants.get(impl, state.group)
    name, rank = group.group_name, state.context.rank
    root = rank == ROOT
    calls: dict[str, Callable[[], Any]] = {
        "allreduce": lambda: col.allreduce(b.x, name),
        "broadcast": lambda: col.broadcast(b.x, ROOT, name),
        "reduce": lambda: col.reduce(b.x, ROOT, name),
        "allgather": lambda: col.allgather(b.outs, b.x, name),
        "reducescatter": lambda: col.reducescatter(b.out, b.xs, name),
        "alltoall": lambda: col.alltoall(b.outs, b.xs, name),
        "gather": lambda: col.gather(b.x, b.outs if root else None, ROOT, name),
        "scatter": lambda: col.scatter(b.out, b.xs if root else None, ROOT, name),
    }
    if op != "sendrecv":
        return calls[op]
    if rank % 2 == 0:
        return lambda: col.send(b.x, rank + 1, name)
    return lambda: col.recv(b.out, rank - 1, name)


def _raw(op: str, b: Buffers) -> Callable[[], Any]:
    state = rank_state()
    nccl, comm = state.cupy.cuda.nccl, state.comm
    rank, n = state.context.rank, state.context.world_size
    f32, total = nccl.NCCL_FLOAT32, nccl.NCCL_SUM
    x, out, count = b.x.data.ptr, b.out.data.ptr, b.x.shape[0]
    each = b.outs[0].shape[0] if op in {"allgather", "gather"} else b.xs[0].shape[0]
    nbytes = each * ITEM
    s = int(state.cupy.cuda.get_current_stream().ptr)

    def grouped(sends: list[tuple[int, int]], recvs: list[tuple[int, int]]) -> None:
        nccl.groupStart()
        try:
            for ptr, peer in sends:
                comm.send(ptr, each, f32, peer, s)
            for ptr, peer in recvs:
                comm.recv(ptr, each, f32, peer, s)
        finally:
            nccl.groupEnd()

    peers = range(n)
    calls: dict[str, Callable[[], Any]] = {
        "allreduce": lambda: comm.allReduce(x, x, count, f32, total, s),
        "broadcast": lambda: comm.broadcast(x, x, count, f32, ROOT, s),
        "reduce": lambda: comm.reduce(x, x, count, f32, total, ROOT, s),
        "allgather": lambda: comm.allGather(x, out, each, f32, s),
        "reducescatter": lambda: comm.reduceScatter(x, out, each, f32, total, s),
        "alltoall": lambda: grouped(
            [(x + j * nbytes, j) for j in peers], [(out + j * nbytes, j) for j in peers]
        ),
        "gather": lambda: grouped(
            [(x, ROOT)], [(out + j * nbytes, j) for j in peers] if rank == ROOT else []
        ),
        "scatter": lambda: grouped(
            [(x + j * nbytes, j) for j in peers] if rank == ROOT else [], [(out, ROOT)]
        ),
    }
    if op != "sendrecv":
        return calls[op]
    if rank % 2 == 0:
        return lambda: comm.send(x, count, f32, rank + 1, s)
    return lambda: comm.recv(out, count, f32, rank - 1, s)


def _torch(op: str, b: Buffers) -> Callable[[], Any]:
    import torch.distributed as dist

    rank = rank_state().context.rank
    root = rank == ROOT
    calls: dict[str, Callable[[], Any]] = {
        "allreduce": lambda: dist.all_reduce(b.x),
        "broadcast": lambda: dist.broadcast(b.x, ROOT),
        "reduce": lambda: dist.reduce(b.x, ROOT),
        "allgather": lambda: dist.all_gather_into_tensor(b.out, b.x),
        "reducescatter": lambda: dist.reduce_scatter_tensor(b.out, b.x),
        "alltoall": lambda: dist.all_to_all_single(b.out, b.x),
        "gather": lambda: dist.gather(b.x, b.outs if root else None, dst=ROOT),
        "scatter": lambda: dist.scatter(b.out, b.xs if root else None, src=ROOT),
    }
    if op != "sendrecv":
        return calls[op]
    if rank % 2 == 0:
        return lambda: dist.send(b.x, rank + 1)
    return lambda: dist.recv(b.out, rank - 1)


_CALLS: dict[str, Callable[[str, Buffers], Callable[[], Any]]] = {
    "collective": _ours,
    **{impl: partial(_ours, impl=impl) for impl in VARIANTS},
    "collective_torch": _ours,
    "cupy_nccl": _raw,
}


def op_call(impl: str, op: str, b: Buffers) -> Callable[[], Any]:
    """Return one call of ``op`` by ``impl`` on ``b``; it queues the op and returns."""
    return _CALLS.get(impl, _torch)(op, b)


def library(impl: str) -> str:
    """Return the array library whose buffers ``impl`` takes: "cupy" or "torch"."""
    return "torch" if "torch" in impl else "cupy"
