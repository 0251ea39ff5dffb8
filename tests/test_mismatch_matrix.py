"""The mismatch matrix: every op, every field that can differ, every CPU transport, every role.

One rank of four (the odd rank) calls an op with one field changed (the op itself,
the root, the reduction, the dtype or the element count) while the other three call
it as written. Whatever the transport (shared memory on one node, Gloo, or two
nodes of two ranks: shared memory inside each, Gloo between the leaders) and
whichever rank is odd (a root, a node's leader or not), no rank may return as if
the op had happened: every rank raises in the op, and a rank that raises has none of
its buffers written. On shared memory alone, a bystander (a rank that agrees with
the ranks it reads from, such as a broadcast's reader when another reader is odd)
may finish the op it was called with and learns of the mismatch from the broken
group, at the latest in its next op.

The ranks run as processes, so that gloo aborting a process (its receive finding
more bytes than it posted) fails the test instead of killing pytest. Each process
makes a fresh group per case, since a mismatch breaks shared-memory groups.
"""

from __future__ import annotations

import multiprocessing
import queue
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch.distributed as dist

from collective.groups.base import BaseGroup
from collective.groups.cpu.group import CpuGroup
from collective.rendezvous.store import PrefixedRendezvousStore, TCPRendezvousStore
from collective.types import (
    AllGatherOptions,
    AllReduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    CpuTransport,
    GatherOptions,
    GroupOptions,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)
from tests.test_gloo_group import _master_store

WORLD = 4
GROUP_TIMEOUT = timedelta(seconds=10)
"""Timeout of the groups' ops: a rank left waiting fails well within a run."""
RUN_TIMEOUT_S = 240.0
"""Bound on one transport's run of every case; past it the test fails."""

TRANSPORTS: dict[str, tuple[list[str], CpuTransport]] = {
    "shared memory": (["a"] * WORLD, CpuTransport.AUTO),
    "gloo": (["a"] * WORLD, CpuTransport.GLOO),
    "two nodes": (["a", "a", "b", "b"], CpuTransport.AUTO),
}
"""Each transport: the node of each rank, and the group's ``cpu_transport``."""
ODD_RANKS = {"shared memory": [0, 3], "gloo": [0, 3], "two nodes": [0, 1, 2, 3]}
"""The ranks that take the odd call: a root (0) and a bystander; on two nodes, every role:
node a's leader (the root), a rank beside it, node b's leader, a rank beside that."""

Buffers = list[np.ndarray]
Call = Callable[[BaseGroup, int], Buffers]
"""Run one rank's side of an op on a group; return the buffers it may write."""


def _allreduce(dtype: str = "float32", count: int = 8, op: ReduceOp = ReduceOp.SUM) -> Call:
    def call(group: BaseGroup, rank: int) -> Buffers:
        x = np.full(count, rank + 1, dtype=dtype)
        group.allreduce([x], AllReduceOptions(op))
        return [x]

    return call


def _reduce(
    root: int = 0, dtype: str = "float32", count: int = 8, op: ReduceOp = ReduceOp.SUM
) -> Call:
    def call(group: BaseGroup, rank: int) -> Buffers:
        x = np.full(count, rank + 1, dtype=dtype)
        group.reduce([x], ReduceOptions(op, root_rank=root))
        return [x]

    return call


def _broadcast(root: int = 0, dtype: str = "float32", count: int = 8) -> Call:
    def call(group: BaseGroup, rank: int) -> Buffers:
        x = np.full(count, rank + 1, dtype=dtype)
        group.broadcast([x], BroadcastOptions(root_rank=root))
        return [x]

    return call


def _allgather(dtype: str = "float32", count: int = 8) -> Call:
    def call(group: BaseGroup, rank: int) -> Buffers:
        outputs = [np.zeros(count, dtype=dtype) for _ in range(WORLD)]
        group.allgather([outputs], [np.full(count, rank + 1, dtype=dtype)], AllGatherOptions())
        return outputs

    return call


def _reducescatter(dtype: str = "float32", count: int = 8, op: ReduceOp = ReduceOp.SUM) -> Call:
    def call(group: BaseGroup, rank: int) -> Buffers:
        out = np.zeros(count, dtype=dtype)
        inputs = [np.full(count, rank + 1, dtype=dtype) for _ in range(WORLD)]
        group.reducescatter([out], [inputs], ReduceScatterOptions(op))
        return [out, *inputs]

    return call


