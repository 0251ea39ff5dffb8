"""Every NCCL call the nccl backend makes, checked against cupy's real binding, without a GPU.

The real ``cupy-cuda12x`` and ``nvidia-nccl-cu12`` are installed with the test extras.
First the binding itself: the unique ID, and each communicator method on an
uninitialised communicator, which reaches NCCL with the right argument types and
raises TypeError with wrong ones. Then the backend's own call sites, every op at world
size 3, the multigpu functions, send/recv, barrier, destroy: each rank runs in a
thread on a ``ContractCupy`` (see ``tests/nccl_binding.py``), the real binding checks
the types of what it is handed, and these tests check the values, call by call, from
the buffers' own addresses, sizes and dtypes and from cupy's NCCL constants.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import collective as col
from collective.registry import held
from collective.types import (
    AllGatherOptions,
    AllReduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    RecvOptions,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
    SendOptions,
)
from tests.nccl_binding import (
    DeviceArray,
    Entry,
    chunks,
    group_blocks,
    real_nccl,
    without_checks,
)
from tests.nccl_threads import CONTRACT, Ranks, caller_stream, contract_ranks

pytestmark = CONTRACT

SHAPE = (4, 8)
COUNT = 32
D2D = 3
"""``cudaMemcpyDeviceToDevice``."""
NCCL_OPS = ("allReduce", "reduce", "broadcast", "bcast", "allGather", "reduceScatter")
CALLS = (*NCCL_OPS, "send", "recv", "memcpyAsync")
DTYPES = ("int8", "uint8", "int32", "int64", "float16", "bfloat16", "float32", "float64")
REDUCTIONS = {
    ReduceOp.SUM: real_nccl.NCCL_SUM,
    ReduceOp.PRODUCT: real_nccl.NCCL_PROD,
    ReduceOp.MAX: real_nccl.NCCL_MAX,
    ReduceOp.MIN: real_nccl.NCCL_MIN,
    ReduceOp.AVG: real_nccl.NCCL_AVG,
}


def nccl_dtype(dtype: str) -> int:
    """Return cupy's ``NCCL_<DTYPE>`` constant: the number the binding hands NCCL."""
    return int(getattr(real_nccl, f"NCCL_{dtype.upper()}"))


@pytest.fixture
def ranks(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Ranks]]:
    with contract_ranks(monkeypatch) as make:
        yield make


def op_calls(entries: list[Entry]) -> list[tuple[str, tuple[Any, ...]]]:
    """Return the NCCL calls and copies of the one op in ``entries``.

    An op of one NCCL call makes it alone; an op of several makes them in one NCCL
    group call, and nothing outside it.
    """
    entries = without_checks(entries)
    calls = [e for e in entries if e.name in CALLS]
    blocks = [b for b in group_blocks(entries) if any(e.name in CALLS for e in b)]
    if len(calls) == 1 and calls[0].comm is not None:
        assert not blocks, "a single NCCL call needs no NCCL group call"
    else:
        assert len(blocks) == 1, f"expected one NCCL group call, got {len(blocks)}"
        assert [e for e in blocks[0] if e.name in CALLS] == calls
    return [(e.name, e.args) for e in calls]


def check_devices(ranks: Ranks, async_op: bool = False) -> None:
    """Assert that every call ran on its communicator's device and that device's stream.

    A blocking op's stream is the caller's current one, an async op's the group's
    comm stream. A lone NCCL call may be made with any device current: NCCL runs it
    on its communicator's device, as NCCL's own multi-device example does.
    """
    for cupy in ranks.cupys:
        streams = cupy.streams()
        for e in cupy.trace.named(*CALLS):
            device = e.comm.device if e.comm is not None else e.device
            lone = e.comm is not None and e.device is None
            assert lone or e.device == device, f"{e.name} on GPU {e.device}, its comm on {device}"
            stream = streams[device or 0] if async_op else caller_stream(device or 0)
            assert e.args[-1] == stream, f"{e.name} not on GPU {device}'s stream"


def bufs(n: int, dtype: str, counts: list[int] | None = None) -> list[DeviceArray]:
    return [DeviceArray((c,), dtype) for c in (counts or [COUNT] * n)]


