"""A group over several GPUs with several ranks on some, on one GPU split into virtual GPUs.

The GPU machines at hand have one GPU. Each rank process here says its GPU is one of
two virtual GPUs of GPU 0 (its UUID with ``/virtual-k`` appended), so the group picks
the hierarchy: the shared-GPU transport among the ranks of each virtual GPU, and NCCL
among the two leaders and between ranks of different virtual GPUs. NCCL refuses two
ranks of one communicator on one GPU, so every rank claims a host of its own
(``NCCL_HOSTID``) and NCCL runs over its sockets: right results, no speed worth
measuring. Every op, kind and dtype at world size 4 (interleaved: ranks 0 and 2 on one
virtual GPU), float32 at world size 3 (two ranks and one); send and recv on one virtual
GPU and across. No Ray.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import numpy as np
import pytest

from tests.gpu import cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bool(cases.no_gpu_reason()), reason=cases.no_gpu_reason() or "-"),
]

LAYOUTS = {3: [0, 0, 1], 4: [0, 1, 0, 1]}
"""The virtual GPU of each rank, per world size."""

_GROUP: list[Any] = []
"""The group of the rank in this process, between jobs."""


def open_hierarchy(context: Any, name: str) -> str:
    """Build this rank's group ``name`` on its virtual GPU of GPU 0; say its transport."""
    import cupy

    from collective.groups.gpu.connect import connect_gpu_group
    from collective.groups.shared_gpu.device import CudaDevice

    class VirtualGpu(CudaDevice):
        """GPU 0, under the name of virtual GPU ``k`` of it."""

        def uuid(self) -> str:
            return f"{super().uuid()}/virtual-{LAYOUTS[context.world_size][context.rank]}"

    cases.claim_own_host(context.rank)
    cupy.cuda.Device(0).use()
    if cases.torch_cuda():
        import torch

        torch.cuda.set_device(0)
    group = connect_gpu_group(
        context.world_size,
        context.rank,
        name,
        context.store,
        cases.GROUP_TIMEOUT,
        device=VirtualGpu(cupy),
        cupy=cupy,
    )
    _GROUP[:] = [group]
    return str(group.transport)


def close_hierarchy(context: Any) -> None:
    """Destroy this rank's group."""
    _GROUP.pop().destroy_group()


def op_on_rank(context: Any, op: str, kind: str, dtype: str, async_op: bool) -> list[np.ndarray]:
    """Run ``cases.run_op`` on this rank's group."""
    return cases.run_op(_GROUP[0], 0, op, kind, dtype, async_op)


@pytest.fixture(scope="module", params=[3, 4], ids=["ws3", "ws4"])
def hierarchy(request: pytest.FixtureRequest) -> Iterator[Any]:
    """Yield a pool of ranks on two virtual GPUs of GPU 0, in one group."""
    from benchmarks.nccl_ranks import RankPool

    world_size = request.param
    with RankPool(world_size, timeout=timedelta(seconds=180)) as pool:
        name = f"hier-ws{world_size}-{uuid.uuid4().hex[:8]}"
        transports = pool.run(open_hierarchy, name)
        assert transports == ["shared_gpu+nccl"] * world_size, transports
        yield pool
        pool.run(close_hierarchy)


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize(("op", "kind", "dtype"), cases.op_cases())
def test_op(hierarchy: Any, op: str, kind: str, dtype: str, async_op: bool) -> None:
    if kind == "torch" and not cases.torch_cuda():
        pytest.skip("this torch build has no CUDA")
    if async_op and dtype != "float32":
        pytest.skip("async ops take float32")
    if hierarchy.world_size == 3 and dtype != "float32":
        pytest.skip("world size 3 takes float32")
    cases.check(op, dtype, hierarchy.run(op_on_rank, op, kind, dtype, async_op))


def send_recv_on_rank(context: Any, count: int) -> dict[int, list[float]]:
    """Every pair of ranks swaps ``count`` floats, lower rank first; return what arrived."""
    import cupy

    from collective.types import RecvOptions, SendOptions

    group, rank, got = _GROUP[0], context.rank, {}
    for peer in range(context.world_size):
        if peer == rank:
            continue
        mine = cupy.arange(count, dtype=cupy.float32) + 100 * rank + peer
        theirs = cupy.zeros(count, dtype=cupy.float32)
        if rank < peer:
            group.send([mine], SendOptions(dst_rank=peer))
            group.recv([theirs], RecvOptions(src_rank=peer))
        else:
            group.recv([theirs], RecvOptions(src_rank=peer))
            group.send([mine], SendOptions(dst_rank=peer))
        got[peer] = cupy.asnumpy(theirs)[:4].tolist()
    return got


@pytest.mark.parametrize("count", [8, 3 << 20], ids=["8-floats", "12MiB"])
def test_send_recv_on_one_virtual_gpu_and_across(hierarchy: Any, count: int) -> None:
    for rank, got in enumerate(hierarchy.run(send_recv_on_rank, count)):
        for peer, values in got.items():
            assert values == [float(100 * peer + rank + i) for i in range(4)], (rank, peer)
