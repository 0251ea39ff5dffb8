"""The bulk calls on a group whose ranks share one GPU, run on a stood-in GPU.

As in ``test_shared_gpu_group``, the ranks are threads of this process, each with its
own ``HostDevice`` over one ``HostGpu``, and their tensors are numpy arrays that the
group describes as GPU buffers. The bulk layer tells a GPU buffer by its library, so
``on_the_stand_in`` gives it the stand-in's view of host memory: a numpy array lies on
``cuda:0`` (``kinds.spec``), staging and control messages go to host memory (the buffer
they go next to, ``calls._like``, is None), and the device's new arrays are host arrays
(``packing.empty``). Everything else runs as on a GPU: each rank's checks, the agreement
through the group's ops, the plan and the pipeline, and the transport. A broadcast moves
its whole list as one message (the group ``takes_lists``: ``broadcast_list``); a
reduction goes bucket by bucket through ``allreduce``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pytest

from collective.bulk import calls
from collective.bulk.meta import Listing
from collective.bulk.plan import plan
from collective.frameworks import kinds, packing
from collective.frameworks.bytelist import ByteList
from collective.groups.shared_gpu import transport
from collective.groups.shared_gpu.group import SharedGpuGroup
from collective.types import ReduceOp
from tests.shared_gpu_standin import HostGpu
from tests.test_shared_gpu_group import _data, run_group

BUCKET = 1024
"""Bytes per op of a reduction: several buckets, and tensors that move in ops of their own."""


@pytest.fixture(autouse=True)
def on_the_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the bulk layer take numpy arrays as the stand-in GPU's buffers; small mailboxes."""
    real_spec, real_empty = kinds.spec, packing.empty

    def spec(x: Any, name: str) -> kinds.TensorSpec:
        found = real_spec(x, name)
        return replace(found, device="cuda:0") if found.kind == "numpy" else found

    def empty(dtype: str, shape: tuple[int, ...], device: str) -> Any:
        return np.empty(shape, dtype) if device == "cuda" else real_empty(dtype, shape, device)

    monkeypatch.setattr(kinds, "spec", spec)
    monkeypatch.setattr(calls, "_like", lambda group, xs: None)
    monkeypatch.setattr(packing, "empty", empty)
    monkeypatch.setattr(transport, "MAIL_BYTES", 4096)
    monkeypatch.setattr(transport, "SLOT_BYTES", 8192)


@dataclass
class Seen:
    """The data ops one rank's group was asked for: each call's buffers and options."""

    broadcast_list: list[tuple[list[Any], Any]] = field(default_factory=list)
    allreduce: list[tuple[list[Any], Any]] = field(default_factory=list)
    broadcast: list[tuple[list[Any], Any]] = field(default_factory=list)


def spied(g: SharedGpuGroup) -> Seen:
    """Record every ``broadcast_list``, ``allreduce`` and ``broadcast`` asked of ``g``."""
    seen = Seen()
    for name in ("broadcast_list", "allreduce", "broadcast"):
        real, calls_of = getattr(g, name), getattr(seen, name)

        def spy(tensors: Any, options: Any, real: Any = real, calls_of: Any = calls_of) -> Any:
            calls_of.append((list(tensors), options))
            return real(tensors, options)

        setattr(g, name, spy)
    return seen


