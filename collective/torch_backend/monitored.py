"""monitored_barrier: rank 0 names the ranks that did not arrive in time, as Gloo's does.

It meets in torch's store of the group, not on the group's transports, so a barrier
that fails leaves the group usable (as Gloo's does). Each call is numbered; rank 0
waits for every other rank's arrival key of that number up to the timeout, then
publishes that all arrived or which did not; the other ranks wait for that word.
The messages are Gloo's, which torch's own tests match.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from collective.rendezvous.store import TCPRendezvousStore
from collective.types import time_left


class MonitoredBarrier:
    """One rank's monitored barriers on a group, over the group's torch store."""

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        """Meet in ``store`` (torch's store of the group) as ``rank`` of ``world_size``."""
        self._store = TCPRendezvousStore(store)
        self._rank = rank
        self._world_size = world_size
        self._count = 0

    def __call__(self, timeout: timedelta, wait_all_ranks: bool) -> None:
        """Block until every rank has called this barrier, up to ``timeout``.

        Raises:
            RuntimeError: on rank 0, "Rank i failed to pass monitoredBarrier in t ms"
                naming the first rank that did not arrive (every one with
                ``wait_all_ranks``: "Ranks i, j failed ..."); on the others, that they
                reached it but rank 0 reported a failure or did not answer in time.

        """
        self._count += 1
        prefix = f"monitored/{self._count}"
        deadline = time.monotonic() + timeout.total_seconds()
        millis = int(timeout.total_seconds() * 1000)
        if self._rank != 0:
            self._store.set(f"{prefix}/arrived/{self._rank}", b"1")
            try:
                word = self._store.get(f"{prefix}/done", time_left(deadline))
            except TimeoutError:
                word = b"rank 0 did not answer in time"
            if word != b"ok":
                raise RuntimeError(
                    f"Rank {self._rank} successfully reached monitoredBarrier, but received "
                    f"errors while waiting for send/recv from rank 0: {word.decode()}"
                )
            return
        if millis <= 0 < self._world_size - 1:
            self._fail(prefix, "Rank 0 timed out in monitoredBarrier after 0 ms")
        missing: list[int] = []
        for peer in range(1, self._world_size):
            if missing and not wait_all_ranks:
                break
            try:
                self._store.get(f"{prefix}/arrived/{peer}", time_left(deadline))
            except TimeoutError:
                missing.append(peer)
        if missing:
            names = ", ".join(str(r) for r in missing)
            ranks = "Ranks" if len(missing) > 1 else "Rank"
            self._fail(prefix, f"{ranks} {names} failed to pass monitoredBarrier in {millis} ms")
        self._store.set(f"{prefix}/done", b"ok")

    def _fail(self, prefix: str, message: str) -> None:
        """Tell the other ranks that the barrier failed, then raise ``message`` here."""
        self._store.set(f"{prefix}/done", message.encode())
        raise RuntimeError(message)
