"""Ranks that disagree over Gloo, without check_args: every rank raises, nothing is written.

gloo itself aborts the process when a rank receives more bytes than it posted, and
mixes data without an error when dtypes or reductions differ. The ranks here run
as processes, so that such an abort fails the test instead of killing pytest. Each
rank runs every case in turn on one group and reports, per case, its error, whether
its buffers are unchanged, and the result of a correct allreduce run after it.
"""

from __future__ import annotations

import multiprocessing
import queue
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch.distributed as dist

from collective.groups.base import BaseGroup
from collective.groups.cpu.group import CpuGroup
from collective.groups.gloo.group import GlooGroup
from collective.rendezvous.store import TCPRendezvousStore
from collective.types import (
    AllGatherOptions,
    AllReduceOptions,
    AllToAllOptions,
    BroadcastOptions,
    GatherOptions,
    RecvOptions,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
    SendOptions,
)
from tests.test_gloo_group import _master_store

GROUP_TIMEOUT = timedelta(seconds=10)
"""Timeout of the groups' ops: a rank left waiting fails well within a run."""

RUN_TIMEOUT_S = 120.0
"""Bound on one run of the processes; past it the test fails."""

Outcome = dict[str, Any]


def _outcome(group: BaseGroup, rank: int, buffers: list[Any], call: Callable[[], Any]) -> Outcome:
    """Run ``call``; return its error, whether ``buffers`` kept their bytes, and a check-up sum."""
    before = [_raw(b) for b in buffers]
    error, message = "", ""
    try:
        call()
    except Exception as exc:
        error, message = type(exc).__name__, str(exc)
    unchanged = [_raw(b) for b in buffers] == before
    after = np.full(4, rank + 1.0)
    group.allreduce([after], AllReduceOptions())
    return {"error": error, "message": message, "unchanged": unchanged, "after": after.tolist()}


def _raw(x: Any) -> bytes:
    return bytes(x.tobytes()) if isinstance(x, np.ndarray) else bytes(x.numpy().tobytes())


def _allreduce(dtypes: tuple[str, str], sizes: tuple[int, int] = (8, 8), ops: Any = None) -> Any:
    ops = ops or (ReduceOp.SUM, ReduceOp.SUM)

    def case(group: BaseGroup, rank: int) -> Outcome:
        x = np.full(sizes[rank], rank + 1, dtype=dtypes[rank])
        call = lambda: group.allreduce([x], AllReduceOptions(ops[rank]))  # noqa: E731
        return _outcome(group, rank, [x], call)

    return case


def _broadcast_roots(group: BaseGroup, rank: int) -> Outcome:
    x = np.full(8, rank + 1.0, dtype=np.float32)
    call = lambda: group.broadcast([x], BroadcastOptions(root_rank=rank))  # noqa: E731
    return _outcome(group, rank, [x], call)


def _allreduce_against_broadcast(group: BaseGroup, rank: int) -> Outcome:
    x = np.full(8, rank + 1.0, dtype=np.float32)
    if rank == 0:
        return _outcome(group, rank, [x], lambda: group.allreduce([x], AllReduceOptions()))
    return _outcome(group, rank, [x], lambda: group.broadcast([x], BroadcastOptions(root_rank=1)))


def _reduce_roots(group: BaseGroup, rank: int) -> Outcome:
    x = np.full(8, rank + 1.0, dtype=np.float32)
    call = lambda: group.reduce([x], ReduceOptions(root_rank=rank))  # noqa: E731
    return _outcome(group, rank, [x], call)


def _allgather_sizes(group: BaseGroup, rank: int) -> Outcome:
    x = np.ones(1000 - rank, dtype=np.float32)
    outputs = [np.zeros(1000 - rank, dtype=np.float32) for _ in range(2)]
    call = lambda: group.allgather([outputs], [x], AllGatherOptions())  # noqa: E731
    return _outcome(group, rank, outputs, call)


