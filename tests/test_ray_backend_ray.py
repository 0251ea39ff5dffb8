"""Ray's own ``ray.util.collective`` API runs on this library after ``register_ray_backend``.

One Ray job on the local cluster for the module; the actors register the backend
themselves, as Ray's docs show. Every op of Ray's API runs in 4 actors, on groups made with Ray's
``init_collective_group`` in the actors, with Ray's ``create_collective_group`` from
the driver, and with ``ray.experimental.collective.create_collective_group``; every
rank's result is checked; the ``gloo_timeout`` given to Ray bounds the group's waits.
The two-node tests are in ``test_ray_plugins_cluster_ray``.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import ray.util.collective as rc
import torch

import collective as col
from collective.ray_plugins.backend import TIMEOUT_ENV, RayGroup, gloo_timeout
from tests.conftest import (
    RAY_TIMEOUT_S,
    Member,
    SharedCluster,
    live_groups,
    run_all,
    unique_name,
)
from tests.ray_api_ops import WORLD, check_every_op, every_op

BACKEND: Any = "collective"
"""Ray's hints say ``types.Backend``; its calls take the name."""


@pytest.fixture(scope="module")
def actors(shared_cluster: SharedCluster) -> Iterator[list[Any]]:
    """Join the local cluster with four member actors that registered the backend."""
    shared_cluster.connect(namespace="ray-backend")
    col.register_ray_backend()
    members = [Member.remote() for _ in range(WORLD)]
    run_all(members, col.register_ray_backend)
    yield members
    shared_cluster.disconnect()


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


def _alone_in_an_op(rank: int, name: str, made_in_actor: bool) -> tuple[float, str, float]:
    """Join group ``name`` (gloo_timeout 3000 ms); rank 0 allreduces, rank 1 never does.

    Returns the group's timeout in s, and on rank 0 the error's type and when it came.
    """
    if made_in_actor:
        rc.init_collective_group(2, rank, backend=BACKEND, group_name=name, gloo_timeout=3000)
    group = rc.get_group_handle(name)  # builds a group declared by the driver
    timeout = col.get_group_handle(group.cpu_group).timeout.total_seconds()
    if rank == 1:
        return timeout, "", 0.0
    start = time.monotonic()
    try:
        rc.allreduce(torch.ones(4), name)
    except Exception as exc:
        return timeout, type(exc).__name__, time.monotonic() - start
    return timeout, "no error", time.monotonic() - start


@pytest.mark.parametrize("made_in_actor", [True, False], ids=["init", "declared"])
def test_gloo_timeout_given_to_ray_bounds_every_wait(
    actors: list[Any], made_in_actor: bool
) -> None:
    name, pair = unique_name(), actors[:2]
    if not made_in_actor:
        rc.create_collective_group(pair, 2, [0, 1], BACKEND, name, gloo_timeout=3000)
    results = run_all(pair, _alone_in_an_op, [0, 1], [name] * 2, [made_in_actor] * 2)
    assert [r[0] for r in results] == [3.0, 3.0]
    _, error, seconds = results[0]
    assert error == "CollectiveTimeoutError"
    assert 2.9 <= seconds < 15, seconds  # the 3 s timeout, not Ray's default of 30 s
    assert run_all(pair, _destroy, [name] * 2) == [(False, False)] * 2
    assert live_groups() == []


def _built_by_hand(name: str) -> tuple[list[str], list[float]]:
    """Build two one-rank ``RayGroup``s outside Ray, with collective_gloo_timeout set."""
    os.environ[TIMEOUT_ENV] = "4000"
    seconds = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for suffix in ("a", "b"):
                group = RayGroup(1, 0, name + suffix)
                seconds.append(col.get_group_handle(group.cpu_group).timeout.total_seconds())
                group.destroy_group()
    finally:
        del os.environ[TIMEOUT_ENV]
    return [str(w.message) for w in caught], seconds


def test_a_group_built_outside_ray_warns_once_and_reads_the_environment(
    actors: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    messages, seconds = ray.get(
        actors[0].run.remote(_built_by_hand, unique_name()), timeout=RAY_TIMEOUT_S
    )
    assert seconds == [4.0, 4.0]
    assert len(messages) == 1, messages
    assert "gloo_timeout given to Ray is unknown here" in messages[0]
    assert f"set {TIMEOUT_ENV}" in messages[0]
    with pytest.raises(ValueError, match="gloo_timeout must be a positive number of ms, got 0"):
        RayGroup(2, 0, unique_name(), gloo_timeout=0)
    with pytest.raises(TypeError, match="gloo_timeout must be a number of ms, got str"):
        RayGroup(2, 0, unique_name(), gloo_timeout="3000")  # type: ignore[arg-type]
    monkeypatch.setenv(TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=f"{TIMEOUT_ENV} must be a positive number of ms"):
        gloo_timeout(None, None)
