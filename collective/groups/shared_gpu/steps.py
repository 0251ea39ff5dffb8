"""The step protocol on device slots: the host's counters, plus events on the caller's stream.

``DeviceSteps`` is the shared-memory ``Steps`` (who may write a slot, who has read it,
which op a step carries, checked on the host before any data is read) with the slots
in device memory and four more calls that order the GPU work of different processes
without any kernel waiting for another process:

- ``post``: record this rank's ``posted`` event of the slot on the stream, then
  publish the step on the host;
- ``collect``: wait on the host for the writer's step (and check its signature),
  then make the stream wait on the writer's ``posted`` event;
- ``done``: record this rank's ``consumed`` event of the slot, then publish it;
- ``free``: wait on the host until every other rank has consumed the slot's last
  step, then make the stream wait on their ``consumed`` events;
- ``use`` and ``end``: an op on another stream than the previous one first waits for
  that op's end, so a ``consumed`` record covers every read this rank queued before it.

An event is recorded before the host counter that announces it and waited on only
after that counter is seen, so each wait captures the record it needs
(``cudaStreamWaitEvent`` uses the state the event had when the wait was called). A
rank records a slot's ``posted`` event again only after every other rank has
consumed the slot, so a waiter never sees a later step's record in its place.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from collective.groups.shared_gpu.arena import DeviceSlots
from collective.groups.shm.arena import Arena
from collective.groups.shm.steps import Steps
from collective.groups.shm.sync import Waiter


class DeviceSteps(Steps):
    """One local rank's side of the step protocol over device slots, on one stream at a time."""

    def __init__(
        self,
        arena: Arena,
        local_rank: int,
        waiter: Waiter,
        slots: DeviceSlots,
        ranks: Sequence[int] | None = None,
    ) -> None:
        """Take part as ``local_rank``: the host side in ``arena``, the data in ``slots``.

        ``arena`` holds the counters and slot headers (its own slots stay unused);
        ``slots`` must have been opened, with ``arena``'s ``nbuf``.
        """
        super().__init__(arena, local_rank, waiter, ranks)
        if slots.nbuf != self.nbuf:
            raise ValueError(f"expecting {self.nbuf} device slots per rank, got {slots.nbuf}")
        self.slot_bytes = slots.slot_bytes
        self.slots = slots.views
        self._device = slots.device
        self._posted = slots.posted
        self._consumed = slots.consumed
        self.stream = 0
        """The stream the op in progress runs on; set by ``use`` before each op."""
        self._ended = self._device.new_event()
        """Recorded on an op's stream as it ends (``end``); the next op, on another stream,
        waits on it first (``use``)."""
        self._any = False

    def use(self, stream: int) -> None:
        """Run the next op's steps on ``stream``, ordered after every earlier op's work.

        A rank's ``consumed`` event says it has read a slot only for the stream it was
        recorded on: an op on another stream records it there, and a writer waiting on
        that record would overwrite the slot while a read queued on the earlier stream
        is still pending. So a new stream first waits for the previous op's end.
        """
        if stream != self.stream and self._any:
            self._device.wait(stream, self._ended)
        self.stream = stream

    def end(self, *, quiet: bool = False) -> None:
        """Mark the end of the op just issued on its stream; ``quiet`` (it failed): never raise."""
        try:
            self._device.record(self._ended, self.stream)
            self._any = True
        except Exception:
            if not quiet:
                raise

    def free(self, step: int, deadline: float) -> None:
        """Wait until every other rank has read this rank's slot of ``step``'s last use."""
        super().free(step, deadline)
        if step - self.nbuf + 1 <= 0:
            return
        buffer, wait, stream = step % self.nbuf, self._device.wait, self.stream
        for rank in self.others:
            wait(stream, self._consumed[rank][buffer])

    def post(self, step: int) -> None:
        """Record that this rank's slot of ``step`` is written, then announce it."""
        self._device.record(self._posted[self.rank][step % self.nbuf], self.stream)
        super().post(step)

    def collect(self, rank: int, step: int, deadline: float) -> None:
        """Wait until ``rank`` posted ``step`` (same op), then order the stream after its write."""
        super().collect(rank, step, deadline)
        self._device.wait(self.stream, self._posted[rank][step % self.nbuf])

    def done(self, step: int) -> None:
        """Record that this rank has read every slot of ``step``, then announce it."""
        self._device.record(self._consumed[self.rank][step % self.nbuf], self.stream)
        super().done(step)

    def put(self, target: Any, values: np.ndarray) -> None:
        """Write the host array ``values`` into ``target``, a part of a device slot.

        cupy fills a device array from a scalar only: the values go up through
        ``cupy.asarray``, on the current stream, which is the op's.
        """
        if isinstance(target, np.ndarray):
            target[...] = values
        else:
            target[...] = sys.modules["cupy"].asarray(values)

    def release(self) -> None:
        """Drop every view of the host arena and of the device slots; no step may follow.

        The end-of-op event is destroyed: CUDA keeps it until a pending wait used it.
        """
        super().release()
        self._posted, self._consumed = [], []
        ended, self._ended = self._ended, 0
        if ended:
            self._device.destroy_event(ended)
