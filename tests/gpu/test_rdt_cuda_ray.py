"""The one-sided transport's CUDA path in Ray actors that share one GPU.

A producer and three consumers, each with ``num_gpus=0.25`` of GPU 0, and the driver:
``tensor_transport="COLLECTIVE_SHM"`` moves an object of one 256 MiB tensor and 2,000
tensors of 32 KiB from the producer's GPU memory to each consumer's through CUDA IPC,
with no group. Every element of every tensor is checked on every consumer, on its current
stream with no explicit synchronisation (so the check also checks the stream ordering).
After 100 objects the GPU memory outside torch's and cupy's pools, torch's and cupy's
allocations, the producer's buffers and the consumers' mappings are back where they
were. The producer's tensors come from torch's expandable segments (a VMM allocator,
which CUDA IPC cannot export: the transport copies them into its own buffer). A
producer that dies after it returned is a clear error in a consumer. Skipped,
saying why, without a GPU, torch's CUDA or Ray (``tests/gpu/run.sh`` installs Ray
offline from ``GPU_WHEELS``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.gpu import cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bool(cases.no_gpu_reason()), reason=cases.no_gpu_reason() or "-"),
    pytest.mark.skipif(not cases.torch_cuda(), reason="this torch build has no CUDA"),
]

NAME = "COLLECTIVE_SHM"
BIG = 256 << 20
SMALL, EACH = 2000, 32 << 10
SLACK = 64 << 20
"""GPU memory outside the processes' pools that may move between two measures for reasons
of no concern here; one object's buffer is 320 MiB."""


