"""NCCL plumbing for ``NCCLGroup``: cupy, unique-ID exchange, communicators and their Work.

Nothing here imports cupy at module load; ``cupy_module`` does, on first use.
"""

from __future__ import annotations

import functools
import platform
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from collective import tensor
from collective.store import RendezvousStore
from collective.tensor import CudaBuffer
from collective.types import (
    ArgumentValueError,
    CollectiveError,
    CollectiveTimeoutError,
    ReduceOp,
)
from collective.work import OnceWork

NCCL_REDUCE_OPS: dict[ReduceOp, int] = {
    ReduceOp.SUM: 0,
    ReduceOp.PRODUCT: 1,
    ReduceOp.MAX: 2,
    ReduceOp.MIN: 3,
    ReduceOp.AVG: 4,
}
"""NCCL's ``ncclRedOp_t`` value of each reduction it supports (nccl.h; ncclAvg needs 2.10+)."""

UNIQUE_ID_BYTES = 128
"""The size of an ``ncclUniqueId``."""

INSTALL_HINT = (
    'pip install "collective[nccl]" (it installs cupy-cuda12x; for CUDA 13: cupy-cuda13x)'
)
"""What to install when cupy is missing."""

_CHAR_IS_SIGNED = platform.machine().lower() in {"x86_64", "amd64", "i386", "i686"}
"""Whether C ``char`` is signed here; cupy hands unique IDs over as a tuple of chars."""

_POLL_S = (0.0005, 0.01)
"""First and longest sleep between two queries of an unfinished CUDA event."""


@functools.cache
def _probe() -> tuple[Any, str]:
    """Import cupy and count GPUs once; return ``(cupy, "")`` or ``(None, why not)``."""
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError as exc:
        return None, (
            f"the nccl backend is not available here: it needs cupy with NCCL: {INSTALL_HINT}; "
            f"use backend='gloo' for CPU tensors ({exc})"
        )
    if not getattr(nccl, "available", True):
        return None, f"the nccl backend is not available here: cupy has no NCCL: {INSTALL_HINT}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return None, f"the nccl backend is not available here: CUDA failed: {exc}"
    if count < 1:
        return None, (
            "the nccl backend is not available here: no CUDA GPU is visible in this process; "
            "give the actor num_gpus=1, or use backend='gloo' for CPU tensors"
        )
    return cupy, ""


def unavailable_reason() -> str:
    """Return why the nccl backend cannot run here, or "" when it can."""
    return _probe()[1]


def cupy_module() -> Any:
    """Return the cupy module.

    Raises:
        CollectiveError: cupy, NCCL or a GPU is missing; says what to install.

    """
    cupy, reason = _probe()
    if cupy is None:
        raise CollectiveError(reason)
    return cupy


def encode_unique_id(uid: Sequence[int]) -> bytes:
    """Return cupy's unique ID (a tuple of C chars) as the bytes stored for the other ranks."""
    if len(uid) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique ID has {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
    return bytes(b & 0xFF for b in uid)


def decode_unique_id(data: bytes) -> tuple[int, ...]:
    """Return stored unique-ID bytes as the tuple of C chars that cupy's communicator takes."""
    if len(data) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique ID has {UNIQUE_ID_BYTES} bytes, got {len(data)}")
    if _CHAR_IS_SIGNED:
        return tuple(b - 256 if b > 127 else b for b in data)
    return tuple(data)


def exchange_unique_id(
    store: RendezvousStore,
    key: str,
    publisher: bool,
    make_id: Callable[[], bytes],
    timeout: timedelta,
    group_name: str,
    rank: int,
) -> bytes:
    """Return the unique ID of communicator ``key``, made here or by its lowest rank.

    The publisher (the communicator's lowest rank) calls ``make_id`` and stores the
    result; every other rank waits up to ``timeout`` for it.

    Raises:
        CollectiveTimeoutError: the publisher did not store the ID within ``timeout``.

    """
    if publisher:
        uid = make_id()
        store.set(key, uid)
        return uid
    try:
        return store.get(key, timeout)
    except TimeoutError as exc:
        detail = f"the lowest rank of communicator {key!r} never published its NCCL id: {exc}"
        raise CollectiveTimeoutError("nccl init", group_name, rank, timeout, detail) from exc


def create_communicators(
    uid: bytes, world: int, ranks: Sequence[int], devices: Sequence[int], timeout: timedelta
) -> list[Any]:
    """Create one NCCL communicator per device, device i holding NCCL rank ``ranks[i]``.

    The creation runs as one NCCL group call on a helper thread: cupy holds the GIL
    while it initialises a communicator, but not in ``groupEnd``, where a grouped
    initialisation waits for the peers. The caller waits at most ``timeout``.

    Raises:
        TimeoutError: the peers did not all arrive within ``timeout``.
        RuntimeError: NCCL or CUDA failed.

    """
    cupy = cupy_module()
    nccl = cupy.cuda.nccl
    commid = decode_unique_id(uid)
    outcome: dict[str, Any] = {}

    def body() -> None:
        comms: list[Any] = []
        try:
            nccl.groupStart()
            try:
                for device, rank in zip(devices, ranks, strict=True):
                    with cupy.cuda.Device(device):
                        comms.append(nccl.NcclCommunicator(world, commid, rank))
            finally:
                nccl.groupEnd()
            outcome["comms"] = comms
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=body, name="collective-nccl-init", daemon=True)
    thread.start()
    thread.join(timeout.total_seconds())
    if thread.is_alive():
        raise TimeoutError(f"not all {world} NCCL ranks arrived within {timeout}")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["comms"]