@pytest.mark.parametrize(
    ("op", "dtype"),
    [(op, t) for op in REDUCTIONS for t in DTYPES if op is not ReduceOp.AVG or "int" not in t],
    ids=str,
)
def test_allreduce_passes_buffer_count_dtype_and_op(
    ranks: Callable[..., Ranks], op: ReduceOp, dtype: str
) -> None:
    r = ranks(1)
    x = DeviceArray(SHAPE, dtype)
    r.run(lambda _, g: g.allreduce([x], AllReduceOptions(op)))
    stream = caller_stream(0)
    expected = ("allReduce", (x.ptr, x.ptr, COUNT, nccl_dtype(dtype), REDUCTIONS[op], stream))
    assert op_calls(r.cupys[0].trace.entries) == [expected]
    check_devices(r)


def test_communicators_form_from_rank_0s_unique_id(ranks: Callable[..., Ranks]) -> None:
    r = ranks(3)
    r.run(lambda rank, g: g.allreduce([DeviceArray(SHAPE, "float32")], AllReduceOptions()))
    made = r.cupys[0].trace.named("get_unique_id")
    assert len(made) == 1 and not any(c.trace.named("get_unique_id") for c in r.cupys[1:])
    uid = made[0].args[0]
    for rank, cupy in enumerate(r.cupys):
        inits = cupy.trace.named("NcclCommunicator")
        assert [e.args for e in inits] == [(3, uid, rank)]
        assert inits[0].device == 0
        block = next(b for b in group_blocks(cupy.trace.entries) if inits[0] in b)
        assert block[0].thread == inits[0].thread == block[-1].thread


def _issue(op: str, rank: int, g: Any, dtype: str) -> list[tuple[str, tuple[Any, ...]]]:
    """Issue ``op`` on this rank with fresh buffers; return the calls it must make."""
    n, d = g.world_size, nccl_dtype(dtype)
    x, outs, ins = DeviceArray(SHAPE, dtype), bufs(n, dtype), bufs(n, dtype)
    stream = caller_stream(0)
    nbytes = x.size * (2 if dtype == "bfloat16" else np.dtype(dtype).itemsize)
    if op == "reduce":
        g.reduce([x], ReduceOptions(ReduceOp.MAX, root_rank=1))
        return [("reduce", (x.ptr, x.ptr, COUNT, d, REDUCTIONS[ReduceOp.MAX], 1, stream))]
    if op == "broadcast":
        g.broadcast([x], BroadcastOptions(root_rank=2))
        return [("broadcast", (x.ptr, x.ptr, COUNT, d, 2, stream))]
    if op == "allgather":
        g.allgather([outs], [x], AllGatherOptions())
        return [
            ("broadcast", (x.ptr if j == rank else o.ptr, o.ptr, COUNT, d, j, stream))
            for j, o in enumerate(outs)
        ]
    if op == "reducescatter":
        g.reducescatter([x], [ins], ReduceScatterOptions(ReduceOp.MIN))
        return [
            ("reduce", (i.ptr, x.ptr, COUNT, d, REDUCTIONS[ReduceOp.MIN], j, stream))
            for j, i in enumerate(ins)
        ]
    if op == "gather":
        g.gather([outs if rank == 1 else []], [x], GatherOptions(root_rank=1))
        if rank != 1:
            return [("send", (x.ptr, COUNT, d, 1, stream))]
        return [
            ("memcpyAsync", (o.ptr, x.ptr, nbytes, D2D, stream))
            if j == 1
            else ("recv", (o.ptr, COUNT, d, j, stream))
            for j, o in enumerate(outs)
        ]
    if op == "scatter":
        g.scatter([x], [ins if rank == 1 else []], ScatterOptions(root_rank=1))
        if rank != 1:
            return [("recv", (x.ptr, COUNT, d, 1, stream))]
        return [
            ("memcpyAsync", (x.ptr, i.ptr, nbytes, D2D, stream))
            if j == 1
            else ("send", (i.ptr, COUNT, d, j, stream))
            for j, i in enumerate(ins)
        ]
    assert op == "alltoall"
    # rank r sends 8 * (j + 1) elements to rank j, so it receives 8 * (r + 1) from each
    sent = bufs(n, dtype, [8 * (j + 1) for j in range(n)])
    got = bufs(n, dtype, [8 * (rank + 1)] * n)
    g.alltoall(got, sent, AllToAllOptions())
    calls: list[tuple[str, tuple[Any, ...]]] = []
    for j in range(n):
        if j == rank:
            size = sent[j].size * nbytes // COUNT
            calls.append(("memcpyAsync", (got[j].ptr, sent[j].ptr, size, D2D, stream)))
        else:
            calls.append(("send", (sent[j].ptr, 8 * (j + 1), d, j, stream)))
            calls.append(("recv", (got[j].ptr, 8 * (rank + 1), d, j, stream)))
    return calls


