"""NCCL's mismatch check: the ranks compare each op's signature on the GPU, with no host sync.

NCCL never checks that its ranks make the same call: a count, dtype, root or op
that differs mixes data silently, or hangs. So, just ahead of each collective on
one GPU, every rank allreduces (MAX) its op's signature words ``w`` (see
``signature``, the encoding every transport compares) together with ``-w``: all
ranks agree on a word if and only if ``max(w) == -max(-w)``. The words of a launch
are put on the GPU once, when the launch is built, by a copy from pinned memory on
the op's stream; each call issues the small
allreduce into the next slot of a ring on the GPU, copies the slot to pinned host
memory and records the slot's event, all on the op's stream: three calls, no
wait. The result is read once the event has completed: at the group's next op,
in ``Work.wait``, in ``destroy_group``, or by the watchdog within a few
milliseconds, whichever comes first. The signature's allreduce is its own NCCL
call, so it completes even when the op after it hangs; a mismatch then names the
fields that differ rather than ending in a bare timeout.

With ``COLLECTIVE_NCCL_CHECK=side`` the check leaves the op's stream: its allreduce
runs on a communicator of its own (one per GPU, made with the first check) on the
group's comm stream of that GPU, and so does the copy of its words and result. The
words do not depend on the op's data, so that stream waits for nothing and the op's
stream carries only the op; NCCL keeps each communicator's kernels in order, so check
k still meets check k on every rank. NCCL's rule for several communicators on one GPU:
before 2.26 their operations must follow one global order set by stream dependencies
or synchronisation, which ``side`` does not set; from 2.26,
``NCCL_LAUNCH_ORDER_IMPLICIT=1`` makes NCCL order them as the host issues them (check
k, then op k, under the op lock), provided every GPU sees the same host order. That
order runs the check's kernel before the op's, not beside it (see docs/nccl.md).

Nothing of this runs during CUDA-graph capture. A group with ``COLLECTIVE_NCCL_CHECK=0``
in its environment skips the check.
"""

from __future__ import annotations

import os
import zlib
from collections import deque
from typing import Any

import numpy as np

from collective import signature
from collective.groups.nccl.cuda import NOT_READY
from collective.types import ArgumentValueError, CollectiveError, ReduceOp

CHECK_ENV = "COLLECTIVE_NCCL_CHECK"
"""Environment variable: 1 (the default) checks on the op's stream, ``side`` beside it, 0 not."""

OFF, STREAM, SIDE = "off", "stream", "side"
"""Where a group checks its ops' signatures (``mode``): nowhere, on the op's stream, beside it."""

_MODES = {
    **dict.fromkeys(("0", "false", "no", "off"), OFF),
    **dict.fromkeys(("1", "true", "yes", "on"), STREAM),
    SIDE: SIDE,
}

FIELDS = signature.FIXED
"""The signature words an NCCL op's check compares: the fixed part of its signature."""

WORDS = FIELDS + 1
"""Words per rank: a hash of the whole signature, then its fields."""

SLOTS = 64
"""Results in flight per group and GPU. An op that finds every slot unread first waits
(up to its timeout) for the oldest: the host never runs more than 64 checked ops ahead
of the GPU, and no op goes unchecked."""

_INT64, _MAX, _D2H = 4, 2, 2
"""``ncclInt64``, ``ncclMax``, ``cudaMemcpyDeviceToHost``."""

_COUNT = 2 * WORDS
"""Words a check reduces: the signature and its negatives."""


def mode() -> str:
    """Return where this process's NCCL groups check their ops: ``OFF``, ``STREAM`` or ``SIDE``.

    Raises:
        ArgumentValueError: ``COLLECTIVE_NCCL_CHECK`` holds another value.

    """
    raw = os.environ.get(CHECK_ENV, "1").strip().lower()
    found = _MODES.get(raw)
    if found is None:
        raise ArgumentValueError(f"{CHECK_ENV} must be 0, 1 or side, got {raw!r}")
    return found


