"""Ranks that share one GPU and switch streams between ops: the GPU review's H2.

Two rank processes on GPU 0 run three broadcasts (roots 0, 1, 0). Rank 1 runs the
first on stream A behind a kernel that spins about a second, the next two on stream
B; rank 0 runs all three on one stream. Rank 0's third broadcast writes its slots
again: it must wait for rank 1's reads of the first, still queued on A, or rank 1's
first output holds the third's bytes. Every rank's every output is checked byte for
byte.

On CUDA, rank 0's first step waits for rank 1's arrival, recorded on A behind the
kernel and just ahead of its reads: what is left to race is rank 1's last reads of the
first broadcast, so an unordered build may pass here by luck. The stand-in test of the
same scenario (``tests/test_shared_gpu_streams.py``) holds the reads back and fails
without the ordering every time.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import numpy as np
import pytest

from tests.gpu import cases
from tests.gpu.test_shared_gpu import _SHARED, close_shared, open_shared

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bool(cases.no_gpu_reason()), reason=cases.no_gpu_reason() or "-"),
]

ROOTS = (0, 1, 0)
SPIN_CYCLES = 2_000_000_000
"""About a second of a GPU's clock."""


def pattern(op: int, nbytes: int) -> np.ndarray:
    """Return the bytes broadcast ``op`` sends: different for every op and offset."""
    return ((np.arange(nbytes, dtype=np.int64) * 7 + 31 * op + 1) % 251).astype(np.uint8)


def three_broadcasts_on_rank(context: Any, slot_bytes: int) -> list[bool]:
    """Run the three broadcasts on this rank's streams; return whether each output is exact."""
    import cupy

    from collective.types import BroadcastOptions

    group, rank = _SHARED[0], context.rank
    sizes = (3 * slot_bytes, 2 * slot_bytes, 2 * slot_bytes)
    outs = [
        cupy.asarray(pattern(op, n)) if rank == root else cupy.zeros(n, cupy.uint8)
        for op, (n, root) in enumerate(zip(sizes, ROOTS, strict=True))
    ]
    cupy.cuda.Device(0).synchronize()
    a, b = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    streams = (a, b, b) if rank == 1 else (a, a, a)
    if rank == 1:
        spin = cupy.RawKernel(
            'extern "C" __global__ void spin(long long n) '
            "{ long long t = clock64(); while (clock64() - t < n) {} }",
            "spin",
        )
        with a:
            spin((1,), (1,), (np.int64(SPIN_CYCLES),))
    for out, root, stream in zip(outs, ROOTS, streams, strict=True):
        with stream:
            group.broadcast([out], BroadcastOptions(root_rank=root))
    cupy.cuda.Device(0).synchronize()
    got = [cupy.asnumpy(out) for out in outs]
    return [bool(np.array_equal(g, pattern(op, g.size))) for op, g in enumerate(got)]


@pytest.fixture(scope="module")
def pair() -> Iterator[Any]:
    """Yield two rank processes sharing GPU 0 in one group."""
    from benchmarks.nccl_ranks import RankPool

    with RankPool(2, timeout=timedelta(seconds=120)) as pool:
        transports = pool.run(open_shared, f"streams-{uuid.uuid4().hex[:8]}")
        assert transports == ["shared_gpu"] * 2, transports
        yield pool
        pool.run(close_shared)


def test_three_broadcasts_on_alternating_streams_behind_a_long_kernel(pair: Any) -> None:
    from collective.groups.shared_gpu.transport import slot_bytes_for

    results = pair.run(three_broadcasts_on_rank, slot_bytes_for(2))
    assert results == [[True, True, True]] * 2, results
