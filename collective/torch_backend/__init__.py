"""torch.distributed's backend "collective": torch's process groups over the library's CPU groups.

``register`` registers it with torch under the name in ``names`` (at ``import
collective``, and through torch's ``torch.backends`` entry point); ``connect`` builds a
group's ``CpuGroup`` on the store torch hands the backend; ``process_group`` is torch's
``ProcessGroup``, whose ops (``collectives``, ``sparse``, ``exchange``, ``p2p``,
``monitored``, each written for the ``adapter`` protocol) map torch's option objects
onto the library's ops and return torch's ``Work`` (``work``), with ``options`` the
tables between the two and ``overloads`` torch's shorter forms of a call.
It sits at the top, beside the public names: it imports ``collective.ops``,
``collective.bulk``, ``collective.groups`` (``groups.cpu``'s ``CpuGroup``),
``collective.rendezvous``, ``collective.frameworks``, ``collective.types`` and
``collective.work``, and nothing imports it but ``collective``.
"""
