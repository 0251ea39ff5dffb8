"""Gather, scatter, alltoall, flat buffers, new reductions and async through the public API.

Every op x every gloo dtype x numpy and torch runs inside one remote call per actor
per world size (1, 2 and 4); every rank's result is checked on the driver.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import collective as col
from tests.conftest import run_all, unique_name
from tests.test_ops_ray import LENGTH, _assert_same, _combos, _expect, _export, _make, _values

pytestmark = pytest.mark.usefixtures("no_leaks")

FLOATS = ("float16", "bfloat16", "float32", "float64")


def _new_ops(dtype: str) -> list[col.ReduceOp]:
    return [
        op
        for op in (col.ReduceOp.AVG, col.ReduceOp.BAND, col.ReduceOp.BOR, col.ReduceOp.BXOR)
        if op.accepts(dtype)
    ]


def _new_reference(op: col.ReduceOp, dtype: str, inputs: list[np.ndarray]) -> np.ndarray:
    stack = np.stack(inputs)
    if op is col.ReduceOp.AVG:
        return stack.astype(np.float64).mean(0)
    if dtype == "bool":
        ufunc: dict[col.ReduceOp, np.ufunc] = {
            col.ReduceOp.BAND: np.logical_and,
            col.ReduceOp.BOR: np.logical_or,
        }
        return ufunc.get(op, np.logical_xor).reduce(stack, axis=0)
    ufunc = {col.ReduceOp.BAND: np.bitwise_and, col.ReduceOp.BOR: np.bitwise_or}
    return ufunc.get(op, np.bitwise_xor).reduce(stack, axis=0)


def _as_float(kind: str, dtype: str, values: np.ndarray) -> Any:
    if kind == "numpy":
        return values.astype(dtype)
    return torch.from_numpy(values).to(getattr(torch, dtype))


def _exchange_in_actor(rank: int, n: int, name: str) -> dict[Any, Any]:
    """Run every new op on every dtype and kind in group ``name``; return what each produced."""
    col.init_collective_group(n, rank, backend="gloo", group_name=name)
    res: dict[Any, Any] = {}
    try:
        for kind, dtype in _combos():

            def make(values: Any, kind: str = kind, dtype: str = dtype) -> Any:
                return _make(kind, dtype, values)

            zeros = np.zeros(LENGTH, dtype=np.int64)
            for root in range(n):
                x = make(_values(dtype, rank))
                parts = [make(zeros) for _ in range(n)] if rank == root else None
                col.gather(x, parts, dst_rank=root, group_name=name)
                res["gather", kind, dtype, root] = parts and [_export(p) for p in parts]
                flat = make(np.zeros(n * LENGTH, dtype=np.int64)) if rank == root else None
                col.gather(x, flat, root, name)
                res["gather_flat", kind, dtype, root] = flat is not None and _export(flat)
                res["gather_input", kind, dtype, root] = _export(x)
                sources = [make(_values(dtype, j, salt=root)) for j in range(n)]
                out = make(zeros)
                col.scatter(out, sources if rank == root else None, src_rank=root, group_name=name)
                res["scatter", kind, dtype, root] = _export(out)
                flat_in = make(np.concatenate([_values(dtype, j, salt=root) for j in range(n)]))
                out = make(zeros)
                col.scatter(out, flat_in if rank == root else None, root, name)
                res["scatter_flat", kind, dtype, root] = _export(out)
            inputs = [make(_values(dtype, rank, salt=j)) for j in range(n)]
            outputs = [make(zeros) for _ in range(n)]
            col.alltoall(outputs, inputs, name)
            res["alltoall", kind, dtype] = [_export(o) for o in outputs]
            res["alltoall_inputs", kind, dtype] = [_export(t) for t in inputs]
            single_in = make(np.concatenate([_values(dtype, rank, salt=j) for j in range(n)]))
            single_out = make(np.zeros(n * LENGTH, dtype=np.int64))
            col.alltoall_single(single_out, single_in, group_name=name)
            res["alltoall_single", kind, dtype] = _export(single_out)
            flat = make(np.zeros(n * LENGTH, dtype=np.int64))
            col.allgather(flat, make(_values(dtype, rank)), name)
            res["allgather_flat", kind, dtype] = _export(flat)
            out = make(zeros)
            stacked = make(np.concatenate([_values(dtype, rank, salt=j) for j in range(n)]))
            col.reducescatter(out, stacked, name)
            res["reducescatter_flat", kind, dtype] = _export(out)
            for op in _new_ops(dtype):
                x = make(_values(dtype, rank))
                col.allreduce(x, name, op)
                res["allreduce", kind, dtype, op.name] = _export(x)
            x = make(_values(dtype, rank))
            work = col.allreduce(x, name, async_op=True)
            assert work is not None
            work.wait()
            res["async", kind, dtype] = (_export(x), work.is_completed(), work.exception())
        rows = [rank + j + 1 for j in range(n)]
        uneven_in = np.concatenate(
            [np.full(r, 10 * rank + j, np.int64) for j, r in enumerate(rows)]
        )
        in_rows = [rank + j + 1 for j in range(n)]
        out_rows = [j + rank + 1 for j in range(n)]
        uneven_out = np.zeros(sum(out_rows), np.int64)
        col.alltoall_single(uneven_out, uneven_in, out_rows, in_rows, name)
        res["alltoall_uneven"] = uneven_out
    finally:
        col.destroy_collective_group(name)
    return res


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda n: f"ws{n}")
def matrix(request: pytest.FixtureRequest, members: list) -> tuple[int, list[dict]]:
    n = request.param
    name = unique_name(f"ex{n}")
    return n, run_all(members[:n], _exchange_in_actor, list(range(n)), [n] * n, [name] * n)


def test_gather_list_and_flat(matrix: tuple[int, list[dict]]) -> None:
    n, results = matrix
    for kind, dtype in _combos():
        parts = [_expect(kind, dtype, _values(dtype, q)) for q in range(n)]
        for root in range(n):
            for rank, res in enumerate(results):
                where = f"gather {kind} {dtype} root {root} rank {rank}"
                assert (
                    res["gather_input", kind, dtype, root][1]
                    == _export(_make(kind, dtype, _values(dtype, rank)))[1]
                ), f"{where}: input changed"
                if rank != root:
                    assert res["gather", kind, dtype, root] is None, where
                    assert res["gather_flat", kind, dtype, root] is False, where
                    continue
                got = res["gather", kind, dtype, root]
                assert len(got) == n, where
                for q, (part, _) in enumerate(got):
                    _assert_same(part, parts[q], f"{where} part {q}")
                flat, _ = res["gather_flat", kind, dtype, root]
                _assert_same(flat, np.concatenate(parts), f"{where} flat")


def test_scatter_list_and_flat(matrix: tuple[int, list[dict]]) -> None:
    n, results = matrix
    for kind, dtype in _combos():
        for root in range(n):
            for rank, res in enumerate(results):
                expected = _expect(kind, dtype, _values(dtype, rank, salt=root))
                where = f"scatter {kind} {dtype} root {root} rank {rank}"
                _assert_same(res["scatter", kind, dtype, root][0], expected, where)
                _assert_same(res["scatter_flat", kind, dtype, root][0], expected, f"{where} flat")


def test_alltoall_list_and_single(matrix: tuple[int, list[dict]]) -> None:
    n, results = matrix
    for kind, dtype in _combos():
        for rank, res in enumerate(results):
            where = f"alltoall {kind} {dtype} rank {rank}"
            expected = [_expect(kind, dtype, _values(dtype, q, salt=rank)) for q in range(n)]
            got = res["alltoall", kind, dtype]
            for q in range(n):
                _assert_same(got[q][0], expected[q], f"{where} from {q}")
                sent = _export(_make(kind, dtype, _values(dtype, rank, salt=q)))[1]
                assert res["alltoall_inputs", kind, dtype][q][1] == sent, f"{where} input {q}"
            _assert_same(
                res["alltoall_single", kind, dtype][0], np.concatenate(expected), f"{where} single"
            )
    for rank, res in enumerate(results):
        uneven = np.concatenate([np.full(q + rank + 1, 10 * q + rank) for q in range(n)])
        np.testing.assert_array_equal(res["alltoall_uneven"], uneven, f"uneven rank {rank}")


def test_flat_allgather_and_reducescatter(matrix: tuple[int, list[dict]]) -> None:
    n, results = matrix
    for kind, dtype in _combos():
        gathered = np.concatenate([_expect(kind, dtype, _values(dtype, q)) for q in range(n)])
        for rank, res in enumerate(results):
            where = f"{kind} {dtype} rank {rank}"
            _assert_same(res["allgather_flat", kind, dtype][0], gathered, f"allgather {where}")
            chunks = np.stack([_values(dtype, q, salt=rank) for q in range(n)])
            total = chunks.any(0) if dtype == "bool" else chunks.sum(0)
            expected = _expect(kind, dtype, total)
            _assert_same(res["reducescatter_flat", kind, dtype][0], expected, f"rs {where}")


def test_avg_and_bitwise_allreduce(matrix: tuple[int, list[dict]]) -> None:
    n, results = matrix
    for kind, dtype in _combos():
        inputs = [_values(dtype, q) for q in range(n)]
        for op in _new_ops(dtype):
            reference = _new_reference(op, dtype, inputs)
            if op is col.ReduceOp.AVG:  # fractional: _expect would round through int64
                expected = _export(_as_float(kind, dtype, reference))[0]
            else:
                expected = _expect(kind, dtype, reference)
            for rank, res in enumerate(results):
                got, _ = res["allreduce", kind, dtype, op.name]
                _assert_same(got, expected, f"allreduce {kind} {dtype} {op.name} rank {rank}")


def test_async_allreduce_through_the_api(matrix: tuple[int, list[dict]]) -> None:
    n, results = matrix
    for kind, dtype in _combos():
        stack = np.stack([_values(dtype, q) for q in range(n)])
        expected = _expect(kind, dtype, stack.any(0) if dtype == "bool" else stack.sum(0))
        for rank, res in enumerate(results):
            (got, _), done, error = res["async", kind, dtype]
            _assert_same(got, expected, f"async {kind} {dtype} rank {rank}")
            assert (done, error) == (True, None)
