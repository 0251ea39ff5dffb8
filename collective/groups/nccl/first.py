"""First use: the ranks agree through the store before a new kind of op reaches NCCL.

NCCL connects peers when a communicator first needs them (``NCCL_RUNTIME_CONNECT``,
the default since 2.22): the first collective of each algorithm, and the first send
or receive to each peer. On a blocking communicator, the only kind cupy makes, that
call blocks the host, inside NCCL and under the group's op lock, until every peer
makes the matching call: a peer that died, or called another op, leaves it blocked
forever, where neither the watchdog nor an abort may reach it (see ``guard``).

So before a group issues a launch whose kind (``First.kind``: the op and its
signature, the same on every rank of a correct program) is new on its communicator,
every rank of that communicator publishes the kind under the communicator's next
agreement key and reads every peer's, within the op's timeout. A peer that never
publishes fails the op with a timeout; one that published another kind fails it as a
mismatch naming both; otherwise every peer is about to issue the same launch, and the
connection forms. Each kind is agreed once per communicator (the ranks remember the
same ``KINDS_KEPT`` most recent ones, as they issue the same ops in the same order), so
a repeated call costs one set lookup. NCCL's choice of algorithm, and so which calls
connect, is not known here: every new kind is agreed, never only the first. A peer
that dies after agreeing and before its own call is the one case left to NCCL: its
socket closes, which fails the connection rather than hanging it.
"""

from __future__ import annotations

import ast
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import timedelta

from collective.groups.nccl import mismatch
from collective.rendezvous.store import RendezvousStore
from collective.types import CollectiveError

KINDS_KEPT = 4096
"""Kinds each communicator remembers as agreed; the oldest is forgotten first."""


@dataclass(frozen=True)
class First:
    """What a launch's ranks agree on before its first use of a communicator."""

    comm: str
    """The communicator's store key (``collective/0``, ``p2p/0.0-1.0``): the same on every rank."""
    members: tuple[int, ...]
    """The group ranks that use the communicator."""
    kind: tuple[object, ...]
    """The launch's op and signature, equal on every member in a correct program."""


class FirstUse:
    """One group's agreements on first uses (op lock held throughout)."""

    def __init__(self, store: RendezvousStore, group_name: str, rank: int) -> None:
        """Agree through ``store`` as ``rank`` of ``group_name``."""
        self._store = store
        self._group = group_name
        self._prefix = f"nccl/{group_name}/first"
        self._rank = rank
        self.agreed: dict[str, OrderedDict[tuple[object, ...], None]] = {}
        """The kinds agreed on each communicator, by its store key (read on every op)."""
        self._counts: dict[str, int] = {}

    def agree(self, first: First, op: str, timeout: timedelta) -> None:
        """Publish ``first.kind`` and read every other member's, within ``timeout``.

        Raises:
            CollectiveError: a member published another kind (the message names both).
            TimeoutError: a member published nothing within ``timeout``.

        """
        k = self._counts.get(first.comm, 0)
        base = f"{self._prefix}/{first.comm}/{k}"
        mine = repr(first.kind).encode()
        self._store.set(f"{base}/{self._rank}", mine)
        if k >= 2:  # every member read it: each has published k - 1 since
            self._store.delete(f"{self._prefix}/{first.comm}/{k - 2}/{self._rank}")
        deadline = time.monotonic() + timeout.total_seconds()
        for member in first.members:
            if member == self._rank:
                continue
            left = timedelta(seconds=max(deadline - time.monotonic(), 0.0))
            try:
                theirs = self._store.get(f"{base}/{member}", left)
            except TimeoutError as exc:
                raise TimeoutError(
                    f"rank {member} never issued a matching {op} (the first of its kind on "
                    f"NCCL communicator {first.comm!r}, which connects the ranks in NCCL)"
                ) from exc
            if theirs != mine:
                shown = mismatch.kind_differences(first.kind, ast.literal_eval(theirs.decode()))
                raise CollectiveError(
                    f"group {self._group!r}, found on rank {self._rank}: {op}: the ranks called "
                    f"different ops or arguments; {shown} (ranks {self._rank} and {member}, "
                    f"the next new op on NCCL communicator {first.comm!r}); NCCL was never "
                    "called, and the group is unusable"
                )
        self._counts[first.comm] = k + 1
        known = self.agreed.setdefault(first.comm, OrderedDict())
        known[first.kind] = None
        if len(known) > KINDS_KEPT:
            known.popitem(last=False)
