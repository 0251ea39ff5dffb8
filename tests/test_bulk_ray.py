"""The bulk calls through the public API in Ray actors, and the weight-sync example."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import collective as col
from tests.conftest import run_all, unique_name

ROOT = Path(__file__).resolve().parent.parent


def _init(rank: int, name: str, check_args: bool) -> None:
    col.init_collective_group(
        4, rank, backend="gloo", group_name=name, timeout=timedelta(seconds=30),
        check_args=check_args,
    )  # fmt: skip


def _state(rank: int) -> dict[str, Any]:
    fill = 3.0 if rank == 1 else 0.0
    return {
        "w": torch.full((64, 32), fill, dtype=torch.bfloat16),
        "b": torch.full((32,), fill),
        "big": torch.full((1 << 19,), fill),
        "steps": np.full((), int(fill), dtype=np.int64),
    }


def _sync(rank: int, name: str) -> dict[str, Any]:
    state = _state(rank)
    out = col.broadcast_state_dict(state, 1, name)
    fresh = col.broadcast_state_dict(state if rank == 1 else None, 1, name)
    grads = [torch.full((100,), float(rank + 1)), np.full((3, 3), rank + 1, np.int32).T]
    work = col.allreduce_tensors(grads, name, async_op=True)
    assert work is not None
    work.wait(timedelta(seconds=30))
    listed = [torch.full((5,), float(rank))]
    col.broadcast_tensors(listed, 3, name, bucket_bytes=8)
    return {
        "returned": out is state,
        "state": {k: float(torch.as_tensor(v).float().mean()) for k, v in state.items()},
        "fresh": None if fresh is None else sorted(fresh),
        "grads": [float(torch.as_tensor(g).float().mean()) for g in grads],
        "listed": listed[0].tolist(),
    }


@pytest.mark.parametrize("check_args", [False, True])
def test_the_public_calls_in_actors(members: list[Any], check_args: bool) -> None:
    name = unique_name("bulk")
    run_all(members, _init, range(4), [name] * 4, [check_args] * 4)
    try:
        results = run_all(members, _sync, range(4), [name] * 4)
    finally:
        run_all(members, col.destroy_collective_group, [name] * 4)
    for rank, r in enumerate(results):
        assert r["returned"] is (rank != 1)
        assert r["state"] == {"w": 3.0, "b": 3.0, "big": 3.0, "steps": 3.0}
        assert r["fresh"] == (None if rank == 1 else ["b", "big", "steps", "w"])
        assert r["grads"] == [10.0, 10.0]
        assert r["listed"] == [3.0] * 5


def _mismatch(rank: int, name: str) -> tuple[str, list[float]]:
    tensors = [torch.zeros(4), torch.zeros(3 if rank == 2 else 2)]
    try:
        col.broadcast_tensors(tensors, 0, name)
    except ValueError as error:
        return str(error), [float(t.sum()) for t in tensors]
    return "no error", []


def test_a_mismatch_raises_on_every_actor(members: list[Any]) -> None:
    name = unique_name("bulk")
    run_all(members, _init, range(4), [name] * 4, [False] * 4)
    try:
        results = run_all(members, _mismatch, range(4), [name] * 4)
    finally:
        run_all(members, col.destroy_collective_group, [name] * 4)
    assert len({message for message, _ in results}) == 1
    assert "tensors[1] is float32[3] on rank 2 but float32[2] on src_rank 0" in results[0][0]
    assert all(sums == [0.0, 0.0] for _, sums in results)


def test_weight_sync_example_runs() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "weight_sync.py")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "blocking: rollouts hold" in result.stdout
    assert "mismatch on every rank" in result.stdout
