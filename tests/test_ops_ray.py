"""The op matrix through the public API in real Ray actors: world sizes 1, 2 and 4.

Every op x every gloo dtype x every ReduceOp x numpy and torch runs inside one remote
call per actor per world size; the results come back as plain arrays and every rank's
result is checked on the driver against a numpy reference.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch

import collective as col
from tests.conftest import run_all, unique_name

pytestmark = pytest.mark.usefixtures("no_leaks")

LENGTH = 16
"""Elements per test buffer; 16 covers every bool pattern across four ranks."""

DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool")
KINDS = ("numpy", "torch")
OPS = (col.ReduceOp.SUM, col.ReduceOp.PRODUCT, col.ReduceOp.MIN, col.ReduceOp.MAX)
SHAPE_3D = (2, 3, 4)


def _combos() -> list[tuple[str, str]]:
    """Return every (kind, dtype) pair; numpy has no bfloat16."""
    return [(k, d) for k in KINDS for d in DTYPES if not (k == "numpy" and d == "bfloat16")]


def _values(dtype: str, rank: int, salt: int = 0) -> np.ndarray:
    """Return rank's small integer (or bool) input; exact in every dtype, never overflows.

    Signed and float dtypes get values in [-2, 2] (product of four ranks: at most 16),
    uint8 gets [0, 2], bool gets bit ``rank`` of ``i``: every all-true, all-false and
    mixed column appears.
    """
    i = np.arange(LENGTH)
    if dtype == "bool":
        return (((i + 5 * salt) % LENGTH) >> rank) & 1 == 1
    if dtype == "uint8":
        return (i + 2 * rank + salt) % 3
    return (i + 2 * rank + 3 * salt) % 5 - 2


def _make(kind: str, dtype: str, values: Any) -> Any:
    """Build a fresh buffer of ``kind`` and ``dtype`` holding ``values``."""
    array = np.asarray(values)
    if kind == "numpy":
        return array.astype(dtype)
    source = array.astype(bool) if dtype == "bool" else array.astype(np.int64)
    return torch.from_numpy(source.copy()).to(getattr(torch, dtype))


def _export(x: Any) -> tuple[np.ndarray, bytes]:
    """Return a picklable copy of ``x`` (bfloat16 as float32, exact here) and its raw bytes."""
    if isinstance(x, torch.Tensor):
        raw = x.contiguous().view(torch.uint8).numpy().tobytes()
        array = x.float().numpy() if x.dtype == torch.bfloat16 else x.numpy()
        return array.copy(), raw
    return x.copy(), x.tobytes()


def _reference(op: col.ReduceOp, dtype: str, inputs: list[np.ndarray]) -> np.ndarray:
    """Reduce ``inputs`` with numpy; bool SUM/MAX is logical or, PRODUCT/MIN logical and."""
    stack = np.stack(inputs)
    if dtype == "bool":
        either = op in (col.ReduceOp.SUM, col.ReduceOp.MAX)
        return np.asarray(stack.any(0) if either else stack.all(0))
    reducers: dict[col.ReduceOp, Callable[..., np.ndarray]] = {
        col.ReduceOp.SUM: np.sum,
        col.ReduceOp.PRODUCT: np.prod,
        col.ReduceOp.MIN: np.min,
        col.ReduceOp.MAX: np.max,
    }
    return reducers[op](stack, axis=0)


def _expect(kind: str, dtype: str, values: Any) -> np.ndarray:
    """Return what ``_export`` gives for a buffer of ``kind``/``dtype`` holding ``values``."""
    return _export(_make(kind, dtype, values))[0]


def _assert_same(got: np.ndarray, expected: np.ndarray, where: str) -> None:
    assert got.dtype == expected.dtype, f"{where}: dtype {got.dtype} != {expected.dtype}"
    assert got.shape == expected.shape, f"{where}: shape {got.shape} != {expected.shape}"
    np.testing.assert_array_equal(got, expected, err_msg=where)


def _p2p_pairs(n: int) -> list[tuple[int, int]]:
    """Every ordered (src, dst) pair; all ranks walk them in the same order."""
    return [(s, d) for s in range(n) for d in range(n) if s != d]


def _matrix_in_actor(rank: int, n: int, name: str) -> dict[Any, Any]:
    """Run every op on every dtype, op and kind in group ``name``; return what each produced."""
    col.init_collective_group(n, rank, backend="gloo", group_name=name)
    res: dict[Any, Any] = {}
    try:
        res["identity"] = (col.get_rank(name), col.get_collective_group_size(name))
        for kind, dtype in _combos():

            def make(values: Any, kind: str = kind, dtype: str = dtype) -> Any:
                return _make(kind, dtype, values)

            zeros = np.zeros(LENGTH, dtype=np.int64)
            for op in OPS:
                x = make(_values(dtype, rank))
                col.allreduce(x, name, op=op)
                res["allreduce", kind, dtype, op.name] = _export(x)
                for dst in range(n):
                    x = make(_values(dtype, rank))
                    col.reduce(x, dst_rank=dst, group_name=name, op=op)
                    res["reduce", kind, dtype, op.name, dst] = _export(x)
                out = make(zeros)
                inputs = [make(_values(dtype, rank, salt=j)) for j in range(n)]
                col.reducescatter(out, inputs, name, op=op)
                res["reducescatter", kind, dtype, op.name] = _export(out)
                res["reducescatter_inputs", kind, dtype, op.name] = [_export(t) for t in inputs]
            for src in range(n):
                x = make(_values(dtype, rank))
                col.broadcast(x, src_rank=src, group_name=name)
                res["broadcast", kind, dtype, src] = _export(x)
            parts = [make(zeros) for _ in range(n)]
            x = make(_values(dtype, rank))
            col.allgather(parts, x, name)
            res["allgather", kind, dtype] = [_export(p) for p in parts]
            res["allgather_input", kind, dtype] = _export(x)
            for src, dst in _p2p_pairs(n):
                if rank == src:
                    x = make(_values(dtype, src, salt=dst + 1))
                    col.send(x, dst_rank=dst, group_name=name)
                    res["send", kind, dtype, src, dst] = _export(x)
                elif rank == dst:
                    x = make(zeros)
                    col.recv(x, src_rank=src, group_name=name)
                    res["recv", kind, dtype, src, dst] = _export(x)
        time.sleep(0.2 * rank)
        arrived = time.time()
        col.barrier(name)
        res["barrier"] = (arrived, time.time())
        col.barrier(group_name=name, timeout=timedelta(seconds=20))
        res.update(_shaped_ops(rank, n, name))
    finally:
        col.destroy_collective_group(name)
    res["after_destroy"] = (col.is_group_initialized(name), col.get_rank(name))
    return res


def _base_3d(rank: int, salt: int = 0) -> np.ndarray:
    return (np.arange(24).reshape(SHAPE_3D) + 3 * salt) % 7 + rank


def _shaped_ops(rank: int, n: int, name: str) -> dict[Any, Any]:
    """Run the ops on 3-D buffers, contiguous and not, as torch float32 and numpy int32."""
    res: dict[Any, Any] = {}
    for kind, dtype in (("torch", "float32"), ("numpy", "int32")):
        x = _make(kind, dtype, _base_3d(rank))
        col.allreduce(x, name)
        res["3d_allreduce", kind] = _export(x)
        x = _make(kind, dtype, _base_3d(rank))
        col.broadcast(x, src_rank=n - 1, group_name=name)
        res["3d_broadcast", kind] = _export(x)
        x = _make(kind, dtype, _base_3d(rank))
        col.reduce(x, dst_rank=0, group_name=name, op=col.ReduceOp.MAX)
        res["3d_reduce", kind] = _export(x)
        parts = [_make(kind, dtype, np.zeros(SHAPE_3D)) for _ in range(n)]
        col.allgather(parts, _make(kind, dtype, _base_3d(rank)), name)
        res["3d_allgather", kind] = [_export(p) for p in parts]
        out = _make(kind, dtype, np.zeros(SHAPE_3D))
        inputs = [_make(kind, dtype, _base_3d(rank, salt=j)) for j in range(n)]
        col.reducescatter(out, inputs, name)
        res["3d_reducescatter", kind] = _export(out)
    # Non-contiguous buffers: a transposed torch view and a strided numpy view.
    t = torch.from_numpy(_base_3d(rank).astype(np.float32).transpose(2, 1, 0).copy())
    view = t.transpose(0, 2)
    assert not view.is_contiguous()
    col.allreduce(view, name)
    res["3d_noncontiguous", "torch"] = _export(view)
    parent = np.full((2, 3, 8), -1, dtype=np.int32)
    strided = parent[:, :, ::2]
    strided[...] = _base_3d(rank)
    col.allreduce(strided, name)
    res["3d_noncontiguous", "numpy"] = _export(strided)
    res["3d_noncontiguous_gaps"] = parent[:, :, 1::2].copy()
    return res


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda n: f"ws{n}")
def matrix(request: pytest.FixtureRequest, members: list) -> tuple[int, list[dict]]:
    """Run the whole matrix once per world size; return it and every rank's results."""
    n = request.param
    name = unique_name(f"ops{n}")
    results = run_all(members[:n], _matrix_in_actor, list(range(n)), [n] * n, [name] * n)
    return n, results


