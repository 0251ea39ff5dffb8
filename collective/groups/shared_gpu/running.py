"""How a group of ranks on one GPU runs its ops: connect, lanes, streams, failures, teardown.

Every op runs the transport's collectives (``SharedGpu``) with its device work on the
caller's current CUDA stream, as an NCCL op does: a blocking op returns once this
rank has issued its copies and reductions, which complete in stream order; an async
op is issued from the group's lane thread on the stream that was current when it
was called, and its ``wait`` returns once it is issued. The host side of each step
waits for the peers in host shared memory, bounded by the op's timeout. A failure on
one rank (a timeout, a peer that died, a mismatch) breaks the group on every rank:
the arena's abort word ends the peers' waits at once. ``group.SharedGpuGroup`` adds
the ops.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any, NoReturn, Protocol

from collective.frameworks.bytelist import ByteList
from collective.frameworks.cuda_buffers import NCCL_DTYPES, CudaBuffer
from collective.groups import progress
from collective.groups.base import BaseGroup
from collective.groups.lanes import Lanes
from collective.groups.launches import Prepared
from collective.groups.shared_gpu.device import Device
from collective.groups.shared_gpu.transport import SharedGpu
from collective.groups.shm.algorithms import Collectives
from collective.groups.shm.arena import OP_SEQ
from collective.groups.shm.failures import caller_error
from collective.rendezvous.store import RendezvousStore
from collective.types import (
    DEFAULT_TIMEOUT,
    ArgumentValueError,
    Backend,
    CollectiveError,
    CollectiveTimeoutError,
    GroupOptions,
    ReduceOp,
)
from collective.work import CompletedWork, Work

_DONE = CompletedWork()
VIEWS_KEPT = 1024
"""Device views of callers' buffers a group keeps, by address and size."""

_IDLE_S = 1.0
"""The longest destroy waits for ops running in other threads to give up."""

PER_THREAD_STREAM = 2
"""``cudaStreamPerThread``: a handle that names each thread's own default stream."""

REDUCE_OPS = frozenset((ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG))
"""The reductions of the nccl backend, which a group on one GPU takes too: a group's
ops do not depend on where its ranks sit."""


@dataclass(frozen=True)
class Buffers:
    """How the group reads a caller's GPU buffers; ``gpu.connect`` gives CUDA's."""

    describe: Callable[[Any, str], CudaBuffer]
    """Describes a buffer (``cuda_buffers.cuda_buffer``): raises on a wrong one."""
    stream_of: Callable[[Any], int]
    """The caller's current stream on a buffer's device (None: on the current device)."""
    capturing: Callable[[Any], bool]
    """Whether the caller's current stream on a buffer's device (None: on the current
    device) captures a CUDA graph."""
    contiguous_copy: Callable[[Any], tuple[Any, Callable[[], None]]]
    """A contiguous copy of a buffer, and what writes it back."""


class Lists(Protocol):
    """Runs the ops of ranks that pass one tensor per GPU they drive (``*_multigpu``).

    ``groups.gpu.multigpu`` gives it; without one, such a list raises ``ValueError``.
    """

    def takes(self, op: str, args: tuple[Any, ...]) -> bool:
        """Return whether the call ``op(*args)`` passes more than one tensor per list."""
        ...

    def prepare(self, op: str, args: tuple[Any, ...], options: Any) -> tuple[Prepared, bool]:
        """Return a run of such a call, as ``BaseGroup.prepare`` does."""
        ...

    def abort(self, reason: str) -> None:
        """End the ops it has pending, with ``reason``."""
        ...

    def destroy(self) -> None:
        """Release every group it made."""
        ...


