"""Shared fixtures: one Ray cluster per test module, a pool of member actors, leak checks."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import ray

import collective as col
from collective.rendezvous.actor import STORE_ACTOR_NAME

RAY_TIMEOUT_S = 120
"""Bound on every ray.get in the tests, so that a hang fails instead of stalling CI."""


class _Member:
    """A test actor that runs whatever function it is sent, in its own process."""

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    def actor_id(self) -> str:
        return ray.get_runtime_context().get_actor_id() or ""


Member: Any = ray.remote(num_cpus=0)(_Member)
"""The member actor class. Applied rather than decorated, as type checkers ignore class
decorators; ``Any``, as Ray's types do not follow method calls through actor handles."""


def our_named_actors() -> list[str]:
    """Return the namespaces that hold this library's store actor."""
    return sorted(
        a["namespace"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"] == STORE_ACTOR_NAME
    )


def live_groups() -> list[str]:
    """Return the groups alive in this library's store actors, in every namespace."""
    names = []
    for namespace in our_named_actors():
        try:
            store = ray.get_actor(STORE_ACTOR_NAME, namespace=namespace)
            names += ray.get(store.names.remote(), timeout=RAY_TIMEOUT_S)
        except (ValueError, ray.exceptions.RayActorError):
            continue
    return sorted(names)


def run_all(actors: Sequence[Any], fn: Callable[..., Any], *per_actor_args: Sequence[Any]) -> list:
    """Run ``fn(*args_i)`` on actor i for every i, and return every result in order."""
    refs = [a.run.remote(fn, *(args[i] for args in per_actor_args)) for i, a in enumerate(actors)]
    return ray.get(refs, timeout=RAY_TIMEOUT_S)


def allreduce_until_failure(name: str) -> tuple[float, str, str]:
    """Allreduce on group ``name`` until it raises; return when, the error's type and message."""
    x = np.ones(1 << 14, dtype=np.float32)
    deadline = time.monotonic() + RAY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            col.allreduce(x, name)
        except Exception as exc:
            return time.time(), type(exc).__name__, str(exc)
    return time.time(), "", "no failure"


def settle_rdt(timeout_s: float = 5.0) -> None:
    """Wait until Ray's RDT failure monitor has taken every transfer of this session.

    Ray keeps its RDT manager across ``ray.shutdown``: a transfer still queued for its
    monitor reaches the next session's monitor, whose ``ray.wait`` on it raises in a
    thread. Call it before ``ray.shutdown`` in a module that moved tensors by RDT.
    """
    manager = ray._private.worker.global_worker._rdt_manager
    deadline = time.monotonic() + timeout_s
    while manager is not None and time.monotonic() < deadline:
        if manager._unmonitored_transfers.empty():
            return
        time.sleep(0.05)


def unique_name(prefix: str = "g") -> str:
    """Return a group name no other test uses."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """Start one local Ray cluster for the module and stop it afterwards."""
    ray.init(address="local", num_cpus=2, namespace="collective-tests", include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def members(ray_cluster: None) -> list[Any]:
    """Return four live member actors, shared by the module's tests."""
    actors = [Member.remote() for _ in range(4)]
    ray.get([a.actor_id.remote() for a in actors], timeout=RAY_TIMEOUT_S)
    return actors


@pytest.fixture
def no_leaks(ray_cluster: None) -> Iterator[None]:
    """Assert that a test leaves no group alive behind it, in any namespace."""
    yield
    assert live_groups() == []
