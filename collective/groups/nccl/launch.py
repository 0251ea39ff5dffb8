"""A launch: the NCCL calls one op makes, built once per call signature and issued many times.

An op's launch depends only on its call signature: the op, each buffer's address,
dtype, shape, strides and device, the caller's stream, the root, the reduction and
whether it is async. ``NcclLifecycle`` keeps launches in a bounded cache under that
key, so a repeated call does one dict lookup and the NCCL calls themselves: nothing
is checked, described or built again.

A launch never holds a caller's buffer, only its address: a buffer freed and
another made at the same address, of the same dtype and layout, gets the same calls,
which are then right for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from collective.groups.nccl.comm import discard_group
from collective.groups.nccl.first import First
from collective.groups.nccl.mismatch import Check
from collective.groups.nccl.watchdog import Marker

NcclCall = tuple[Callable[..., Any], tuple[Any, ...]]
"""One NCCL call of an op: a bound method of a communicator (or cupy's runtime), its arguments."""

DeviceCalls = Callable[[int, Any, int], list[NcclCall]]
"""Returns device i's calls: ``device_calls(i, communicator, stream_handle)``."""

LAUNCHES_KEPT = 256
"""How many launches a group keeps; the oldest goes first."""

_H2D = 1
"""``cudaMemcpyHostToDevice``."""

_POINT_TO_POINT = frozenset({"send", "recv"})
"""The ops a group does not count among its collectives."""


@dataclass(frozen=True)
class Signed:
    """The signature check of a launch: its words on the GPU and where they are reduced."""

    check: Check
    words: Any
    """The op's signature words on the GPU and in pinned memory, kept alive with the launch."""
    ptr: int
    comm: Any
    stream: int
    """The stream the check runs on: the op's own, or the group's comm stream (``mismatch``)."""
    device: int
    """The GPU of ``stream``, current while the check is issued (the legacy stream's handle
    names the current device's)."""


@dataclass(frozen=True)
class Launch:
    """The calls of one op on each of its devices, and the streams they run on.

    ``single`` is the one call of a launch that makes exactly one NCCL call on one
    device: it is issued alone, with no NCCL group call and no device switch (NCCL
    itself runs each call on its communicator's device). Every other launch is one
    NCCL group call, entering each device for its calls.
    """

    op: str
    devices: tuple[int, ...]
    calls: tuple[tuple[NcclCall, ...], ...]
    streams: tuple[int, ...]
    """The stream each device's calls run on: the caller's (blocking) or a comm stream."""
    markers: tuple[Marker, ...]
    """The watchdog's marker of each of ``streams``."""
    single: NcclCall | None
    signed: Signed | None = None
    """The op's signature check, issued just ahead of it; None for ops not checked."""
    callers: tuple[int, ...] = ()
    """The caller's current stream on each device, which the launch's key fixes: an
    async op's comm streams wait for them, and its ``Work.wait`` orders them after it."""
    counted: bool = True
    """Whether the group counts the op among its collectives: every op but send and recv,
    which two ranks issue (see ``groups.progress``)."""
    first: First | None = None
    """What the ranks agree on before the first launch of its kind (see ``first``)."""
    lock: Any = None
    """What holds the issue locks of ``devices`` (``guard.ISSUE.lock``), made once."""

    def issue(self, nccl: Any, cuda: Any) -> None:
        """Issue the calls; on a failure inside the NCCL group, discard the whole group.

        Raises:
            RuntimeError: NCCL or CUDA refused a call; no call of the op was launched.

        """
        single = self.single
        if single is not None:
            single[0](*single[1])
            return
        nccl.groupStart()
        try:
            for device, calls in zip(self.devices, self.calls, strict=True):
                with cuda.Device(device):
                    for method, args in calls:
                        method(*args)
        except BaseException:
            discard_group(nccl)
            raise
        nccl.groupEnd()


def build(
    op: str,
    devices: tuple[int, ...],
    comms: list[Any],
    streams: tuple[int, ...],
    device_calls: DeviceCalls,
    markers: tuple[Marker, ...],
    signed: Signed | None = None,
    callers: tuple[int, ...] = (),
) -> Launch:
    """Return the launch of ``device_calls`` on ``comms``, device i's calls on ``streams[i]``.

    ``callers`` are the caller's streams (see ``Launch.callers``); a blocking
    launch's ``streams`` are they.
    """
    calls = tuple(
        tuple(device_calls(i, comm, s))
        for i, (comm, s) in enumerate(zip(comms, streams, strict=True))
    )
    single = None
    if (
        len(calls) == 1
        and len(calls[0]) == 1
        and getattr(calls[0][0][0], "__self__", None) in comms
    ):
        single = calls[0][0]
    counted = op not in _POINT_TO_POINT
    return Launch(op, devices, calls, streams, markers, single, signed, callers, counted)


def signed(
    cupy: Any, check: Check, words: np.ndarray, device: int, comm: Any, stream: int
) -> Signed:
    """Return the signature check of a launch: ``words`` put on GPU ``device``, reduced on ``comm``.

    The words go up from pinned memory on ``stream``, the one the check runs on, with
    ``device`` current (the legacy stream's handle names the current device's), so they
    are in place when the check's allreduce reads them: no host synchronisation, and no
    ordering against any other stream.
    """
    cuda = cupy.cuda
    pinned = cuda.alloc_pinned_memory(words.nbytes)
    np.frombuffer(pinned, dtype=np.int64, count=words.size)[:] = words
    with cuda.Device(device):
        on_gpu = cupy.empty(words.size, dtype=np.int64)
        ptr = int(on_gpu.data.ptr)
        cuda.runtime.memcpyAsync(ptr, int(pinned.ptr), words.nbytes, _H2D, stream)
    return Signed(check, (on_gpu, pinned), ptr, comm, stream, device)
