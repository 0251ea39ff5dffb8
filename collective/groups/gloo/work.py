"""Torch plumbing for GlooGroup: the c10d module, per-call options and ``GlooWork``."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from enum import Enum
from typing import Any, Protocol

from collective.frameworks.cpu_buffers import CpuBuffer
from collective.rendezvous.store import RendezvousStore
from collective.types import DEFAULT_TIMEOUT, ArgumentValueError, CollectiveError, ReduceOp
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


@functools.cache
def _options_class(kind: str) -> Any:
    """Return torch's ``<kind>Options`` class, looked up once per kind."""
    return getattr(c10d().distributed_c10d, f"{kind}Options")


def call_options(kind: str, timeout: timedelta | None, **fields: Any) -> Any:
    """Build torch's ``<kind>Options`` for one gloo call with ``timeout`` and ``fields``.

    With ``timeout`` None the call keeps gloo's default: the group's timeout.
    """
    options = _options_class(kind)()
    if timeout is not None:
        options.timeout = timeout
    for name, value in fields.items():
        setattr(options, name, value)
    return options


_ON_BOOL = {ReduceOp.SUM: ReduceOp.MAX, ReduceOp.PRODUCT: ReduceOp.MIN}
"""What gloo runs for a reduction on bool, which it reduces as bytes: SUM is OR, PRODUCT AND."""


def c10d_reduce_op(op: ReduceOp, dtype: str) -> Any:
    """Return torch's ``ReduceOp`` that runs ``op`` on ``dtype`` tensors.

    Gloo adds and multiplies bool tensors as bytes (True + True holds 2, and 256
    Trues wrap to False), so on bool SUM runs as MAX (OR) and PRODUCT as MIN
    (AND), as the shared-memory path and numpy reduce them.
    """
    if dtype == "bool":
        op = _ON_BOOL.get(op, op)
    return getattr(c10d().ReduceOp, op.name)


def is_timeout(exc: BaseException) -> bool:
    """Return whether torch's error ``exc`` reports a timeout."""
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def is_closed(exc: BaseException) -> bool:
    """Return whether torch's error ``exc`` says a peer closed its connection in order.

    gloo closes every connection of a rank whose op failed or timed out; a killed
    process's connections are more often reset.
    """
    return "closed by peer" in str(exc).lower()


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
        raise ArgumentValueError(f"the gloo backend takes one {name} per rank, got {len(tensors)}")
    return CpuBuffer(tensors[0], name, writable)


def buffer_list(
    tensor_lists: Sequence[Sequence[Any]], name: str, writable: bool
) -> list[CpuBuffer]:
    """Return the buffers of a CPU group's single tensor list, or raise if there is not one."""
    if len(tensor_lists) != 1:
        raise ArgumentValueError(
            f"the gloo backend takes one {name} per rank, got {len(tensor_lists)}"
        )
    return [CpuBuffer(t, f"{name}[{i}]", writable) for i, t in enumerate(tensor_lists[0])]


def int64_tensor(words: list[int]) -> Any:
    """Return a new int64 torch tensor of ``words``: a control message of a gloo op."""
    import torch

    return torch.tensor(words, dtype=torch.int64)


def byte_tensor(nbytes: int) -> Any:
    """Return a new uint8 torch tensor of ``nbytes``, to receive a message into and drop."""
    import torch

    return torch.empty(nbytes, dtype=torch.uint8)


class Sequenced:
    """Two torch works of one op, waited for as one: a send's header, then its data."""

    def __init__(self, first: Any, second: Any) -> None:
        """Wait for ``first``, then ``second``."""
        self._first = first
        self._second = second

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for both works, within ``timeout`` in all; raise as torch does."""
        if timeout is None:
            self._first.wait()
            return bool(self._second.wait())
        deadline = time.monotonic() + timeout.total_seconds()
        self._first.wait(timeout)
        left = max(deadline - time.monotonic(), 0.001)
        return bool(self._second.wait(timedelta(seconds=left)))

    def is_completed(self) -> bool:
        """Return whether both works have finished."""
        return bool(self._first.is_completed() and self._second.is_completed())


def commit_all(buffers: Sequence[CpuBuffer]) -> None:
    """Write every staged buffer of an op back into its user buffer."""
    for buffer in buffers:
        buffer.commit()


class Completion(Enum):
    """How the end of a gloo op becomes known without waiting on it."""

    REPORTED = "reported"
    """torch's handle turns ``is_completed`` by itself (most collectives)."""

    WATCHED_WAIT = "watched_wait"
    """Only a wait learns of the end (gloo's composite reduce_scatter); waited in watched slices."""

    DIRECT_WAIT = "direct_wait"
    """Only a wait on the handle itself, with the op's timeout (send, recv); never sliced."""


_REPORTED = Completion.REPORTED
_DIRECT_WAIT = Completion.DIRECT_WAIT


class WorkOwner(Protocol):
    """What a ``GlooWork`` needs from its group."""

    @property
    def group_name(self) -> str:
        """Return the group's name."""

    def _fail(
        self, op: str, timeout: timedelta, exc: BaseException, number: int = 0
    ) -> CollectiveError:
        """Turn a transport failure of ``op``, the group's collective ``number``, into its error."""

    def _wait(self, op: str, torch_work: Any, timeout: timedelta | None) -> None:
        """Wait for a collective; raise ``CollectiveError`` when another rank failed."""

    @property
    def _in_flight(self) -> InFlight:
        """Return the group's tracked works."""

    def _interrupted(self, watched: bool) -> bool:
        """Return whether a wait on an op still pending here would end at once.

        True after ``abort``; with ``watched``, also once another rank reported a failure.
        """