ORDER_ENV = "NCCL_LAUNCH_ORDER_IMPLICIT"
"""NCCL's variable that orders the kernels of several communicators of a GPU as issued."""

SIDE_NCCL = 22600
"""The first NCCL (2.26.0, as ``ncclGetVersion`` codes it) that orders them so."""


def require_side(nccl: Any) -> None:
    """Refuse ``SIDE`` unless NCCL orders the check's communicator with the op's.

    NCCL's rule for several communicators on one GPU: before 2.26 their operations
    must follow one global order set by stream dependencies or synchronisation, which
    ``side`` does not set; from 2.26, ``NCCL_LAUNCH_ORDER_IMPLICIT=1`` makes NCCL order
    them as the host issues them (check k, then op k, under the op lock).

    Raises:
        ArgumentValueError: NCCL is older than 2.26, or the variable is not 1.

    """
    version = int(nccl.get_version())
    value = os.environ.get(ORDER_ENV, "")
    if version >= SIDE_NCCL and value.strip() == "1":
        return
    shown = f"{version // 10000}.{version // 100 % 100}.{version % 100}"
    raise ArgumentValueError(
        f"{CHECK_ENV}=side runs each check on a communicator of its own beside the op's, "
        f"which NCCL keeps in order only from 2.26 with {ORDER_ENV}=1 (here NCCL {shown}, "
        f"{ORDER_ENV}={value!r}); set {ORDER_ENV}=1 in every rank's environment, or use "
        f"{CHECK_ENV}=1"
    )


def enabled() -> bool:
    """Return whether this process's NCCL groups check each op's signature (the default)."""
    return mode() != OFF


def error(group_name: str, rank: int, found: str) -> CollectiveError:
    """Return the error of the mismatch that rank ``rank``'s check ``found`` in its group."""
    return CollectiveError(
        f"group {group_name!r}, found on rank {rank}: {found}; NCCL "
        "moved nothing right, and the group is unusable"
    )


def fields(op: str, x: Any, root: int, reduce_op: ReduceOp | None) -> list[int]:
    """Return the signature words of ``op`` on ``x`` that the ranks compare."""
    return list(signature.of_call(op, 0, x, root, reduce_op)[:FIELDS])


def words(op: str, x: Any, root: int, reduce_op: ReduceOp | None) -> np.ndarray:
    """Return ``[h, w..., -h, -w...]``: the signature ``w`` of ``op`` on ``x`` and its hash."""
    fields = signature.of_call(op, 0, x, root, reduce_op)[:FIELDS]
    digest = zlib.crc32(np.asarray(fields, dtype=np.int64).tobytes())
    mine = np.asarray([digest, *fields], dtype=np.int64)
    return np.concatenate([mine, -mine])


def differences(found: np.ndarray) -> list[str]:
    """Return a line per field on which the ranks disagree, from a slot's reduced words.

    The check learns each word's lowest and highest value among the ranks, so a line
    reads ``"dtype: float32 .. float64"``; a shape that differs reads ``"shape: differs"``.
    """
    high, low = found[1:WORDS], -found[WORDS + 1 :]
    lines: dict[str, str] = {}
    for i, name in enumerate(signature.FIELD_OF_WORD):
        if high[i] == low[i] or name in lines:
            continue
        if name == "shape":
            shown = "differs"
        else:
            shown = f"{signature.value(name, int(low[i]))} .. {signature.value(name, int(high[i]))}"
        lines[name] = f"{name}: {shown}"
    return list(lines.values()) or ["the signature hash"]


def kind_differences(mine: tuple[object, ...], theirs: tuple[object, ...]) -> str:
    """Return how two ranks' first-use kinds (``first.First.kind``) differ, as a check says it.

    A kind of a checked op is ``(op, *fields(...))``; any other is shown whole.
    """
    if len(mine) == len(theirs) == FIELDS + 1 and mine[0] == theirs[0]:
        a = np.asarray(mine[1:], dtype=np.int64)
        b = np.asarray(theirs[1:], dtype=np.int64)
        found = np.concatenate([[0], np.maximum(a, b), [0], -np.minimum(a, b)])
        return "; ".join(differences(found))
    return f"{mine!r} .. {theirs!r}"


