"""The shared-memory files of the objects this process produced and still holds.

A file goes when Ray frees its object (``release``). Ray frees nothing at a driver's
``ray.shutdown()``, and a reference still alive then can no longer be read, nor is
its object ever freed: so a file also goes when the Ray session that made it ends.
Each session is the process's connection to Ray (its core worker); its end is seen
when ``ray.shutdown()`` drops the session's node handle, and, should anything else
keep that handle, at the next ``ray.init`` at the latest. Whatever is left goes as
the process exits. A process killed before any of these leaves its files to the
next file made on the node, which removes those of dead processes.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from collective.ray_plugins import segment


@dataclass(frozen=True)
class _Held:
    meta: Any
    path: str
    session: str


class HeldFiles:
    """The files this process holds, by object id, each with the metadata Ray got for it."""

    def __init__(self) -> None:
        """Hold nothing; unlink the earlier sessions' files at each ``ray.init``, all at exit."""
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._watched: set[str] = set()
        """The sessions whose end is watched."""
        hooks = _post_init_hooks()
        if hooks is not None:
            hooks.append(self._after_init)
        atexit.register(self.unlink_all)

    def get(self, obj_id: str) -> Any:
        """Return the metadata of object ``obj_id``'s file, or None if none is held."""
        with self._lock:
            held = self._held.get(obj_id)
        return None if held is None else held.meta

    def add(self, obj_id: str, meta: Any, path: str) -> None:
        """Hold ``path``, the file of object ``obj_id``, until it is freed or its session ends."""
        session, node = _session()
        with self._lock:
            self._held[obj_id] = _Held(meta, path, session)
            watch = node is not None and session not in self._watched
            if watch:
                self._watched.add(session)
        if watch:
            weakref.finalize(node, self._end, lambda s: s == session)

    def release(self, obj_id: str) -> None:
        """Unlink the file of object ``obj_id``, if it is held."""
        with self._lock:
            held = self._held.pop(obj_id, None)
        if held is not None:
            segment.unlink(held.path)

    def unlink_all(self) -> None:
        """Unlink every file held, as the process exits."""
        self._end(lambda _: True)

    def _after_init(self) -> None:
        """Unlink the files of the sessions before the one ``ray.init`` has just begun."""
        session, _ = _session()
        self._end(lambda s: s != session)

    def _end(self, ended: Any) -> None:
        """Unlink the files of every session ``s`` for which ``ended(s)`` is true."""
        with self._lock:
            gone = [k for k, held in self._held.items() if ended(held.session)]
            paths = [self._held.pop(k).path for k in gone]
            self._watched = {s for s in self._watched if not ended(s)}
        for path in paths:
            segment.unlink(path)


def _session() -> tuple[str, Any]:
    """Return this process's Ray session (its core worker's id) and its node handle.

    ("", None) outside a Ray session.
    """
    from ray._private import worker

    current: Any = worker.global_worker
    try:
        return str(current.worker_id.hex()), getattr(current, "node", None)
    except AttributeError:  # no core worker: not connected
        return "", None


def _post_init_hooks() -> list[Any] | None:
    """Return Ray's list of functions run after each ``ray.init``, if this Ray has one."""
    from ray._private import worker

    hooks = getattr(worker, "_post_init_hooks", None)
    return hooks if isinstance(hooks, list) else None
