"""GroupManager: this process's groups by name, safe to use from several threads."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from collective.groups.base import BaseGroup
from collective.types import CollectiveError

Builder = Callable[[], "tuple[BaseGroup, Any] | None"]
"""Makes a group and its rendezvous handle, or returns None when there is none to make."""


class GroupManager:
    """Map group names to this process's groups and their rendezvous stores.

    Building a group blocks on the other ranks, so it happens under a lock of its
    own name only: a slow rendezvous in one group never stalls another group.
    """

    def __init__(self) -> None:
        """Start with no groups."""
        self._lock = threading.Lock()
        self._groups: dict[str, tuple[BaseGroup, Any]] = {}
        self._building: dict[str, threading.Lock] = {}

    def _name_lock(self, name: str) -> threading.Lock:
        with self._lock:
            return self._building.setdefault(name, threading.Lock())

    def get(self, name: str) -> BaseGroup | None:
        """Return the group called ``name``, or None."""
        with self._lock:
            entry = self._groups.get(name)
        return entry[0] if entry else None

    def entry(self, name: str) -> tuple[BaseGroup, Any] | None:
        """Return the group called ``name`` and its rendezvous store, or None."""
        with self._lock:
            return self._groups.get(name)

    def names(self) -> list[str]:
        """Return the names of this process's groups."""
        with self._lock:
            return sorted(self._groups)

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
            self._groups[name] = built
        return built[0]

    def remove(self, name: str) -> tuple[BaseGroup, Any] | None:
        """Forget the group called ``name``; return it and its store, or None."""
        with self._lock:
            self._building.pop(name, None)
            return self._groups.pop(name, None)
