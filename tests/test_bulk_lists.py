"""Bulk broadcasts on one node move the caller's tensors as one message: no staging, no buckets.

A group whose ranks all share memory (``takes_lists``) gets a broadcast's whole list
of tensors in one op that streams them through the arena back to back; the tests
check the cut of a list into slots, that the path is taken (no staging buffer, one
op), and its results against numpy where a slot holds the ends of many tensors.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from collective.bulk import calls
from collective.frameworks.bytelist import ByteList, address, byte_runs
from collective.frameworks.packing import Staging
from collective.groups.base import BaseGroup
from collective.groups.cpu.group import CpuGroup
from tests.test_gloo_group import run_ranks
from tests.test_shm import run_cpu


def test_a_list_is_cut_into_slots_end_to_end() -> None:
    datas = [np.zeros(n, np.uint8) for n in (5, 0, 3, 9, 1)]
    steps = ByteList.of(datas).cut(4)
    base = {address(d): i for i, d in enumerate(datas) if d.size}

    def where(piece: tuple[int, int, int]) -> tuple[int, int, int, int]:
        at, offset, size = piece
        i = max((b for b in base if b <= at), key=lambda b: b)
        return base[i], at - i, at - i + size, offset

    spans = [[where(p) for p in s] for s in steps]
    assert spans == [
        [(0, 0, 4, 0)],
        [(0, 4, 5, 0), (2, 0, 3, 1)],
        [(3, 0, 4, 0)],
        [(3, 4, 8, 0)],
        [(3, 8, 9, 0), (4, 0, 1, 1)],
    ]
    assert ByteList.of([]).cut(4) == [[]]
    assert ByteList.of([np.zeros(0, np.uint8)]).cut(4) == [[]]
    assert [len(s) for s in ByteList.of([np.zeros(8, np.uint8)]).cut(4)] == [1, 1]


def test_a_byte_list_takes_only_flat_contiguous_bytes() -> None:
    with pytest.raises(ValueError, match="flat contiguous uint8"):
        ByteList.of([np.zeros(8, np.uint8)[::2]])
    with pytest.raises(ValueError, match="flat contiguous uint8"):
        ByteList.of([np.zeros(2, np.int32)])


def test_tensors_back_to_back_in_memory_make_one_run() -> None:
    flat = torch.arange(100, dtype=torch.float32)
    parts = [flat[0:10], flat[10:30], flat[30:30], flat[30:50], flat[60:70], flat[70:100]]
    runs = byte_runs(parts)
    assert [len(v) for v in runs] == [50 * 4, 40 * 4]
    runs[1][:] = 0
    assert flat[60:].eq(0).all() and flat[:60].ne(0).sum() == 59
    tied = byte_runs([flat[:10], flat[:10]])
    assert [len(v) for v in tied] == [40, 40]


def _many(rank: int, count: int) -> list[Any]:
    """Return ``count`` tensors of odd sizes and dtypes, some not contiguous; rank 0's are set."""
    rng = np.random.default_rng(count)
    out: list[Any] = []
    for i in range(count):
        n = int(rng.integers(0, 40))
        value = float(i + 1) if rank == 0 else 0.0
        if i % 5 == 4:
            out.append(torch.full((3, n), value).t())
        elif i % 5 == 3:
            out.append(np.full(n, value, dtype=np.int32))
        else:
            out.append(torch.full((n,), value, dtype=torch.bfloat16 if i % 2 else torch.float64))
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_shared_memory_broadcast_moves_the_list_in_one_op_without_staging(
    world_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[int] = []
    monkeypatch.setattr(Staging, "__init__", lambda self, like, n: made.append(n))
    ops: list[int] = []
    real = CpuGroup.broadcast

    def counted(*args: Any) -> Any:
        ops.append(1)
        return real(*args)

    def fn(group: BaseGroup, rank: int) -> list[str]:
        monkeypatch.setattr(type(group), "broadcast", counted)
        assert group.takes_lists
        xs = _many(rank, 300)
        calls.broadcast_tensors(group, xs, 0)
        want = _many(0, 300)
        return [
            f"tensors[{i}]"
            for i, (x, w) in enumerate(zip(xs, want, strict=True))
            if not np.array_equal(np.asarray(_host(x)), np.asarray(_host(w)))
        ]

    assert run_cpu(world_size, fn, slot_bytes=256) == [[]] * world_size
    assert made == [] and ops == [], (made, ops)


def _host(x: Any) -> Any:
    return x.float().numpy() if isinstance(x, torch.Tensor) else x


def test_groups_over_tcp_do_not_take_lists() -> None:
    def fn(group: BaseGroup, rank: int) -> bool:
        return group.takes_lists

    assert run_ranks(2, fn) == [False, False]
    assert run_cpu(4, fn, nodes=["a", "a", "b", "b"]) == [False] * 4
