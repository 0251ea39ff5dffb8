"""The peers in plain processes: raw torch gloo, and plain copies through shared memory.

Each rank is a spawned process that serves runs sent through a pipe; the runners
have the interface described in ``peers``.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from benchmarks import copy_peer, torch_peer, workloads
from benchmarks.peers import RAY_TIMEOUT_S, slowest
from benchmarks.workloads import Plan


class ProcessRanks:
    """``world_size`` spawned processes, each running ``target(pipe, world_size, rank, *args)``."""

    ops = workloads.OPS
    max_batch = workloads.MAX_BATCH

    def __init__(self, target: Callable[..., None]) -> None:
        self.target = target
        self.procs: list[Any] = []
        self.pipes: list[Any] = []

    def start_args(self) -> tuple[Any, ...]:
        """Return the extra arguments of every rank's ``target``."""
        return ()

    def start(self, world_size: int) -> None:
        context = multiprocessing.get_context("spawn")
        args = self.start_args()
        for rank in range(world_size):
            parent, child = context.Pipe()
            proc = context.Process(
                target=self.target, args=(child, world_size, rank, *args), daemon=True
            )
            proc.start()
            self.procs.append(proc)
            self.pipes.append(parent)
        for pipe in self.pipes:
            if not pipe.poll(RAY_TIMEOUT_S):
                raise TimeoutError("a benchmark rank did not start")
            pipe.recv()

    def ask(self, message: tuple[Any, ...]) -> tuple[list[float], int]:
        """Send ``message`` to every rank; return the slowest times and the wrong count."""
        for pipe in self.pipes:
            pipe.send(message)
        results = []
        for pipe in self.pipes:
            if not pipe.poll(RAY_TIMEOUT_S):
                raise TimeoutError(f"a benchmark rank did not answer {message[:3]}")
            results.append(pipe.recv())
        return slowest([t for t, _ in results]), sum(w for _, w in results)

    def run(self, op: str, size: int, plan: Plan) -> tuple[list[float], int]:
        return self.ask(("run", op, size, plan))

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
        self.procs, self.pipes = [], []


class TorchGloo(ProcessRanks):
    """Raw torch.distributed ``ProcessGroupGloo`` in plain processes: the transport under us."""

    def __init__(self) -> None:
        super().__init__(torch_peer.serve)
        self.store: Any = None

    def start_args(self) -> tuple[Any, ...]:
        import torch.distributed as dist

        self.store = dist.TCPStore(
            "127.0.0.1", 0, None, True, timedelta(seconds=120), wait_for_workers=False
        )
        return (self.store.port,)

    def stop(self) -> None:
        super().stop()
        self.store = None


class ShmCopy(ProcessRanks):
    """The plain-copy peer: each op's bytes copied through a shared segment (see ``copy_peer``).

    Every run gets a fresh segment, which is gone from the file system once it ends.
    """

    def __init__(self) -> None:
        super().__init__(copy_peer.serve)

    def run(self, op: str, size: int, plan: Plan) -> tuple[list[float], int]:
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        path = os.path.join(folder, f"collective-bench-copy-{uuid.uuid4().hex[:12]}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, copy_peer.segment_bytes(op, size, len(self.procs)))
            return self.ask(("run", op, size, plan, path))
        finally:
            os.close(fd)
            os.unlink(path)
