"""One raw torch.distributed gloo rank in a plain process, driven through a pipe."""

from __future__ import annotations

from datetime import timedelta
from typing import Any


def serve(pipe: Any, world_size: int, rank: int, port: int) -> None:
    """Build a ``ProcessGroupGloo`` from the TCPStore at ``port``, then run ops as told."""
    import torch
    import torch.distributed as dist

    from benchmarks import workloads

    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=120))
    gloo: Any = dist.ProcessGroupGloo  # torch's stubs lack its _Options and its ops
    options = gloo._Options()
    options._timeout = timedelta(seconds=300)
    options._devices = [gloo.create_device(hostname="127.0.0.1")]
    pg = gloo(dist.PrefixStore("bench/", store), rank, world_size, options)
    pipe.send("ready")

    def call(op: str, x: Any, out: Any) -> Any:
        t, o = torch.from_numpy(x), torch.from_numpy(out)
        if op == "allreduce":
            return lambda: pg.allreduce([t]).wait()
        if op == "broadcast":
            return lambda: pg.broadcast([t], dist.BroadcastOptions()).wait()
        if op == "allgather":
            parts = list(o.chunk(world_size))
            return lambda: pg.allgather([parts], [t]).wait()
        chunks = list(t.chunk(world_size))
        return lambda: pg.reduce_scatter([o], [chunks]).wait()

    while True:
        message = pipe.recv()
        if message[0] == "stop":
            return
        _, op, size, iters, warmup = message
        x, out = workloads.buffers(op, size, world_size, rank)
        times = workloads.time_loop(call(op, x, out), lambda: pg.barrier().wait(), iters, warmup)
        x, out = workloads.buffers(op, size, world_size, rank)
        call(op, x, out)()
        pipe.send((times, workloads.wrong(op, out, size, world_size)))
