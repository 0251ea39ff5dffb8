"""The rendezvous store interface, its TCPStore and prefixed views, and the meeting barrier.

Groups reach their rendezvous only through ``RendezvousStore``: set, get with a
timeout, delete. In Ray it is backed by the group's state in the namespace's shared
store actor (``collective.rendezvous``); in a plain process by torch's TCPStore.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

from collective.types import time_left

PEEK_WAIT = timedelta(milliseconds=1)
"""How long ``RendezvousStore.peek`` waits where the store cannot look without waiting."""


def abort_key(rank: int) -> str:
    """Return the store key under which failures are reported to ``rank``."""
    return f"abort/{rank}"


def reason_key(rank: int) -> str:
    """Return the store key that keeps a failure reported to ``rank``.

    The abort key only rings: a progress query written there may replace a report
    before ``rank`` reads it, so the report is kept here as well.
    """
    return f"abort/{rank}/reason"


class Settable(Protocol):
    """Anything with a store's ``set``: a ``RendezvousStore``, or a group's state in the actor."""

    def set(self, key: str, value: bytes) -> None:
        """Publish ``value`` under ``key``."""


def report_failure(store: Settable, rank: int, reason: bytes) -> None:
    """Tell ``rank`` of a failure: kept under its reason key, then rung on its abort key."""
    store.set(reason_key(rank), reason)
    store.set(abort_key(rank), reason)


class RendezvousStore(ABC):
    """A small key-value store through which the ranks of one group meet."""

    @abstractmethod
    def set(self, key: str, value: bytes) -> None:
        """Publish ``value`` under ``key``, waking every rank waiting for it."""

    @abstractmethod
    def get(self, key: str, timeout: timedelta) -> bytes:
        """Return the value of ``key``, waiting up to ``timeout`` for it to be set.

        Raises:
            TimeoutError: ``key`` was not set within ``timeout``.
            CollectiveError: the store is unreachable.

        """

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key`` if it is present."""

    def peek(self, key: str) -> bytes | None:
        """Return the value of ``key`` if it is set, else None, without waiting for it."""
        try:
            return self.get(key, PEEK_WAIT)
        except TimeoutError:
            return None

    @property
    def incarnation(self) -> str:
        """Return the id of the group incarnation this store's keys belong to; "" if none."""
        return ""

    def watcher(self) -> RendezvousStore:
        """Return a store a second thread may block on while this one is in use."""
        return self


class TCPRendezvousStore(RendezvousStore):
    """A ``RendezvousStore`` on a torch ``TCPStore``, for use without Ray."""

    def __init__(self, store: Any) -> None:
        """Wrap a connected ``torch.distributed.TCPStore`` (or any c10d ``Store``)."""
        self._store = store

    def set(self, key: str, value: bytes) -> None:
        """Publish ``value`` under ``key``."""
        self._store.set(key, value)

    def get(self, key: str, timeout: timedelta) -> bytes:
        """Return the value of ``key``, waiting up to ``timeout`` for it."""
        from torch.distributed import DistStoreError

        try:
            self._store.wait([key], timeout)
        except DistStoreError as exc:
            raise TimeoutError(f"key {key!r} was not set within {timeout}: {exc}") from exc
        return bytes(self._store.get(key))

    def delete(self, key: str) -> None:
        """Remove ``key`` if it is present."""
        self._store.delete_key(key)

    def peek(self, key: str) -> bytes | None:
        """Return the value of ``key`` if it is set, else None; asks without waiting."""
        if not self._store.check([key]):
            return None
        return bytes(self._store.get(key))

    def watcher(self) -> RendezvousStore:
        """Return a store on a connection of its own; a TCPStore serialises its calls."""
        return TCPRendezvousStore(self._store.clone())


class PrefixedRendezvousStore(RendezvousStore):
    """A view of another ``RendezvousStore`` in which every key starts with ``prefix``."""

    def __init__(self, store: RendezvousStore, prefix: str) -> None:
        """Wrap ``store``; keys set and read through this view get ``prefix`` in front."""
        self._store = store
        self._prefix = prefix

    def set(self, key: str, value: bytes) -> None:
        """Publish ``value`` under the prefixed ``key``."""
        self._store.set(self._prefix + key, value)

    def get(self, key: str, timeout: timedelta) -> bytes:
        """Return the value of the prefixed ``key``, waiting up to ``timeout`` for it."""
        return self._store.get(self._prefix + key, timeout)

    def delete(self, key: str) -> None:
        """Remove the prefixed ``key`` if it is present."""
        self._store.delete(self._prefix + key)

    def peek(self, key: str) -> bytes | None:
        """Return the value of the prefixed ``key`` if it is set, else None, without waiting."""
        return self._store.peek(self._prefix + key)

    @property
    def incarnation(self) -> str:
        """Return the incarnation id of the wrapped store."""
        return self._store.incarnation

    def watcher(self) -> RendezvousStore:
        """Return the same view over a store a second thread may block on."""
        return PrefixedRendezvousStore(self._store.watcher(), self._prefix)


def meet(
    store: RendezvousStore, prefix: str, rank: int, world_size: int, timeout: timedelta
) -> None:
    """Block until every rank has called ``meet`` with ``prefix``, or ``timeout`` passes.

    Each rank marks its arrival; rank 0 waits for all marks, then says ready.

    Raises:
        TimeoutError: not every rank arrived in time.

    """
    deadline = time.monotonic() + timeout.total_seconds()

    def left() -> timedelta:
        return time_left(deadline)

    store.set(f"{prefix}/arrived/{rank}", b"1")
    if rank != 0:
        await_gathered(store, f"{prefix}/ready", left())
        return
    gather_arrivals(store, lambda peer: f"{prefix}/arrived/{peer}", world_size, deadline)
    store.set(f"{prefix}/ready", b"1")


def gather_arrivals(
    store: RendezvousStore, key_of: Callable[[int], str], world_size: int, deadline: float
) -> list[bytes]:
    """Return the values of ``key_of(rank)`` for ranks 1 to ``world_size - 1``, as rank 0 does.

    ``deadline`` is a ``time.monotonic`` time.

    Raises:
        TimeoutError: some rank's key was not set by ``deadline``; the message names
            every rank whose key is missing then.

    """
    values = []
    for peer in range(1, world_size):
        left = time_left(deadline)
        try:
            values.append(store.get(key_of(peer), left))
        except TimeoutError:
            later = [p for p in range(peer + 1, world_size) if not _is_set(store, key_of(p))]
            arrived = [p for p in range(world_size) if p != peer and p not in later]
            raise TimeoutError(
                f"ranks {[peer, *later]} never arrived; ranks {arrived} did"
            ) from None
    return values


def await_gathered(store: RendezvousStore, key: str, timeout: timedelta) -> bytes:
    """Return ``key``, which rank 0 sets once every rank has arrived.

    Raises:
        TimeoutError: it was not set in time; rank 0's error names the ranks missing.

    """
    try:
        return store.get(key, timeout)
    except TimeoutError:
        raise TimeoutError(
            "not every rank arrived in time (rank 0, which waits for them, names the "
            "ranks that never did, unless it is one of them)"
        ) from None


def _is_set(store: RendezvousStore, key: str) -> bool:
    try:
        store.get(key, timedelta(milliseconds=1))
    except TimeoutError:
        return False
    return True