def _gather(root: int = 0, dtype: str = "float32", count: int = 8) -> Call:
    def call(group: BaseGroup, rank: int) -> Buffers:
        outputs = [np.zeros(count, dtype=dtype) for _ in range(WORLD)] if rank == root else []
        group.gather([outputs], [np.full(count, rank + 1, dtype=dtype)], GatherOptions(root))
        return outputs

    return call


def _scatter(root: int = 0, dtype: str = "float32", count: int = 8) -> Call:
    def call(group: BaseGroup, rank: int) -> Buffers:
        inputs = [np.full(count, j + 1, dtype=dtype) for j in range(WORLD)] if rank == root else []
        out = np.zeros(count, dtype=dtype)
        group.scatter([out], [inputs], ScatterOptions(root))
        return [out]

    return call


def _alltoall(dtype: str = "float32", count: int = 2) -> Call:
    """Send ``count`` elements to every rank; receive two from each."""

    def call(group: BaseGroup, rank: int) -> Buffers:
        inputs = [np.full(count, rank + 1, dtype=dtype) for _ in range(WORLD)]
        outputs = [np.zeros(2, dtype=dtype) for _ in range(WORLD)]
        group.alltoall(outputs, inputs, AllToAllOptions())
        return outputs

    return call


def _barrier(group: BaseGroup, rank: int) -> Buffers:
    group.barrier(BarrierOptions())
    return []


CASES: dict[str, tuple[Call, Call]] = {
    "allreduce: op (broadcast)": (_allreduce(), _broadcast()),
    "allreduce: reduce op (AVG)": (_allreduce(), _allreduce(op=ReduceOp.AVG)),
    "allreduce: reduce op (MAX)": (_allreduce(), _allreduce(op=ReduceOp.MAX)),
    "allreduce: dtype": (_allreduce(), _allreduce("float64")),
    "allreduce: elements": (_allreduce(), _allreduce(count=9)),
    "reduce: op (allreduce)": (_reduce(), _allreduce()),
    "reduce: root": (_reduce(), _reduce(root=1)),
    "reduce: root on the other node": (_reduce(), _reduce(root=3)),
    "reduce: reduce op (AVG)": (_reduce(), _reduce(op=ReduceOp.AVG)),
    "reduce: dtype": (_reduce(), _reduce(dtype="int32")),
    "reduce: elements": (_reduce(), _reduce(count=9)),
    "broadcast: op (reduce)": (_broadcast(), _reduce()),
    "broadcast: root": (_broadcast(), _broadcast(root=1)),
    "broadcast: root on the other node": (_broadcast(), _broadcast(root=2)),
    "broadcast: dtype": (_broadcast(), _broadcast(dtype="float64")),
    "broadcast: elements": (_broadcast(), _broadcast(count=9)),
    "allgather: op (allreduce)": (_allgather(), _allreduce()),
    "allgather: dtype": (_allgather(), _allgather("int32")),
    "allgather: elements": (_allgather(), _allgather(count=9)),
    "reducescatter: reduce op (MIN)": (_reducescatter(), _reducescatter(op=ReduceOp.MIN)),
    "reducescatter: dtype": (_reducescatter(), _reducescatter("float64")),
    "reducescatter: elements": (_reducescatter(), _reducescatter(count=9)),
    "barrier: op (allreduce)": (_barrier, _allreduce()),
    "gather: root": (_gather(), _gather(root=1)),
    "gather: dtype": (_gather(), _gather(dtype="float64")),
    "gather: elements": (_gather(), _gather(count=9)),
    "scatter: root": (_scatter(), _scatter(root=1)),
    "scatter: dtype": (_scatter(), _scatter(dtype="int32")),
    "scatter: elements": (_scatter(), _scatter(count=9)),
    "alltoall: dtype": (_alltoall(), _alltoall("float64")),
    "alltoall: elements": (_alltoall(), _alltoall(count=3)),
}
"""Each case: the call of the three agreeing ranks, and the odd rank's call."""

Outcome = dict[str, Any]


def _snapshot(buffers: Buffers) -> list[bytes]:
    return [b.tobytes() for b in buffers]


def _run_case(group: BaseGroup, rank: int, case: str, odd: int) -> Outcome:
    """Run ``case`` with ``odd`` taking the odd call, then a correct allreduce; say how each ended.

    The buffers' bytes are compared with what the call filled them with, so a
    write into them by the op (on any rank) shows.
    """
    usual, odd_call = CASES[case]
    written: list[np.ndarray] = []
    before: list[bytes] = []
    recorder: Any = _Recorder(group, written, before)
    outcome: Outcome = {"op": "", "next": "", "unchanged": True}
    try:
        (odd_call if rank == odd else usual)(recorder, rank)
    except Exception as exc:
        outcome["op"] = f"{type(exc).__name__}: {exc}"
    outcome["unchanged"] = _snapshot(written) == before
    try:
        group.allreduce([np.ones(4)], AllReduceOptions())
    except Exception as exc:
        outcome["next"] = f"{type(exc).__name__}: {exc}"
    return outcome


