"""CpuGroup: the CPU backend; shared memory inside a node, Gloo between nodes, picked at init.

``connect`` decides at init which transports run; ``running`` runs, fails and ends the
ops; ``group`` holds the ops; ``routes`` composes shared memory and Gloo across nodes.
This is the one package that knows both CPU transports: it imports ``groups.shm``,
``groups.gloo``, the shared pieces of ``collective.groups``, ``collective.rendezvous``,
``collective.frameworks``, ``collective.signature``, ``collective.types`` and
``collective.work``.
"""