def test_group_identity_and_destroy(matrix: tuple[int, list[dict]]) -> None:
    n, results = matrix
    for rank, res in enumerate(results):
        assert res["identity"] == (rank, n)
        assert res["after_destroy"] == (False, -1)


def test_allreduce_every_dtype_op_and_kind(matrix: tuple[int, list[dict]]) -> None:
    n, results = matrix
    for kind, dtype in _combos():
        inputs = [_values(dtype, q) for q in range(n)]
        for op in OPS:
            expected = _expect(kind, dtype, _reference(op, dtype, inputs))
            for rank, res in enumerate(results):
                got, _ = res["allreduce", kind, dtype, op.name]
                _assert_same(got, expected, f"allreduce {kind} {dtype} {op.name} rank {rank}")


def test_reduce_writes_only_dst(matrix: tuple[int, list[dict]]) -> None:
    n, results = matrix
    for kind, dtype in _combos():
        inputs = [_values(dtype, q) for q in range(n)]
        for op in OPS:
            expected = _expect(kind, dtype, _reference(op, dtype, inputs))
            for dst in range(n):
                for rank, res in enumerate(results):
                    got, raw = res["reduce", kind, dtype, op.name, dst]
                    where = f"reduce {kind} {dtype} {op.name} dst {dst} rank {rank}"
                    if rank == dst:
                        _assert_same(got, expected, where)
                    else:
                        assert raw == _export(_make(kind, dtype, inputs[rank]))[1], where


