"""Random programs that mix user send/recv with collectives on one group, and their answers.

Every rank builds the same program from a seed. A send is posted asynchronously,
and its receive comes one or more collectives later, so the user's messages are
in flight while collectives run. Inputs are small integers, so every reduction
is exact and each rank's results can be compared with numpy's bit for bit.

An extended program (``make(..., extended=True)``) also runs async alltoalls of
non-contiguous inputs, whose references the program drops before the wait (some
ranks send to one peer only), and bool reductions above the small-message limit,
whose results are compared byte for byte (a bool holding byte 2 reads as True). Its
allreduces, reduces and broadcasts go through the public call path (``ExtendedOps.one``)
on numpy arrays, torch tensors or lazily negated torch views (the negative bit), with
no timeout or one of up to ``timedelta.max``; after each, every torch tensor must
still be resizable, and is freed and regrown.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, cast

import numpy as np
import torch

from collective.types import ReduceOp

DTYPES = ["float32", "float64", "int32", "int64"]
COUNTS = [0, 1, 5, 300, 5000]
REDUCTIONS = [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN]
KINDS = ["allreduce", "reduce", "broadcast", "allgather", "reducescatter", "barrier", "send"]
REDUCING = ("allreduce", "reduce", "reducescatter")
BOOL_COUNT = 20000
"""Bools per buffer of a bool reduction: above the small-message limit at every world size."""
BOOL_REDUCTIONS = [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX]
FORMS = ["numpy", "numpy", "torch", "negated"]
"""What an extended program's allreduce, reduce or broadcast passes (see ``as_form``)."""
TIMEOUTS = [None, None, timedelta(days=400), timedelta(days=250 * 365), timedelta.max]
"""The timeouts an extended program's allreduce, reduce or broadcast passes."""


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
    form: str = "numpy"
    """For an extended program's allreduce, reduce and broadcast: what it passes."""
    timeout: timedelta | None = None
    """For an extended program's allreduce, reduce and broadcast: the call's timeout."""


def make(seed: int, world_size: int, length: int = 24, extended: bool = False) -> list[Event]:
    """Return a program of about ``length`` events for ``world_size`` ranks.

    With ``extended``, it also holds async alltoalls and bool reductions (see above).
    """
    rng = np.random.default_rng(seed)
    events: list[Event] = []
    pending: list[Event] = []
    kinds = [*KINDS, "alltoall"] if extended else KINDS
    for i in range(length):
        kind = kinds[int(rng.integers(len(kinds)))]
        dtype = DTYPES[int(rng.integers(len(DTYPES)))]
        count = COUNTS[int(rng.integers(len(COUNTS)))]
        if extended and kind in REDUCING and rng.random() < 0.4:
            op = BOOL_REDUCTIONS[int(rng.integers(len(BOOL_REDUCTIONS)))]
            events.append(Event(i, kind, "bool", BOOL_COUNT, op, int(rng.integers(world_size))))
            continue
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
        event = Event(i, kind, dtype, count, reduce_op, int(rng.integers(world_size)))
        if extended and kind in ONE_BUFFER:
            extra = np.random.default_rng((seed, i))
            form = FORMS[int(extra.integers(len(FORMS)))]
            timeout = TIMEOUTS[int(extra.integers(len(TIMEOUTS)))]
            event = Event(i, kind, dtype, count, reduce_op, event.root, form=form, timeout=timeout)
        events.append(event)
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
    """Return ``rank``'s input of ``event`` (``part``: the chunk of a reducescatter, alltoall)."""
    seed = event.index * 1000 + rank * 10 + part
    low = 0 if event.dtype == "bool" else -3
    values = np.random.default_rng(seed).integers(low, 4 if low else 2, size=event.count)
    return values.astype(event.dtype)


def pair_count(event: Event, src: int, dst: int) -> int:
    """Return the elements ``src`` sends ``dst`` in an alltoall: all to the root, some to others."""
    return event.count if dst == event.root or (src + dst + event.index) % 3 == 0 else 0


