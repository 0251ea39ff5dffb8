"""How a group across GPUs connects, fails, agrees and sends; ``hierarchy`` adds the ops.

The ranks on each GPU form a shared-GPU set (``SharedGpuRunning`` over those ranks); the
lowest rank on each GPU is its leader, and the leaders form an NCCL group of one rank
per GPU. Every rank also joins a group over every rank that only ever makes pair NCCL
communicators: a send or receive between ranks on different GPUs goes through it, one
between ranks on the same GPU through the device mailboxes. A failure of the leaders'
or the pair group breaks this group on every rank (each group tells its peers through
the store), and the abort word ends the waits of the ranks on each GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from collective.frameworks.cuda_buffers import CudaBuffer
from collective.groups.gpu.stages import DEVICE_ARRAYS, Arrays, MakeStages, Stages
from collective.groups.shared_gpu.group import SharedGpuGroup
from collective.groups.topology import Topology
from collective.rendezvous.store import PrefixedRendezvousStore, RendezvousStore
from collective.types import (
    ArgumentError,
    ArgumentValueError,
    BroadcastOptions,
    CollectiveError,
    RecvOptions,
    ReduceOp,
    SendOptions,
    time_left,
)
from collective.work import Work

NO_ROOT = -1
"""The root an op without one agrees on."""


class HierarchyRunning(SharedGpuGroup):
    """Ranks on several GPUs, several on some: see the module docstring."""

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
        places: Sequence[Sequence[str]],
        make_stages: MakeStages,
        arrays: Arrays = DEVICE_ARRAYS,
        **shared: Any,
    ) -> None:
        """Connect this GPU's ranks, then the pair group, then (on leaders) the leaders' group.

        Args:
            world_size: the number of ranks of the group.
            rank: this rank.
            group_name: the group's name.
            store: where the ranks meet.
            timeout: the default timeout of every wait and op.
            host: unused.
            options: the group's settings.
            places: each rank's node and GPU, as every rank published them.
            make_stages: makes the NCCL groups among leaders and among every rank.
            arrays: how the hierarchy's own device arrays are made.
            **shared: the shared-GPU transport's arguments (device, buffers, cupy, ...).

        Raises:
            CollectiveTimeoutError: the ranks did not all arrive within ``timeout``.
            CollectiveError: a transport could not be made.

        """
        topo = Topology.from_keys(rank, ["\n".join(p) for p in places], [0] * world_size)
        super().__init__(
            world_size,
            rank,
            group_name,
            store,
            timeout,
            host,
            options,
            local_ranks=topo.local_ranks,
            **shared,
        )
        self.topo = topo
        self._arrays = arrays
        self._widest = max(len(ranks) for ranks in topo.nodes)
        self._pairs: Stages | None = None
        self._leaders: Stages | None = None
        try:
            pairs_store = PrefixedRendezvousStore(store, "pairs/")
            self._pairs = make_stages(world_size, rank, f"{group_name}/pairs", pairs_store)
            self._pairs.on_failure(self._failed_below)
            if topo.is_leader:
                name, leaders_store = (
                    f"{group_name}/leaders",
                    PrefixedRendezvousStore(store, "leaders/"),
                )
                self._leaders = make_stages(len(topo.nodes), topo.node, name, leaders_store)
                self._leaders.skip_agreement()
                self._leaders.on_failure(self._failed_below)
        except BaseException:
            self.destroy_group()
            raise
        self._flag = arrays.empty(1)
        """One byte, never written: the buffer the leaders' barrier agrees on."""

    @property
    def transport(self) -> str:
        """Return "shared_gpu+nccl": device memory inside each GPU, NCCL among them."""
        return "shared_gpu+nccl"

    @property
    def takes_lists(self) -> bool:
        """Return False: lists move as buckets of broadcasts across GPUs."""
        return False

    # --- failures and teardown ---------------------------------------------------------------

    def _stages(self) -> list[Stages]:
        return [g for g in (self._leaders, self._pairs) if g is not None]

    def _failed_below(self, error: CollectiveError) -> None:
        """Break this group because the leaders' or the pair group failed (any thread)."""
        self._break(CollectiveError(f"group {self.group_name!r} across GPUs: {error}"))

    def _break(self, error: CollectiveError) -> None:
        """Mark the group unusable on every rank: this GPU's ranks, and the others' through NCCL."""
        first = self._error is None
        super()._break(error)
        if first:
            for stages in self._stages():
                if stages.error is None:
                    stages.fail(error)

    def abort(self, reason: str) -> None:
        """End every op pending on this rank, here and in the NCCL groups; see ``BaseGroup``."""
        super().abort(reason)
        for stages in self._stages():
            stages.abort(reason)

    def destroy_group(self) -> None:
        """Release this GPU's transport, then the NCCL groups."""
        super().destroy_group()
        for stages in self._stages():
            stages.destroy_group()

    # --- stages ----------------------------------------------------------------------------

    def _across(self, stream: int, x: Any, call: Callable[[Stages], Any]) -> None:
        """Run ``call`` on the leaders' group with ``x``'s stream current; see ``CpuGroup``.

        A leader that learns the GPUs disagree cannot leave the group usable: the
        other ranks of its GPU wait for it in the middle of the op. So an argument
        error becomes a ``CollectiveError``, which breaks the group.
        """
        leaders = self._leaders
        if leaders is None:
            raise RuntimeError("only a GPU's leader talks to the other GPUs")
        try:
            with self._arrays.on_stream(x, stream):
                call(leaders)
        except ArgumentError as exc:
            raise CollectiveError(
                f"{exc} (the ranks named are the GPUs' leaders, ranks "
                f"{list(self.topo.leaders)} of the group)"
            ) from exc

    def _agree(
        self,
        op: str,
        buf: CudaBuffer | None,
        data: Any,
        root: int,
        reduce_op: ReduceOp | None,
        stream: int,
        deadline: float,
    ) -> None:
        """Have every rank agree on the whole op before a stage moves data (module doc)."""
        _, collectives = self._collectives()
        code = -1 if reduce_op is None else reduce_op.value
        dtype, nbytes = ("", 0) if buf is None else (buf.dtype, buf.nbytes)
        collectives.agree(op, dtype, code, root, nbytes, deadline)
        if self._leaders is not None:
            x = self._flag if buf is None else self._arrays.typed(data, buf.dtype)
            self._across(stream, x, lambda g: g.agree(op, x, root, reduce_op, time_left(deadline)))

    def _reducers(self, op: ReduceOp, dtype: str) -> tuple[Any, Any, ReduceOp]:
        """Return the stages' reducer (AVG sums), the one that finishes, and the leaders' op."""
        transport, _ = self._collectives()
        summed = ReduceOp.SUM if op is ReduceOp.AVG else op
        finish = transport.reducer(op, dtype, self.world_size)
        return transport.reducer(summed, dtype), finish, summed

    def _slot(self, rank: int, size: int) -> slice:
        """Return where ``rank``'s piece of ``size`` bytes sits in a block of every GPU's rows."""
        topo = self.topo
        at = (topo.node_of(rank) * self._widest + topo.local_rank_of(rank)) * size
        return slice(at, at + size)

    def _same_sizes(self, bufs: Sequence[CudaBuffer], like: CudaBuffer, name: str) -> None:
        for i, b in enumerate(bufs):
            if (b.dtype, b.nbytes) != (like.dtype, like.nbytes):
                raise ArgumentValueError(
                    f"{name}[{i}] holds {b.nbytes} bytes of {b.dtype}; expected {like.nbytes} "
                    f"bytes of {like.dtype}, as the rank's own tensor"
                )

    def broadcast_list(self, tensors: Sequence[Any], options: BroadcastOptions) -> Work:
        """Refuse: a group across GPUs takes lists as buckets (``takes_lists`` is False)."""
        raise CollectiveError(f"{type(self).__name__} does not take a list of buffers as one op")

    def send(self, tensors: Sequence[Any], options: SendOptions) -> Work:
        """Send this rank's tensor to ``options.dst_rank``, on this GPU or another."""
        return self._point("send", tensors, options, options.dst_rank)

    def recv(self, tensors: Sequence[Any], options: RecvOptions) -> Work:
        """Receive into this rank's tensor what ``options.src_rank`` sends, in place."""
        return self._point("recv", tensors, options, options.src_rank)

    def _point(self, op: str, tensors: Sequence[Any], options: Any, peer: int) -> Work:
        """Move through the mailboxes on this GPU, else through the pair group's NCCL."""
        topo = self.topo
        if topo.node_of(peer) == topo.node:
            buf = self._buffer(tensors, "tensor")
            stream = self._stream(op, tensors)
            return self._point_to_point(op, options, buf, topo.local_rank_of(peer), stream, tensors)
        self._check_usable(destroyed=self._closing)
        pairs = self._pairs
        if pairs is None:
            raise CollectiveError(f"group {self.group_name!r} has been destroyed")
        return pairs.send(tensors, options) if op == "send" else pairs.recv(tensors, options)
