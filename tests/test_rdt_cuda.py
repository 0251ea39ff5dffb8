"""The one-sided transport's CUDA path, run on stood-in GPUs: no GPU, no Ray cluster.

Each "process" is a ``ShmTransport`` over its own ``HostDevice`` of one shared
``HostGpu`` (``tests/shared_gpu_standin.py``): device memory is host memory, events count
their records, and CUDA's rules are checked (no opening one's own handle, no freeing
memory or destroying an event a peer still has open, no opening a handle twice). The
tests call the transport's methods as Ray calls them: ``extract_tensor_transport_metadata``
in the producer, ``recv_multiple_tensors`` in each consumer with the metadata pickled
across, ``garbage_collect`` in the producer, ``abort_transport`` from another thread.
Every byte is checked, and so is what each consumer's stream waited on; no misuse may be
logged, and the stood-in GPU holds no allocation or event once the objects are freed.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from collective.groups.shm.arena import NAME_PREFIX, SHM_DIR
from collective.ray_plugins import shm_transport
from collective.ray_plugins.cuda_buffer import ALIGN, CudaIpcMetadata
from collective.ray_plugins.shm_transport import ShmCommunicatorMetadata, ShmTransport
from collective.types import CollectiveError, CollectiveTimeoutError
from tests.shared_gpu_standin import HostDevice, HostGpu, gpu_tensor

STREAM = 0x5A5A
"""The current stream every stood-in process reports."""

SIDE = 0x5151
"""The side stream every stood-in process reads on."""


class Stuck:
    """A switch that holds the stood-in GPU still: nothing runs on it while set."""

    def __init__(self, gpu: HostGpu) -> None:
        self._gpu = gpu
        self._held: contextlib.ExitStack | None = None

    def set(self) -> None:
        if self._held is None:
            self._held = contextlib.ExitStack()
            self._held.enter_context(self._gpu.clock.paused())

    def clear(self) -> None:
        """Let the GPU run again, and wait until it has caught up."""
        held, self._held = self._held, None
        if held is not None:
            held.close()
            self._gpu.clock.run_until_idle()

    def is_set(self) -> bool:
        return self._held is not None


class StandinGpus:
    """One process's GPUs: ``HostDevice``s by UUID; CPU tensors stand for CUDA ones."""

    def __init__(self, devices: list[HostDevice], node: str = "node-a") -> None:
        self.devices = {d.uuid(): d for d in devices}
        self.node = node
        self.on_host: set[int] = set()
        """ids of tensors that stand for CPU tensors."""
        self.placed: dict[int, str] = {}
        """ids of tensors on another GPU than the first, and its UUID."""

    def holds(self, tensor: Any) -> bool:
        return id(tensor) not in self.on_host

    def device(self, tensor: Any) -> HostDevice:
        return self.devices[self.placed.get(id(tensor), next(iter(self.devices)))]

    def find(self, uuid: str) -> HostDevice | None:
        return self.devices.get(uuid)

    def uuids(self) -> list[str]:
        return list(self.devices)

    def stream(self, device: Any) -> int:
        return STREAM

    def side_stream(self, device: Any) -> int:
        return SIDE

    def empty(self, nbytes: int, device: Any) -> torch.Tensor:
        return gpu_tensor(nbytes)  # memory the stood-in GPU knows as its own

    def node_id(self) -> str:
        return self.node


class Machine:
    """A stood-in GPU, and a producer (rank 0) and consumers (ranks 1..n) that share it."""

    def __init__(self, consumers: int = 3) -> None:
        self.gpu = HostGpu("GPU-standin-0@0000:3b:00")
        self.stuck = Stuck(self.gpu)
        self.devices = [HostDevice(self.gpu, r) for r in range(consumers + 1)]
        self.gpus = [StandinGpus([d]) for d in self.devices]
        self.transports = [ShmTransport(gpus=g) for g in self.gpus]

    @property
    def producer(self) -> ShmTransport:
        return self.transports[0]

    @property
    def consumers(self) -> list[ShmTransport]:
        return self.transports[1:]

    def publish(self, obj_id: str, tensors: list[torch.Tensor]) -> CudaIpcMetadata:
        meta = self.producer.extract_tensor_transport_metadata(obj_id, tensors)
        assert isinstance(meta, CudaIpcMetadata)
        return pickle.loads(pickle.dumps(meta))  # as Ray sends it to the consumers

    def open_anywhere(self) -> list[tuple[int, int]]:
        """Return (memory, events) each process still has open."""
        return [(len(d.opened_memory), len(d.opened_events)) for d in self.devices]


