"""How a shared-memory CPU group runs its ops: on one node (Flat) or across nodes (Hierarchy).

``Flat`` hands each op to the node's shared-memory collectives. ``Hierarchy``
composes them with Gloo among one leader rank per node, as NCCL composes its
intra- and inter-node transports:

- allreduce: reduce onto the leader in shared memory, allreduce among leaders,
  broadcast from the leader in shared memory;
- reduce: the same, with the result relayed from the root node's leader to the root;
- broadcast: the root relays to its leader, leaders broadcast, leaders broadcast locally;
- allgather: gather onto the leader, allgather among leaders, broadcast locally;
- reducescatter: reduce the whole input onto the leader, allreduce among leaders,
  scatter each node's chunks locally;
- barrier: a local barrier, a barrier among leaders, a local barrier.

Leaders' Gloo calls get what is left of the op's deadline as their timeout. Before
any step, each node's ranks agree on the whole op in shared memory, then the leaders
agree on it (``GlooGroup.agree``): ranks that disagree raise before any data moves,
instead of gloo aborting the process or a stage mixing the data; the leaders' Gloo
ops then skip their own agreement.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from collective.frameworks.cpu_buffers import CpuBuffer, torch_view
from collective.groups.gloo.agree import Call, on_buffer
from collective.groups.gloo.group import GlooGroup
from collective.groups.shm.algorithms import Collectives
from collective.groups.shm.kernels import Reducer
from collective.groups.shm.local_copies import LocalCopies
from collective.groups.topology import Topology
from collective.types import (
    AllGatherOptions,
    AllReduceOptions,
    ArgumentError,
    BarrierOptions,
    BroadcastOptions,
    CollectiveError,
    ReduceOp,
    ReduceOptions,
    time_left,
)

Local = Collectives | LocalCopies


class Reducers:
    """One ``Reducer`` per (op, dtype), made on first use."""

    def __init__(self, world_size: int) -> None:
        """Make reducers whose AVG divides by ``world_size``."""
        self._world_size = world_size
        self._made: dict[tuple[ReduceOp, str], Reducer] = {}

    def get(self, op: ReduceOp, dtype: str) -> Reducer:
        """Return the reducer of ``op`` on ``dtype``."""
        reducer = self._made.get((op, dtype))
        if reducer is None:
            reducer = self._made[(op, dtype)] = Reducer(op, dtype, self._world_size)
        return reducer


class Flat:
    """Every rank on one node: each op is one shared-memory collective."""

    def __init__(self, local: Local, world_size: int) -> None:
        """Run ops on ``local``, the node's collectives."""
        self.local = local
        self._reducers = Reducers(world_size)

    def allreduce(self, buf: CpuBuffer, op: ReduceOp, deadline: float) -> None:
        """Reduce into every rank's ``buf``."""
        dtype = buf.dtype
        self.local.allreduce(buf.bytes, self._reducers.get(op, dtype), dtype, deadline)

    def reduce(self, buf: CpuBuffer, op: ReduceOp, root: int, deadline: float) -> None:
        """Reduce onto ``root``'s ``buf``."""
        dtype = buf.dtype
        self.local.reduce(buf.bytes, root, self._reducers.get(op, dtype), dtype, deadline)

    def broadcast(self, buf: CpuBuffer, root: int, deadline: float) -> None:
        """Copy ``root``'s ``buf`` into every other rank's."""
        self.local.broadcast(buf.bytes, root, buf.dtype, deadline)

    def broadcast_list(self, datas: Sequence[np.ndarray], root: int, deadline: float) -> None:
        """Copy ``root``'s ``datas`` (flat byte views) into every other rank's, as one message."""
        self.local.broadcast_list(datas, root, deadline)

    def allgather(self, source: CpuBuffer, outputs: list[CpuBuffer], deadline: float) -> None:
        """Write rank i's ``source`` into ``outputs[i]`` on every rank."""
        out = [o.bytes for o in outputs]
        self.local.allgather(source.bytes, out, source.dtype, deadline)

    def reducescatter(
        self, output: CpuBuffer, inputs: list[CpuBuffer], op: ReduceOp, deadline: float
    ) -> None:
        """Reduce ``inputs[i]`` of every rank into rank i's ``output``."""
        dtype = output.dtype
        reducer = self._reducers.get(op, dtype)
        self.local.reducescatter([i.bytes for i in inputs], output.bytes, reducer, dtype, deadline)

    def barrier(self, deadline: float) -> None:
        """Return once every rank has entered the barrier."""
        self.local.barrier(deadline)

    def gather(
        self, source: CpuBuffer, outputs: list[CpuBuffer], root: int, deadline: float
    ) -> None:
        """Write rank i's ``source`` into ``outputs[i]`` on ``root`` (no outputs elsewhere)."""
        out = [o.bytes for o in outputs]
        self.local.gather(source.bytes, out, root, source.dtype, deadline)

    def scatter(
        self, output: CpuBuffer, inputs: list[CpuBuffer], root: int, deadline: float
    ) -> None:
        """Write ``root``'s ``inputs[i]`` into rank i's ``output`` (no inputs elsewhere)."""
        ins = [i.bytes for i in inputs]
        self.local.scatter(ins, output.bytes, root, output.dtype, deadline)

    def alltoall(self, outputs: list[CpuBuffer], inputs: list[CpuBuffer], deadline: float) -> None:
        """Send ``inputs[j]`` to rank j; ``outputs[j]`` receives what rank j sends here."""
        dtype = inputs[0].dtype if inputs else ""
        ins, outs = [i.bytes for i in inputs], [o.bytes for o in outputs]
        self.local.alltoall(ins, outs, dtype, deadline)


