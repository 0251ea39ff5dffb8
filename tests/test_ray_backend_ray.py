"""Ray's own ``ray.util.collective`` API runs on this library after ``register_ray_backend``.

One local cluster for the module; the actors register the backend themselves, as
Ray's docs show. Every op of Ray's API runs in 4 actors, on groups made with Ray's
``init_collective_group`` in the actors, with Ray's ``create_collective_group`` from
the driver, and with ``ray.experimental.collective.create_collective_group``; every
rank's result is checked. The two-node tests are in ``test_ray_plugins_cluster_ray``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray
import ray.util.collective as rc

import collective as col
from tests.conftest import RAY_TIMEOUT_S, Member, live_groups, run_all, unique_name
from tests.ray_api_ops import WORLD, check_every_op, every_op

BACKEND: Any = "collective"
"""Ray's hints say ``types.Backend``; its calls take the name."""


@pytest.fixture(scope="module")
def actors() -> Iterator[list[Any]]:
    """Start a local cluster with four member actors that registered the backend."""
    ray.init(address="local", num_cpus=2, namespace="ray-backend", include_dashboard=False)
    col.register_ray_backend()
    members = [Member.remote() for _ in range(WORLD)]
    run_all(members, col.register_ray_backend)
    yield members
    ray.shutdown()


def _init_and_run(rank: int, name: str) -> dict[str, Any]:
    rc.init_collective_group(WORLD, rank, backend=BACKEND, group_name=name)
    return every_op(rank, name)


def _transport(name: str) -> dict[str, Any]:
    group = rc.get_group_handle(name)
    return {"cpu": col.get_group_handle(group.cpu_group).transport, "gpu": group.gpu_group}


def _destroy(name: str) -> tuple[bool, bool]:
    inner = rc.get_group_handle(name).cpu_group
    rc.destroy_collective_group(name)
    return rc.is_group_initialized(name), col.is_group_initialized(inner)


def test_every_op_on_a_group_made_in_the_actors(actors: list[Any]) -> None:
    name = unique_name()
    check_every_op(run_all(actors, _init_and_run, range(WORLD), [name] * WORLD))
    transports = run_all(actors, _transport, [name] * WORLD)
    assert transports == [{"cpu": "shm", "gpu": None}] * WORLD
    assert run_all(actors, _destroy, [name] * WORLD) == [(False, False)] * WORLD
    assert live_groups() == []


def test_every_op_on_a_group_declared_by_the_driver(actors: list[Any]) -> None:
    name = unique_name()
    ranks = [2, 0, 3, 1]
    rc.create_collective_group(actors, WORLD, ranks, backend=BACKEND, group_name=name)
    results = run_all(actors, every_op, ranks, [name] * WORLD)
    check_every_op([results[ranks.index(rank)] for rank in range(WORLD)])
    assert run_all(actors, _destroy, [name] * WORLD) == [(False, False)] * WORLD
    assert live_groups() == []


def test_experimental_create_and_destroy_from_the_driver(actors: list[Any]) -> None:
    from ray.experimental.collective import create_collective_group, destroy_collective_group

    handle = create_collective_group(actors, backend=BACKEND, name=unique_name())
    check_every_op(run_all(actors, every_op, range(WORLD), [handle.name] * WORLD))
    destroy_collective_group(handle)
    assert run_all(actors, rc.is_group_initialized, [handle.name] * WORLD) == [False] * WORLD
    assert live_groups() == []


def test_registering_again_is_a_no_op_and_a_taken_name_is_refused(actors: list[Any]) -> None:
    col.register_ray_backend()
    col.register_ray_backend("Collective")
    assert rc.is_backend_available("collective")
    with pytest.raises(ValueError, match="already names Ray's backend"):
        col.register_ray_backend("gloo")
    with pytest.raises(TypeError, match="name must be a str"):
        col.register_ray_backend(3)  # type: ignore[arg-type]
    available = actors[0].run.remote(rc.is_backend_available, "COLLECTIVE")
    assert ray.get(available, timeout=RAY_TIMEOUT_S)
