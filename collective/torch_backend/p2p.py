"""send and recv with torch's tags, and recv from any source, over the group's send and recv.

Every message goes as two of the group's sends to its peer: a header of three int64
words (the tag, the dtype's code, the element count), then the data. The group moves
a pair's messages in order, so a receiver reads the next header from a peer and knows
the next message before it touches its tensor:

- ``recv(src, tag)`` takes the first message from ``src`` with ``tag``. A message
  of another tag that comes first is read into a tensor of its own and kept for the
  receive that asks for its tag (as Gloo matches by tag too).
- A message whose dtype or element count differs from the receiving tensor is read
  and dropped, and the receive raises a ``ValueError`` saying what came: nothing is
  written, and the pair stays in step.
- ``recv_anysource(tag)`` learns its source from the headers: it reads ahead the
  next header of every peer (a receive of the group that waits as long as it takes,
  since a peer may never send again) and takes the first message with ``tag`` that
  arrives, kept or new. The headers read ahead serve the next receives from those
  peers. It waits for the receives posted before it on this rank to end, and the
  receives posted after it wait for it: messages are matched in the order their
  receives were posted.

Receives from one peer run in order on a lane of their own, so a receive from one
peer never waits behind one from another. Each wait of a receive (for a header, for
the data) ends by the group's timeout and raises ``CollectiveTimeoutError`` naming the
peer; the group's sends and receives run with the group's timeout, so each keeps one
launch in the group's cache, whatever the deadline left.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta

import torch

from collective.frameworks.dtypes import CODES, NAMES
from collective.groups.cpu.group import CpuGroup
from collective.groups.lanes import Lanes
from collective.ops.calls import RECV, SEND, call
from collective.types import LONGEST_TIMEOUT, ArgumentValueError, CollectiveTimeoutError
from collective.work import Work

_PAUSES_S = (0.00005, 0.002)
"""First and longest sleep of a receive from any source between two looks at its peers."""

ANY = -1
"""The source of a receive from any source."""


class Message:
    """A header read from a peer: the next message's tag, dtype code and element count."""

    __slots__ = ("code", "count", "tag")

    def __init__(self, words: list[int]) -> None:
        self.tag, self.code, self.count = words

    def fits(self, tensor: torch.Tensor) -> bool:
        """Return whether ``tensor`` has this message's dtype and element count."""
        return CODES.get(str(tensor.dtype)[6:]) == self.code and tensor.numel() == self.count

    def describe(self) -> str:
        """Return the message as words: "4 float32 elements"."""
        name = NAMES[self.code] if 0 <= self.code < len(NAMES) else f"dtype code {self.code}"
        return f"{self.count} {name} elements"


