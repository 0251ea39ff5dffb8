"""Two ranks on one GPU: each op on the shared-GPU transport or on NCCL's multi-rank mode.

``shared_gpu_group`` builds the group of ranks that all share one GPU: a plain
``SharedGpuGroup``, or, where ``routes.table_for`` gives routes, a ``RoutedGpuGroup``,
which holds the shared-GPU transport and an NCCL group of the same two ranks made with
``NCCL_MULTI_RANK_GPU_ENABLE=1``, and sends each blocking op that the table routes, by
its op and byte size, to NCCL; every other op runs on the shared-GPU transport.

- **Order.** An op routed to NCCL runs on the shared-GPU transport's collective lane,
  behind the ops queued there before it, and issues NCCL's call on the caller's current
  stream, as the transport's own ops do: consecutive ops stay in order on the stream,
  whichever transport runs them. Async ops all run on the shared-GPU transport, so
  their lane orders them as before.
- **Agreement.** Every rank derives the route from the op and its size, which every
  rank passes; ranks called with different sizes may still route apart. So before an
  op routed to NCCL the ranks compare the whole op (op, dtype, size, root, reduction)
  in the transport's host shared memory: a rank that took the shared-GPU route posts
  its op's first step there instead, which never equals a whole op's signature, so
  both ranks raise a ``CollectiveError`` with nothing written, and the group breaks on
  both. The comparison covers what NCCL's own check would, so the NCCL group skips it.
- **Failures.** A failure of the NCCL group breaks this group (and a break of this
  group fails the NCCL group, telling its peer); ``abort`` and ``destroy_group`` reach
  both transports.

NCCL reads ``NCCL_MULTI_RANK_GPU_ENABLE`` when it first initialises in a process: the
group sets it before its NCCL group makes a communicator, but where NCCL was already
initialised in this process with the variable unset (another group made a
communicator first) NCCL refuses the two ranks on one GPU, and the op that would make
the communicator fails the group.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from collective.groups.gpu import routes as routing
from collective.groups.gpu.routes import Routes, op_bytes
from collective.groups.gpu.stages import DEVICE_ARRAYS, Arrays, MakeStages, Stages
from collective.groups.shared_gpu.group import SharedGpuGroup
from collective.rendezvous.store import PrefixedRendezvousStore, RendezvousStore
from collective.types import (
    AllGatherOptions,
    AllReduceOptions,
    BroadcastOptions,
    CollectiveError,
    CollectiveTimeoutError,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
)
from collective.work import Work

NO_ROOT = -1
"""The root an op without one agrees on."""


def shared_gpu_group(
    world_size: int,
    rank: int,
    group_name: str,
    store: RendezvousStore,
    timeout: timedelta,
    host: str,
    options: Any,
    *,
    make_stages: MakeStages,
    arrays: Arrays = DEVICE_ARRAYS,
    **shared: Any,
) -> SharedGpuGroup:
    """Connect this rank to a group whose ranks all share one GPU; see the module doc.

    Args:
        world_size: the number of ranks of the group.
        rank: this rank.
        group_name: the group's name.
        store: where the ranks meet.
        timeout: the default timeout of every wait and op.
        host: unused.
        options: the group's settings.
        make_stages: makes the NCCL group of the ranks, where the group routes.
        arrays: how a stream is made current for an NCCL call on a lane's thread.
        **shared: the shared-GPU transport's arguments (device, buffers, cupy).

    Raises:
        CollectiveTimeoutError: the ranks did not all arrive within ``timeout``.
        CollectiveError: a transport could not be made, or ``COLLECTIVE_GPU_ROUTES``
            names no table.

    """
    common = (world_size, rank, group_name, store, timeout, host, options)
    table = routing.table_for(world_size, lambda: routing.nccl_version(shared.get("cupy")))
    if table is None:
        return SharedGpuGroup(*common, **shared)
    return RoutedGpuGroup(*common, routes=table, make_stages=make_stages, arrays=arrays, **shared)


class RoutedGpuGroup(SharedGpuGroup):
    """Two ranks on one GPU, each op on the transport the routes name; see the module doc."""

    def __init__(
        self,
        world_size: int,
        rank: int,
        group_name: str,
        store: RendezvousStore,
        timeout: timedelta,
        host: str,
        options: Any,
        *,
        routes: Routes,
        make_stages: MakeStages,
        arrays: Arrays = DEVICE_ARRAYS,
        **shared: Any,
    ) -> None:
        """Connect the shared-GPU transport, then the NCCL group (its communicator comes later).

        Args:
            world_size: the number of ranks of the group.
            rank: this rank.
            group_name: the group's name.
            store: where the ranks meet.
            timeout: the default timeout of every wait and op.
            host: unused.
            options: the group's settings.
            routes: which ops, of which sizes, NCCL runs.
            make_stages: makes the NCCL group (``NCCLGroup``).
            arrays: how a stream is made current for an NCCL call on a lane's thread.
            **shared: the shared-GPU transport's arguments (device, buffers, cupy, ...).

        Raises:
            CollectiveTimeoutError: the ranks did not all arrive within ``timeout``.
            CollectiveError: a transport could not be made.

        """
        super().__init__(world_size, rank, group_name, store, timeout, host, options, **shared)
        self.routes = routes
        """The routes this group takes."""
        self._arrays = arrays
        self._agreeing = True
        self._nccl: Stages | None = None
        try:
            routing.enable_multirank()
            scoped = PrefixedRendezvousStore(store, "multirank/")
            self._nccl = make_stages(world_size, rank, f"{group_name}/multirank", scoped)
            self._nccl.skip_agreement()
            self._nccl.on_failure(self._failed_below)
        except CollectiveTimeoutError as exc:
            self.destroy_group()
            raise CollectiveTimeoutError(
                "init",
                group_name,
                rank,
                timeout,
                f"{exc.detail}; the other rank built no NCCL group beside the shared-GPU "
                "transport: give every rank the same NCCL, COLLECTIVE_GPU_ROUTES and "
                "NCCL_MULTI_RANK_GPU_ENABLE",
            ) from exc
        except BaseException:
            self.destroy_group()
            raise

    @property
    def transport(self) -> str:
        """Return "shared_gpu|nccl": each op on the shared-GPU transport or on NCCL."""
        return "shared_gpu|nccl"

    def skip_agreement(self) -> None:
        """Skip the comparison before an op routed to NCCL: ``CheckedGroup`` compares every call."""
        self._agreeing = False

    # --- routing ------------------------------------------------------------------------------

    def _route(
        self,
        op: str,
        options: Any,
        tensors: Sequence[Any],
        root: int,
        reduce_op: ReduceOp | None,
        args: tuple[Any, ...],
    ) -> Work | None:
        """Run ``op(*args, options)`` on NCCL where the routes send it; else return None.

        ``tensors`` holds the rank's one buffer the op is agreed on and sized by.
        """
        if options.async_op or op not in self.routes.ops:
            return None
        buf = self._buffer(tensors, "tensor")
        if not self.routes.nccl_runs(op, op_bytes(op, buf.nbytes, self.world_size)):
            return None
        nccl = self._nccl
        if nccl is None:
            raise CollectiveError(f"group {self.group_name!r} has been destroyed")
        _, collectives = self._collectives()
        stream, x, on_stream = self._stream(op, tensors), tensors[0], self._arrays.on_stream
        code = -1 if reduce_op is None else reduce_op.value
        agreeing, run = self._agreeing, getattr(nccl, op)

        def body(deadline: float) -> None:
            if agreeing:
                collectives.agree(op, buf.dtype, code, root, buf.nbytes, deadline)
            with on_stream(x, stream):
                run(*args, options)

        return self._submit(op, options, stream, body, tensors)

    def allreduce(self, tensors: Sequence[Any], options: AllReduceOptions) -> Work:
        """Reduce by ``options.reduce_op`` into every rank's tensor, in place."""
        routed = self._route("allreduce", options, tensors, NO_ROOT, options.reduce_op, (tensors,))
        return super().allreduce(tensors, options) if routed is None else routed

    def reduce(self, tensors: Sequence[Any], options: ReduceOptions) -> Work:
        """Reduce onto the root's tensor; other ranks' tensors are left unchanged."""
        root, op = options.root_rank, options.reduce_op
        routed = self._route("reduce", options, tensors, root, op, (tensors,))
        return super().reduce(tensors, options) if routed is None else routed

    def broadcast(self, tensors: Sequence[Any], options: BroadcastOptions) -> Work:
        """Copy the root's tensor into every other rank's tensor, in place."""
        routed = self._route("broadcast", options, tensors, options.root_rank, None, (tensors,))
        return super().broadcast(tensors, options) if routed is None else routed

    def allgather(
        self,
        tensor_lists: Sequence[Sequence[Any]],
        tensors: Sequence[Any],
        options: AllGatherOptions,
    ) -> Work:
        """Write rank i's tensor into element i of every rank's list."""
        args = (tensor_lists, tensors)
        routed = self._route("allgather", options, tensors, NO_ROOT, None, args)
        return super().allgather(tensor_lists, tensors, options) if routed is None else routed

    def reducescatter(
        self,
        tensors: Sequence[Any],
        tensor_lists: Sequence[Sequence[Any]],
        options: ReduceScatterOptions,
    ) -> Work:
        """Reduce element i of every rank's list into rank i's tensor; inputs stay unchanged."""
        args, op = (tensors, tensor_lists), options.reduce_op
        routed = self._route("reducescatter", options, tensors, NO_ROOT, op, args)
        return super().reducescatter(tensors, tensor_lists, options) if routed is None else routed

    # --- failures and teardown ----------------------------------------------------------------

    def _failed_below(self, error: CollectiveError) -> None:
        """Break this group because its NCCL group failed (from any thread)."""
        self._break(CollectiveError(f"group {self.group_name!r}, NCCL's multi-rank mode: {error}"))

    def _break(self, error: CollectiveError) -> None:
        """Mark the group unusable on both ranks: through the arena, and through NCCL's group."""
        first = self._error is None
        super()._break(error)
        nccl = self._nccl
        if first and nccl is not None and nccl.error is None:
            nccl.fail(error)

    def abort(self, reason: str) -> None:
        """End every op pending on this rank, on both transports; see ``BaseGroup``."""
        super().abort(reason)
        if self._nccl is not None:
            self._nccl.abort(reason)

    def retire(self, reason: str) -> None:
        """Abort both transports and release them without waiting on the peer: it may be gone.

        The NCCL group retires (its communicator is aborted, never destroyed, as
        ``NCCLGroup.retire`` says), then the shared-GPU transport is aborted and released.
        """
        nccl, self._nccl = self._nccl, None
        if nccl is not None:
            nccl.retire(reason)
        super().retire(reason)

    def destroy_group(self) -> None:
        """Release the shared-GPU transport, then the NCCL group."""
        super().destroy_group()
        nccl, self._nccl = self._nccl, None
        if nccl is not None:
            nccl.destroy_group()