def _reducescatter_dtypes(group: BaseGroup, rank: int) -> Outcome:
    dtype = np.float32 if rank == 0 else np.int32
    out = np.zeros(4, dtype=dtype)
    chunks = [np.ones(4, dtype=dtype) for _ in range(2)]
    call = lambda: group.reducescatter([out], [chunks], ReduceScatterOptions())  # noqa: E731
    return _outcome(group, rank, [out, *chunks], call)


def _gather_sizes(group: BaseGroup, rank: int) -> Outcome:
    x = np.ones(8 + rank, dtype=np.float32)
    outputs = [np.zeros(8, dtype=np.float32) for _ in range(2)] if rank == 0 else []
    call = lambda: group.gather([outputs], [x], GatherOptions(root_rank=0))  # noqa: E731
    return _outcome(group, rank, outputs, call)


def _alltoall_splits(group: BaseGroup, rank: int) -> Outcome:
    """Rank 0 sends rank 1 three elements; rank 1 expects two."""
    inputs = [np.full(2 + (rank == 0 and j == 1), rank + 1.0, np.float32) for j in range(2)]
    outputs = [np.zeros(2, dtype=np.float32) for _ in range(2)]
    call = lambda: group.alltoall(outputs, inputs, AllToAllOptions())  # noqa: E731
    return _outcome(group, rank, outputs, call)


def _p2p(sent: str, received: str) -> Any:
    """Send ``sent``[8] from rank 0 into rank 1's ``received``[8], then a matching pair."""

    def case(group: BaseGroup, rank: int) -> Outcome:
        if rank == 0:
            x = np.arange(8, dtype=sent)
            outcome = _outcome(group, rank, [x], lambda: group.send([x], SendOptions(1)))
            group.send([np.full(3, 7.0)], SendOptions(1))
            return outcome
        y = np.full(8, -1, dtype=received)
        outcome = _outcome(group, rank, [y], lambda: group.recv([y], RecvOptions(0)))
        follow = np.zeros(3)
        group.recv([follow], RecvOptions(0))
        return {**outcome, "follow": follow.tolist()}

    return case


CASES: dict[str, tuple[Callable[[BaseGroup, int], Outcome], list[str]]] = {
    "float32 vs float64": (
        _allreduce(("float32", "float64")),
        ["dtype: float32 on rank 0, float64 on rank 1"],
    ),
    "8 vs 9 elements": (_allreduce(("float32", "float32"), (8, 9)), ["elements: 8 on rank 0, 9"]),
    "float32 vs int32": (_allreduce(("float32", "int32")), ["dtype: float32 on rank 0, int32"]),
    "SUM vs MAX": (
        _allreduce(("float32", "float32"), ops=(ReduceOp.SUM, ReduceOp.MAX)),
        ["reduce op: SUM on rank 0, MAX on rank 1"],
    ),
    "broadcast root 0 vs 1": (_broadcast_roots, ["root: 0 on rank 0, 1 on rank 1"]),
    "reduce root 0 vs 1": (_reduce_roots, ["root: 0 on rank 0, 1 on rank 1"]),
    "allreduce vs broadcast": (
        _allreduce_against_broadcast,
        ["op: allreduce on rank 0, broadcast on rank 1"],
    ),
    "allgather 1000 vs 999": (_allgather_sizes, ["elements: 1000 on rank 0, 999 on rank 1"]),
    "reducescatter float32 vs int32": (_reducescatter_dtypes, ["dtype: float32 on rank 0"]),
    "gather 8 vs 9": (_gather_sizes, ["elements: 8 on rank 0, 9 on rank 1"]),
    "alltoall splits": (
        _alltoall_splits,
        ["rank 1 expects 2 elements from rank 0, which sends it 3"],
    ),
}
"""Collectives whose ranks disagree, and what every rank's error must say."""

