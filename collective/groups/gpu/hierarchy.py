"""A group over several GPUs with several ranks on some: device memory inside, NCCL across.

As a CPU group runs shared memory inside a node and Gloo among the nodes' leaders, the
ranks on each GPU form a shared-GPU set (``SharedGpuRunning`` over those ranks); the
lowest rank on each GPU is its leader, and the leaders form an NCCL group of one rank per
GPU. Every op first has every rank agree on the whole op: the ranks of each GPU compare
it in host shared memory, then the leaders compare it over NCCL (``NCCLGroup.agree``,
whose result, as every NCCL check's, is read at the latest at the next op, ``wait`` or
watchdog poll); the stages that follow skip their own checks. Then:

- allreduce: reduce onto the leader in device memory, allreduce among leaders, broadcast
  from the leader; reducescatter the same on the concatenated inputs, scattered at the end;
- reduce: the same with the result relayed from the root GPU's leader to the root;
- broadcast: the root relays to its leader, leaders broadcast, leaders broadcast locally;
- allgather and gather: gather onto the leader, allgather (gather) among leaders,
  broadcast (relay to the root) locally; scatter the reverse;
- alltoall: each GPU's rows gathered onto its leader, regrouped by destination GPU, one
  alltoall among leaders, regrouped by destination rank and scattered;
- barrier: a local agreement, a leaders' barrier, a local barrier;
- send and recv: through the device mailboxes to a rank on the same GPU, through a pair
  NCCL communicator (of a group over every rank that only ever makes pair
  communicators) to a rank on another GPU.

Each stage's device work runs on the caller's current stream, in order. AVG sums in
every stage and divides once by the world size. A failure of the leaders' or the pair
group breaks this group on every rank (each group tells its peers through the store),
and the abort word ends the waits of the ranks on each GPU. Lists of buffers move as
buckets of broadcasts (``takes_lists`` is False). No machine at hand has two GPUs: the
tests run the stages on stood-in GPUs and leaders (see ``tests/test_gpu_hierarchy.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from collective.groups.gpu.running import NO_ROOT, HierarchyRunning
from collective.types import (
    AllGatherOptions,
    AllReduceOptions,
    AllToAllOptions,
    ArgumentValueError,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
    time_left,
)
from collective.work import Work


class GpuHierarchyGroup(HierarchyRunning):
    """The ops of a group over several GPUs with several ranks on some; see the module doc."""

    def allreduce(self, tensors: Sequence[Any], options: AllReduceOptions) -> Work:
        """Reduce by ``options.reduce_op`` into every rank's tensor, in place."""
        buf = self._buffer(tensors, "tensor")
        self.check_reduce_op(options.reduce_op, buf.dtype)
        _, collectives = self._collectives()
        op, dtype, data = options.reduce_op, buf.dtype, self._view(buf)
        local, finish, summed = self._reducers(op, dtype)
        stream = self._stream("allreduce", tensors)

        def body(deadline: float) -> None:
            self._agree("allreduce", buf, data, NO_ROOT, op, stream, deadline)
            collectives.reduce(data, 0, local, dtype, deadline)
            if self._leaders is not None:
                x = self._arrays.typed(data, dtype)
                step = AllReduceOptions(summed, time_left(deadline))
                self._across(stream, x, lambda g: g.allreduce([x], step))
                finish.finish(data)
            collectives.broadcast(data, 0, dtype, deadline)

        return self._submit("allreduce", options, stream, body, tensors)

    def reduce(self, tensors: Sequence[Any], options: ReduceOptions) -> Work:
        """Reduce onto the root's tensor; every other rank's stays as it was."""
        buf = self._buffer(tensors, "tensor")
        self.check_reduce_op(options.reduce_op, buf.dtype)
        _, collectives = self._collectives()
        op, dtype, data, root = options.reduce_op, buf.dtype, self._view(buf), options.root_rank
        local, finish, summed = self._reducers(op, dtype)
        topo = self.topo
        root_gpu = topo.node_of(root)
        relayed = root != topo.leaders[root_gpu]
        stream = self._stream("reduce", tensors)

        def body(deadline: float) -> None:
            self._agree("reduce", buf, data, root, op, stream, deadline)
            work = data.copy() if topo.is_leader and topo.rank != root else data
            collectives.reduce(work, 0, local, dtype, deadline)
            if self._leaders is not None:
                x = self._arrays.typed(work, dtype)
                step = ReduceOptions(summed, root_gpu, 0, time_left(deadline))
                self._across(stream, x, lambda g: g.reduce([x], step))
                if topo.node == root_gpu:
                    finish.finish(work)
            if topo.node == root_gpu and relayed:
                target = data if topo.rank == root else work
                collectives.relay(target, 0, topo.local_rank_of(root), dtype, deadline)

        return self._submit("reduce", options, stream, body, tensors)

    def broadcast(self, tensors: Sequence[Any], options: BroadcastOptions) -> Work:
        """Copy the root's tensor into every other rank's; the root's is only read."""
        buf = self._buffer(tensors, "tensor")
        _, collectives = self._collectives()
        dtype, data, root, topo = buf.dtype, self._view(buf), options.root_rank, self.topo
        root_gpu = topo.node_of(root)
        relayed = root != topo.leaders[root_gpu]
        stream = self._stream("broadcast", tensors)

        def body(deadline: float) -> None:
            self._agree("broadcast", buf, data, root, None, stream, deadline)
            own = data.copy() if topo.rank == root and not topo.is_leader else data
            if topo.node == root_gpu and relayed:
                collectives.relay(own, topo.local_rank_of(root), 0, dtype, deadline)
            if self._leaders is not None:
                step = BroadcastOptions(root_gpu, 0, time_left(deadline))
                self._across(stream, own, lambda g: g.broadcast([own], step))
            collectives.broadcast(own, 0, dtype, deadline)

        return self._submit("broadcast", options, stream, body, tensors)

    def barrier(self, options: BarrierOptions) -> Work:
        """Return once every rank has entered the barrier; each stream follows the others'."""
        _, collectives = self._collectives()
        stream = self._stream("barrier", ())

        def body(deadline: float) -> None:
            self._agree("barrier", None, None, NO_ROOT, None, stream, deadline)
            if self._leaders is not None:
                step = BarrierOptions(time_left(deadline))
                self._across(stream, self._flag, lambda g: g.barrier(step))
            collectives.barrier(deadline)

        return self._submit("barrier", options, stream, body)

    def allgather(
        self,
        tensor_lists: Sequence[Sequence[Any]],
        tensors: Sequence[Any],
        options: AllGatherOptions,
    ) -> Work:
        """Write rank i's tensor into element i of every rank's list."""
        source = self._buffer(tensors, "tensor")
        outputs = self._list(tensor_lists, "tensor_list")
        self._same_sizes(outputs, source, "tensor_list")
        _, collectives = self._collectives()
        piece, views = self._view(source), [self._view(b) for b in outputs]
        size, dtype = source.nbytes, source.dtype
        stream = self._stream("allgather", tensors)

        def body(deadline: float) -> None:
            self._agree("allgather", source, piece, NO_ROOT, None, stream, deadline)
            block, mine, rows = self._onto_leader(piece, dtype, deadline)
            if self._leaders is not None:
                ours, step = mine.copy(), AllGatherOptions(time_left(deadline))
                self._across(stream, ours, lambda g: g.allgather([rows], [ours], step))
            collectives.broadcast(block, 0, dtype, deadline)
            self._copy_out(views, block, size)

        return self._submit("allgather", options, stream, body, (tensor_lists, tensors))

    def _onto_leader(self, piece: Any, dtype: str, deadline: float) -> tuple[Any, Any, list[Any]]:
        """Gather this GPU's pieces onto its leader, into its row of a block of every GPU's.

        Returns the block (a row of ``widest`` pieces per GPU; see ``_slot``), this
        GPU's row, and every GPU's row.
        """
        _, collectives = self._collectives()
        topo, size = self.topo, piece.size
        row = self._widest * size
        block = self._arrays.empty(len(topo.nodes) * row)
        rows = [block[h * row : (h + 1) * row] for h in range(len(topo.nodes))]
        mine = rows[topo.node]
        gathered = [mine[i * size : (i + 1) * size] for i in range(len(topo.local_ranks))]
        collectives.gather(piece, gathered if topo.is_leader else [], 0, dtype, deadline)
        return block, mine, rows

    def _copy_out(self, views: Sequence[Any], block: Any, size: int) -> None:
        """Write each rank's piece of ``block`` into ``views[rank]``."""
        for r, view in enumerate(views):
            view[...] = block[self._slot(r, size)]

    def reducescatter(
        self,
        tensors: Sequence[Any],
        tensor_lists: Sequence[Sequence[Any]],
        options: ReduceScatterOptions,
    ) -> Work:
        """Reduce element i of every rank's list into rank i's tensor; inputs stay unchanged."""
        output = self._buffer(tensors, "tensor")
        self.check_reduce_op(options.reduce_op, output.dtype)
        inputs = self._list(tensor_lists, "tensor_list")
        self._same_sizes(inputs, output, "tensor_list")
        _, collectives = self._collectives()
        op, dtype, size, topo = options.reduce_op, output.dtype, output.nbytes, self.topo
        local, finish, summed = self._reducers(op, dtype)
        out, views = self._view(output), [self._view(b) for b in inputs]
        stream = self._stream("reducescatter", tensors)

        def body(deadline: float) -> None:
            self._agree("reducescatter", output, out, NO_ROOT, op, stream, deadline)
            whole = self._arrays.empty(len(views) * size)
            for r, view in enumerate(views):
                whole[r * size : (r + 1) * size] = view
            collectives.reduce(whole, 0, local, dtype, deadline)
            if self._leaders is not None:
                x = self._arrays.typed(whole, dtype)
                step = AllReduceOptions(summed, time_left(deadline))
                self._across(stream, x, lambda g: g.allreduce([x], step))
                finish.finish(whole)
            chunks = [whole[r * size : (r + 1) * size] for r in topo.local_ranks]
            collectives.scatter(chunks if topo.is_leader else [], out, 0, dtype, deadline)

        return self._submit("reducescatter", options, stream, body, (tensors, tensor_lists))

    def gather(
        self,
        tensor_lists: Sequence[Sequence[Any]],
        tensors: Sequence[Any],
        options: GatherOptions,
    ) -> Work:
        """Write rank i's tensor into element i of the root's list."""
        source = self._buffer(tensors, "tensor")
        outputs = self._list(tensor_lists, "gather_list")
        self._same_sizes(outputs, source, "gather_list")
        _, collectives = self._collectives()
        piece, views, root = self._view(source), [self._view(b) for b in outputs], options.root_rank
        topo, size, dtype = self.topo, source.nbytes, source.dtype
        root_gpu = topo.node_of(root)
        relayed = root != topo.leaders[root_gpu]
        stream = self._stream("gather", tensors)

        def body(deadline: float) -> None:
            self._agree("gather", source, piece, root, None, stream, deadline)
            block, mine, rows = self._onto_leader(piece, dtype, deadline)
            if self._leaders is not None:
                rows = rows if topo.node == root_gpu else []
                ours, step = mine.copy(), GatherOptions(root_gpu, time_left(deadline))
                self._across(stream, ours, lambda g: g.gather([rows], [ours], step))
            if topo.node == root_gpu and relayed:
                collectives.relay(block, 0, topo.local_rank_of(root), dtype, deadline)
            if topo.rank == root:
                self._copy_out(views, block, size)

        return self._submit("gather", options, stream, body, (tensor_lists, tensors))

    def scatter(
        self,
        tensors: Sequence[Any],
        tensor_lists: Sequence[Sequence[Any]],
        options: ScatterOptions,
    ) -> Work:
        """Write element i of the root's list into rank i's tensor."""
        output = self._buffer(tensors, "tensor")
        inputs = self._list(tensor_lists, "scatter_list")
        self._same_sizes(inputs, output, "scatter_list")
        _, collectives = self._collectives()
        out, views, root = self._view(output), [self._view(b) for b in inputs], options.root_rank
        topo, size, dtype = self.topo, output.nbytes, output.dtype
        root_gpu, row = topo.node_of(root), self._widest * size
        relayed = root != topo.leaders[root_gpu]
        stream = self._stream("scatter", tensors)

        def body(deadline: float) -> None:
            self._agree("scatter", output, out, root, None, stream, deadline)
            block = self._arrays.empty(len(topo.nodes) * row)
            for r, view in enumerate(views):
                block[self._slot(r, size)] = view
            if topo.node == root_gpu and relayed:
                collectives.relay(block, topo.local_rank_of(root), 0, dtype, deadline)
            mine = self._arrays.empty(row)
            if self._leaders is not None:
                rows = [block[h * row : (h + 1) * row] for h in range(len(topo.nodes))]
                rows = rows if topo.node == root_gpu else []
                step = ScatterOptions(root_gpu, time_left(deadline))
                self._across(stream, mine, lambda g: g.scatter([mine], [rows], step))
            chunks = [mine[i * size : (i + 1) * size] for i in range(len(topo.local_ranks))]
            collectives.scatter(chunks if topo.is_leader else [], out, 0, dtype, deadline)

        return self._submit("scatter", options, stream, body, (tensors, tensor_lists))

    def alltoall(
        self, outputs: Sequence[Any], inputs: Sequence[Any], options: AllToAllOptions
    ) -> Work:
        """Send ``inputs[j]`` to rank j; ``outputs[j]`` receives what rank j sends here.

        Every piece holds the same bytes across GPUs (each stage moves equal rows).
        """
        describe = self._describe
        ins = [describe(t, f"inputs[{i}]") for i, t in enumerate(inputs)]
        outs = [describe(t, f"outputs[{i}]") for i, t in enumerate(outputs)]
        if len(ins) != self.world_size or len(outs) != self.world_size:
            raise ArgumentValueError(
                f"inputs and outputs must hold {self.world_size} tensors each, got "
                f"{len(ins)} and {len(outs)}"
            )
        self._same_sizes(ins + outs, ins[0], "inputs and outputs")
        _, collectives = self._collectives()
        in_views, out_views = [self._view(b) for b in ins], [self._view(b) for b in outs]
        topo, size, dtype, world = self.topo, ins[0].nbytes, ins[0].dtype, self.world_size
        stream = self._stream("alltoall", inputs)

        def body(deadline: float) -> None:
            self._agree("alltoall", ins[0], in_views[0], NO_ROOT, None, stream, deadline)
            line = world * size
            mine = self._arrays.empty(line)
            for j, view in enumerate(in_views):
                mine[j * size : (j + 1) * size] = view
            local = len(topo.local_ranks)
            lines = self._arrays.empty(local * line)
            gathered = [lines[i * line : (i + 1) * line] for i in range(local)]
            collectives.gather(mine, gathered if topo.is_leader else [], 0, dtype, deadline)
            if self._leaders is not None:
                self._exchange(lines, stream, size, deadline)
            collectives.scatter(gathered if topo.is_leader else [], mine, 0, dtype, deadline)
            for j, view in enumerate(out_views):
                view[...] = mine[j * size : (j + 1) * size]

        return self._submit("alltoall", options, stream, body, (outputs, inputs))

    def _exchange(self, lines: Any, stream: int, size: int, deadline: float) -> None:
        """On a leader: turn this GPU's rows by source into rows by destination, across GPUs.

        ``lines[i]`` holds what local rank i sends to each rank; afterwards it holds what
        each rank sends to local rank i.
        """
        topo, world, widest = self.topo, self.world_size, self._widest
        line, block = world * size, widest * widest * size
        count = len(topo.nodes)
        sends = [self._arrays.empty(block) for _ in range(count)]
        receives = [self._arrays.empty(block) for _ in range(count)]
        for h, ranks in enumerate(topo.nodes):
            for i in range(len(topo.local_ranks)):
                for j, r in enumerate(ranks):
                    at = (i * widest + j) * size
                    sends[h][at : at + size] = lines[
                        i * line + r * size : i * line + (r + 1) * size
                    ]
        step = AllToAllOptions(time_left(deadline))
        self._across(stream, receives[0], lambda g: g.alltoall(receives, sends, step))
        for h, ranks in enumerate(topo.nodes):
            for i, src in enumerate(ranks):
                for j in range(len(topo.local_ranks)):
                    at = (i * widest + j) * size
                    to = j * line + src * size
                    lines[to : to + size] = receives[h][at : at + size]
