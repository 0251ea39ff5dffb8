"""One raw torch.distributed gloo rank in a plain process, driven through a pipe."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np


def serve(pipe: Any, world_size: int, rank: int, port: int) -> None:
    """Build a ``ProcessGroupGloo`` from the TCPStore at ``port``, then run ops as told."""
    import torch.distributed as dist

    from benchmarks import workloads

    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=120))
    gloo: Any = dist.ProcessGroupGloo  # torch's stubs lack its _Options and its ops
    options = gloo._Options()
    options._timeout = timedelta(seconds=300)
    options._devices = [gloo.create_device(hostname="127.0.0.1")]
    pg = gloo(dist.PrefixStore("bench/", store), rank, world_size, options)
    pipe.send("ready")

    def call(op: str, x: np.ndarray, out: np.ndarray) -> Callable[[], Any]:
        return _call(pg, dist, world_size, rank, op, x, out)

    while True:
        message = pipe.recv()
        if message[0] == "stop":
            return
        _, op, size, plan = message
        barrier = lambda: pg.barrier().wait()  # noqa: E731
        pipe.send(workloads.measure(op, size, world_size, rank, plan, call, barrier))


def _call(
    pg: Any, dist: Any, n: int, rank: int, op: str, x: np.ndarray, out: np.ndarray
) -> Callable[[], Any]:
    """Return a function that runs ``op`` once on ``pg`` with the buffers ``x`` and ``out``."""
    import torch

    from benchmarks.workloads import ROOT

    t, o = torch.from_numpy(x), torch.from_numpy(out)
    root = rank == ROOT
    if op == "allreduce":
        return lambda: pg.allreduce([t]).wait()
    if op == "broadcast":
        return lambda: pg.broadcast([t], dist.BroadcastOptions()).wait()
    if op == "reduce":
        options = dist.ReduceOptions()
        options.rootRank = ROOT
        return lambda: pg.reduce([t], options).wait()
    if op == "allgather":
        parts = list(o.chunk(n))
        return lambda: pg.allgather([parts], [t]).wait()
    if op == "gather":
        gathered = [list(o.chunk(n))] if root else []
        options = dist.GatherOptions()
        options.rootRank = ROOT
        return lambda: pg.gather(gathered, [t], options).wait()
    if op == "scatter":
        scattered = [list(t.chunk(n))] if root else []
        options = dist.ScatterOptions()
        options.rootRank = ROOT
        return lambda: pg.scatter([o], scattered, options).wait()
    if op == "reducescatter":
        chunks = list(t.chunk(n))
        return lambda: pg.reduce_scatter([o], [chunks]).wait()
    return lambda: pg.alltoall_base(o, t, [], []).wait()
