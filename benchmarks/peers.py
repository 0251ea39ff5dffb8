"""The implementations under test, each a set of ranks that run one op and time it.

Every implementation has ``start(world_size)``, ``run(op, size, iters, warmup)``
returning per-iteration seconds (the slowest rank's, as nccl-tests reports) and
the count of wrong output elements, and ``stop()``.
"""

from __future__ import annotations

import importlib
import multiprocessing
import uuid
from datetime import timedelta
from typing import Any

import numpy as np
import ray

from benchmarks import workloads
from benchmarks.torch_peer import serve

RAY_TIMEOUT_S = 600
"""Bound on every wait for the ranks of one run."""


class _CollectiveRank:
    """One rank of ``collective`` or of ``ray.util.collective``, in its own Ray actor."""

    def __init__(self, library: str) -> None:
        name = "collective" if library == "collective" else "ray.util.collective"
        self._lib, self._library = importlib.import_module(name), library

    def setup(self, world_size: int, rank: int, group: str) -> int:
        self._n, self._rank, self._group = world_size, rank, group
        self._lib.init_collective_group(world_size, rank, backend="gloo", group_name=group)
        return rank

    def _call(self, op: str, x: np.ndarray, out: np.ndarray) -> Any:
        lib, g, ours = self._lib, self._group, self._library == "collective"
        if op == "allreduce":
            return lambda: lib.allreduce(x, g)
        if op == "broadcast":
            return lambda: lib.broadcast(x, 0, g)
        if op == "allgather":
            target = out if ours else np.split(out, self._n)
            return lambda: lib.allgather(target, x, g)
        source = x if ours else np.split(x, self._n)
        return lambda: lib.reducescatter(out, source, g)

    def run(self, op: str, size: int, iters: int, warmup: int) -> tuple[list[float], int]:
        x, out = workloads.buffers(op, size, self._n, self._rank)
        barrier = lambda: self._lib.barrier(self._group)  # noqa: E731
        times = workloads.time_loop(self._call(op, x, out), barrier, iters, warmup)
        x, out = workloads.buffers(op, size, self._n, self._rank)
        self._call(op, x, out)()
        return times, workloads.wrong(op, out, size, self._n)

    def teardown(self) -> None:
        self._lib.destroy_collective_group(self._group)


class _StoreRank:
    """One rank of the object-store baseline: ray.put its array, ray.get everyone's."""

    def setup(self, world_size: int, rank: int, op: str, size: int) -> None:
        self._n, self._op, self._size = world_size, op, size
        self._x = workloads.buffers(op, size, world_size, rank)[0]

    def put(self) -> np.ndarray:
        return self._x

    def combine(self, refs: list[Any], check: bool) -> int:
        arrays = ray.get(refs)
        if self._op == "allreduce":
            out = arrays[0].copy()
            for array in arrays[1:]:
                out += array
        else:
            out = np.concatenate(arrays)
        return workloads.wrong(self._op, out, self._size, self._n) if check else 0


CollectiveRank: Any = ray.remote(num_cpus=0)(_CollectiveRank)  # Any: Ray's handles are untyped
StoreRank: Any = ray.remote(num_cpus=0)(_StoreRank)


class RayActors:
    """``collective`` (ours) or ``ray.util.collective`` over gloo, ranks in Ray actors."""

    def __init__(self, library: str) -> None:
        self.library = library
        self.ranks: list[Any] = []

    def start(self, world_size: int) -> None:
        group = f"bench-{self.library}-{uuid.uuid4().hex[:6]}"
        self.ranks = [CollectiveRank.remote(self.library) for _ in range(world_size)]
        refs = [a.setup.remote(world_size, r, group) for r, a in enumerate(self.ranks)]
        ray.get(refs, timeout=RAY_TIMEOUT_S)

    def run(self, op: str, size: int, iters: int, warmup: int) -> tuple[list[float], int]:
        refs = [a.run.remote(op, size, iters, warmup) for a in self.ranks]
        results = ray.get(refs, timeout=RAY_TIMEOUT_S)
        return slowest([t for t, _ in results]), sum(w for _, w in results)

    def stop(self) -> None:
        if self.ranks:
            ray.get([a.teardown.remote() for a in self.ranks], timeout=RAY_TIMEOUT_S)
        for actor in self.ranks:
            ray.kill(actor)
        self.ranks = []


class ObjectStore:
    """The Ray object store as a collective: every rank puts, every rank gets all and combines."""

    ops = ("allreduce", "allgather")

    def __init__(self) -> None:
        self.ranks: list[Any] = []

    def start(self, world_size: int) -> None:
        self.ranks = [StoreRank.remote() for _ in range(world_size)]
        refs = [a.setup.remote(world_size, r, "allreduce", 4096) for r, a in enumerate(self.ranks)]
        ray.get(refs, timeout=RAY_TIMEOUT_S)  # started, so no start-up runs beside a timed op

    def run(self, op: str, size: int, iters: int, warmup: int) -> tuple[list[float], int]:
        n = len(self.ranks)
        ray.get([a.setup.remote(n, r, op, size) for r, a in enumerate(self.ranks)])

        def once(check: bool = False) -> int:
            refs = [a.put.remote() for a in self.ranks]
            done = [a.combine.remote(refs, check) for a in self.ranks]
            return sum(ray.get(done, timeout=RAY_TIMEOUT_S))

        times = workloads.time_loop(once, lambda: None, iters, warmup)
        return times, once(check=True)

    def stop(self) -> None:
        for actor in self.ranks:
            ray.kill(actor)
        self.ranks = []


class TorchGloo:
    """Raw torch.distributed ``ProcessGroupGloo`` in plain processes: the transport under us."""

    def __init__(self) -> None:
        self.store: Any = None
        self.procs: list[Any] = []
        self.pipes: list[Any] = []

    def start(self, world_size: int) -> None:
        import torch.distributed as dist

        self.store = dist.TCPStore(
            "127.0.0.1", 0, None, True, timedelta(seconds=120), wait_for_workers=False
        )
        context = multiprocessing.get_context("spawn")
        for rank in range(world_size):
            parent, child = context.Pipe()
            proc = context.Process(
                target=serve, args=(child, world_size, rank, self.store.port), daemon=True
            )
            proc.start()
            self.procs.append(proc)
            self.pipes.append(parent)
        for pipe in self.pipes:
            if not pipe.poll(RAY_TIMEOUT_S):
                raise TimeoutError("a torch rank did not start")
            pipe.recv()

    def run(self, op: str, size: int, iters: int, warmup: int) -> tuple[list[float], int]:
        for pipe in self.pipes:
            pipe.send(("run", op, size, iters, warmup))
        results = []
        for pipe in self.pipes:
            if not pipe.poll(RAY_TIMEOUT_S):
                raise TimeoutError(f"a torch rank did not finish {op} at {size} B")
            results.append(pipe.recv())
        return slowest([t for t, _ in results]), sum(w for _, w in results)

    def stop(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(("stop",))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        self.procs, self.pipes, self.store = [], [], None


def slowest(per_rank: list[list[float]]) -> list[float]:
    """Return, for each iteration, the time of the slowest rank."""
    return [max(times) for times in zip(*per_rank, strict=True)]


def ray_collective_available() -> str:
    """Return "" if ``ray.util.collective`` can run gloo groups here, else why not."""
    try:
        import ray.util.collective as rc
    except ImportError as exc:
        return f"unavailable: {exc}"
    return "" if rc.gloo_available() else "unavailable: ray.util.collective has no gloo here"
