"""The rendezvous store interface, its TCPStore and prefixed views, and the meeting barrier.

Groups reach their rendezvous only through ``RendezvousStore``: set, get with a
timeout, delete. In Ray it is backed by the group's state in the namespace's shared
store actor (``collective.rendezvous``); in a plain process by torch's TCPStore.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Any


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
        return timedelta(seconds=max(deadline - time.monotonic(), 0.001))

    store.set(f"{prefix}/arrived/{rank}", b"1")
    if rank != 0:
        store.get(f"{prefix}/ready", left())
        return
    for peer in range(1, world_size):
        store.get(f"{prefix}/arrived/{peer}", left())
    store.set(f"{prefix}/ready", b"1")
