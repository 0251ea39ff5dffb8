"""FailureWatch and IncarnationStore on gloo groups whose ranks are threads over a TCPStore."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import pytest

from collective.groups import progress
from collective.groups.base import BaseGroup
from collective.groups.cpu.group import CpuGroup
from collective.groups.cpu.running import CpuRunning
from collective.groups.gloo.group import GlooGroup
from collective.groups.watch import FailureWatch
from collective.rendezvous.incarnation import IncarnationStore
from collective.rendezvous.store import TCPRendezvousStore, report_failure
from collective.types import AllReduceOptions, CollectiveError, CollectiveTimeoutError
from tests.test_gloo_group import (
    GROUP_TIMEOUT,
    Absence,
    _client_store,
    _master_store,
    _run_threads,
)

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


# --- a rank that destroyed its group still answers: its final count stays in the store ------


class _RungThenStopped(TCPRendezvousStore):
    """A store whose watcher, once its abort key is rung, reads it only after ``stop`` wrote.

    It stands for a watch thread scheduled late on a rank that destroys its group at
    once: the query lands, then the stop marker replaces it, before the thread reads.
    """

    def __init__(self, store: Any) -> None:
        super().__init__(store)
        self.rung = threading.Event()
        self._stop_written = threading.Event()

    def set(self, key: str, value: bytes) -> None:
        super().set(key, value)
        if key == "abort/0" and not progress.is_query(value):
            self._stop_written.set()

    def watcher(self) -> TCPRendezvousStore:
        outer = self

        class Late(TCPRendezvousStore):
            def get(self, key: str, timeout: timedelta) -> bytes:
                super().get(key, timeout)
                outer.rung.set()
                outer._stop_written.wait(JOIN_S)
                return super().get(key, timeout)

        return Late(self._store.clone())


def _plain_watches(master: Any, counts: list[int], first: int = 0) -> list[FailureWatch]:
    """Start a FailureWatch for each rank from ``first`` on; rank r has issued ``counts[r]``."""
    return [
        FailureWatch(
            TCPRendezvousStore(_client_store(master, GROUP_TIMEOUT)),
            rank,
            len(counts),
            "final",
            functools.partial(int, count),
            last_op=functools.partial(str, "allreduce"),
        )
        for rank, count in enumerate(counts)
        if rank >= first
    ]


def test_a_rank_that_destroyed_before_it_was_asked_leaves_its_final_count() -> None:
    master = _master_store()
    watches = _plain_watches(master, [5, 5, 4])
    try:
        watches[0].stop()
        start = time.monotonic()
        line = watches[1].progress(5, timedelta(seconds=3), "allreduce")
        took = time.monotonic() - start
    finally:
        for watch in watches:
            watch.stop()
    assert line == (
        "ranks that joined it (op 5 of the group): [0, 1]; ranks that never joined it: [2] "
        "(rank 2 has issued 4 ops, the last allreduce)"
    ), line
    assert took < 2.5, f"the answer of a destroyed rank was waited for ({took:.2f} s)"


def test_a_rank_that_destroys_while_it_is_asked_still_answers() -> None:
    master = _master_store()
    late = _RungThenStopped(_client_store(master, GROUP_TIMEOUT))
    watches = [FailureWatch(late, 0, 3, "final", functools.partial(int, 5))]
    watches += _plain_watches(master, [5, 5, 4], first=1)
    lines: list[str] = []
    try:
        asker = threading.Thread(target=lambda: lines.append(watches[1].progress(5)))
        asker.start()
        assert late.rung.wait(JOIN_S)
        watches[0].stop()  # the stop marker replaces the query before the thread reads it
        asker.join(JOIN_S)
    finally:
        for watch in watches:
            watch.stop()
    assert lines == [
        "ranks that joined it (op 5 of the group): [0, 1]; ranks that never joined it: [2] "
        "(rank 2 has issued 4 ops, the last allreduce)"
    ], lines


class _AsksAfter(TCPRendezvousStore):
    """A rank's store whose progress queries start only once ``event`` is set."""

    def __init__(self, store: Any, event: threading.Event) -> None:
        super().__init__(store)
        self._event = event

    def delete(self, key: str) -> None:
        if key.startswith("progress/count/"):  # an asker's first step
            self._event.wait(JOIN_S)
        super().delete(key)


