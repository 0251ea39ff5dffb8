"""The communicators and comm streams of an NCCLGroup, made on first use (op lock held).

Collectives use one communicator per device set; send and recv one per pair of
endpoints; the checks beside the ops (``COLLECTIVE_NCCL_CHECK=side``) one per GPU (see
``lifecycle`` for how the ranks meet for each). Each list is kept with its store key
and member ranks, which its first uses agree under (see ``first``).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from collective.frameworks.cuda_buffers import CudaBuffer
from collective.groups.nccl.comm import (
    create_communicators,
    encode_unique_id,
    exchange_unique_id,
    release_communicators,
)
from collective.groups.nccl.cuda import STREAMS
from collective.groups.nccl.lifecycle import Communicators, NcclLifecycle
from collective.types import ArgumentValueError, CollectiveError


class NcclMaking(NcclLifecycle):
    """Makes and caches the group's communicators and comm streams."""

    def _communicators(
        self,
        key: tuple[Any, ...],
        store_key: str,
        devices: Sequence[int],
        world: int,
        ranks: Sequence[int],
        timeout: timedelta,
        members: Sequence[int] | None = None,
    ) -> list[Any]:
        """Return the cached communicators ``key``, making them through the store if new.

        ``members`` are the group ranks that use them (all when None); ``names`` keeps
        ``store_key`` and ``members`` for their first uses (see ``first``).
        Communicators made while the group was aborted are aborted, not kept.

        Raises:
            ArgumentValueError: they are new and a stream captures a CUDA graph.

        """
        found = self._comms.get(key)
        if found is not None:
            return found
        if self._capturing:
            raise ArgumentValueError(
                "the first op of its kind on this group makes NCCL communicators, which a "
                "CUDA graph cannot capture: run the op once before the capture"
            )
        nccl = self._nccl
        uid = exchange_unique_id(
            self._store,
            f"nccl/{self.group_name}/{store_key}",
            min(ranks) == 0,
            lambda: encode_unique_id(nccl.get_unique_id()),
            timeout,
            self.group_name,
            self.rank,
        )
        comms = create_communicators(self._cuda, uid, world, ranks, devices, timeout)
        everyone = tuple(range(self.world_size)) if members is None else tuple(members)
        with self._lock:
            aborted = self._aborted
            if aborted is None:
                self._comms[key] = comms
                self.names[id(comms[0])] = (store_key, everyone)
        if aborted is not None:
            release_communicators(self._cuda, comms, [], False, timeout)
            raise CollectiveError(
                f"the group was aborted while its communicators formed: {aborted}"
            )
        return comms

    def _collective_comms(self, devices: Sequence[int], timeout: timedelta) -> list[Any]:
        key = ("collective", tuple(devices))
        found = self._comms.get(key)
        if found is not None:
            return found
        store_key = f"collective/{self._collective_count}"
        self._collective_count += 1
        self._default_devices = self._default_devices or tuple(devices)
        n = len(devices)
        ranks = [self.rank * n + i for i in range(n)]
        return self._communicators(key, store_key, devices, self.world_size * n, ranks, timeout)

    def _comms_of(self, bufs: Sequence[CudaBuffer]) -> Communicators:
        """Return the getter of the collective communicators of ``bufs``' devices."""
        devices = [b.device for b in bufs]
        return lambda timeout: self._collective_comms(devices, timeout)

    def _stream(self, device: int) -> int:
        stream = self._streams.get(device)
        if stream is None:
            stream = STREAMS.acquire(self._cuda, device)
            with self._lock:
                self._streams[device] = stream
        return stream
