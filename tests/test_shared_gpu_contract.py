"""Every CUDA call of the shared-GPU transport, checked against cupy's real binding.

``CudaDevice`` reaches the CUDA runtime through ``cupy.cuda.runtime`` only. Here that
namespace is cupy's real one (but for ``getDevice``, which needs a driver to answer):
each call goes to the real binding, which checks every argument's type and count and
then fails for want of a driver with ``CUDARuntimeError``. A call the binding refuses
(a wrong argument type or count, a handle of the wrong size) raises something else and
fails the test. What the calls do on a GPU is checked by ``tests/gpu/test_shared_gpu.py``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, ClassVar

import cupy
import pytest
from cupy.cuda import runtime as real_runtime

from collective.groups.shared_gpu.device import MEMORY_HANDLE_BYTES, CudaDevice
from collective.groups.shared_gpu.reduce import DeviceReducer
from collective.types import ReduceOp

CUDARuntimeError = real_runtime.CUDARuntimeError


class _Runtime:
    """cupy's real runtime, but ``getDevice`` answers 0 and every call is logged."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def getDevice(self) -> int:  # noqa: N802 (cupy's name)
        return 0

    def __getattr__(self, name: str) -> Any:
        real = getattr(real_runtime, name)
        if not callable(real):
            return real

        def call(*args: Any) -> Any:
            self.calls.append(name)
            return real(*args)

        return call


class _Device:
    """cupy's ``Device`` context, which needs a driver to enter: entering it is logged."""

    entered: ClassVar[list[int]] = []

    def __init__(self, device: int) -> None:
        self.id = device

    def __enter__(self) -> None:
        self.entered.append(self.id)

    def __exit__(self, *exc: object) -> None:
        pass


def _device() -> tuple[CudaDevice, _Runtime]:
    runtime = _Runtime()
    namespace = SimpleNamespace(
        cuda=SimpleNamespace(
            runtime=runtime,
            UnownedMemory=cupy.cuda.UnownedMemory,
            MemoryPointer=cupy.cuda.MemoryPointer,
            Stream=cupy.cuda.Stream,
            Device=_Device,
        ),
        ndarray=cupy.ndarray,
        uint8=cupy.uint8,
    )
    return CudaDevice(namespace), runtime


HANDLE = bytes(range(MEMORY_HANDLE_BYTES))

CALLS: list[tuple[str, tuple[Any, ...], list[str]]] = [
    ("uuid", (), ["getDeviceProperties"]),
    ("alloc", (1 << 20,), ["malloc"]),
    ("free", (0x7F00_0000_0000,), ["free"]),
    ("export_memory", (0x7F00_0000_0000,), ["ipcGetMemHandle"]),
    ("open_memory", (HANDLE,), ["ipcOpenMemHandle"]),
    ("close_memory", (0x7F00_0000_0000,), ["ipcCloseMemHandle"]),
    ("new_event", (), ["eventCreateWithFlags"]),
    ("export_event", (0x5555_0000,), ["ipcGetEventHandle"]),
    ("open_event", (HANDLE,), ["ipcOpenEventHandle"]),
    ("destroy_event", (0x5555_0000,), ["eventDestroy"]),
    ("record", (0x5555_0000, 0x6666_0000), ["eventRecord"]),
    ("wait", (0x6666_0000, 0x5555_0000), ["streamWaitEvent"]),
    ("copy", (0x7F00_0000_0000, 0x7F10_0000_0000, 4096, 0x6666_0000), ["memcpyAsync"]),
    ("synchronize", (), ["deviceSynchronize"]),
]


@pytest.mark.parametrize(("method", "args", "reached"), CALLS, ids=[c[0] for c in CALLS])
def test_each_call_is_one_the_real_binding_accepts(
    method: str, args: tuple[Any, ...], reached: list[str]
) -> None:
    device, runtime = _device()
    with pytest.raises(CUDARuntimeError, match="driver"):
        getattr(device, method)(*args)
    assert runtime.calls == reached


def test_events_are_made_interprocess_with_timing_off() -> None:
    device, _ = _device()
    flags = real_runtime.eventInterprocess | real_runtime.eventDisableTiming
    assert device._event_flags == flags


def test_memory_is_opened_with_the_only_flag_cuda_allows() -> None:
    opened: list[tuple[bytes, int]] = []

    def open_handle(handle: bytes, flags: int) -> int:
        opened.append((handle, flags))
        return 0x10

    device, runtime = _device()
    runtime.__dict__["ipcOpenMemHandle"] = open_handle
    assert device.open_memory(HANDLE) == 0x10
    assert opened == [(HANDLE, real_runtime.cudaIpcMemLazyEnablePeerAccess)]


def test_a_view_is_a_cupy_uint8_array_over_the_address() -> None:
    device, _ = _device()
    view = device.view(0x7F00_0000_1000, 4096)
    assert isinstance(view, cupy.ndarray)
    assert view.dtype == cupy.uint8 and view.shape == (4096,)
    assert view.data.ptr == 0x7F00_0000_1000


def test_each_stream_is_wrapped_once_for_cupy_and_entered_on_the_gpu() -> None:
    device, _ = _device()
    first = device.on_stream(0x1234)
    second = device.on_stream(0x1234)
    assert first._stream is second._stream and first._stream.ptr == 0x1234
    _Device.entered.clear()
    with pytest.raises(CUDARuntimeError, match="driver"), first:  # the stream needs a driver
        pass
    assert _Device.entered == [0]  # the GPU was made current first


def test_cupy_before_14_wraps_a_stream_with_external_stream_on_the_groups_gpu() -> None:
    """cupy 13 has no ``Stream.from_external``: the stream is wrapped as an
    ``ExternalStream`` of the group's GPU, once."""
    made: list[tuple[int, int]] = []

    class OldStream:  # cupy 13's Stream: no from_external
        pass

    def external(ptr: int, device_id: int) -> Any:
        made.append((ptr, device_id))
        return SimpleNamespace(ptr=ptr)

    device, _ = _device()
    device._cupy.cuda.Stream = OldStream
    device._cupy.cuda.ExternalStream = external
    first, second = device.on_stream(0x1234), device.on_stream(0x1234)
    assert first._stream is second._stream
    assert made == [(0x1234, 0)]


@pytest.mark.parametrize("method", ["free", "close_memory", "destroy_event", "synchronize"])
def test_teardown_calls_run_on_the_groups_gpu(method: str) -> None:
    device, _ = _device()
    _Device.entered.clear()
    with pytest.raises(CUDARuntimeError, match="driver"):
        getattr(device, method)(*([0x5555_0000] if method != "synchronize" else []))
    assert _Device.entered == [0]


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN, ReduceOp.MAX])
def test_bfloat16_reductions_are_cupy_kernels(op: ReduceOp) -> None:
    reducer = DeviceReducer(op, "bfloat16", 3, cupy)
    assert reducer.itemsize == 2


def test_bfloat16_refuses_bitwise_reductions() -> None:
    with pytest.raises(ValueError, match="bfloat16 takes"):
        DeviceReducer(ReduceOp.BXOR, "bfloat16", 2, cupy)