def test_broadcast_from_every_src(matrix: tuple[int, list[dict]]) -> None:
    n, results = matrix
    for kind, dtype in _combos():
        for src in range(n):
            expected = _expect(kind, dtype, _values(dtype, src))
            for rank, res in enumerate(results):
                got, _ = res["broadcast", kind, dtype, src]
                _assert_same(got, expected, f"broadcast {kind} {dtype} src {src} rank {rank}")


def test_allgather(matrix: tuple[int, list[dict]]) -> None:
    n, results = matrix
    for kind, dtype in _combos():
        for rank, res in enumerate(results):
            parts = res["allgather", kind, dtype]
            assert len(parts) == n
            for j, (got, _) in enumerate(parts):
                expected = _expect(kind, dtype, _values(dtype, j))
                _assert_same(got, expected, f"allgather {kind} {dtype} rank {rank} part {j}")
            _, raw = res["allgather_input", kind, dtype]
            assert raw == _export(_make(kind, dtype, _values(dtype, rank)))[1]


def test_reducescatter_and_inputs_unchanged(matrix: tuple[int, list[dict]]) -> None:
    n, results = matrix
    for kind, dtype in _combos():
        for op in OPS:
            for rank, res in enumerate(results):
                where = f"reducescatter {kind} {dtype} {op.name} rank {rank}"
                chunk = [_values(dtype, q, salt=rank) for q in range(n)]
                expected = _expect(kind, dtype, _reference(op, dtype, chunk))
                got, _ = res["reducescatter", kind, dtype, op.name]
                _assert_same(got, expected, where)
                inputs = res["reducescatter_inputs", kind, dtype, op.name]
                assert len(inputs) == n
                for j, (_, raw) in enumerate(inputs):
                    original = _export(_make(kind, dtype, _values(dtype, rank, salt=j)))[1]
                    assert raw == original, f"{where}: tensor_list[{j}] was modified"


