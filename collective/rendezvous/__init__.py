"""Where the ranks of a group meet: the rendezvous store, and in Ray the store actor behind it.

This room owns the ``RendezvousStore`` interface with its TCPStore, prefixed and
incarnation views (``store``, ``incarnation``); the namespace's named detached store
actor (``actor``, with its key-value calls in ``actor_keys`` and its shrink and grow
in ``actor_reshape``), the per-group state it keeps (``state``) and the rules of a
shrink or grow (``reshape``); the GCS queries that tell it which members died
(``liveness``); and a process's side of it: the actor's handle and notices
(``client``) and the requests to join, leave, declare, end and list groups
(``membership``). It imports only ``collective.types``; ``store`` (with ``abort_key``, the key under
which a failure is reported to a rank) imports nothing of the package, so the
transports in ``groups/`` build on it.
"""
