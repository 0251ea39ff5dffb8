"""Every CUDA call of the one-sided transport's CUDA path, checked against cupy's real binding.

The path reaches the CUDA runtime through ``cupy.cuda.runtime`` only (``CudaIpcDevice``,
a ``CudaDevice``, and ``TorchGpus``). Here that namespace is cupy's real one: each call
goes to the real binding, which checks every argument's type and count and then fails
for want of a driver with ``CUDARuntimeError``. A call the binding refuses (a wrong
argument type or count, a handle of the wrong size) raises something else and fails
the test. The calls that ``tests/test_shared_gpu_contract.py`` checks one by one are
checked here as the transport makes them: a whole publish, read and free runs, each
call answered, once the real binding has checked it, with a made-up result. What the
calls do on a GPU is checked by ``tests/gpu/test_rdt_cuda_ray.py``.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import cupy
import pytest
import torch
from cupy.cuda import runtime as real_runtime

from collective.groups.shared_gpu.device import MEMORY_HANDLE_BYTES
from collective.ray_plugins.cuda_gpus import NOT_READY, CudaIpcDevice, TorchGpus
from collective.ray_plugins.cuda_objects import CudaObjects

CUDARuntimeError = real_runtime.CUDARuntimeError
UUID = bytes(range(16))


class _Runtime:
    """cupy's real runtime; ``getDevice`` answers the device a ``_Device`` made current."""

    def __init__(self, answer: bool = False) -> None:
        self.calls: list[str] = []
        self.current = 0
        self.answer = answer
        """Answer each call once the binding checked it, instead of raising its error."""
        self._ids = itertools.count(0x7F00_0000_0000, 1 << 20)

    def getDevice(self) -> int:  # noqa: N802 (cupy's name)
        return self.current

    def __getattr__(self, name: str) -> Any:
        real = getattr(real_runtime, name)
        if not callable(real) or isinstance(real, type):
            return real

        def call(*args: Any) -> Any:
            self.calls.append(name)
            try:
                status = real(*args)
            except CUDARuntimeError as exc:
                if not self.answer or "driver" not in str(exc):
                    raise
                return self._made_up(name, args)
            if name == "eventQuery":  # answers a status: "insufficient driver" here
                assert status == 35, status
                return 0 if self.answer else status
            raise AssertionError(f"{name} ran without a driver")

        return call

    def _made_up(self, name: str, args: tuple[Any, ...]) -> Any:
        made = ("malloc", "ipcOpenMemHandle", "eventCreateWithFlags", "ipcOpenEventHandle")
        if name in (*made, "streamCreateWithFlags"):
            return next(self._ids)
        if name in ("ipcGetMemHandle", "ipcGetEventHandle"):
            return args[0].to_bytes(MEMORY_HANDLE_BYTES, "little")
        if name == "getDeviceCount":
            return 2
        if name == "getDeviceProperties":
            uuid = UUID[:-1] + bytes([args[0]])
            return {"uuid": uuid, "pciDomainID": 0, "pciBusID": 0x3B + args[0], "pciDeviceID": 0}
        return None


class _Device:
    """cupy's ``Device`` context, which needs a driver to enter: it sets ``getDevice``."""

    def __init__(self, runtime: _Runtime, device: int) -> None:
        self.runtime, self.id, self.before = runtime, device, 0

    def __enter__(self) -> None:
        self.before, self.runtime.current = self.runtime.current, self.id

    def __exit__(self, *exc: object) -> None:
        self.runtime.current = self.before


class _Stream:
    """cupy's ``Stream``, whose context needs a driver: entering it does nothing here."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    @classmethod
    def from_external(cls, handle: Any) -> _Stream:
        return cls(handle.__cuda_stream__()[1])

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        pass


def _cupy(runtime: _Runtime) -> Any:
    return SimpleNamespace(
        cuda=SimpleNamespace(
            runtime=runtime,
            UnownedMemory=cupy.cuda.UnownedMemory,
            MemoryPointer=cupy.cuda.MemoryPointer,
            Stream=_Stream,
            Device=lambda index: _Device(runtime, index),
        ),
        ndarray=cupy.ndarray,
        uint8=cupy.uint8,
    )


class _Gpus(TorchGpus):
    """``TorchGpus`` on the checked runtime; torch's side (a CPU build here) stood in."""

    def holds(self, tensor: Any) -> bool:
        return True

    def device(self, tensor: Any) -> Any:
        return self._at(1)

    def stream(self, device: Any) -> int:
        return 0x6666_0000 + device.device_id

    def side_stream(self, device: Any) -> int:
        return 0x7777_0000 + device.device_id

    def empty(self, nbytes: int, device: Any) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8)

    def node_id(self) -> str:
        return "node"


