"""The host cost of one op, measured without a GPU: ``python -m benchmarks.host_path``.

Drives the public functions (``col.allreduce(...)``) on a world-size-1 NCCL group
built on the contract suite's stand-ins (``tests/nccl_binding.py``), with a
communicator and a CUDA runtime that do nothing, for torch-like and cupy-like
buffers: allreduce blocking and async, allgather and reducescatter blocking; and the
shared-memory and Gloo paths of a CPU group for an 8-byte allreduce at 2 ranks (rank
1 in a process of its own). Each row gives the microseconds per call, those of a
bare loop that makes the op's own NCCL call (NCCL rows; Gloo: torch's
``ProcessGroupGloo``), and the number of Python calls one op makes, counted with
``sys.setprofile`` (the stand-ins' own frames left out).

The torch-like buffer is a CPU tensor subclass that says it lies on ``cuda:0``; its
attribute reads cost about 0.1 us more each than a real tensor's. The caller's
stream comes from stand-ins of ``cuda_buffers.torch_stream`` and ``cupy_stream``
that are one C call each, as the real ones are on a GPU. ``--json PATH`` writes the
rows: ``path``, ``us_per_call``, ``bare_us_per_call``, ``python_calls``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import collective as col
from collective.frameworks import cuda_buffers
from collective.frameworks.kinds import is_torch
from collective.groups.nccl import comm as nccl_comm
from collective.groups.nccl.group import NCCLGroup
from collective.registry import held
from collective.rendezvous.store import TCPRendezvousStore
from collective.types import AllReduceOptions, CpuTransport, GroupOptions
from tests.nccl_binding import DeviceArray, FakeDevice, Pinned, _Devices

_CUDA0 = torch.device("cuda", 0)
_STAND_INS = {__file__, sys.modules["tests.nccl_binding"].__file__}


class TorchLike(torch.Tensor):
    """A CPU tensor that says it lies on ``cuda:0``, as a CUDA tensor does, without dispatch."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return _CUDA0

    def get_device(self) -> int:
        return 0

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def _record_stream(x: Any, stream: int) -> None:
    """Stand in for ``cuda_buffers.record_stream``: a kind check; torch's own call is C."""
    if is_torch(x):
        return


class _Nothing:
    """A communicator or CUDA runtime whose every call does nothing."""

    CUDARuntimeError = RuntimeError

    def __init__(self, *args: Any) -> None:
        pass

    def _nothing(self, *args: Any) -> int:
        return 0

    allReduce = reduce = broadcast = send = recv = check_async_error = _nothing  # noqa: N815
    allGather = reduceScatter = _nothing  # noqa: N815
    abort = destroy = _nothing
    eventRecord = streamWaitEvent = eventQuery = streamIsCapturing = _nothing  # noqa: N815
    memcpyAsync = streamCreateWithFlags = _nothing  # noqa: N815


class _Event:
    """``cupy.cuda.Event`` on a runtime that does nothing: only a handle of its own."""

    _handles = itertools.count(0x5E00, 0x10)

    def __init__(self, *, disable_timing: bool = False) -> None:
        self.ptr = next(self._handles)
        self.disable_timing = disable_timing


class _Comm(_Nothing):
    """A communicator that does nothing; refuses a unique ID of the wrong size, as cupy 14."""

    def __init__(self, *args: Any) -> None:
        if len(args[1]) != nccl_comm.UNIQUE_ID_BYTES:
            raise ValueError("commId must be 128 bytes")


def _bare_cupy() -> Any:
    devices = _Devices()
    nccl = SimpleNamespace(
        NcclCommunicator=_Comm,
        NcclError=RuntimeError,
        get_unique_id=lambda: bytes(128),
        groupStart=lambda: None,
        groupEnd=lambda: None,
    )
    cuda = SimpleNamespace(
        nccl=nccl,
        runtime=_Nothing(),
        Device=lambda device=None: FakeDevice(devices, device),
        Event=_Event,
        alloc_pinned_memory=Pinned,
    )

    def zeros(shape: Any, dtype: Any) -> DeviceArray:
        return DeviceArray((shape,) if isinstance(shape, int) else shape, np.dtype(dtype).name)

    return SimpleNamespace(cuda=cuda, int32=np.int32, zeros=zeros, empty=zeros)


@contextmanager
def nccl_group() -> Iterator[str]:
    """Yield the name of a world-size-1 NCCL group on do-nothing stand-ins."""
    cupy = _bare_cupy()
    saved = (
        nccl_comm._probe,
        cuda_buffers.torch_stream,
        cuda_buffers.cupy_stream,
        cuda_buffers.record_stream,
    )
    nccl_comm._probe = lambda: (cupy, "")  # type: ignore[assignment]
    cuda_buffers.torch_stream = cuda_buffers.cupy_stream = abs  # type: ignore[assignment]
    cuda_buffers.record_stream = _record_stream
    nccl_comm._takes_bytes.cache_clear()
    store = TCPRendezvousStore(dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30)))
    name = f"host-path-{uuid.uuid4().hex[:8]}"
    group = NCCLGroup(1, 0, name, store, timedelta(seconds=30))
    held.create_group(name, lambda: (group, store))
    try:
        yield name
    finally:
        col.destroy_collective_group(name)
        (
            nccl_comm._probe,
            cuda_buffers.torch_stream,
            cuda_buffers.cupy_stream,
            cuda_buffers.record_stream,
        ) = saved