class PointToPoint:
    """One rank's sends and receives on a group, with tags and receives from any source."""

    def __init__(self, group: CpuGroup) -> None:
        """Send and receive on ``group``."""
        self._group = group
        self._lanes = Lanes(f"torch-{group.group_name}")
        self._lock = threading.Lock()
        self._kept: dict[int, deque[tuple[int, torch.Tensor]]] = {}
        """Messages read for a tag nobody asked for yet, by peer, in arrival order."""
        self._ahead: dict[int, tuple[Work, torch.Tensor]] = {}
        """The header receive read ahead from each peer, by a receive from any source."""
        self._posted: dict[int, Work] = {}
        """The last receive posted from each peer (``ANY`` for any source) and not yet ended."""

    # --- send ---------------------------------------------------------------------------------

    def send(self, tensor: torch.Tensor, dst: int, tag: int, async_op: bool) -> Work | None:
        """Send ``tensor`` to ``dst`` with ``tag``: its header, then its data.

        Returns the data's ``Work`` when ``async_op`` (it ends after the header's).
        """
        code = CODES.get(str(tensor.dtype)[6:], -1)
        header = torch.tensor([tag, code, tensor.numel()], dtype=torch.int64)
        group = self._group
        call(SEND, group, header, None, dst, None, async_op)
        return call(SEND, group, tensor, None, dst, None, async_op)

    # --- receive ------------------------------------------------------------------------------

    def recv(
        self, tensor: torch.Tensor, src: int, tag: int, timeout: timedelta, async_op: bool
    ) -> Work | None:
        """Receive into ``tensor`` the first message from ``src`` (``ANY``: any peer) with ``tag``.

        Returns the receive's ``Work`` when ``async_op``; its ``source`` is the peer.
        """
        box: list[int] = []
        lane = "recv-any" if src == ANY else f"recv-{src}"
        with self._lock:
            before = [w for w in self._before(src) if not w.is_completed()]

            def body() -> None:
                for work in before:
                    work.wait(timeout)
                deadline = time.monotonic() + timeout.total_seconds()
                box.append(self._receive(tensor, src, tag, deadline, timeout))

            if async_op:
                task = self._lanes.run(lane, body, self._expired(src), True)
                if task is None:
                    raise RuntimeError("an async receive returned no Work")
                self._posted[src] = task
                return _Received(task, box)
        self._lanes.run(lane, body, self._expired(src), False)
        return None

    def _before(self, src: int) -> list[Work]:
        """Return the receives that must end before one from ``src`` starts."""
        if src == ANY:
            return list(self._posted.values())
        return [w for s, w in self._posted.items() if s in (src, ANY)]

    def _receive(
        self, tensor: torch.Tensor, src: int, tag: int, deadline: float, timeout: timedelta
    ) -> int:
        """Receive the first message from ``src`` with ``tag`` into ``tensor``; return who sent."""
        while True:
            found = self._take_kept(src, tag)
            if found is not None:
                peer, kept = found
                message = Message([tag, CODES.get(str(kept.dtype)[6:], -1), kept.numel()])
                self._check_fits(message, tensor, peer)
                tensor.copy_(kept.view(tensor.shape))
                return peer
            peer, message = self._next_header(src, deadline, timeout)
            if message.tag == tag:
                if not message.fits(tensor):
                    self._read(peer, message)
                    self._check_fits(message, tensor, peer)
                call(RECV, self._group, tensor, None, peer, None, False)
                return peer
            kept = self._read(peer, message)
            with self._lock:
                self._kept.setdefault(peer, deque()).append((message.tag, kept))

    def _take_kept(self, src: int, tag: int) -> tuple[int, torch.Tensor] | None:
        """Take the first message kept from ``src`` (``ANY``: any peer) with ``tag``, if any."""
        with self._lock:
            peers = list(self._kept) if src == ANY else [src]
            for peer in peers:
                kept = self._kept.get(peer)
                for i, (t, data) in enumerate(kept or ()):
                    if t == tag and kept is not None:
                        del kept[i]
                        return peer, data
        return None

    def _next_header(self, src: int, deadline: float, timeout: timedelta) -> tuple[int, Message]:
        """Return the next header from ``src``, or from whichever peer's comes first for ``ANY``."""
        if src != ANY:
            ahead = self._ahead.pop(src, None)
            if ahead is None:
                words = torch.zeros(3, dtype=torch.int64)
                call(RECV, self._group, words, None, src, None, False)
                return src, Message(words.tolist())
            ahead[0].wait(_left(deadline))
            return src, Message(ahead[1].tolist())
        pause = _PAUSES_S[0]
        while True:
            for peer in range(self._group.world_size):
                if peer == self._group.rank:
                    continue
                ahead = self._ahead.get(peer)
                if ahead is None:
                    ahead = self._ahead[peer] = self._read_ahead(peer)
                if ahead[0].is_completed():
                    del self._ahead[peer]
                    ahead[0].wait()
                    return peer, Message(ahead[1].tolist())
            if time.monotonic() > deadline:
                raise CollectiveTimeoutError(
                    "recv",
                    self._group.group_name,
                    self._group.rank,
                    timeout,
                    "no rank sent this rank a message in time (a receive from any source)",
                )
            time.sleep(pause)
            pause = min(2 * pause, _PAUSES_S[1])

    def _read_ahead(self, peer: int) -> tuple[Work, torch.Tensor]:
        """Start receiving the next header from ``peer``, however long it takes to come."""
        words = torch.zeros(3, dtype=torch.int64)
        work = call(RECV, self._group, words, None, peer, LONGEST_TIMEOUT, True)
        if work is None:
            raise RuntimeError("an async receive returned no Work")
        return work, words

    def _read(self, peer: int, message: Message) -> torch.Tensor:
        """Receive ``message``'s data from ``peer`` into a tensor of its own and return it."""
        if not 0 <= message.code < len(NAMES):
            raise ArgumentValueError(
                f"rank {peer} sent a message of dtype code {message.code}, which this "
                "library does not know"
            )
        data = torch.empty(message.count, dtype=getattr(torch, NAMES[message.code]))
        call(RECV, self._group, data, None, peer, None, False)
        return data

    def _check_fits(self, message: Message, tensor: torch.Tensor, peer: int) -> None:
        if not message.fits(tensor):
            raise ArgumentValueError(
                f"rank {peer} sent {message.describe()} with tag {message.tag}, but rank "
                f"{self._group.rank} receives into a tensor of {tensor.numel()} "
                f"{str(tensor.dtype)[6:]} elements; the message was dropped and the tensor "
                "left unchanged"
            )

    def _expired(self, src: int) -> Callable[[timedelta], BaseException]:
        group = self._group

        def expired(waited: timedelta) -> BaseException:
            peer = "any rank" if src == ANY else f"rank {src}"
            error = CollectiveTimeoutError(
                "recv", group.group_name, group.rank, waited, f"{peer} sent nothing in time"
            )
            group.abort(str(error))
            return error

        return expired

    def close(self, reason: str) -> None:
        """End every receive pending here with ``reason``; the group is being destroyed."""
        from collective.types import CollectiveError

        self._lanes.stop(CollectiveError(reason))


class _Received(Work):
    """A receive's ``Work`` that also tells which peer sent the message, once it has ended."""

    def __init__(self, task: Work, box: list[int]) -> None:
        self._task = task
        self._box = box

    def wait(self, timeout: timedelta | None = None) -> None:
        """Block until the message is received, or raise why it was not."""
        self._task.wait(timeout)

    def is_completed(self) -> bool:
        """Return whether the receive has ended."""
        return self._task.is_completed()

    def exception(self) -> BaseException | None:
        """Return the receive's failure once it has ended with one."""
        return self._task.exception()

    @property
    def source(self) -> int:
        """Return the peer the message came from; -1 until it has come."""
        return self._box[0] if self._box else -1


def _left(deadline: float) -> timedelta:
    return timedelta(seconds=max(deadline - time.monotonic(), 0.001))
