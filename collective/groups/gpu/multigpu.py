"""The ``*_multigpu`` calls on a group whose ranks share GPUs: ranks that drive several GPUs.

As on NCCL, an actor of rank ``r`` that passes ``n`` tensors, one per GPU it drives,
holds the ranks ``r * n + i`` of a group of ``world_size * n``. NCCL refuses two of
those ranks on one GPU, so on the first call with ``n`` tensors on a set of this
process's devices the ranks exchange where each tensor's GPU is (node and UUID) and
build that group once:

- each of its ranks on a GPU of its own: one ``NCCLGroup`` over the ranks, which runs
  the lists itself;
- several on some GPU: one group per tensor, in this process, each on its tensor's
  GPU, as ``connect`` builds any group of ranks that share GPUs (device memory inside
  each GPU, NCCL among the GPUs). A call runs the same op on each of them, each on
  its own thread, on the caller's current stream of its tensor's GPU, and returns once
  every one is issued.

A later call on the same devices looks its group up; another set of devices makes
another group, the ``k``-th set each rank used (so every rank must use its sets in the
same order, as NCCL's communicators keyed by device list ask too). A failure of one of
those groups breaks the group on every rank.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

from collective.groups import topology
from collective.groups.base import BaseGroup
from collective.groups.launches import Prepared
from collective.groups.shared_gpu.device import Device
from collective.groups.shared_gpu.running import PER_THREAD_STREAM, Buffers, SharedGpuRunning
from collective.rendezvous.store import PrefixedRendezvousStore, RendezvousStore
from collective.types import (
    ArgumentError,
    ArgumentValueError,
    CollectiveError,
    CollectiveTimeoutError,
)
from collective.work import CompletedWork, Work

_LIST_AT = {"allreduce": 0, "reduce": 0, "broadcast": 0, "allgather": 1, "reducescatter": 0}
"""Where each op that takes one tensor per GPU has that list among its arguments."""

_PER_GPU_LISTS = {
    "allgather": (0, "output_tensor_lists"),
    "reducescatter": (1, "input_tensor_lists"),
}
"""Where the ops with a list of tensors per GPU have those lists, and their public name."""

_BUILD_MARGIN_S = 5.0
"""How much longer than the group's timeout the groups of a device set may take to build."""


@dataclass(frozen=True)
class Gpus:
    """Find the GPUs of this process by CUDA ordinal: each one's ``Device``, made current."""

    device: Callable[[int], Device]
    """The transport's ``Device`` on a GPU (``CudaDevice`` on it)."""
    current: Callable[[int], AbstractContextManager[Any]]
    """A context that makes a GPU current in this thread (``cupy.cuda.Device``)."""


Whole = Callable[[str, RendezvousStore], BaseGroup]
"""Makes an ``NCCLGroup`` over the group's ranks, of ``(name, store)``."""

Member = Callable[[list[list[str]], int, int, str, RendezvousStore, Device], BaseGroup]
"""Makes the group of ``(places, world_size, rank, name, store, device)`` (``connect``)."""


@dataclass
class _Set:
    """The group(s) that run the calls on one set of devices."""

    whole: BaseGroup | None = None
    members: list[BaseGroup] = field(default_factory=list)

    def groups(self) -> list[BaseGroup]:
        return [self.whole] if self.whole is not None else list(self.members)