@pytest.mark.parametrize("dtype", ["float16", "int64"])
@pytest.mark.parametrize(
    "op", ["reduce", "broadcast", "allgather", "reducescatter", "gather", "scatter", "alltoall"]
)
def test_each_op_makes_its_nccl_calls_on_every_rank(
    ranks: Callable[..., Ranks], op: str, dtype: str
) -> None:
    r = ranks(3)
    r.run(lambda _, g: g.allreduce([DeviceArray(SHAPE, dtype)], AllReduceOptions()))
    r.clear()
    expected = r.run(lambda rank, g: _issue(op, rank, g, dtype))
    for rank, cupy in enumerate(r.cupys):
        assert op_calls(cupy.trace.entries) == expected[rank], f"rank {rank}"
    check_devices(r)


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_blocking_op_is_one_nccl_call_on_the_callers_stream_and_one_marker(
    ranks: Callable[..., Ranks], world_size: int
) -> None:
    """No stream, event, group call or device switch of ours: what NCCL's own API costs.

    With peers, the mismatch check's three calls go ahead of the op; a group of one
    rank has nobody to disagree with and makes none.
    """
    r = ranks(world_size)
    x = DeviceArray(SHAPE, "float32")
    r.run(lambda _, g: g.allreduce([x], AllReduceOptions()))
    for _ in range(3):
        r.clear()
        caller = r.run(lambda _, g: (g.allreduce([x], AllReduceOptions()), threading.get_ident()))
        entries = [e for e in r.cupys[0].trace.entries if e.thread == caller[0][1]]
        trace = [(e.name, e.args, e.device) for e in without_checks(entries)]
        capture, *reads, call, marker = trace
        assert {e[0] for e in reads} <= {"eventQuery"}  # the checks of earlier ops, if unread
        assert capture == ("streamIsCapturing", (caller_stream(0),), None)
        assert call == ("allReduce", (x.ptr, x.ptr, COUNT, nccl_dtype("float32"), 0, 0xCA00), None)
        assert marker[0] == "eventRecord" and marker[1][1] == caller_stream(0)
        check = [e.name for e in entries if e not in without_checks(entries)]
        assert check == (["allReduce", "memcpyAsync", "eventRecord"] if world_size > 1 else [])
    assert not r.cupys[0].trace.named("streamCreateWithFlags")