def _time_out_and_destroy(
    group: BaseGroup, timeout: timedelta, destroyed: threading.Event, late: Absence
) -> str:
    """Return the error of an allreduce that times out; destroy at once (rank 0: say so)."""
    with pytest.raises(CollectiveTimeoutError) as timed_out:
        group.allreduce([np.ones(8)], AllReduceOptions(timeout=timeout))
    group.destroy_group()
    if group.rank == 0:
        destroyed.set()
    late.done()
    return str(timed_out.value)


def test_ranks_that_ask_after_a_peer_destroyed_name_only_the_late_rank() -> None:
    """4 ranks, rank 3 late but alive; rank 1 times out (1 s) and reports it.

    Ranks 0 and 2 (5 s) end at rank 1's report and destroy their groups at once; rank 1
    asks how far the others got only after both have destroyed: it still names rank 3
    alone, with ranks 0 and 2 among those that joined. (Timing out together, a rank may
    hear a peer's report before its own timeout: so only rank 1 times out.)
    """
    master, world_size = _master_store(), 4
    destroyed, count, lock = threading.Event(), [0], threading.Lock()
    together = threading.Barrier(world_size - 1)
    late = Absence(present=world_size - 1)

    def rank(r: int) -> str:
        client = master if r == 0 else _client_store(master, GROUP_TIMEOUT)
        store = _AsksAfter(client, destroyed) if r == 1 else TCPRendezvousStore(client)
        group = GlooGroup(world_size, r, "late", store, GROUP_TIMEOUT, host="127.0.0.1")
        try:
            group.allreduce([np.ones(8)], AllReduceOptions())  # every rank: op 1
            if r == 3:
                late.stay()
            else:
                together.wait(JOIN_S)
            timeout = timedelta(seconds=1 if r == 1 else 5)
            with pytest.raises(CollectiveError) as raised:
                group.allreduce([np.ones(8)], AllReduceOptions(timeout=timeout))
            if r in (0, 2):
                group.destroy_group()
                with lock:
                    count[0] += 1
                    if count[0] == 2:
                        destroyed.set()
            if r != 3:
                late.done()
            return str(raised.value)
        finally:
            group.destroy_group()

    messages = _run_threads([functools.partial(rank, r) for r in range(world_size)], JOIN_S)
    assert "timed out on rank 1 after" in messages[1], messages[1]
    assert messages[1].endswith(
        "ranks that joined it (op 2 of the group): [0, 1, 2]; ranks that never joined it: "
        "[3] (rank 3 has issued 1 ops, the last allreduce)"
    ), messages[1]
    for r in (0, 2, 3):
        assert f"was aborted on rank {r}: rank 1 reported: " in messages[r], messages[r]
        assert "allreduce on group 'late' timed out on rank 1" in messages[r], messages[r]


def test_on_shared_memory_a_rank_reads_the_count_of_a_peer_that_destroyed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The counts are words in the arena: a peer's stays readable after it unmapped it.

    Rank 1 times out first (0.5 s) but reads the counts only once rank 0 has timed
    out (1 s: nobody told it yet) and destroyed its group; rank 2 never comes.
    """
    destroyed = threading.Event()
    laggards = CpuRunning._laggards

    def after_rank_0(self: CpuRunning, stalled: int | None = None) -> str:
        if self.rank == 1:
            destroyed.wait(JOIN_S)
        return laggards(self, stalled)

    monkeypatch.setattr(CpuRunning, "_laggards", after_rank_0)
    master, late = _master_store(), Absence(present=2)

    def rank(r: int) -> str | None:
        client = master if r == 0 else _client_store(master, GROUP_TIMEOUT)
        store = TCPRendezvousStore(client)
        group = CpuGroup(3, r, "shm-late", store, GROUP_TIMEOUT, slot_bytes=256)
        try:
            group.allreduce([np.ones(8)], AllReduceOptions())
            if r == 2:
                late.stay()
                return None
            timeout = timedelta(seconds=1.0 if r == 0 else 0.5)
            return _time_out_and_destroy(group, timeout, destroyed, late)
        finally:
            group.destroy_group()

    messages = _run_threads([functools.partial(rank, r) for r in range(3)], JOIN_S)
    for r, message in enumerate(messages[:2]):
        assert f"timed out on rank {r} after {1 if r == 0 else 0.5}s" in message, message
        assert message.endswith(
            "ranks that joined it (op 2 of the group): [0, 1]; ranks that never joined it: [2] "
            "(rank 2 has issued 1 ops)"
        ), message
