"""FailureWatch and IncarnationStore on gloo groups whose ranks are threads over a TCPStore."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np

from collective.groups import progress
from collective.groups.gloo.group import GlooGroup
from collective.groups.watch import FailureWatch
from collective.rendezvous.incarnation import IncarnationStore
from collective.rendezvous.store import TCPRendezvousStore, report_failure
from collective.types import AllReduceOptions, CollectiveError, CollectiveTimeoutError
from tests.test_gloo_group import GROUP_TIMEOUT, _client_store, _master_store, _run_threads

JOIN_S = 60.0


def _build(master: Any, world_size: int, name: str, incarnation: str = "") -> list[GlooGroup]:
    """Build one group of ``world_size`` thread ranks and return every rank's group."""

    def rank(r: int) -> GlooGroup:
        raw = TCPRendezvousStore(master if r == 0 else _client_store(master, GROUP_TIMEOUT))
        store = IncarnationStore(raw, incarnation) if incarnation else raw
        return GlooGroup(world_size, r, name, store, GROUP_TIMEOUT, host="127.0.0.1")

    return _run_threads([functools.partial(rank, r) for r in range(world_size)], JOIN_S)


def test_one_ranks_timeout_wakes_a_rank_waiting_on_a_live_peer() -> None:
    """Rank 2 never joins the op. Rank 0 gives up after 1 s; rank 1 would wait 20 s alone."""
    groups = _build(_master_store(), 3, "watch")
    try:
        short, long = timedelta(seconds=1), timedelta(seconds=20)
        outcomes: dict[int, tuple[BaseException | None, float]] = {}

        def call(rank: int, timeout: timedelta) -> None:
            start = time.monotonic()
            try:
                groups[rank].allreduce([np.ones(8)], AllReduceOptions(timeout=timeout))
                outcomes[rank] = (None, time.monotonic() - start)
            except CollectiveError as exc:
                outcomes[rank] = (exc, time.monotonic() - start)

        threads = [threading.Thread(target=call, args=a) for a in ((0, short), (1, long))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(JOIN_S)
        error0, elapsed0 = outcomes[0]
        error1, elapsed1 = outcomes[1]
        assert type(error0) is CollectiveTimeoutError, repr(error0)
        assert type(error1) is CollectiveError, repr(error1)
        assert "aborted on rank 1" in str(error1) and "rank 0 reported" in str(error1)
        assert elapsed1 < elapsed0 + 3.0 < long.total_seconds()
        # Rank 2 took no part, yet its group is broken too: its next op raises at once
        # ("unusable"), or, if the report is still on its way under load, as soon as it
        # arrives ("aborted"), never at the op's timeout.
        start = time.monotonic()
        try:
            groups[2].allreduce([np.ones(8)], AllReduceOptions())
        except CollectiveError as exc:
            assert "unusable" in str(exc) or "rank 0 reported" in str(exc), str(exc)
        else:
            raise AssertionError("rank 2's op on a broken group did not raise")
        assert time.monotonic() - start < 3.0
        # Rank 1's op still runs in gloo (abandoned): its destroy ends it at once.
        start = time.monotonic()
        groups[1].destroy_group()
        took = time.monotonic() - start
        print(f"\ndestroy with an abandoned op took {took:.3f} s")
        assert took < 1.0
    finally:
        for group in groups:
            group.destroy_group()


def test_destroy_ends_the_watch_thread() -> None:
    before = {t.name for t in threading.enumerate()}
    groups = _build(_master_store(), 2, "stopwatch")
    watchers = [t for t in threading.enumerate() if t.name == "collective-watch-stopwatch"]
    assert len(watchers) == 2
    for group in groups:
        group.destroy_group()
    assert all(not t.is_alive() for t in watchers)
    assert {t.name for t in threading.enumerate()} <= before | {"MainThread"}


def test_two_incarnations_of_one_name_share_a_store_without_mixing() -> None:
    master = _master_store()
    old = _build(master, 2, "same", incarnation="old")
    new = _build(master, 2, "same", incarnation="new")
    try:

        def reduce(groups: list[GlooGroup], base: float) -> list[list[float]]:
            def rank(r: int) -> list[float]:
                x = np.full(4, base + r)
                groups[r].allreduce([x], AllReduceOptions())
                return x.tolist()

            return _run_threads([functools.partial(rank, r) for r in range(2)], JOIN_S)

        assert reduce(new, 10.0) == [[21.0] * 4] * 2
        assert reduce(old, 1.0) == [[3.0] * 4] * 2
    finally:
        for group in old + new:
            group.destroy_group()


# --- the progress queries: several at once, and one that lands on a failure report --------


class _BusyWatcher(TCPRendezvousStore):
    """A store whose watcher reads the abort key only ``delay_s`` after it is rung.

    It stands for a watch thread that a loaded machine schedules late: every query
    and report written meanwhile lands on the key before the thread reads it.
    """

    def __init__(self, store: Any, delay_s: float) -> None:
        super().__init__(store)
        self._delay_s = delay_s

    def watcher(self) -> TCPRendezvousStore:
        outer = self

        class Late(TCPRendezvousStore):
            def get(self, key: str, timeout: timedelta) -> bytes:
                super().get(key, timeout)  # rung: read what is there a moment later
                time.sleep(outer._delay_s)
                return super().get(key, timeout)

        return Late(self._store.clone())


def _watches(master: Any, counts: list[int], late: int) -> list[FailureWatch]:
    """Start one FailureWatch per rank over ``master``; rank ``late``'s reads come late."""
    watches = []
    for rank, count in enumerate(counts):
        client = _client_store(master, GROUP_TIMEOUT)
        store = _BusyWatcher(client, 0.5) if rank == late else TCPRendezvousStore(client)
        watches.append(
            FailureWatch(store, rank, len(counts), "progress", functools.partial(int, count))
        )
    return watches


def test_queries_that_land_together_are_all_answered() -> None:
    master = _master_store()
    watches = _watches(master, [3, 2, 3, 3], late=1)
    try:
        asks: list[Callable[[], Any]] = [
            functools.partial(watches[r].progress, 3, timedelta(seconds=5)) for r in (0, 2, 3)
        ]
        lines = _run_threads(asks, JOIN_S)
    finally:
        for watch in watches:
            watch.stop()
    for line in lines:
        assert "ranks that never joined it: [1] (rank 1 has issued 2 ops)" in line, line
        assert "did not answer" not in line, line


def test_a_failure_report_that_a_query_replaces_is_still_seen() -> None:
    master = _master_store()
    watches = _watches(master, [4, 4], late=1)
    try:
        report_failure(TCPRendezvousStore(master), 1, b"rank 0 reported: it broke")
        line = watches[0].progress(5, timedelta(seconds=5))
        assert watches[1].awaited(5.0) == "rank 0 reported: it broke"
    finally:
        for watch in watches:
            watch.stop()
    assert "ranks that never joined it: [1] (rank 1 has issued 4 ops)" in line, line


def test_a_timeout_line_names_who_joined_who_never_did_and_whose_op_was_another() -> None:
    counts = {1: 2, 2: 1, 3: 2}
    lasts = {1: "broadcast", 2: "allreduce", 3: "allreduce"}
    line = progress.describe(0, 2, counts, [4], "did not answer", lasts, "allreduce")
    assert line == (
        "ranks that joined it (op 2 of the group): [0, 3]; ranks that never joined it: [2] "
        "(rank 2 has issued 1 ops, the last allreduce); ranks whose op 2 was another: "
        "rank 1 (broadcast); ranks that did not answer: [4]"
    )
    unnamed = progress.describe(0, 2, counts, [], "did not answer", lasts)
    assert "another" not in unnamed and "joined it (op 2 of the group): [0, 1, 3]" in unnamed