class SeveralGpus:
    """Runs a group's calls with one tensor per GPU; see the module docstring."""

    def __init__(
        self,
        group: SharedGpuRunning,
        store: RendezvousStore,
        node: str,
        buffers: Buffers,
        gpus: Gpus,
        whole: Whole,
        member: Member,
    ) -> None:
        """Serve ``group``, whose ranks meet on ``store`` and sit on ``node``."""
        self._group = group
        self._store = store
        self._node = node
        self._buffers = buffers
        self._gpus = gpus
        self._whole = whole
        self._member = member
        self._sets: dict[tuple[int, ...], _Set] = {}
        self._made = 0
        self._lock = threading.Lock()

    def takes(self, op: str, args: tuple[Any, ...]) -> bool:
        """Return whether ``op(*args)`` passes more than one tensor per list."""
        at = _LIST_AT.get(op)
        return at is not None and len(args[at]) > 1

    def prepare(self, op: str, args: tuple[Any, ...], options: Any) -> tuple[Prepared, bool]:
        """Check the call, build the groups of its devices on first use, return its run.

        Raises:
            ArgumentValueError: two tensors of a rank share a GPU, or a per-GPU list is
                not on its tensor's GPU or does not hold ``world_size * n`` tensors.
            CollectiveError: the ranks pass different numbers of tensors.
            CollectiveTimeoutError: not every rank joined within the group's timeout.

        """
        ordinals = self._check(op, args)
        found = self._set_of(ordinals)
        if found.whole is not None:
            return found.whole.prepare(op, args, options)
        members, n = found.members, len(ordinals)
        each = replace(options, async_op=True)
        if op in ("reduce", "broadcast"):
            root = options.root_rank * n + options.root_tensor
            each = replace(each, root_rank=root, root_tensor=0)

        def run(make: Callable[[], tuple[Any, ...]]) -> Work:
            return self._fan_out(op, members, make(), each, options.async_op)

        return run, True

    def _check(self, op: str, args: tuple[Any, ...]) -> tuple[int, ...]:
        """Return the CUDA ordinal of each GPU of the call; raise on a wrong one."""
        name = "input_tensor_list" if op == "allgather" else "tensor_list"
        if op == "reducescatter":
            name = "output_tensor_list"
        describe = self._buffers.describe
        ordinals = tuple(
            describe(t, f"{name}[{i}]").device for i, t in enumerate(args[_LIST_AT[op]])
        )
        for i, d in enumerate(ordinals):
            if d in ordinals[:i]:
                raise ArgumentValueError(
                    f"{name} must hold one tensor per GPU, got {name}[{ordinals.index(d)}] "
                    f"and {name}[{i}] both on cuda:{d}"
                )
        if op in _PER_GPU_LISTS:
            at, lists_name = _PER_GPU_LISTS[op]
            width = self._group.world_size * len(ordinals)
            for i, (d, xs) in enumerate(zip(ordinals, args[at], strict=True)):
                if len(xs) != width:
                    raise ArgumentValueError(
                        f"{lists_name}[{i}] must hold world_size * {len(ordinals)} = {width} "
                        f"tensors, got {len(xs)}"
                    )
                for k, x in enumerate(xs):
                    where = describe(x, f"{lists_name}[{i}][{k}]").device
                    if where != d:
                        raise ArgumentValueError(
                            f"{lists_name}[{i}][{k}] is on cuda:{where}; expected cuda:{d}, "
                            f"the GPU of {name}[{i}]"
                        )
        return ordinals

    def _set_of(self, ordinals: tuple[int, ...]) -> _Set:
        """Return the groups of this set of devices, built on first use (every rank at once)."""
        with self._lock:
            found = self._sets.get(ordinals)
            if found is None:
                number, self._made = self._made, self._made + 1
                found = self._sets[ordinals] = self._connect(ordinals, number)
            return found

    def _connect(self, ordinals: tuple[int, ...], number: int) -> _Set:
        """Build the groups of the ``number``-th set of devices (see the module docstring)."""
        group = self._group
        world, rank, timeout = group.world_size, group.rank, group.timeout
        name = f"{group.group_name}/gpus{number}"
        store = PrefixedRendezvousStore(self._store, f"gpus/{number}/")
        devices = [self._gpus.device(d) for d in ordinals]
        mine = [self._node] + [device.uuid() for device in devices]
        try:
            everyone = topology.exchange(store, "where", rank, world, mine, timeout)
        except TimeoutError as exc:
            raise CollectiveTimeoutError("init", name, rank, timeout, str(exc)) from exc
        counts = [len(place) - 1 for place in everyone]
        if len(set(counts)) > 1:
            told = ", ".join(f"rank {r} {c}" for r, c in enumerate(counts))
            raise CollectiveError(
                f"group {group.group_name!r}: the ranks pass different numbers of tensors to "
                f"a *_multigpu call ({told}); each must pass one per GPU it drives, as many "
                "as the others"
            )
        places = [[place[0], gpu] for place in everyone for gpu in place[1:]]
        if len({tuple(p) for p in places}) == len(places):
            return _Set(whole=self._whole(name, store))
        return _Set(members=self._members(places, ordinals, devices, name, store, timeout))

    def _members(
        self,
        places: list[list[str]],
        ordinals: tuple[int, ...],
        devices: list[Device],
        name: str,
        store: RendezvousStore,
        timeout: timedelta,
    ) -> list[BaseGroup]:
        """Build the group of every tensor of this rank at once, each on its GPU's thread."""
        n, rank = len(ordinals), self._group.rank
        built: list[BaseGroup | None] = [None] * n
        errors: list[BaseException] = []

        def build(i: int) -> None:
            own = store.watcher()  # a connection of its own: the members block on it at once
            try:
                with self._gpus.current(ordinals[i]):
                    built[i] = self._member(
                        places, len(places), rank * n + i, name, own, devices[i]
                    )
            except BaseException as exc:
                errors.append(exc)

        threads = [
            threading.Thread(target=build, args=(i,), name=f"{name}-{i}", daemon=True)
            for i in range(n)
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + timeout.total_seconds() + _BUILD_MARGIN_S
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
        made = [g for g in built if g is not None]
        if errors or len(made) < n:
            for g in made:
                g.destroy_group()
            if errors:
                raise errors[0]
            raise CollectiveTimeoutError("init", name, rank, timeout, "a GPU's group never ended")
        return made

    def _fan_out(
        self, op: str, members: list[BaseGroup], args: tuple[Any, ...], each: Any, keep: bool
    ) -> Work:
        """Issue ``op`` on every member with its GPU's arguments; return one ``Work`` for all.

        ``keep`` (the caller's ``async_op``) returns that ``Work``; otherwise this
        returns once every part is issued, or raises the first failure.
        """
        group = self._group
        group._check_usable(destroyed=group._closing)
        for tensor in args[_LIST_AT[op]]:  # a caller's mistake raises before any part starts
            self._ready(op, tensor)
        works: list[Work] = []
        try:
            for member, part in zip(members, _split(op, args, len(members)), strict=True):
                works.append(getattr(member, op)(*part, each))
        except BaseException as exc:
            if works:  # the parts already issued wait for this one on the other ranks
                self._failed(exc, members)
            raise
        work = _AllOf(works, lambda exc: self._failed(exc, members))
        if keep:
            return work
        work.wait()
        return CompletedWork()

    def _ready(self, op: str, tensor: Any) -> None:
        """Raise where a GPU's part could not run on the caller's stream of ``tensor``."""
        if self._buffers.capturing(tensor):
            raise ArgumentValueError(
                f"{op}_multigpu on group {self._group.group_name!r} cannot be captured in a "
                "CUDA graph: its ranks share GPUs and take each step together on the host"
            )
        if self._buffers.stream_of(tensor) == PER_THREAD_STREAM:
            raise ArgumentValueError(
                f"{op}_multigpu on group {self._group.group_name!r} cannot run on the "
                "per-thread default stream (CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1): each GPU's "
                "part is issued from a thread of its own; make a stream current"
            )

    def _failed(self, exc: BaseException, members: Sequence[BaseGroup]) -> None:
        """Break the group and end the other GPUs' parts: a part failed (or never started)."""
        if isinstance(exc, ArgumentError):
            exc = CollectiveError(f"a GPU's part was refused after the others had started: {exc}")
        error = exc if isinstance(exc, CollectiveError) else CollectiveError(str(exc))
        self._group._break(error)
        for member in members:
            member.abort(str(error))

    def abort(self, reason: str) -> None:
        """End the ops pending in every group built here."""
        for found in list(self._sets.values()):
            for g in found.groups():
                g.abort(reason)

    def destroy(self) -> None:
        """Destroy every group built here, each from a thread of its own, all at once.

        A GPU's group frees its memory once the other ranks on that GPU have unmapped
        it, and another rank may be destroying its group of another GPU first: one at a
        time, the ranks would wait for each other.
        """
        sets, self._sets = list(self._sets.values()), {}
        groups = [g for found in sets for g in found.groups()]
        threads = [
            threading.Thread(target=g.destroy_group, name=f"collective-destroy-{i}", daemon=True)
            for i, g in enumerate(groups)
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + self._group.timeout.total_seconds() + _BUILD_MARGIN_S
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0.0))


