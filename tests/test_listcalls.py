"""The call path of the ops on several buffers, barrier and the exchange ops (``list_calls``).

Checked and built once per key, then looked up; buffers that now lie otherwise
relative to each other are checked anew. Ranks are threads meeting on a TCPStore
(see ``test_shm.run_cpu``); the spy on the checks wraps the real ``check_call``,
which every op's checks run once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import collective as col
from collective.groups.cpu.group import CpuGroup
from collective.ops import calls
from collective.types import ArgumentValueError, GroupOptions, ReduceOp
from tests.test_calls import _GLOO, registered
from tests.test_shm import run_cpu


@pytest.fixture
def checked_ops(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[int, int]]:
    """Count each thread's calls of the real ``check_call``, which every op's checks run once."""
    counts: dict[int, int] = {}
    real = calls.arguments.check_call

    def spy(*args: Any) -> Any:
        me = threading.get_ident()
        counts[me] = counts.get(me, 0) + 1
        return real(*args)

    monkeypatch.setattr(calls.arguments, "check_call", spy)
    yield counts


@pytest.mark.parametrize("options", [None, _GLOO], ids=["shm", "gloo"])
def test_repeated_allgathers_reducescatters_and_barriers_are_checked_once(
    options: GroupOptions | None, checked_ops: dict[int, int]
) -> None:
    def fn(name: str, group: CpuGroup, rank: int) -> tuple[list[Any], list[int]]:
        x, out = np.zeros(2), np.zeros(2)
        gathered, flat = [np.zeros(2), np.zeros(2)], torch.zeros(4, dtype=torch.float64)
        chunks, flat_in = [np.zeros(2), np.zeros(2)], torch.zeros(4)
        seen, counts = [], []
        for i in range(3):
            x[:] = rank + 10 * i
            col.allgather(gathered, x, name)
            col.allgather(flat, torch.from_numpy(x), name)
            chunks[0][:], chunks[1][:] = rank + i, 2 * rank + i
            col.reducescatter(out, chunks, name)
            flat_in[:] = torch.arange(4.0) + rank + i
            col.reducescatter(flat_in[2 * rank : 2 * rank + 2], flat_in, name, ReduceOp.MAX)
            col.barrier(name)
            seen.append(
                [[g.tolist() for g in gathered], flat.tolist(), out.tolist(), flat_in.tolist()]
            )
            counts.append(checked_ops[threading.get_ident()])
        return seen, counts

    for rank, (seen, counts) in enumerate(run_cpu(2, registered(fn), options=options)):
        assert counts == [5, 5, 5], "each of the five calls is checked on its first call only"
        for i, (gathered, flat, out, flat_in) in enumerate(seen):
            assert gathered == [[10.0 * i] * 2, [1 + 10.0 * i] * 2]
            assert flat == [10.0 * i] * 2 + [1 + 10.0 * i] * 2
            assert out == [(1 + 2 * i) if rank == 0 else (2 + 2 * i)] * 2
            mine = [float(v + rank + i) for v in range(4)]
            mine[2 * rank : 2 * rank + 2] = [
                float(v + 1 + i) for v in range(2 * rank, 2 * rank + 2)
            ]
            assert flat_in == mine, "the result lands in this rank's chunk; the others stay"


def test_buffers_that_now_alias_are_refused_on_a_repeated_call() -> None:
    def fn(name: str, group: CpuGroup, rank: int) -> tuple[list[str], list[float]]:
        a, b, x = np.zeros(2), np.zeros(2), np.full(2, float(rank))
        col.allgather([a, b], x, name)
        errors = []
        with pytest.raises(ArgumentValueError) as raised:
            col.allgather([a, a], x, name)  # same keys as [a, b] but for the address
        errors.append(str(raised.value))
        chunks = [np.full(2, 1.0 + rank), np.full(2, 3.0 + rank)]
        out = np.zeros(2)
        col.reducescatter(out, chunks, name)
        col.reducescatter(chunks[rank], chunks, name)  # the output is one of the inputs
        memory = np.zeros(4)
        halves = [memory[:2], memory[2:]]
        col.reducescatter(halves[0], halves, name)
        with pytest.raises(ArgumentValueError) as raised:
            col.reducescatter(memory[1:3], halves, name)  # a part of two inputs
        errors.append(str(raised.value))
        return errors, out.tolist() + [c for chunk in chunks for c in chunk]

    for rank, (errors, values) in enumerate(run_cpu(2, registered(fn))):
        assert "share memory" in errors[0] and "share memory" in errors[1]
        assert values[:2] == [3.0 + 4.0 * rank] * 2
        mine = [1.0 + rank] * 2 + [3.0 + rank] * 2
        mine[2 * rank : 2 * rank + 2] = [3.0 + 4.0 * rank] * 2
        assert values[2:] == mine, "the result lands in this rank's chunk; the others stay"


def test_a_cached_allgather_on_a_checked_group_still_refuses_another_ranks_error() -> None:
    def fn(name: str, group: CpuGroup, rank: int) -> tuple[list[float], str]:
        x, outs = np.full(2, float(rank)), [np.zeros(2), np.zeros(2)]
        col.allgather(outs, x, name)
        with pytest.raises(ArgumentValueError) as raised:
            col.allgather(outs if rank == 0 else [*outs, np.zeros(2)], x, name)
        col.allgather(outs, x + 1, name)
        return [float(o[0]) for o in outs], str(raised.value)

    for values, message in run_cpu(2, registered(fn, checked=True)):
        assert values == [1.0, 2.0]
        assert "tensor_list must hold 2 tensors" in message


def test_a_flat_buffer_of_another_dtype_is_checked_and_refused_anew() -> None:
    def fn(name: str, group: CpuGroup, rank: int) -> str:
        memory, x = np.zeros(4), np.ones(2)
        col.allgather(memory, x, name)
        with pytest.raises(ArgumentValueError) as raised:
            col.allgather(memory.view(np.int64), x, name)
        return str(raised.value)

    for message in run_cpu(2, registered(fn)):
        assert "int64" in message or "must be a list" in message


@pytest.mark.parametrize("options", [None, _GLOO], ids=["shm", "gloo"])
def test_repeated_gathers_scatters_and_alltoalls_are_checked_once(
    options: GroupOptions | None, checked_ops: dict[int, int]
) -> None:
    def fn(name: str, group: CpuGroup, rank: int) -> tuple[list[Any], list[int]]:
        x, got = np.zeros(2), np.zeros(2)
        gathered = np.zeros(4) if rank == 0 else None
        parts = [np.zeros(2), np.zeros(2)] if rank == 1 else None
        outs, ins = [np.zeros(1), np.zeros(2)], [np.zeros(rank + 1), np.zeros(rank + 1)]
        single_out, single_in = torch.zeros(3 - rank), torch.zeros(2 + rank)
        seen, counts = [], []
        for i in range(3):
            x[:] = rank + 10 * i
            col.gather(x, gathered, 0, name)
            if parts is not None:
                parts[0][:], parts[1][:] = i, i + 1
            col.scatter(got, parts, 1, name)
            ins[0][:], ins[1][:] = 10 * rank + i, 10 * rank + i + 1
            col.alltoall(outs, ins, name)
            single_in[:] = torch.arange(2.0 + rank) + 10 * rank + i
            sizes = [1, 2] if rank == 0 else [1, 1]
            col.alltoall_single(single_out, single_in, sizes, [1 + rank, 1], name)
            seen.append(
                [
                    None if gathered is None else gathered.tolist(),
                    got.tolist(),
                    [o.tolist() for o in outs],
                    single_out.tolist(),
                ]
            )
            counts.append(checked_ops[threading.get_ident()])
        return seen, counts

    for rank, (seen, counts) in enumerate(run_cpu(2, registered(fn), options=options)):
        assert counts == [4, 4, 4], "each of the four calls is checked on its first call only"
        for i, (gathered, got, outs, single) in enumerate(seen):
            assert gathered == (None if rank else [10.0 * i] * 2 + [1 + 10.0 * i] * 2)
            assert got == [float(i + rank)] * 2
            assert outs == [[float(i + rank)], [10.0 + i + rank] * 2]
            if rank == 0:
                assert single == [float(i), 10.0 + i, 11.0 + i]
            else:
                assert single == [1.0 + i, 12.0 + i]


def test_exchange_buffers_that_now_overlap_are_refused_on_a_repeated_call() -> None:
    def fn(name: str, group: CpuGroup, rank: int) -> list[str]:
        x, memory = np.zeros(2), np.zeros(4)
        gathered = [np.zeros(2), np.zeros(2)] if rank == 0 else None
        col.gather(x, gathered, 0, name)
        outs, ins = [np.zeros(2), np.zeros(2)], [np.ones(2), np.ones(2)]
        col.alltoall(outs, ins, name)
        errors = []
        if rank == 0:  # the root's list overlaps its tensor; no other rank runs this gather
            with pytest.raises(ArgumentValueError) as raised:
                col.gather(memory[:2], [memory[:2], memory[2:]], 0, name)
            errors.append(str(raised.value))
        with pytest.raises(ArgumentValueError) as raised:
            col.alltoall([memory[:2], memory[2:]], [memory[2:], np.ones(2)], name)
        errors.append(str(raised.value))
        return errors

    errors = run_cpu(2, registered(fn))
    assert "share memory" in errors[0][0]
    assert all("share memory" in e[-1] for e in errors)


def test_cached_exchange_calls_on_a_checked_group_still_agree_and_async_ones_return_work() -> None:
    def fn(name: str, group: CpuGroup, rank: int) -> tuple[list[float], str]:
        x, outs = np.full(2, float(rank)), [np.zeros(2), np.zeros(2)]
        for _ in range(2):
            col.barrier(name)
            col.alltoall(outs, [x, x], name)
            work = col.allgather(outs, x + 1, name, async_op=True)
            assert work is not None
            work.wait()
        with pytest.raises(ArgumentValueError) as raised:
            col.alltoall(outs, [x, x], name) if rank == 0 else col.barrier(name)
        col.barrier(name)
        return [float(o[0]) for o in outs], str(raised.value)

    for values, message in run_cpu(2, registered(fn, checked=True)):
        assert values == [1.0, 2.0]
        assert "different arguments" in message
