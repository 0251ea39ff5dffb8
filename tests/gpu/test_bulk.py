"""The bulk calls on a world-size-1 NCCL group, one GPU, without Ray.

``solo`` is registered under its name, so the public functions reach it. At one rank
every result equals the input, so each test first keeps the GPU busy on the caller's
current stream and only then writes the values the call must carry: a call that
packed or unpacked off that stream, or a caller that read the results before the
call's copies, would see the old values. The ``*_multigpu`` functions with lists of
one run on the same group between the bulk calls.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import numpy as np
import pytest

import collective as col
from tests.gpu import cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bool(cases.no_gpu_reason()), reason=cases.no_gpu_reason() or "-"),
    pytest.mark.skipif(
        not cases.no_gpu_reason() and not cases.torch_cuda(),
        reason="these tests keep the GPU busy with torch.cuda._sleep; this torch has no CUDA",
    ),
]

BUSY_CYCLES = 50_000_000
"""GPU clock cycles to spin before the values are written: longer than the calls."""


def _busy(kind: str) -> None:
    """Keep the caller's current stream of ``kind`` busy on GPU 0."""
    import torch

    if kind == "torch":
        torch.cuda._sleep(BUSY_CYCLES)
        return
    import cupy

    current = torch.cuda.ExternalStream(cupy.cuda.get_current_stream().ptr, device=0)
    with torch.cuda.stream(current):
        torch.cuda._sleep(BUSY_CYCLES)


def _buffers(kind: str) -> list[Any]:
    """Return zeroed buffers on GPU 0: big, small, strided, 0-d, bfloat16 where torch."""
    dtypes = ["float32", "float16", "int64", "int8", "float64"]
    if kind == "torch":
        dtypes.append("bfloat16")
    out = [cases.make(kind, np.zeros((64, 48)), dtype, 0) for dtype in dtypes]
    out.append(cases.make(kind, np.zeros((40, 30)), "float32", 0).T)
    out.append(cases.make(kind, np.zeros(()), "int32", 0))
    out.append(cases.make(kind, np.zeros(1 << 18), "float32", 0))
    return out


def _fill(xs: list[Any], offset: int) -> list[np.ndarray]:
    """Write small distinct values into ``xs`` on the current stream; return them on the host."""
    want = []
    for i, x in enumerate(xs):
        values = (np.arange(int(np.prod(x.shape))).reshape(x.shape) + i + offset) % 5 + 1
        x[...] = cases.make(_kind(x), values.astype(np.float64), _dtype(x), 0)
        want.append(values.astype(np.float64))
    return want


def _kind(x: Any) -> str:
    return "torch" if type(x).__module__.startswith("torch") else "cupy"


def _dtype(x: Any) -> str:
    return str(x.dtype).removeprefix("torch.")


def _check(xs: list[Any], want: list[np.ndarray], what: str) -> None:
    for i, (x, w) in enumerate(zip(xs, want, strict=True)):
        np.testing.assert_array_equal(cases.host(x), w, f"{what}: tensor {i}")


@pytest.mark.parametrize("kind", cases.KINDS)
@pytest.mark.parametrize("bucket", [64, None])
def test_bulk_calls_follow_the_callers_stream(solo: Any, kind: str, bucket: int | None) -> None:
    name = solo.group_name
    xs = _buffers(kind)
    _busy(kind)
    want = _fill(xs, 1)
    col.broadcast_tensors(xs, 0, name, bucket_bytes=bucket)
    _check(xs, want, "broadcast_tensors")
    col.allreduce_multigpu([xs[0]], name)
    _busy(kind)
    want = _fill(xs, 2)
    col.allreduce_tensors(xs, name, bucket_bytes=bucket)
    _check(xs, want, "allreduce_tensors")
    _busy(kind)
    want = _fill(xs, 3)
    col.allreduce_tensors(xs, name, col.ReduceOp.MAX, bucket_bytes=bucket)
    _check(xs, want, "allreduce_tensors max")
    col.broadcast_multigpu([xs[1]], 0, 0, name)
    state = {f"p{i}": x for i, x in enumerate(xs)}
    _busy(kind)
    want = _fill(xs, 4)
    assert col.broadcast_state_dict(state, 0, name, bucket_bytes=bucket) is None
    _check(xs, want, "broadcast_state_dict")


@pytest.mark.parametrize("kind", cases.KINDS)
def test_async_bulk_calls_order_the_waiters_stream(solo: Any, kind: str) -> None:
    name = solo.group_name
    xs = _buffers(kind)
    _busy(kind)
    want = _fill(xs, 5)
    work = col.allreduce_tensors(xs, name, bucket_bytes=4096, async_op=True)
    assert work is not None
    work.wait(timedelta(seconds=60))
    assert work.is_completed() and work.exception() is None
    _check(xs, want, "async allreduce_tensors")
    _busy(kind)
    want = _fill(xs, 6)
    work = col.broadcast_tensors(xs, 0, name, async_op=True)
    assert work is not None
    work.wait(timedelta(seconds=60))
    _check(xs, want, "async broadcast_tensors")


def test_mixed_libraries_and_cpu_buffers_are_refused(solo: Any) -> None:
    name = solo.group_name
    xs = _buffers("torch")[:1] + _buffers("cupy")[:1]
    with pytest.raises(ValueError, match=r"tensors\[1\] is a cupy buffer on cuda:0"):
        col.broadcast_tensors(xs, 0, name)
    with pytest.raises(TypeError, match=r"tensors\[0\] must be a cuda tensor"):
        col.allreduce_tensors([np.zeros(3)], name)