def read(transport: ShmTransport, meta: Any, into: list[torch.Tensor] | None = None) -> Any:
    return transport.recv_multiple_tensors(meta.obj_id, meta, ShmCommunicatorMetadata(), into)


def tensors(seed: int, small: int = 40, each: int = 1024) -> list[torch.Tensor]:
    """Return tensors of every dtype, 0-d, empty, strided, conjugate and negative-bit ones."""
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(each // 4, generator=g) + i for i in range(small)]
    for dtype in (torch.float16, torch.bfloat16, torch.float64, torch.complex64):
        out.append(torch.randn(7, 3, generator=g).to(dtype))
    for dtype in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
        out.append(torch.randint(-100, 100, (33,), generator=g).to(dtype))
    c = torch.randn(5, generator=g, dtype=torch.complex64)
    out += [torch.rand(13, generator=g) > 0.5, torch.tensor(seed * 0.5), torch.zeros(0, 4)]
    out += [torch.randn(64, 300, generator=g).t(), c.conj(), c.conj().imag]
    out.append(torch.randn(1 << 20, generator=g))  # 4 MiB
    return out


def mismatches(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[int]:
    """Return the indices where ``got`` differs from ``want`` in dtype, shape or any byte."""
    assert len(got) == len(want)
    bad = []
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        w = w.resolve_conj().resolve_neg().contiguous()
        if g.dtype != w.dtype or g.shape != w.shape or g.is_conj() or g.is_neg():
            bad.append(i)
        elif not torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)):
            bad.append(i)
    return bad


@pytest.fixture
def machine() -> Iterator[Machine]:
    m = Machine()
    yield m
    m.stuck.clear()
    assert m.gpu.misuse == []
    assert _leases() == []


def _leases() -> list[str]:
    """Return the lease files of this process's objects (``cuda_leases``)."""
    return [f for f in os.listdir(SHM_DIR) if f.startswith(f"{NAME_PREFIX}{os.getpid()}-lease-")]


def test_every_consumer_reads_every_byte_and_waits_on_the_producers_last_record(
    machine: Machine,
) -> None:
    want = tensors(1)
    meta = machine.publish("obj", want)
    assert meta.tensor_device == "cuda" and meta.gpu == machine.gpu.uuid
    assert all(place % ALIGN == 0 for place in meta.offsets)
    assert machine.gpu.live() == (1, 1)  # one buffer and one event for the whole object
    event = machine.devices[0].records[-1][0]
    for consumer, device in zip(machine.consumers, machine.devices[1:], strict=True):
        got = read(consumer, meta)
        assert mismatches(got, want) == []
        sized = [t for t in got if t.numel()]
        assert len({t.untyped_storage().data_ptr() for t in sized}) == 1  # one copy, views
        follow, mine = device.waits[0][0], device.waits[0][1]
        assert device.waits[1:] == [(event, 0, 2)]  # after the zeroing's record and the copies'
        assert device.streams[:3] == [
            ("record", follow, STREAM),  # where the caller's stream has got to
            ("wait", follow, SIDE),
            ("wait", event, SIDE),  # the producer's event: never on the caller's stream
        ]
        assert mine == device.rank
    assert machine.open_anywhere() == [(0, 0)] * 4  # every consumer closed what it opened
    machine.producer.garbage_collect("obj", meta, want)
    assert machine.gpu.live() == (0, 0)


def test_a_consumer_reads_into_its_buffers(machine: Machine) -> None:
    want = tensors(2, small=5)
    meta = machine.publish("obj", want)
    into = [gpu_tensor(torch.full(t.shape, 7, dtype=t.dtype)) for t in want]
    got = read(machine.consumers[0], meta, into)
    assert all(g is i for g, i in zip(got, into, strict=True))
    assert mismatches(got, want) == []
    with pytest.raises(ValueError, match="expecting"):
        read(machine.consumers[1], meta, into[:-1])
    with pytest.raises(ValueError, match="must be contiguous"):
        read(machine.consumers[1], meta, [torch.empty(0)] * len(want))
    machine.producer.garbage_collect("obj", meta, want)
    assert machine.gpu.live() == (0, 0)


def test_a_hundred_objects_leave_no_allocation_event_or_mapping(machine: Machine) -> None:
    for seed in range(100):
        want = tensors(seed, small=3, each=256)[:-1]
        meta = machine.publish(f"obj{seed}", want)
        for consumer in machine.consumers:
            assert mismatches(read(consumer, meta), want) == [], seed
        machine.producer.garbage_collect(f"obj{seed}", meta, want)
    assert machine.gpu.live() == (0, 0)
    assert machine.open_anywhere() == [(0, 0)] * 4
    assert all(not t._cuda._mapped and not t._cuda._held for t in machine.transports)


