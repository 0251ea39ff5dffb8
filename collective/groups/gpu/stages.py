"""What a group across GPUs asks of NCCL and of cupy: the stages' groups and device arrays.

``Stages`` is the part of ``NCCLGroup`` the hierarchy (``hierarchy``) uses, so that the
tests can stand in for NCCL with groups that move host memory; ``Arrays`` the device
arrays it makes itself (typed views, scratch, a stream made current for a view).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

from collective.frameworks import device_arrays
from collective.rendezvous.store import RendezvousStore
from collective.types import (
    AllGatherOptions,
    AllReduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    CollectiveError,
    GatherOptions,
    RecvOptions,
    ReduceOp,
    ReduceOptions,
    ScatterOptions,
    SendOptions,
)
from collective.work import Work


class Stages(Protocol):
    """What the hierarchy asks of the group among leaders and the pair group: ``NCCLGroup``."""

    @property
    def error(self) -> CollectiveError | None: ...  # noqa: D102

    def agree(  # noqa: D102
        self, op: str, x: Any, root: int, reduce_op: ReduceOp | None, timeout: timedelta
    ) -> None: ...

    def on_failure(self, listener: Callable[[CollectiveError], None]) -> None: ...  # noqa: D102
    def fail(self, error: CollectiveError) -> None: ...  # noqa: D102
    def skip_agreement(self) -> None: ...  # noqa: D102
    def abort(self, reason: str) -> None: ...  # noqa: D102
    def destroy_group(self) -> None: ...  # noqa: D102
    def retire(self, reason: str) -> None: ...  # noqa: D102
    def allreduce(self, tensors: Sequence[Any], options: AllReduceOptions) -> Work: ...  # noqa: D102
    def reduce(self, tensors: Sequence[Any], options: ReduceOptions) -> Work: ...  # noqa: D102
    def broadcast(self, tensors: Sequence[Any], options: BroadcastOptions) -> Work: ...  # noqa: D102
    def barrier(self, options: BarrierOptions) -> Work: ...  # noqa: D102
    def send(self, tensors: Sequence[Any], options: SendOptions) -> Work: ...  # noqa: D102
    def recv(self, tensors: Sequence[Any], options: RecvOptions) -> Work: ...  # noqa: D102

    def allgather(  # noqa: D102
        self,
        tensor_lists: Sequence[Sequence[Any]],
        tensors: Sequence[Any],
        options: AllGatherOptions,
    ) -> Work: ...

    def gather(  # noqa: D102
        self, tensor_lists: Sequence[Sequence[Any]], tensors: Sequence[Any], options: GatherOptions
    ) -> Work: ...

    def scatter(  # noqa: D102
        self,
        tensors: Sequence[Any],
        tensor_lists: Sequence[Sequence[Any]],
        options: ScatterOptions,
    ) -> Work: ...

    def alltoall(  # noqa: D102
        self, outputs: Sequence[Any], inputs: Sequence[Any], options: AllToAllOptions
    ) -> Work: ...


MakeStages = Callable[[int, int, str, RendezvousStore], Stages]
"""Makes the group of ``(world_size, rank, group_name, store)``: an ``NCCLGroup``."""


@dataclass(frozen=True)
class Arrays:
    """How the hierarchy makes its own device arrays; ``device_arrays`` gives cupy's."""

    typed: Callable[[Any, str], Any]
    """Views flat device bytes as elements of a dtype, for a reduction among leaders."""
    empty: Callable[[int], Any]
    """Makes scratch bytes on the current device and stream."""
    on_stream: Callable[[Any, int], AbstractContextManager[None]]
    """Makes a stream current for a typed view's library, for a leaders' call."""


DEVICE_ARRAYS = Arrays(device_arrays.typed, device_arrays.empty, device_arrays.on_stream)
