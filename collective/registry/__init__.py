"""Where an op finds its group: the groups of this process, and the calls that make and end them.

This room owns the public group calls (``lifecycle``: init, declare, destroy;
``queries``: ranks, sizes, lists; ``subgroups``: ``new_group``; ``elastic``: shrink and
grow), the groups this process holds and the lookup every op starts with
(``held``, over the ``GroupManager`` of ``manager``), the join and build of a rank's
transports (``build``), the backend names and their group classes (``backends``) and
what this process knows of Ray (``ray_process``). It imports the rendezvous
(``collective.rendezvous``), the group classes (``collective.groups``), the argument
checks and ``collective.types``; the public ops above it import ``held``.
"""
