"""The GPU review's NCCL findings (``../shared/GPU-REVIEW.md``) on the asynchronous stand-ins.

Ranks are threads on ``ContractCupy`` over one ``DeviceClock`` (``tests/nccl_threads.py``):
streams queue their work, events complete when reached, a collective waits for every
rank's call and a first use of an NCCL connection blocks the host until the peers make
theirs. Each test here failed on the code before its fix.
"""

from __future__ import annotations

import functools
import gc
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from collective.frameworks import cuda_buffers
from collective.types import (
    AllReduceOptions,
    CollectiveError,
    CollectiveTimeoutError,
    GatherOptions,
    ReduceOp,
)
from tests.device_clock import NOT_READY
from tests.nccl_binding import DeviceArray
from tests.nccl_threads import CONTRACT, Ranks, caller_stream, ranks_fixture

pytestmark = CONTRACT
__all__ = ["ranks_fixture"]  # the fixture ``ranks``

SLACK_S = 4.0
"""How much later than its timeout an error may come, on a loaded machine."""


def _allreduce(
    rank: int, g: Any, x: list[DeviceArray], op: ReduceOp = ReduceOp.SUM, times: int = 1
) -> None:
    for _ in range(times):
        g.allreduce([x[rank]], AllReduceOptions(op))


def _sync(r: Ranks, device: int = 0, stream: int | None = None) -> None:
    for cupy in r.cupys:
        cupy.gpu.stream_synchronize(caller_stream(device) if stream is None else stream, device)


def test_h1_a_loop_of_200_ops_the_device_runs_slower_keeps_the_group_and_its_checks(
    ranks: Callable[..., Ranks],
) -> None:
    """H1: the host issues 200 blocking allreduces faster than the device runs them.

    Before the fix the 65th op found the check's ring full and broke the group on every
    rank. Now the host waits for the oldest check: every op is checked and right.
    """
    r = ranks(2)
    x = [DeviceArray((4,), "int64") for _ in range(2)]
    r.run(functools.partial(_allreduce, x=x, op=ReduceOp.MAX))
    _sync(r)
    for rank in range(2):
        x[rank].host()[:] = rank + 1
    r.clock.pace_s = 0.002  # every kernel takes 2 ms: the device falls behind
    r.run(functools.partial(_allreduce, x=x, op=ReduceOp.MAX, times=200))
    behind = [c.gpu.stream_query(caller_stream(0), 0) == NOT_READY for c in r.cupys]
    r.clock.pace_s = 0.0
    _sync(r)
    r.settle()
    assert any(behind), "the device never fell behind the host"
    assert all(g.error is None for g in r.groups), [str(g.error) for g in r.groups]
    assert [xs.host().tolist() for xs in x] == [[2] * 4] * 2
    assert all(len(c.trace.named("allReduce")) == 2 * 201 for c in r.cupys), "op and check each"


def test_h1_a_mismatch_late_in_a_long_loop_is_still_found(ranks: Callable[..., Ranks]) -> None:
    """H1: waiting for the ring's oldest slot loses no check: op 100 of 120 differs."""
    r = ranks(2)
    shapes = [DeviceArray((8,), "float32"), DeviceArray((9,), "float32")]
    for x in shapes:  # both kinds known on both ranks: the check, not the agreement, finds it
        r.run(functools.partial(_allreduce, x=[x, x]))
    r.settle()
    r.clock.pace_s = 0.001

    def loop(rank: int, g: Any) -> BaseException | None:
        try:
            for i in range(120):
                x = shapes[rank] if i == 100 else shapes[0]
                g.allreduce([x], AllReduceOptions(timeout=timedelta(seconds=20)))
        except CollectiveError as exc:
            return exc
        return None

    r.run(loop)
    r.clock.pace_s = 0.0
    deadline = time.monotonic() + 10
    while any(g.error is None for g in r.groups) and time.monotonic() < deadline:
        time.sleep(0.01)
    for group in r.groups:
        assert "different ops or arguments" in str(group.error), str(group.error)
        assert "shape: differs" in str(group.error)


def test_h3_a_first_use_whose_peer_never_comes_times_out_instead_of_blocking_in_nccl(
    ranks: Callable[..., Ranks],
) -> None:
    """H3: rank 0's first gather receives from rank 1, which never gathers (dead or busy).

    Before the fix rank 0 blocked inside NCCL's first-use connect, op lock held, where no
    watchdog reaches (the stand-in gave up after its bound). Now it agrees through the
    store first and ends with a timeout naming rank 1; NCCL never sees the gather.
    """
    r = ranks(2)
    r.clock.bound_s = 8.0
    r.run(functools.partial(_allreduce, x=[DeviceArray((4,), "float32") for _ in range(2)]))
    r.settle()
    r.clear()
    outs = [DeviceArray((4,), "float32") for _ in range(2)]
    options = GatherOptions(root_rank=0, timeout=timedelta(seconds=1))
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="rank 1") as info:
        r.run(lambda _, g: g.gather([outs], [DeviceArray((4,), "float32")], options), ranks=[0])
    assert time.monotonic() - start < 1 + SLACK_S
    assert info.value.op == "gather"
    assert not r.cupys[0].trace.named("recv", "groupStart"), "NCCL saw the gather"