@pytest.fixture
def moved(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Return the ``(root, bytes)`` of every message the transport broadcasts as a list."""
    messages: list[tuple[int, int]] = []
    lock = threading.Lock()
    real = transport.SharedGpu.broadcast_list

    def broadcast_list(self: Any, message: ByteList, root: int, deadline: float) -> None:
        with lock:
            messages.append((root, message.nbytes))
        real(self, message, root, deadline)

    monkeypatch.setattr(transport.SharedGpu, "broadcast_list", broadcast_list)
    return messages


def _tensors(seed: int, fill: bool) -> list[np.ndarray]:
    """Return tensors of many dtypes and sizes: rank ``seed``'s values, or zeros (not ``fill``).

    Among them: one of many mailboxes, an empty one, a 0-d one, a transposed matrix and
    a strided vector (neither contiguous, as the receivers' are too).
    """

    def make(i: int, count: int, dtype: str) -> np.ndarray:
        values = _data(100 * seed + i, count, dtype)
        return values if fill else np.zeros_like(values)

    matrix = make(6, 60, "float64").reshape(6, 10)
    return [
        make(0, 5000, "float32"),  # 20 KB: through 4 KiB mailboxes in many chunks
        make(1, 777, "int64"),
        make(2, 3, "float16"),
        make(3, 10001, "uint8"),
        make(4, 33, "bool"),
        make(5, 0, "int32"),
        matrix.T,
        make(7, 90, "int8")[::3],
        make(8, 1, "float64").reshape(()),
    ]


def _run(world_size: int, fn: Callable[[SharedGpuGroup, int], Any]) -> list[Any]:
    """Run ``fn`` on every rank of a fresh group (see ``run_group``); check the stand-in GPU
    saw no misuse and holds nothing once the group is destroyed."""
    gpu = HostGpu(blocking=True)  # the bulk layer's arrays are plain numpy: see HostGpu
    results = run_group(world_size, fn, gpu)
    assert gpu.misuse == []
    assert gpu.live() == (0, 0)
    return results


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_broadcast_tensors_moves_the_whole_list_as_one_message(
    world_size: int, async_op: bool, moved: list[tuple[int, int]]
) -> None:
    root = world_size - 1

    def fn(g: SharedGpuGroup, rank: int) -> tuple[list[np.ndarray], Seen]:
        assert g.takes_lists
        seen = spied(g)
        tensors = _tensors(root, fill=rank == root)
        work = calls.broadcast_tensors(g, tensors, root, async_op=async_op)
        assert (work is not None) == async_op
        if work is not None:
            work.wait()
        return tensors, seen

    results = _run(world_size, fn)
    want = _tensors(root, fill=True)
    for rank, (got, seen) in enumerate(results):
        assert len(got) == len(want)
        for i, (x, w) in enumerate(zip(got, want, strict=True)):
            assert (x.dtype, x.shape) == (w.dtype, w.shape), (rank, i)
            np.testing.assert_array_equal(x, w, f"rank {rank}, tensors[{i}]")
        (tensors, options), *more = seen.broadcast_list
        assert more == [] and len(tensors) == len(want) and options.root_rank == root
        assert seen.allreduce == [] and seen.broadcast == [], rank
    nbytes = sum(w.nbytes for w in want)
    assert moved == [(root, nbytes)] * world_size


def _reduced(op: ReduceOp, world_size: int) -> list[np.ndarray]:
    """Return what ``op`` over every rank's ``_tensors`` gives, tensor by tensor."""
    every = [_tensors(r, fill=True) for r in range(world_size)]
    reduce: Callable[..., np.ndarray] = np.max if op is ReduceOp.MAX else np.sum
    return [
        reduce(np.stack([ts[i] for ts in every]), axis=0).astype(every[0][i].dtype)
        for i in range(len(every[0]))
    ]


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MAX], ids=lambda op: op.name)
@pytest.mark.parametrize("world_size", [2, 3])
def test_allreduce_tensors_reduces_every_tensor_bucket_by_bucket(
    world_size: int, op: ReduceOp, moved: list[tuple[int, int]]
) -> None:
    def fn(g: SharedGpuGroup, rank: int) -> tuple[list[np.ndarray], Seen]:
        seen = spied(g)
        tensors = [t for t in _tensors(rank, fill=True) if t.dtype != np.bool_]
        calls.allreduce_tensors(g, tensors, op, bucket_bytes=BUCKET)
        return tensors, seen

    results = _run(world_size, fn)
    want = [w for w in _reduced(op, world_size) if w.dtype != np.bool_]
    layout = Listing(None, tuple(w.dtype.name for w in want), tuple(w.shape for w in want))
    bulk_ops = plan(layout.sorted(), BUCKET, BUCKET, typed=True)
    assert any(b.direct for b in bulk_ops) and sum(not b.direct for b in bulk_ops) > 1
    for rank, (got, seen) in enumerate(results):
        for i, (x, w) in enumerate(zip(got, want, strict=True)):
            assert (x.dtype, x.shape) == (w.dtype, w.shape), (rank, i)
            np.testing.assert_array_equal(x, w, f"rank {rank}, tensors[{i}]")
        assert seen.broadcast_list == [] and seen.broadcast == [], rank
        assert len(seen.allreduce) == len(bulk_ops), rank
        for ((buffer,), options), bulk_op in zip(seen.allreduce, bulk_ops, strict=True):
            assert options.reduce_op is op
            assert (buffer.dtype.name, buffer.nbytes) == (bulk_op.dtype, bulk_op.nbytes)
    assert moved == []


@pytest.mark.parametrize("world_size", [2, 3])
def test_broadcast_state_dict_moves_the_whole_dict_as_one_message(
    world_size: int, moved: list[tuple[int, int]]
) -> None:
    """Receivers hold the dict in another order, or none at all (rank 0 of three); then,
    with ``strict=False``, each receiver lacks one of the source's keys and has one more."""
    root = 1
    names = [f"layer{i}.weight" for i in range(len(_tensors(0, fill=False)))]

    def state(fill: bool) -> dict[str, np.ndarray]:
        return dict(zip(names, _tensors(root, fill), strict=True))

    def fn(g: SharedGpuGroup, rank: int) -> tuple[Any, Any, Seen]:
        seen = spied(g)
        if rank == root:
            mine: dict[str, np.ndarray] | None = state(fill=True)
        elif rank == 0 and world_size == 3:
            mine = None
        else:
            mine = dict(reversed(state(fill=False).items()))
        got = calls.broadcast_state_dict(g, mine, root)
        partial = state(fill=rank == root)
        if rank != root:
            del partial[names[2]]
            partial["extra"] = np.full(4, 7, np.int32)
        calls.broadcast_state_dict(g, partial, root, strict=False)
        return (mine if got is None else got), partial, seen

    results = _run(world_size, fn)
    want = state(fill=True)
    for rank, (whole, partial, seen) in enumerate(results):
        assert set(whole) == set(names), rank
        kept = {names[2]} if rank == root else {"extra"}
        assert set(partial) == set(names) - {names[2]} | kept, rank
        for got in (whole, partial):
            for name, x in got.items():
                w = want.get(name, np.full(4, 7, np.int32))  # "extra" is left as it was
                assert (x.dtype, x.shape) == (w.dtype, w.shape), (rank, name)
                np.testing.assert_array_equal(x, w, f"rank {rank}, {name}")
        assert [options.root_rank for _, options in seen.broadcast_list] == [root, root]
        assert [len(tensors) for tensors, _ in seen.broadcast_list] == [len(names)] * 2
        assert seen.allreduce == [], rank
    nbytes = sum(w.nbytes for w in want.values())
    assert moved == [(root, nbytes)] * (2 * world_size)
