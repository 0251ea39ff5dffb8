"""CpuGroup: the CPU backend; shared memory inside a node, Gloo between nodes, picked at init.

Each op runs on the transports that ``CpuRunning`` connected: over Gloo alone
when the group was forced to it, else through the route (``routes``) of shared
memory inside the node and Gloo between nodes' leaders. The ops that have no
hierarchical form (gather, scatter, alltoall) and send/recv between nodes go over
the group's full Gloo group.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from collective.frameworks.bytelist import ByteList
from collective.frameworks.cpu_buffers import CpuBuffer, host_view, plain_flat
from collective.groups.cpu.routes import Flat, Hierarchy
from collective.groups.cpu.running import CpuRunning
from collective.groups.gloo.group import GlooGroup
from collective.groups.gloo.work import buffer_list, commit_all, one_buffer
from collective.groups.launches import Launch
from collective.groups.shm.sendrecv import SendRecv
from collective.signature import dtype_code
from collective.types import (
    AllGatherOptions,
    AllReduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    CollectiveError,
    GatherOptions,
    RecvOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
    SendOptions,
)
from collective.work import Work

_SHORT_OPS = frozenset(("allreduce", "reduce", "broadcast"))
"""The ops the short path runs."""


class CpuGroup(CpuRunning):
    """A group of CPU ranks: shared memory among ranks of a node, Gloo between nodes."""

    def _routed(self) -> Flat | Hierarchy:
        if self._route is None:
            raise CollectiveError(f"group {self.group_name!r} has been destroyed")
        return self._route

    def build(self, op: str, x: Any, options: Any) -> tuple[Launch, bool]:
        """Return the short path's launch where it takes the call, else the general one's.

        See ``BaseGroup.build`` and ``short_launch``.
        """
        launch = self.short_launch(op, x, options)
        if launch is not None:
            return launch, True
        return super().build(op, x, options)

    def short_launch(self, op: str, x: Any, options: Any) -> Launch | None:
        """Return the launch of blocking ``op`` on short plain buffers like ``x``; see ``ShortOps``.

        ``options`` are the call's checked options. Returns None, having done
        nothing, when the group has no short path (it spans nodes, or this rank is
        alone, or Gloo was asked for), for an async call, and for any buffer that
        path does not take. The launch takes the general path when the group cannot
        run ops (which raises why) or an op is queued or running on this rank.
        """
        short = self._short
        if short is None or options.async_op or op not in _SHORT_OPS:
            return None
        flat = plain_flat(x)
        if flat is None:
            return None
        root = getattr(options, "root_rank", -1)
        prepared = short.prepare(op, flat, getattr(options, "reduce_op", None), root)
        if prepared is None:
            return None
        run = getattr(short, op)
        flat_of: Callable[[Any], np.ndarray] = np.ndarray.ravel  # the key fixes its kind
        if type(x) is not np.ndarray:
            flat_of = partial(host_view, typestr=flat.dtype.str, count=flat.size)

        general = super().build(op, x, options)[0]
        timeout = options.timeout or self.timeout
        seconds = timeout.total_seconds()
        lane = self._lanes.get("collective")

        def launch(x: Any) -> None:
            watch = self._watch
            if (
                self._error is not None
                or self._closing
                or self._aborted is not None
                or watch is None
                or watch.failure is not None
                or not lane.enter()
            ):
                general(x)
                return
            try:
                run(prepared, flat_of(x), time.monotonic() + seconds)
            except BaseException as exc:
                self._raise_failure(op, timeout, exc)
            finally:
                lane.leave()

        return launch

    def allreduce(self, tensors: Sequence[Any], options: AllReduceOptions) -> Work:
        """Reduce by ``options.reduce_op`` into every rank's tensor, in place."""
        if self._gloo is not None:
            return self._gloo.allreduce(tensors, options)
        buf, route = one_buffer(tensors, "tensor", True), self._routed()

        def body(deadline: float) -> None:
            route.allreduce(buf, options.reduce_op, deadline)
            buf.commit()

        return self._submit("allreduce", options, body)

    def barrier(self, options: BarrierOptions) -> Work:
        """Block until every rank has entered the barrier."""
        if self._gloo is not None:
            return self._gloo.barrier(options)
        return self._submit("barrier", options, self._routed().barrier)

    def reduce(self, tensors: Sequence[Any], options: ReduceOptions) -> Work:
        """Reduce onto the root's tensor; other ranks' tensors are left unchanged."""
        if self._gloo is not None:
            return self._gloo.reduce(tensors, options)
        root = options.root_rank
        buf, route = one_buffer(tensors, "tensor", self.rank == root), self._routed()

        def body(deadline: float) -> None:
            route.reduce(buf, options.reduce_op, root, deadline)
            buf.commit()

        return self._submit("reduce", options, body)

    def broadcast(self, tensors: Sequence[Any], options: BroadcastOptions) -> Work:
        """Copy the root's tensor into every other rank's tensor, in place."""
        if self._gloo is not None:
            return self._gloo.broadcast(tensors, options)
        root = options.root_rank
        buf, route = one_buffer(tensors, "tensor", self.rank != root), self._routed()

        def body(deadline: float) -> None:
            route.broadcast(buf, root, deadline)
            buf.commit()

        return self._submit("broadcast", options, body)

    @property
    def takes_lists(self) -> bool:
        """Return whether every rank is on this node and moves bytes through shared memory."""
        return self._gloo is None and isinstance(self._route, Flat)

    def broadcast_list(self, tensors: Sequence[Any], options: BroadcastOptions) -> Work:
        """Copy the root's ``tensors`` into every other rank's, in order, as one message.

        See ``BaseGroup.broadcast_list``. A tensor that is not contiguous moves
        through a contiguous copy of its own; a ``ByteList`` moves as it is.
        """
        route = self._route
        if self._gloo is not None or not isinstance(route, Flat):
            return super().broadcast_list(tensors, options)
        root = options.root_rank
        writes = self.rank != root
        datas: list[np.ndarray] = []
        staged: list[CpuBuffer] = []
        for i, t in enumerate(tensors if not isinstance(tensors, ByteList) else ()):
            flat = plain_flat(t)
            if flat is None:
                buf = CpuBuffer(t, f"tensors[{i}]", writes)
                staged.append(buf)
                datas.append(buf.bytes)
            else:
                datas.append(flat.view(np.uint8))
        message = tensors if isinstance(tensors, ByteList) else datas

        def body(deadline: float) -> None:
            route.broadcast_list(message, root, deadline)
            commit_all(staged)

        return self._submit("broadcast", options, body)

    def allgather(
        self,
        tensor_lists: Sequence[Sequence[Any]],
        tensors: Sequence[Any],
        options: AllGatherOptions,
    ) -> Work:
        """Write rank i's tensor into element i of every rank's list."""
        if self._gloo is not None:
            return self._gloo.allgather(tensor_lists, tensors, options)
        source = one_buffer(tensors, "tensor", False)
        outputs, route = buffer_list(tensor_lists, "tensor_list", True), self._routed()

        def body(deadline: float) -> None:
            route.allgather(source, outputs, deadline)
            commit_all(outputs)

        return self._submit("allgather", options, body)

    def reducescatter(
        self,
        tensors: Sequence[Any],
        tensor_lists: Sequence[Sequence[Any]],
        options: ReduceScatterOptions,
    ) -> Work:
        """Reduce element i of every rank's list into rank i's tensor; inputs stay unchanged."""
        if self._gloo is not None:
            return self._gloo.reducescatter(tensors, tensor_lists, options)
        output = one_buffer(tensors, "tensor", True)
        inputs, route = buffer_list(tensor_lists, "tensor_list", False), self._routed()

        def body(deadline: float) -> None:
            route.reducescatter(output, inputs, options.reduce_op, deadline)
            output.commit()

        return self._submit("reducescatter", options, body)

    def gather(
        self,
        tensor_lists: Sequence[Sequence[Any]],
        tensors: Sequence[Any],
        options: GatherOptions,
    ) -> Work:
        """Write rank i's tensor into element i of the root's list."""
        gloo = self._gloo or self._full
        if gloo is not None:
            return gloo.gather(tensor_lists, tensors, options)
        source = one_buffer(tensors, "tensor", False)
        outputs, route = buffer_list(tensor_lists, "gather_list", True), self._routed()
        if not isinstance(route, Flat):
            raise CollectiveError("gather across nodes goes over Gloo")

        def body(deadline: float) -> None:
            route.gather(source, outputs, options.root_rank, deadline)
            commit_all(outputs)

        return self._submit("gather", options, body)

    def scatter(
        self,
        tensors: Sequence[Any],
        tensor_lists: Sequence[Sequence[Any]],
        options: ScatterOptions,
    ) -> Work:
        """Write element i of the root's list into rank i's tensor."""
        gloo = self._gloo or self._full
        if gloo is not None:
            return gloo.scatter(tensors, tensor_lists, options)
        output = one_buffer(tensors, "tensor", True)
        inputs, route = buffer_list(tensor_lists, "scatter_list", False), self._routed()
        if not isinstance(route, Flat):
            raise CollectiveError("scatter across nodes goes over Gloo")

        def body(deadline: float) -> None:
            route.scatter(output, inputs, options.root_rank, deadline)
            output.commit()

        return self._submit("scatter", options, body)

    def alltoall(
        self, outputs: Sequence[Any], inputs: Sequence[Any], options: AllToAllOptions
    ) -> Work:
        """Exchange ``inputs[j]`` for ``outputs[j]`` with every rank j."""
        gloo = self._gloo or self._full
        if gloo is not None:
            return gloo.alltoall(outputs, inputs, options)
        outs = buffer_list([outputs], "output", True)
        ins, route = buffer_list([inputs], "input", False), self._routed()
        if not isinstance(route, Flat):
            raise CollectiveError("alltoall across nodes goes over Gloo")

        def body(deadline: float) -> None:
            route.alltoall(outs, ins, deadline)
            commit_all(outs)

        return self._submit("alltoall", options, body)

    def _peer_sendrecv(self, peer: int) -> SendRecv | None:
        """Return the mailboxes to ``peer`` when it shares this rank's node, else None."""
        topo = self._topology
        if self._sendrecv is None or topo is None or peer not in topo.local_ranks:
            return None
        return self._sendrecv

    def send(self, tensors: Sequence[Any], options: SendOptions) -> Work:
        """Send the tensor to ``options.dst_rank``; completes once it has been handed over."""
        peer = options.dst_rank
        mail = self._peer_sendrecv(peer)
        if mail is None:
            return self._tcp().send(tensors, options)
        buf, local = one_buffer(tensors, "tensor", False), self._local_rank(peer)

        def body(deadline: float) -> None:
            mail.send(buf.bytes, local, dtype_code(buf.dtype), deadline)

        return self._submit("send", options, body, lane=f"send-{peer}")

    def recv(self, tensors: Sequence[Any], options: RecvOptions) -> Work:
        """Receive from ``options.src_rank`` into the tensor, in place."""
        peer = options.src_rank
        mail = self._peer_sendrecv(peer)
        if mail is None:
            return self._tcp().recv(tensors, options)
        buf, local = one_buffer(tensors, "tensor", True), self._local_rank(peer)

        def body(deadline: float) -> None:
            mail.recv(buf.bytes, local, dtype_code(buf.dtype), deadline)
            buf.commit()

        return self._submit("recv", options, body, lane=f"recv-{peer}")

    def _tcp(self) -> GlooGroup:
        gloo = self._gloo or self._full
        if gloo is None:
            raise CollectiveError(f"group {self.group_name!r} has been destroyed")
        return gloo

    def _local_rank(self, rank: int) -> int:
        topo = self._topology
        return topo.local_rank_of(rank) if topo is not None else rank