def test_h3_a_first_collective_against_a_peers_send_fails_both_within_the_timeout(
    ranks: Callable[..., Ranks],
) -> None:
    """H3: on warm communicators rank 0 calls a new allreduce while rank 1 sends to it."""
    r = ranks(2)
    r.clock.bound_s = 8.0
    x = [DeviceArray((4,), "float32") for _ in range(2)]
    r.run(functools.partial(_allreduce, x=x))
    r.run(lambda rank, g: g.send([x[0]], _send(1)) if rank == 0 else g.recv([x[1]], _recv(0)))
    r.settle()
    one_s = timedelta(seconds=1)

    def differ(rank: int, g: Any) -> BaseException | None:
        try:
            if rank == 0:
                g.allreduce([DeviceArray((6,), "float32")], AllReduceOptions(timeout=one_s))
            else:
                g.send([x[1]], _send(0, one_s))
        except CollectiveError as exc:
            return exc
        return None

    start = time.monotonic()
    errors = r.run(differ)
    assert time.monotonic() - start < 1 + SLACK_S
    for error in errors:  # its own timeout, or the peer's, told through the store
        assert isinstance(error, CollectiveError) and "timed out" in str(error), error
    assert not r.misuse()


def _send(peer: int, timeout: timedelta | None = None) -> Any:
    from collective.types import SendOptions

    return SendOptions(dst_rank=peer, timeout=timeout)


def _recv(peer: int) -> Any:
    from collective.types import RecvOptions

    return RecvOptions(src_rank=peer)


def test_m2_ops_on_default_streams_of_a_gpu_that_is_not_current(
    ranks: Callable[..., Ranks], monkeypatch: pytest.MonkeyPatch
) -> None:
    """M2: stream 0 names the *current* device's legacy stream.

    A rank drives cuda:0 and cuda:1 on their default streams with cuda:0 current (as
    ``allreduce_multigpu`` on torch's default streams does), and two ranks allreduce on
    cuda:1's default stream. Before the fix the marker of cuda:1, and the check's copy
    and event, went to cuda:0's legacy stream: ``cudaErrorInvalidResourceHandle`` broke
    the group.
    """
    monkeypatch.setattr(cuda_buffers, "cupy_stream", lambda device: 0)
    r = ranks(1)
    pair = [DeviceArray((4,), "float32", 0), DeviceArray((4,), "float32", 1)]
    pair[0].host()[:] = 1
    pair[1].host()[:] = 2
    r.run(lambda _, g: g.allreduce(pair, AllReduceOptions()))
    for device in (0, 1):
        r.cupys[0].gpu.stream_synchronize(0, device)
    r.settle()
    assert r.groups[0].error is None, str(r.groups[0].error)
    assert [a.host().tolist() for a in pair] == [[3.0] * 4] * 2

    two = ranks(2)
    on_1 = [DeviceArray((4,), "float32", 1) for _ in range(2)]
    for rank, a in enumerate(on_1):
        a.host()[:] = rank + 1
    two.run(functools.partial(_allreduce, x=on_1, op=ReduceOp.MAX))
    for cupy in two.cupys:
        cupy.gpu.stream_synchronize(0, 1)
    two.settle()
    assert all(g.error is None for g in two.groups), [str(g.error) for g in two.groups]
    assert [a.host().tolist() for a in on_1] == [[2.0] * 4] * 2


def test_m4_a_stream_never_idle_for_longer_than_the_timeout_is_no_timeout(
    ranks: Callable[..., Ranks],
) -> None:
    """M4: 1.2 s of compute + allreduce with a 0.5 s timeout, the stream never idle.

    Each op finishes within 0.1 s, but before the fix one re-recorded event per stream
    read as unfinished all along and the group failed with a false timeout.
    """
    r = ranks(1)
    x = DeviceArray((4,), "float32")
    half = AllReduceOptions(timeout=timedelta(seconds=0.5))
    r.run(lambda _, g: g.allreduce([x], half))
    r.settle()
    gpu = r.cupys[0].gpu

    def busy(rank: int, g: Any) -> None:
        done: list[int] = []
        start = time.monotonic()
        while time.monotonic() - start < 1.2:
            if len(done) >= 2:  # keep two iterations queued: the stream never idles
                gpu.event_synchronize(done.pop(0))
            gpu.delay(caller_stream(0), 0.05)  # a 50 ms kernel of the caller's
            g.allreduce([x], half)
            event = gpu.create_event(0)
            gpu.record(event, caller_stream(0))
            done.append(event)

    r.run(busy)
    _sync(r)
    r.settle()
    assert r.groups[0].error is None, str(r.groups[0].error)


def test_l3_a_launch_evicted_while_its_check_is_queued_keeps_its_words(
    ranks: Callable[..., Ranks], monkeypatch: pytest.MonkeyPatch
) -> None:
    """L3: the check still queued reads the words of a launch the cache dropped.

    Before the fix the words went back to cupy's pool with the launch, while the
    check's allreduce on the op's stream had yet to read them.
    """
    monkeypatch.setattr("collective.groups.nccl.running.LAUNCHES_KEPT", 1)
    r = ranks(2)
    xs = [[DeviceArray((4,), "float32") for _ in range(2)] for _ in range(2)]
    for x in xs:
        r.run(functools.partial(_allreduce, x=x))
    r.settle()
    ys = [[DeviceArray((4,), "float32") for _ in range(2)] for _ in range(2)]
    holds = [c.gpu.hold(caller_stream(0), 0) for c in r.cupys]
    for hold in holds:
        hold.__enter__()
    try:
        for y in ys:  # each new address builds a launch; the second evicts the first
            r.run(functools.partial(_allreduce, x=y))
        gc.collect()
    finally:
        for hold in holds:
            hold.__exit__(None, None, None)
    _sync(r)
    r.settle()
    assert not r.misuse(), r.misuse()
    assert all(g.error is None for g in r.groups)
