"""Ray Direct Transport over this library's groups: ``tensor_transport="COLLECTIVE"``.

A method declared with ``@ray.method(tensor_transport=name)`` keeps the tensors it
returns in its actor; when the driver passes the result to another actor's task, Ray
calls ``send_multiple_tensors`` in the producer and ``recv_multiple_tensors`` in the
consumer, and the tensors move between them without the object store. The two
actors need a Ray collective group of backend ``name`` between them (made with
``ray.experimental.collective.create_collective_group(actors, backend=name)``);
``register_tensor_transport`` registers that backend too. All the tensors of one
object move in a header and a few messages (``wire``): shared memory inside a node,
Gloo across nodes, NCCL for CUDA tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ray.experimental.rdt.collective_tensor_transport import (
    CollectiveCommunicatorMetadata,
    CollectiveTensorTransport,
    CollectiveTransportMetadata,
)

from collective.ray_plugins import wire
from collective.ray_plugins.backend import RayGroup, is_ours, ray_group
from collective.ray_plugins.carried import refuse_uncarried
from collective.ray_plugins.names import DEFAULT_NAME
from collective.registry import held, queries
from collective.types import CollectiveError


@dataclass
class ObjectMetadata(CollectiveTransportMetadata):
    """Ray's metadata of a collective transport's object, and the object's id.

    The id travels with the metadata to both ends, so the sender can name the
    object in the transfer's header and the receiver check it.
    """

    obj_id: str = ""


class CollectiveTransport(CollectiveTensorTransport):
    """A two-sided tensor transport over Ray collective groups of this library's backend.

    Ray's own ``CollectiveTensorTransport`` finds the pair's group and ranks; this
    class moves the tensors (``wire``) and can abort a transfer: Ray then calls
    ``abort_transport`` in both actors, which ends their pending transfer, instead
    of killing them.
    """

    def tensor_transport_backend(self) -> str:
        """Return the default transport name; any name registered to this class works alike."""
        return DEFAULT_NAME

    @staticmethod
    def can_abort_transport() -> bool:
        """Return True: ``abort_transport`` ends a pending send or receive within a second."""
        return True

    def actor_has_tensor_transport(self, actor: Any) -> bool:
        """Return whether ``actor`` is in a Ray collective group of a backend of this library."""
        from ray.experimental.collective import get_collective_groups

        return any(is_ours(group.backend) for group in get_collective_groups([actor]))

    def extract_tensor_transport_metadata(self, obj_id: str, rdt_object: list[Any]) -> Any:
        """Return the tensors' shapes, dtypes and device type, with ``obj_id``.

        Raises:
            ValueError: the tensors are on devices of different types.
            TypeError: a tensor holds what the transport cannot carry (``carried``).

        """
        refuse_uncarried(obj_id, rdt_object, DEFAULT_NAME)
        meta = super().extract_tensor_transport_metadata(obj_id, rdt_object)
        return ObjectMetadata(meta.tensor_meta, meta.tensor_device, obj_id=obj_id)

    def send_multiple_tensors(
        self, tensors: list[Any], tensor_transport_metadata: Any, communicator_metadata: Any
    ) -> None:
        """Send the object's tensors to the consumer's rank; they are only read.

        Raises:
            CollectiveError: the group is gone or failed; the group is then aborted here.

        """
        meta, _, dst = _checked(tensor_transport_metadata, communicator_metadata)
        group = ray_group(communicator_metadata.communicator_name)
        data = _data_group(group, meta.tensor_device)
        with _aborting(group):
            wire.send(tensors, meta.obj_id, dst, data, group.cpu_group)

    def recv_multiple_tensors(
        self,
        obj_id: str,
        tensor_transport_metadata: Any,
        communicator_metadata: Any,
        target_buffers: list[Any] | None = None,
    ) -> list[Any]:
        """Receive the object's tensors from the producer's rank.

        Returns:
            New tensors, or ``target_buffers`` written in place when given.

        Raises:
            CollectiveError: the group is gone or failed, or the producer sent another
                object; the group is then aborted here.

        """
        meta, src, _ = _checked(tensor_transport_metadata, communicator_metadata)
        group = ray_group(communicator_metadata.communicator_name)
        data = _data_group(group, meta.tensor_device)
        with _aborting(group):
            got = wire.recv(
                meta.tensor_meta, meta.tensor_device or "cpu", obj_id, src, data,
                group.cpu_group,
            )  # fmt: skip
        if target_buffers is None:
            return got
        for target, tensor in zip(target_buffers, got, strict=True):
            target.copy_(tensor)
        return target_buffers

    def garbage_collect(self, obj_id: str, tensor_transport_meta: Any, tensors: list[Any]) -> None:
        """Hold nothing: the producer's tensors are freed with Ray's reference to them."""

    def abort_transport(self, obj_id: str, communicator_metadata: Any) -> None:
        """End the pending transfer of this actor in the pair's group; the group is unusable after.

        Ray calls it in both actors after a transfer failed or timed out, then destroys
        the group; a group already gone here is left alone.
        """
        try:
            group = ray_group(communicator_metadata.communicator_name)
        except CollectiveError:
            return
        _abort(group, f"Ray aborted the transfer of object {obj_id}")


def _checked(meta: Any, comm: Any) -> tuple[ObjectMetadata, int, int]:
    """Return Ray's metadata of a transfer with the source's and the destination's ranks."""
    if not isinstance(meta, ObjectMetadata) or not isinstance(comm, CollectiveCommunicatorMetadata):
        raise CollectiveError(
            f"expecting {ObjectMetadata.__name__} and {CollectiveCommunicatorMetadata.__name__}, "
            f"got {type(meta).__name__} and {type(comm).__name__}"
        )
    if comm.src_rank is None or comm.dst_rank is None:
        raise CollectiveError(f"the transfer of {meta.obj_id} names no source or destination rank")
    return meta, comm.src_rank, comm.dst_rank


def _data_group(group: RayGroup, device: str | None) -> str:
    if device == "cuda":
        if group.gpu_group is None:
            raise CollectiveError(
                f"group {group.group_name!r} moves CPU tensors only, as not every rank had "
                "a GPU when it was made; got CUDA tensors"
            )
        return group.gpu_group
    return group.cpu_group


def _abort(group: RayGroup, reason: str) -> None:
    for name in (group.gpu_group, group.cpu_group):
        if name is not None and queries.is_group_initialized(name):
            held.get_group_handle(name).abort(reason)


@contextmanager
def _aborting(group: RayGroup) -> Iterator[None]:
    """Run a block after whose failure ``group`` is aborted, so no later transfer misreads it."""
    try:
        yield
    except BaseException as error:
        _abort(group, f"a transfer failed: {error}")
        raise
