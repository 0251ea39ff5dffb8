"""The one-sided shared-memory transport across two Ray nodes on this machine.

One two-node cluster for the module (``ray.cluster_utils.Cluster``; each node has a
resource to pin actors by). A consumer on the producer's node maps the file; one on
the other node reads it through a task pinned to the producer's node: both get the
same tensors, bit for bit, with no group. The lifetime rules hold across nodes: a
read after the free, or after the producer died, raises ``CollectiveError`` naming
which; Ray's abort and the fetch timeout end a pending cross-node read.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ray
import torch
from ray.cluster_utils import Cluster
from ray.experimental import set_target_for_ref

import collective as col
from tests.conftest import RAY_TIMEOUT_S, settle_rdt
from tests.test_rdt_shm_ray import SHM, segments, state_dict, wait_dead

col.register_shm_transport()  # before the classes that name it, as Ray asks

actor_class: Any = ray.remote
"""Ray's decorator; its stubs know neither ``enable_tensor_transport`` nor actor methods."""


def mismatches(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[int]:
    """Return the indices where ``got`` differs from ``want`` in dtype, shape or any bit."""
    assert len(got) == len(want)
    return [
        i
        for i, (g, w) in enumerate(zip(got, want, strict=True))
        if g.dtype != w.dtype
        or g.shape != w.shape
        or not torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8))
    ]


def tensors(seed: int, small: int = 20) -> list[torch.Tensor]:
    """Return tensors of every dtype the transport moves: 0-d, empty, strided; 2 MiB ones if
    ``small``, else few bytes in all (Ray returns those inline, not through its store)."""
    return list(state_dict(seed, small, big=small > 0).values())


def node_id() -> str:
    return str(ray.get_runtime_context().get_node_id())


class _Producer:
    @ray.method(tensor_transport=SHM)
    def make(self, seed: int, small: int = 20) -> list[torch.Tensor]:
        return tensors(seed, small)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)


Producer: Any = actor_class(num_cpus=0, enable_tensor_transport=True)(_Producer)


class _Consumer:
    def check(self, got: list[torch.Tensor], seed: int, small: int = 20) -> list[int]:
        bad = mismatches(got, tensors(seed, small))
        for t in got:
            t.zero_()  # its own memory: the other consumers still read the producer's bytes
        return bad

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)


Consumer: Any = actor_class(num_cpus=0, enable_tensor_transport=True)(_Consumer)


@pytest.fixture(scope="module")
def nodes() -> Iterator[dict[str, Any]]:
    """Start two nodes; return a producer and a consumer on each, and the nodes' ids."""
    cluster = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={"num_cpus": 2, "resources": {"node_a": 10}, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=2, resources={"node_b": 10})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="rdt-shm-two-nodes")
    actors = {
        f"{kind}_{node}": cls.options(resources={f"node_{node}": 1}).remote()
        for kind, cls in (("producer", Producer), ("consumer", Consumer))
        for node in "ab"
    }
    ids = ray.get([a.run.remote(node_id) for a in actors.values()], timeout=RAY_TIMEOUT_S)
    by_name = dict(zip(actors, ids, strict=True))
    assert node_id() == by_name["producer_a"] == by_name["consumer_a"]  # the driver's node
    assert by_name["producer_b"] == by_name["consumer_b"] != node_id()
    yield actors
    settle_rdt()
    ray.shutdown()
    cluster.shutdown()


