"""The ``*_multigpu`` calls on groups whose ranks share GPUs, on stood-in GPUs.

Ranks are threads meeting on a TCPStore, each driving several stood-in GPUs
(``HostGpu``); a buffer is a numpy array that says which of its rank's CUDA ordinals
it is on. A call with ``n`` tensors per rank runs the group of ``world_size * n``
ranks that ``collective.groups.gpu.multigpu`` builds: the real shared-GPU transport
on each stood-in GPU and Gloo on host memory standing in for NCCL among GPUs
(``HostStages``), so every rank's every tensor is checked against what NCCL's
``*_multigpu`` ops write (rank ``r``'s tensor ``i`` is NCCL rank ``r * n + i``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import pytest

from collective.checks.check_args import CheckedGroup
from collective.frameworks.cuda_buffers import CudaBuffer
from collective.groups.gpu.multigpu import Gpus, SeveralGpus
from collective.groups.launches import Prepared
from collective.groups.shared_gpu import transport
from collective.groups.shared_gpu.running import Buffers, SharedGpuRunning
from collective.types import (
    AllGatherOptions,
    AllReduceOptions,
    ArgumentValueError,
    BroadcastOptions,
    CollectiveError,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
)
from collective.work import CompletedWork, Work
from tests.shared_gpu_standin import HostDevice, HostGpu, device_bytes
from tests.test_gpu_hierarchy import run_on_gpus, small_slots
from tests.test_shared_gpu_group import _contiguous_copy, _data, _our_files

__all__ = ["small_slots"]  # the autouse fixture: slots of 8 KiB, so messages take many chunks

TIMEOUT = timedelta(seconds=20)


class OnGpu(np.ndarray):
    """A numpy array standing in for a buffer on CUDA ordinal ``gpu`` of its rank."""

    gpu = 0

    def __array_finalize__(self, obj: Any) -> None:
        self.gpu = getattr(obj, "gpu", 0)


def on(gpu: int, x: np.ndarray) -> OnGpu:
    """Return ``x`` as a buffer on ordinal ``gpu``."""
    y = x.view(OnGpu)
    y.gpu = gpu
    return y


def describe(x: Any, name: str) -> CudaBuffer:
    """Describe ``x`` as ``cuda_buffers.cuda_buffer`` does, on the ordinal it says."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be an array")
    if not x.flags.c_contiguous:
        raise ArgumentValueError(f"{name} is not contiguous")
    device_bytes(x)  # the stand-in GPU knows its memory while it lives
    return CudaBuffer(int(x.ctypes.data), x.size, x.dtype.name, getattr(x, "gpu", 0), x.itemsize)


BUFFERS = Buffers(describe, lambda x: 5, lambda x: False, _contiguous_copy)


def call(group: Any, op: str, args: tuple[Any, ...], options: Any) -> Work:
    """Run ``op`` as ``collective.ops`` runs a call: prepare it, then run it."""
    run, _ = group.prepare(op, args, options)
    return run(lambda: args)


def run_ranks(
    ordinals: list[list[int]],
    fn: Callable[[SharedGpuRunning, int], Any],
    gpus: list[HostGpu] | None = None,
) -> list[Any]:
    """Run ``fn(group, rank)``; rank r's CUDA ordinal k is stood-in GPU ``ordinals[r][k]``.

    Every rank's current GPU (where its group is made) is its ordinal 0.
    """
    found = gpus or [HostGpu(f"gpu-{i}", blocking=True) for i in range(1 + max(map(max, ordinals)))]

    def devices(rank: int) -> Callable[[int], HostDevice]:
        return lambda ordinal: HostDevice(found[ordinals[rank][ordinal]], rank, ordinal)

    def gpus_of(rank: int) -> Gpus:
        return Gpus(devices(rank), lambda ordinal: contextlib.nullcontext())

    def checked(group: Any, rank: int) -> Any:
        assert isinstance(group, SharedGpuRunning)  # or a GpuHierarchyGroup, which is one
        return fn(group, rank)

    return run_on_gpus(
        len(ordinals),
        checked,
        lambda rank: devices(rank)(0),
        buffers=BUFFERS,
        gpus_of=gpus_of,
    )


