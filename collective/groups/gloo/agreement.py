"""How a Gloo group runs the agreement before each collective: the records go round, then compare.

``agree`` says what a record holds; ``Agreement`` moves every rank's record to every
rank over the group's own gloo process group, compares them, and finishes an op
whose data rode in them. Each exchange is one of the group's ops (``Start``), so it
is tracked, timed out and aborted as any other.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

from collective.groups.gloo.agree import (
    GATHER_FROM,
    Call,
    Carried,
    Records,
    disagreement,
    unpaired,
)
from collective.groups.gloo.work import call_options, int64_tensor
from collective.types import time_left


class Start(Protocol):
    """Start one gloo call of op ``op`` as the group's collective ``number``; return its work."""

    def __call__(
        self, op: str, options: Any, start: Callable[[timedelta | None], Any], number: int
    ) -> Any:
        """Start ``start(timeout)``, tracked by the group; the work has ``wait()``."""


class Agreement:
    """A Gloo group's agreements: one at a time, on the group's collective lane."""

    def __init__(
        self,
        world_size: int,
        rank: int,
        group_name: str,
        timeout: timedelta,
        start: Start,
        pg: Callable[[], Any],
    ) -> None:
        """Run agreements of ``rank`` through ``start`` on the process group ``pg()``.

        ``timeout`` is the group's, for an op that gives none.
        """
        self._timeout = timeout
        self._world_size = world_size
        self._rank = rank
        self._group_name = group_name
        self._start = start
        self._pg = pg
        self._records: Records | None = None
        self.gather_from = GATHER_FROM
        """The world size from which the records go to rank 0 and back (see ``agree``)."""

    def agree(self, call: Call, options: Any, number: int, carried: Carried | None = None) -> bool:
        """Give every rank every rank's ``call``; raise the same error on every rank if they differ.

        Returns:
            Whether the op is done: its data rode in the records, and
            ``carried.complete`` wrote the result.

        Raises:
            ArgumentValueError: the ranks passed different arguments; no buffer was written.
            CollectiveError: the exchange itself failed; the group is unusable.

        """
        records = self._records
        if records is None:
            records = self._records = Records(self._world_size)
        size = call.nbytes() if carried is None or carried.size is None else carried.size
        carry = carried is not None and size <= records.room
        if call.op == "alltoall":
            carry = records.fill_sizes(call)
        else:
            records.fill(call, carried.data if carried is not None and carry else None)
        self._exchange(call.op, options, records, number)
        if not records.agreed():
            raise disagreement(call.op, self._group_name, records.words())
        if call.op == "alltoall":
            self._pair(call, options, number, records.sizes() if carry else None)
            return False
        if carried is None or not carry:
            return False
        carried.complete(records.data(size))
        return True

    def _pair(self, call: Call, options: Any, number: int, table: list[list[int]] | None) -> None:
        """Raise if an alltoall's elements per peer do not pair up; allgather them if not given."""
        if table is None:
            sizes = int64_tensor([*call.sends, *call.receives])
            gathered = self._allgather(call.op, options, sizes, number)
            table = gathered.view(self._world_size, -1).tolist()
        error = unpaired(self._group_name, table)
        if error is not None:
            raise error

    def _exchange(self, op: str, options: Any, records: Records, number: int) -> None:
        """Give every rank every rank's record, within the op's timeout.

        An allgather; from ``gather_from`` ranks on, a gather at rank 0 and its broadcast.
        """
        if self._world_size < self.gather_from:
            self._allgather(op, options, records.mine, number, records.gathered)
            return
        deadline = time.monotonic() + (options.timeout or self._timeout).total_seconds()
        rows = [records.rows] if self._rank == 0 else []
        pg = self._pg()
        self._start(
            op,
            options,
            lambda t: pg.gather(rows, [records.mine], call_options("Gather", t, rootRank=0)),
            number,
        ).wait()
        self._start(
            op,
            dataclasses.replace(options, timeout=time_left(deadline)),
            lambda t: pg.broadcast([records.gathered], call_options("Broadcast", t, rootRank=0)),
            number,
        ).wait()

    def _allgather(self, op: str, options: Any, mine: Any, number: int, out: Any = None) -> Any:
        """Return every rank's ``mine`` (all of one size and dtype), one after another.

        They land in ``out`` when given, else in a new tensor.
        """
        import torch

        if out is None:
            out = torch.empty(self._world_size * mine.numel(), dtype=mine.dtype)
        pg = self._pg()
        self._start(
            op,
            options,
            lambda t: pg._allgather_base(out, mine, call_options("Allgather", t)),
            number,
        ).wait()
        return out
