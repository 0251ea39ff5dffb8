"""The shared-GPU transport when a rank's ops run on several streams, on the device clock.

A real GPU runs each stream's work later, in order; the stand-in does too
(``shared_gpu_standin``), so an op whose device work is not ordered after the previous
op's shows wrong bytes here, as it would on a GPU. The GPU test of the same scenario is
``tests/gpu/test_review_shared_gpu.py``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from types import SimpleNamespace

import numpy as np
from cupy.cuda.runtime import CUDARuntimeError

from collective.groups.shared_gpu.device import CudaDevice
from collective.groups.shared_gpu.transport import SharedGpu
from tests.device_clock import DeviceClock, Process
from tests.shared_gpu_standin import HostDevice, HostGpu, device_bytes
from tests.test_shared_gpu import SLOT_BYTES, _deadline, run_gpu

A, B, S = 0x0A, 0x0B, 0x05
"""Rank 1's two streams, and rank 0's one."""


def _message(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes).astype(np.uint8)


def test_a_read_queued_on_a_busy_stream_is_not_overwritten_by_an_op_on_another_stream() -> None:
    """The review's H2: rank 1 reads op 1's bytes from rank 0's slot 0 on stream A, which is
    busy; op 2 runs on stream B and records rank 1's ``consumed`` event of slot 0 there; op 3
    (also on B: on A, rank 0's first step would wait for rank 1's arrival behind the read)
    has rank 0 write slot 0 again. Rank 0 must wait for rank 1's read on A, or rank 1's op-1
    output holds op-3 bytes."""
    sizes = [SLOT_BYTES, 2 * SLOT_BYTES, 2 * SLOT_BYTES]  # steps 0; 1-2; 3-4: slot 0 at 0, 2, 4
    issued, opened = threading.Barrier(2), threading.Event()

    def fn(t: SharedGpu, device: HostDevice, rank: int) -> list[np.ndarray]:
        c = t.collectives
        assert c is not None
        roots = [0, 1, 0]
        outs = [_message(10 * op + rank, n) if rank == root else np.zeros(n, np.uint8)
                for op, (n, root) in enumerate(zip(sizes, roots, strict=True))]  # fmt: skip
        # a long kernel ahead of rank 1's read of op 1 on A (its arrival, which rank 0's
        # stream waits on, runs before: only the read is late)
        stalled = device.stall_next(A, "write") if rank == 1 else None
        for out, root, stream in zip(outs, roots, (A, B, B) if rank else (S, S, S), strict=True):
            t.run(stream, c.broadcast, device_bytes(out), root, "uint8", _deadline())
        issued.wait(10)
        if rank == 0:  # let rank 0's device run as far as it may
            deadline = time.monotonic() + 0.5
            while not device.stream_idle(S) and time.monotonic() < deadline:
                time.sleep(0.005)
            opened.set()
        else:
            assert opened.wait(10) and stalled is not None
            stalled.set()
        device.synchronize()
        return outs

    gpu = HostGpu()
    results = run_gpu(2, fn, gpu)
    for op, root in enumerate([0, 1, 0]):
        want = _message(10 * op + root, sizes[op])
        for rank in range(2):
            np.testing.assert_array_equal(results[rank][op], want, err_msg=f"op {op + 1}")


class ClockRuntime:
    """The CUDA runtime calls ``CudaDevice.settle`` makes, on a device clock's process."""

    eventDisableTiming = 2  # noqa: N815 (cupy's names)
    eventInterprocess = 4  # noqa: N815
    CUDARuntimeError = CUDARuntimeError

    def __init__(self, process: Process) -> None:
        self.process = process
        self.events: set[int] = set()
        """The events made and not destroyed."""

    def getDevice(self) -> int:  # noqa: N802
        return 0

    def eventCreateWithFlags(self, flags: int) -> int:  # noqa: N802
        event = self.process.create_event(0)
        self.events.add(event)
        return event

    def eventRecord(self, event: int, stream: int) -> None:  # noqa: N802
        self.process.record(event, stream, 0)

    def eventQuery(self, event: int) -> int:  # noqa: N802
        return self.process.query(event)

    def eventDestroy(self, event: int) -> None:  # noqa: N802
        self.process.destroy_event(event)
        self.events.discard(event)


def test_settle_waits_for_work_on_a_stream_its_user_destroyed_and_never_records_on_it() -> None:
    """The review's L5: ``settle`` recorded an event on every stream ops had run on, and a
    stream its user destroyed since made that record fail (CUDA: invalid handle), so the
    destroy raised and left the slots allocated. Its queued work still runs, and settle
    must wait for it, within its bound."""
    clock = DeviceClock(1)
    try:
        process = clock.process()
        runtime = ClockRuntime(process)
        cupy = SimpleNamespace(
            cuda=SimpleNamespace(
                runtime=runtime,
                Device=lambda device: contextlib.nullcontext(),
                Stream=SimpleNamespace(from_external=lambda handle: contextlib.nullcontext()),
            )
        )
        device = CudaDevice(cupy)
        stream = process.create_stream(0)
        gate = process.gate(stream)  # the op's work waits behind a long kernel
        with device.on_stream(stream):
            process.submit(stream, name="the op's copy")
        process.destroy_stream(stream)  # the user's cudaStreamDestroy: the work still runs
        assert device.settle(0.1) is False
        gate.open()
        assert device.settle(5.0) is True
        assert runtime.events == set()  # its own events destroyed once done
    finally:
        clock.close()
