"""The NCCL stand-in runs on the device clock: data moves, ops wait for peers, checks read late.

Ranks are threads on ``ContractCupy`` over one ``DeviceClock`` (see ``tests/nccl_threads.py``):
what a blocking op returns is queued, not done; a collective completes only once every
rank's stream reaches it; the mismatch check finds a mismatch from the bytes the
stand-in's NCCL reduced, with no test playing NCCL.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from collective.types import (
    AllGatherOptions,
    AllReduceOptions,
    BroadcastOptions,
    CollectiveError,
    RecvOptions,
    ReduceOp,
    ReduceScatterOptions,
    SendOptions,
)
from tests.device_clock import NOT_READY
from tests.nccl_binding import DeviceArray, chunks
from tests.nccl_threads import CONTRACT, Ranks, caller_stream, ranks_fixture

pytestmark = CONTRACT
__all__ = ["ranks_fixture"]  # the fixture ``ranks``


def _allreduce(rank: int, g: Any, x: DeviceArray) -> None:
    g.allreduce([x], AllReduceOptions())


def _sync(r: Ranks) -> None:
    for cupy in r.cupys:
        cupy.gpu.stream_synchronize(caller_stream(0), 0)


def test_collectives_move_every_ranks_data(ranks: Callable[..., Ranks]) -> None:
    r = ranks(3)
    xs = [DeviceArray((4,), "float32") for _ in range(3)]
    for rank, x in enumerate(xs):
        x.host()[:] = np.arange(4) + 10 * rank
    r.run(lambda rank, g: g.allreduce([xs[rank]], AllReduceOptions(ReduceOp.SUM)))
    _sync(r)
    for x in xs:
        assert x.host().tolist() == [30, 33, 36, 39]
    r.run(lambda rank, g: g.broadcast([xs[rank]], BroadcastOptions(root_rank=1)))
    outs = [chunks(3, (4,), "float32") for _ in range(3)]
    r.run(lambda rank, g: g.allgather([outs[rank]], [xs[rank]], AllGatherOptions()))
    mins = [DeviceArray((4,), "float32") for _ in range(3)]
    r.run(lambda rank, g: g.reducescatter([mins[rank]], [outs[rank]], ReduceScatterOptions()))
    _sync(r)
    for rank in range(3):
        assert [o.host().tolist() for o in outs[rank]] == [[30, 33, 36, 39]] * 3
        assert mins[rank].host().tolist() == [90, 99, 108, 117]


def test_a_blocking_op_is_queued_until_every_peer_reaches_it(ranks: Callable[..., Ranks]) -> None:
    r = ranks(2)
    x = [DeviceArray((4,), "int64") for _ in range(2)]
    r.run(lambda rank, g: g.allreduce([x[rank]], AllReduceOptions()))  # connects
    _sync(r)
    x[0].host()[:] = 1
    x[1].host()[:] = 2
    with r.cupys[1].gpu.hold(caller_stream(0), 0):
        r.run(lambda rank, g: g.allreduce([x[rank]], AllReduceOptions()))
        assert r.cupys[0].gpu.stream_query(caller_stream(0), 0) == NOT_READY
        assert x[0].host().tolist() == [1] * 4, "rank 0's op waits for rank 1's stream"
    _sync(r)
    assert x[0].host().tolist() == x[1].host().tolist() == [3] * 4


def test_send_and_recv_pair_up_in_order(ranks: Callable[..., Ranks]) -> None:
    r = ranks(2)
    a, b = DeviceArray((3,), "int32"), DeviceArray((3,), "int32")
    got = [DeviceArray((3,), "int32"), DeviceArray((3,), "int32")]
    a.host()[:] = [1, 2, 3]
    b.host()[:] = [4, 5, 6]

    def pair(rank: int, g: object) -> None:
        if rank == 0:
            g.send([a], SendOptions(dst_rank=1))  # type: ignore[attr-defined]
            g.send([b], SendOptions(dst_rank=1))  # type: ignore[attr-defined]
        else:
            for out in got:
                g.recv([out], RecvOptions(src_rank=0))  # type: ignore[attr-defined]

    r.run(pair)
    _sync(r)
    assert [o.host().tolist() for o in got] == [[1, 2, 3], [4, 5, 6]]


def test_the_check_finds_a_mismatch_from_what_nccl_reduced(ranks: Callable[..., Ranks]) -> None:
    r = ranks(2)
    xs = [DeviceArray((4, 8), "float32"), DeviceArray((4, 9), "float32")]
    for x in xs:  # both kinds are known on both ranks: no first-use agreement is needed
        r.run(functools.partial(_allreduce, x=x))
    r.settle()
    r.run(lambda rank, g: g.allreduce([xs[rank]], AllReduceOptions()))  # the op itself hangs
    deadline = time.monotonic() + 10
    while any(g.error is None for g in r.groups) and time.monotonic() < deadline:
        time.sleep(0.01)
    for group in r.groups:
        assert group.error is not None and "shape: differs" in str(group.error)
    with pytest.raises(CollectiveError, match="called different ops"):
        r.run(lambda rank, g: g.allreduce([xs[rank]], AllReduceOptions()), ranks=[0])
