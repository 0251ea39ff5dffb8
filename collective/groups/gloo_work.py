"""Torch plumbing for GlooGroup: the c10d module, per-call options and ``GlooWork``."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from collective.store import RendezvousStore
from collective.tensor import CpuBuffer
from collective.types import CollectiveError, ReduceOp
from collective.work import OnceWork


@functools.cache
def c10d() -> Any:
    """Return ``torch.distributed``, or raise what to install when it is unusable."""
    try:
        import torch.distributed as dist
    except ImportError as exc:
        raise CollectiveError(
            "the gloo backend needs torch with torch.distributed: pip install torch"
        ) from exc
    if not dist.is_available() or not dist.is_gloo_available():
        raise CollectiveError(
            "this torch build has no gloo support; install a standard torch wheel"
        )
    return dist


def call_options(kind: str, timeout: timedelta | None, **fields: Any) -> Any:
    """Build torch's ``<kind>Options`` for one gloo call with ``timeout`` and ``fields``.

    With ``timeout`` None the call keeps gloo's default: the group's timeout.
    """
    options = getattr(c10d().distributed_c10d, f"{kind}Options")()
    if timeout is not None:
        options.timeout = timeout
    for name, value in fields.items():
        setattr(options, name, value)
    return options


def c10d_reduce_op(op: ReduceOp) -> Any:
    """Return torch's ``ReduceOp`` for ``op``."""
    return getattr(c10d().ReduceOp, op.name)


def is_timeout(exc: BaseException) -> bool:
    """Return whether torch's error ``exc`` reports a timeout."""
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


ADDRESS_KEY = "gloo/address"
"""Store key under which rank 0 publishes its TCPStore's ``host:port``."""


def connect_tcp_store(store: RendezvousStore, rank: int, host: str, timeout: timedelta) -> Any:
    """Return a torch TCPStore for a gloo group: rank 0 serves one on a free port at ``host``.

    Rank 0 publishes ``host:port`` in ``store``; the other ranks wait for it and connect.
    """
    if rank == 0:
        tcp_store = c10d().TCPStore(host, 0, None, True, timeout, wait_for_workers=False)
        store.set(ADDRESS_KEY, f"{host}:{tcp_store.port}".encode())
        return tcp_store
    address = store.get(ADDRESS_KEY, timeout).decode()
    master, _, port = address.rpartition(":")
    return c10d().TCPStore(master, int(port), None, False, timeout)


def one_buffer(tensors: Sequence[Any], name: str, writable: bool) -> CpuBuffer:
    """Return the single CPU buffer of a CPU group's op, or raise if there is not one."""
    if len(tensors) != 1:
        raise ValueError(f"the gloo backend takes one {name} per rank, got {len(tensors)}")
    return CpuBuffer(tensors[0], name, writable)


def buffer_list(
    tensor_lists: Sequence[Sequence[Any]], name: str, writable: bool
) -> list[CpuBuffer]:
    """Return the buffers of a CPU group's single tensor list, or raise if there is not one."""
    if len(tensor_lists) != 1:
        raise ValueError(f"the gloo backend takes one {name} per rank, got {len(tensor_lists)}")
    return [CpuBuffer(t, f"{name}[{i}]", writable) for i, t in enumerate(tensor_lists[0])]


def commit_all(buffers: Sequence[CpuBuffer]) -> None:
    """Write every staged buffer of an op back into its user buffer."""
    for buffer in buffers:
        buffer.commit()


class GlooWork(OnceWork):
    """A gloo op in flight; ``wait`` writes staged outputs back once it has succeeded."""

    def __init__(
        self,
        fail: Callable[[timedelta, BaseException], CollectiveError],
        wait: Callable[[Any, timedelta | None], None],
        torch_work: Any,
        timeout: timedelta,
        finish: Callable[[], None],
        p2p: bool,
    ) -> None:
        """Track ``torch_work``.

        ``fail`` turns a transport failure into the group's error; ``wait`` waits
        for a collective (and raises ``CollectiveError`` when another rank failed);
        point-to-point ops wait on torch's handle directly.
        """
        super().__init__()
        self._fail = fail
        self._wait_collective = wait
        self._torch_work = torch_work
        self._timeout = timeout
        self._finish = finish
        self._p2p = p2p

    def _complete(self, timeout: timedelta | None) -> None:
        effective = timeout or self._timeout
        try:
            if self._p2p:
                self._torch_work.wait(effective)
            else:
                self._wait_collective(self._torch_work, timeout)
        except CollectiveError as exc:
            self._error = exc
        except (RuntimeError, TimeoutError) as exc:
            self._error = self._fail(effective, exc)
        else:
            self._finish()
        self._torch_work = None
        self._finish = lambda: None

    def is_completed(self) -> bool:
        """Return whether the op has finished, successfully or not."""
        with self._lock:
            return self._done or self._torch_work.is_completed()

    def exception(self) -> BaseException | None:
        """Return the op's failure once it has finished with one, else None."""
        if not self.is_completed():
            return None
        try:
            self.wait()
        except CollectiveError as exc:
            return exc
        return None
