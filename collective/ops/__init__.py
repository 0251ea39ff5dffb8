"""The public ops: where a call's arguments are checked and its launch is built once, then run.

This room owns the op functions users call (``collectives``: allreduce, reduce,
broadcast, allgather, reducescatter, barrier, send, recv; ``gather_scatter``: gather,
scatter, alltoall, alltoall_single; ``multigpu``: the ``*_multigpu`` ops) and the one
path every call takes (``calls`` for the ops on one buffer, ``list_calls`` for the ops
on lists of buffers): make the call's key, look it up in the group's launch cache, check
and build on a miss, launch. It imports the group lookup (``collective.registry.held``),
the checks (``collective.checks``), the group API (``collective.groups.base``,
``collective.groups.launches``), ``collective.frameworks``, ``collective.types`` and
``collective.work``; only ``collective.ray_plugins`` and the public names import it.
"""
