"""Start the ranks of a two-process torch.distributed example and collect their results.

``torch_ddp.py`` and ``torch_fsdp.py`` use it: each rank runs ``worker(rank, port,
results)`` in a spawned process and puts ``(rank, result)`` on ``results``; the parent
waits a bounded time for every rank's result and for every process to exit.
"""

import queue
import socket
import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    """Return a TCP port that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    worker: Callable[[int, int, Any], None], world_size: int, timeout_s: float
) -> dict[int, Any] | None:
    """Run ``worker`` on ``world_size`` spawned ranks; return each rank's result by rank.

    Returns None, after killing the processes still alive, if the results did not all
    come and the processes did not all exit within ``timeout_s``. A rank that raised
    ends the wait at once: ``join`` raises its error, after ending the others.
    """
    results = mp.get_context("spawn").Queue()
    processes = mp.start_processes(
        worker, (free_port(), results), nprocs=world_size, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout_s
    by_rank: dict[int, Any] = {}
    while len(by_rank) < world_size and time.monotonic() < deadline:
        try:
            rank, result = results.get(timeout=1)
            by_rank[rank] = result
        except queue.Empty:
            processes.join(timeout=0)
    # Read before joining: a rank exits only once what it sent is read.
    while len(by_rank) == world_size and not processes.join(timeout=1):
        if time.monotonic() > deadline:
            break
    if len(by_rank) < world_size or any(p.is_alive() for p in processes.processes):
        for process in processes.processes:
            process.kill()
        return None
    return by_rank