P2P_CASES: dict[str, tuple[Callable[[BaseGroup, int], Outcome], str]] = {
    "send float32[8] into float64[8]": (_p2p("float32", "float64"), "float32[8]"),
    "send float64[8] into float32[8]": (_p2p("float64", "float32"), "float64[8]"),
}
"""A send and a recv that disagree, and the sent buffer the receiver's error names."""


# --- ranks as processes ---------------------------------------------------------------------


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    name: str,
    nodes: list[str] | None,
    cases: list[str],
    results: Any,
) -> None:
    """Build this rank's group, run ``cases`` on it in turn, and report each outcome."""
    client = dist.TCPStore("127.0.0.1", port, None, False, GROUP_TIMEOUT)
    store = TCPRendezvousStore(client)
    if nodes is None:
        group: BaseGroup = GlooGroup(world_size, rank, name, store, GROUP_TIMEOUT)
    else:
        group = CpuGroup(world_size, rank, name, store, GROUP_TIMEOUT, node=nodes[rank])
    try:
        for case in cases:
            try:
                results.put((rank, case, RUNNERS[case](group, rank)))
            except Exception as exc:
                results.put((rank, case, {"error": type(exc).__name__, "message": str(exc)}))
    finally:
        group.destroy_group()


def run_processes(
    world_size: int, cases: list[str], nodes: list[str] | None = None
) -> tuple[dict[str, list[Outcome | None]], list[int | None]]:
    """Run ``cases`` on a fresh group of ``world_size`` processes; return outcomes and exit codes.

    ``outcomes[case][rank]`` is None where that rank never reported the case (it died).
    """
    context = multiprocessing.get_context("spawn")
    master = _master_store()
    results = context.Queue()
    name = f"mismatch-{uuid.uuid4().hex[:8]}"
    processes = [
        context.Process(
            target=_rank_main, args=(r, world_size, master.port, name, nodes, cases, results)
        )
        for r in range(world_size)
    ]
    for process in processes:
        process.start()
    outcomes: dict[str, list[Outcome | None]] = {c: [None] * world_size for c in cases}
    deadline = time.monotonic() + RUN_TIMEOUT_S
    left = world_size * len(cases)
    try:
        while left and time.monotonic() < deadline:
            try:
                rank, case, outcome = results.get(timeout=0.5)
            except queue.Empty:
                if not any(p.is_alive() for p in processes):
                    break
                continue
            outcomes[case][rank] = outcome
            left -= 1
    finally:
        for process in processes:
            process.join(max(1.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
    return outcomes, [p.exitcode for p in processes]


@pytest.fixture(scope="module")
def gloo_run() -> tuple[dict[str, list[Outcome | None]], list[int | None]]:
    """Run every case once, in order, on one forced-Gloo group of two processes."""
    return run_processes(2, [*CASES, *P2P_CASES])


@pytest.mark.parametrize("case", list(CASES))
def test_a_mismatch_raises_on_every_rank_and_writes_nothing(
    case: str, gloo_run: tuple[dict[str, list[Outcome | None]], list[int | None]]
) -> None:
    outcomes, exit_codes = gloo_run
    expected = CASES[case][1]
    assert exit_codes == [0, 0], f"a rank's process died: exit codes {exit_codes}"
    for rank, outcome in enumerate(outcomes[case]):
        assert outcome is not None, f"rank {rank} never reported {case!r}"
        assert outcome["error"] == "ArgumentValueError", (rank, outcome)
        assert "different arguments" in outcome["message"], outcome
        for part in expected:
            assert part in outcome["message"], (rank, part, outcome["message"])
        assert outcome["unchanged"], f"rank {rank}'s buffers were written"
        assert outcome["after"] == [3.0] * 4, "the group no longer reduces correctly"
    details = {o["message"].split(": ", 1)[1] for o in outcomes[case] if o is not None}
    assert len(details) == 1, details


@pytest.mark.parametrize("case", list(P2P_CASES))
def test_a_recv_unlike_its_send_raises_and_writes_nothing(
    case: str, gloo_run: tuple[dict[str, list[Outcome | None]], list[int | None]]
) -> None:
    outcomes, exit_codes = gloo_run
    assert exit_codes == [0, 0], f"a rank's process died: exit codes {exit_codes}"
    sender, receiver = outcomes[case]
    assert sender is not None and receiver is not None, outcomes[case]
    assert sender["error"] == "", sender
    assert receiver["error"] == "ArgumentValueError", receiver
    assert f"rank 0 sent {P2P_CASES[case][1]}" in receiver["message"], receiver
    assert receiver["unchanged"], "the receiver's buffer was written"
    assert receiver["follow"] == [7.0] * 3, "the next message of the pair was not its own"
    assert sender["after"] == receiver["after"] == [3.0] * 4


# --- the hierarchical path: Gloo among the nodes' leaders ----------------------------------


def _nodes_disagree(group: BaseGroup, rank: int) -> Outcome:
    """Ranks of node a pass float32[8], ranks of node b float64[8]; each node agrees inside."""
    x = np.full(8, rank + 1, dtype=np.float32 if rank < 2 else np.float64)
    before = _raw(x)
    try:
        group.allreduce([x], AllReduceOptions())
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc), "unchanged": _raw(x) == before}
    return {"error": "", "message": "", "unchanged": _raw(x) == before, "value": x.tolist()}


