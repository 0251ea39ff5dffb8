"""Code written for ray.util.collective runs unchanged after ``import collective as col``.

The patterns are those of Ray's own single-node CPU collective tests: a ``Worker``
actor that keeps the arrays it gets as method arguments as its buffers (read-only
numpy arrays mapped from Ray's object store), ranks and sizes computed with numpy,
Ray's own ``Backend`` and ``ReduceOp``, a float ``gloo_timeout``,
``reducescatter`` into one of its own inputs, and ``pytest.raises(RuntimeError)``
around bad lists. One cluster and one pair of workers serve the whole module.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import ray
import torch
from ray.util.collective.types import Backend, ReduceOp

import collective as col
from tests.conftest import RAY_TIMEOUT_S, unique_name

WORLD_SIZE = np.int64(2)
SHAPE = (10,)


class _Captured(logging.Handler):
    """Keep the messages of the records it handles."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@ray.remote(num_cpus=0)
class Worker:
    """Ray's test worker: its buffers are whatever its methods were called with."""

    def __init__(self) -> None:
        self.buffer: Any = None
        self.list_buffer: Any = None
        self.logs = _Captured()
        logging.getLogger("collective").addHandler(self.logs)

    def init_group(
        self, world_size: Any, rank: Any, backend: Any, group_name: str, **kwargs: Any
    ) -> bool:
        col.init_collective_group(world_size, rank, backend, group_name, **kwargs)
        return True

    def set_buffer(self, data: Any) -> bool:
        self.buffer = data
        return True

    def set_list_buffer(self, data: Any) -> bool:
        self.list_buffer = data
        return True

    def buffer_from_ref(self, refs: list[Any]) -> bool:
        self.buffer = torch.from_numpy(ray.get(refs[0]))
        return True

    def do_allreduce(self, group_name: str, op: Any = ReduceOp.SUM) -> Any:
        col.allreduce(self.buffer, group_name, op)
        return self.buffer

    def do_reduce(self, group_name: str, dst_rank: Any, op: Any = ReduceOp.SUM) -> Any:
        col.reduce(self.buffer, dst_rank, group_name, op)
        return self.buffer

    def do_broadcast(self, group_name: str, src_rank: Any) -> Any:
        col.broadcast(self.buffer, src_rank, group_name)
        return self.buffer

    def do_allgather(self, group_name: str) -> Any:
        col.allgather(self.list_buffer, self.buffer, group_name)
        return self.list_buffer

    def do_reducescatter(self, group_name: str, op: Any = ReduceOp.SUM) -> Any:
        col.reducescatter(self.buffer, self.list_buffer, group_name, op)
        return self.buffer

    def do_reducescatter_into_own_chunk(self, group_name: str) -> Any:
        rank = col.get_rank(group_name)
        col.reducescatter(self.list_buffer[rank], self.list_buffer, group_name)
        return self.list_buffer

    def do_send(self, group_name: str, dst_rank: Any) -> Any:
        col.send(self.buffer, dst_rank, group_name)
        return self.buffer

    def do_recv(self, group_name: str, src_rank: Any) -> Any:
        col.recv(self.buffer, src_rank, group_name)
        return self.buffer

    def init_from_environment(self, rank: Any, group_name: str) -> bool:
        os.environ["COLLECTIVE_STRICT_BUFFERS"] = "1"
        try:
            col.init_collective_group(WORLD_SIZE, rank, Backend.GLOO, group_name)
        finally:
            del os.environ["COLLECTIVE_STRICT_BUFFERS"]
        return True

    def warnings(self) -> list[str]:
        return list(self.logs.messages)

    def destroy_group(self, group_name: str) -> bool:
        col.destroy_collective_group(group_name)
        return True


def _get(refs: Any) -> Any:
    return ray.get(refs, timeout=RAY_TIMEOUT_S)


def _init(workers: list, name: str, **kwargs: Any) -> None:
    ranks = np.arange(WORLD_SIZE)
    _get(
        [
            w.init_group.remote(WORLD_SIZE, r, Backend.GLOO, name, **kwargs)
            for w, r in zip(workers, ranks, strict=True)
        ]
    )


@pytest.fixture(scope="module")
def workers(ray_cluster: None) -> Iterator[list]:
    """Yield two workers, members of group "compat", made as Ray's tests make groups."""
    actors = [Worker.remote() for _ in range(WORLD_SIZE)]  # type: ignore[attr-defined]
    _init(actors, "compat", gloo_timeout=30000.0)
    yield actors
    _get([w.destroy_group.remote("compat") for w in actors])


