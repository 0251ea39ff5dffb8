"""CollectiveProcessGroup: torch's ``ProcessGroup`` "collective", a thin adapter over a CpuGroup.

torch builds one per group (``init_process_group``, ``new_group``, ``new_subgroups``)
through the creator that ``register`` registered, and calls its methods with its own
option objects. Each op method lives in ``collectives``, ``exchange`` or here (send,
recv, the barriers) and runs the library's op on the group's ``CpuGroup``: shared
memory among the ranks of a host, Gloo between hosts, every wait bounded by the
group's timeout, ranks whose calls disagree told so on every rank.

A tensor on another device than the CPU goes to torch's own dispatch, which finds
the backend the group's configuration names for that device (``"cpu:collective,
cuda:nccl"``: NCCL, made on first use) or raises torch's error when there is none.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from collective.groups.cpu.group import CpuGroup
from collective.ops import list_calls
from collective.torch_backend import collectives, exchange
from collective.torch_backend.monitored import MonitoredBarrier
from collective.torch_backend.names import BACKEND_NAME
from collective.torch_backend.options import timeout_of
from collective.torch_backend.p2p import ANY, PointToPoint
from collective.torch_backend.work import DONE, Futures, TorchWork
from collective.types import ArgumentValueError
from collective.work import Work

_ProcessGroup: Any = dist.ProcessGroup
"""torch's class, untyped for the type checker: the ops, written in modules of their own
for any ``Adapter``, are assigned in the class body."""


_BACKEND_OPS = {
    "all_gather_single": "_allgather_base",
    "reduce_scatter_single": "_reduce_scatter_base",
    "all_to_all_single": "alltoall_base",
    "all_gather_single_coalesced": "allgather_into_tensor_coalesced",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced",
}
"""The name of each op on torch's ``Backend``, where it differs from the process group's."""


class CollectiveProcessGroup(_ProcessGroup):
    """One rank's torch process group of backend "collective", over the library's CPU group.

    Built by torch's ``init_process_group`` and ``new_group``; see ``register``.
    """

    def __init__(self, group: CpuGroup, store: Any) -> None:
        """Wrap ``group``, built on torch's ``store`` of this group (which NCCL would share)."""
        super().__init__(group.rank, group.world_size)
        self.group = group
        """The library's group the ops run on."""
        self._store = store
        self._futures = Futures(group.group_name)
        self._p2p = PointToPoint(group)
        self._monitored = MonitoredBarrier(store, group.rank, group.world_size)
        self._bound_lock = threading.Lock()
        self._bound: set[str] = set()
        self._torch_name = ""

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        """Return "collective"."""
        return BACKEND_NAME

    def _set_group_name(self, name: str) -> None:
        """Keep the name torch gives the group (torch's own keeps it on a backend it lacks)."""
        self._torch_name = name
        super()._set_group_name(name)

    @property
    def group_name(self) -> str:
        """Return the name torch gave the group.

        Raises:
            RuntimeError: torch has not named it yet.

        """
        if not self._torch_name:
            raise RuntimeError("ProcessGroup name not set")
        return self._torch_name

    def __repr__(self) -> str:
        return (
            f"CollectiveProcessGroup(rank={self.rank()}, size={self.size()}, "
            f"transport={self.group.transport!r})"
        )

    # --- the ops ------------------------------------------------------------------------------

    allreduce = collectives.allreduce
    broadcast = collectives.broadcast
    reduce = collectives.reduce
    allgather = collectives.allgather
    all_gather_single = collectives.all_gather_single
    _allgather_base = collectives.all_gather_single
    reduce_scatter = collectives.reduce_scatter
    reduce_scatter_single = collectives.reduce_scatter_single
    _reduce_scatter_base = collectives.reduce_scatter_single
    barrier = collectives.barrier
    gather = exchange.gather
    scatter = exchange.scatter
    alltoall = exchange.alltoall
    all_to_all_single = exchange.all_to_all_single
    alltoall_base = exchange.all_to_all_single
    allreduce_coalesced = exchange.allreduce_coalesced
    allgather_coalesced = exchange.allgather_coalesced
    all_gather_single_coalesced = exchange.all_gather_single_coalesced
    allgather_into_tensor_coalesced = exchange.all_gather_single_coalesced
    reduce_scatter_single_coalesced = exchange.reduce_scatter_single_coalesced
    reduce_scatter_tensor_coalesced = exchange.reduce_scatter_single_coalesced

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        """Send the tensor to rank ``dst`` with ``tag``; the ``Work`` ends once it is handed over.

        A message up to the pair's shared-memory mailboxes is handed over at once;
        a longer one once the peer has read all but what they hold.
        """
        tensor = collectives.one_tensor(tensors, "tensor")
        if not tensor.is_cpu:
            return self.other_device("send", tensor, tensors, dst, tag)
        work = self._p2p.send(tensor, dst, tag, True)
        return self.async_work(work, tensors, f"send-{dst}")

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        """Receive into the tensor the first message from rank ``src`` with ``tag``."""
        return self._recv(tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        """Receive into the tensor the first message with ``tag`` from any rank.

        The ``Work``'s ``source_rank`` is the sender once it has ended.
        """
        return self._recv(tensors, ANY, tag)

    def _recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
        tensor = collectives.one_tensor(tensors, "tensor")
        if not tensor.is_cpu:
            if src == ANY:
                return self.other_device("recv_anysource", tensor, tensors, tag)
            return self.other_device("recv", tensor, tensors, src, tag)
        if src != ANY and not 0 <= src < self.size():
            raise ArgumentValueError(f"src must be a rank of the group, got {src}")
        work = self._p2p.recv(tensor, src, tag, self.group.timeout, True)
        lane = "recv-any" if src == ANY else f"recv-{src}"
        return self.async_work(work, tensors, lane)

    def monitored_barrier(
        self, timeout: timedelta | None = None, wait_all_ranks: bool = False
    ) -> None:
        """Block until every rank has entered the barrier, up to ``timeout``; see ``monitored``.

        ``torch.distributed.monitored_barrier`` refuses every backend but one named
        "gloo"; call this method of the group instead. A failure leaves the group usable.

        Raises:
            RuntimeError: on rank 0, naming the ranks that did not enter in time; on the
                others, saying that rank 0 reported a failure.

        """
        if isinstance(timeout, (int, float)):
            timeout = timedelta(seconds=timeout)
        self._monitored(self.group.timeout if timeout is None else timeout, wait_all_ranks)

    # --- what the ops share -------------------------------------------------------------------

    def run_list(
        self,
        build: list_calls.Builder,
        op: str,
        args: tuple[Any, ...],
        extra: tuple[Any, ...],
        opts: Any,
        outputs: list[Any],
    ) -> dist.Work:
        """Run ``op`` on ``args`` through the library's list path; see ``list_calls.call``."""
        async_op = opts.asyncOp
        work = list_calls.call(build, self.group, op, args, extra, timeout_of(opts), async_op)
        return self.async_work(work, outputs) if async_op else DONE

    def async_work(
        self, work: Work | None, outputs: list[Any], lane: str = "collective"
    ) -> dist.Work:
        """Return torch's ``Work`` of the library's ``work``, on ``lane``, writing ``outputs``."""
        if work is None:
            return DONE
        return TorchWork(work, outputs, self._futures, lane)

    def other_device(self, op: str, tensor: torch.Tensor, *args: Any) -> Any:
        """Run ``op`` on a tensor of another device on torch's backend for that device.

        The backend is the one the group's configuration names for the device's kind
        (for CUDA, NCCL is made on first use); where there is none, torch raises its own
        error ("No backend type associated with device type ...").
        """
        self._bind(tensor.device)
        backend = self._get_backend(tensor.device)
        return getattr(backend, _BACKEND_OPS.get(op, op))(*args)

    def _bind(self, device: torch.device) -> None:
        """Register the backend the group's configuration names for ``device``'s kind, once."""
        kind = device.type
        with self._bound_lock:
            if kind in self._bound:
                return
            self._bound.add(kind)
            try:
                config = dist.get_backend_config(self)
            except (ValueError, RuntimeError):
                return
            names = dict(part.split(":", 1) for part in config.split(",") if ":" in part)
            if kind != "cuda" or names.get(kind) != "nccl" or not dist.is_nccl_available():
                return
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.group.timeout
            nccl = dist.ProcessGroupNCCL(
                dist.PrefixStore("nccl/", self._store), self.rank(), self.size(), options
            )
            self._register_backend(device, dist.ProcessGroup.BackendType.NCCL, nccl)

    # --- lifetime -----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Destroy the group: end pending ops with an error, release shared memory and Gloo."""
        reason = f"group {self.group.group_name!r} was destroyed on rank {self.rank()}"
        self._p2p.close(reason)
        self.group.destroy_group()
        self._futures.stop()

    def abort(self) -> None:
        """End every op pending on this rank at once, then destroy the group."""
        self.group.abort(f"group {self.group.group_name!r} was aborted on rank {self.rank()}")
        self.shutdown()
