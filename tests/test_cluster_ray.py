"""Two Ray nodes on this machine: a group spans them, and losing a node fails the group fast.

This module starts its own two-node cluster with ``ray.cluster_utils.Cluster``,
so it cannot share the single-node cluster of the other modules.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import ray
from ray.cluster_utils import Cluster

import collective as col
from tests.conftest import (
    RAY_TIMEOUT_S,
    Member,
    allreduce_until_failure,
    our_named_actors,
    run_all,
    unique_name,
)

GROUP_TIMEOUT = timedelta(seconds=20)
DETECT_S = 8.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Cluster, Any]]:
    """Start a head node and a second node, each with a resource to pin actors by."""
    two = Cluster(
        initialize_head=True,
        connect=True,
        head_node_args={"num_cpus": 2, "resources": {"node_a": 10}, "include_dashboard": False},
    )
    second = two.add_node(num_cpus=2, resources={"node_b": 10})
    two.wait_for_nodes()
    yield two, second
    ray.shutdown()
    two.shutdown()


def _members(node: str, count: int) -> list[Any]:
    actors = [Member.options(resources={node: 1}).remote() for _ in range(count)]
    ray.get([a.actor_id.remote() for a in actors], timeout=RAY_TIMEOUT_S)
    return actors


def _init(rank: int, name: str) -> str:
    col.init_collective_group(4, rank, backend="gloo", group_name=name, timeout=GROUP_TIMEOUT)
    return ray.get_runtime_context().get_node_id()


def _allreduce(rank: int, name: str) -> float:
    x = np.full(1000, rank + 1.0)
    col.allreduce(x, name)
    return float(x[0])


def _destroy(name: str) -> bool:
    col.destroy_collective_group(name)
    return col.is_group_initialized(name)


def test_group_spans_two_nodes_and_survives_losing_one(cluster: tuple[Cluster, Any]) -> None:
    two, second = cluster
    actors = _members("node_a", 2) + _members("node_b", 2)
    name = unique_name("span")
    nodes = run_all(actors, _init, range(4), [name] * 4)
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3]
    assert run_all(actors, _allreduce, range(4), [name] * 4) == [10.0] * 4

    refs = [a.run.remote(allreduce_until_failure, name) for a in actors[:2]]
    time.sleep(2.0)
    removed_at = time.time()
    two.remove_node(second)
    outcomes = ray.get(refs, timeout=RAY_TIMEOUT_S)
    for failed_at, kind, message in outcomes:
        assert kind == "CollectiveError", message
        assert name in message and "allreduce" in message, message
        assert failed_at - removed_at < DETECT_S
    print(f"\nnode loss noticed after {[round(o[0] - removed_at, 3) for o in outcomes]} s")
    assert run_all(actors[:2], _destroy, [name] * 2) == [False, False]
    deadline = time.monotonic() + 30
    while our_named_actors() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert our_named_actors() == []