def _set_buffers(workers: list, make: Any) -> None:
    _get([w.set_buffer.remote(make(i)) for i, w in enumerate(workers)])


@pytest.mark.parametrize("op", list(ReduceOp), ids=lambda op: op.name)
def test_allreduce_into_argument_buffers_with_rays_reduce_op(op: Any, workers: list) -> None:
    _set_buffers(workers, lambda i: np.ones(SHAPE, dtype=np.float32) * (i + 2))
    results = _get([w.do_allreduce.remote("compat", op) for w in workers])
    expected = {"SUM": 5.0, "PRODUCT": 6.0, "MIN": 2.0, "MAX": 3.0}[op.name]
    for result in results:
        assert (result == np.full(SHAPE, expected, dtype=np.float32)).all(), result


def test_rooted_and_point_to_point_ops_with_numpy_ranks(workers: list) -> None:
    src, dst = np.int64(1), np.int32(0)
    _set_buffers(workers, lambda i: np.ones(SHAPE, dtype=np.float32) * (i + 2))
    results = _get([w.do_broadcast.remote("compat", src) for w in workers])
    assert [r.tolist() for r in results] == [[3.0] * 10] * 2

    _set_buffers(workers, lambda i: np.ones(SHAPE, dtype=np.float32) * (i + 2))
    results = _get([w.do_reduce.remote("compat", dst, ReduceOp.MAX) for w in workers])
    assert results[0].tolist() == [3.0] * 10 and results[1].tolist() == [3.0] * 10

    _set_buffers(workers, lambda i: np.full(SHAPE, i + 7.0, dtype=np.float32))
    refs = [workers[0].do_recv.remote("compat", np.int64(1))]
    refs.append(workers[1].do_send.remote("compat", np.uint8(0)))
    assert [r.tolist() for r in _get(refs)] == [[8.0] * 10] * 2


def test_allgather_into_an_argument_list(workers: list) -> None:
    _set_buffers(workers, lambda i: torch.ones(SHAPE) * (i + 1))
    lists = [[np.zeros(SHAPE, dtype=np.float32) for _ in range(2)] for _ in workers]
    _get([w.set_list_buffer.remote(xs) for w, xs in zip(workers, lists, strict=True)])
    for result in _get([w.do_allgather.remote("compat") for w in workers]):
        assert [x.tolist() for x in result] == [[1.0] * 10, [2.0] * 10]


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_reducescatter_into_one_of_its_own_inputs(kind: str, workers: list) -> None:
    def chunks(i: int) -> list[Any]:
        arrays = [np.full(SHAPE, 10.0 * j + i, dtype=np.float32) for j in range(2)]
        return arrays if kind == "numpy" else [torch.from_numpy(a) for a in arrays]

    _get([w.set_list_buffer.remote(chunks(i)) for i, w in enumerate(workers)])
    results = _get([w.do_reducescatter_into_own_chunk.remote("compat") for w in workers])
    for rank, result in enumerate(results):
        for j, chunk in enumerate(result):
            # chunk `rank` holds the sum of every rank's chunk `rank`; the other is untouched
            expected = 20.0 * j + 1 if j == rank else 10.0 * j + rank
            assert np.asarray(chunk).tolist() == [expected] * 10, (rank, j, chunk)


def test_reducescatter_with_rays_op_and_argument_buffers(workers: list) -> None:
    _set_buffers(workers, lambda i: np.zeros(SHAPE, dtype=np.float32))
    lists = [[np.full(SHAPE, 2.0 + i + j, dtype=np.float32) for j in range(2)] for i in range(2)]
    _get([w.set_list_buffer.remote(xs) for w, xs in zip(workers, lists, strict=True)])
    results = _get([w.do_reducescatter.remote("compat", ReduceOp.PRODUCT) for w in workers])
    assert [r.tolist() for r in results] == [[6.0] * 10, [12.0] * 10]


@pytest.mark.parametrize("length", [0, 1, 3])
def test_bad_list_lengths_raise_runtime_error(length: int, workers: list) -> None:
    _set_buffers(workers, lambda i: np.ones(SHAPE, dtype=np.float32))
    lists = [np.ones(SHAPE, dtype=np.float32) for _ in range(length)]
    _get([w.set_list_buffer.remote(lists) for w in workers])
    with pytest.raises(RuntimeError) as info:
        _get([w.do_allgather.remote("compat") for w in workers])
    assert isinstance(info.value, ValueError) and "tensor_list" in str(info.value)
    with pytest.raises(RuntimeError):
        _get([w.do_reducescatter.remote("compat") for w in workers])


