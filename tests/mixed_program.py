"""Random programs that mix user send/recv with collectives on one group, and their answers.

Every rank builds the same program from a seed. A send is posted asynchronously,
and its receive comes one or more collectives later, so the user's messages are
in flight while collectives run. Inputs are small integers, so every reduction
is exact and each rank's results can be compared with numpy's bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from collective.types import ReduceOp

DTYPES = ["float32", "float64", "int32", "int64"]
COUNTS = [0, 1, 5, 300, 5000]
REDUCTIONS = [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN]
KINDS = ["allreduce", "reduce", "broadcast", "allgather", "reducescatter", "barrier", "send"]


@dataclass(frozen=True)
class Event:
    """One step of a program: a collective, a send's post, or a receive."""

    index: int
    kind: str
    dtype: str = "float64"
    count: int = 0
    reduce_op: ReduceOp = ReduceOp.SUM
    root: int = 0
    peer: int = 0
    """For send and recv: the other rank (the receiver of a send, the sender of a recv)."""
    rank: int = 0
    """For send and recv: the rank that acts."""
    message: int = -1
    """For send and recv: which message."""


def make(seed: int, world_size: int, length: int = 24) -> list[Event]:
    """Return a program of about ``length`` events for ``world_size`` ranks."""
    rng = np.random.default_rng(seed)
    events: list[Event] = []
    pending: list[Event] = []
    for i in range(length):
        kind = KINDS[int(rng.integers(len(KINDS)))]
        dtype = DTYPES[int(rng.integers(len(DTYPES)))]
        count = COUNTS[int(rng.integers(len(COUNTS)))]
        if kind == "send" and world_size > 1:
            src = int(rng.integers(world_size))
            dst = (src + 1 + int(rng.integers(world_size - 1))) % world_size
            send = Event(i, "send", dtype, count, peer=dst, rank=src, message=i)
            events.append(send)
            pending.append(send)
            continue
        if kind == "send":
            kind = "barrier"
        reduce_op = REDUCTIONS[int(rng.integers(len(REDUCTIONS)))]
        events.append(Event(i, kind, dtype, count, reduce_op, int(rng.integers(world_size))))
        if pending and rng.random() < 0.5:
            events.append(_receive(pending.pop(0)))
    events.extend(_receive(send) for send in pending)
    return events


def _receive(send: Event) -> Event:
    return Event(
        send.index,
        "recv",
        send.dtype,
        send.count,
        peer=send.rank,
        rank=send.peer,
        message=send.index,
    )


def data(event: Event, rank: int, part: int = 0) -> np.ndarray:
    """Return ``rank``'s input of ``event`` (``part``: which chunk of a reducescatter)."""
    seed = event.index * 1000 + rank * 10 + part
    values = np.random.default_rng(seed).integers(-3, 4, size=event.count)
    return values.astype(event.dtype)


class Ops(Protocol):
    """The calls a program makes, through a group object or the public API."""

    def allreduce(self, x: np.ndarray, op: ReduceOp) -> None: ...
    def reduce(self, x: np.ndarray, root: int, op: ReduceOp) -> None: ...
    def broadcast(self, x: np.ndarray, root: int) -> None: ...
    def allgather(self, outs: list[np.ndarray], x: np.ndarray) -> None: ...
    def reducescatter(self, out: np.ndarray, ins: list[np.ndarray], op: ReduceOp) -> None: ...
    def barrier(self) -> None: ...
    def send(self, x: np.ndarray, dst: int) -> Any: ...
    def recv(self, x: np.ndarray, src: int) -> None: ...


def run(ops: Ops, rank: int, world_size: int, program: list[Event]) -> dict[int, Any]:
    """Run ``program`` as ``rank``; return every result it holds, by event index."""
    results: dict[int, Any] = {}
    works = []
    for event in program:
        x = data(event, rank)
        if event.kind == "allreduce":
            ops.allreduce(x, event.reduce_op)
        elif event.kind == "reduce":
            ops.reduce(x, event.root, event.reduce_op)
        elif event.kind == "broadcast":
            ops.broadcast(x, event.root)
        elif event.kind == "allgather":
            outs = [np.full(event.count, -9, event.dtype) for _ in range(world_size)]
            ops.allgather(outs, x)
            x = np.concatenate(outs)
        elif event.kind == "reducescatter":
            ins = [data(event, rank, part) for part in range(world_size)]
            ops.reducescatter(x, ins, event.reduce_op)
        elif event.kind == "barrier":
            ops.barrier()
            continue
        elif event.kind == "send":
            if rank == event.rank:
                works.append(ops.send(x, event.peer))
            continue
        elif event.kind == "recv":
            if rank != event.rank:
                continue
            x = np.full(event.count, -9, event.dtype)
            ops.recv(x, event.peer)
            results[-event.index - 1] = x
            continue
        results[event.index] = x
    for work in works:
        work.wait()
    return results


def _fold(inputs: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    stack = np.stack(inputs)
    ufunc = {ReduceOp.SUM: np.add, ReduceOp.MAX: np.maximum, ReduceOp.MIN: np.minimum}[op]
    return ufunc.reduce(stack, axis=0).astype(inputs[0].dtype)


def expected(program: list[Event], rank: int, world_size: int) -> dict[int, np.ndarray]:
    """Return what ``run`` must return on ``rank``."""
    want: dict[int, np.ndarray] = {}
    for event in program:
        mine = data(event, rank)
        everyone = [data(event, r) for r in range(world_size)]
        if event.kind == "allreduce":
            want[event.index] = _fold(everyone, event.reduce_op)
        elif event.kind == "reduce":
            want[event.index] = _fold(everyone, event.reduce_op) if rank == event.root else mine
        elif event.kind == "broadcast":
            want[event.index] = everyone[event.root]
        elif event.kind == "allgather":
            want[event.index] = np.concatenate(everyone)
        elif event.kind == "reducescatter":
            parts = [data(event, r, rank) for r in range(world_size)]
            want[event.index] = _fold(parts, event.reduce_op)
        elif event.kind == "recv" and rank == event.rank:
            want[-event.index - 1] = data(event, event.peer)
    return want


def check(program: list[Event], results: list[dict[int, Any]], world_size: int) -> None:
    """Assert every rank's results against ``expected``, naming the first difference."""
    for rank, got in enumerate(results):
        want = expected(program, rank, world_size)
        assert sorted(got) == sorted(want), (rank, sorted(got), sorted(want))
        for key, value in want.items():
            what = f"message {-key - 1} received" if key < 0 else f"event {key}"
            np.testing.assert_array_equal(got[key], value, err_msg=f"rank {rank}, {what}")
