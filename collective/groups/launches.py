"""A group's launches: what a call does, built once per call key and looked up after.

A launch is what one public op does on one rank once its arguments are checked:
the transport's calls, with everything that depends only on the call's key (the
op, each buffer's description, the root, the reduction, the timeout and
``async_op``) made ahead. It is called with the call's buffers and returns what
the public op returns: None for a blocking op, its ``Work`` for an async one.

The group keeps its launches in a bounded cache, ``Launches``; a failure, an abort
and a destroy empty it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any

from collective.work import Work

Launch = Callable[[Any], "Work | None"]
"""Runs one op on the call's buffer; returns the public op's result."""

Prepared = Callable[[Callable[[], tuple[Any, ...]]], Work]
"""Runs one op of a group (``BaseGroup.prepare``): called with a function that makes the
call's arguments for the group's op, which it makes only if it needs them."""

LAUNCHES_KEPT = 256
"""How many launches a group keeps; the oldest goes first."""


class Launches:
    """The launches of one group, by call key; at most ``LAUNCHES_KEPT``, the oldest dropped.

    ``get`` is the dict's own: a lookup runs no Python code of ours.
    """

    __slots__ = ("_kept", "_lock", "get")

    def __init__(self) -> None:
        """Start empty."""
        self._kept: dict[Hashable, Launch] = {}
        self._lock = threading.Lock()
        self.get = self._kept.get

    def keep(self, key: Hashable, launch: Launch) -> None:
        """Keep ``launch`` under ``key``, dropping the oldest one when full."""
        with self._lock:
            if len(self._kept) >= LAUNCHES_KEPT:
                self._kept.pop(next(iter(self._kept)))
            self._kept[key] = launch

    def run_first(self, key: Hashable | None, launch: Launch, args: Any, keep: bool = True) -> Any:
        """Run a call's new ``launch`` on ``args``; then keep it under ``key``.

        It is not kept when ``key`` is None (a call to check every time), when
        ``keep`` is False, or when it raised: a launch that failed is built anew.
        """
        result = launch(args)
        if keep and key is not None:
            self.keep(key, launch)
        return result

    def clear(self) -> None:
        """Drop every launch: the group failed, was aborted or destroyed."""
        with self._lock:
            self._kept.clear()

    def __len__(self) -> int:
        """Return how many launches are kept."""
        return len(self._kept)
