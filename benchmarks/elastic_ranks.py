"""The ranks of the elastic benchmark: Ray actors that lose a member, recover, and grow back.

Each rank stamps its steps with the wall clock, which every process of one machine
shares (the two-node setting is a ``ray.cluster_utils.Cluster`` on this machine), and
the driver combines the stamps. A round starts four members and two spares, all warm
(each has made, used and destroyed a group of its own, so that no timed step pays for
first imports), then kills a member twice and brings the group back to four twice.
"""

from __future__ import annotations

import time
import uuid
from datetime import timedelta
from typing import Any

import numpy as np
import ray

import collective as col

RAY_TIMEOUT_S = 300
"""Bound on every wait for the ranks of one step."""
TIMEOUT = timedelta(seconds=30)
"""The groups' timeout: how long a shrink, grow or init waits for the others."""
ELEMENTS = 1024
"""float32 elements of each allreduce."""
WORLD_SIZE, VICTIM = 4, 2
"""The group's full size, and the rank the driver kills."""
POLL_S = 0.005
"""How often the driver asks whether every member is inside its allreduce loop."""

SHRINK, REINIT = "shrink_group", "destroy + init"
"""How the survivors of a death recover."""
GROW, FRESH = "grow_group", "destroy + init"
"""How the group gets back to four ranks: a newcomer joins, or everyone makes it anew."""


class _ElasticRank:
    """One rank, with ``max_concurrency=2`` so that the driver asks its progress as it loops."""

    def __init__(self) -> None:
        self._ops = 0

    def warm(self) -> str:
        """Make, use and destroy a one-rank group; return this actor's node id."""
        name = f"warm-{uuid.uuid4().hex[:8]}"
        col.init_collective_group(1, 0, "gloo", name, timeout=TIMEOUT)
        col.allreduce(np.ones(ELEMENTS, np.float32), name)
        col.destroy_collective_group(name)
        return ray.get_runtime_context().get_node_id()

    def ops(self) -> int:
        """Return how many allreduces the running loop has completed."""
        return self._ops

    def init(self, name: str, world_size: int, rank: int) -> tuple[float, int, str]:
        """Make the group and run one allreduce; see ``_first_op``."""
        col.init_collective_group(world_size, rank, "gloo", name, timeout=TIMEOUT)
        return (*self._first_op(name), col.get_group_handle(name).transport)

    def loop_then_recover(self, name: str, how: str, new_rank: int) -> tuple[float, float, int]:
        """Allreduce until the group fails, recover by ``how``, and allreduce once more.

        Args:
            name: the group.
            how: ``SHRINK`` (``shrink_group``) or ``REINIT`` (destroy, then a fresh
                init of the survivors as rank ``new_rank`` of three).
            new_rank: this rank's rank among the survivors.

        Returns:
            When the loop's allreduce raised, when the first allreduce after the
            recovery returned, and how many of its elements were wrong.

        """
        x = np.ones(ELEMENTS, np.float32)
        self._ops = 0
        deadline = time.monotonic() + RAY_TIMEOUT_S
        while time.monotonic() < deadline:
            x.fill(1.0)
            try:
                col.allreduce(x, name)
            except col.CollectiveError:
                break
            self._ops += 1
        failed = time.time()
        if how == SHRINK:
            col.shrink_group(name, timeout=TIMEOUT)
        else:
            col.destroy_collective_group(name)
            col.init_collective_group(WORLD_SIZE - 1, new_rank, "gloo", name, timeout=TIMEOUT)
        ok, wrong = self._first_op(name)
        return failed, ok, wrong

    def rejoin(self, name: str, how: str, rank: int, at: float) -> tuple[float, int]:
        """At wall-clock time ``at``, bring the group to four ranks by ``how``; then allreduce.

        ``GROW`` on a member calls ``grow_group``, and on a newcomer (one that holds
        no group ``name``) calls ``init_collective_group`` as ``rank``. ``FRESH``
        destroys the group where held and makes it anew, this actor as ``rank``.

        Returns:
            As ``_first_op``.

        """
        time.sleep(max(0.0, at - time.time()))
        member = col.is_group_initialized(name)
        if how == GROW and member:
            col.grow_group(name, WORLD_SIZE, timeout=TIMEOUT)
        else:
            if member:
                col.destroy_collective_group(name)
            col.init_collective_group(WORLD_SIZE, rank, "gloo", name, timeout=TIMEOUT)
        return self._first_op(name)

    def _first_op(self, name: str) -> tuple[float, int]:
        """Allreduce ones; return when it returned and how many elements are not the size."""
        x = np.ones(ELEMENTS, np.float32)
        col.allreduce(x, name)
        done = time.time()
        return done, int(np.count_nonzero(x != col.get_collective_group_size(name)))

    def teardown(self, name: str) -> None:
        """Destroy the group if this actor holds it."""
        if col.is_group_initialized(name):
            col.destroy_collective_group(name)