def test_send_recv_every_pair(matrix: tuple[int, list[dict]]) -> None:
    n, results = matrix
    if n < 2:
        pytest.skip("send/recv needs two ranks")
    for kind, dtype in _combos():
        for src, dst in _p2p_pairs(n):
            payload = _export(_make(kind, dtype, _values(dtype, src, salt=dst + 1)))
            got, _ = results[dst]["recv", kind, dtype, src, dst]
            _assert_same(got, payload[0], f"recv {kind} {dtype} {src}->{dst}")
            _, sent_raw = results[src]["send", kind, dtype, src, dst]
            assert sent_raw == payload[1], f"send {kind} {dtype} {src}->{dst} changed its buffer"
            for other in set(range(n)) - {src, dst}:
                assert ("recv", kind, dtype, src, dst) not in results[other]


def test_barrier_waits_for_every_rank(matrix: tuple[int, list[dict]]) -> None:
    _, results = matrix
    last_arrival = max(res["barrier"][0] for res in results)
    for rank, res in enumerate(results):
        assert res["barrier"][1] >= last_arrival, f"rank {rank} left the barrier early"


def test_3d_shapes(matrix: tuple[int, list[dict]]) -> None:
    n, results = matrix
    for kind, dtype in (("torch", "float32"), ("numpy", "int32")):
        total = _expect(kind, dtype, sum(_base_3d(q) for q in range(n)))
        top = _expect(kind, dtype, np.max([_base_3d(q) for q in range(n)], axis=0))
        for rank, res in enumerate(results):
            where = f"3-D {kind} rank {rank}"
            _assert_same(res["3d_allreduce", kind][0], total, f"allreduce {where}")
            _assert_same(
                res["3d_broadcast", kind][0],
                _expect(kind, dtype, _base_3d(n - 1)),
                f"broadcast {where}",
            )
            if rank == 0:
                _assert_same(res["3d_reduce", kind][0], top, f"reduce {where}")
            else:
                assert res["3d_reduce", kind][1] == _export(_make(kind, dtype, _base_3d(rank)))[1]
            parts = res["3d_allgather", kind]
            for j, (got, _) in enumerate(parts):
                _assert_same(got, _expect(kind, dtype, _base_3d(j)), f"allgather {where} part {j}")
            chunk_sum = sum(_base_3d(q, salt=rank) for q in range(n))
            _assert_same(
                res["3d_reducescatter", kind][0],
                _expect(kind, dtype, chunk_sum),
                f"reducescatter {where}",
            )
    for rank, res in enumerate(results):
        summed = np.sum([_base_3d(q) for q in range(n)], axis=0)
        _assert_same(
            res["3d_noncontiguous", "torch"][0],
            summed.astype(np.float32),
            f"transposed torch rank {rank}",
        )
        _assert_same(
            res["3d_noncontiguous", "numpy"][0], summed.astype(np.int32), f"strided rank {rank}"
        )
        assert (res["3d_noncontiguous_gaps"] == -1).all(), "allreduce wrote between the strides"


def _declared_in_actor(name: str, actor_index: int) -> dict[str, Any]:
    """Query a declared group before any collective, then use it, then leave it."""
    res: dict[str, Any] = {
        "before": (
            col.get_rank(name),
            col.get_collective_group_size(name),
            col.is_group_initialized(name),
        )
    }
    rank = col.get_rank(name)
    x = np.full(5, rank + 1, dtype=np.float64)
    col.allreduce(x, name)
    res["allreduce"] = x.tolist()
    parts = [torch.zeros(1, dtype=torch.int64) for _ in range(col.get_collective_group_size(name))]
    col.allgather(parts, torch.tensor([actor_index]), name)
    res["allgather"] = [int(p.item()) for p in parts]
    res["after"] = (col.get_rank(name), col.is_group_initialized(name))
    col.destroy_collective_group(name)
    return res


def test_declared_group_with_permuted_ranks(members: list) -> None:
    name, ranks = unique_name("declared"), [2, 0, 3, 1]
    col.declare_collective_group(
        members, world_size=4, ranks=ranks, backend="gloo", group_name=name
    )
    try:
        results = run_all(members, _declared_in_actor, [name] * 4, list(range(4)))
    finally:
        col.destroy_collective_group(name)
    for i, res in enumerate(results):
        assert res["before"] == (ranks[i], 4, False), f"actor {i} before the first op"
        assert res["allreduce"] == [10.0] * 5
        assert res["allgather"] == [ranks.index(r) for r in range(4)]
        assert res["after"] == (ranks[i], True)
