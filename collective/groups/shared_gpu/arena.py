"""The device slots of the ranks on one GPU: made, exported and opened once per group.

Every local rank allocates, as one ``cudaMalloc``, its own ``nbuf`` collective slots and
``mail_nbuf`` mailboxes towards each other local rank, and makes two interprocess
events per slot and per mailbox: ``posted`` (recorded once the rank wrote it) and
``consumed`` (recorded once the rank finished reading a step's slots, or a peer's
mailbox to it). It publishes the handles (``Exported``); every other local rank opens
each of them once (``DeviceSlots.open``). Nothing is opened, exported or allocated per
op.

Teardown (``close_peers`` on every rank, then ``free_own``) unmaps the peers' memory
and destroys the opened events before any owner frees what it exported: the
transport runs a host barrier between the two.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from collective.groups.shared_gpu.device import Device

SLOT_ALIGN = 256
"""Slots start at multiples of this many bytes, so every dtype's view is aligned."""


def _align(value: int, to: int) -> int:
    return (value + to - 1) // to * to


@dataclass(frozen=True)
class Exported:
    """One rank's handles: its slots' memory, and its posted and consumed events per slot."""

    memory: bytes
    posted: tuple[bytes, ...]
    consumed: tuple[bytes, ...]
    mail_posted: tuple[bytes, ...]
    """Per (receiver, mailbox), receiver-major: recorded by this rank once it wrote the box."""
    mail_consumed: tuple[bytes, ...]
    """Per (sender, mailbox), sender-major: recorded by this rank once it read the box."""

    def to_json(self) -> dict[str, Any]:
        """Return the handles as JSON-able hex strings."""
        return {name: [h.hex() for h in getattr(self, name)] for name in _EVENT_KINDS} | {
            "memory": self.memory.hex()
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Exported:
        """Return the handles that ``to_json`` wrote."""
        events = {name: tuple(bytes.fromhex(h) for h in data[name]) for name in _EVENT_KINDS}
        return cls(bytes.fromhex(data["memory"]), **events)


_EVENT_KINDS = ("posted", "consumed", "mail_posted", "mail_consumed")
"""The events of a rank, by kind, in the order ``DeviceSlots`` makes and opens them."""


class DeviceSlots:
    """One local rank's device slots, mailboxes and events, and those of the other local ranks.

    After ``open``, for every local rank ``r`` (this one or a peer, mapped here):
    ``views[r][b]`` is its slot ``b`` and ``addresses[r][b]`` that slot's address;
    ``posted[r][b]`` and ``consumed[r][b]`` its slot events; ``mail[r][q][b]`` is its
    mailbox ``b`` towards local rank ``q``, ``mail_posted[r][q][b]`` the event ``r``
    records once it wrote that box, and ``mail_consumed[r][q][b]`` the event ``r``
    records once it read box ``b`` that ``q`` wrote to it.
    """

    def __init__(
        self,
        device: Device,
        local_rank: int,
        local_size: int,
        slot_bytes: int,
        nbuf: int,
        mail_bytes: int,
        mail_nbuf: int,
    ) -> None:
        """Allocate this rank's slots and mailboxes, and make their events.

        Raises:
            Exception: the device refused; whatever was made is released first.

        """
        self.device = device
        self.local_rank = local_rank
        self.local_size = local_size
        self.slot_bytes = slot_bytes
        self.nbuf = nbuf
        self.mail_bytes = mail_bytes
        self.mail_nbuf = mail_nbuf
        self.stride = _align(slot_bytes, SLOT_ALIGN)
        self.mail_stride = _align(mail_bytes, SLOT_ALIGN)
        self._own_memory = 0
        self._own_events: list[int] = []
        self._opened_memory: list[int] = []
        self._opened_events: list[int] = []
        self.views: list[list[Any]] = []
        self.addresses: list[list[int]] = []
        self.mail: list[list[list[Any]]] = []
        n = local_size
        self.posted: list[list[int]] = [[] for _ in range(n)]
        self.consumed: list[list[int]] = [[] for _ in range(n)]
        self.mail_posted: list[list[list[int]]] = [[[] for _ in range(n)] for _ in range(n)]
        self.mail_consumed: list[list[list[int]]] = [[[] for _ in range(n)] for _ in range(n)]
        try:
            size = nbuf * self.stride + n * mail_nbuf * self.mail_stride
            self._own_memory = device.alloc(size)
            device.synchronize()  # the zero fill runs on the legacy stream: done before any use
            for kind, count in self._kinds(local_rank):
                for events in kind:
                    for _ in range(count):
                        event = device.new_event()
                        self._own_events.append(event)
                        events.append(event)
        except BaseException:
            self.free_own()
            raise

    def _kinds(self, rank: int) -> list[tuple[list[list[int]], int]]:
        """Return ``rank``'s event lists by kind (``_EVENT_KINDS`` order), and events per list."""
        return [
            ([self.posted[rank]], self.nbuf),
            ([self.consumed[rank]], self.nbuf),
            (self.mail_posted[rank], self.mail_nbuf),
            (self.mail_consumed[rank], self.mail_nbuf),
        ]

    def exported(self) -> Exported:
        """Return this rank's handles, for the other local ranks to open."""
        device = self.device
        flat = [
            tuple(device.export_event(e) for events in kind for e in events)
            for kind, _ in self._kinds(self.local_rank)
        ]
        return Exported(device.export_memory(self._own_memory), *flat)

    def open(self, exported: list[Exported]) -> None:
        """Open every other local rank's handles (``exported[rank]``), once each.

        Raises:
            ValueError: ``exported`` has no entry per local rank, or one with other counts.
            Exception: the device refused to open a handle; ``close_peers`` releases
                what was opened.

        """
        n = self.local_size
        if len(exported) != n:
            raise ValueError(f"expecting {n} ranks' handles, got {len(exported)}")
        device = self.device
        bases: list[int] = []
        for rank, handles in enumerate(exported):
            if rank == self.local_rank:
                bases.append(self._own_memory)
                continue
            counts = [len(getattr(handles, name)) for name in _EVENT_KINDS]
            expected = [self.nbuf, self.nbuf, n * self.mail_nbuf, n * self.mail_nbuf]
            if counts != expected:
                raise ValueError(
                    f"local rank {rank} exported {counts} events, expecting {expected}"
                )
            base = device.open_memory(handles.memory)
            self._opened_memory.append(base)
            bases.append(base)
            for (kind, count), name in zip(self._kinds(rank), _EVENT_KINDS, strict=True):
                found = iter(getattr(handles, name))
                for events in kind:
                    for _ in range(count):
                        event = device.open_event(next(found))
                        self._opened_events.append(event)
                        events.append(event)
        self.addresses = [[base + b * self.stride for b in range(self.nbuf)] for base in bases]
        self.views = [[device.view(a, self.slot_bytes) for a in mine] for mine in self.addresses]
        boxes = self.nbuf * self.stride
        self.mail = [[self._boxes(base + boxes, q) for q in range(n)] for base in bases]

    def regions(self, rank: int, ranks: Sequence[int]) -> list[tuple[str, int, int]]:
        """Return local rank ``rank``'s slots and mailboxes towards the others, as mapped here.

        Each is ``(name, address, bytes)``; a mailbox's name says its receiver's group
        rank (``ranks`` holds the local ranks' group ranks).
        """
        found = [(f"slot {b}", a, self.slot_bytes) for b, a in enumerate(self.addresses[rank])]
        boxes = self.addresses[rank][0] + self.nbuf * self.stride
        for q in range(self.local_size):
            first = boxes + q * self.mail_nbuf * self.mail_stride
            if q != rank:
                found += [
                    (f"mailbox {b} towards rank {ranks[q]}", first + b * self.mail_stride, size)
                    for b, size in enumerate([self.mail_bytes] * self.mail_nbuf)
                ]
        return found

    def _boxes(self, start: int, receiver: int) -> list[Any]:
        """Return the views of the boxes towards ``receiver``, of boxes that start at ``start``."""
        first = start + receiver * self.mail_nbuf * self.mail_stride
        return [
            self.device.view(first + b * self.mail_stride, self.mail_bytes)
            for b in range(self.mail_nbuf)
        ]

    def close_peers(self) -> None:
        """Drop the views, unmap every peer's memory and destroy every opened event."""
        self.views, self.addresses, self.mail = [], [], []
        device = self.device
        for event in self._opened_events:
            device.destroy_event(event)
        self._opened_events = []
        for ptr in self._opened_memory:
            device.close_memory(ptr)
        self._opened_memory = []
        for rank in range(self.local_size):
            if rank != self.local_rank:
                for kind, _ in self._kinds(rank):
                    for events in kind:
                        events.clear()

    def free_own(self) -> None:
        """Destroy this rank's events and free its memory; call after every peer closed them."""
        device = self.device
        for event in self._own_events:
            device.destroy_event(event)
        self._own_events = []
        memory, self._own_memory = self._own_memory, 0
        if memory:
            device.free(memory)
        for kind, _ in self._kinds(self.local_rank):
            for events in kind:
                events.clear()