ElasticRank: Any = ray.remote(num_cpus=0)(_ElasticRank)


def _start(resources: dict[str, int]) -> Any:
    """Start a rank actor on a node that has ``resources``."""
    return ElasticRank.options(resources=resources, max_concurrency=2).remote()


class Round:
    """Four members and two spares; ranks 2 and 3 and the spares on node 1 when two nodes."""

    def __init__(self, nodes: int) -> None:
        self.name = f"elastic-{uuid.uuid4().hex[:6]}"
        place = [{f"node{r * nodes // WORLD_SIZE}": 1} if nodes > 1 else {} for r in range(4)]
        spare = place[VICTIM]
        self.members = [_start(p) for p in place]
        self.spares = [_start(spare) for _ in range(2)]
        self.everyone = [*self.members, *self.spares]
        nodes_of = ray.get([a.warm.remote() for a in self.everyone], timeout=RAY_TIMEOUT_S)
        self.nodes = len(set(nodes_of))
        made = ray.get(
            [a.init.remote(self.name, WORLD_SIZE, r) for r, a in enumerate(self.members)],
            timeout=RAY_TIMEOUT_S,
        )
        self.transport = made[0][2]
        self.wrong = sum(w for _, w, _ in made)
        """Wrong elements of the first allreduce of the group of four."""

    def kill_and_recover(self, how: str, least_ops: int) -> tuple[float, float, int]:
        """Kill rank ``VICTIM`` while every member loops over allreduces; recover by ``how``.

        Returns:
            Seconds from the worst survivor's error to its first op after the
            recovery, from the kill to the last survivor's first op, and the
            count of wrong elements in those ops.

        """
        survivors = [a for r, a in enumerate(self.members) if r != VICTIM]
        new_ranks = [r - (r > VICTIM) for r in range(len(self.members))]
        loops = [
            a.loop_then_recover.remote(self.name, how, new_ranks[r])
            for r, a in enumerate(self.members)
        ]
        deadline = time.monotonic() + RAY_TIMEOUT_S
        while min(ray.get([a.ops.remote() for a in self.members], timeout=RAY_TIMEOUT_S)) < (
            least_ops
        ):
            if time.monotonic() > deadline:
                raise TimeoutError("the members never got into their allreduce loop")
            time.sleep(POLL_S)
        killed = time.time()
        ray.kill(self.members[VICTIM])
        del loops[VICTIM]
        stamps = ray.get(loops, timeout=RAY_TIMEOUT_S)
        self.members = survivors
        from_error = max(ok - failed for failed, ok, _ in stamps)
        from_kill = max(ok for _, ok, _ in stamps) - killed
        return from_error, from_kill, sum(w for _, _, w in stamps)

    def rejoin(self, how: str) -> tuple[float, int]:
        """Bring the group back to four ranks with a spare, by ``how``.

        Returns:
            Seconds from the start, the same wall-clock time on every rank, to the
            last rank's first allreduce; and the count of its wrong elements.

        """
        newcomer = self.spares.pop()
        everyone = [*self.members, newcomer]
        at = time.time() + 0.2
        refs = [a.rejoin.remote(self.name, how, r, at) for r, a in enumerate(everyone)]
        stamps = ray.get(refs, timeout=RAY_TIMEOUT_S)
        self.members = everyone
        return max(ok for ok, _ in stamps) - at, sum(w for _, w in stamps)

    def stop(self) -> None:
        """Destroy the group in the live members and kill every actor of the round."""
        ray.get([a.teardown.remote(self.name) for a in self.members], timeout=RAY_TIMEOUT_S)
        for actor in self.everyone:
            ray.kill(actor)