class Check:
    """One group's signature checks on one GPU: the ring of results and their events."""

    def __init__(self, cupy: Any, device: int) -> None:
        """Allocate the ring on GPU ``device`` and in pinned host memory."""
        cuda = cupy.cuda
        self._cuda = cuda
        size = SLOTS * _COUNT
        with cuda.Device(device):
            self._ring = cupy.empty(size, dtype=np.int64)  # no kernel: written before read
            self._events = [cuda.Event(disable_timing=True) for _ in range(SLOTS)]
        self._pinned = cuda.alloc_pinned_memory(size * 8)
        self._host = np.frombuffer(self._pinned, dtype=np.int64, count=size)
        self._words = self._host.data
        ring, host = int(self._ring.data.ptr), int(self._pinned.ptr)
        self._slots = [
            (ring + slot * _COUNT * 8, host + slot * _COUNT * 8, event.ptr)
            for slot, event in enumerate(self._events)
        ]
        """Each slot's result on the GPU, its copy in pinned memory and its event's handle."""
        runtime = cuda.runtime
        self._copy, self._record = runtime.memcpyAsync, runtime.eventRecord
        self._next = 0
        self._pending: deque[tuple[int, str, Any]] = deque()

    def full(self) -> bool:
        """Return whether every slot holds a result not yet read: ``issue`` needs one read."""
        return len(self._pending) == SLOTS

    def oldest_event(self) -> Any:
        """Return the event of the oldest result not yet read (the ring is not empty)."""
        return self._events[self._pending[0][0]]

    def issue(self, op: str, send: Any, comm: Any, stream: int, keep: Any = None) -> None:
        """Queue the allreduce of ``send`` (the op's words) and the copy of its result.

        All three calls go on ``stream``: the op's own, or the group's comm stream
        when the group checks beside its ops (``SIDE``). ``keep`` (the words' buffers)
        is held until the result is read, so that the memory ``send`` points to is never
        freed, and handed to another allocation, while the allreduce may still read it.

        Raises:
            CollectiveError: the ring is full (``full``): the caller reads a slot first.

        """
        pending = self._pending
        if len(pending) == SLOTS:
            raise CollectiveError(f"the ring of {SLOTS} signature checks is full")
        slot = self._next
        self._next = slot + 1 if slot + 1 < SLOTS else 0
        result, host, event = self._slots[slot]
        comm.allReduce(send, result, _COUNT, _INT64, _MAX, stream)
        self._copy(host, result, _COUNT * 8, _D2H, stream)
        self._record(event, stream)
        pending.append((slot, op, keep))

    def read(self) -> str | None:
        """Read every finished result in order; return the first mismatch's message, if any.

        Raises:
            RuntimeError: CUDA reports an error for an event.

        """
        pending = self._pending
        runtime = self._cuda.runtime
        while pending:
            slot, op, _ = pending[0]
            status = runtime.eventQuery(self._events[slot].ptr)
            if status:
                if status == NOT_READY:
                    return None
                raise runtime.CUDARuntimeError(status)
            pending.popleft()
            base = slot * _COUNT
            if self._words[base] != -self._words[base + WORDS]:
                found = self._host[base : base + _COUNT]
                return f"{op}: the ranks called different ops or arguments; " + "; ".join(
                    differences(found)
                )
        return None

    def oldest(self) -> str:
        """Return the op of the oldest result not yet read."""
        return self._pending[0][1] if self._pending else "nccl signature check"

    def events(self) -> list[Any]:
        """Return the events of the results not yet read."""
        return [self._events[slot] for slot, _, _ in self._pending]
