"""The shared-GPU transport of one set of ranks on one GPU: connect, run ops, fail, close.

``SharedGpu`` connects once, through the group's store: the set's first rank makes
the host arena (counters and step headers, in ``/dev/shm``) and every rank maps it;
every rank allocates its device slots and events and publishes their IPC handles;
every rank opens the others', and checks that it reads what each peer wrote there
(``verify``). The host arena's file is unlinked as soon as every
rank has mapped it, so a killed process leaves no file. Every op then runs the
shared-memory collectives over the device slots (``DeviceSteps``), on the stream the
caller passes, with host waits bounded by the op's deadline; a peer that dies is seen
from its pid, and ``abort`` stops every local peer's waits at once.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from datetime import timedelta
from typing import Any, TypeVar

from collective.frameworks.bytelist import ByteList
from collective.groups import topology
from collective.groups.shared_gpu import verify
from collective.groups.shared_gpu.arena import DeviceSlots, Exported
from collective.groups.shared_gpu.device import Device
from collective.groups.shared_gpu.mail import DeviceSendRecv
from collective.groups.shared_gpu.reduce import DeviceReducer
from collective.groups.shared_gpu.steps import DeviceSteps
from collective.groups.shm import arena as shm_arena
from collective.groups.shm.algorithms import Collectives
from collective.groups.shm.arena import PID, UNMAPPED, Arena, Layout
from collective.groups.shm.kernels import Reducer
from collective.groups.shm.lists import broadcast_list
from collective.groups.shm.sync import Counter, Liveness, Waiter
from collective.rendezvous.store import RendezvousStore
from collective.types import ReduceOp

SLOT_BYTES = 32 << 20
"""Device bytes per slot; each rank has ``NBUF`` of them. 64 MiB of device memory per
rank moves a 1 GiB message in 32 steps."""

SLOT_BYTES_ENV = "COLLECTIVE_GPU_SLOT_BYTES"
"""Overrides ``SLOT_BYTES`` (a multiple of 256 of at least 256 per rank of the set)."""

NBUF = 2
"""Slots per rank: a writer runs at most one step ahead of its slowest reader."""

MAIL_BYTES = 4 << 20
"""Device bytes per mailbox of a sender towards one receiver; ``MAIL_NBUF`` of them."""

MAIL_NBUF = 2
"""Mailboxes per ordered pair: a sender runs at most one chunk ahead of its receiver."""

CLOSE_WAIT_S = 5.0
"""The longest ``close`` waits for the other ranks to unmap this rank's slots."""

SETTLE_S = 5.0
"""The longest ``close`` waits for this rank's queued device work before it unmaps."""

REAP_S = 600.0
"""How long slots a late peer still maps wait to be freed, from a thread, after ``close``."""

T = TypeVar("T")


def slot_bytes_for(local_size: int, slot_bytes: int | None = None) -> int:
    """Return the device slot size: ``slot_bytes``, else the variable, else ``SLOT_BYTES``.

    Raises:
        ValueError: the size is no multiple of 256, or under 256 bytes per rank.

    """
    if slot_bytes is None:
        slot_bytes = int(os.environ.get(SLOT_BYTES_ENV) or SLOT_BYTES)
    if slot_bytes % 256 or slot_bytes < 256 * local_size:
        raise ValueError(
            f"slot_bytes must be a multiple of 256 of at least 256 per rank on the GPU "
            f"({256 * local_size}), got {slot_bytes}"
        )
    return slot_bytes