class _Recorder:
    """A group's stand-in that snapshots the buffers of each op before handing it on."""

    def __init__(self, group: BaseGroup, written: list[np.ndarray], before: list[bytes]) -> None:
        self._group, self._written, self._before = group, written, before

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._group, name)

        def record(*args: Any) -> Any:
            arrays = list(_arrays(args[:-1]))
            self._written.extend(arrays)
            self._before.extend(_snapshot(arrays))
            return method(*args)

        return record


def _arrays(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _arrays(item)


def _rank_main(
    rank: int, port: int, transport: str, jobs: list[tuple[str, int]], results: Any
) -> None:
    """Run each ``(case, odd rank)`` of ``jobs`` on a fresh group of this transport; report."""
    client = dist.TCPStore("127.0.0.1", port, None, False, GROUP_TIMEOUT)
    store = TCPRendezvousStore(client)
    nodes, cpu_transport = TRANSPORTS[transport]
    options = GroupOptions(cpu_transport=cpu_transport)
    for number, (case, odd) in enumerate(jobs):
        name = f"matrix-{number}"
        try:
            group = CpuGroup(
                WORLD,
                rank,
                name,
                PrefixedRendezvousStore(store, f"{name}/"),
                GROUP_TIMEOUT,
                options=options,
                node=nodes[rank],
            )
        except Exception as exc:
            results.put((rank, case, odd, {"op": f"init failed: {exc!r}", "next": "x"}))
            continue
        try:
            results.put((rank, case, odd, _run_case(group, rank, case, odd)))
        except Exception as exc:
            results.put((rank, case, odd, {"op": f"harness: {exc!r}", "next": "x"}))
        finally:
            group.destroy_group()


Outcomes = dict[tuple[str, int], list[Outcome | None]]


def _run(transport: str) -> tuple[Outcomes, list[int | None]]:
    """Run every case x odd rank on ``transport``, four processes; return outcomes, exit codes."""
    jobs = [(case, odd) for case in CASES for odd in ODD_RANKS[transport]]
    context = multiprocessing.get_context("spawn")
    master = _master_store()
    results = context.Queue()
    processes = [
        context.Process(target=_rank_main, args=(r, master.port, transport, jobs, results))
        for r in range(WORLD)
    ]
    for process in processes:
        process.start()
    outcomes: Outcomes = {job: [None] * WORLD for job in jobs}
    deadline = time.monotonic() + RUN_TIMEOUT_S
    left = WORLD * len(jobs)
    try:
        while left and time.monotonic() < deadline:
            try:
                rank, case, odd, outcome = results.get(timeout=0.5)
            except queue.Empty:
                if not any(p.is_alive() for p in processes):
                    break
                continue
            outcomes[(case, odd)][rank] = outcome
            left -= 1
    finally:
        for process in processes:
            process.join(max(1.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
    return outcomes, [p.exitcode for p in processes]


_RUNS: dict[str, tuple[Outcomes, list[int | None]]] = {}


def _outcomes(transport: str) -> tuple[Outcomes, list[int | None]]:
    if transport not in _RUNS:
        _RUNS[transport] = _run(transport)
    return _RUNS[transport]


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_every_mismatch_raises_on_every_rank_and_writes_nothing(transport: str) -> None:
    outcomes, exit_codes = _outcomes(transport)
    assert exit_codes == [0] * WORLD, f"a rank's process died: exit codes {exit_codes}"
    failures = []
    for (case, odd), ranks in outcomes.items():
        for rank, outcome in enumerate(ranks):
            where = f"{case}, rank {odd} odd: rank {rank}"
            if outcome is None:
                failures.append(f"{where} never reported")
                continue
            in_op = outcome["op"]
            if transport != "shared memory" and not in_op:
                failures.append(f"{where} returned from the op")
            elif not in_op and not outcome["next"]:
                failures.append(f"{where} returned from the op and the next one")
            if in_op and not outcome["unchanged"]:
                failures.append(f"{where} raised, but its buffers were written ({in_op})")
    assert not failures, "\n".join(failures)
