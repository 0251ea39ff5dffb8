"""Which ranks of a group share a node: learned once, at init, through the rendezvous store.

Each rank publishes what it knows of itself (its node, its pid, whether it can
use shared memory); rank 0 gathers every rank's and publishes the list, and
every rank derives the same picture from it. In Ray a node is a Ray node id;
without Ray, a host name and the kernel's boot id.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from collective.rendezvous.store import RendezvousStore, await_gathered, gather_arrivals

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def node_key() -> str:
    """Return an id shared by exactly the processes of this node."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        node_id = ray.get_runtime_context().get_node_id()
        if node_id:
            return f"ray:{node_id}"
    try:
        with open(_BOOT_ID) as boot:
            boot_id = boot.read().strip()
    except OSError:
        boot_id = "unknown-boot"
    return f"host:{socket.gethostname()}:{boot_id}"


def exchange(
    store: RendezvousStore, prefix: str, rank: int, world_size: int, value: Any, timeout: timedelta
) -> list[Any]:
    """Return every rank's ``value`` (JSON-able), in rank order, on every rank.

    Rank 0 reads the others' values and publishes them all; the others read that.

    Raises:
        TimeoutError: not every rank published in time.

    """
    deadline = time.monotonic() + timeout.total_seconds()

    def left() -> timedelta:
        return timedelta(seconds=max(deadline - time.monotonic(), 0.001))

    if rank != 0:
        store.set(f"{prefix}/{rank}", json.dumps(value).encode())
        return json.loads(await_gathered(store, f"{prefix}/all", left()))
    peers = gather_arrivals(store, lambda peer: f"{prefix}/{peer}", world_size, deadline)
    values = [value] + [json.loads(v) for v in peers]
    store.set(f"{prefix}/all", json.dumps(values).encode())
    return values


@dataclass(frozen=True)
class Topology:
    """How a group's ranks sit on nodes, as every rank sees it."""

    rank: int
    nodes: tuple[tuple[int, ...], ...]
    """The ranks of each node, ascending; nodes ordered by their lowest rank."""
    pids: tuple[int, ...]
    """Each rank's process id."""

    @classmethod
    def from_keys(cls, rank: int, keys: list[str], pids: list[int]) -> Topology:
        """Group ranks by their node ``keys`` (one per rank)."""
        nodes: dict[str, list[int]] = {}
        for r, key in enumerate(keys):
            nodes.setdefault(key, []).append(r)
        return cls(rank, tuple(tuple(ranks) for ranks in nodes.values()), tuple(pids))

    @property
    def node(self) -> int:
        """Return the index of this rank's node."""
        return self.node_of(self.rank)

    def node_of(self, rank: int) -> int:
        """Return the index of ``rank``'s node."""
        return next(i for i, ranks in enumerate(self.nodes) if rank in ranks)

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """Return the ranks on this rank's node."""
        return self.nodes[self.node]

    @property
    def local_rank(self) -> int:
        """Return this rank's index among its node's ranks."""
        return self.local_ranks.index(self.rank)

    def local_rank_of(self, rank: int) -> int:
        """Return ``rank``'s index among its node's ranks."""
        return self.nodes[self.node_of(rank)].index(rank)

    @property
    def leaders(self) -> tuple[int, ...]:
        """Return each node's lowest rank, in node order."""
        return tuple(ranks[0] for ranks in self.nodes)

    @property
    def is_leader(self) -> bool:
        """Return whether this rank leads its node."""
        return self.local_rank == 0

    @property
    def local_pids(self) -> list[int]:
        """Return the pids of this node's ranks, in local rank order."""
        return [self.pids[r] for r in self.local_ranks]


def identity(shm_reason: str) -> dict[str, Any]:
    """Return what a rank tells the others of itself at init."""
    return {"node": node_key(), "pid": os.getpid(), "shm": shm_reason}
