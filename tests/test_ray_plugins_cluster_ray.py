"""Both Ray plug-ins across two Ray nodes on this machine, with a driver-only change.

The module's two-node cluster is joined with ``runtime_env()``, so every worker
registers the backend and the transport as it starts: the actors never call
this library. Every op of ``ray.util.collective``'s API runs on a group whose ranks
span the nodes (shared memory inside each, Gloo between), and a state dict moves by
Ray Direct Transport from a node to the other, through a group or through the
one-sided shared-memory transport, which a consumer on the other node reads too.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray
import ray.util.collective as rc
import torch
from ray.cluster_utils import Cluster
from ray.experimental.collective import create_collective_group, destroy_collective_group

import collective as col
from collective.ray_plugins.hook import runtime_env
from tests.conftest import (
    RAY_TIMEOUT_S,
    Member,
    live_groups,
    run_all,
    settle_rdt,
    unique_name,
)
from tests.ray_api_ops import WORLD, check_every_op, every_op

BACKEND: Any = "collective"
"""Ray's hints say ``types.Backend``; its calls take the name."""
col.register_tensor_transport()  # before the classes that name it, as Ray asks
col.register_shm_transport()

actor_class: Any = ray.remote
"""Ray's decorator; its stubs know neither ``enable_tensor_transport`` nor actor methods."""


class _Producer:
    @ray.method(tensor_transport="COLLECTIVE")
    def weights(self) -> dict[str, torch.Tensor]:
        return {f"w{i}": torch.full((100 + i,), float(i)) for i in range(50)} | {
            "big": torch.arange(1 << 19, dtype=torch.float32)
        }

    @ray.method(tensor_transport="COLLECTIVE_SHM")
    def shared(self) -> list[torch.Tensor]:
        return [torch.ones(4)]


Producer: Any = actor_class(num_cpus=0)(_Producer)


class _Consumer:
    def check(self, weights: dict[str, torch.Tensor]) -> list[str]:
        wrong = [
            k
            for i in range(50)
            if not torch.equal(weights[k := f"w{i}"], torch.full((100 + i,), float(i)))
        ]
        if not torch.equal(weights["big"], torch.arange(1 << 19, dtype=torch.float32)):
            wrong.append("big")
        return wrong

    def values(self, tensors: list[torch.Tensor]) -> list[list[float]]:
        return [t.tolist() for t in tensors]


Consumer: Any = actor_class(num_cpus=0, enable_tensor_transport=True)(_Consumer)


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[None]:
    """Start a head node and a second node, each with a resource to pin actors by."""
    cluster = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={"num_cpus": 2, "resources": {"node_a": 10}, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=2, resources={"node_b": 10})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="ray-plugins-two-nodes", runtime_env=runtime_env())
    yield
    settle_rdt()
    ray.shutdown()
    cluster.shutdown()


def _node(rank: int) -> str:
    return "node_a" if rank < WORLD // 2 else "node_b"


def _transport(name: str) -> str:
    return col.get_group_handle(rc.get_group_handle(name).cpu_group).transport


def test_every_op_of_rays_api_across_two_nodes(two_nodes: None) -> None:
    actors = [Member.options(resources={_node(r): 1}).remote() for r in range(WORLD)]
    name = unique_name()
    rc.create_collective_group(actors, WORLD, list(range(WORLD)), BACKEND, name)
    check_every_op(run_all(actors, every_op, range(WORLD), [name] * WORLD))
    assert run_all(actors, _transport, [name] * WORLD) == ["hierarchical"] * WORLD
    run_all(actors, rc.destroy_collective_group, [name] * WORLD)
    assert live_groups() == []


def test_a_state_dict_moves_by_rdt_to_the_other_node(two_nodes: None) -> None:
    producer = Producer.options(resources={"node_a": 1}).remote()
    consumer = Consumer.options(resources={"node_b": 1}).remote()
    handle = create_collective_group([producer, consumer], backend="collective")
    for _ in range(2):
        ref = producer.weights.remote()
        assert ray.get(consumer.check.remote(ref), timeout=RAY_TIMEOUT_S) == []
    destroy_collective_group(handle)
    assert live_groups() == []
    # The one-sided transport, with no group, reaches a consumer on the other node too.
    got = ray.get(consumer.values.remote(producer.shared.remote()), timeout=RAY_TIMEOUT_S)
    assert got == [[1.0] * 4]