def _tensor(data: np.ndarray, like: CpuBuffer) -> Any:
    """Return the bytes ``data`` as a torch tensor of ``like``'s dtype, sharing memory."""
    return torch_view(data, like.torch_dtype)


class Hierarchy:
    """Ranks on several nodes: shared memory inside each, Gloo among the nodes' leaders."""

    def __init__(
        self,
        topo: Topology,
        local: Local,
        leaders: GlooGroup | None,
        world_size: int,
    ) -> None:
        """Compose ``local`` (this node's collectives) with ``leaders`` (on leaders only)."""
        self.topo = topo
        self.local = local
        self._leaders = leaders
        self._world_size = world_size
        self._reducers = Reducers(world_size)
        self._agreeing = True
        if leaders is not None:
            leaders.skip_agreement()

    def skip_agreement(self) -> None:
        """Run each op without the leaders' agreement: a wrapper checks every call first."""
        self._agreeing = False

    def _agree(self, call: Call, deadline: float) -> None:
        """Have every rank agree on the op ``call`` before any data moves.

        First each node's ranks compare their calls in shared memory, then the
        nodes' leaders compare theirs over Gloo. The stages that follow carry only
        their own arguments (a local stage knows no root on another node, and sums
        where the user asked for AVG), so a rank that is not a leader is checked
        here or not at all.

        Raises:
            MismatchError: this node's ranks passed different arguments (on every
                rank of the node; the group breaks, and the other nodes learn it).
            CollectiveError: the nodes passed different arguments (on leaders only);
                see ``_across``.

        """
        if not self._agreeing:
            return
        reduce_op = -1 if call.reduce_op is None else call.reduce_op.value
        dtype = call.dtype or ""
        self.local.agree(call.op, dtype, reduce_op, call.root, call.nbytes(), deadline)
        if self.topo.is_leader:
            self._across(lambda g: g.agree(call, time_left(deadline)))

    def _local_op(self, op: ReduceOp, dtype: str) -> Reducer:
        """Return the reducer of the local stages: AVG sums, and divides only at the end."""
        return self._reducers.get(ReduceOp.SUM if op is ReduceOp.AVG else op, dtype)

    def _finish(self, op: ReduceOp, dtype: str, data: np.ndarray) -> None:
        if op is ReduceOp.AVG:
            self._reducers.get(op, dtype).finish(data)

    def _across(self, call: Callable[[GlooGroup], Any]) -> None:
        """Run ``call`` on the leaders' Gloo group; its argument errors break this group.

        A leader that learns the nodes disagree cannot leave the group usable: the
        other ranks of its node wait for it in the middle of the op. So the error
        becomes a ``CollectiveError``, which breaks the group and ends their waits.
        """
        if self._leaders is None:
            raise RuntimeError("only a node's leader talks to the other nodes")
        try:
            call(self._leaders)
        except ArgumentError as exc:
            leaders = list(self.topo.leaders)
            raise CollectiveError(
                f"{exc} (the ranks named are the nodes' leaders, ranks {leaders} of the group)"
            ) from exc

    def allreduce(self, buf: CpuBuffer, op: ReduceOp, deadline: float) -> None:
        """Reduce into every rank's ``buf``."""
        self._agree(on_buffer("allreduce", buf, reduce_op=op), deadline)
        dtype, data = buf.dtype, buf.bytes
        self.local.reduce(data, 0, self._local_op(op, dtype), dtype, deadline)
        if self.topo.is_leader:
            gloo_op = ReduceOp.SUM if op is ReduceOp.AVG else op
            options = AllReduceOptions(gloo_op, time_left(deadline))
            self._across(lambda g: g.allreduce([_tensor(data, buf)], options))
            self._finish(op, dtype, data)
        self.local.broadcast(data, 0, dtype, deadline)

    def reduce(self, buf: CpuBuffer, op: ReduceOp, root: int, deadline: float) -> None:
        """Reduce onto ``root``'s ``buf``; every other rank's stays as it was."""
        self._agree(on_buffer("reduce", buf, root, op), deadline)
        topo, dtype = self.topo, buf.dtype
        root_node = topo.node_of(root)
        leader_of_root = topo.leaders[root_node]
        in_place = not topo.is_leader or topo.rank == root
        data = buf.bytes if in_place else buf.bytes.copy()
        self.local.reduce(data, 0, self._local_op(op, dtype), dtype, deadline)
        if topo.is_leader:
            gloo_op = ReduceOp.SUM if op is ReduceOp.AVG else op
            options = ReduceOptions(gloo_op, root_node, 0, time_left(deadline))
            self._across(lambda g: g.reduce([_tensor(data, buf)], options))
            if topo.node == root_node:
                self._finish(op, dtype, data)
        if topo.node == root_node and root != leader_of_root:
            target = buf.bytes if topo.rank == root else data
            self.local.relay(target, 0, topo.local_rank_of(root), dtype, deadline)

    def broadcast(self, buf: CpuBuffer, root: int, deadline: float) -> None:
        """Copy ``root``'s ``buf`` into every other rank's; the root's is only read."""
        self._agree(on_buffer("broadcast", buf, root), deadline)
        topo, dtype = self.topo, buf.dtype
        root_node = topo.node_of(root)
        leader_of_root = topo.leaders[root_node]
        data = buf.bytes.copy() if topo.rank == root and not topo.is_leader else buf.bytes
        if topo.node == root_node and root != leader_of_root:
            self.local.relay(data, topo.local_rank_of(root), 0, dtype, deadline)
        if topo.is_leader:
            options = BroadcastOptions(root_node, 0, time_left(deadline))
            self._across(lambda g: g.broadcast([_tensor(data, buf)], options))
        self.local.broadcast(data, 0, dtype, deadline)

    def allgather(self, source: CpuBuffer, outputs: list[CpuBuffer], deadline: float) -> None:
        """Write rank i's ``source`` into ``outputs[i]`` on every rank."""
        self._agree(on_buffer("allgather", source, length=len(outputs)), deadline)
        topo, dtype, piece = self.topo, source.dtype, source.bytes
        size = piece.size
        widest = max(len(ranks) for ranks in topo.nodes)
        full = np.zeros(len(topo.nodes) * widest * size, dtype=np.uint8)
        block = full.reshape(len(topo.nodes), widest, size)
        mine = block[topo.node]
        gathered = [mine[i] for i in range(len(topo.local_ranks))]
        self.local.gather(piece, gathered if topo.is_leader else [], 0, dtype, deadline)
        if topo.is_leader:
            rows = [_tensor(block[n].reshape(-1), source) for n in range(len(topo.nodes))]
            ours = _tensor(mine.reshape(-1).copy(), source)
            self._across(
                lambda g: g.allgather([rows], [ours], AllGatherOptions(time_left(deadline)))
            )
        self.local.broadcast(full, 0, dtype, deadline)
        for node, ranks in enumerate(topo.nodes):
            for i, rank in enumerate(ranks):
                outputs[rank].bytes[:] = block[node, i]

    def reducescatter(
        self, output: CpuBuffer, inputs: list[CpuBuffer], op: ReduceOp, deadline: float
    ) -> None:
        """Reduce ``inputs[i]`` of every rank into rank i's ``output``."""
        self._agree(on_buffer("reducescatter", output, reduce_op=op, length=len(inputs)), deadline)
        topo, dtype = self.topo, output.dtype
        size = output.bytes.size
        whole = np.concatenate([i.bytes for i in inputs]) if inputs else np.zeros(0, np.uint8)
        self.local.reduce(whole, 0, self._local_op(op, dtype), dtype, deadline)
        if topo.is_leader:
            gloo_op = ReduceOp.SUM if op is ReduceOp.AVG else op
            options = AllReduceOptions(gloo_op, time_left(deadline))
            self._across(lambda g: g.allreduce([_tensor(whole, output)], options))
            self._finish(op, dtype, whole)
        chunks = [whole[r * size : (r + 1) * size] for r in topo.local_ranks]
        self.local.scatter(chunks if topo.is_leader else [], output.bytes, 0, dtype, deadline)

    def barrier(self, deadline: float) -> None:
        """Return once every rank has entered the barrier."""
        self._agree(Call("barrier"), deadline)
        self.local.barrier(deadline)
        if self.topo.is_leader:
            self._across(lambda g: g.barrier(BarrierOptions(time_left(deadline))))
        self.local.barrier(deadline)