def _split(op: str, args: tuple[Any, ...], n: int) -> list[tuple[Any, ...]]:
    """Return each GPU's arguments of the call: its tensor, and its list where there is one."""
    if op in _PER_GPU_LISTS:
        first, second = args
        return [([first[i]], [second[i]]) for i in range(n)]
    (tensors,) = args
    return [([tensors[i]],) for i in range(n)]


class _AllOf(Work):
    """The ``Work`` of every GPU's part of one call; the first failure ends the others."""

    def __init__(self, works: list[Work], failed: Callable[[BaseException], None]) -> None:
        self._works = works
        self._failed = failed

    def wait(self, timeout: timedelta | None = None) -> None:
        """Wait for every part (within ``timeout`` in all); raise the first failure."""
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        first: BaseException | None = None
        for work in self._works:
            left = None
            if deadline is not None:
                left = timedelta(seconds=max(deadline - time.monotonic(), 0.001))
            try:
                work.wait(left)
            except BaseException as exc:
                if first is None:
                    first = exc
                    self._failed(exc)
        if first is not None:
            raise first

    def is_completed(self) -> bool:
        """Return whether every part has finished."""
        return all(work.is_completed() for work in self._works)

    def exception(self) -> BaseException | None:
        """Return the first part's failure, once it has one."""
        for work in self._works:
            found = work.exception()
            if found is not None:
                return found
        return None
