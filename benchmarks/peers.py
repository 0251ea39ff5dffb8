"""The peers in Ray actors: ``collective`` on either transport, ``ray.util.collective``, the store.

Every runner has ``ops``, ``max_batch``, ``start(world_size)``, ``run(op, size, plan)``
returning per-op seconds of each sample (the slowest rank's, as nccl-tests reports)
and the count of wrong output elements, and ``stop()``.
"""

from __future__ import annotations

import importlib
import sys
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import ray

from benchmarks import workloads
from benchmarks.workloads import ROOT, Plan

RAY_TIMEOUT_S = 600
"""Bound on every wait for the ranks of one run."""

RAY_COLLECTIVE_OPS = ("allreduce", "broadcast", "reduce", "allgather", "reducescatter")
"""The ops ``ray.util.collective`` has."""


class _CollectiveRank:
    """One rank of ``collective`` or of ``ray.util.collective``, in its own Ray actor.

    ``source``: a folder holding another ``collective`` package (a checkout of main, say),
    imported instead of the installed one.
    """

    def __init__(self, library: str, source: str | None = None) -> None:
        if source is not None:
            sys.path.insert(0, source)
        name = "collective" if library == "collective" else "ray.util.collective"
        self._lib, self._ours = importlib.import_module(name), library == "collective"

    def setup(self, world_size: int, rank: int, group: str, transport: str | None) -> int:
        self._n, self._rank, self._group = world_size, rank, group
        options: dict[str, Any] = {"cpu_transport": transport} if self._ours else {}
        self._lib.init_collective_group(
            world_size, rank, backend="gloo", group_name=group, **options
        )
        return rank

    def _call(self, op: str, x: np.ndarray, out: np.ndarray) -> Callable[[], Any]:
        lib, g, ours, root = self._lib, self._group, self._ours, self._rank == ROOT
        calls: dict[str, Callable[[], Any]] = {
            "allreduce": lambda: lib.allreduce(x, g),
            "broadcast": lambda: lib.broadcast(x, ROOT, g),
            "reduce": lambda: lib.reduce(x, ROOT, g),
        }
        if op in calls:
            return calls[op]
        if op == "allgather":
            target = out if ours else np.split(out, self._n)
            return lambda: lib.allgather(target, x, g)
        if op == "reducescatter":
            source = x if ours else np.split(x, self._n)
            return lambda: lib.reducescatter(out, source, g)
        if op == "gather":
            gathered = out if root else None
            return lambda: lib.gather(x, gathered, ROOT, g)
        if op == "scatter":
            scattered = x if root else None
            return lambda: lib.scatter(out, scattered, ROOT, g)
        return lambda: lib.alltoall_single(out, x, group_name=g)

    def run(self, op: str, size: int, plan: Plan) -> tuple[list[float], int]:
        barrier = lambda: self._lib.barrier(self._group)  # noqa: E731
        return workloads.measure(op, size, self._n, self._rank, plan, self._call, barrier)

    def teardown(self) -> None:
        self._lib.destroy_collective_group(self._group)


class _StoreRank:
    """One rank of the object-store baseline: ray.put its array, ray.get the others'."""

    def setup(self, world_size: int, rank: int, op: str, size: int) -> None:
        self._n, self._rank, self._op, self._size = world_size, rank, op, size
        self._x = workloads.buffers(op, size, world_size, rank)[0]

    def put(self) -> np.ndarray:
        return self._x

    def combine(self, refs: list[Any], check: bool) -> int:
        arrays = ray.get(refs)
        if self._op == "allreduce":
            out = arrays[0].copy()
            for array in arrays[1:]:
                out += array
        elif self._op == "broadcast":
            out = arrays[0].copy()
        else:
            out = np.concatenate(arrays)
        if not check:
            return 0
        return workloads.wrong(self._op, out, self._size, self._n, self._rank)


