"""Fixtures of the GPU tests, without Ray: one group per world size, shared by the session.

``solo`` is a world-size-1 NCCLGroup in this process on GPU 0, on a torch TCPStore,
also registered under its name so that the public functions reach it. ``pair`` and
``trio`` are two and three rank processes, each holding its rank of one group, rank r
on GPU r where there are enough GPUs and otherwise sharing them, each rank claiming a
host of its own for NCCL. ``tests/gpu/run.sh`` runs these tests with
``--confcutdir tests/gpu``, so that the Ray fixtures of ``tests/conftest.py`` are not
loaded where Ray is not installed.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from tests.gpu import cases


@pytest.fixture(scope="session")
def solo() -> Iterator[Any]:
    """Yield a world-size-1 NCCLGroup on GPU 0, registered in this process as its name."""
    reason = cases.no_gpu_reason()
    if reason:
        pytest.skip(reason)
    import cupy
    import torch.distributed as dist

    from collective.groups.nccl.group import NCCLGroup
    from collective.registry import held
    from collective.rendezvous.store import TCPRendezvousStore

    cupy.cuda.Device(0).use()
    store = TCPRendezvousStore(dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60)))
    name = f"gpu-solo-{uuid.uuid4().hex[:8]}"
    group = NCCLGroup(1, 0, name, store, cases.GROUP_TIMEOUT)
    held.create_group(name, lambda: (group, store))
    yield group
    import collective as col

    col.destroy_collective_group(name)


def _pool(world_size: int) -> Iterator[Any]:
    """Yield a pool of ``world_size`` rank processes, each in one NCCLGroup.

    Rank r runs on GPU r where there are enough GPUs; otherwise the ranks share them,
    each claiming a host of its own for NCCL (see ``cases.claim_own_host``).
    """
    reason = cases.no_gpu_reason()
    if reason:
        pytest.skip(reason)
    from benchmarks.nccl_ranks import RankPool

    with RankPool(world_size, timeout=timedelta(seconds=120)) as pool:
        pool.run(cases.open_group, f"gpu-ws{world_size}-{uuid.uuid4().hex[:8]}")
        yield pool
        pool.run(cases.close_group)


@pytest.fixture(scope="session")
def pair() -> Iterator[Any]:
    """Yield a pool of two rank processes in one NCCLGroup (see ``_pool``)."""
    yield from _pool(2)


@pytest.fixture(scope="session")
def trio() -> Iterator[Any]:
    """Yield a pool of three rank processes in one NCCLGroup (see ``_pool``)."""
    yield from _pool(3)
