"""Ranks as spawned processes on one TCPStore: run a function on every rank, without Ray.

The NCCL benchmark and the GPU tests of world size 2 and up use this. The driver
holds a torch ``TCPStore``; each rank is a spawned process that connects to it and
runs jobs as the driver sends them. A job is a module-level function, called as
``fn(context, *args)`` with this rank's ``RankContext``; its result, or its
traceback, comes back through a pipe. Jobs run one at a time on every rank, so a
rank keeps what a job leaves in module globals for the next job (its group, its
GPU buffers). Every wait has a timeout, and a rank that fails or hangs is named.
"""

from __future__ import annotations

import multiprocessing
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from collective.rendezvous.store import TCPRendezvousStore

HOST = "127.0.0.1"
START_TIMEOUT = timedelta(seconds=180)
"""How long a rank may take to start: spawn, import torch, connect to the store."""


@dataclass(frozen=True)
class RankContext:
    """What a job knows about the rank it runs on."""

    rank: int
    world_size: int
    store: TCPRendezvousStore
    """The group's rendezvous store, shared by every rank."""
    c10d_store: Any
    """The torch ``TCPStore`` under ``store``, for libraries that take a c10d store."""


class RankError(RuntimeError):
    """A rank raised in a job, died, or did not answer in time."""


def _serve(pipe: Any, rank: int, world_size: int, port: int, timeout_s: float) -> None:
    """Connect to the driver's store, then run the jobs the driver sends until told to stop."""
    import torch.distributed as dist

    c10d_store = dist.TCPStore(HOST, port, None, False, timedelta(seconds=timeout_s))
    context = RankContext(rank, world_size, TCPRendezvousStore(c10d_store), c10d_store)
    pipe.send(("ok", rank))
    while True:
        job = pipe.recv()
        if job is None:
            return
        fn, args = job
        try:
            result: tuple[str, Any] = ("ok", fn(context, *args))
        except BaseException:
            result = ("error", traceback.format_exc())
        try:
            pipe.send(result)
        except Exception:
            pipe.send(("error", f"the result of {fn.__name__} could not be sent back"))


class RankPool:
    """``world_size`` spawned rank processes meeting on one TCPStore; see the module doc.

    Use it as a context manager, or call ``start`` and ``stop``. After a rank fails
    to answer in time, or dies, the pool is stopped and refuses further jobs.
    """

    def __init__(self, world_size: int, timeout: timedelta = timedelta(seconds=300)) -> None:
        """Describe a pool of ``world_size`` ranks whose jobs take at most ``timeout`` each."""
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.world_size = world_size
        self.timeout = timeout
        self._store: Any = None
        self._procs: list[Any] = []
        self._pipes: list[Any] = []
        self._broken = ""

    @property
    def broken(self) -> str:
        """Return why the pool refuses jobs (a rank hung or died, or it was stopped), or ""."""
        return self._broken

    def __enter__(self) -> RankPool:
        """Start the ranks."""
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop the ranks."""
        self.stop()

    def start(self) -> None:
        """Spawn the ranks and wait until every one has connected to the store.

        Raises:
            RankError: a rank failed or did not connect within ``START_TIMEOUT``.

        """
        import torch.distributed as dist

        self._store = dist.TCPStore(
            HOST, 0, None, True, self.timeout + START_TIMEOUT, wait_for_workers=False
        )
        context = multiprocessing.get_context("spawn")
        timeout_s = (self.timeout + START_TIMEOUT).total_seconds()
        for rank in range(self.world_size):
            parent, child = context.Pipe()
            args = (child, rank, self.world_size, self._store.port, timeout_s)
            proc = context.Process(target=_serve, args=args, name=f"rank-{rank}", daemon=True)
            proc.start()
            self._procs.append(proc)
            self._pipes.append(parent)
        self._collect("start", START_TIMEOUT)

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: timedelta | None = None
    ) -> list[Any]:
        """Run ``fn(context, *args)`` on every rank at once; return each rank's result.

        Raises:
            RankError: a rank raised (its traceback is in the message), died, or did
                not finish within ``timeout`` (default: the pool's).

        """
        if self._broken:
            raise RankError(f"the rank pool is stopped: {self._broken}")
        for pipe in self._pipes:
            pipe.send((fn, args))
        return self._collect(fn.__name__, timeout or self.timeout)

    def _collect(self, what: str, timeout: timedelta) -> list[Any]:
        deadline = time.monotonic() + timeout.total_seconds()
        answers: list[tuple[str, Any]] = []
        for rank, (pipe, proc) in enumerate(zip(self._pipes, self._procs, strict=True)):
            answer = self._answer(rank, pipe, proc, deadline)
            if answer is None:
                self._broken = f"rank {rank} did not finish {what} within {timeout}"
                self.stop(wait_s=0.0)
                raise RankError(self._broken)
            answers.append(answer)
        failed = [(rank, text) for rank, (status, text) in enumerate(answers) if status != "ok"]
        if failed:
            detail = "\n".join(f"--- rank {rank} ---\n{text}" for rank, text in failed)
            raise RankError(f"{what} failed on ranks {[r for r, _ in failed]}:\n{detail}")
        return [value for _, value in answers]

    def _answer(self, rank: int, pipe: Any, proc: Any, deadline: float) -> Any:
        """Return rank's ``(status, value)``, ``("error", why)`` if it died, or None on timeout."""
        while True:
            if pipe.poll(min(1.0, max(0.0, deadline - time.monotonic()))):
                try:
                    return pipe.recv()
                except EOFError:
                    self._broken = f"rank {rank} died (exit code {proc.exitcode})"
                    return ("error", self._broken)
            if not proc.is_alive():
                self._broken = f"rank {rank} died (exit code {proc.exitcode})"
                return ("error", self._broken)
            if time.monotonic() >= deadline:
                return None

    def stop(self, wait_s: float = 10.0) -> None:
        """Tell the ranks to stop, and kill any that has not exited within ``wait_s``."""
        for pipe in self._pipes:
            try:
                pipe.send(None)
            except OSError:
                continue
        for proc in self._procs:
            proc.join(wait_s)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self._procs, self._pipes, self._store = [], [], None
        self._broken = self._broken or "stopped"