def test_an_async_op_follows_the_callers_stream_and_the_caller_follows_it_on_wait(
    ranks: Callable[..., Ranks],
) -> None:
    r = ranks(1)
    x = DeviceArray(SHAPE, "float32")
    r.run(lambda _, g: g.allreduce([x], AllReduceOptions(async_op=True)).wait())
    r.clear()
    work = r.run(lambda _, g: g.allreduce([x], AllReduceOptions(async_op=True)))[0]
    work.wait()
    trace = without_checks(r.cupys[0].trace.entries)
    names = [e.name for e in trace if e.name not in ("eventQuery", "check_async_error")]
    assert names == [
        "streamIsCapturing",  # the caller's stream: an async op is never captured
        "eventRecord",
        "streamWaitEvent",
        "allReduce",
        "eventRecord",
        "eventRecord",
        "streamWaitEvent",
    ]
    caller, stream = caller_stream(0), r.cupys[0].streams()[0]
    _, ready, follow, _, done, marker, after = [e for e in trace if e.name in names]
    assert ready.args[1] == caller and follow.args[:2] == (stream, ready.args[0])
    assert done.args[1] == stream and after.args[:2] == (caller, done.args[0])
    assert marker.args[1] == stream and marker.args[0] not in (ready.args[0], done.args[0])
    between = trace[trace.index(done) : trace.index(after)]
    me = threading.get_ident()
    polled = [e.args[0] for e in between if e.name == "eventQuery" and e.thread == me]
    assert polled[:1] == [done.args[0]]  # the wait polled the op's event first
    r.settle()
    r.clear()  # the pool hands the same two events out again, the marker its own
    r.run(lambda _, g: g.allreduce([x], AllReduceOptions(async_op=True)))[0].wait()
    again = [e for e in without_checks(r.cupys[0].trace.entries) if e.name == "eventRecord"]
    assert {e.args[0] for e in again} == {ready.args[0], done.args[0], marker.args[0]}


def test_send_and_recv_use_a_pair_communicator_and_n_elements(
    ranks: Callable[..., Ranks],
) -> None:
    r = ranks(2)
    x = [DeviceArray(SHAPE, "int32"), DeviceArray(SHAPE, "int32")]

    def pair(rank: int, g: Any) -> None:
        if rank == 0:
            g.send([x[0]], SendOptions(dst_rank=1, dst_gpu_index=0, n_elements=5))
        else:
            g.recv([x[1]], RecvOptions(src_rank=0, src_gpu_index=0, n_elements=5))

    r.run(pair)
    d = nccl_dtype("int32")
    sends = r.cupys[0].trace.named("NcclCommunicator", "send")
    recvs = r.cupys[1].trace.named("NcclCommunicator", "recv")
    uid = r.cupys[0].trace.named("get_unique_id")[0].args[0]
    s0 = s1 = caller_stream(0)
    assert [(e.name, e.args) for e in sends] == [
        ("NcclCommunicator", (2, uid, 0)),
        ("send", (x[0].ptr, 5, d, 1, s0)),
    ]
    assert [(e.name, e.args) for e in recvs] == [
        ("NcclCommunicator", (2, uid, 1)),
        ("recv", (x[1].ptr, 5, d, 0, s1)),
    ]
    check_devices(r)


def test_a_rank_driving_two_gpus_holds_nccl_ranks_2r_and_2r_plus_1(
    ranks: Callable[..., Ranks],
) -> None:
    r = ranks(2)
    xs = [[DeviceArray(SHAPE, "float32", device=i) for i in range(2)] for _ in range(2)]
    r.run(lambda rank, g: g.allreduce(xs[rank], AllReduceOptions()))
    for rank, cupy in enumerate(r.cupys):
        inits = cupy.trace.named("NcclCommunicator")
        assert [(e.args[0], e.args[2], e.device) for e in inits] == [
            (4, 2 * rank, 0),
            (4, 2 * rank + 1, 1),
        ]
        assert not cupy.streams()  # each GPU's calls run on the caller's stream there
        calls = [(e.args, e.device) for e in cupy.trace.named("allReduce")]
        assert calls == [
            ((x.ptr, x.ptr, COUNT, nccl_dtype("float32"), 0, caller_stream(i)), i)
            for i, x in enumerate(xs[rank])
        ]
    check_devices(r)


