"""GlooGroup: one torch ``ProcessGroupGloo`` per group, built from a store.

``running`` connects the ranks and runs, fails and ends ops; ``group`` holds the ops;
``agree`` is what the ranks compare before an op and ``agreement`` how they exchange
it; ``work`` and ``reducescatter`` the pieces of running one. It imports the shared
pieces of ``collective.groups``, ``collective.rendezvous`` (the store its
``ProcessGroupGloo`` is built from), ``collective.frameworks``, ``collective.signature``,
``collective.types`` and ``collective.work``; never another transport.
"""

from collective.groups.gloo.group import GlooGroup

__all__ = ["GlooGroup"]
