"""NCCL plumbing for ``NCCLGroup``: cupy, unique IDs, communicators and buffer lists.

Nothing here imports cupy at module load; ``cupy_module`` does, on first use.
"""

from __future__ import annotations

import atexit
import functools
import platform
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from collective.frameworks import cuda_buffers
from collective.frameworks.cuda_buffers import CudaBuffer
from collective.groups.nccl.cuda import no_probe, wait_events
from collective.groups.nccl.guard import CommGuard
from collective.rendezvous.store import RendezvousStore
from collective.types import (
    ArgumentValueError,
    CollectiveError,
    CollectiveTimeoutError,
    ReduceOp,
)

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

INSTALL_HINT = cuda_buffers.CUPY_INSTALL_HINT
"""What to install when cupy is missing."""

NO_GPU_HINT = "give the actor num_gpus=1, or use backend='gloo' for CPU tensors"
"""What to do when cupy is installed but sees no GPU."""

_CHAR_IS_SIGNED = platform.machine().lower() in {"x86_64", "amd64", "i386", "i686"}
"""Whether C ``char`` is signed here; cupy 13 hands unique IDs over as a tuple of chars."""


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
        return None, (
            f"the nccl backend is not available here: no usable CUDA GPU in this process "
            f"({exc}); {NO_GPU_HINT}"
        )
    if count < 1:
        return None, (
            "the nccl backend is not available here: no CUDA GPU is visible in this process; "
            + NO_GPU_HINT
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


def encode_unique_id(uid: bytes | Sequence[int]) -> bytes:
    """Return the unique ID that cupy's ``get_unique_id`` made as the bytes the ranks share.

    cupy 14 returns bytes; cupy 13 a tuple of C chars, negative where C's char is signed.
    """
    if len(uid) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique ID has {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
    if isinstance(uid, bytes):
        return uid
    return bytes(b & 0xFF for b in uid)


@functools.cache
def _takes_bytes(communicator: Any) -> bool:
    """Return whether ``communicator`` (cupy's ``NcclCommunicator``) takes the ID as bytes.

    Asks the binding itself, on an uninitialised instance, with an empty ID that it
    refuses before calling NCCL: cupy 14 (``bytes commId``) checks the length and
    raises ValueError, cupy 13 (``tuple commId``) checks the type and raises TypeError.
    """
    probe = communicator.__new__(communicator)
    try:
        probe.__init__(1, b"", 0)
    except ValueError:
        return True
    except TypeError:
        return False
    raise CollectiveError(
        f"{communicator.__qualname__} accepted an empty NCCL unique ID; "
        "this cupy's NCCL binding is not one collective knows"
    )


def unique_id_argument(communicator: Any, uid: bytes) -> bytes | tuple[int, ...]:
    """Return the shared unique-ID bytes in the form ``communicator`` takes as ``commId``.

    That is the bytes themselves for cupy 14 and later, and a tuple of C chars for
    cupy 13, as the installed binding says (see ``_takes_bytes``).
    """
    if len(uid) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique ID has {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
    if _takes_bytes(communicator):
        return bytes(uid)
    if _CHAR_IS_SIGNED:
        return tuple(b - 256 if b > 127 else b for b in uid)
    return tuple(uid)


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
    cuda: Any,
    uid: bytes,
    world: int,
    ranks: Sequence[int],
    devices: Sequence[int],
    timeout: timedelta,
) -> list[Any]:
    """Create one NCCL communicator per device, device i holding NCCL rank ``ranks[i]``.

    ``cuda`` is cupy's CUDA namespace. The creation runs as one NCCL group call on a
    helper thread: cupy holds the GIL while it initialises a communicator, but not in
    ``groupEnd``, where a grouped initialisation waits for the peers. The caller waits
    at most ``timeout``.

    Raises:
        TimeoutError: the peers did not all arrive within ``timeout``.
        RuntimeError: NCCL or CUDA failed.

    """
    nccl = cuda.nccl
    commid = unique_id_argument(nccl.NcclCommunicator, uid)
    outcome: dict[str, Any] = {}
    lock = threading.Lock()

    def body() -> None:
        comms: list[Any] = []
        try:
            nccl.groupStart()
            try:
                for device, rank in zip(devices, ranks, strict=True):
                    with cuda.Device(device):
                        comms.append(nccl.NcclCommunicator(world, commid, rank))
            finally:
                nccl.groupEnd()
        except BaseException as exc:
            outcome["error"] = exc
        keep(comms)
        with lock:
            abandoned = outcome.setdefault("comms", comms) is not comms or "error" in outcome
        if abandoned:  # nobody will use them: abort here, never leave them to the GC
            _end(comms)

    thread = threading.Thread(target=body, name="collective-nccl-init", daemon=True)
    thread.start()
    thread.join(timeout.total_seconds())
    with lock:
        made = outcome.setdefault("comms", None)
    if made is None:
        raise TimeoutError(f"not all {world} NCCL ranks arrived within {timeout}")
    if "error" in outcome:
        raise outcome["error"]
    return list(made)


_LIVE: dict[int, Any] = {}
"""Every communicator made and not yet destroyed or aborted, by id: held here so that the
garbage collector never runs cupy's ``__dealloc__``, which calls ``ncclCommDestroy``, a
call every rank must make (it can hang alone). Those left at exit are aborted."""

_LIVE_LOCK = threading.Lock()


def keep(comms: Sequence[Any]) -> None:
    """Hold ``comms`` until ``release_communicators`` ends them (see ``_LIVE``)."""
    with _LIVE_LOCK:
        for comm in comms:
            _LIVE[id(comm)] = comm


def _end(comms: Sequence[Any], destroy: bool = False) -> None:
    """Destroy ``comms``, or abort them, errors aside; stop holding them (``_LIVE``)."""
    for comm in comms:
        try:
            comm.destroy() if destroy else comm.abort()
        except RuntimeError:
            continue
    with _LIVE_LOCK:
        for comm in comms:
            _LIVE.pop(id(comm), None)


@atexit.register
def _abort_live() -> None:
    """Abort the communicators still alive at exit: ``ncclCommAbort`` never waits for peers."""
    with _LIVE_LOCK:
        live = list(_LIVE.values())
    _end(live)


def discard_group(nccl: Any) -> None:
    """End the NCCL group call in progress so that NCCL launches none of its calls.

    A call that NCCL refuses inside a group makes ``groupEnd`` drop the whole group
    and fail (NCCL 2.21 and later), so a send on an uninitialised communicator
    discards what the group holds: peers never get half of an op. Errors are
    swallowed; the caller raises its own.
    """
    try:
        nccl.NcclCommunicator.__new__(nccl.NcclCommunicator).send(0, 0, 0, 0, 0)
    except RuntimeError:
        pass
    try:
        nccl.groupEnd()
    except RuntimeError:
        pass


def release_communicators(
    cuda: Any,
    comms: Sequence[Any],
    events: Sequence[Any],
    healthy: bool,
    timeout: timedelta,
    guard: CommGuard | None = None,
) -> bool:
    """Destroy ``comms`` once ``events`` complete, or abort them; return whether destroyed.

    A healthy group's running ops get ``timeout`` to finish. Communicators of an
    unhealthy group, or with ops that do not finish, are aborted, which never waits.
    With ``guard``, the destroy or abort runs through ``guard.end``: never while another
    thread is inside an NCCL call on them.
    """
    if healthy and events:
        probe = no_probe if guard is None else guard.probe(lambda: comms)
        try:
            healthy = wait_events(cuda, events, probe, timeout)
        except RuntimeError:
            healthy = False
    destroy = healthy

    def release() -> None:
        _end(comms, destroy)

    if guard is None:
        release()
    else:
        guard.end(release)
    return healthy


def per_device(tensors: Sequence[Any], name: str) -> list[CudaBuffer]:
    """Describe one buffer per device; they must agree in dtype and size."""
    if len(tensors) < 1:
        raise ArgumentValueError(f"{name} must hold at least one tensor, got none")
    bufs = [cuda_buffers.cuda_buffer(t, f"{name}[{i}]") for i, t in enumerate(tensors)]
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
    bufs = [cuda_buffers.cuda_buffer(x, f"{name}[{j}]") for j, x in enumerate(xs)]
    for j, b in enumerate(bufs):
        if (b.device, b.dtype, b.count) != (like.device, like.dtype, like.count):
            raise ArgumentValueError(
                f"{name}[{j}] holds {b.count} {b.dtype} on cuda:{b.device}, but must hold "
                f"{like.count} {like.dtype} on cuda:{like.device}"
            )
    return bufs


def consecutive(bufs: Sequence[CudaBuffer]) -> bool:
    """Return whether ``bufs`` lie one after another in memory, in order, with no gap.

    Such a list is one buffer that a single NCCL allgather or reduce-scatter fills or
    reads, chunk j belonging to NCCL rank j.
    """
    first = bufs[0]
    return all(b.ptr == first.ptr + j * first.nbytes for j, b in enumerate(bufs))
