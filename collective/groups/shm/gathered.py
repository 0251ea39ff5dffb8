"""Short allreduces and barriers gathered into one rank's hands: linear work in the ranks.

On a crowded node (more local ranks than cores, see ``gather_bytes``), an allreduce
of at most ``Steps.gather_bytes`` (one step) and a barrier take one step that every
rank posts, and one rank finishes (``finish``):

- every rank writes its contribution into its slot and posts the step;
- the rank that finds every rank posted (the last poster, as a rule: it is running
  already and holds every input) checks every header, reduces the slots in rank order
  into the second half of its slot and says it is done (``Steps.settle``,
  ``Steps.publish``);
- every other rank copies that result out (``Steps.result``).

One rank reads every slot instead of every rank reading every slot, so an op does
O(ranks) work in all, not O(ranks^2); and each rank runs once per op, not once more
for every look at a step that is not there yet. Every rank gets the finisher's bits,
reduced as the other paths reduce (``Reducer.fold``). A rank in another op is found
by the finisher, which names it before it says done: every rank raises, and no
rank's buffer is written.

Barriers among three or more ranks that each have a core meet at local rank 0
(``Steps.gather``, ``Steps.collect_gathered``): there a rank polls without yielding,
and one more hop costs less than every rank reading every header.
"""

from __future__ import annotations

import os

import numpy as np

from collective.groups.shm.arena import MAX_DONE_RANKS
from collective.groups.shm.kernels import Reducer
from collective.groups.shm.steps import Steps

GATHER_BYTES = 64 << 10
"""The longest allreduce the CPU group gathers (``Steps.gather_bytes``), at most half a slot."""

LEADER = 0
"""The local rank at which barriers meet on a node where every rank has a core."""

MIN_RANKS = 3
"""The fewest local ranks whose short ops are gathered."""


def gather_bytes(local_size: int, slot_bytes: int) -> int:
    """Return the ``Steps.gather_bytes`` for ``local_size`` ranks on this node: 0, or a size.

    Only a crowded node gathers: one with more local ranks than this process may use
    cores, where every rank's reading of every slot takes the cores the others need.
    With a core per rank the ranks read in parallel and one hop less. The node's leader
    decides, and every local rank takes its word (``cpu.connect``). A result takes the
    second half of a slot.
    """
    if local_size < MIN_RANKS or local_size <= usable_cores() or local_size > MAX_DONE_RANKS:
        return 0
    return min(GATHER_BYTES, slot_bytes // 2)


def usable_cores() -> int:
    """Return how many cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def gathers(steps: Steps, nbytes: int) -> bool:
    """Return whether an allreduce of ``nbytes`` on ``steps`` is gathered (see ``allreduce``)."""
    return steps.size >= MIN_RANKS and 0 < steps.gather_bytes and nbytes <= steps.gather_bytes


def allreduce(steps: Steps, data: np.ndarray, reducer: Reducer, deadline: float) -> None:
    """Reduce every rank's ``data`` (bytes) into every rank's ``data``, gathered.

    The op must have begun (``Steps.begin``), and ``gathers(steps, data.size)`` hold.
    """
    step = steps.next()
    steps.free(step, deadline)
    steps.slot(step)[: data.size] = data
    steps.post(step)
    who = steps.settle(step, deadline)
    if who < 0:
        out = steps.result(steps.rank, step)[: data.size]
        reducer.fold([steps.peer_slot(r, step)[: data.size] for r in range(steps.size)], out)
        steps.publish(step)
        data[:] = out
    else:
        data[:] = steps.result(who, step)[: data.size]
    steps.done(step)


def meet(steps: Steps, deadline: float) -> None:
    """Return once every local rank has begun this op and carries its signature.

    The op must have begun (``Steps.begin``), and ``steps.size`` be at least
    ``MIN_RANKS``.

    Raises:
        MismatchError: a local rank is in another op; every local rank raises it.

    """
    step = steps.next()
    steps.free(step, deadline)
    if steps.gather_bytes:
        steps.post(step)
        if steps.settle(step, deadline) < 0:
            steps.publish(step)
    elif steps.rank == LEADER:
        steps.gather(step, deadline)
        steps.post(step)
    else:
        steps.post(step)
        steps.collect_gathered(LEADER, step, deadline)
    steps.done(step)