def test_a_retried_extract_and_an_empty_object_make_nothing_new(machine: Machine) -> None:
    want = [torch.arange(10.0)]
    first = machine.producer.extract_tensor_transport_metadata("obj", want)
    assert machine.producer.extract_tensor_transport_metadata("obj", want) is first
    assert machine.gpu.live() == (1, 1)
    machine.producer.garbage_collect("obj", first, want)
    empty = machine.publish("none", [torch.zeros(0, 3), torch.zeros(2, 0, dtype=torch.int64)])
    assert machine.gpu.live() == (0, 0) and empty.memory == b""
    got = read(machine.consumers[0], empty)
    assert [(tuple(t.shape), t.dtype) for t in got] == [
        ((0, 3), torch.float32),
        ((2, 0), torch.int64),
    ]


def test_the_producer_reads_its_own_buffer_and_its_free_waits_for_that_read(
    machine: Machine,
) -> None:
    want = tensors(3, small=2)
    meta = machine.publish("obj", want)
    assert mismatches(read(machine.producer, meta), want) == []  # opening its own would fail
    machine.stuck.set()
    outcome: list[Any] = []
    thread = threading.Thread(target=lambda: outcome.append(read(machine.producer, meta)))
    thread.start()
    while not machine.producer._cuda._reads.count():
        time.sleep(0.001)
    machine.producer.garbage_collect("obj", meta, want)
    assert machine.gpu.live()[0] == 1  # the read in flight keeps the buffer
    machine.stuck.clear()
    thread.join(timeout=10)
    assert mismatches(outcome[0], want) == []
    assert machine.gpu.live() == (0, 0)  # the read freed it as it ended


def test_concurrent_reads_in_one_process_open_the_handle_once(machine: Machine) -> None:
    want = tensors(4, small=2)
    meta = machine.publish("obj", want)
    machine.stuck.set()
    outcomes: list[Any] = []
    threads = [
        threading.Thread(target=lambda: outcomes.append(read(machine.consumers[0], meta)))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    cuda, deadline = machine.consumers[0]._cuda, time.monotonic() + 10
    while sum(m.users for m in list(cuda._mapped.values())) < 3:  # every read holds the mapping
        assert time.monotonic() < deadline, "the reads never mapped the object"
        time.sleep(0.001)
    assert cuda._reads.count("obj") == 3
    assert machine.open_anywhere()[1] == (1, 1)
    machine.stuck.clear()
    for thread in threads:
        thread.join(timeout=10)
    assert [mismatches(o, want) for o in outcomes] == [[], [], []]
    assert machine.open_anywhere() == [(0, 0)] * 4
    machine.producer.garbage_collect("obj", meta, want)
    assert machine.gpu.live() == (0, 0)


def abort_a_stuck_read(machine: Machine, consumer: ShmTransport, meta: Any) -> tuple[Any, float]:
    """Hold the GPU, start a read of ``meta`` in a thread, abort it; return its outcome and
    how long the abort took to end it (the GPU stays held)."""
    machine.stuck.set()
    outcome: list[Any] = []

    def reading() -> None:
        try:
            outcome.append(read(consumer, meta))
        except CollectiveError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=reading)
    thread.start()
    while not consumer._cuda._reads.count():
        time.sleep(0.001)
    start = time.monotonic()
    consumer.abort_transport(meta.obj_id, ShmCommunicatorMetadata())
    thread.join(timeout=10)
    return outcome[0], time.monotonic() - start


def test_abort_ends_a_pending_read_and_its_mapping_closes_once_the_copy_completes(
    machine: Machine,
) -> None:
    want = tensors(5, small=2)
    meta = machine.publish("obj", want)
    consumer = machine.consumers[0]
    outcome, took = abort_a_stuck_read(machine, consumer, meta)
    assert took < 0.5
    assert str(outcome) == "Ray aborted the read of object obj"
    assert machine.open_anywhere()[1] == (1, 1)  # parked: its copy has not completed
    machine.stuck.clear()
    other = machine.publish("other", [torch.ones(3)])
    assert mismatches(read(consumer, other), [torch.ones(3)]) == []  # its next call closes it
    assert machine.open_anywhere() == [(0, 0)] * 4
    for obj_id, m in (("obj", meta), ("other", other)):
        machine.producer.garbage_collect(obj_id, m, [])
    assert machine.gpu.live() == (0, 0)


