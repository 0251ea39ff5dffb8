"""The shared-memory transport of CPU groups: an arena per node, its waits, its algorithms.

``arena`` creates, maps and unlinks the node's segment and says where each part of
it lies; ``sync`` waits on its counters (spin, then sleep, bounded by the op's
deadline, watching the peers' pids); ``steps`` is the protocol of the collective
slots, whose headers carry each step's signature; ``algorithms`` pipelines the
collectives through the slots, with the reductions of ``kernels``; ``short``
serves short allreduce, reduce and broadcast calls prepared once; ``lists``
broadcasts a list of buffers as one message; ``sendrecv`` moves send and recv
through each pair's mailboxes; ``local_copies`` stands in for the collectives of
a rank alone on its node. It imports only ``collective.frameworks``,
``collective.signature`` and ``collective.types``: it knows no group.
"""
