"""IncarnationStore: scope every rendezvous key to one incarnation of a group.

A group destroyed and created again under its name gets a new incarnation id
from its store actor. Every key its ranks write or read carries that id, so a
rank still holding an older incarnation can neither read the new one's
addresses nor write into its keys: its reads time out and its writes land
where nobody looks.
"""

from __future__ import annotations

from datetime import timedelta

from collective.rendezvous import RendezvousStore


class IncarnationStore(RendezvousStore):
    """A ``RendezvousStore`` that prefixes every key with an incarnation id."""

    def __init__(self, store: RendezvousStore, incarnation: str) -> None:
        """Scope ``store``'s keys to ``incarnation``, a non-empty id without ``/``."""
        if not incarnation or "/" in incarnation:
            raise ValueError(f"incarnation must be a non-empty id without '/', got {incarnation!r}")
        self._store = store
        self._incarnation = incarnation

    @property
    def incarnation(self) -> str:
        """Return the incarnation id."""
        return self._incarnation

    def _key(self, key: str) -> str:
        return f"{self._incarnation}/{key}"

    def set(self, key: str, value: bytes) -> None:
        """Publish ``value`` under this incarnation's ``key``."""
        self._store.set(self._key(key), value)

    def get(self, key: str, timeout: timedelta) -> bytes:
        """Return the value of this incarnation's ``key``, waiting up to ``timeout``."""
        return self._store.get(self._key(key), timeout)

    def delete(self, key: str) -> None:
        """Remove this incarnation's ``key`` if it is present."""
        self._store.delete(self._key(key))

    def watcher(self) -> RendezvousStore:
        """Return the same scope over a store a second thread may block on."""
        return IncarnationStore(self._store.watcher(), self._incarnation)
