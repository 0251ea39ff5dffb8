"""The many-tensor peers: ours bucketed and per tensor, ``ray.util.collective``, the object store.

The ranks are Ray actors, each in a group of ours and, when asked for, one of
``ray.util.collective``. Every run builds fresh tensors, times ``iters`` calls (the
ranks meet before each) and checks one more call on fresh tensors. The object store
is driven from the driver: the source puts its state dict, every receiver gets it
and copies it into its own tensors.
"""

from __future__ import annotations

import importlib
import time
import uuid
from typing import Any

import ray
import torch

import collective as col
from benchmarks import bulk_workloads as bw
from benchmarks.bulk_workloads import SOURCE, Workload
from benchmarks.report import COPY, LOOP, OURS, RAY, STORE

RAY_TIMEOUT_S = 1800
IMPLS = (OURS, LOOP, RAY, STORE, COPY)


class _BulkRank:
    """One rank: a group of ours, and one of ``ray.util.collective`` when asked for."""

    def setup(self, world_size: int, rank: int, group: str, with_ray: bool) -> str:
        self._n, self._rank, self._group = world_size, rank, group
        col.init_collective_group(world_size, rank, backend="gloo", group_name=group)
        if with_ray:
            rc: Any = importlib.import_module("ray.util.collective")
            rc.init_collective_group(world_size, rank, backend="gloo", group_name=group + "-ray")
        return col.get_group_handle(group).transport

    def _call(self, impl: str, work: Workload, held: dict[str, torch.Tensor]) -> Any:
        g, root, reduce = self._group, SOURCE, work.op == "allreduce"
        values = list(held.values())
        if impl == OURS and reduce:
            return lambda: col.allreduce_tensors(values, g)
        if impl == OURS:
            return lambda: col.broadcast_state_dict(held, root, g)
        lib: Any = col
        if impl == RAY:
            lib = importlib.import_module("ray.util.collective")
            g += "-ray"

        def loop() -> None:
            for x in values:
                if reduce:
                    lib.allreduce(x, g)
                else:
                    lib.broadcast(x, root, g)

        return loop

    def run(self, impl: str, work: Workload, iters: int, warmup: int) -> tuple[list[float], int]:
        held = bw.tensors(work, self._rank)
        meet = lambda: col.barrier(self._group)  # noqa: E731
        times = bw.timed(self._call(impl, work, held), meet, iters, warmup)
        held = bw.tensors(work, self._rank)
        self._call(impl, work, held)()
        return times, bw.wrong(work, held, self._n)

    def put(self, work: Workload) -> list[Any]:
        self._store = bw.tensors(work, self._rank)
        return [ray.put(self._store)]

    def take(self, refs: list[Any], work: Workload, check: bool) -> int:
        if not hasattr(self, "_store"):
            self._store = bw.tensors(work, self._rank)
        got = ray.get(refs[0])
        for name, x in self._store.items():
            x.copy_(got[name])
        return bw.wrong(work, self._store, self._n) if check else 0

    def drop(self) -> None:
        self.__dict__.pop("_store", None)

    def teardown(self) -> None:
        col.destroy_collective_group(self._group)


BulkRank: Any = ray.remote(num_cpus=0)(_BulkRank)


class Ranks:
    """``world_size`` rank actors, placed by ``resources`` (one dict per rank) when given."""

    def __init__(self, world_size: int, with_ray: bool, resources: list[dict] | None = None):
        group = f"bulk-{uuid.uuid4().hex[:6]}"
        place = resources or [{}] * world_size
        self.actors = [BulkRank.options(resources=place[r]).remote() for r in range(world_size)]
        refs = [a.setup.remote(world_size, r, group, with_ray) for r, a in enumerate(self.actors)]
        self.transports = ray.get(refs, timeout=RAY_TIMEOUT_S)

    def run(self, impl: str, work: Workload, iters: int, warmup: int) -> tuple[list[float], int]:
        """Return the slowest rank's seconds per sample and the count of wrong tensors."""
        if impl == STORE:
            return self._store(work, iters, warmup)
        refs = [a.run.remote(impl, work, iters, warmup) for a in self.actors]
        results = ray.get(refs, timeout=RAY_TIMEOUT_S)
        times = [max(ts) for ts in zip(*(t for t, _ in results), strict=True)]
        return times, sum(w for _, w in results)

    def _store(self, work: Workload, iters: int, warmup: int) -> tuple[list[float], int]:
        source, receivers = self.actors[SOURCE], self.actors[SOURCE + 1 :]

        def once(check: bool = False) -> int:
            refs = source.put.remote(work)
            done = [a.take.remote(refs, work, check) for a in receivers]
            return sum(ray.get(done, timeout=RAY_TIMEOUT_S))

        times = []
        for i in range(warmup + iters):
            start = time.perf_counter()
            once()
            if i >= warmup:
                times.append(time.perf_counter() - start)
        ray.get([a.drop.remote() for a in self.actors], timeout=RAY_TIMEOUT_S)
        wrong = once(check=True)
        ray.get([a.drop.remote() for a in self.actors], timeout=RAY_TIMEOUT_S)
        return times, wrong

    def stop(self) -> None:
        """Destroy the groups and the actors."""
        ray.get([a.teardown.remote() for a in self.actors], timeout=RAY_TIMEOUT_S)
        for actor in self.actors:
            ray.kill(actor)
