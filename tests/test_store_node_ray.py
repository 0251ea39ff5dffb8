"""Where the store actor lives on two Ray nodes, and what its members hear when it is gone.

The store actor is pinned to the node of the job's driver, whichever process first
makes it, so that losing another node leaves the survivors their rendezvous. Its
loss is a ``CollectiveError`` that says so, whatever Ray raised. This module starts
its own two-node cluster (the fixture of ``test_cluster_ray``).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster

import collective as col
from collective.rendezvous import client
from collective.rendezvous.actor import STORE_ACTOR_NAME
from tests.conftest import RAY_TIMEOUT_S, run_all, unique_name
from tests.test_cluster_ray import _members, cluster  # noqa: F401  (the module's cluster)

TIMEOUT = timedelta(seconds=20)


def _init(world_size: int, rank: int, name: str) -> str:
    col.init_collective_group(world_size, rank, backend="gloo", group_name=name, timeout=TIMEOUT)
    return ray.get_runtime_context().get_node_id()


def _store_node() -> str:
    store = ray.get_actor(STORE_ACTOR_NAME)
    return ray._private.state.actors(actor_id=store._ray_actor_id.hex())["Address"]["NodeID"]


def _shrink_outcome(name: str) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        col.shrink_group(name, timeout=TIMEOUT)
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "returned", "", time.monotonic() - start


def test_the_store_sits_on_the_drivers_node_when_actors_elsewhere_make_it(
    cluster: tuple[Cluster, Any],  # noqa: F811
) -> None:
    """Issue 27 item 8: actors on the second node make the store; it lands on the driver's."""
    assert STORE_ACTOR_NAME not in ray.util.list_named_actors()
    actors = _members("node_b", 2)
    name = unique_name("pinned")
    nodes = run_all(actors, _init, [2, 2], [0, 1], [name, name])
    driver = ray.get_runtime_context().get_node_id()
    assert nodes[0] == nodes[1] != driver
    assert _store_node() == driver
    run_all(actors, col.destroy_collective_group, [name, name])
    for actor in actors:
        ray.kill(actor)


def test_members_that_lose_the_store_are_told_it_is_gone_and_what_to_do(
    cluster: tuple[Cluster, Any],  # noqa: F811
) -> None:
    """Issue 27 item 8: a killed store is a clear CollectiveError on shrink, not a raw Ray one."""
    actors = [*_members("node_a", 1), *_members("node_b", 1)]
    name = unique_name("storegone")
    run_all(actors, _init, [2, 2], [0, 1], [name, name])
    ray.kill(ray.get_actor(STORE_ACTOR_NAME), no_restart=True)
    outcomes = ray.get([a.run.remote(_shrink_outcome, name) for a in actors], timeout=RAY_TIMEOUT_S)
    for kind, message, took in outcomes:
        assert kind == "CollectiveError", outcomes
        assert f"the rendezvous store of group {name!r} is gone" in message, outcomes
        assert "destroy the group on every member and create it again" in message, outcomes
        assert took < TIMEOUT.total_seconds() / 2, outcomes
    run_all(actors, col.destroy_collective_group, [name, name])
    for actor in actors:
        ray.kill(actor)


class _OutOfMemory:
    """A store actor handle whose every call ends as Ray's OOM killer ends it."""

    def __getattr__(self, method: str) -> Any:
        return self

    def remote(self, *args: Any) -> Any:
        return self

    def future(self) -> Any:
        return self

    def result(self, timeout: float) -> Any:
        raise ray.exceptions.OutOfMemoryError(
            "Task was killed due to the node running low on memory"
        )


def test_a_store_killed_for_memory_is_the_same_clear_error() -> None:
    """Issue 27 item 8: Ray's OutOfMemoryError (a fault we cannot cause here) does not escape."""
    with pytest.raises(col.CollectiveError, match="rendezvous store of group 'g' is gone"):
        client.call(_OutOfMemory(), "get", group="g")
