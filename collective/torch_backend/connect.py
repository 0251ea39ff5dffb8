"""How a torch process group meets: its incarnation in torch's store, its address, its CPU group.

torch hands a backend a ``PrefixStore`` of the group, which the same job may use again
for a group of the same name (``destroy_process_group`` then ``init_process_group`` on one
``store=``, or ``new_group`` names reused). Each build of a group counts its ranks in that
store and meets under the incarnation the count gives, so no rank ever reads a key an
earlier build of the group left.
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta
from typing import Any

from collective.groups.cpu.group import CpuGroup
from collective.rendezvous.store import PrefixedRendezvousStore, TCPRendezvousStore
from collective.types import GroupOptions

JOINED_KEY = "collective/joined"
"""The store counter of the ranks that built this group so far, every incarnation together."""

MASTER_ADDR_ENV = "MASTER_ADDR"


def incarnation(store: Any, world_size: int) -> int:
    """Return the number of this build of the group in ``store``, the same on each of its ranks.

    Every rank of a build adds itself to one counter; a build starts only once every
    rank of the one before it has joined, so the counts of one build fall in one block
    of ``world_size``.
    """
    joined = int(store.add(JOINED_KEY, 1))
    return (joined - 1) // world_size


def gloo_host() -> str:
    """Return the address this rank's Gloo binds to, should its group span hosts.

    The Ray node IP inside Ray; else the address of the route towards
    ``MASTER_ADDR`` (no packet is sent); else this host name's address.
    """
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return str(ray.util.get_node_ip_address())
    master = os.environ.get(MASTER_ADDR_ENV, "")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((master, 9))
                return str(probe.getsockname()[0])
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def build_group(
    store: Any,
    rank: int,
    world_size: int,
    timeout: timedelta,
    group_name: str,
    options: GroupOptions | None,
) -> CpuGroup:
    """Build this rank's CPU group of torch group ``group_name`` on torch's ``store``.

    Blocks until every rank of the group has arrived. Ranks on one host (by host name
    and boot id, or Ray node) meet in shared memory; Gloo runs between hosts.

    Raises:
        CollectiveTimeoutError: not every rank arrived within ``timeout``.
        CollectiveError: a transport failed to start.

    """
    number = incarnation(store, world_size)
    meeting = PrefixedRendezvousStore(TCPRendezvousStore(store), f"collective/{number}/")
    return CpuGroup(world_size, rank, group_name, meeting, timeout, gloo_host(), options)
