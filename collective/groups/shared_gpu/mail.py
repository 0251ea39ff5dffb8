"""Send and recv between two ranks on one GPU, through the sender's device mailboxes.

The host side is shared memory's (``groups.shm.sendrecv``): per ordered pair, the
chunks the sender posted and the chunks the receiver consumed, and each message's
size and dtype in the host mailbox's header, so a receiver whose buffer does not
match reads the whole message anyway (the pair stays in step) and raises. The bytes
move through the sender's device mailboxes towards the receiver, ordered by events
as the collective steps are (``steps``): the sender records its ``mail_posted`` event
of the box before posting the chunk, the receiver's stream waits on it after seeing
the post, and the same the other way for ``mail_consumed``. Sends and receives run
on the stream that was current when they were called, from their own lane threads.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from collective import signature
from collective.groups.shared_gpu.arena import DeviceSlots
from collective.groups.shm.arena import Arena
from collective.groups.shm.sendrecv import MessageMismatchError, SendRecv
from collective.groups.shm.sync import Waiter


class DeviceSendRecv(SendRecv):
    """One local rank's sends and receives with the other ranks of its GPU."""

    def __init__(self, arena: Arena, local_rank: int, waiter: Waiter, slots: DeviceSlots) -> None:
        """Send and receive as ``local_rank``: counters in ``arena``, bytes in ``slots``' boxes."""
        super().__init__(arena, local_rank, waiter)
        self._slots = slots
        self._device = slots.device
        self._nbuf = slots.mail_nbuf
        self._capacity = slots.mail_bytes

    def _header(self, sender: int, receiver: int, chunk: int) -> np.ndarray:
        return self._arena.mailbox(sender, receiver, chunk % self._nbuf)[:16].view(np.int64)

    def send(self, data: Any, peer: int, dtype_code: int, deadline: float, stream: int = 0) -> None:
        """Send the bytes ``data`` to local rank ``peer``; returns once all are in its mailboxes.

        The copies into the mailboxes are issued on ``stream``.
        """
        wait, advance, device = self._waiter.wait, self._waiter.advance, self._device
        posted, consumed = self._out_posted[peer], self._out_consumed[peer]
        me, slots = self._me, self._slots
        for start, end in self._chunks(data.size):
            chunk = self._sent[peer]
            box = chunk % self._nbuf
            wait(consumed, chunk - self._nbuf + 1, deadline)
            if chunk >= self._nbuf:
                device.wait(stream, slots.mail_consumed[peer][me][box])
            header = self._header(me, peer, chunk)
            header[0], header[1] = data.size, dtype_code
            slots.mail[me][peer][box][: end - start] = data[start:end]
            device.record(slots.mail_posted[me][peer][box], stream)
            self._sent[peer] = chunk + 1
            advance(posted, chunk + 1)

    def recv(self, data: Any, peer: int, dtype_code: int, deadline: float, stream: int = 0) -> None:
        """Receive into the bytes ``data`` what local rank ``peer`` sends, in place, on ``stream``.

        Raises:
            MessageMismatchError: the message's size or dtype differs from ``data``'s; the whole
                message has been read, and ``data`` left unchanged.

        """
        wait, advance, device = self._waiter.wait, self._waiter.advance, self._device
        posted, consumed = self._in_posted[peer], self._in_consumed[peer]
        me, slots = self._me, self._slots
        chunk = self._received[peer]
        wait(posted, chunk + 1, deadline)
        header = self._header(peer, me, chunk)
        total, code = int(header[0]), int(header[1])
        fits = total == data.size and code == dtype_code
        for start, end in self._chunks(total):
            chunk = self._received[peer]
            box = chunk % self._nbuf
            wait(posted, chunk + 1, deadline)
            device.wait(stream, slots.mail_posted[peer][me][box])
            if fits:
                data[start:end] = slots.mail[peer][me][box][: end - start]
            device.record(slots.mail_consumed[me][peer][box], stream)
            self._received[peer] = chunk + 1
            advance(consumed, chunk + 1)
        if not fits:
            raise MessageMismatchError(
                f"local rank {peer} sent {signature.buffer_text(code, total)}, but this rank "
                f"receives into {signature.buffer_text(dtype_code, data.size)}; the message was "
                "dropped and nothing was written"
            )