def test_query_is_a_call_the_real_binding_accepts() -> None:
    runtime = _Runtime()
    device = CudaIpcDevice(_cupy(runtime))
    with pytest.raises(CUDARuntimeError, match="driver"):
        device.query(0x5555_0000)
    assert runtime.calls == ["eventQuery"]


@pytest.mark.parametrize(("status", "done"), [(0, True), (NOT_READY, False)])
def test_query_tells_complete_from_not_ready(status: int, done: bool) -> None:
    runtime = _Runtime()
    runtime.__dict__["eventQuery"] = lambda event: status
    assert CudaIpcDevice(_cupy(runtime)).query(0x5555_0000) is done


def test_a_gpu_is_found_by_uuid_through_the_real_binding() -> None:
    runtime = _Runtime()
    with pytest.raises(CUDARuntimeError, match="driver"):
        TorchGpus(_cupy(runtime)).find("any")
    assert runtime.calls == ["getDeviceCount"]
    answered = _Runtime(answer=True)
    gpus = TorchGpus(_cupy(answered))
    second = gpus.uuids()[1]
    found = gpus.find(second)
    assert isinstance(found, CudaIpcDevice) and found.uuid() == second and found.device_id == 1
    assert gpus.find("GPU-elsewhere") is None


def test_a_whole_publish_read_and_free_makes_only_calls_the_binding_accepts() -> None:
    runtime = _Runtime(answer=True)
    producer, consumer = CudaObjects(_Gpus(_cupy(runtime))), CudaObjects(_Gpus(_cupy(runtime)))
    tensors = [torch.ones(1000), torch.arange(6.0).reshape(2, 3).t(), torch.zeros(0)]
    meta = producer.publish("obj", tensors)
    made = list(runtime.calls)
    assert made == [
        "getDeviceProperties",  # the GPU's UUID
        "malloc",
        "memset",
        "eventCreateWithFlags",
        "eventRecord",  # on the legacy stream, after the zeroing
        "streamWaitEvent",
        "memcpyAsync",
        "memcpyAsync",  # the strided tensor, made contiguous; nothing for the empty one
        "eventRecord",
        "ipcGetMemHandle",
        "ipcGetEventHandle",
    ]
    assert meta.gpu.endswith("@0000:3c:00") and len(meta.memory) == MEMORY_HANDLE_BYTES
    runtime.calls.clear()
    into = [torch.empty(1000), torch.empty(3, 2), torch.empty(0)]
    assert consumer.read(meta, into, 5.0) == into
    assert consumer.read(meta, None, 5.0)[0].shape == (1000,)
    one_read = [
        "ipcOpenMemHandle",
        "ipcOpenEventHandle",
        "eventCreateWithFlags",  # where the caller's stream has got to
        "eventRecord",
        "streamWaitEvent",
        "eventDestroy",
        "streamWaitEvent",  # the producer's event
        "memcpyAsync",
        "eventCreateWithFlags",
        "eventRecord",
        "eventQuery",
        "eventDestroy",
        "ipcCloseMemHandle",
        "eventDestroy",
    ]
    found = ["getDeviceCount", "getDeviceProperties", "getDeviceProperties"]
    into_buffers = [*one_read[:8], "memcpyAsync", *one_read[8:]]  # two tensors with bytes
    assert runtime.calls == found + into_buffers + one_read
    runtime.calls.clear()
    producer.free("obj")
    assert runtime.calls == ["eventDestroy", "free"]


def test_the_side_stream_is_a_raw_stream_of_its_own_made_once_per_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The review's L1: torch's ``Stream()`` hands out its pool's streams round-robin to
    every user, so a read stuck on a dead producer's event could hold up unrelated torch
    work. The side stream is a raw non-blocking one, made on its GPU once."""
    pooled: list[Any] = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: pooled.append(a or k))
    runtime = _Runtime(answer=True)
    made: list[tuple[Any, int]] = []
    real = runtime.__getattr__("streamCreateWithFlags")

    def create(flags: Any) -> Any:
        made.append((flags, runtime.current))
        return real(flags)

    runtime.__dict__["streamCreateWithFlags"] = create
    gpus = TorchGpus(_cupy(runtime))
    device = gpus._at(1)
    first, second = gpus.side_stream(device), gpus.side_stream(device)
    assert first == second and isinstance(first, int)
    assert made == [(real_runtime.streamNonBlocking, 1)]  # once, on its GPU
    assert pooled == []
