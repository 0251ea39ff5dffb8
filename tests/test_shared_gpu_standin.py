"""The shared-GPU stand-in itself: work queues on streams and runs later, as on a GPU.

The transport's tests trust ``shared_gpu_standin`` to show an ordering defect as wrong
data; these check that it does: device writes wait for their stream, a wait waits for
the record it captured, each rank's handle is its own queue, host memory is copied as
pageable memory is, and work that outlives its memory is caught.
"""

from __future__ import annotations

import time
from typing import cast

import numpy as np

from tests.shared_gpu_standin import DeviceBytes, HostDevice, HostGpu, device_bytes


def test_a_write_runs_when_its_stream_reaches_it_and_a_host_read_waits_for_it() -> None:
    gpu = HostGpu()
    device = HostDevice(gpu, 0)
    x = np.zeros(8, np.int64)
    view = device_bytes(x).view(np.int64)
    gate = device.gate(3)
    with device.on_stream(3):
        view[...] = np.arange(8)  # host values: taken now
        np.add(view, view, out=view)
    time.sleep(0.05)
    assert not x.any(), "the write ran before its stream reached it"
    assert not device.settle(0.05)
    gate.open()
    with device.on_stream(3):
        np.testing.assert_array_equal(cast(DeviceBytes, view).get(), 2 * np.arange(8))
    assert device.settle(1.0)


def test_a_wait_orders_one_ranks_stream_after_another_ranks_record() -> None:
    gpu = HostGpu()
    writer, reader = HostDevice(gpu, 0), HostDevice(gpu, 1)
    event = writer.new_event()
    source, target = np.zeros(4, np.int32), np.zeros(4, np.int32)
    src, dst = device_bytes(source), device_bytes(target)
    gate = writer.gate(5)  # the same handle in both ranks: two queues
    with writer.on_stream(5):
        src.view(np.int32)[...] = np.array([1, 2, 3, 4], np.int32)
    writer.record(event, 5)
    reader.wait(5, event)
    with reader.on_stream(5):
        dst[...] = src
    time.sleep(0.05)
    assert not target.any() and not reader.stream_idle(5)
    gate.open()
    reader.stream_synchronize(5)
    np.testing.assert_array_equal(target, [1, 2, 3, 4])
    assert gpu.misuse == []


def test_copies_take_host_bytes_at_once_and_fill_host_memory_before_returning() -> None:
    gpu = HostGpu()
    device = HostDevice(gpu, 0)
    ptr = device.alloc(16)
    host = np.arange(16, dtype=np.uint8)
    gate = device.gate(7)
    device.copy(ptr, int(host.ctypes.data), 16, 7)
    host[:] = 0  # the copy already took the bytes (pageable memory is staged)
    gate.open()
    back = np.zeros(16, np.uint8)
    device.copy(int(back.ctypes.data), ptr, 16, 7)  # returns once it ran
    np.testing.assert_array_equal(back, np.arange(16))
    device.free(ptr)
    assert gpu.live() == (0, 0) and gpu.misuse == []


def test_work_that_reaches_memory_another_process_freed_is_a_misuse() -> None:
    gpu = HostGpu()
    owner, peer = HostDevice(gpu, 0), HostDevice(gpu, 1)
    ptr = owner.alloc(64)
    mapped = peer.open_memory(owner.export_memory(ptr))
    gate = peer.gate(9)
    out = np.zeros(64, np.uint8)
    device_bytes(out)
    peer.copy(int(out.ctypes.data), mapped, 64, 9)
    peer.close_memory(mapped)
    owner.free(ptr)  # waits for the owner's work only, as cudaFree does
    gate.open()
    peer.stream_synchronize(9)
    assert gpu.misuse == ["rank 1's copy touched memory freed before the device reached it"]