CollectiveRank: Any = ray.remote(num_cpus=0)(_CollectiveRank)  # Any: Ray's handles are untyped
StoreRank: Any = ray.remote(num_cpus=0)(_StoreRank)


class RayActors:
    """``collective`` (ours) or ``ray.util.collective`` over gloo, ranks in Ray actors.

    ``transport`` is ours' ``cpu_transport``: ``"auto"`` (shared memory inside a
    node) or ``"gloo"`` (Gloo over TCP everywhere); ``source`` a folder whose
    ``collective`` package the ranks import instead of the installed one.
    """

    max_batch = workloads.MAX_BATCH
    actor: Any = CollectiveRank
    """The Ray actor class of a rank (a subclass may add methods to ``_CollectiveRank``)."""

    def __init__(
        self, library: str, transport: str | None = None, source: str | None = None
    ) -> None:
        self.library, self.transport, self.source = library, transport, source
        self.ops = workloads.OPS if library == "collective" else RAY_COLLECTIVE_OPS
        self.ranks: list[Any] = []

    def start(self, world_size: int) -> None:
        group = f"bench-{self.library}-{uuid.uuid4().hex[:6]}"
        self.ranks = [self.actor.remote(self.library, self.source) for _ in range(world_size)]
        refs = [
            a.setup.remote(world_size, r, group, self.transport) for r, a in enumerate(self.ranks)
        ]
        ray.get(refs, timeout=RAY_TIMEOUT_S)

    def run(self, op: str, size: int, plan: Plan) -> tuple[list[float], int]:
        refs = [a.run.remote(op, size, plan) for a in self.ranks]
        results = ray.get(refs, timeout=RAY_TIMEOUT_S)
        return slowest([t for t, _ in results]), sum(w for _, w in results)

    def stop(self) -> None:
        if self.ranks:
            ray.get([a.teardown.remote() for a in self.ranks], timeout=RAY_TIMEOUT_S)
        for actor in self.ranks:
            ray.kill(actor)
        self.ranks = []


class ObjectStore:
    """The Ray object store as a collective: ranks put, every rank gets and combines.

    Each op is driven from the driver, so a sample is always one op (``max_batch``).
    """

    ops = ("allreduce", "broadcast", "allgather")
    max_batch = 1

    def __init__(self) -> None:
        self.ranks: list[Any] = []

    def start(self, world_size: int) -> None:
        self.ranks = [StoreRank.remote() for _ in range(world_size)]
        refs = [a.setup.remote(world_size, r, "allreduce", 4096) for r, a in enumerate(self.ranks)]
        ray.get(refs, timeout=RAY_TIMEOUT_S)  # started, so no start-up runs beside a timed op

    def run(self, op: str, size: int, plan: Plan) -> tuple[list[float], int]:
        n = len(self.ranks)
        ray.get([a.setup.remote(n, r, op, size) for r, a in enumerate(self.ranks)])
        senders = self.ranks[ROOT : ROOT + 1] if op == "broadcast" else self.ranks

        def once(check: bool = False) -> int:
            refs = [a.put.remote() for a in senders]
            done = [a.combine.remote(refs, check) for a in self.ranks]
            return sum(ray.get(done, timeout=RAY_TIMEOUT_S))

        times = workloads.time_loop(once, lambda: None, plan)
        return times, once(check=True) if plan.check else 0

    def stop(self) -> None:
        for actor in self.ranks:
            ray.kill(actor)
        self.ranks = []


def slowest(per_rank: list[list[float]]) -> list[float]:
    """Return, for each sample, the time of the slowest rank."""
    return [max(times) for times in zip(*per_rank, strict=True)]


def ray_collective_available() -> str:
    """Return "" if ``ray.util.collective`` can run gloo groups here, else why not."""
    try:
        import ray.util.collective as rc
    except ImportError as exc:
        return f"unavailable: {exc}"
    return "" if rc.gloo_available() else "unavailable: ray.util.collective has no gloo here"
