"""Send and recv between two ranks of one node, through the pair's mailboxes.

Every ordered pair of local ranks has ``mail_nbuf`` mailboxes and two counters:
the chunks the sender has posted and the chunks the receiver has consumed. A
message is cut into chunks of one mailbox less its 64-byte header, which
carries the message's total size and dtype. A receiver whose buffer does not
match reads the whole message anyway, so the pair stays in step, then raises.
"""

from __future__ import annotations

import numpy as np

from collective import signature
from collective.groups.shm.arena import MAIL_CONSUMED, MAIL_POSTED, Arena
from collective.groups.shm.sync import Counter, Waiter

_HEADER = 64
"""Bytes at the start of each mailbox: the message's size and dtype code."""


class MessageMismatchError(Exception):
    """A received message's size or dtype differs from the receiving buffer's."""


def _pair_counter(arena: Arena, sender: int, receiver: int, word: int, owner: int) -> Counter:
    flags = arena.mail_flags(sender, receiver, word)
    cells = arena.mail_control[sender, receiver]
    return Counter(
        cells,
        word,
        arena.mail_address(sender, receiver, word),
        flags,
        flags.view(np.int64),
        owner,
    )


class SendRecv:
    """One local rank's sends and receives with the other ranks of its node.

    Sends to one peer run in issue order, as do receives from one peer; a send and
    a receive, or two peers, may proceed from different threads at once.
    """

    def __init__(self, arena: Arena, local_rank: int, waiter: Waiter) -> None:
        """Send and receive as ``local_rank`` of ``arena``."""
        self._arena = arena
        self._me = local_rank
        self._waiter = waiter
        layout = arena.layout
        self._nbuf = layout.mail_nbuf
        self._capacity = layout.mail_bytes - _HEADER
        size = layout.local_size
        self._sent = [0] * size
        self._received = [0] * size
        self._out_posted = [
            _pair_counter(arena, local_rank, p, MAIL_POSTED, local_rank) for p in range(size)
        ]
        self._out_consumed = [
            _pair_counter(arena, local_rank, p, MAIL_CONSUMED, p) for p in range(size)
        ]
        self._in_posted = [_pair_counter(arena, p, local_rank, MAIL_POSTED, p) for p in range(size)]
        self._in_consumed = [
            _pair_counter(arena, p, local_rank, MAIL_CONSUMED, local_rank) for p in range(size)
        ]

    def release(self) -> None:
        """Drop every view of the arena, so that it can be unmapped; no message may follow."""
        self._out_posted, self._out_consumed, self._in_posted, self._in_consumed = [], [], [], []

    def counters(self) -> list[Counter]:
        """Return every counter this rank may sleep on, to wake its sleepers."""
        return self._out_consumed + self._in_posted

    def _chunks(self, nbytes: int) -> list[tuple[int, int]]:
        if nbytes == 0:
            return [(0, 0)]
        step = self._capacity
        return [(a, min(a + step, nbytes)) for a in range(0, nbytes, step)]

    def send(self, data: np.ndarray, peer: int, dtype_code: int, deadline: float) -> None:
        """Send the bytes ``data`` to local rank ``peer``; returns once all are in its mailboxes."""
        wait, advance = self._waiter.wait, self._waiter.advance
        posted, consumed = self._out_posted[peer], self._out_consumed[peer]
        for start, end in self._chunks(data.size):
            chunk = self._sent[peer]
            wait(consumed, chunk - self._nbuf + 1, deadline)
            box = self._arena.mailbox(self._me, peer, chunk % self._nbuf)
            header = box[:16].view(np.int64)
            header[0], header[1] = data.size, dtype_code
            box[_HEADER : _HEADER + end - start] = data[start:end]
            self._sent[peer] = chunk + 1
            advance(posted, chunk + 1)

    def recv(self, data: np.ndarray, peer: int, dtype_code: int, deadline: float) -> None:
        """Receive into the bytes ``data`` what local rank ``peer`` sends, in place.

        Raises:
            MessageMismatchError: the message's size or dtype differs from ``data``'s; the whole
                message has been read, and ``data`` left unchanged.

        """
        wait, advance = self._waiter.wait, self._waiter.advance
        posted, consumed = self._in_posted[peer], self._in_consumed[peer]
        chunk = self._received[peer]
        wait(posted, chunk + 1, deadline)
        header = self._arena.mailbox(peer, self._me, chunk % self._nbuf)[:16].view(np.int64)
        total, code = int(header[0]), int(header[1])
        spans = self._chunks(total)
        for start, end in spans:
            chunk = self._received[peer]
            wait(posted, chunk + 1, deadline)
            box = self._arena.mailbox(peer, self._me, chunk % self._nbuf)
            if total == data.size and code == dtype_code:
                data[start:end] = box[_HEADER : _HEADER + end - start]
            self._received[peer] = chunk + 1
            advance(consumed, chunk + 1)
        if total != data.size or code != dtype_code:
            raise MessageMismatchError(
                f"local rank {peer} sent {signature.buffer_text(code, total)}, but this rank "
                f"receives into {signature.buffer_text(dtype_code, data.size)}; the message was "
                "dropped and nothing was written"
            )