LAYOUTS = [
    pytest.param([[0, 1], [0, 1]], id="2-ranks-on-2-gpus"),
    pytest.param([[0, 1], [0, 1], [0, 1]], id="3-ranks-on-2-gpus"),
    pytest.param([[0, 1], [0, 2]], id="one-gpu-shared-two-not"),
    pytest.param([[0, 1, 2], [0, 2, 1]], id="ordinals-numbered-apart"),
    pytest.param([[0, 1], [0, 1], [1, 0]], id="group-across-gpus"),
]


@pytest.mark.parametrize("ordinals", LAYOUTS)
def test_every_list_op_writes_what_nccl_writes_on_every_rank(ordinals: list[list[int]]) -> None:
    count, ws, n = 2000, len(ordinals), len(ordinals[0])
    world = ws * n

    def fn(g: SharedGpuRunning, rank: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        v = [rank * n + i for i in range(n)]
        xs = [on(i, _data(v[i], count)) for i in range(n)]
        call(g, "allreduce", (xs,), AllReduceOptions(ReduceOp.SUM))
        out["sum"] = xs
        xs = [on(i, _data(v[i], count, "float64")) for i in range(n)]
        call(g, "allreduce", (xs,), AllReduceOptions(ReduceOp.AVG))
        out["avg"] = xs
        xs = [on(i, _data(v[i], count, "int64")) for i in range(n)]
        call(g, "allreduce", (xs,), AllReduceOptions(ReduceOp.MAX, async_op=True)).wait()
        out["max"] = xs
        xs = [on(i, _data(10 + v[i], count)) for i in range(n)]
        call(g, "reduce", (xs,), ReduceOptions(ReduceOp.SUM, ws - 1, n - 1))
        out["reduce"] = xs
        xs = [on(i, _data(20 + v[i], count, "int32")) for i in range(n)]
        call(g, "broadcast", (xs,), BroadcastOptions(ws - 1, 0))
        out["broadcast"] = xs
        outs = [[on(i, np.zeros(count, np.int32)) for _ in range(world)] for i in range(n)]
        ins = [on(i, _data(30 + v[i], count, "int32")) for i in range(n)]
        call(g, "allgather", (outs, ins), AllGatherOptions())
        out["allgather"] = outs
        results = [on(i, np.zeros(count, np.float32)) for i in range(n)]
        inputs = [[on(i, _data(1000 * v[i] + k, count)) for k in range(world)] for i in range(n)]
        call(g, "reducescatter", (results, inputs), ReduceScatterOptions(ReduceOp.SUM))
        out["reducescatter"] = results
        # the group's own ops still run on its GPU, with one tensor each
        x = on(0, _data(rank, count))
        call(g, "allreduce", ([x],), AllReduceOptions(ReduceOp.SUM))
        out["one"] = x
        return out

    every = range(world)
    for rank, got in enumerate(run_ranks(ordinals, fn)):
        for i in range(n):
            me = rank * n + i
            np.testing.assert_array_equal(
                got["sum"][i], np.sum([_data(v, count) for v in every], 0)
            )
            mean = np.sum([_data(v, count, "float64") for v in every], 0) / world
            np.testing.assert_allclose(got["avg"][i], mean)
            best = np.max([_data(v, count, "int64") for v in every], 0)
            np.testing.assert_array_equal(got["max"][i], best)
            total = np.sum([_data(10 + v, count) for v in every], 0)
            want = total if me == world - 1 else _data(10 + me, count)
            np.testing.assert_array_equal(got["reduce"][i], want)
            root = (ws - 1) * n
            np.testing.assert_array_equal(got["broadcast"][i], _data(20 + root, count, "int32"))
            for k in every:
                np.testing.assert_array_equal(got["allgather"][i][k], _data(30 + k, count, "int32"))
            scattered = np.sum([_data(1000 * v + me, count) for v in every], 0)
            np.testing.assert_array_equal(got["reducescatter"][i], scattered)
        np.testing.assert_array_equal(got["one"], np.sum([_data(r, count) for r in range(ws)], 0))


def test_lists_leave_nothing_once_the_group_is_destroyed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank numbers the GPUs apart: destroying its groups one at a time, each rank
    would wait for the other to unmap the slots of a GPU the other reaches last (up to
    the close wait, made longer than the group's timeout here)."""
    monkeypatch.setattr(transport, "CLOSE_WAIT_S", 60.0)
    gpus = [HostGpu(f"gpu-{i}", blocking=True) for i in range(3)]
    before = _our_files()

    def fn(g: SharedGpuRunning, rank: int) -> float:
        for _ in range(3):  # the groups of a set of devices are built once
            xs = [on(i, _data(rank, 100)) for i in range(3)]
            call(g, "allreduce", (xs,), AllReduceOptions())
        assert isinstance(g.lists, SeveralGpus) and len(g.lists._sets) == 1
        start = time.monotonic()
        g.lists.destroy()
        return time.monotonic() - start

    took = run_ranks([[0, 1, 2], [0, 2, 1]], fn, gpus)
    assert max(took) < TIMEOUT.total_seconds() / 2, took
    assert [gpu.live() for gpu in gpus] == [(0, 0)] * 3
    assert [gpu.misuse for gpu in gpus] == [[]] * 3
    assert _our_files() == before


def test_tensors_on_the_wrong_gpus_are_refused_before_anything_moves() -> None:
    def fn(g: SharedGpuRunning, rank: int) -> str:
        xs = [on(0, _data(rank, 10)), on(0, _data(rank, 10))]
        with pytest.raises(ArgumentValueError, match=r"tensor_list\[0\] and tensor_list\[1\]"):
            call(g, "allreduce", (xs,), AllReduceOptions())
        assert isinstance(g.lists, SeveralGpus) and not g.lists._sets  # nothing was built
        elsewhere = on(1, _data(rank, 10))  # one tensor, on a GPU the group does not run on
        with pytest.raises(ArgumentValueError, match=r"tensor is on cuda:1, but group .* cuda:0"):
            call(g, "allreduce", ([elsewhere],), AllReduceOptions())
        with pytest.raises(ArgumentValueError, match=r"tensor_list\[0\] is on cuda:1"):
            call(
                g,
                "allgather",
                ([[elsewhere, elsewhere]], [on(0, _data(rank, 10))]),
                AllGatherOptions(),
            )
        x = on(0, _data(rank, 10))
        call(g, "allreduce", ([x],), AllReduceOptions())  # the group still works
        return "ok"

    assert run_ranks([[0, 1], [0, 1]], fn) == ["ok", "ok"]


def test_a_per_gpu_list_on_another_gpu_or_of_the_wrong_length_is_refused() -> None:
    def fn(g: SharedGpuRunning, rank: int) -> str:
        ins = [on(i, _data(rank, 10, "int32")) for i in range(2)]
        outs = [[on(i, np.zeros(10, np.int32)) for _ in range(4)] for i in range(2)]
        outs[1][2] = on(0, np.zeros(10, np.int32))
        with pytest.raises(ArgumentValueError, match=r"output_tensor_lists\[1\]\[2\] is on cuda:0"):
            call(g, "allgather", (outs, ins), AllGatherOptions())
        short = [[on(i, np.zeros(10, np.int32)) for _ in range(3)] for i in range(2)]
        with pytest.raises(ArgumentValueError, match=r"world_size \* 2 = 4 tensors, got 3"):
            call(g, "allgather", (short, ins), AllGatherOptions())
        return "ok"

    assert run_ranks([[0, 1], [0, 1]], fn) == ["ok", "ok"]


def test_ranks_that_pass_different_numbers_of_tensors_are_told_on_every_rank() -> None:
    def fn(g: SharedGpuRunning, rank: int) -> str:
        xs = [on(i, _data(rank, 10)) for i in range(2 + rank)]
        with pytest.raises(CollectiveError, match="rank 0 2, rank 1 3") as caught:
            call(g, "allreduce", (xs,), AllReduceOptions())
        return str(caught.value)

    got = run_ranks([[0, 1, 2], [0, 1, 2]], fn)
    assert all("different numbers of tensors" in line for line in got)


def test_a_mismatch_across_ranks_raises_on_every_rank_and_breaks_the_group() -> None:
    def fn(g: SharedGpuRunning, rank: int) -> tuple[str, str]:
        xs = [on(i, _data(rank * 2 + i, 50)) for i in range(2)]
        op = ReduceOp.SUM if rank == 0 else ReduceOp.MAX
        with pytest.raises(CollectiveError) as caught:
            call(g, "allreduce", (xs,), AllReduceOptions(op))
        with pytest.raises(CollectiveError) as after:
            call(g, "allreduce", ([on(0, _data(rank, 5))],), AllReduceOptions())
        return str(caught.value), str(after.value)

    for got, after in run_ranks([[0, 1], [0, 1]], fn):
        assert "SUM" in got and "MAX" in got
        assert "unusable" in after


class _Whole:
    """An NCCL group over the ranks, stood in: records what it was asked to run."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def prepare(self, op: str, args: tuple[Any, ...], options: Any) -> tuple[Prepared, bool]:
        def run(make: Callable[[], tuple[Any, ...]]) -> Work:
            self.calls.append((op, len(make()[0])))
            return CompletedWork()

        return run, True

    def abort(self, reason: str) -> None:
        self.calls.append(("aborted", 0))

    def destroy_group(self) -> None:
        self.calls.append(("destroyed", 0))


def test_tensors_each_on_a_gpu_of_its_own_run_as_one_nccl_group() -> None:
    wholes: list[_Whole] = []

    def fn(g: SharedGpuRunning, rank: int) -> list[tuple[str, int]]:
        lists = g.lists
        assert isinstance(lists, SeveralGpus)
        whole = _Whole()
        wholes.append(whole)
        lists._whole = lambda name, store: whole  # type: ignore[assignment,return-value]
        xs = [on(1, _data(rank, 10)), on(2, _data(rank, 10))]  # GPUs no other rank drives
        call(g, "allreduce", (xs,), AllReduceOptions())
        call(g, "allreduce", (xs,), AllReduceOptions())
        return list(whole.calls)

    got = run_ranks([[0, 1, 2], [0, 3, 4]], fn)
    assert got == [[("allreduce", 2), ("allreduce", 2)]] * 2
    assert all(whole.calls[-2:] == [("aborted", 0), ("destroyed", 0)] for whole in wholes)


def test_a_check_args_group_runs_the_lists_and_refuses_a_mismatch_on_every_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The check's control messages stay in host memory, which the stand-in GPU moves.
    monkeypatch.setattr(CheckedGroup, "_mover", lambda self, like: None)

    def fn(g: SharedGpuRunning, rank: int) -> tuple[list[OnGpu], str]:
        checked = CheckedGroup(g)
        xs = [on(i, _data(rank * 2 + i, 300)) for i in range(2)]
        call(checked, "allreduce", (xs,), AllReduceOptions(ReduceOp.SUM))
        ys = [on(i, _data(rank, 300 + 100 * rank)) for i in range(2)]  # sizes differ
        with pytest.raises(ArgumentValueError) as caught:
            call(checked, "allreduce", (ys,), AllReduceOptions(ReduceOp.SUM))
        return xs, str(caught.value)

    total = np.sum([_data(v, 300) for v in range(4)], 0)
    for xs, error in run_ranks([[0, 1], [0, 1]], fn):
        for x in xs:
            np.testing.assert_array_equal(x, total)
        assert "rank 1" in error