def _nodes_gather_disagree(group: BaseGroup, rank: int) -> Outcome:
    """Gather goes over the Gloo group of all ranks: a mismatch there keeps the group."""
    x = np.ones(8 if rank < 3 else 9, dtype=np.float32)
    outputs = [np.zeros(8, dtype=np.float32) for _ in range(4)] if rank == 0 else []
    call = lambda: group.gather([outputs], [x], GatherOptions(root_rank=0))  # noqa: E731
    outcome = _outcome(group, rank, outputs, call)
    return {**outcome, "after": outcome["after"][:1]}


RUNNERS: dict[str, Callable[[BaseGroup, int], Outcome]] = {
    **{name: case for name, (case, _) in CASES.items()},
    **{name: case for name, (case, _) in P2P_CASES.items()},
    "across nodes: gather": _nodes_gather_disagree,
    "across nodes: allreduce": _nodes_disagree,
}
"""Every case by name, as the rank processes look them up."""


@pytest.fixture(scope="module")
def across_nodes() -> tuple[dict[str, list[Outcome | None]], list[int | None]]:
    """Run the cross-node cases on one group of four processes, two per faked node."""
    cases = ["across nodes: gather", "across nodes: allreduce"]
    return run_processes(4, cases, ["a", "a", "b", "b"])


def test_nodes_that_disagree_raise_on_every_rank_and_no_process_dies(
    across_nodes: tuple[dict[str, list[Outcome | None]], list[int | None]],
) -> None:
    outcomes, exit_codes = across_nodes
    assert exit_codes == [0] * 4, f"a rank's process died: exit codes {exit_codes}"
    gathered = outcomes["across nodes: gather"]
    for rank, outcome in enumerate(gathered):
        assert outcome is not None and outcome["error"] == "ArgumentValueError", (rank, outcome)
        assert "elements: 8 on ranks [0, 1, 2], 9 on rank 3" in outcome["message"], outcome
        assert outcome["unchanged"] and outcome["after"] == [10.0], outcome
    reduced = outcomes["across nodes: allreduce"]
    for rank, outcome in enumerate(reduced):
        assert outcome is not None and outcome["error"], (rank, outcome)
        assert outcome["unchanged"], f"rank {rank}'s buffer was written"
    for leader in (0, 2):
        message = reduced[leader]["message"]  # type: ignore[index]
        assert "dtype: float32 on rank 0, float64 on rank 1" in message, message
        assert "the nodes' leaders, ranks [0, 2]" in message, message
