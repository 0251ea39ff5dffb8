"""A group whose ranks share a GPU checks its CUDA IPC mappings as it is made.

On the stood-in GPU (``shared_gpu_standin``), one rank opens a peer's handle onto the
wrong memory, as a mapping gone wrong on real hardware would: making the group fails
on every rank, naming the pair and the way back to NCCL, and leaves nothing behind.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest

from collective.groups.gpu.connect import connect_gpu_group
from collective.groups.shared_gpu import transport
from collective.rendezvous.store import TCPRendezvousStore
from collective.types import CollectiveError
from tests.shared_gpu_standin import HostDevice, HostGpu
from tests.test_gloo_group import JOIN_TIMEOUT_S, _client_store, _master_store, _run_threads
from tests.test_shared_gpu_group import HOST_BUFFERS, TIMEOUT, _our_files


class MisMapped(HostDevice):
    """A rank whose mapping of local rank ``wrong``'s memory shows local rank ``shown``'s."""

    def __init__(self, gpu: HostGpu, rank: int, wrong: int, shown: int, owners: list[int]) -> None:
        super().__init__(gpu, rank)
        self._wrong, self._shown, self._owners = wrong, shown, owners
        self._aliases: list[tuple[int, int]] = []

    def open_memory(self, handle: bytes) -> int:
        ptr = super().open_memory(handle)
        if ptr != self._owners[self._wrong]:
            return ptr
        self._aliases.append((self._owners[self._shown], ptr))
        return self._owners[self._shown]

    def close_memory(self, ptr: int) -> None:
        for i, (shown, real) in enumerate(self._aliases):
            if shown == ptr:
                del self._aliases[i]
                ptr = real
                break
        super().close_memory(ptr)


class Recorded(HostDevice):
    """A rank that says where its memory is (``owners``), so a peer can map it wrongly."""

    def __init__(self, gpu: HostGpu, rank: int, owners: list[int]) -> None:
        super().__init__(gpu, rank)
        self._owners = owners

    def alloc(self, nbytes: int) -> int:
        ptr = super().alloc(nbytes)
        self._owners[self.rank] = ptr
        return ptr


@pytest.fixture(autouse=True)
def small_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport, "MAIL_BYTES", 4096)
    monkeypatch.setattr(transport, "SLOT_BYTES", 8192)


def test_a_peer_handle_opened_onto_other_memory_fails_the_group_on_every_rank() -> None:
    gpu, owners = HostGpu(), [0, 0, 0]
    before = _our_files()
    master, name = _master_store(), f"mapped-{uuid.uuid4().hex[:8]}"

    def target(rank: int) -> Callable[[], str]:
        def run() -> str:
            store = TCPRendezvousStore(master if rank == 0 else _client_store(master, TIMEOUT))
            if rank == 2:  # maps rank 0's memory onto rank 1's (known once the handles came)
                device: HostDevice = MisMapped(gpu, 2, 0, 1, owners)
            else:
                device = Recorded(gpu, rank, owners)
            with pytest.raises(CollectiveError) as caught:
                connect_gpu_group(
                    3, rank, name, store, TIMEOUT, device=device, buffers=HOST_BUFFERS
                )
            return str(caught.value)

        return run

    messages = _run_threads([target(r) for r in range(3)], JOIN_TIMEOUT_S)
    for message in messages:
        assert "rank 2 reads other bytes than rank 0 wrote, in its slot 0, slot 1, " in message
        assert "mailbox 1 towards rank 2" in message, message  # every region, named
        assert "COLLECTIVE_GPU_TRANSPORT=nccl" in message, message
        assert "rank 1 reads" not in message and "rank 0 reads" not in message, message
    assert gpu.misuse == []
    assert gpu.live() == (0, 0)
    assert _our_files() == before
