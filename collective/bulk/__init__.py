"""Many tensors in one call: state dicts and lists of tensors, broadcast or reduced.

``api`` holds the public calls (``broadcast_state_dict``, ``broadcast_tensors``,
``allreduce_tensors``) and finds their group; ``calls`` runs one on a group: the
rank's own checks (``local``), the agreement among ranks on what moves (``meta``
describes it, ``agree`` compares it), the cut into ops (``plan``), and the moves
(``pipeline``: pack, move and unpack through two staging buffers, or one vectored
op where the transport takes lists). ``repeat`` lets a call that repeats an earlier
one skip this rank's per-tensor work, and ``turns`` lets one bulk call at a time
run on a group. It sits above the ops' rooms: it imports ``collective.registry``,
``collective.checks``, ``collective.groups``, ``collective.frameworks``,
``collective.signature``, ``collective.types`` and ``collective.work``.
"""
