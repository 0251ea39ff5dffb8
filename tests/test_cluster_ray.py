"""Two Ray nodes on this machine: a group spans them, and losing a node fails the group fast.

This module starts its own two-node cluster with ``ray.cluster_utils.Cluster``,
so it cannot share the single-node cluster of the other modules.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
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
    live_groups,
    run_all,
    unique_name,
    wait_for_files,
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


def _every_op(rank: int, name: str) -> dict[str, Any]:
    """Run every op once; the hierarchical ones from every root."""
    out: dict[str, Any] = {"transport": col.get_group_handle(name).transport}
    x = np.full(1000, rank + 1.0)
    col.allreduce(x, name, col.ReduceOp.AVG)
    out["allreduce"] = x.tolist()[:2]
    for root in range(4):
        b = np.full(5, 100.0 + root if rank == root else 0.0)
        col.broadcast(b, root, name)
        r = np.full(5, rank + 1, np.int64)
        col.reduce(r, root, name, col.ReduceOp.PRODUCT)
        out[f"root{root}"] = (b.tolist()[0], r.tolist()[0])
    gathered = np.zeros(4 * 3, np.float32)
    col.allgather(gathered, np.full(3, rank, np.float32), name)
    out["allgather"] = gathered.tolist()
    mine = np.zeros(2, np.int32)
    col.reducescatter(mine, np.arange(8, dtype=np.int32) + rank, name)
    out["reducescatter"] = mine.tolist()
    col.barrier(name)
    pieces = [np.zeros(1) for _ in range(4)] if rank == 1 else None
    col.gather(np.full(1, float(rank)), pieces, 1, name)
    out["gather"] = [float(p[0]) for p in pieces] if pieces else None
    received = [np.zeros(1, np.int64) for _ in range(4)]
    col.alltoall(received, [np.full(1, 10 * rank + j, np.int64) for j in range(4)], name)
    out["alltoall"] = [int(r[0]) for r in received]
    peer = rank ^ 2  # 0<->2 and 1<->3: across the nodes
    got = np.zeros(2)
    if rank < peer:
        col.send(np.full(2, float(rank)), peer, name)
        col.recv(got, peer, name)
    else:
        col.recv(got, peer, name)
        col.send(np.full(2, float(rank)), peer, name)
    out["p2p"] = got.tolist()
    return out


def test_every_op_runs_hierarchically_across_two_nodes(cluster: tuple[Cluster, Any]) -> None:
    actors = _members("node_a", 2) + _members("node_b", 2)
    name = unique_name("hier")
    run_all(actors, _init, range(4), [name] * 4)
    try:
        results = run_all(actors, _every_op, range(4), [name] * 4)
    finally:
        run_all(actors, _destroy, [name] * 4)
        for actor in actors:
            ray.kill(actor)
    for rank, out in enumerate(results):
        assert out["transport"] == "hierarchical"
        assert out["allreduce"] == [2.5, 2.5]
        for root in range(4):
            assert out[f"root{root}"] == (100.0 + root, 24 if rank == root else rank + 1)
        assert out["allgather"] == [float(r) for r in range(4) for _ in range(3)]
        assert out["reducescatter"] == [sum(2 * rank + i + r for r in range(4)) for i in range(2)]
        assert out["gather"] == ([0.0, 1.0, 2.0, 3.0] if rank == 1 else None)
        assert out["alltoall"] == [10 * r + rank for r in range(4)]
        assert out["p2p"] == [float(rank ^ 2)] * 2


def _bulk(rank: int, name: str) -> dict[str, Any]:
    """Send a state dict from rank 2 (node b) and reduce a list of gradients."""
    fill = 5.0 if rank == 2 else 0.0
    state: dict[str, Any] = {
        f"layer{i}": np.full((i + 1, 64), fill, np.float32) for i in range(300)
    }
    state["big"] = np.full(400_000, fill)
    col.broadcast_state_dict(state, 2, name, bucket_bytes=64 << 10)
    grads = [np.full(100 + i, rank + 1, np.int64) for i in range(50)]
    work = col.allreduce_tensors(grads, name, async_op=True)
    assert work is not None
    work.wait()
    values = np.concatenate([v.ravel() for v in state.values()])
    return {
        "state": np.unique(values).tolist(),
        "grads": np.unique(np.concatenate(grads)).tolist(),
    }


def test_bulk_calls_run_across_two_nodes(cluster: tuple[Cluster, Any]) -> None:
    actors = _members("node_a", 2) + _members("node_b", 2)
    name = unique_name("bulk")
    run_all(actors, _init, range(4), [name] * 4)
    try:
        results = run_all(actors, _bulk, range(4), [name] * 4)
    finally:
        run_all(actors, _destroy, [name] * 4)
        for actor in actors:
            ray.kill(actor)
    assert results == [{"state": [5.0], "grads": [10]}] * 4


def test_group_spans_two_nodes_and_survives_losing_one(
    cluster: tuple[Cluster, Any], tmp_path: Path
) -> None:
    two, second = cluster
    actors = _members("node_a", 2) + _members("node_b", 2)
    name = unique_name("span")
    nodes = run_all(actors, _init, range(4), [name] * 4)
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3]
    assert run_all(actors, _allreduce, range(4), [name] * 4) == [10.0] * 4

    started = [str(tmp_path / f"rank{r}") for r in range(2)]
    refs = [
        a.run.remote(allreduce_until_failure, name, s)
        for a, s in zip(actors[:2], started, strict=True)
    ]
    wait_for_files(started)
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
    while live_groups() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert live_groups() == []