def made(seed: int, device: str = "cuda") -> list[Any]:
    """Return the object: one 256 MiB float32 tensor, then 2,000 of 32 KiB; all differ by seed."""
    import torch

    big = torch.arange(BIG // 4, device=device, dtype=torch.int64).remainder(251).float() + seed
    values = torch.arange(SMALL, device=device, dtype=torch.float32) * 3 + seed
    small = values[:, None].expand(SMALL, EACH // 4).contiguous()
    return [big, *small.unbind(0)]


def wrong(got: list[Any], seed: int) -> list[int]:
    """Return the indices of the tensors of ``got`` that differ from ``made(seed)`` anywhere."""
    import torch

    if len(got) != 1 + SMALL:
        return [-1]
    device = str(got[0].device)
    want = made(seed, device)
    bad = [] if torch.equal(got[0], want[0]) else [0]
    stacked, expected = torch.stack(got[1:]), torch.stack(want[1:])
    rows = (stacked != expected).any(dim=1).nonzero().flatten().tolist()
    return bad + [1 + r for r in rows]


def memory() -> dict[str, Any]:
    """Return the GPU's used bytes; this process's pools, torch's, cupy's and the transport's.

    What the GPU uses beyond every process's pools is what the transport allocates
    (``cudaMalloc``), the CUDA contexts and the IPC mappings.
    """
    import cupy
    import torch
    from ray.experimental.rdt.util import get_tensor_transport_manager

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    manager: Any = get_tensor_transport_manager(NAME)
    cuda = manager._cuda
    pool = cupy.get_default_memory_pool()
    return {
        "gpu_used": total - free,
        "pools": torch.cuda.memory_reserved() + pool.total_bytes(),
        "torch": torch.cuda.memory_allocated(),
        "cupy": pool.used_bytes(),
        "held": len(cuda._held),
        "mapped": len(cuda._mapped),
        "parked": len(cuda._parked),
    }


@pytest.fixture(scope="module")
def actors() -> Iterator[tuple[Any, Any, list[Any]]]:
    """Start Ray with this machine's GPUs; yield it, a producer and three consumers on GPU 0."""
    ray = pytest.importorskip("ray")
    import torch

    import collective as col

    col.register_shm_transport()  # before the classes that name it, as Ray asks
    ray.init(
        address="local",
        num_cpus=2,
        num_gpus=cases.gpu_count(),
        namespace="collective-gpu-rdt",
        include_dashboard=False,
    )

    class _Producer:
        def __init__(self) -> None:
            self.kept: list[Any] = []

        def keep(self, seed: int) -> None:
            self.kept = made(seed)

        @ray.method(tensor_transport=NAME)
        def publish(self) -> list[torch.Tensor]:
            return self.kept

        def pid(self) -> int:
            import os

            return os.getpid()

        def memory(self) -> dict[str, Any]:
            return memory()

    class _Consumer:
        def check(self, got: list[torch.Tensor], seed: int) -> list[int]:
            return wrong(got, seed)

        def memory(self) -> dict[str, Any]:
            return memory()

    options = {"num_cpus": 0, "num_gpus": 0.25, "enable_tensor_transport": True}
    vmm = {"env_vars": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}
    producer = ray.remote(**options, runtime_env=vmm)(_Producer).remote()  # VMM tensors
    consumers = [ray.remote(**options)(_Consumer).remote() for _ in range(3)]
    yield ray, producer, consumers
    from tests.conftest import settle_rdt

    settle_rdt()
    ray.shutdown()


def settled(ray: Any, everyone: list[Any], timeout_s: float = 20) -> list[dict[str, Any]]:
    """Wait until no actor holds, maps or parks an object; return each one's memory."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = ray.get([a.memory.remote() for a in everyone], timeout=60)
        if all(not (m["held"] or m["mapped"] or m["parked"]) for m in got):
            return got
        if time.monotonic() > deadline:
            return got
        time.sleep(0.1)


@pytest.mark.timeout(600)
def test_three_consumers_read_every_tensor_and_a_hundred_objects_leave_memory_flat(
    actors: tuple[Any, Any, list[Any]],
) -> None:
    ray, producer, consumers = actors
    everyone = [producer, *consumers]
    ray.get(producer.keep.remote(1), timeout=120)
    ref = producer.publish.remote()
    assert ray.get([c.check.remote(ref, 1) for c in consumers], timeout=120) == [[], [], []]
    del ref
    before = settled(ray, everyone)
    for seed in range(100):
        ray.get(producer.keep.remote(seed), timeout=120)
        ref = producer.publish.remote()
        checks = ray.get([c.check.remote(ref, seed) for c in consumers], timeout=120)
        assert checks == [[], [], []], seed
        del ref
    after = settled(ray, everyone)
    for role, b, a in zip(["producer", "c1", "c2", "c3"], before, after, strict=True):
        assert (a["held"], a["mapped"], a["parked"]) == (0, 0, 0), (role, a)
        assert a["torch"] <= b["torch"] and a["cupy"] <= b["cupy"], (role, b, a)
    outside = [m[-1]["gpu_used"] - sum(x["pools"] for x in m) for m in (before, after)]
    assert outside[1] <= outside[0] + SLACK, (outside, before, after)


def test_the_driver_reads_the_object_too(actors: tuple[Any, Any, list[Any]]) -> None:
    ray, producer, _ = actors
    ray.get(producer.keep.remote(7), timeout=120)
    ref = producer.publish.remote()
    assert wrong(ray.get(ref, timeout=120), 7) == []


def test_a_producer_that_died_is_a_clear_error_in_a_consumer(
    actors: tuple[Any, Any, list[Any]],
) -> None:
    """Run last: it kills the module's producer (a fifth actor would not fit on one GPU)."""
    ray, producer, consumers = actors
    pid = ray.get(producer.pid.remote(), timeout=60)
    ray.get(producer.keep.remote(3), timeout=120)
    ref = producer.publish.remote()
    ray.wait([ref], timeout=120)  # it returned: its buffer is published
    ray.kill(producer)
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(ray.exceptions.RayTaskError, match=rf"\(pid {pid}\) died"):
        ray.get(consumers[0].check.remote(ref, 3), timeout=60)
