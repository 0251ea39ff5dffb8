"""Ranks of an NCCLGroup as threads of this process, each on a ``ContractCupy`` of its own.

``contract_ranks`` points the nccl backend at a per-thread ``ContractCupy`` and makes
the caller's current stream on GPU d the handle ``caller_stream(d)`` (without a GPU
there is none), then hands out ``Ranks``: one NCCLGroup per rank on a torch TCPStore,
built and driven in one thread per rank so that the ranks meet and exchange unique
IDs as they would in separate processes. The ranks' GPUs run on one ``DeviceClock``
(``Ranks.clock``), as the GPUs of one machine, on which every caller stream exists.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar

import pytest
import torch.distributed as dist

from collective.frameworks import cuda_buffers
from collective.groups.nccl import comm as nccl_comm
from collective.groups.nccl import watchdog as nccl_watchdog
from collective.groups.nccl.group import NCCLGroup
from collective.rendezvous.store import TCPRendezvousStore
from tests import device_clock
from tests.device_clock import DeviceClock
from tests.nccl_binding import DEVICES, ContractCupy, no_driver

CONTRACT = [
    pytest.mark.nccl_contract,
    pytest.mark.skipif(
        not no_driver(),
        reason="a CUDA driver is present: these tests hand it fake handles; run tests/gpu",
    ),
]
"""The marks of every contract test module."""

T = TypeVar("T")
JOIN_S = 60.0
"""How long a rank thread may take before the test fails."""

_local = threading.local()


def caller_stream(device: int) -> int:
    """Return the handle that stands for the caller's current stream on GPU ``device``."""
    return 0xCA00 + device


def _probe() -> tuple[Any, str]:
    return _local.cupy, ""


class Ranks:
    """``world_size`` ranks of one NCCLGroup, rank r driven by thread r of ``run``."""

    def __init__(
        self, world_size: int, timeout: timedelta, cupys: list[ContractCupy] | None = None
    ) -> None:
        if cupys is None:
            clock = DeviceClock(DEVICES)
            cupys = [ContractCupy(clock) for _ in range(world_size)]
        self.cupys = cupys
        self.clock = cupys[0].clock
        for cupy in cupys:
            for device in range(DEVICES):
                cupy.gpu.adopt_stream(caller_stream(device), device)
        master = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30))
        clients = [
            dist.TCPStore("127.0.0.1", master.port, None, False, timedelta(seconds=30))
            for _ in range(world_size - 1)
        ]
        self._stores = [TCPRendezvousStore(s) for s in [master, *clients]]
        self.name = f"contract-{uuid.uuid4().hex[:8]}"
        self.groups: list[NCCLGroup] = []
        self.groups = self.run(
            lambda r, _: NCCLGroup(world_size, r, self.name, self._stores[r], timeout)
        )

    @property
    def world_size(self) -> int:
        return len(self.cupys)

    def run(self, fn: Callable[[int, NCCLGroup], T], ranks: Sequence[int] | None = None) -> list[T]:
        """Run ``fn(rank, group)`` for each of ``ranks`` (all), at once; return the results."""
        chosen = list(range(self.world_size)) if ranks is None else list(ranks)
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}

        def body(rank: int) -> None:
            _local.cupy = self.cupys[rank]
            try:
                group = self.groups[rank] if self.groups else None
                results[rank] = fn(rank, group)  # type: ignore[arg-type]
            except BaseException as exc:
                errors[rank] = exc

        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in chosen]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(JOIN_S)
            assert not thread.is_alive(), f"a rank thread did not finish within {JOIN_S} s"
        if errors:
            raise next(iter(errors.values()))
        return [results[r] for r in chosen]

    def settle(self) -> None:
        """Wait until the watchdog has seen every op and check of every rank finish."""
        deadline = time.monotonic() + JOIN_S
        while any(g._watch.pending() for g in self.groups):
            assert time.monotonic() < deadline, "the watchdog never saw the ops finish"
            time.sleep(0.005)

    def clear(self) -> None:
        """Forget every rank's calls so far."""
        for c in self.cupys:
            c.trace.clear()

    def destroy(self) -> None:
        for group in self.groups:
            group.destroy_group()

    def misuse(self) -> list[str]:
        """Return what every rank did that NCCL or CUDA forbids (``Trace.misuse``)."""
        return [m for c in self.cupys for m in c.trace.misuse]

    def close(self) -> None:
        """Stop the ranks' device clocks."""
        for clock in {c.clock for c in self.cupys}:
            clock.close()


@contextmanager
def contract_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Callable[..., Ranks]]:
    """Point the backend at per-thread ``ContractCupy``s; yield a maker of ``Ranks``.

    ``make(world_size, timeout=..., cupys=...)`` builds the ranks (on the given
    ``ContractCupy``s, to share their streams); all are destroyed at the end.
    """
    monkeypatch.setattr(nccl_comm, "_probe", _probe)
    monkeypatch.setattr(cuda_buffers, "cupy_stream", caller_stream)
    monkeypatch.setattr(
        nccl_watchdog, "exchange_capture_mode", device_clock.exchange_capture_mode, raising=False
    )
    made: list[Ranks] = []

    def make(
        world_size: int,
        timeout: timedelta = timedelta(seconds=30),
        cupys: list[ContractCupy] | None = None,
    ) -> Ranks:
        made.append(Ranks(world_size, timeout, cupys))
        return made[-1]

    try:
        yield make
    finally:
        for ranks in made:
            ranks.destroy()
        for ranks in made:
            ranks.close()


def on_this_thread(cupy: ContractCupy) -> None:
    """Make ``cupy`` the one the backend sees from the calling thread."""
    _local.cupy = cupy


@pytest.fixture(name="ranks")
def ranks_fixture(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Ranks]]:
    """The fixture ``ranks``: ``contract_ranks``' maker; import it into a test module."""
    with contract_ranks(monkeypatch) as make:
        yield make