class SharedGpu:
    """The collectives of one set of ranks that share a GPU; see the module docstring."""

    def __init__(
        self,
        device: Device,
        store: RendezvousStore,
        ranks: Sequence[int],
        local_rank: int,
        timeout: timedelta,
        *,
        prefix: str = "gpu/shared",
        slot_bytes: int | None = None,
        cupy: Any = None,
        interrupted: Callable[[], str | None] = lambda: None,
    ) -> None:
        """Connect as ``local_rank`` of the set whose group ranks are ``ranks``.

        Args:
            device: the GPU, current in this process.
            store: where the set's ranks meet; keys go under ``prefix``.
            ranks: the group's ranks on this GPU, ascending; ``ranks[local_rank]`` is this one.
            local_rank: this rank's index in ``ranks``.
            timeout: how long to wait for the others at connect.
            prefix: the store keys' prefix, unique to this set and group.
            slot_bytes: the device slot size (see ``slot_bytes_for``).
            cupy: the cupy module for reductions on the device; None reduces with numpy
                (the host stand-in of the tests).
            interrupted: returns why every wait must end now, or None; called between
                sleeps.

        Raises:
            TimeoutError: a rank did not arrive within ``timeout``.
            MappingError: a rank read other bytes through its mapping of a peer's
                memory than the peer wrote; every rank raises it.
            ValueError: a bad ``slot_bytes``.
            OSError: the host arena could not be made or mapped.
            Exception: the device refused; nothing made here is left behind.

        """
        self.ranks = list(ranks)
        self.size = len(self.ranks)
        self.local_rank = local_rank
        self.device = device
        self._store = store
        self._prefix = prefix
        self._timeout = timeout
        self._cupy = cupy
        self._reducers: dict[tuple[ReduceOp, str, int], Reducer] = {}
        self.arena: Arena | None = None
        self.liveness: Liveness | None = None
        self.slots: DeviceSlots | None = None
        self.steps: DeviceSteps | None = None
        self.collectives: Collectives | None = None
        self.mail: DeviceSendRecv | None = None
        self.waiter: Waiter | None = None
        try:
            self._connect(slot_bytes_for(self.size, slot_bytes), interrupted)
        except verify.MappingError:
            self.close()  # every rank fails here: each waits for the others to unmap its slots
            raise
        except BaseException:
            self._release(wait_s=0.0)
            raise

    def _exchange(self, name: str, value: Any) -> list[Any]:
        """Return every local rank's ``value`` for the step ``name`` of connecting."""
        key = f"{self._prefix}/{name}"
        return topology.exchange(self._store, key, self.local_rank, self.size, value, self._timeout)

    def _connect(self, slot_bytes: int, interrupted: Callable[[], str | None]) -> None:
        """Map the host arena, make and open the device slots, and start the steps."""
        layout = Layout.for_ranks(self.size, 64 * self.size)
        if self.local_rank == 0:
            self.arena = shm_arena.create(layout)
            path = self._exchange("arena", self.arena.path)[0]
        else:
            path = self._exchange("arena", "")[0]
            self.arena = shm_arena.attach(path, layout)
        self.arena.control[self.local_rank, PID] = os.getpid()
        pids = self._exchange("pids", os.getpid())
        if self.local_rank == 0:
            shm_arena.unlink(path)
        self.liveness = Liveness(pids)
        self.slots = DeviceSlots(
            self.device, self.local_rank, self.size, slot_bytes, NBUF, MAIL_BYTES, MAIL_NBUF
        )
        handles = self._exchange("handles", self.slots.exported().to_json())
        self.slots.open([Exported.from_json(h) for h in handles])
        verify.check(self.slots, self._exchange, self.ranks)  # a barrier: all have opened
        self.waiter = Waiter(self.arena, self.local_rank, self.liveness, interrupted)
        self.steps = DeviceSteps(self.arena, self.local_rank, self.waiter, self.slots, self.ranks)
        # A GPU reduces a whole half-chunk in one kernel: blocks sized for a core's
        # cache would only add launches.
        self.collectives = Collectives(self.steps, reduce_block_bytes=slot_bytes)
        self.mail = DeviceSendRecv(self.arena, self.local_rank, self.waiter, self.slots)

    def reducer(self, op: ReduceOp, dtype: str, divisor: int | None = None) -> Reducer:
        """Return the reducer of ``op`` on ``dtype``, made once per pair.

        Its AVG divides by ``divisor``: the ranks on this GPU by default, the whole
        group's for a group over several GPUs, whose stages sum.
        """
        divisor = self.size if divisor is None else divisor
        made = self._reducers.get((op, dtype, divisor))
        if made is None:
            if self._cupy is None:
                made = Reducer(op, dtype, divisor)
            else:
                made = DeviceReducer(op, dtype, divisor, self._cupy)
            self._reducers[(op, dtype, divisor)] = made
        return made

    def run(self, stream: int, op: Callable[..., T], *args: Any, collective: bool = True) -> T:
        """Run ``op(*args)`` with its array operations on ``stream``.

        With ``collective``, ``op`` takes collective steps (a method of ``collectives``,
        or ``broadcast_list``), which then order ``stream`` too, after the previous such
        op's work whatever its stream (``DeviceSteps.use``); the caller runs one such op
        at a time. Else ``op`` is a send or a receive, given its stream itself.
        """
        steps = self.steps
        if steps is None:
            raise RuntimeError("the shared-GPU transport is closed")
        with self.device.on_stream(stream):
            if not collective:
                return op(*args)
            steps.use(stream)
            try:
                result = op(*args)
            except BaseException:
                steps.end(quiet=True)
                raise
            steps.end()
            return result

    def broadcast_list(self, message: ByteList, root: int, deadline: float) -> None:
        """Copy local rank ``root``'s ``message`` (device memory) into every other rank's.

        Every byte is copied once into the root's slots and once out on each other
        rank, with the device's copies on the steps' stream; see ``lists.broadcast_list``.
        """
        steps, slots = self.steps, self.slots
        if steps is None or slots is None:
            raise RuntimeError("the shared-GPU transport is closed")
        copy, stream = self.device.copy, steps.stream

        def move(target: int, source: int, size: int) -> None:
            copy(target, source, size, stream)

        broadcast_list(steps, message, root, deadline, move, slots.addresses[root])

    def counters(self) -> list[Counter]:
        """Return every counter a rank may sleep on, to wake or abort its sleepers."""
        if self.steps is None or self.mail is None:
            return []
        return self.steps.all_counters() + self.mail.counters()

    def abort(self, reason: str) -> None:
        """Stop every local rank's waits now, with ``reason``."""
        if self.waiter is not None:
            self.waiter.abort(self.counters(), reason)

    def close(self) -> None:
        """Release everything: the peers' mappings, then (once they closed ours) our slots."""
        self._release(wait_s=min(CLOSE_WAIT_S, self._timeout.total_seconds()))

    def _release(self, wait_s: float) -> None:
        """Release what was made; wait up to ``wait_s`` for the peers to unmap our slots.

        This rank unmaps the peers' slots once its own queued device work is done, and
        says so in its control block; it frees its own once every other rank has said
        so or died. A peer that closes later than ``wait_s`` leaves that to a thread
        (``_free_later``), which keeps the host arena to read it.
        """
        arena, liveness, slots = self.arena, self.liveness, self.slots
        later = False
        try:
            with ExitStack() as stack:
                if slots is not None and self._settled(wait_s):
                    slots.close_peers()
                    if arena is not None:
                        arena.control[self.local_rank, UNMAPPED] = 1
                    if wait_s <= 0 or arena is None or liveness is None:
                        stack.callback(slots.free_own)
                    elif self._unmapped(arena, liveness, time.monotonic() + wait_s):
                        stack.callback(slots.free_own)
                    else:
                        later = True
                        self._free_later(slots, arena, liveness)
                if self.steps is not None:
                    self.steps.release()
                if self.mail is not None:
                    self.mail.release()
                if self.waiter is not None:
                    self.waiter.release()
        finally:
            if not later:
                if arena is not None:
                    self._close_arena(arena)
                if liveness is not None:
                    liveness.close()
            self.arena = self.liveness = None
            self.slots = self.steps = self.collectives = self.waiter = self.mail = None

    def _settled(self, wait_s: float) -> bool:
        """Return whether this rank's queued device work finished within ``SETTLE_S``.

        Work still queued (a stream waiting on the event of a peer that died) may use
        the slots: they are then left mapped and allocated, never freed under it.
        """
        if self.device.settle(max(wait_s, SETTLE_S)):
            return True
        warnings.warn(
            f"GPU work of the group's rank {self.ranks[self.local_rank]} did not finish "
            f"within {max(wait_s, SETTLE_S):.0f} s of its destroy: its device slots are left "
            "allocated, and the peers' left mapped",
            RuntimeWarning,
            stacklevel=4,
        )
        return False

    def _unmapped(self, arena: Arena, liveness: Liveness, deadline: float) -> bool:
        """Wait until ``deadline`` for every other rank to unmap this rank's slots, or die."""
        others = [r for r in range(self.size) if r != self.local_rank]
        while True:
            waiting = [r for r in others if not arena.control[r, UNMAPPED] and liveness.alive(r)]
            if not waiting:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)

    def _free_later(self, slots: DeviceSlots, arena: Arena, liveness: Liveness) -> None:
        """Free ``slots`` from a thread once the peers unmapped them or died (within ``REAP_S``)."""
        me = self.ranks[self.local_rank]

        def reap() -> None:
            try:
                if self._unmapped(arena, liveness, time.monotonic() + REAP_S):
                    slots.free_own()
                else:
                    warnings.warn(
                        f"rank {me}'s device slots stay allocated: a rank sharing its GPU "
                        f"still mapped them {REAP_S:.0f} s after the destroy",
                        RuntimeWarning,
                        stacklevel=1,
                    )
            except Exception as exc:  # a thread of its own: nobody to raise to
                warnings.warn(f"freeing device slots failed: {exc!r}", RuntimeWarning, stacklevel=1)
            finally:
                self._close_arena(arena)
                liveness.close()

        threading.Thread(target=reap, name="collective-free-slots", daemon=True).start()

    @staticmethod
    def _close_arena(arena: Arena) -> None:
        shm_arena.unlink(arena.path)
        arena.close()
