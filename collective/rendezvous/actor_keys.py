"""The store actor's key-value store: set, get, agree and delete keys of one incarnation.

``KeyMethods`` is a part of ``StoreActor``: the ranks of a group meet through
these calls (``RayRendezvousStore`` sends them). Each key lives in one
incarnation of the group; a call for an incarnation that is over returns the
reason it ended.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from collective.rendezvous.state import GroupState, Incarnation, wait_event


class KeyMethods:
    """Set, get, agree on and delete the keys of a group's incarnation."""

    if TYPE_CHECKING:  # what StoreActor provides
        _groups: dict[str, GroupState]
        _gone: OrderedDict[str, str]

    def _world(self, name: str, incarnation: str) -> Incarnation | None:
        """Return ``incarnation`` of ``name``: the current one, or the one being built."""
        group = self._groups.get(name)
        if group is None:
            return None
        if group.current.id == incarnation:
            return group.current
        building = group.building.following if group.building is not None else None
        return building if building is not None and building.id == incarnation else None

    def _gone_reason(self, name: str, incarnation: str) -> str:
        return self._gone.get(incarnation, f"group {name!r} no longer exists")

    async def set(self, name: str, incarnation: str, key: str, value: bytes) -> str | None:
        """Publish ``value`` under ``key``; return None, or why the incarnation is gone."""
        world = self._world(name, incarnation)
        if world is None:
            return self._gone_reason(name, incarnation)
        world.set(key, value)
        return None

    async def get(
        self, name: str, incarnation: str, key: str, timeout_s: float
    ) -> tuple[str, bytes | str | None]:
        """Return ``("ok", value)``, ``("timeout", None)`` or ``("gone", reason)``."""
        world = self._world(name, incarnation)
        deadline = time.monotonic() + timeout_s
        while world is not None and key not in world.values and not world.reason:
            event = world.events.setdefault(key, asyncio.Event())
            if not await wait_event(event, deadline):
                return "timeout", None
        if world is not None and key in world.values:
            return "ok", world.values[key]
        return "gone", self._gone_reason(name, incarnation)

    async def agree(
        self, name: str, incarnation: str, topic: str, rank: int, value: Any, timeout_s: float
    ) -> tuple[str, Any]:
        """Record ``rank``'s ``value`` on ``topic``; wait for every rank's, up to ``timeout_s``.

        Returns:
            ``("ok", None)`` once every rank of the incarnation voted the same value;
            ``("mismatch", {rank: value})`` once every rank voted and two votes
            differ, or at the timeout if two of those in differ; ``("timeout", ranks
            that voted)``; ``("gone", reason)`` when the incarnation is over.

        """
        world = self._world(name, incarnation)
        if world is None:
            return "gone", self._gone_reason(name, incarnation)
        deadline = time.monotonic() + timeout_s
        votes = world.vote(topic, rank, value)
        while len(votes) < (world.world_size or 0) and not world.reason:
            if not await wait_event(world.voted(topic), deadline):
                break
        if len(set(votes.values())) > 1:
            return "mismatch", dict(votes)
        if world.reason:
            return "gone", world.reason
        if len(votes) < (world.world_size or 0):
            return "timeout", sorted(votes)
        return "ok", None

    async def delete(self, name: str, incarnation: str, key: str) -> None:
        """Remove ``key`` if it is present."""
        world = self._world(name, incarnation)
        if world is not None and world.values.pop(key, None) is not None:
            world.events[key].clear()
