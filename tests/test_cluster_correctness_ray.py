"""Two Ray nodes: user messages beside hierarchical ops, tiny buffers, and a death seen at once.

Ranks 0 and 1 live on node a (0 leads it), ranks 2 and 3 on node b (2 leads it),
so a group of the four runs hierarchically: shared memory inside each node, Gloo
between the leaders. This module starts its own two-node cluster.
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
import torch
from ray.cluster_utils import Cluster

import collective as col
from tests import mixed_program
from tests.conftest import (
    RAY_TIMEOUT_S,
    Member,
    allreduce_until_failure,
    run_all,
    unique_name,
    wait_for_files,
)

GROUP_TIMEOUT = timedelta(seconds=10)
NOTICE_S = 2.0
"""How soon after a death every survivor must have raised (the goal is about a second)."""


@pytest.fixture(scope="module")
def actors() -> Iterator[list[Any]]:
    """Start two nodes and two member actors on each; ranks 0, 1 on node a, 2, 3 on node b."""
    two = Cluster(
        initialize_head=True,
        connect=True,
        head_node_args={"num_cpus": 2, "resources": {"node_a": 10}, "include_dashboard": False},
    )
    two.add_node(num_cpus=2, resources={"node_b": 10})
    two.wait_for_nodes()
    members = [Member.options(resources={n: 1}).remote() for n in ["node_a"] * 2 + ["node_b"] * 2]
    ray.get([a.actor_id.remote() for a in members], timeout=RAY_TIMEOUT_S)
    yield members
    ray.shutdown()
    two.shutdown()


def _init(rank: int, name: str) -> str:
    col.init_collective_group(4, rank, backend="gloo", group_name=name, timeout=GROUP_TIMEOUT)
    return col.get_group_handle(name).transport


def _destroy(name: str) -> None:
    col.destroy_collective_group(name)


@pytest.fixture
def group(actors: list[Any]) -> Iterator[str]:
    """Make a hierarchical group of the four actors; destroy it afterwards."""
    name = unique_name("hier")
    assert run_all(actors, _init, range(4), [name] * 4) == ["hierarchical"] * 4
    yield name
    run_all(actors, _destroy, [name] * 4)


def _send_then_op(rank: int, name: str, op: str) -> tuple[float, float | None]:
    """Rank 0 sends -5 to rank 1 (reduce) or rank 1 to rank 0 (broadcast), then the op."""
    sender, receiver = (0, 1) if op == "reduce" else (1, 0)
    if rank == sender:
        col.send(np.full(4, -5.0), receiver, name)
    x = np.full(4, 42.0 if rank == 1 else float(rank + 1))
    if op == "reduce":
        col.reduce(x, 1, name)
    else:
        col.broadcast(x, 1, name)
    got = None
    if rank == receiver:
        received = np.zeros(4)
        col.recv(received, sender, name)
        got = float(received[0])
    return float(x[0]), got


@pytest.mark.parametrize("op", ["reduce", "broadcast"])
def test_a_user_message_and_an_op_rooted_off_the_leader_stay_apart(
    actors: list[Any], group: str, op: str
) -> None:
    results = run_all(actors, _send_then_op, range(4), [group] * 4, [op] * 4)
    for rank, (value, _) in enumerate(results):
        if op == "reduce":
            assert value == (42.0 + 1 + 3 + 4 if rank == 1 else rank + 1.0), results
        else:
            assert value == 42.0, results
    receiver = 1 if op == "reduce" else 0
    assert results[receiver][1] == -5.0, results


def _tiny(rank: int, name: str) -> list[Any]:
    """Run the ops on buffers of 0 or 1 elements with odd strides; return what each holds."""
    out: list[Any] = []
    empty_int = torch.zeros(0, dtype=torch.int32)
    col.broadcast(empty_int, 0, name)
    out.append(empty_int.numel())
    one = torch.full((1, 4), float(rank + 1))[:, 0]
    col.allreduce(one, name)
    out.append(one.tolist())
    past_end = torch.zeros(4)[4::2]
    col.allreduce(past_end, name)
    col.broadcast(np.zeros(0), 2, name)
    col.reduce(torch.from_numpy(np.zeros(0)), 3, name)
    column = torch.full((1, 4), float(rank))[:, 1]
    col.broadcast(column, 3, name)
    out.append(column.tolist())
    received = [np.zeros(0) for _ in range(4)]
    col.alltoall(received, [np.zeros(0) for _ in range(4)], name)
    out.append([r.size for r in received])
    return out


def test_buffers_of_zero_or_one_element_with_any_stride_work_across_nodes(
    actors: list[Any], group: str
) -> None:
    for out in run_all(actors, _tiny, range(4), [group] * 4):
        assert out == [0, [10.0], [3.0], [0, 0, 0, 0]], out


def _odd_call(rank: int, name: str, case: str) -> tuple[str, list[float]]:
    """Rank 3 (not a leader) passes another reduction or root; say how the op ended."""
    x = np.full(4, float(rank + 1))
    odd = rank == 3
    try:
        if case == "allreduce AVG":
            col.allreduce(x, name, col.ReduceOp.AVG if odd else col.ReduceOp.SUM)
        elif case == "broadcast root":
            col.broadcast(x, 1 if odd else 0, name)
        else:
            col.reduce(x, 1 if odd else 0, name)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", x.tolist()
    return "", x.tolist()


@pytest.mark.parametrize("case", ["allreduce AVG", "broadcast root", "reduce root"])
def test_a_rank_off_the_leaders_that_disagrees_is_an_error_on_every_rank(
    actors: list[Any], case: str
) -> None:
    name = unique_name("odd")
    run_all(actors, _init, range(4), [name] * 4)
    try:
        outcomes = run_all(actors, _odd_call, range(4), [name] * 4, [case] * 4)
    finally:
        run_all(actors, _destroy, [name] * 4)
    for rank, (error, x) in enumerate(outcomes):
        assert error, f"rank {rank} returned from a mismatched {case}: {x}"
        assert x == [float(rank + 1)] * 4, f"rank {rank}'s buffer was written: {x}"
    odd_node = [error for error, _ in outcomes[2:]]
    assert all("rank 3 called" in e or "rank 2 called" in e for e in odd_node), odd_node


def test_a_death_on_one_node_reaches_every_rank_on_the_other_at_once(
    actors: list[Any], tmp_path: Path
) -> None:
    name = unique_name("death")
    extra = Member.options(resources={"node_b": 1}).remote()
    ranks = [*actors[:3], extra]
    assert run_all(ranks, _init, range(4), [name] * 4) == ["hierarchical"] * 4
    started = [str(tmp_path / f"rank{r}") for r in range(4)]
    refs = [
        a.run.remote(allreduce_until_failure, name, s) for a, s in zip(ranks, started, strict=True)
    ]
    wait_for_files(started)
    killed_at = time.time()
    ray.kill(extra)
    outcomes = ray.get(refs[:3], timeout=RAY_TIMEOUT_S)
    delays = [round(at - killed_at, 3) for at, _, _ in outcomes]
    print(f"\nnon-leader on node b killed; ranks 0, 1, 2 raised after {delays} s")
    for _, kind, message in outcomes:
        assert kind == "CollectiveError", message
        assert name in message, message
    assert max(delays) < NOTICE_S, (delays, outcomes)
    run_all(ranks[:3], _destroy, [name] * 3)


class ApiOps:
    """A program's calls through the public API on one group."""

    def __init__(self, name: str) -> None:
        self.name = name

    def allreduce(self, x: np.ndarray, op: col.ReduceOp) -> None:
        col.allreduce(x, self.name, op)

    def reduce(self, x: np.ndarray, root: int, op: col.ReduceOp) -> None:
        col.reduce(x, root, self.name, op)

    def broadcast(self, x: np.ndarray, root: int) -> None:
        col.broadcast(x, root, self.name)

    def allgather(self, outs: list[np.ndarray], x: np.ndarray) -> None:
        col.allgather(outs, x, self.name)

    def reducescatter(self, out: np.ndarray, ins: list[np.ndarray], op: col.ReduceOp) -> None:
        col.reducescatter(out, ins, self.name, op)

    def barrier(self) -> None:
        col.barrier(self.name)

    def send(self, x: np.ndarray, dst: int) -> Any:
        return col.send(x, dst, self.name, async_op=True)

    def recv(self, x: np.ndarray, src: int) -> None:
        col.recv(x, src, self.name)


