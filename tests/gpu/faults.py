"""Jobs that break a rank process's CUDA state: a device-side error, a free after destroy.

Each runs in a fresh rank process (``RankPool(1)``): a sticky CUDA error ruins the
process's CUDA context, and torch recording on a dead stream may abort the process,
which the pool then reports as a failed rank.
"""

from __future__ import annotations

import time
import warnings
from datetime import timedelta
from typing import Any

from benchmarks.nccl_ranks import RankContext
from collective.types import AllGatherOptions, AllReduceOptions
from tests.gpu import cases


def _group(context: RankContext, name: str) -> Any:
    import cupy
    import torch

    from collective.groups.nccl.group import NCCLGroup

    cupy.cuda.Device(0).use()
    torch.cuda.set_device(0)
    return NCCLGroup(1, 0, f"{name}-{context.rank}", context.store, cases.GROUP_TIMEOUT)


def free_after_destroy_on_rank(context: RankContext) -> list[str]:
    """Use torch tensors in ops, destroy the group, then free them; return any trouble seen.

    torch records an event on the group's comm stream when it frees a block that an
    op used, so the comm stream must outlive the group. Returns the warnings raised
    meanwhile, and a note if a later allocation computes a wrong sum.
    """
    import torch

    group = _group(context, "free-after-destroy")
    with torch.cuda.stream(torch.cuda.Stream(device=0)):
        x = torch.ones(1 << 20, device="cuda:0")
        outs = [torch.zeros(1 << 20, device="cuda:0")]
        group.allreduce([x], AllReduceOptions())
        group.allgather([outs], [x], AllGatherOptions(async_op=True)).wait(cases.WAIT)
    group.destroy_group()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        del x, outs
        torch.cuda.synchronize()
        y = torch.ones(1 << 21, device="cuda:0")  # may take the freed blocks
        total = float(y.sum())
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
    trouble = [str(w.message) for w in seen]
    return trouble if total == float(1 << 21) else [*trouble, f"a later sum is {total}"]


def device_error_on_rank(context: RankContext, busy_cycles: int) -> tuple[str, str, float, bool]:
    """Wait for an allreduce queued behind a device-side assert; report how it ended.

    The GPU sleeps ``busy_cycles`` first, so the op is launched before the assert
    fires and its wait sees the sticky error in its event query. Returns the wait's
    error type and message, how long the wait took, and whether the group broke.
    """
    import torch

    group = _group(context, "device-error")
    x = torch.ones(4, device="cuda:0")
    group.allreduce([x], AllReduceOptions())
    torch.cuda.synchronize(0)
    torch.cuda._sleep(busy_cycles)
    index = torch.tensor([10], device="cuda:0")
    torch.zeros(4, device="cuda:0")[index]  # out of bounds: a device-side assert, later
    work = group.allreduce([x], AllReduceOptions(async_op=True))
    start = time.monotonic()
    error, message = cases.wait_outcome(work, timedelta(seconds=60))
    took = time.monotonic() - start
    broken = group.error is not None
    try:
        group.destroy_group()
    except Exception as exc:  # the CUDA context is gone; say so, but report the wait
        message += f" (destroy_group then raised {type(exc).__name__})"
    return error, message, took, broken