def strided(values: np.ndarray) -> np.ndarray:
    """Return ``values`` as a non-contiguous view: every other element of a new buffer."""
    wide = np.zeros(2 * values.size, values.dtype)
    wide[::2] = values
    return wide[::2]


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


class ExtendedOps(Ops, Protocol):
    """The calls of an extended program: an async alltoall, and one-buffer calls of any form."""

    def alltoall(self, outs: list[np.ndarray], ins: list[np.ndarray]) -> Any: ...
    def one(self, kind: str, x: Any, root: int, op: ReduceOp, timeout: timedelta | None) -> None:
        """Run ``kind`` (allreduce, reduce or broadcast) on ``x`` through the public call path."""


ONE_BUFFER = ("allreduce", "reduce", "broadcast")


def as_form(values: np.ndarray, form: str) -> Any:
    """Return ``values`` as ``form``: the array, a torch tensor, or a view with the negative bit.

    The negated view reads ``values`` from memory holding their negation, as
    ``z.conj().imag`` does; it is contiguous, so it may take the short path.
    """
    if form == "numpy":
        return values
    if form == "torch":
        return torch.tensor(values)
    return torch._neg_view(torch.tensor(-values))


def _read_and_regrow(x: Any) -> np.ndarray:
    """Return the values of ``x``; a torch tensor must still be resizable, and is regrown."""
    if isinstance(x, np.ndarray):
        return x
    values = x.resolve_neg().clone().numpy()
    storage = x.untyped_storage()
    assert storage.resizable(), "the op left the caller's tensor not resizable"
    nbytes = storage.nbytes()
    storage.resize_(0)
    storage.resize_(nbytes)
    return values


def run(ops: Ops, rank: int, world_size: int, program: list[Event]) -> dict[int, Any]:
    """Run ``program`` as ``rank``; return every result it holds, by event index."""
    results: dict[int, Any] = {}
    works = []
    for event in program:
        x = data(event, rank)
        if event.form != "numpy" or event.timeout is not None:
            buffer = as_form(x, event.form)
            extended = cast(ExtendedOps, ops)
            extended.one(event.kind, buffer, event.root, event.reduce_op, event.timeout)
            results[event.index] = _read_and_regrow(buffer)
            continue
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
        elif event.kind == "alltoall":
            x = _alltoall(cast(ExtendedOps, ops), event, rank, world_size)
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


def _alltoall(ops: ExtendedOps, event: Event, rank: int, world_size: int) -> np.ndarray:
    """Run ``event``'s async alltoall of strided inputs, dropped before the wait; return outputs."""
    ins = [strided(data(event, rank, j)[: pair_count(event, rank, j)]) for j in range(world_size)]
    outs = [np.full(pair_count(event, j, rank), -9, event.dtype) for j in range(world_size)]
    work = ops.alltoall(outs, ins)
    del ins
    scribbles = [np.full(max(event.count, 1), -7, event.dtype) for _ in range(16)]
    work.wait()
    del scribbles
    return np.concatenate(outs)


_UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MAX: np.maximum,
    ReduceOp.MIN: np.minimum,
}


def _fold(inputs: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    """Reduce ``inputs`` by ``op``; on bool, SUM is OR and PRODUCT AND."""
    stack = np.stack(inputs)
    if stack.dtype == np.bool_:
        return _UFUNCS[op].reduce(stack.astype(np.int64), axis=0) != 0
    return _UFUNCS[op].reduce(stack, axis=0).astype(inputs[0].dtype)


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
        elif event.kind == "alltoall":
            got = [data(event, r, rank)[: pair_count(event, r, rank)] for r in range(world_size)]
            want[event.index] = np.concatenate(got)
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
            mine = got[key]
            if value.dtype == np.bool_:
                mine, value = np.asarray(mine).view(np.uint8), value.view(np.uint8)
            np.testing.assert_array_equal(mine, value, err_msg=f"rank {rank}, {what}")
