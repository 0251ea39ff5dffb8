"""Where an op's arguments are checked, on this rank and, with ``check_args``, among the ranks.

This room owns the argument checks every op runs before any communication
(``arguments``: types, ranges, list lengths, timeouts, the ``checking`` context that
turns one rank's bad argument into an error on every rank of a ``check_args`` group),
the checks on the buffers an op writes (``written``: read-only memory, grad leaves,
overlaps and aliases) and the ``check_args`` group itself (``check_args``: before each
op the ranks compare their calls' signatures). A call's signature, the encoding the
ranks compare, is ``collective.signature``, below this room, because the transports
compare it too. It imports ``collective.groups.base``, ``collective.frameworks``,
``collective.signature``, ``collective.types`` and ``collective.work``.
"""