class SharedGpuRunning(BaseGroup):
    """A group whose ranks all share one GPU: how its ops run, fail and end."""

    device_type = "cuda"
    dtypes = frozenset(NCCL_DTYPES)
    supported_ops = REDUCE_OPS
    lists: Lists | None = None
    """What runs the ``*_multigpu`` calls with several tensors; set by ``groups.gpu``."""

    def __init__(
        self,
        world_size: int,
        rank: int,
        group_name: str,
        store: RendezvousStore,
        timeout: timedelta = DEFAULT_TIMEOUT,
        host: str = "127.0.0.1",
        options: GroupOptions | None = None,
        *,
        device: Device,
        buffers: Buffers,
        cupy: Any = None,
        slot_bytes: int | None = None,
        local_ranks: Sequence[int] | None = None,
    ) -> None:
        """Connect the transport among the ranks on this GPU; blocks until all have arrived.

        Args:
            world_size: the number of ranks of the group.
            rank: this rank.
            group_name: the group's name.
            store: where the ranks meet.
            timeout: the default timeout of every wait and op.
            host: unused: the ranks meet through ``store`` and share memory.
            options: the group's settings.
            device: this process's GPU (``CudaDevice``).
            buffers: how the caller's buffers are read.
            cupy: the cupy module, for reductions on the device (None: numpy's ufuncs,
                for host stand-ins in tests).
            slot_bytes: the device slot size; None picks one.
            local_ranks: the group's ranks on this GPU, ascending (None: every rank).

        Raises:
            CollectiveTimeoutError: the ranks did not all arrive within ``timeout``.
            CollectiveError: the device refused to share memory or events.

        """
        super().__init__(world_size, rank, group_name, timeout, options)
        self._buffers = buffers
        self._closing = False
        self._lanes = Lanes(group_name)
        self._views: dict[tuple[int, int], Any] = {}
        self._device_id = device.device_id
        self._transport: SharedGpu | None = None
        local = list(range(world_size)) if local_ranks is None else list(local_ranks)
        try:
            self._transport = SharedGpu(
                device,
                store,
                local,
                local.index(rank),
                timeout,
                prefix=f"gpu/{group_name}/shared/{local[0]}",
                slot_bytes=slot_bytes,
                cupy=cupy,
                interrupted=self._interrupted,
            )
        except TimeoutError as exc:
            raise CollectiveTimeoutError("init", group_name, rank, timeout, str(exc)) from exc
        except (OSError, RuntimeError, ValueError) as exc:
            raise CollectiveError(
                f"group {group_name!r} could not share GPU memory among its ranks on rank "
                f"{rank}: {exc}; set COLLECTIVE_GPU_TRANSPORT=nccl to use NCCL alone"
            ) from exc

    @property
    def transport(self) -> str:
        """Return how this group moves bytes: "shared_gpu" (device memory every rank maps)."""
        return "shared_gpu"

    @classmethod
    def backend(cls) -> Backend:
        """Return ``Backend.NCCL``: users ask for ``backend="nccl"``."""
        return Backend.NCCL

    @classmethod
    def check_backend_availability(cls) -> bool:
        """Return True: the group that picks this one checked cupy and the GPU."""
        return True

    # --- running ops -------------------------------------------------------------------------

    def prepare(self, op: str, args: tuple[Any, ...], options: Any) -> tuple[Prepared, bool]:
        """Return a run of the call; one with a tensor per GPU goes to ``lists``."""
        lists = self.lists
        if lists is not None and lists.takes(op, args):
            return lists.prepare(op, args, options)
        return super().prepare(op, args, options)

    def _collectives(self) -> tuple[SharedGpu, Collectives]:
        transport = self._transport
        if transport is None or transport.collectives is None:
            raise CollectiveError(f"group {self.group_name!r} has been destroyed")
        return transport, transport.collectives

    def _buffer(self, tensors: Sequence[Any], name: str) -> CudaBuffer:
        """Return the description of an op's single buffer."""
        if len(tensors) != 1:
            raise ArgumentValueError(
                f"a group whose ranks share a GPU takes one {name} per rank, got {len(tensors)}"
            )
        return self._describe(tensors[0], name)

    def _describe(self, x: Any, name: str) -> CudaBuffer:
        """Return the description of buffer ``x``, which must be on this group's GPU.

        Raises:
            ArgumentValueError: ``x`` is on another GPU (its memory cannot be reached
                by this GPU's kernels), or is not contiguous.
            ArgumentTypeError: ``x`` is no GPU buffer, or of a dtype NCCL does not move.

        """
        buf = self._buffers.describe(x, name)
        if buf.device != self._device_id:
            raise ArgumentValueError(
                f"{name} is on cuda:{buf.device}, but group {self.group_name!r} runs on "
                f"cuda:{self._device_id}, the GPU its ranks share here; pass a tensor on that "
                "GPU, or one per GPU to the *_multigpu calls"
            )
        return buf

    def _stream(self, op: str, tensors: Sequence[Any]) -> int:
        """Return the caller's current stream on the op's device, which may not capture a graph.

        The device is that of ``tensors[0]``; for no tensors, or a ``ByteList`` (raw
        memory), the current device.

        Raises:
            ArgumentValueError: the stream captures a CUDA graph, which could not replay
                the steps the ranks take together on the host.

        """
        x = tensors[0] if tensors and not isinstance(tensors, ByteList) else None
        if self._buffers.capturing(x):
            raise ArgumentValueError(
                f"{op} on group {self.group_name!r} cannot be captured in a CUDA graph: its "
                "ranks share a GPU and take each step together on the host; run it outside "
                "the capture, or give each rank a GPU of its own (NCCL's ops can be captured)"
            )
        return self._buffers.stream_of(x)

    def _view(self, buf: CudaBuffer) -> Any:
        """Return the flat bytes of ``buf`` as the device's array type, made once per address.

        A view owns nothing (the caller's buffer keeps its memory), so a kept one is
        right for any buffer at the same address and size.
        """
        key = (buf.ptr, buf.nbytes)
        view = self._views.get(key)
        if view is None:
            transport, _ = self._collectives()
            if len(self._views) >= VIEWS_KEPT:
                self._views.clear()
            view = self._views[key] = transport.device.view(buf.ptr, buf.nbytes)
        return view

    def _interrupted(self) -> str | None:
        """Return why every wait of this rank must end now, or None."""
        return self._aborted

    def _submit(
        self,
        op: str,
        options: Any,
        stream: int,
        body: Callable[[float], None],
        keep: Any = (),
        lane: str = "collective",
    ) -> Work:
        """Run ``body(deadline)`` as op ``op`` on ``lane``, with its device work on ``stream``.

        The group's collectives share one lane and the collective steps' stream; a
        send or receive runs on the lane of its direction and peer. ``keep`` (the
        caller's tensors) is held until the op has been issued: ``body`` knows their
        memory only by address, and an async op's caller may drop them before the
        lane reaches the op, which must not write into memory the allocator gave away.
        Once issued, the work is ordered on the caller's stream, as on NCCL.
        """
        self._check_usable(destroyed=self._closing)
        if options.async_op and stream == PER_THREAD_STREAM:
            raise ArgumentValueError(
                f"async {op} on group {self.group_name!r} cannot run on the per-thread default "
                "stream (CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1): the op is issued from the "
                "group's own thread, where that handle names another stream; make a stream "
                "current (cupy.cuda.Stream() or torch.cuda.Stream()), or call it blocking"
            )
        transport, _ = self._collectives()
        timeout = options.timeout or self.timeout
        collective = lane == "collective"

        held = [keep]

        def run() -> None:
            deadline = time.monotonic() + timeout.total_seconds()
            try:
                transport.run(stream, body, deadline, collective=collective)
            except BaseException as exc:
                self._raise_failure(op, timeout, exc)
            finally:
                held.clear()

        expired = partial(self._expired, op)
        return self._lanes.run(lane, run, expired, options.async_op) or _DONE

    def _raise_failure(self, op: str, timeout: timedelta, exc: BaseException) -> NoReturn:
        """Raise what the caller sees of ``exc``, which ended ``op``; see ``caller_error``."""
        transport = self._transport
        ranks = list(range(self.world_size)) if transport is None else transport.ranks
        error, breaks = caller_error(
            exc, op, self.group_name, self.rank, timeout, ranks.__getitem__, self._laggards
        )
        if breaks and self._aborted is not None:
            error = self._aborted_error(op)
        elif breaks and isinstance(error, CollectiveError):
            self._break(error)
        if error is exc:
            raise exc
        raise error from exc.with_traceback(None)

    def _expired(self, op: str, waited: timedelta) -> CollectiveTimeoutError:
        """Return the error of a ``Work.wait`` that ran out, and break the group."""
        error = CollectiveTimeoutError(op, self.group_name, self.rank, waited, self._laggards())
        self._break(error)
        return error

    def _break(self, error: CollectiveError) -> None:
        """Mark the group unusable and stop every peer's waits."""
        if self._error is None:
            self._error = error
        self.launches.clear()
        if self._transport is not None:
            self._transport.abort(str(error))

    def _laggards(self, stalled: int | None = None) -> str:
        """Describe which ranks never joined this rank's current collective."""
        transport = self._transport
        if transport is None or transport.arena is None or transport.steps is None:
            return "the group was closed"
        op, ranks = transport.steps.op, transport.ranks
        counts = {
            r: int(transport.arena.control[i, OP_SEQ])
            for i, r in enumerate(ranks)
            if r != self.rank
        }
        line = progress.describe(self.rank, op, counts, [], "")
        if stalled is not None and all(count >= op for count in counts.values()):
            line += f"; rank {ranks[stalled]} joined it but did not take its step in time"
        return line

    # --- teardown ----------------------------------------------------------------------------

    def abort(self, reason: str) -> None:
        """End every op pending on this rank at once, with ``reason``; see ``BaseGroup``.

        When an op was pending, the other ranks' ops with this rank could not end
        otherwise: the arena's abort word ends them too, and their groups break.
        """
        super().abort(reason)
        if self.lists is not None:
            self.lists.abort(reason)
        pending = self._lanes.active()
        transport = self._transport
        if transport is not None and transport.waiter is not None and transport.steps is not None:
            counters = transport.counters()
            if pending:
                transport.waiter.abort(counters, reason)
            else:
                transport.waiter.wake_all(counters)

    def destroy_group(self) -> None:
        """End every pending op with an error, then release the GPU memory, events and arena.

        Ops queued by ``async_op`` end with a ``CollectiveError`` saying the group was
        destroyed. The device slots are freed once the other ranks have unmapped them
        (or after a few seconds, when they are gone).
        """
        self._closing = True
        self.abort(f"group {self.group_name!r} was destroyed on rank {self.rank}")
        error = CollectiveError(f"group {self.group_name!r} has been destroyed")
        lanes = self._lanes.stop(error)
        idle = all(lane.idle(_IDLE_S) for lane in lanes)
        if self.lists is not None:
            self.lists.destroy()
        transport, self._transport = self._transport, None
        if transport is not None and idle:
            transport.close()
