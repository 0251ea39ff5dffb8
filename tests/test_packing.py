"""Packing many buffers into a staging buffer: exact bytes, every kind of buffer, copies in C."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch

from collective.bulk import calls
from collective.frameworks.packing import Batch, Staging
from collective.groups.base import BaseGroup
from collective.types import ReduceOp
from tests.test_shm import run_cpu


def laid_out(xs: list[Any]) -> tuple[list[tuple[int, Any]], int]:
    """Return ``xs`` at increasing offsets aligned to their element size, and the total bytes."""
    items, end = [], 0
    for x in xs:
        size = x.element_size() if isinstance(x, torch.Tensor) else x.itemsize
        offset = -(-end // size) * size
        items.append((offset, x))
        end = offset + (x.numel() if isinstance(x, torch.Tensor) else x.size) * size
    return items, end


def raw(x: Any) -> bytes:
    """Return the bytes of ``x``'s elements in row-major order."""
    if isinstance(x, torch.Tensor):
        x = x.detach().contiguous()
        return x.view(-1).view(torch.uint8).numpy().tobytes() if x.numel() else b""
    return np.ascontiguousarray(x).tobytes()


def fresh_like(x: Any) -> Any:
    """Return a buffer of ``x``'s kind, dtype, shape and strides, filled with other values."""
    if isinstance(x, torch.Tensor):
        out = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype)
        out.view(-1).view(torch.uint8).fill_(0xA5) if out.is_contiguous() else out.zero_()
        return out
    return np.zeros_like(x)


def mixed() -> list[Any]:
    """Return buffers of every kind the bulk calls pack, in an order that leaves gaps."""
    rng = np.random.default_rng(7)
    return [
        torch.randn(3, 5),
        torch.tensor(True),
        torch.randn(4, 6)[:, ::2].to(torch.bfloat16),
        torch.randn(6, 4).t(),
        torch.empty(0, 3),
        torch.tensor(2.5, dtype=torch.float64),
        torch.arange(7, dtype=torch.int8),
        torch.randint(-9, 9, (5,), dtype=torch.int64),
        rng.standard_normal((4, 3)).astype(np.float16),
        rng.standard_normal((5, 4))[::-1],
        rng.integers(0, 2, (9,)).astype(bool)[::2],
        np.zeros((0,), dtype=np.float32),
        torch.randn(2, 3, dtype=torch.float32),
    ]


def test_pack_writes_each_buffer_at_its_offset_and_unpack_restores_it() -> None:
    xs = mixed()
    items, nbytes = laid_out(xs)
    staging = Staging(xs[0], nbytes)
    staging.bytes(0, nbytes)[:] = 0
    batch = Batch(items)
    assert not any(isinstance(x, torch.Tensor) for _, x in batch.rest)
    staging.pack(batch)
    packed = np.asarray(staging.bytes(0, nbytes)).tobytes()
    for offset, x in items:
        assert packed[offset : offset + len(raw(x))] == raw(x)
    ys = [fresh_like(x) for x in xs]
    staging.unpack(Batch([(offset, y) for (offset, _), y in zip(items, ys, strict=True)]))
    for x, y in zip(xs, ys, strict=True):
        assert raw(y) == raw(x)


def test_unpack_writes_read_only_arrays_and_parameters_in_place() -> None:
    parameter = torch.nn.Parameter(torch.zeros(3, 4))
    frozen = np.zeros((2, 5), dtype=np.float32)
    frozen.flags.writeable = False
    matrix = torch.arange(12.0).reshape(3, 4)
    array = np.arange(10, dtype=np.float32).reshape(2, 5)
    source: list[Any] = [matrix, array]
    items, nbytes = laid_out(source)
    staging = Staging(source[0], nbytes)
    staging.pack(items)
    staging.unpack([(items[0][0], parameter), (items[1][0], frozen)])
    assert torch.equal(parameter.detach(), matrix)
    assert parameter.requires_grad and parameter.grad_fn is None
    assert np.array_equal(frozen, array)


def test_offsets_that_overlap_or_break_alignment_raise() -> None:
    with pytest.raises(ValueError, match="byte 4"):
        Batch([(0, torch.zeros(2)), (4, torch.zeros(2))])
    with pytest.raises(ValueError, match="multiple of 4"):
        Batch([(0, torch.zeros(2)), (10, torch.zeros(2))])


@contextmanager
def python_calls() -> Iterator[list[int]]:
    """Count the Python and C function calls this thread makes inside the block."""
    count = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            count[0] += 1

    sys.setprofile(profile)
    try:
        yield count
    finally:
        sys.setprofile(None)


def test_packing_two_thousand_tensors_runs_no_python_per_tensor() -> None:
    xs = [
        torch.randn(4, 8).to(torch.bfloat16 if i % 3 == 0 else torch.float32) for i in range(2000)
    ]
    xs[5] = xs[5].t()
    items, nbytes = laid_out(xs)
    staging = Staging(xs[0], nbytes)
    batch = Batch(items)
    assert len(batch.runs) == 2 and not batch.rest
    with python_calls() as packing:
        staging.pack(batch)
    with python_calls() as unpacking:
        staging.unpack(batch)
    assert packing[0] < 50 and unpacking[0] < 50, (packing, unpacking)


def test_the_bulk_calls_pack_and_unpack_each_bucket_without_python_per_tensor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counts: list[int] = []
    lock = threading.Lock()

    def profiled(copy: Callable[[Staging, Any], None]) -> Callable[[Staging, Any], None]:
        def run(self: Staging, batch: Any) -> None:
            with python_calls() as count:
                copy(self, batch)
            with lock:
                counts.append(count[0])

        return run

    monkeypatch.setattr(Staging, "pack", profiled(Staging.pack))
    monkeypatch.setattr(Staging, "unpack", profiled(Staging.unpack))

    def rank_fn(group: BaseGroup, rank: int) -> bool:
        xs = [torch.full((64,), float(rank + i)) for i in range(1000)]
        calls.allreduce_tensors(group, xs, ReduceOp.SUM, bucket_bytes=1 << 20)
        return all(torch.equal(x, torch.full((64,), float(1 + 2 * i))) for i, x in enumerate(xs))

    assert run_cpu(2, rank_fn) == [True, True]
    assert len(counts) == 2 * 2 and max(counts) < 50, counts
