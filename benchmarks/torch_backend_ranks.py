"""What each rank of ``benchmarks.torch_backend`` runs: ops, DDP steps and the binding's cost.

torch's ops on both backends, DDP steps, and the torch binding's call beside the
library's on the same group.

Each rank is a spawned process. It joins a default process group on the
``"collective"`` backend and a second group on ``"gloo"`` (``dist.new_group``), both
over every rank, and times the same calls on each in alternating order round by
round, so that a slow spell of the shared machine falls on both. Every timed block
starts after a barrier of its own group. A rank sends back, for every measurement,
its per-call (or per-step) seconds of each round; the parent keeps the slowest rank.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

BACKENDS = ("collective", "gloo")
NO_COMMUNICATION = "no communication"
"""DDP's row whose comm hook hands each bucket back untouched: the step's own cost, which
bounds how many steps per second any backend can reach."""
OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter")
CHUNKED = frozenset({"all_gather", "reduce_scatter"})
"""Ops whose size is the whole buffer of ``world_size`` chunks (nccl-tests' convention).
They run in their one-tensor forms, as DDP and FSDP call them: ``all_gather_single`` and
``reduce_scatter_single`` (``all_gather_into_tensor`` and ``reduce_scatter_tensor`` before
torch 2.13)."""
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
SAMPLE_BYTES = 16 << 20
"""A timed block runs back-to-back calls until about this many bytes have gone by..."""
MOST_CALLS = 200
"""...and at most this many calls."""
DDP_LAYERS = 16
DDP_WIDTH = 1024
"""DDP's model: ``DDP_LAYERS`` bias-free linear layers of ``DDP_WIDTH`` squared, float32:
16 x 1024 x 1024 x 4 B = 64 MiB of gradients, in DDP's default 25 MiB buckets."""
DDP_BATCH = 2
"""Small, so that a step moves more bytes than it computes on: 64 MiB of gradients a step."""
THREADS = 1
"""torch's threads per rank, as ``torchrun`` sets them up (``OMP_NUM_THREADS=1``)."""
BINDING_BLOCKS = 10
"""Blocks of each of the two calls per round, alternated, in the binding's comparison."""
TIMEOUT = timedelta(seconds=300)
BINDING_GROUP = "torch-backend-binding"
"""The name ``col.allreduce`` finds the binding's group by."""

Times = dict[tuple[Any, ...], list[float]]
"""Per measurement key, the seconds of each round (per call, or per DDP step)."""


@dataclass(frozen=True)
class Plan:
    """What one run measures: the parent builds it from its arguments."""

    ops: tuple[str, ...]
    sizes: tuple[int, ...]
    rounds: int
    ddp_steps: int
    ddp_layers: int
    binding_calls: int


def calls(size: int) -> int:
    """Return how many back-to-back calls a timed block of ``size`` bytes makes."""
    return max(1, min(MOST_CALLS, SAMPLE_BYTES // max(size, 1)))


def numel(op: str, size: int, world_size: int) -> int:
    """Return the float32 elements of ``op``'s buffer: at least one per chunk."""
    count = max(size // 4, 1)
    if op in CHUNKED:
        count = max(count // world_size, 1) * world_size
    return count


def op_call(op: str, size: int, rank: int, world_size: int, group: Any) -> Callable[[], Any]:
    """Return one call of ``op`` on ``size`` bytes over ``group``, its buffers made once."""
    n = numel(op, size, world_size)
    if op == "all_reduce":
        x = torch.full((n,), float(rank + 1))
        return lambda: dist.all_reduce(x, group=group)
    if op == "broadcast":
        x = torch.full((n,), float(rank + 1))
        return lambda: dist.broadcast(x, src=0, group=group)
    whole, chunk = torch.zeros(n), torch.full((n // world_size,), float(rank + 1))
    if op == "all_gather":
        return lambda: ALL_GATHER(whole, chunk, group=group)
    return lambda: REDUCE_SCATTER(chunk, whole, group=group)


def timed(run: Callable[[], Any], count: int, group: Any) -> float:
    """Return the seconds per call of ``count`` back-to-back calls, after a barrier."""
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(count):
        run()
    return (time.perf_counter() - start) / count


def in_turn(round_index: int) -> tuple[str, ...]:
    """Return the backends in this round's order: each goes first every other round."""
    return BACKENDS if round_index % 2 == 0 else BACKENDS[::-1]


def time_ops(plan: Plan, rank: int, world_size: int, groups: dict[str, Any]) -> Times:
    """Time every op and size on both backends, round by round; one warm-up call first."""
    times: Times = {}
    for op in plan.ops:
        for size in plan.sizes:
            runs = {b: op_call(op, size, rank, world_size, g) for b, g in groups.items()}
            for run in runs.values():
                run()
            for r in range(plan.rounds):
                for backend in in_turn(r):
                    seconds = timed(runs[backend], calls(size), groups[backend])
                    times.setdefault(("op", op, size, backend), []).append(seconds)
    return times


def ddp_model(layers: int, group: Any, communicate: bool = True) -> torch.nn.Module:
    """Return DDP over ``group`` of ``layers`` bias-free linear layers, the same on every rank.

    With ``communicate`` False, a comm hook hands each gradient bucket back as it is: DDP
    still fills its buckets, but nothing is sent.
    """
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *(torch.nn.Linear(DDP_WIDTH, DDP_WIDTH, bias=False) for _ in range(layers))
    )
    ddp = DistributedDataParallel(model, process_group=group)
    if not communicate:
        # DDP refuses a hook whose annotations are not its own types (here strings).
        ddp.register_comm_hook(None, lambda state, bucket: _done(bucket.buffer()))
    return ddp


def _done(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """Return a future already completed with ``tensor``."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(tensor)
    return future


def time_ddp(plan: Plan, rank: int, groups: dict[str, Any]) -> Times:
    """Time DDP training steps on both backends and with no communication, round by round.

    Returns seconds per step, keyed ``("ddp", backend)`` and ``("ddp", NO_COMMUNICATION)``.
    """
    times: Times = {}
    x = torch.randn(DDP_BATCH, DDP_WIDTH, generator=torch.Generator().manual_seed(rank))
    steps = {}
    barriers = {**groups, NO_COMMUNICATION: groups["gloo"]}
    for backend, group in barriers.items():
        model = ddp_model(plan.ddp_layers, group, communicate=backend != NO_COMMUNICATION)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)

        def step(model: torch.nn.Module = model, optimizer: Any = optimizer) -> None:
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()

        step()
        steps[backend] = step
    for r in range(plan.rounds):
        for backend in (*in_turn(r), NO_COMMUNICATION):
            seconds = timed(steps[backend], plan.ddp_steps, barriers[backend])
            times.setdefault(("ddp", backend), []).append(seconds)
    return times


def time_binding(plan: Plan, group: Any) -> Times:
    """Time an 8-byte ``dist.all_reduce`` beside ``col.allreduce`` on the same group.

    The binding's ``CpuGroup`` is registered under a name of its own in this process,
    so that ``col.allreduce`` finds it as it finds any group. Blocks of each call
    alternate; a round's value is its median block.
    """
    import collective as col
    from collective.registry import held

    held.create_group(BINDING_GROUP, lambda: (group.group, None))
    x = torch.ones(2)
    runs = {
        "torch": lambda: dist.all_reduce(x, group=group),
        "library": lambda: col.allreduce(x, group_name=BINDING_GROUP),
    }
    for run in runs.values():
        run()
    times: Times = {}
    for r in range(plan.rounds):
        blocks: dict[str, list[float]] = {name: [] for name in runs}
        for b in range(BINDING_BLOCKS):
            for name in runs if (r + b) % 2 == 0 else reversed(runs):
                blocks[name].append(timed(runs[name], plan.binding_calls, group))
        for name, seconds in blocks.items():
            times.setdefault(("binding", name), []).append(statistics.median(seconds))
    held.forget(BINDING_GROUP)
    return times


def run_rank(rank: int, world_size: int, port: int, plan: Plan, results: Any) -> None:
    """One rank: join both groups on the parent's store, time everything, send the times."""
    import collective  # noqa: F401  (registers the backend where torch's autoload did not)

    torch.set_flush_denormal(True)
    torch.set_num_threads(THREADS)
    store = dist.TCPStore("127.0.0.1", port, world_size, False, TIMEOUT)
    dist.init_process_group(
        "collective", store=store, rank=rank, world_size=world_size, timeout=TIMEOUT
    )
    groups = {"collective": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    times = time_ops(plan, rank, world_size, groups)
    if plan.ddp_steps:
        times |= time_ddp(plan, rank, groups)
    if plan.binding_calls:
        times |= time_binding(plan, groups["collective"])
    results.put((rank, times))
    dist.destroy_process_group()
