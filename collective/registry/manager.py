"""GroupManager: this process's groups by name, safe to use from several threads."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from collective.groups.base import BaseGroup
from collective.types import CollectiveError

Builder = Callable[[], "tuple[BaseGroup, Any] | None"]
"""Makes a group and its rendezvous handle, or returns None when there is none to make."""

Entry = tuple[BaseGroup, Any]
"""A group and its rendezvous store."""


class GroupManager:
    """Map group names to this process's groups and their rendezvous stores.

    Building a group blocks on the other ranks, so it happens under a lock of its
    own name only: a slow rendezvous in one group never stalls another group.

    A group its driver ended elsewhere is moved aside (``end``), from the thread
    that hears of it: lookups no longer find it, and the next caller that wants
    the name takes it (``take_ended``) to close it and learn why it ended.
    """

    def __init__(self) -> None:
        """Start with no groups."""
        self._lock = threading.Lock()
        self._groups: dict[str, Entry] = {}
        self.lookup = self._groups.get
        """Return the group called ``name`` and its rendezvous store, or None, without the lock.

        The dict's own ``get``: one read of a dict is atomic, so an op's lookup of its
        group runs no Python code of ours. Raises ``TypeError`` for an unhashable name."""
        self._building: dict[str, threading.Lock] = {}
        self._ended: dict[str, tuple[Entry | None, str]] = {}
        self._ending: dict[str, tuple[str, str]] = {}

    def _name_lock(self, name: str) -> threading.Lock:
        with self._lock:
            return self._building.setdefault(name, threading.Lock())

    def get(self, name: str) -> BaseGroup | None:
        """Return the group called ``name``, or None."""
        with self._lock:
            entry = self._groups.get(name)
        return entry[0] if entry else None

    def entry(self, name: str) -> Entry | None:
        """Return the group called ``name`` and its rendezvous store, or None."""
        with self._lock:
            return self._groups.get(name)

    def names(self) -> list[str]:
        """Return the names of this process's groups, the ended ones not yet closed included."""
        with self._lock:
            return sorted(set(self._groups) | {n for n, e in self._ended.items() if e[0]})

    def create(self, name: str, build: Callable[[], tuple[BaseGroup, Any]]) -> BaseGroup:
        """Build and register a new group called ``name``.

        Raises:
            CollectiveError: a group of that name exists or is being built here.

        """
        lock = self._name_lock(name)
        if not lock.acquire(blocking=False):
            raise CollectiveError(f"group {name!r} is already being initialized in this process")
        try:
            if self.get(name) is not None:
                raise CollectiveError(f"group {name!r} is already initialized in this process")
            return self._register(name, build())
        finally:
            lock.release()

    def get_or_build(self, name: str, build: Builder) -> BaseGroup | None:
        """Return the group called ``name``, building it first if ``build`` can."""
        group = self.get(name)
        if group is not None:
            return group
        with self._name_lock(name):
            return self.get(name) or self._build(name, build)

    def _build(self, name: str, build: Builder) -> BaseGroup | None:
        built = build()
        return None if built is None else self._register(name, built)

    def _register(self, name: str, built: tuple[BaseGroup, Any]) -> BaseGroup:
        with self._lock:
            ending = self._ending.pop(name, None)
            if ending is not None and ending[0] == _incarnation(built):
                self._ended[name] = (built, ending[1])
            else:
                self._ended.pop(name, None)
                self._groups[name] = built
        return built[0]

    def remove(self, name: str) -> Entry | None:
        """Forget the group called ``name``, live or ended; return it and its store, or None."""
        with self._lock:
            self._building.pop(name, None)
            self._ending.pop(name, None)
            ended = self._ended.pop(name, (None, ""))[0]
            return self._groups.pop(name, None) or ended

    def replace(self, name: str, entry: Entry) -> None:
        """Make ``entry`` the group called ``name``, in place of what held the name."""
        with self._lock:
            self._ended.pop(name, None)
            self._ending.pop(name, None)
            self._groups[name] = entry

    def end_incarnation(self, incarnation: str, reason: str, keep: str) -> list[str]:
        """Move aside every group of ``incarnation`` but ``keep`` (a parent's subgroups).

        Returns:
            The names moved aside; their next lookup raises with ``reason``.

        """
        with self._lock:
            names = [
                n for n, e in self._groups.items() if n != keep and _incarnation(e) == incarnation
            ]
            for name in names:
                self._ended[name] = (self._groups.pop(name), reason)
        return names

    def end(self, name: str, incarnation: str, reason: str) -> None:
        """Move the group ``name`` aside if it is ``incarnation``, which its driver ended.

        A group of that incarnation still being built is moved aside once built.
        """
        with self._lock:
            entry = self._groups.get(name)
            if entry is not None and _incarnation(entry) == incarnation:
                del self._groups[name]
                self._ended[name] = (entry, reason)
            else:
                self._ending[name] = (incarnation, reason)

    def take_ended(self, name: str) -> tuple[Entry | None, str | None]:
        """Return the ended group ``name`` (once) and why it ended; ``(None, None)`` if it did not.

        The reason stays until the name is removed or built again.
        """
        with self._lock:
            entry, reason = self._ended.get(name, (None, None))
            if reason is not None:
                self._ended[name] = (None, reason)
            return entry, reason


def _incarnation(entry: Entry) -> str:
    return getattr(entry[1], "incarnation", "")
