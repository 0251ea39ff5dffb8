"""How a CPU group connects at init: which ranks share a node, and which transports to start.

Every rank publishes its node, its pid and whether it can use shared memory
(``topology.exchange``); every rank then derives the same choice from what all
published, so the ranks never disagree:

- ranks on one node (or a group of one): the node's arena; no Gloo at all;
- ranks on several nodes, some sharing one: an arena per shared node, a Gloo
  group among the nodes' leaders, and a Gloo group of all ranks for the ops
  without a hierarchical form;
- one rank per node, ``cpu_transport="gloo"``, a platform without the shared
  transport, or an arena that some node could not make: one Gloo group of all
  ranks. An arena failure is logged once per process; with
  ``cpu_transport="shm"`` it raises instead.

A node's leader creates its arena and unlinks it once every local rank has
reported, through the store, that it has mapped it (or failed to).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from datetime import timedelta

from collective.groups import topology
from collective.groups.gloo.group import GlooGroup
from collective.groups.shm import arena as shm_arena
from collective.groups.shm import gathered
from collective.groups.shm.arena import PID, Arena, Layout
from collective.groups.shm.sync import Liveness
from collective.groups.shm.sync import unsupported_reason as shm_unsupported
from collective.rendezvous.store import PrefixedRendezvousStore, RendezvousStore
from collective.types import CollectiveError, CpuTransport, GroupOptions

logger = logging.getLogger("collective")

ALONE = "no two ranks share a node"
"""The reason for plain Gloo that needs no log line: there is nothing to share."""

_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.warning(message)


@dataclass(frozen=True)
class Member:
    """Who this rank is in its group, and how its transports connect."""

    world_size: int
    rank: int
    group_name: str
    store: RendezvousStore
    timeout: timedelta
    host: str
    options: GroupOptions

    def gloo(self, world_size: int, rank: int, prefix: str = "") -> GlooGroup:
        """Connect a Gloo group of this group's name, meeting under ``prefix`` in the store."""
        store = PrefixedRendezvousStore(self.store, prefix) if prefix else self.store
        return GlooGroup(
            world_size, rank, self.group_name, store, self.timeout, self.host, self.options
        )


@dataclass
class Transports:
    """What a CPU group connected: filled as init goes, so a failed init can undo it."""

    topology: topology.Topology | None = None
    gloo: GlooGroup | None = None
    """The one Gloo group of every op, when shared memory is not used."""
    leaders: GlooGroup | None = None
    """Gloo among the nodes' leaders (on leaders only), across nodes."""
    full: GlooGroup | None = None
    """Gloo among all ranks, across nodes, for ops without a hierarchical form."""
    arena: Arena | None = None
    liveness: Liveness | None = None
    gather_bytes: int = 0
    """The arena's ``Steps.gather_bytes``, as the node's leader decided it for every local rank."""

    @property
    def mode(self) -> str:
        """Return "gloo", "shm" (one node) or "hierarchical" (several)."""
        if self.gloo is not None:
            return "gloo"
        return "shm" if self.full is None else "hierarchical"

    def close_arena(self) -> None:
        """Unmap (and unlink, if still named) the arena, and release the pidfds."""
        if self.liveness is not None:
            self.liveness.close()
            self.liveness = None
        arena, self.arena = self.arena, None
        if arena is not None:
            shm_arena.unlink(arena.path)
            arena.close()

    def destroy_gloo(self) -> None:
        """Destroy every Gloo group."""
        for gloo in (self.gloo, self.leaders, self.full):
            if gloo is not None:
                gloo.destroy_group()


def connect(member: Member, found: Transports, node: str | None, slot_bytes: int | None) -> None:
    """Meet the other ranks and start the transports into ``found``.

    Args:
        member: this rank and its group.
        found: filled with what is connected, also when this raises.
        node: this rank's node id; None detects it.
        slot_bytes: the arena's slot size; None picks one.

    Raises:
        TimeoutError: not every rank arrived within the group's timeout.
        CollectiveError: a transport failed, or shared memory was required and cannot be used.

    """
    wish = member.options.cpu_transport
    reason = "cpu_transport='gloo' was asked for" if wish is CpuTransport.GLOO else ""
    me = topology.identity(reason or shm_unsupported())
    if node is not None:
        me["node"] = node
    n, rank, store, timeout = member.world_size, member.rank, member.store, member.timeout
    infos = topology.exchange(store, "cpu/who", rank, n, me, timeout)
    topo = topology.Topology.from_keys(rank, [i["node"] for i in infos], [i["pid"] for i in infos])
    found.topology = topo
    reasons = sorted({i["shm"] for i in infos if i["shm"]})
    if n > 1 and not any(len(ranks) > 1 for ranks in topo.nodes):
        reasons = reasons or [ALONE]
    elif not reasons:
        failure = _map_arena(member, found, topo, slot_bytes)
        failures = topology.exchange(store, "cpu/mapped", rank, n, failure, timeout)
        if found.arena is not None and topo.is_leader:
            shm_arena.unlink(found.arena.path)
        reasons = sorted({f for f in failures if f})
    if reasons:
        found.close_arena()
        why = "; ".join(reasons)
        if wish is CpuTransport.SHM:
            raise CollectiveError(
                f"group {member.group_name!r} cannot use shared memory (cpu_transport='shm'): {why}"
            )
        if wish is not CpuTransport.GLOO and reasons != [ALONE]:
            _log_once(f"collective: CPU groups fall back to Gloo over TCP: {why}")
        found.gloo = member.gloo(n, rank)
        return
    if len(topo.nodes) > 1:
        if topo.is_leader:
            found.leaders = member.gloo(len(topo.nodes), topo.node, "leaders/")
        found.full = member.gloo(n, rank, "full/")


def _map_arena(
    member: Member, found: Transports, topo: topology.Topology, slot_bytes: int | None
) -> str:
    """Create (on the leader) or map this node's arena into ``found``; return "" or why not."""
    local = topo.local_ranks
    if len(local) == 1:
        return ""
    key = f"cpu/arena-path/{topo.node}"
    store = member.store
    try:
        if topo.is_leader:
            try:
                layout = Layout.for_ranks(len(local), slot_bytes)
                found.arena = shm_arena.create(layout)
            except (OSError, ValueError) as exc:
                failure = f"the arena could not be created on rank {member.rank}: {exc}"
                store.set(key, json.dumps({"failure": failure}).encode())
                return failure
            gather = gathered.gather_bytes(len(local), layout.slot_bytes)
            published = {"path": found.arena.path, "slot_bytes": layout.slot_bytes}
            store.set(key, json.dumps({**published, "gather_bytes": gather}).encode())
        else:
            published = json.loads(store.get(key, member.timeout))
            if "failure" in published:
                return str(published["failure"])
            layout = Layout.for_ranks(len(local), published["slot_bytes"])
            found.arena = shm_arena.attach(published["path"], layout)
            gather = int(published["gather_bytes"])
    except (OSError, ValueError) as exc:
        return f"the arena could not be mapped on rank {member.rank}: {exc}"
    found.arena.control[topo.local_rank, PID] = os.getpid()
    found.gather_bytes = gather
    found.liveness = Liveness(topo.local_pids)
    gone = [r for r in range(len(local)) if not found.liveness.alive(r)]
    if gone:
        return f"rank {member.rank} cannot see the processes of local ranks {gone}"
    return ""
