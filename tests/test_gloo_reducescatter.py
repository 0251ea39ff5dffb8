"""GlooGroup's reducescatter past its size thresholds, and the scratch buffer it reuses.

The small-size cases, every dtype and every reduction, are in test_gloo_group.py and
test_gloo_exchange.py. Here the chunks are big enough that the scratch is mapped by
itself (``HUGE_PAGE_BYTES``), the inputs come both as views of one buffer (sent as
they are) and as separate buffers (copied into the scratch first), and two ops are in
flight at once, so the second cannot borrow the first one's scratch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from collective.groups.gloo.group import GlooGroup
from collective.groups.gloo.reducescatter import HUGE_PAGE_BYTES, Scratch, flat_bytes
from collective.types import ReduceOp, ReduceScatterOptions
from tests.test_gloo_group import run_ranks

CHUNK = HUGE_PAGE_BYTES // 4
"""float32 elements per chunk: every op's scratch is at least twice ``HUGE_PAGE_BYTES``."""


def _input(rank: int, world_size: int) -> np.ndarray:
    """Return rank's input: element k is ``k + rank``, exact in float32 and int32."""
    return np.arange(world_size * CHUNK, dtype=np.float32) + rank


@pytest.mark.parametrize("world_size", [2, 3])
def test_big_reducescatters_in_flight_together_flat_and_listed(world_size: int) -> None:
    def fn(group: GlooGroup, rank: int) -> dict[str, Any]:
        flat = torch.from_numpy(_input(rank, world_size))
        views = list(flat.view(world_size, CHUNK).unbind(0))
        separate = [v.clone() for v in views]
        as_int = _input(rank, world_size).astype(np.int32)
        numpy_views = np.split(as_int, world_size)
        outs: list[Any] = [torch.empty(CHUNK), torch.empty(CHUNK), np.empty(CHUNK, np.int32)]
        works = [
            group.reducescatter([outs[0]], [views], ReduceScatterOptions(async_op=True)),
            group.reducescatter(
                [outs[1]], [separate], ReduceScatterOptions(ReduceOp.MAX, async_op=True)
            ),
            group.reducescatter([outs[2]], [numpy_views], ReduceScatterOptions(async_op=True)),
        ]
        for work in reversed(works):
            work.wait()
        again = torch.empty(CHUNK)
        group.reducescatter([again], [views], ReduceScatterOptions(ReduceOp.MIN))
        untouched = np.array_equal(flat.numpy(), _input(rank, world_size))
        untouched &= all(torch.equal(a, b) for a, b in zip(views, separate, strict=True))
        untouched &= np.array_equal(as_int, _input(rank, world_size).astype(np.int32))
        return {
            "sum": outs[0].numpy(),
            "max": outs[1].numpy(),
            "int sum": outs[2],
            "min": again.numpy(),
            "untouched": untouched,
        }

    results = run_ranks(world_size, fn)
    n = world_size
    for rank, result in enumerate(results):
        mine = np.arange(rank * CHUNK, (rank + 1) * CHUNK, dtype=np.float64)
        where = f"rank {rank} of {n}"
        assert result["untouched"], f"{where}: an input changed"
        np.testing.assert_array_equal(result["sum"], n * mine + n * (n - 1) / 2, where)
        np.testing.assert_array_equal(result["max"], mine + n - 1, where)
        np.testing.assert_array_equal(result["int sum"], n * mine + n * (n - 1) // 2, where)
        np.testing.assert_array_equal(result["min"], mine, where)


def test_scratch_is_lent_to_one_op_at_a_time_and_kept_up_to_its_limit() -> None:
    scratch = Scratch(keep_bytes=1 << 20)
    first = scratch.take(1000)
    busy = scratch.take(1000)
    assert busy.tensor.data_ptr() != first.tensor.data_ptr(), "a lent buffer was lent again"
    busy.release()
    first.release()
    again = scratch.take(500)
    assert again.tensor.data_ptr() == first.tensor.data_ptr(), "the kept buffer was not reused"
    assert again.tensor.numel() == 500
    again.release()
    grown = scratch.take(HUGE_PAGE_BYTES // 4)
    assert grown.tensor.data_ptr() != first.tensor.data_ptr(), "a too small buffer was lent"
    grown.release()
    assert scratch.take(1000).tensor.data_ptr() == grown.tensor.data_ptr(), "grown not kept"
    scratch = Scratch(keep_bytes=1 << 20)
    big = scratch.take(HUGE_PAGE_BYTES)
    big.tensor.fill_(7)
    assert int(big.tensor[-1]) == 7
    big.release()
    assert scratch.take(HUGE_PAGE_BYTES).tensor.data_ptr() != big.tensor.data_ptr(), (
        "a buffer above keep_bytes was kept"
    )


def test_flat_bytes_spans_adjacent_chunks_of_any_sizes_and_refuses_the_rest() -> None:
    base = torch.arange(16, dtype=torch.int32)
    uneven = [base[:1], base[1:1], base[1:3], base[3:16]]
    flat = flat_bytes(uneven)
    assert flat is not None and flat.data_ptr() == base.data_ptr()
    assert torch.equal(flat, base.view(torch.uint8)), "uneven adjacent chunks"
    same_stride = [base[:4], base[4:8], base[8:16]]
    spanned = flat_bytes(same_stride)
    assert spanned is not None and spanned.numel() == 64, "a longer last chunk was cut short"
    assert flat_bytes([base[:4], base[8:12]]) is None, "a gap was bridged"
    assert flat_bytes([base[4:8], base[:4]]) is None, "chunks out of order were joined"
    assert flat_bytes([base[:4], base[4:8].clone()]) is None, "separate buffers were joined"
    assert flat_bytes([base.view(4, 4).t()[0]]) is None, "a strided chunk was taken"
    empty = flat_bytes([base[:0], base[:0]])
    assert empty is not None and empty.numel() == 0
