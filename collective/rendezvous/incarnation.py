"""IncarnationStore: scope every rendezvous key to one incarnation of a group.

For stores that do not know incarnations themselves, such as a torch TCPStore
shared by successive groups of one name without Ray. Every key the ranks write or
read carries the id, so a rank still holding an older incarnation can neither
read the new one's addresses nor write into its keys: its reads time out and its
writes land where nobody looks. (The Ray store actor keeps each incarnation apart
itself, and refuses an old one's calls; see ``collective.rendezvous.actor``.)
"""

from __future__ import annotations

from collective.rendezvous.store import PrefixedRendezvousStore, RendezvousStore


class IncarnationStore(PrefixedRendezvousStore):
    """A ``RendezvousStore`` that prefixes every key with an incarnation id."""

    def __init__(self, store: RendezvousStore, incarnation: str) -> None:
        """Scope ``store``'s keys to ``incarnation``, a non-empty id without ``/``."""
        if not incarnation or "/" in incarnation:
            raise ValueError(f"incarnation must be a non-empty id without '/', got {incarnation!r}")
        super().__init__(store, f"{incarnation}/")
        self._incarnation = incarnation

    @property
    def incarnation(self) -> str:
        """Return the incarnation id."""
        return self._incarnation

    def watcher(self) -> RendezvousStore:
        """Return the same scope over a store a second thread may block on."""
        return IncarnationStore(self._store.watcher(), self._incarnation)