class GlooWork(OnceWork):
    """A gloo op in flight; ``wait`` writes staged outputs back once it has succeeded.

    torch reports the end of most gloo collectives by itself. Its reduce_scatter and
    its send and recv learn of their end only inside a wait, so for those the first
    poll (``is_completed`` or ``exception``) starts a thread that waits; a caller
    that only calls ``wait`` never pays for that thread.
    """

    def __init__(
        self,
        owner: WorkOwner,
        op: str,
        torch_work: Any,
        timeout: timedelta,
        finish: Callable[[], None],
        completion: Completion,
        number: int = 0,
    ) -> None:
        """Track ``torch_work`` of ``op``; ``finish`` writes staged outputs back.

        ``number`` counts the group's collectives from 1 (0 for send and recv): a
        timeout asks the other ranks whether they reached it.
        """
        super().__init__(timeout)
        self._number = number
        self._owner = owner
        self._op = op
        self._torch_work = torch_work
        self._finish = finish
        self._completion = completion

    def _complete(self, timeout: timedelta | None) -> None:
        effective = timeout or self._timeout or DEFAULT_TIMEOUT
        try:
            if self._completion is _DIRECT_WAIT:
                self._torch_work.wait(effective)
            else:
                self._owner._wait(self._op, self._torch_work, timeout)
        except CollectiveError as exc:
            self._error = exc
        except TimeoutError as exc:
            self._error = self._owner._fail(self._op, effective, exc, self._number)
        except RuntimeError as exc:
            self._error = self._owner._fail(self._op, effective, exc, self._number)
            self._owner._in_flight.discard(self)
        else:
            self._finish()
            self._owner._in_flight.discard(self)
        self._torch_work = None
        self._finish = nothing

    def _give_up(self, timeout: timedelta | None) -> BaseException:
        effective = timeout or self._timeout or DEFAULT_TIMEOUT
        expired = TimeoutError(f"timed out waiting {effective} for the op to complete")
        return self._owner._fail(self._op, effective, expired, self._number)

    def may_run(self) -> bool:
        """Return whether the op may still be running in gloo; never blocks."""
        torch_work = self._torch_work
        reported = self._completion is _REPORTED and torch_work is not None
        return not (reported and torch_work.is_completed())

    def is_completed(self) -> bool:
        """Return whether the op has finished, successfully or not."""
        torch_work = self._torch_work
        if self._done or torch_work is None:
            return True
        if self._owner._interrupted(self._completion is not _DIRECT_WAIT):
            return True
        if self._completion is _REPORTED:
            return torch_work.is_completed()
        self._complete_in_background(f"collective-work-{self._owner.group_name}")
        return self._done

    def exception(self) -> BaseException | None:
        """Return the op's failure once it has finished with one, else None."""
        if not self.is_completed():
            return None
        try:
            self.wait()
        except CollectiveError as exc:
            return exc
        return None

    def join(self, seconds: float) -> None:
        """Wait up to ``seconds`` for the thread a poll started, if any."""
        self._join_background(seconds)


def nothing() -> None:
    """Do nothing: the ``finish`` of an op with no staged output."""


_PRUNE_AT = 64
"""Tracked works past which those torch has reported finished are forgotten, at the next op."""

_JOIN_S = 0.5
"""The longest ``InFlight.close`` waits for the threads that complete polled works to end."""


class InFlight:
    """The works of one group whose ops may still run in gloo.

    ``lock`` orders starting an op against closing the group: a group takes it
    to start an op and track its work, and to look for running ones before it
    closes its connections, so that no op starts unseen.
    """

    def __init__(self) -> None:
        """Track no work."""
        self.lock = threading.Lock()
        self._works: set[GlooWork] = set()

    def add(self, work: GlooWork) -> None:
        """Track ``work`` until ``discard``; call with ``lock`` held."""
        if len(self._works) >= _PRUNE_AT:
            self._works = {w for w in list(self._works) if w.may_run()}
        self._works.add(work)

    def discard(self, work: GlooWork) -> None:
        """Stop tracking ``work``: its op no longer runs in gloo; any thread, no lock."""
        self._works.discard(work)

    def running(self) -> list[GlooWork]:
        """Return the works whose ops may still run; call with ``lock`` held."""
        return [w for w in list(self._works) if w.may_run()]

    def close(self, pg: Any, peers: Sequence[int], running: list[GlooWork]) -> None:
        """End the ``running`` ops of ``pg`` at once, and the threads that wait on them."""
        close_connections(pg, peers)
        deadline = time.monotonic() + _JOIN_S
        for work in running:
            work.join(max(0.0, deadline - time.monotonic()))
        self._works = set()


CLOSE_TAG = 0x7FFFFFF0
"""A point-to-point tag no op uses: the receive that closes a context's connections."""


def close_connections(pg: Any, peers: Sequence[int]) -> None:
    """Close every connection of ``pg``'s gloo context; every op running in it fails at once.

    torch has no abort for gloo (``ProcessGroupGloo.abort`` does nothing, and
    ``shutdown`` waits for running ops), but gloo treats a receive that the
    application stops waiting for as fatal to its whole context: it closes every
    pair, which fails every op pending on this rank, and the peers see their
    connections to this rank close. So this posts a receive on a tag that no
    sender uses and stops waiting after 1 ms, from the first of ``peers`` whose
    connection is still open (a broken one fails the receive at once instead).
    """
    import torch

    for peer in peers:
        try:
            probe = pg.recv([torch.empty(1, dtype=torch.uint8)], peer, CLOSE_TAG)
            probe.wait(timedelta(milliseconds=1))
        except RuntimeError as exc:
            if is_timeout(exc):
                return
