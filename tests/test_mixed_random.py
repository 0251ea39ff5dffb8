"""Random programs mixing user send/recv with collectives match numpy on every rank.

Ranks are threads on a TCPStore (see ``test_shm.run_cpu``), on one node, on two
faked nodes (the hierarchical path), with small slots so that long messages stream,
and on plain Gloo. The programs are extended ones: async alltoalls of non-contiguous
inputs and bool reductions above the small-message limit among the rest. The same
programs, without those (and the public call path's buffer forms and timeouts, see
``mixed_program``), run across two real Ray nodes in
``test_cluster_correctness_ray``.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import numpy as np
import pytest

from collective.groups.base import BaseGroup
from collective.ops import calls
from collective.types import (
    AllGatherOptions,
    AllReduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    RecvOptions,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
    SendOptions,
)
from tests import mixed_program
from tests.test_gloo_group import run_ranks
from tests.test_shm import run_cpu

SEEDS = int(os.environ.get("MIXED_SEEDS", "6"))


class GroupOps:
    """A program's calls on a CPU group."""

    def __init__(self, group: BaseGroup) -> None:
        self.group = group

    def allreduce(self, x: np.ndarray, op: ReduceOp) -> None:
        self.group.allreduce([x], AllReduceOptions(op))

    def reduce(self, x: np.ndarray, root: int, op: ReduceOp) -> None:
        self.group.reduce([x], ReduceOptions(op, root_rank=root))

    def broadcast(self, x: np.ndarray, root: int) -> None:
        self.group.broadcast([x], BroadcastOptions(root_rank=root))

    def allgather(self, outs: list[np.ndarray], x: np.ndarray) -> None:
        self.group.allgather([outs], [x], AllGatherOptions())

    def reducescatter(self, out: np.ndarray, ins: list[np.ndarray], op: ReduceOp) -> None:
        self.group.reducescatter([out], [ins], ReduceScatterOptions(op))

    def barrier(self) -> None:
        self.group.barrier(BarrierOptions())

    def send(self, x: np.ndarray, dst: int) -> Any:
        return self.group.send([x], SendOptions(dst, async_op=True))

    def recv(self, x: np.ndarray, src: int) -> None:
        self.group.recv([x], RecvOptions(src))

    def alltoall(self, outs: list[np.ndarray], ins: list[np.ndarray]) -> Any:
        return self.group.alltoall(outs, ins, AllToAllOptions(async_op=True))

    def one(self, kind: str, x: Any, root: int, op: ReduceOp, timeout: timedelta | None) -> None:
        call = calls.ONE_BUFFER[kind]
        reduce_op = op if call.reduces else None
        calls.call(call, self.group, x, reduce_op, root if call.root_name else -1, timeout, False)


@pytest.mark.parametrize(
    ("world_size", "nodes"),
    [
        (2, None),
        (4, None),
        (4, ["a", "a", "b", "b"]),
        (3, ["a", "b", "a"]),
        (2, "gloo"),
        (3, "gloo"),
    ],
    ids=["2 ranks", "4 ranks", "2 nodes of 2", "2 nodes of 2 and 1", "gloo 2", "gloo 3"],
)
@pytest.mark.parametrize("seed", range(SEEDS))
def test_a_random_mixed_program_matches_numpy(
    seed: int, world_size: int, nodes: list[str] | str | None
) -> None:
    program = mixed_program.make(seed, world_size, extended=True)

    def fn(group: BaseGroup, rank: int) -> dict[int, Any]:
        return mixed_program.run(GroupOps(group), rank, world_size, program)

    if isinstance(nodes, str):
        results = run_ranks(world_size, fn)
    else:
        results = run_cpu(world_size, fn, nodes=nodes, slot_bytes=1024)
    mixed_program.check(program, results, world_size)
