"""Short allreduces and barriers gathered at one rank: work that grows linearly with the ranks.

On a crowded node (more local ranks than cores, see ``gather_bytes``), an allreduce
of at most ``Steps.gather_bytes`` (one step) and a barrier run as a gather at local
rank 0 and one post back:

- every other rank writes its contribution into its slot, posts the step, and waits
  for rank 0's post alone;
- rank 0 collects every other rank's step (``Steps.gather``), reduces its own buffer
  and the others' slots in rank order into its slot, posts it, and every other rank
  copies it out (``Steps.collect_gathered``).

Each rank reads one slot instead of every rank reading every slot, so an op does
O(ranks) work in all, not O(ranks^2), and each rank but rank 0 waits for one counter
only, where every rank reading every slot would take the cores the others need.
Every rank gets rank 0's bits, reduced as the other paths reduce (``Reducer.fold``).
A rank in another op is found by rank 0, which names it in its post, and by the rank
itself, which reads rank 0's header: every rank raises.
"""

from __future__ import annotations

import os

import numpy as np

from collective.groups.shm.kernels import Reducer
from collective.groups.shm.steps import Steps

GATHER_BYTES = 64 << 10
"""The longest allreduce the CPU group gathers (``Steps.gather_bytes``), at most a slot."""

LEADER = 0
"""The local rank that gathers."""

MIN_RANKS = 3
"""The fewest local ranks whose short ops are gathered."""


def gather_bytes(local_size: int, slot_bytes: int) -> int:
    """Return the ``Steps.gather_bytes`` for ``local_size`` ranks on this node: 0, or a size.

    Only a crowded node gathers: one with more local ranks than this process may use
    cores, where every rank's reading of every slot takes the cores the others need.
    With a core per rank the ranks read in parallel and one hop less. The node's leader
    decides, and every local rank takes its word (``cpu.connect``).
    """
    if local_size < MIN_RANKS or local_size <= usable_cores():
        return 0
    return min(GATHER_BYTES, slot_bytes)


def usable_cores() -> int:
    """Return how many cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def gathers(steps: Steps, nbytes: int) -> bool:
    """Return whether an allreduce of ``nbytes`` on ``steps`` is gathered at ``LEADER``."""
    return steps.size >= MIN_RANKS and nbytes <= steps.gather_bytes


def allreduce(steps: Steps, data: np.ndarray, reducer: Reducer, deadline: float) -> None:
    """Reduce every rank's ``data`` (bytes) into every rank's ``data``, gathered at the leader.

    The op must have begun (``Steps.begin``), and ``gathers(steps, data.size)`` hold.
    """
    step = steps.next()
    steps.free(step, deadline)
    mine = steps.slot(step)[: data.size]
    if steps.rank == LEADER:
        steps.gather(step, deadline)
        parts = [steps.peer_slot(r, step)[: data.size] for r in steps.others]
        reducer.fold([data, *parts], mine)
        data[:] = mine
        steps.post(step)
    else:
        mine[:] = data
        steps.post(step)
        steps.collect_gathered(LEADER, step, deadline)
        data[:] = steps.peer_slot(LEADER, step)[: data.size]
    steps.done(step)


def meet(steps: Steps, deadline: float) -> None:
    """Return once every local rank has begun this op and carries its signature.

    The op must have begun (``Steps.begin``).

    Raises:
        MismatchError: a local rank is in another op; every local rank raises it.

    """
    step = steps.next()
    steps.free(step, deadline)
    if steps.rank == LEADER:
        steps.gather(step, deadline)
        steps.post(step)
    else:
        steps.post(step)
        steps.collect_gathered(LEADER, step, deadline)
    steps.done(step)