def _program(rank: int, name: str, seed: int) -> dict[int, Any]:
    return mixed_program.run(ApiOps(name), rank, 4, mixed_program.make(seed, 4))


@pytest.mark.parametrize("seed", range(3))
def test_a_random_mixed_program_matches_numpy_across_nodes(
    actors: list[Any], group: str, seed: int
) -> None:
    results = run_all(actors, _program, range(4), [group] * 4, [seed] * 4)
    mixed_program.check(mixed_program.make(seed, 4), results, 4)


def _until_failure_then_shrink(name: str, started: str) -> tuple[str, int, int, str, float]:
    _, kind, _ = allreduce_until_failure(name, started)
    rank = col.shrink_group(name, timeout=GROUP_TIMEOUT)
    x = np.full(8, float(rank + 1))
    col.allreduce(x, name)
    transport = col.get_group_handle(name).transport
    return kind, rank, col.get_collective_group_size(name), transport, float(x[0])


def test_survivors_on_two_nodes_shrink_after_a_leader_dies(
    actors: list[Any], tmp_path: Path
) -> None:
    """Node b's leader dies mid-op; the three survivors shrink and run hierarchically."""
    name = unique_name("shrink")
    extra = Member.options(resources={"node_b": 1}).remote()
    ranks = [actors[0], actors[1], extra, actors[3]]
    assert run_all(ranks, _init, range(4), [name] * 4) == ["hierarchical"] * 4
    survivors = [actors[0], actors[1], actors[3]]
    started = [str(tmp_path / f"survivor{i}") for i in range(3)]
    refs = [
        a.run.remote(_until_failure_then_shrink, name, s)
        for a, s in zip(survivors, started, strict=True)
    ]
    wait_for_files(started)
    ray.kill(extra)
    results = ray.get(refs, timeout=RAY_TIMEOUT_S)
    assert results == [("CollectiveError", r, 3, "hierarchical", 6.0) for r in range(3)], results
    run_all(survivors, _destroy, [name] * 3)