def test_multigpu_functions_with_two_gpus(ranks: Callable[..., Ranks]) -> None:
    r = ranks(1)
    name, g = r.name, r.groups[0]
    held.create_group(name, lambda: (g, None))
    try:
        a = [DeviceArray(SHAPE, "float64", device=i) for i in range(2)]
        outs = [[DeviceArray(SHAPE, "float64", device=i) for _ in range(2)] for i in range(2)]

        def calls() -> list[tuple[str, tuple[Any, ...]]]:
            entries = list(r.cupys[0].trace.entries)
            r.clear()
            return op_calls(entries)

        r.run(lambda *_: col.allreduce_multigpu(a, name, op="max"))
        s, d = [caller_stream(0), caller_stream(1)], nccl_dtype("float64")
        assert calls() == [
            ("allReduce", (x.ptr, x.ptr, COUNT, d, 2, s[i])) for i, x in enumerate(a)
        ]
        r.run(lambda *_: col.reduce_multigpu(a, 0, 1, name))
        assert calls() == [
            ("reduce", (x.ptr, x.ptr, COUNT, d, 0, 1, s[i])) for i, x in enumerate(a)
        ]
        r.run(lambda *_: col.broadcast_multigpu(a, 0, 1, name))
        assert calls() == [
            ("broadcast", (x.ptr, x.ptr, COUNT, d, 1, s[i])) for i, x in enumerate(a)
        ]
        r.run(lambda *_: col.allgather_multigpu(outs, a, name))
        assert calls() == [
            ("broadcast", (a[i].ptr if j == i else o.ptr, o.ptr, COUNT, d, j, s[i]))
            for i in range(2)
            for j, o in enumerate(outs[i])
        ]
        r.run(lambda *_: col.reducescatter_multigpu(a, outs, name))
        assert calls() == [
            ("reduce", (o.ptr, a[i].ptr, COUNT, d, 0, j, s[i]))
            for i in range(2)
            for j, o in enumerate(outs[i])
        ]
        check_devices(r)
    finally:
        col.destroy_collective_group(name)


def test_barrier_allreduces_one_int32_and_blocks_until_done(ranks: Callable[..., Ranks]) -> None:
    r = ranks(2)
    r.run(lambda _, g: g.barrier(BarrierOptions()))
    for cupy in r.cupys:
        (call,) = [e for e in without_checks(cupy.trace.entries) if e.name == "allReduce"]
        assert call.args[2:5] == (1, nccl_dtype("int32"), real_nccl.NCCL_SUM)
        stream = cupy.streams()[0]
        records = [e for e in without_checks(cupy.trace.entries) if e.name == "eventRecord"]
        done, _marker = [e for e in records if e.args[1] == stream]
        polled = [e.args[0] for e in cupy.trace.named("eventQuery") if e.thread == call.thread]
        assert polled[:1] == [done.args[0]]  # then the signature check's, maybe


def views(n: int, dtype: str) -> list[DeviceArray]:
    """Return ``n`` consecutive chunks of one GPU buffer, as ``frameworks.chunks`` makes them."""
    return chunks(n, (COUNT,), dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "int32"])
def test_allgather_and_reducescatter_on_one_flat_buffer_are_one_nccl_call_each(
    ranks: Callable[..., Ranks], dtype: str
) -> None:
    """No copy and no per-rank calls: the chunks of one buffer are NCCL's own layout."""
    r = ranks(3)
    d = nccl_dtype(dtype)
    x = [DeviceArray(SHAPE, dtype) for _ in range(3)]
    outs = [views(3, dtype) for _ in range(3)]
    r.run(lambda rank, g: g.allgather([outs[rank]], [x[rank]], AllGatherOptions()))
    for rank, cupy in enumerate(r.cupys):
        assert op_calls(cupy.trace.entries) == [
            ("allGather", (x[rank].ptr, outs[rank][0].ptr, COUNT, d, caller_stream(0)))
        ]
    r.clear()
    summing = ReduceScatterOptions(ReduceOp.MIN)
    r.run(lambda rank, g: g.reducescatter([x[rank]], [outs[rank]], summing))
    for rank, cupy in enumerate(r.cupys):
        op = REDUCTIONS[ReduceOp.MIN]
        assert op_calls(cupy.trace.entries) == [
            ("reduceScatter", (outs[rank][0].ptr, x[rank].ptr, COUNT, d, op, caller_stream(0)))
        ]
    check_devices(r)
    r.clear()  # a list whose chunks are out of rank order keeps the per-rank calls
    shuffled = [[o[1], o[0], o[2]] for o in outs]
    r.run(lambda rank, g: g.allgather([shuffled[rank]], [x[rank]], AllGatherOptions()))
    assert [name for name, _ in op_calls(r.cupys[0].trace.entries)] == ["broadcast"] * 3