def test_consumers_on_both_nodes_and_the_driver_get_every_tensor(nodes: dict[str, Any]) -> None:
    producers = [nodes["producer_a"], nodes["producer_b"]]
    pids = ray.get([p.run.remote(os.getpid) for p in producers], timeout=RAY_TIMEOUT_S)
    for seed, small in ((1, 20), (2, 0)):  # through Ray's shared memory, and inline
        ref = nodes["producer_a"].make.remote(seed, small)
        checks = [nodes[c].check.remote(ref, seed, small) for c in ("consumer_a", "consumer_b")]
        assert ray.get(checks, timeout=RAY_TIMEOUT_S) == [[], []]
        assert ray.get(nodes["consumer_b"].check.remote(ref, seed, small), timeout=60) == []
        del ref
    ref = nodes["producer_b"].make.remote(3)  # the driver runs on node a
    assert mismatches(ray.get(ref, timeout=RAY_TIMEOUT_S), tensors(3)) == []
    into = [torch.empty(t.shape, dtype=t.dtype) for t in tensors(3)]
    set_target_for_ref(ref, into)
    got = ray.get(ref, timeout=RAY_TIMEOUT_S)
    assert all(g is i for g, i in zip(got, into, strict=True))
    assert mismatches(into, tensors(3)) == []
    del ref, got
    deadline = time.monotonic() + 10
    while any(map(segments, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [segments(pid) for pid in pids] == [[], []]


def _extract(obj_id: str, seed: int) -> Any:
    from ray.experimental.rdt.util import get_tensor_transport_manager

    manager = get_tensor_transport_manager(SHM)
    return manager.extract_tensor_transport_metadata(obj_id, tensors(seed, 2))


def _free(obj_id: str, meta: Any) -> None:
    from ray.experimental.rdt.util import get_tensor_transport_manager

    get_tensor_transport_manager(SHM).garbage_collect(obj_id, meta, [])


def _read(meta: Any, seed: int) -> Any:
    """Read ``meta``'s object here; return the indices of wrong tensors, or the error."""
    from ray.experimental.rdt.util import get_tensor_transport_manager

    from collective.ray_plugins.shm_transport import ShmCommunicatorMetadata

    manager = get_tensor_transport_manager(SHM)
    try:
        got = manager.recv_multiple_tensors(meta.obj_id, meta, ShmCommunicatorMetadata())
    except col.CollectiveError as exc:
        return f"{type(exc).__name__}: {exc}"
    return mismatches(got, tensors(seed, 2))


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def _stalled_read(meta: Any, abort: bool) -> tuple[str, float]:
    """Read ``meta`` with a reader that never answers; abort it, or let it time out (0.5 s)."""
    from ray.experimental.rdt.util import get_tensor_transport_manager

    from collective.ray_plugins import remote_read
    from collective.ray_plugins.shm_transport import ShmCommunicatorMetadata

    manager: Any = get_tensor_transport_manager(SHM)
    stalled = ray.remote(num_cpus=0)(_sleep)
    real = remote_read.start
    remote_read.start = lambda *args: stalled.remote(60)
    outcome: list[Any] = []
    try:
        request = manager.fetch_multiple_tensors(meta.obj_id, meta, ShmCommunicatorMetadata())
    finally:
        remote_read.start = real

    def wait() -> None:
        try:
            outcome.append(manager.wait_fetch_complete(request, 60 if abort else 0.5))
        except col.CollectiveError as exc:
            outcome.append(f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=wait)
    start = time.monotonic()
    thread.start()
    if abort:
        while not manager._reads.count(meta.obj_id) and thread.is_alive():  # the read is in flight
            time.sleep(0.001)
        start = time.monotonic()
        manager.abort_transport(meta.obj_id, ShmCommunicatorMetadata())
    thread.join(timeout=30)
    return str(outcome[0] if outcome else "still reading"), time.monotonic() - start


def test_a_cross_node_read_after_the_free_or_the_producers_death_names_which(
    nodes: dict[str, Any],
) -> None:
    producer, consumer = nodes["producer_a"], nodes["consumer_b"]
    meta = ray.get(producer.run.remote(_extract, "x", 4), timeout=60)
    assert ray.get(consumer.run.remote(_read, meta, 4), timeout=60) == []
    ray.get(producer.run.remote(_free, "x", meta), timeout=60)
    assert "CollectiveError: object x was freed" in ray.get(
        consumer.run.remote(_read, meta, 4), timeout=60
    )
    doomed = Producer.options(resources={"node_a": 1}).remote()
    meta = ray.get(doomed.run.remote(_extract, "y", 5), timeout=60)
    ray.kill(doomed)
    wait_dead(meta.pid)
    assert segments(meta.pid)  # killed: it could not unlink its file
    message = ray.get(consumer.run.remote(_read, meta, 5), timeout=60)
    assert f"CollectiveError: the producer of object y (pid {meta.pid}) died" in message
    assert segments(meta.pid) == []  # the reader on its node removed the file


def test_abort_and_the_fetch_timeout_end_a_pending_cross_node_read(
    nodes: dict[str, Any],
) -> None:
    producer, consumer = nodes["producer_a"], nodes["consumer_b"]
    meta = ray.get(producer.run.remote(_extract, "z", 6), timeout=60)
    message, delay = ray.get(consumer.run.remote(_stalled_read, meta, True), timeout=60)
    assert message == "CollectiveError: Ray aborted the read of object z" and delay < 2
    message, delay = ray.get(consumer.run.remote(_stalled_read, meta, False), timeout=60)
    assert message.startswith("CollectiveTimeoutError: read of object z") and delay < 3
    assert ray.get(consumer.run.remote(_read, meta, 6), timeout=60) == []
    ray.get(producer.run.remote(_free, "z", meta), timeout=60)
