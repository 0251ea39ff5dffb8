"""GlooGroup: one torch ``ProcessGroupGloo`` per group, built from a store.

``running`` connects the ranks and runs, fails and ends ops; ``group`` holds the ops;
``agree`` is what the ranks compare before an op; ``work`` and ``reducescatter`` the
pieces of running one.
"""

from collective.groups.gloo.group import GlooGroup

__all__ = ["GlooGroup"]
