"""The public API inside Ray actors, where Ray and GPUs are both present.

Each actor has a GPU of its own where there are enough; otherwise the actors share
them (``num_gpus`` a fraction), each claiming a host of its own for NCCL through its
``runtime_env``. Skipped, saying why, without a GPU or without Ray (``tests/gpu/run.sh``
installs Ray offline from ``GPU_WHEELS``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tests.gpu import cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bool(cases.no_gpu_reason()), reason=cases.no_gpu_reason() or "-"),
]


@pytest.fixture(scope="module")
def gpu_ray() -> Iterator[Any]:
    """Start a Ray cluster that offers this machine's GPUs, and stop it afterwards."""
    ray = pytest.importorskip("ray")
    ray.init(
        address="local",
        num_cpus=2,
        num_gpus=cases.gpu_count(),
        namespace="collective-gpu-tests",
        include_dashboard=False,
    )
    yield ray
    ray.shutdown()


def _public_api_ops(world_size: int, rank: int, name: str) -> list[list[float]]:
    import cupy

    import collective as col

    col.init_collective_group(world_size, rank, backend="nccl", group_name=name)
    try:
        x = cupy.asarray(cases.values(rank).reshape(-1)[:8])
        col.allreduce(x, name)
        col.allreduce_multigpu([x], name, op=col.ReduceOp.MAX)
        col.broadcast_multigpu([x], src_rank=0, src_tensor=0, group_name=name)
        outs = [[cupy.zeros(8) for _ in range(world_size)]]
        col.allgather_multigpu(outs, [cupy.full(8, float(rank))], name)
        got = cupy.zeros(8)
        col.reducescatter_multigpu(
            [got], [[cupy.full(8, float(j)) for j in range(world_size)]], name
        )
        peer = cupy.zeros(8)
        if world_size > 1 and rank == 0:
            col.send_multigpu(cupy.full(8, 7.0), 1, 0, name)
        elif world_size > 1 and rank == 1:
            col.recv_multigpu(peer, 0, 0, name)
        col.barrier(name)
        col.synchronize(0)
        rows = [x, *outs[0], got, peer]
        return [cupy.asnumpy(r).tolist() for r in rows]
    finally:
        col.destroy_collective_group(name)


def _actor_options(world_size: int, rank: int) -> dict[str, Any]:
    """Return the options of actor ``rank``: a GPU of its own, or a share and a host of its own."""
    gpus = cases.gpu_count()
    if world_size <= gpus:
        return {"num_gpus": 1}
    env = {"NCCL_HOSTID": f"collective-actor-{rank}", "NCCL_SOCKET_IFNAME": "lo"}
    return {"num_gpus": gpus / world_size, "runtime_env": {"env_vars": env}}


@pytest.mark.parametrize("world_size", [1, 2])
def test_public_api_in_ray_actors(gpu_ray: Any, world_size: int) -> None:
    from tests.conftest import Member, our_named_actors

    actors = [Member.options(**_actor_options(world_size, r)).remote() for r in range(world_size)]
    name = f"nccl-ray-{uuid.uuid4().hex[:8]}"
    refs = [a.run.remote(_public_api_ops, world_size, r, name) for r, a in enumerate(actors)]
    results = gpu_ray.get(refs, timeout=300)
    summed = sum(cases.values(r).reshape(-1)[:8] for r in range(world_size))
    for rank, rows in enumerate(results):
        np.testing.assert_array_equal(rows[0], summed)
        for r in range(world_size):
            assert rows[1 + r] == [float(r)] * 8
        assert rows[1 + world_size] == [float(rank * world_size)] * 8
        assert rows[2 + world_size] == ([7.0] * 8 if world_size > 1 and rank == 1 else [0.0] * 8)
    from collective.rendezvous.actor import IDLE_GRACE_S, SWEEP_S

    # The store actor leaves once it has hosted no group for its idle grace, as after
    # a CPU group's destroy; a new group made within the grace reuses it.
    deadline = time.monotonic() + IDLE_GRACE_S + 5 * SWEEP_S + 10
    while our_named_actors() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert our_named_actors() == []
    for actor in actors:
        gpu_ray.kill(actor)


def _nccl_init(world_size: int, rank: int, name: str) -> int:
    import collective as col

    col.init_collective_group(world_size, rank, backend="nccl", group_name=name)
    return col.get_rank(name)


def _nccl_allreduce(name: str, value: float) -> tuple[int, int, float]:
    import cupy

    import collective as col

    x = cupy.full(16, value, dtype=cupy.float32)
    col.allreduce(x, name)
    return col.get_rank(name), col.get_collective_group_size(name), float(x[0].get())


def _nccl_shrink(name: str) -> int:
    import collective as col

    return col.shrink_group(name)


def _nccl_grow(name: str, world_size: int) -> int:
    import collective as col

    col.grow_group(name, world_size)
    return col.get_rank(name)


def test_an_nccl_group_shrinks_after_a_death_and_grows_back(gpu_ray: Any) -> None:
    """Three rank processes (sharing GPUs where there are fewer): kill one, shrink, grow back.

    The survivors abort the old communicators, never destroying them (a peer is dead),
    and build new ones under the group's next incarnation.
    """
    from tests.conftest import Member

    name = f"nccl-elastic-{uuid.uuid4().hex[:8]}"
    actors = [Member.options(**_actor_options(3, r)).remote() for r in range(3)]
    ranks = gpu_ray.get([a.run.remote(_nccl_init, 3, r, name) for r, a in enumerate(actors)])
    assert ranks == [0, 1, 2]
    sums = gpu_ray.get([a.run.remote(_nccl_allreduce, name, 1.0) for a in actors], timeout=300)
    assert sums == [(r, 3, 3.0) for r in range(3)]
    gpu_ray.kill(actors[1])
    survivors = [actors[0], actors[2]]
    assert gpu_ray.get([a.run.remote(_nccl_shrink, name) for a in survivors], timeout=300) == [
        0,
        1,
    ]
    got = gpu_ray.get(
        [
            a.run.remote(_nccl_allreduce, name, v)
            for a, v in zip(survivors, [1.0, 4.0], strict=True)
        ],
        timeout=300,
    )
    assert got == [(0, 2, 5.0), (1, 2, 5.0)]
    newcomer = Member.options(**_actor_options(3, 3)).remote()
    refs = [a.run.remote(_nccl_grow, name, 3) for a in survivors]
    refs.append(newcomer.run.remote(_nccl_init, 3, 2, name))
    assert gpu_ray.get(refs, timeout=300) == [0, 1, 2]
    everyone = [*survivors, newcomer]
    got = gpu_ray.get(
        [
            a.run.remote(_nccl_allreduce, name, v)
            for a, v in zip(everyone, [1.0, 2.0, 3.0], strict=True)
        ],
        timeout=300,
    )
    assert got == [(r, 3, 6.0) for r in range(3)]
    gpu_ray.get([a.run.remote(col_destroy, name) for a in everyone], timeout=300)
    for actor in [*everyone, actors[1]]:
        gpu_ray.kill(actor)


def col_destroy(name: str) -> None:
    """Destroy group ``name`` in this actor."""
    import collective as col

    col.destroy_collective_group(name)
