"""BaseGroup: the abstract API every backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from datetime import timedelta
from typing import Any, ClassVar

from collective.frameworks.cpu_buffers import cpu_key
from collective.frameworks.kinds import TensorSpec
from collective.frameworks.memory import start_address
from collective.groups.launches import Launch, Launches, Prepared
from collective.types import (
    DEFAULT_TIMEOUT,
    AllGatherOptions,
    AllReduceOptions,
    AllToAllOptions,
    ArgumentTypeError,
    ArgumentValueError,
    Backend,
    BarrierOptions,
    BroadcastOptions,
    CollectiveError,
    GatherOptions,
    GroupOptions,
    RecvOptions,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
    SendOptions,
)
from collective.work import Work


class BaseGroup(ABC):
    """One collective group as seen by one of its ranks.

    Ops take lists of tensors, one per device the rank drives (a single element
    except in the ``*_multigpu`` calls), and write their results in place.
    Arguments reach a group already checked; a group only moves data.

    Every op returns a ``Work``. With ``options.async_op`` False the op has
    finished, and its outputs are written, when it returns; with True it may
    still be running, and the caller must ``wait`` on the handle before touching
    the buffers.

    A backend class is built as ``cls(world_size, rank, group_name, store, timeout,
    host, options=options)``, with ``store`` a ``RendezvousStore`` through which its
    ranks meet, ``host`` the address this rank's transport binds to and ``options``
    the group's resolved ``GroupOptions``.
    """

    device_type: ClassVar[str] = "cpu"
    """The device kind ("cpu" or "cuda") whose buffers this backend takes."""

    dtypes: ClassVar[frozenset[str]] = frozenset()
    """The dtype names this backend reduces and moves."""

    supported_ops: ClassVar[frozenset[ReduceOp]] = frozenset(ReduceOp)
    """The reductions this backend implements."""

    def __init__(
        self,
        world_size: int,
        rank: int,
        group_name: str,
        timeout: timedelta = DEFAULT_TIMEOUT,
        options: GroupOptions | None = None,
    ) -> None:
        """Record the group's identity and settings; subclasses connect the ranks."""
        self._world_size = world_size
        self._rank = rank
        self._group_name = group_name
        self._timeout = timeout
        self._options = (options or GroupOptions()).resolved()
        self._error: CollectiveError | None = None
        self._aborted: str | None = None
        self.launches = Launches()
        """The launches of this group's calls; see ``launches``."""

    @property
    def world_size(self) -> int:
        """Return the number of ranks in the group."""
        return self._world_size

    @property
    def rank(self) -> int:
        """Return this process's rank in the group."""
        return self._rank

    @property
    def group_name(self) -> str:
        """Return the group's name."""
        return self._group_name

    @property
    def timeout(self) -> timedelta:
        """Return the default timeout of the group's waits and ops."""
        return self._timeout

    @property
    def options(self) -> GroupOptions:
        """Return the group's settings, every field resolved."""
        return self._options

    @property
    def transport(self) -> str:
        """Return how this group moves bytes; CPU groups say "shm", "hierarchical" or "gloo"."""
        return self.backend_name()

    @property
    def error(self) -> CollectiveError | None:
        """Return the failure that made this group unusable, or None if it is healthy."""
        return self._error

    def _check_usable(self, destroyed: bool) -> None:
        """Raise at once if an earlier failure broke the group or it was destroyed."""
        if self._error is not None:
            raise CollectiveError(
                f"group {self.group_name!r} is unusable after an earlier failure; destroy it "
                f"and create it again. The failure was: {self._error}"
            )
        if destroyed:
            raise CollectiveError(f"group {self.group_name!r} has been destroyed")
        if self._aborted is not None:
            raise CollectiveError(f"group {self.group_name!r} was aborted: {self._aborted}")

    def _aborted_error(self, op: str) -> CollectiveError:
        """Return the error that ends ``op``, pending when the group was aborted."""
        return CollectiveError(
            f"{op} on group {self.group_name!r} ended on rank {self.rank}: {self._aborted}"
        )

    @classmethod
    @abstractmethod
    def backend(cls) -> Backend | str:
        """Return the backend this class implements: a ``Backend`` or a registered name."""

    @classmethod
    @abstractmethod
    def check_backend_availability(cls) -> bool:
        """Return whether this backend's dependencies are importable here."""

    @classmethod
    def backend_name(cls) -> str:
        """Return the backend's name as users pass it, e.g. ``"gloo"``."""
        backend = cls.backend()
        return backend.value if isinstance(backend, Backend) else str(backend)

    @classmethod
    def unavailable_reason(cls) -> str:
        """Return what to install when ``check_backend_availability`` is False."""
        return f"the {cls.backend_name()} backend's dependencies are not installed"

    def check_tensor(self, spec: TensorSpec, name: str) -> None:
        """Reject a buffer this backend cannot use.

        Raises:
            ArgumentTypeError: the buffer is on the wrong device kind or of an unsupported dtype.

        """
        backend = self.backend_name()
        if spec.device.split(":")[0] != self.device_type:
            other = "gloo" if self.device_type == "cuda" else "nccl"
            raise ArgumentTypeError(
                f"{name} must be a {self.device_type} tensor for a {backend} "
                f"group, got one on {spec.device}; use a {other} group for it, or move it"
            )
        if spec.dtype not in self.dtypes:
            raise ArgumentTypeError(
                f"{name} has dtype {spec.dtype}, which the {backend} backend "
                f"does not support; supported: {sorted(self.dtypes)}"
            )

    def check_reduce_op(self, op: ReduceOp, dtype: str) -> None:
        """Reject a reduction this backend cannot apply to ``dtype`` tensors.

        Raises:
            ArgumentValueError: the backend does not implement ``op``.
            ArgumentTypeError: ``op`` is not defined on ``dtype``, e.g. AVG on integers.

        """
        if op not in self.supported_ops:
            names = ", ".join(o.name for o in ReduceOp if o in self.supported_ops)
            raise ArgumentValueError(
                f"the {self.backend_name()} backend does not support ReduceOp.{op.name}; "
                f"supported: {names}"
            )
        if not op.accepts(dtype):
            kinds = "floating-point" if op is ReduceOp.AVG else "integer and bool"
            raise ArgumentTypeError(
                f"ReduceOp.{op.name} does not take {dtype} tensors: op {op.name} takes "
                f"{kinds} tensors only"
            )

    def skip_agreement(self) -> None:
        """Run each op without first checking that the ranks agree on it.

        A backend whose transport cannot survive ranks that disagree (on the op,
        its root or reduction, or a buffer's dtype or size) checks that they agree
        before each op moves data. ``CheckedGroup`` calls this on the group it
        wraps: it checks every call across ranks itself, so the group need not
        pay twice. This one has no such check.
        """
        return None

    key_of = staticmethod(cpu_key)
    """Return what a launch on buffer ``x`` and its checks depend on (``collective.ops.calls``)."""

    def placed_key(self, x: Any) -> Hashable | None:
        """Return ``key_of(x)`` with where ``x``'s elements start; None if it has no key.

        What a call on several buffers depends on in each: the checks on how its
        buffers overlap read their addresses (``collective.ops.list_calls``).
        """
        key = self.key_of(x)
        return None if key is None else (key, start_address(x))

    def build(self, op: str, x: Any, options: Any) -> tuple[Launch, bool]:
        """Return the launch of ``op`` on buffers like ``x``, and whether to keep it.

        ``op`` is in ``collective.ops.calls.ONE_BUFFER``, ``options`` are checked. This
        one calls the op.
        """
        method = getattr(self, op)
        if options.async_op:
            return (lambda x: method([x], options)), True

        def launch(x: Any) -> None:
            method([x], options)

        return launch, True

    def prepare(self, op: str, args: tuple[Any, ...], options: Any) -> tuple[Prepared, bool]:
        """Return a run of ``getattr(self, op)(*args, options)`` for calls like this one.

        ``op`` is one of the group's ops, ``args`` its arguments but the options, on
        this call, and ``options`` checked. The run is called, on this call and later
        ones whose key is the same, with a function that makes that call's arguments;
        it returns the op's ``Work``. With it a backend finds what a call does once:
        the second value says whether the run may be kept for later calls. This one
        calls the op each time.
        """
        method = getattr(self, op)
        return (lambda make: method(*make(), options)), True

    @property
    def takes_lists(self) -> bool:
        """Return whether ``broadcast_list`` moves a list of buffers as one message.

        The same on every rank of the group. A caller with many tensors to move
        (the bulk calls) hands them over as they are where it is True, and packs
        them into buckets of ordinary ops elsewhere.
        """
        return False

    def broadcast_list(self, tensors: Sequence[Any], options: BroadcastOptions) -> Work:
        """Copy the root's ``tensors`` into every other rank's, in order, as one message.

        Every rank passes as many tensors, of the same byte sizes in the same order;
        the root's are only read, every other rank's are written. Only a group whose
        ``takes_lists`` is True has it.

        Raises:
            CollectiveError: this group moves one buffer per op.

        """
        raise CollectiveError(f"{type(self).__name__} does not take a list of buffers as one op")

    @abstractmethod
    def allreduce(self, tensors: Sequence[Any], options: AllReduceOptions) -> Work:
        """Reduce ``tensors`` across ranks; every rank's buffers receive the result."""

    @abstractmethod
    def barrier(self, options: BarrierOptions) -> Work:
        """Block until every rank has entered the barrier."""

    @abstractmethod
    def reduce(self, tensors: Sequence[Any], options: ReduceOptions) -> Work:
        """Reduce ``tensors`` onto the root; only the root's buffer is written."""

    @abstractmethod
    def broadcast(self, tensors: Sequence[Any], options: BroadcastOptions) -> Work:
        """Copy the root's buffer into every other rank's buffer."""

    @abstractmethod
    def allgather(
        self,
        tensor_lists: Sequence[Sequence[Any]],
        tensors: Sequence[Any],
        options: AllGatherOptions,
    ) -> Work:
        """Gather every rank's tensor into each rank's list; the lists are written."""

    @abstractmethod
    def reducescatter(
        self,
        tensors: Sequence[Any],
        tensor_lists: Sequence[Sequence[Any]],
        options: ReduceScatterOptions,
    ) -> Work:
        """Reduce the lists elementwise; rank i's ``tensors`` receive the i-th result."""

    @abstractmethod
    def send(self, tensors: Sequence[Any], options: SendOptions) -> Work:
        """Send ``tensors`` to ``options.dst_rank``."""

    @abstractmethod
    def recv(self, tensors: Sequence[Any], options: RecvOptions) -> Work:
        """Receive into ``tensors`` from ``options.src_rank``."""

    @abstractmethod
    def gather(
        self,
        tensor_lists: Sequence[Sequence[Any]],
        tensors: Sequence[Any],
        options: GatherOptions,
    ) -> Work:
        """Gather every rank's tensor into the root's list; only the root's list is written.

        ``tensor_lists`` holds one list of world-size buffers on the root and one
        empty list on every other rank.
        """

    @abstractmethod
    def scatter(
        self,
        tensors: Sequence[Any],
        tensor_lists: Sequence[Sequence[Any]],
        options: ScatterOptions,
    ) -> Work:
        """Copy element i of the root's list into rank i's tensor; the list is only read.

        ``tensor_lists`` holds one list of world-size buffers on the root and one
        empty list on every other rank.
        """

    @abstractmethod
    def alltoall(
        self, outputs: Sequence[Any], inputs: Sequence[Any], options: AllToAllOptions
    ) -> Work:
        """Send ``inputs[j]`` to rank j; ``outputs[j]`` receives what rank j sent here.

        Both lists hold world-size buffers of one dtype. Their sizes may differ per
        peer: ``outputs[j]`` on rank i matches ``inputs[i]`` on rank j.
        """

    def watch_stream(self, stream: int, device: int, timeout: timedelta) -> None:
        """Fail the group unless the work on GPU ``device``'s ``stream`` ends within ``timeout``."""
        raise ArgumentValueError(f"group {self.group_name!r} drives no GPU stream to watch")

    def abort(self, reason: str) -> None:
        """End every op pending on this rank at once; the group is unusable after.

        The contract every backend keeps, on which ``destroy_group`` (and a destroy
        from the driver) relies:

        - It returns within a second, and never waits for another rank.
        - Every op pending on this rank ends with a ``CollectiveError`` whose message
          contains ``reason``, raised to whoever waits for it: a thread blocked in a
          blocking op of this group, and any later ``wait`` or ``exception`` of an
          async op's ``Work``, whose ``is_completed`` turns True. Ops that had
          already finished keep their outcome.
        - Every later op raises ``CollectiveError`` at once.
        - It may be called from any thread, while ops run in others, and more than
          once; the first reason is kept.
        - It need not release connections or threads (``destroy_group`` does), and
          it may make the other ranks' pending ops fail, as the loss of this rank
          would.

        This base version marks the group and drops its launches; a backend that can have ops
        pending overrides it to end them, calling ``super().abort(reason)`` first.
        """
        if self._aborted is None:
            self._aborted = reason
        self.launches.clear()

    @abstractmethod
    def destroy_group(self) -> None:
        """Release the group's connections and threads; the group is unusable after.

        Returns within a second, even with ops pending in other threads or in
        unwaited ``Work``: it first calls ``abort``, so those ops end with a
        ``CollectiveError`` that says the group was destroyed.
        """

    def retire(self, reason: str) -> None:
        """Abort this group and release it without waiting on any peer: it is being replaced.

        A shrink or grow replaces a group with a new incarnation while some peers may
        be dead. The default aborts with ``reason``, then destroys; a backend whose
        destroy can wait on peers (NCCL's ``ncclCommDestroy``) overrides this to
        abort its connections instead.
        """
        self.abort(reason)
        self.destroy_group()