def wait_events(events: Sequence[Any], comms: Sequence[Any], timeout: timedelta) -> bool:
    """Poll ``events`` until all have completed; return False if ``timeout`` passes first.

    Raises:
        RuntimeError: one of ``comms`` reports an asynchronous NCCL error.

    """
    deadline = time.monotonic() + timeout.total_seconds()
    pause = _POLL_S[0]
    while not all(event.done for event in events):
        for comm in comms:
            comm.check_async_error()
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, _POLL_S[1])
    return True


def release_communicators(
    comms: Sequence[Any], events: Sequence[Any], healthy: bool, timeout: timedelta
) -> None:
    """Destroy ``comms`` once ``events`` complete, or abort them.

    A healthy group's running ops get ``timeout`` to finish. Communicators of an
    unhealthy group, or with ops that do not finish, are aborted, which never waits.
    """
    if healthy and events:
        try:
            healthy = wait_events(events, comms, timeout)
        except RuntimeError:
            healthy = False
    for comm in comms:
        try:
            if healthy:
                comm.destroy()
            else:
                comm.abort()
        except RuntimeError:
            continue


class NcclWork(OnceWork):
    """An NCCL op in flight, tracked by a CUDA event on each comm stream it used.

    ``wait`` polls the events up to a deadline, then calls ``finish``, which orders
    the caller's current streams after them; ``finish`` holds the op's buffers.
    """

    def __init__(
        self,
        op: str,
        events: Sequence[Any],
        comms: Sequence[Any],
        finish: Callable[[], None],
        fail: Callable[[str, timedelta, BaseException], CollectiveError],
        timeout: timedelta,
    ) -> None:
        """Track ``events`` of op ``op``; ``fail`` turns a failure into the group's error."""
        super().__init__()
        self._op = op
        self._events = list(events)
        self._comms = list(comms)
        self._finish: Callable[[], None] | None = finish
        self._fail = fail
        self._op_timeout = timeout

    def _complete(self, timeout: timedelta | None) -> None:
        limit = timeout or self._op_timeout
        try:
            if not wait_events(self._events, self._comms, limit):
                raise TimeoutError("the NCCL kernels did not finish")
            for comm in self._comms:
                comm.check_async_error()
        except (RuntimeError, TimeoutError) as exc:
            self._error = self._fail(self._op, limit, exc)
        else:
            if self._finish is not None:
                self._finish()
            self._finish = None

    def is_completed(self) -> bool:
        """Return whether the op has finished, successfully or not; never blocks."""
        return self._done or self._error is not None or all(e.done for e in self._events)

    def exception(self) -> BaseException | None:
        """Return the op's failure once it has finished with one, else None."""
        if self._error is not None:
            return self._error
        try:
            for comm in self._comms:
                comm.check_async_error()
        except RuntimeError as exc:
            with self._lock:
                self._error = self._fail(self._op, self._op_timeout, exc)
            return self._error
        return None


def per_device(tensors: Sequence[Any], name: str) -> list[CudaBuffer]:
    """Describe one buffer per device; they must agree in dtype and size."""
    if len(tensors) < 1:
        raise ArgumentValueError(f"{name} must hold at least one tensor, got none")
    bufs = [tensor.cuda_buffer(t, f"{name}[{i}]") for i, t in enumerate(tensors)]
    if len({b.device for b in bufs}) != len(bufs):
        raise ArgumentValueError(f"the tensors of {name} must each be on a different GPU")
    first = bufs[0]
    for i, b in enumerate(bufs):
        if (b.dtype, b.count) != (first.dtype, first.count):
            raise ArgumentValueError(
                f"{name}[{i}] holds {b.count} {b.dtype} but {name}[0] holds "
                f"{first.count} {first.dtype}"
            )
    return bufs


def buffers_on(xs: Sequence[Any], name: str, like: CudaBuffer, length: int) -> list[CudaBuffer]:
    """Describe ``length`` buffers on ``like``'s device, of its dtype and size."""
    if len(xs) != length:
        raise ArgumentValueError(f"{name} must hold {length} tensors, got {len(xs)}")
    bufs = [tensor.cuda_buffer(x, f"{name}[{j}]") for j, x in enumerate(xs)]
    for j, b in enumerate(bufs):
        if (b.device, b.dtype, b.count) != (like.device, like.dtype, like.count):
            raise ArgumentValueError(
                f"{name}[{j}] holds {b.count} {b.dtype} on cuda:{b.device}, but must hold "
                f"{like.count} {like.dtype} on cuda:{like.device}"
            )
    return bufs
