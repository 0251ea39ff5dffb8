"""Many small tensors through the one-sided shared-memory transport: the table and its views.

The transport ships an object's dtypes and shapes as a ``segment.Table`` and cuts
each dtype's tensors from the file with one ``split_with_sizes``. These tests check
the table against the tensors it describes, that its metadata pickles small and
whole, and that 2,000 tensors of every kind (strided, conjugate, 0-d, empty, of
many dtypes) reach three consumers bit for bit, each free to write its own.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ray
import torch

import collective as col
from collective.ray_plugins import segment
from collective.ray_plugins.shm_transport import ShmMetadata
from tests.conftest import RAY_TIMEOUT_S, SharedCluster
from tests.test_rdt_shm_ray import SHM, Consumer, flat, segments

col.register_shm_transport()  # before the classes that name it, as Ray asks
COUNT = 2000

DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex64,
    torch.complex128, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
)  # fmt: skip

actor_class: Any = ray.remote
"""Ray's decorator; its stubs know neither ``enable_tensor_transport`` nor actor methods."""


def many(seed: int, count: int = COUNT) -> dict[str, torch.Tensor]:
    """Return ``count`` tensors: every dtype, 0-d, empty, transposed, sliced and conjugate ones."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(count):
        dtype, kind = DTYPES[i % len(DTYPES)], i % 7
        shape = [(3, 5, 2), (17,), (), (0, 4), (6, 9), (33,), (2, 0)][kind]
        t = (torch.randn(shape, generator=g, dtype=torch.float64) * 50).abs()
        t = t.to(dtype) if not dtype.is_complex else torch.complex(t, -t).to(dtype)
        if kind == 4:
            t = t.t()  # not contiguous
        elif kind == 5:
            t = t[::3]  # strided
        if dtype.is_complex and i % 2:
            t = t.conj()  # a conjugate view, written resolved
        out[f"t{i}"] = t
    return out


class _Producer:
    @ray.method(tensor_transport=SHM)
    def many(self, seed: int) -> dict[str, torch.Tensor]:
        return many(seed)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)


Producer: Any = actor_class(num_cpus=0, enable_tensor_transport=True)(_Producer)


def _check_and_write(got: dict[str, torch.Tensor], seed: int) -> list[str]:
    """Return the names of tensors that differ from ``many(seed)``; then overwrite them all."""
    want = many(seed)
    bad = [
        k
        for k, v in want.items()
        if got[k].dtype != v.dtype or got[k].shape != v.shape or not torch.equal(got[k], v)
    ]
    for v in got.values():
        v.fill_(1)  # copy-on-write: the other consumers still read the producer's bytes
    return bad + ([] if sorted(got) == sorted(want) else ["keys"])


@pytest.fixture(scope="module")
def pool(shared_cluster: SharedCluster) -> Iterator[tuple[Any, list[Any], int]]:
    """Join the local cluster; return a producer, three consumers and the producer's pid."""
    shared_cluster.connect(namespace="rdt-shm-many")
    producer, consumers = Producer.remote(), [Consumer.remote() for _ in range(3)]
    pid = ray.get(producer.run.remote(lambda: __import__("os").getpid()), timeout=RAY_TIMEOUT_S)
    yield producer, consumers, pid
    shared_cluster.disconnect()


def test_the_table_gives_each_tensor_its_meta_place_and_bytes() -> None:
    tensors = list(many(0, 200).values())
    metas = [(t.shape, t.dtype) for t in tensors]
    table = segment.Table.of(metas)
    assert len(table) == 200 and table.metas() == metas
    assert all(type(shape) is torch.Size for shape, _ in table.metas())
    places, sizes, size = table.layout()
    end = segment.HEADER
    for t, place, n in zip(tensors, places.tolist(), sizes.tolist(), strict=True):
        assert n == t.numel() * t.element_size()
        assert place == -(-end // segment.ALIGN) * segment.ALIGN  # the next aligned byte
        end = place + n
    assert size == end


def test_a_table_of_big_sizes_or_many_dimensions_is_wide_and_exact() -> None:
    metas = [(torch.Size([2**31 + 1]), torch.int8), (torch.Size([1] * 300), torch.float32)]
    table = segment.Table.of(metas)
    assert table.wide and table.metas() == metas
    assert table.numels().tolist() == [2**31 + 1, 1]
    narrow = segment.Table.of([(torch.Size([2**31 - 1, 0]), torch.int8)])
    assert not narrow.wide and narrow.numels().tolist() == [0]


def test_the_views_are_the_tensors_and_share_one_mapping() -> None:
    tensors = list(many(1, 300).values())
    table = segment.Table.of([(t.shape, t.dtype) for t in tensors])
    path, size = segment.write("x", tensors, table)
    try:
        got = segment.read(path, "x", table, size)
    finally:
        segment.unlink(path)
    assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in tensors]
    assert all(torch.equal(a, b) and b.is_contiguous() for a, b in zip(tensors, got, strict=True))
    assert len({t.untyped_storage().data_ptr() for t in got if t.numel()}) == 1
    assert all(t.untyped_storage().nbytes() == 0 for t in got if not t.numel())  # no mapping


def test_short_writes_still_write_every_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = list(many(5, 40).values())
    table = segment.Table.of([(t.shape, t.dtype) for t in tensors])
    real = os.pwritev

    def short(fd: int, pieces: list[Any], offset: int) -> int:
        """Write at most 100 bytes of the first piece, as a short write may."""
        return real(fd, [memoryview(pieces[0]).cast("B")[:100]], offset)

    monkeypatch.setattr(os, "pwritev", short)
    path, size = segment.write("x", tensors, table)
    monkeypatch.undo()
    try:
        got = segment.read(path, "x", table, size)
    finally:
        segment.unlink(path)
    assert all(torch.equal(a, b) for a, b in zip(tensors, got, strict=True))


def test_the_metadata_pickles_as_its_table_and_comes_back_whole() -> None:
    metas: list[Any] = [(t.shape, t.dtype) for t in many(2).values()]
    table = segment.Table.of(metas)
    meta = ShmMetadata(metas, "cpu", "obj", "/dev/shm/x", 123, "node", 7, 8, table)
    data = pickle.dumps(meta)
    assert len(data) < len(pickle.dumps(metas))
    back = pickle.loads(data)
    assert back == meta and back.tensor_meta == metas
    empty = ShmMetadata([], None, obj_id="none")
    assert pickle.loads(pickle.dumps(empty)) == empty


def test_two_thousand_tensors_of_every_kind_reach_three_consumers_exactly(
    pool: tuple[Any, list[Any], int],
) -> None:
    producer, consumers, pid = pool
    for seed in (3, 4):
        ref = producer.many.remote(seed)
        bad = ray.get([c.run.remote(_check_and_write, ref, seed) for c in consumers], timeout=60)
        assert bad == [[], [], []], seed
        assert segments(pid)
        del ref
    assert flat(pid, consumers) == ([], [0, 0, 0])