def test_a_copy_that_never_completes_times_out(
    machine: Machine, monkeypatch: pytest.MonkeyPatch
) -> None:
    meta = machine.publish("obj", [torch.ones(8)])
    monkeypatch.setattr(shm_transport, "_fetch_timeout_s", lambda: 0.2)
    machine.stuck.set()
    with pytest.raises(CollectiveTimeoutError, match=r"read of object obj .* after 0.2s"):
        read(machine.consumers[0], meta)
    machine.stuck.clear()
    machine.consumers[0].garbage_collect("unknown", None, [])  # any later call sweeps
    assert machine.open_anywhere() == [(0, 0)] * 4
    machine.producer.garbage_collect("obj", meta, [])
    assert machine.gpu.live() == (0, 0)


def test_a_read_after_the_free_or_after_the_producer_died_says_which(machine: Machine) -> None:
    meta = machine.publish("obj", [torch.ones(8)])
    dead = pickle.loads(pickle.dumps(meta))
    dead.started += 1  # another process now has the producer's pid: it died
    with pytest.raises(CollectiveError, match=r"producer of object obj \(pid \d+\) died"):
        read(machine.consumers[0], dead)
    machine.producer.garbage_collect("obj", meta, [])
    with pytest.raises(CollectiveError, match="object obj was freed: its producer"):
        read(machine.consumers[0], meta)
    with pytest.raises(CollectiveError, match="object obj was freed"):
        read(machine.producer, meta)
    assert machine.gpu.live() == (0, 0)


def test_another_node_or_another_gpu_is_a_clear_error(machine: Machine) -> None:
    meta = machine.publish("obj", [torch.ones(8)])
    machine.gpus[1].node = "node-b"
    with pytest.raises(CollectiveError, match=r"lies in GPU memory of node node-a.*node node-b"):
        read(machine.consumers[0], meta)
    other = HostGpu("GPU-other@0000:5e:00")
    machine.gpus[2].devices = {other.uuid: HostDevice(other, 2)}
    with pytest.raises(CollectiveError, match=r"lies on GPU GPU-standin-0.*does not see"):
        read(machine.consumers[1], meta)
    assert machine.open_anywhere() == [(0, 0)] * 4
    machine.producer.garbage_collect("obj", meta, [])


def test_mixed_devices_in_one_object_are_refused(machine: Machine) -> None:
    host, cuda = torch.ones(3), torch.ones(3)
    machine.gpus[0].on_host.add(id(host))
    with pytest.raises(TypeError, match="all dense CPU tensors or all CUDA ones"):
        machine.producer.extract_tensor_transport_metadata("obj", [cuda, host])
    second = HostGpu("GPU-standin-1@0000:5e:00")
    elsewhere = torch.ones(3)
    machine.gpus[0].devices[second.uuid] = HostDevice(second, 0)
    machine.gpus[0].placed[id(elsewhere)] = second.uuid
    with pytest.raises(TypeError, match="on one GPU"):
        machine.producer.extract_tensor_transport_metadata("obj", [cuda, elsewhere])
    assert machine.gpu.live() == (0, 0)


def test_registering_lets_ray_send_cpu_and_cuda_tensors_through_the_one_name() -> None:
    from ray.experimental.rdt import util

    import collective as col

    col.register_shm_transport()
    assert util.transport_manager_info["COLLECTIVE_SHM"].devices == ["cpu", "cuda"]


def test_the_producer_frees_an_object_only_once_no_parked_read_maps_it(machine: Machine) -> None:
    """The review's L7: a read that Ray aborted before its copy ran parks its mapping of
    the producer's buffer; Ray may then garbage-collect the object in the producer. CUDA
    leaves freeing memory another process still maps undefined: the producer keeps the
    buffer until the consumer closed its mapping, then frees it at its next call."""
    want = tensors(6, small=2)
    meta = machine.publish("obj", want)
    machine.gpu.clock.run_until_idle()  # the producer's copies are done
    consumer = machine.consumers[0]
    outcome, _ = abort_a_stuck_read(machine, consumer, meta)
    assert isinstance(outcome, CollectiveError)
    assert machine.open_anywhere()[1] == (1, 1)  # parked: its copy has not run
    machine.producer.garbage_collect("obj", meta, want)
    assert machine.gpu.misuse == [], machine.gpu.misuse
    assert machine.gpu.live()[0] == 1  # the buffer kept: the consumer still maps it
    machine.stuck.clear()
    consumer.garbage_collect("unknown", None, [])  # the consumer's next call closes it
    assert machine.open_anywhere() == [(0, 0)] * 4
    machine.producer.garbage_collect("unknown", None, [])  # the producer's next call frees it
    assert machine.gpu.live() == (0, 0)
    assert machine.gpu.misuse == []