@pytest.mark.parametrize("shape", [20, [4, 5]])
def test_bad_list_shapes_raise_runtime_error(shape: Any, workers: list) -> None:
    _set_buffers(workers, lambda i: np.ones(SHAPE, dtype=np.float32))
    lists = [np.ones(shape, dtype=np.float32) for _ in range(2)]
    _get([w.set_list_buffer.remote(lists) for w in workers])
    with pytest.raises(RuntimeError) as info:
        _get([w.do_allgather.remote("compat") for w in workers])
    assert isinstance(info.value, ValueError) and "tensor_list[0]" in str(info.value)


def test_invalid_rank_raises_value_error(workers: list) -> None:
    _set_buffers(workers, lambda i: np.ones(SHAPE, dtype=np.float32))
    with pytest.raises(ValueError):
        _get([w.do_broadcast.remote("compat", 3) for w in workers])


def test_read_only_buffers_log_one_warning_per_process(workers: list) -> None:
    for _ in range(2):
        _set_buffers(workers, lambda i: np.ones(SHAPE, dtype=np.float32))
        _get([w.do_allreduce.remote("compat") for w in workers])
    for messages in _get([w.warnings.remote() for w in workers]):
        assert len(messages) == 1, messages
        message = messages[0]
        assert "read-only numpy array" in message
        assert "an actor method's argument or a ray.get result" in message
        assert "every other reader of it on this node" in message
        assert "np.array(x)" in message and "strict_buffers=True" in message
        assert "COLLECTIVE_STRICT_BUFFERS=1" in message


def test_torch_tensor_over_the_object_store_is_written_like_its_array(workers: list) -> None:
    refs = [ray.put(np.full(SHAPE, i + 1.0, dtype=np.float32)) for i in range(2)]
    _get([w.buffer_from_ref.remote([ref]) for w, ref in zip(workers, refs, strict=True)])
    results = _get([w.do_allreduce.remote("compat") for w in workers])
    assert [r.tolist() for r in results] == [[3.0] * 10] * 2
    # as in ray.util.collective, the object itself changed, for every reader on this node
    assert _get(refs[0]).tolist() == [3.0] * 10


@pytest.fixture(scope="module")
def strict(workers: list) -> Iterator[str]:
    """Yield a group of the workers that refuses read-only buffers, made from the environment."""
    name = unique_name("strict")
    _get([w.init_from_environment.remote(r, name) for r, w in enumerate(workers)])
    yield name
    _get([w.destroy_group.remote(name) for w in workers])


def test_strict_group_refuses_a_read_only_array(strict: str, workers: list) -> None:
    _set_buffers(workers, lambda i: np.ones(SHAPE, dtype=np.float32))
    with pytest.raises(ValueError) as info:
        _get([w.do_allreduce.remote(strict) for w in workers])
    assert isinstance(info.value, RuntimeError)
    assert "tensor is a read-only numpy array" in str(info.value)
    assert "strict_buffers is set" in str(info.value)


def test_strict_group_refuses_a_torch_tensor_over_the_object_store(
    strict: str, workers: list
) -> None:
    refs = [ray.put(np.full(SHAPE, 1.0, dtype=np.float32)) for _ in range(2)]
    _get([w.buffer_from_ref.remote([ref]) for w, ref in zip(workers, refs, strict=True)])
    with pytest.raises(ValueError, match="tensor is a read-only torch tensor"):
        _get([w.do_allreduce.remote(strict) for w in workers])
    assert _get(refs[0]).tolist() == [1.0] * 10
    _set_buffers(workers, lambda i: torch.ones(SHAPE) * (i + 1))  # writable: accepted
    assert [r.tolist() for r in _get([w.do_allreduce.remote(strict) for w in workers])] == [
        [3.0] * 10
    ] * 2


def test_declared_group_with_numpy_ranks_and_float_timeout(workers: list) -> None:
    name = unique_name("declared")
    col.declare_collective_group(
        workers, WORLD_SIZE, list(np.arange(WORLD_SIZE)[::-1]), Backend.GLOO, name, 5000.5
    )
    try:
        _set_buffers(workers, lambda i: np.ones(SHAPE, dtype=np.float32) * (i + 1))
        results = _get([w.do_broadcast.remote(name, np.int64(0)) for w in workers])
        assert [r.tolist() for r in results] == [[2.0] * 10] * 2  # rank 0 is workers[1]
    finally:
        _get([w.destroy_group.remote(name) for w in workers])
        col.destroy_collective_group(name)


def test_get_rank_in_the_driver_returns_minus_one(workers: list) -> None:
    """Ray raises RuntimeError here; the driver is simply no member of the group."""
    assert col.get_rank("compat") == -1
    assert col.get_collective_group_size("compat") == -1