def per_call_us(fn: Callable[[], Any], iters: int) -> float:
    """Return the best of three timings of ``iters`` calls of ``fn``, in us per call."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, time.perf_counter() - start)
    return best / iters * 1e6


def python_calls(fn: Callable[[], Any], tries: int = 5) -> int:
    """Return how many Python functions one call of ``fn`` enters, stand-ins left out.

    The fewest of ``tries`` calls: the first op after the watchdog saw the last one
    finish also wakes it, as a few ops a second do.
    """
    counts = []
    for _ in range(tries):
        count = 0

        def profile(frame: Any, event: str, arg: Any) -> None:
            nonlocal count
            if event == "call" and frame.f_code.co_filename not in _STAND_INS:
                count += 1

        sys.setprofile(profile)
        try:
            fn()
        finally:
            sys.setprofile(None)
        counts.append(count)
    return min(counts)


def nccl_rows(iters: int) -> list[dict[str, Any]]:
    """Measure ``col.allreduce`` (blocking and async), ``col.allgather`` and ``col.reducescatter``.

    On torch-like and cupy-like buffers, at world size 1; the list ops gather into
    (and scatter from) a list of one buffer. Each bare loop makes the op's own NCCL call.
    """
    rows = []
    with nccl_group() as name:
        comm = _Nothing()
        for kind in ("torch", "cupy"):
            ops = _nccl_ops(name, comm, _buffer(kind), _buffer(kind))
            for mode, (op, bare_op) in ops.items():
                op()
                op()
                rows.append(
                    {
                        "path": f"nccl/{kind}/{mode}",
                        "us_per_call": per_call_us(op, iters),
                        "bare_us_per_call": per_call_us(bare_op, iters),
                        "python_calls": python_calls(op),
                    }
                )
    return rows


def _nccl_ops(
    name: str, comm: Any, x: Any, other: Any
) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    """Return each NCCL row's op on ``x`` (and ``other``), and its bare NCCL call."""
    return {
        "blocking": (lambda: col.allreduce(x, name), lambda: comm.allReduce(1, 1, 2, 7, 0, 0)),
        "async": (
            lambda: col.allreduce(x, name, async_op=True).wait(),  # type: ignore[union-attr]
            lambda: comm.allReduce(1, 1, 2, 7, 0, 0),
        ),
        "allgather": (
            lambda: col.allgather([other], x, name),
            lambda: comm.allGather(1, 1, 2, 7, 0),
        ),
        "reducescatter": (
            lambda: col.reducescatter(x, [other], name),
            lambda: comm.reduceScatter(1, 1, 2, 7, 0, 0),
        ),
    }


def _buffer(kind: str) -> Any:
    """Return a two-element float32 buffer on the stand-in GPU: torch-like or cupy-like."""
    if kind == "torch":
        return torch.zeros(2, dtype=torch.float32).as_subclass(TorchLike)
    return DeviceArray((2,), "float32")


def _cpu_peer(port: int, name: str, transport: CpuTransport, calls: int) -> None:
    """Rank 1 of ``cpu_row``, in a process of its own: ``calls`` 8-byte allreduces."""
    from collective.groups.cpu.group import CpuGroup

    store = TCPRendezvousStore(dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=60)))
    options = GroupOptions(cpu_transport=transport)
    group = CpuGroup(2, 1, name, store, timedelta(seconds=60), options=options)
    y = np.ones(2, dtype=np.float32)
    launch, _ = group.build("allreduce", y, AllReduceOptions())
    for _ in range(calls):
        launch(y)
    group.destroy_group()


def cpu_row(transport: CpuTransport, iters: int) -> dict[str, Any]:
    """Measure an 8-byte ``col.allreduce`` at 2 ranks on one CPU transport.

    Rank 0 calls the public function in this process; rank 1, a spawned process,
    makes the same number of calls on its group, as ``col.allreduce`` would.
    """
    import multiprocessing

    from collective.groups.cpu.group import CpuGroup

    master = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60))
    name = f"host-path-{transport.value}-{uuid.uuid4().hex[:8]}"
    tries, calls = 5, 1 + 5 + 3 * iters
    peer = multiprocessing.get_context("spawn").Process(
        target=_cpu_peer, args=(master.port, name, transport, calls), daemon=True
    )
    peer.start()
    options = GroupOptions(cpu_transport=transport)
    store = TCPRendezvousStore(master)
    group = CpuGroup(2, 0, name, store, timedelta(seconds=60), options=options)
    held.create_group(name, lambda: (group, store))
    x = np.ones(2, dtype=np.float32)
    try:
        col.allreduce(x, name)
        count = python_calls(lambda: col.allreduce(x, name), tries)
        us = per_call_us(lambda: col.allreduce(x, name), iters)
    finally:
        col.destroy_collective_group(name)
        peer.join(60)
        if peer.is_alive():
            peer.kill()
    path = f"{transport.value}/allreduce"
    return {"path": path, "us_per_call": us, "bare_us_per_call": None, "python_calls": count}


def main(argv: list[str] | None = None) -> int:
    """Print the table; with ``--json PATH`` also write the rows there."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20000, help="calls per NCCL timing")
    parser.add_argument("--cpu-iters", type=int, default=2000, help="calls per CPU timing")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args(argv)
    rows = nccl_rows(args.iters)
    rows += [cpu_row(t, args.cpu_iters) for t in (CpuTransport.SHM, CpuTransport.GLOO)]
    print(f"{'path':<26}{'us/call':>10}{'bare us':>10}{'ours us':>10}{'py calls':>10}")
    for row in rows:
        bare = row["bare_us_per_call"]
        ours = row["us_per_call"] - bare if bare is not None else None
        print(
            f"{row['path']:<26}{row['us_per_call']:>10.2f}"
            f"{'-' if bare is None else f'{bare:.2f}':>10}"
            f"{'-' if ours is None else f'{ours:.2f}':>10}{row['python_calls']:>10}"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
