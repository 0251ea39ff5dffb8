"""The bulk calls without Ray: every rank a thread on a TCPStore, on each CPU transport.

``broadcast_tensors``, ``allreduce_tensors`` and ``broadcast_state_dict`` run on
shared memory, on Gloo over TCP and on the hierarchical path (two faked nodes). The
property tests draw random lists (dtypes, shapes, strides, kinds, bucket sizes) from a
seed every rank shares and compare every rank's result with per-tensor ops on the
same group. The mismatch tests check that every rank raises the same error and that
no receiver's buffer changed.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from collective.bulk import calls, pipeline
from collective.checks.check_args import CheckedGroup
from collective.frameworks.packing import ITEMSIZE, Staging
from collective.groups.base import BaseGroup
from collective.types import (
    AllReduceOptions,
    ArgumentTypeError,
    ArgumentValueError,
    BroadcastOptions,
    ReduceOp,
)
from tests.test_gloo_group import run_ranks
from tests.test_shm import run_cpu

TRANSPORTS = ("shm", "tcp", "hierarchical")
DTYPES = sorted(ITEMSIZE)
INTEGER_OPS = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    """Run the test on each CPU path."""
    return str(request.param)


def run(transport: str, world_size: int, fn: Callable[[BaseGroup, int], Any]) -> list[Any]:
    """Run ``fn(group, rank)`` on a fresh group of ``transport``, one thread per rank."""
    if transport == "tcp":
        return run_ranks(world_size, fn)
    if transport == "hierarchical":
        nodes = [f"node{r * 2 // world_size}" for r in range(world_size)]
        return run_cpu(world_size, fn, nodes=nodes)
    return run_cpu(world_size, fn, slot_bytes=256)


# --- random tensors -------------------------------------------------------------------------


def draw_spec(rng: random.Random, dtypes: list[str]) -> tuple[str, str, tuple[int, ...], str]:
    """Return a random (kind, dtype, shape, layout): layout is contiguous, strided or transposed."""
    dtype = rng.choice(dtypes)
    kind = "torch" if dtype == "bfloat16" else rng.choice(["numpy", "torch"])
    ndim = rng.choice([0, 1, 1, 2, 3])
    shape = tuple(
        rng.choice([0, 1, 2, 3, 5, 7, 40]) if rng.random() < 0.9 else 0 for _ in range(ndim)
    )
    if rng.random() < 0.1:
        shape = tuple(max(1, d) for d in shape)
    layout = "contiguous" if ndim == 0 else rng.choice(["contiguous", "strided", "transposed"])
    return kind, dtype, shape, layout


def make(spec: tuple[str, str, tuple[int, ...], str], values: np.ndarray) -> Any:
    """Return a buffer of ``spec`` holding ``values`` (of its shape), with its memory layout."""
    kind, dtype, shape, layout = spec
    torch_dtype = getattr(torch, dtype)
    base = torch.from_numpy(values.astype(np.float64)).to(torch_dtype)
    if layout == "strided":
        wide = torch.zeros((*shape[:-1], shape[-1] * 2), dtype=torch_dtype)
        wide[..., ::2] = base
        x = wide[..., ::2]
    elif layout == "transposed":
        x = base.transpose(0, -1).contiguous().transpose(0, -1)
    else:
        x = base.clone()
    if kind == "numpy":
        return x.numpy()
    return x


def values(rng: np.random.Generator, spec: tuple[str, str, tuple[int, ...], str]) -> np.ndarray:
    """Return small non-negative integers of ``spec``'s shape: exact in every dtype and op."""
    high = 2 if spec[1] == "bool" else 4
    return rng.integers(0, high, size=spec[2]).astype(np.float64)


def host(x: Any) -> np.ndarray:
    """Return ``x``'s values as float64 numpy, to compare across kinds."""
    if isinstance(x, np.ndarray):
        return x.astype(np.float64)
    return x.detach().to(torch.float64).numpy()


def contiguous_copy(x: Any) -> Any:
    """Return a new contiguous buffer of ``x``'s kind holding its values."""
    if isinstance(x, np.ndarray):
        return np.array(x, order="C", copy=True)
    return x.contiguous().clone()


def nonempty(xs: list[Any]) -> list[Any]:
    """Return the buffers of ``xs`` that hold elements: an empty one is its own reference."""
    return [x for x in xs if (x.size if isinstance(x, np.ndarray) else x.numel())]


# --- property tests against per-tensor ops --------------------------------------------------

CASES = 12


def _broadcast_cases(group: BaseGroup, rank: int, seed: int) -> list[str]:
    """Run random broadcasts, each compared on every rank with per-tensor broadcasts."""
    shared = random.Random(seed)
    failures = []
    for case in range(CASES):
        count = shared.randint(0, 9)
        specs = [draw_spec(shared, DTYPES) for _ in range(count)]
        root = shared.randrange(group.world_size)
        bucket = shared.choice([8, 24, 100, 1000, None])
        rng = np.random.default_rng([seed, case, rank])
        xs = [make(s, values(rng, s)) for s in specs]
        expected = [contiguous_copy(x) for x in xs]
        for e in nonempty(expected):
            group.broadcast([e], BroadcastOptions(root)).wait()
        source = [host(x).copy() for x in xs]
        calls.broadcast_tensors(group, xs, root, bucket_bytes=bucket)
        for i, (x, e) in enumerate(zip(xs, expected, strict=True)):
            if not np.array_equal(host(x), host(e)):
                failures.append(f"case {case} tensors[{i}] {specs[i]} bucket {bucket}")
            if rank == root and not np.array_equal(host(x), source[i]):
                failures.append(f"case {case}: the source's tensors[{i}] changed")
    return failures


def _allreduce_cases(group: BaseGroup, rank: int, seed: int) -> list[str]:
    """Run random allreduces, each compared on every rank with per-tensor allreduces."""
    shared = random.Random(seed)
    failures = []
    for case in range(CASES):
        op = shared.choice(list(ReduceOp))
        dtypes = [d for d in DTYPES if op.accepts(d)]
        count = shared.randint(0, 9)
        specs = [draw_spec(shared, dtypes) for _ in range(count)]
        bucket = shared.choice([8, 24, 100, 1000, None])
        rng = np.random.default_rng([seed, case, rank])
        xs = [make(s, values(rng, s)) for s in specs]
        expected = [contiguous_copy(x) for x in xs]
        for e in nonempty(expected):
            group.allreduce([e], AllReduceOptions(op)).wait()
        calls.allreduce_tensors(group, xs, op, bucket_bytes=bucket)
        for i, (x, e) in enumerate(zip(xs, expected, strict=True)):
            got, want = host(x), host(e)
            if not np.array_equal(got, want):
                failures.append(f"case {case} {op.name} tensors[{i}] {specs[i]} bucket {bucket}")
    return failures


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_broadcast_tensors_equals_a_broadcast_per_tensor(transport: str, world_size: int) -> None:
    if transport == "hierarchical" and world_size == 1:
        pytest.skip("one rank is one node")
    results = run(transport, world_size, lambda g, r: _broadcast_cases(g, r, 7 + world_size))
    assert results == [[]] * world_size


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_allreduce_tensors_equals_an_allreduce_per_tensor(transport: str, world_size: int) -> None:
    if transport == "hierarchical" and world_size == 1:
        pytest.skip("one rank is one node")
    results = run(transport, world_size, lambda g, r: _allreduce_cases(g, r, 11 + world_size))
    assert results == [[]] * world_size


# --- state dicts ----------------------------------------------------------------------------


def _model(rank: int, scale: float, big: int = 300_000) -> dict[str, Any]:
    """Return a small state dict; the source's (rank 0) values are ``scale``-based, else 0.

    Its tensor "big" has ``big`` elements: by default past ``DIRECT_BYTES``, so that it
    moves in ops of its own whatever the bucket.
    """
    fill = scale if rank == 0 else 0.0
    weights = {
        "embed.weight": torch.full((40, 8), fill, dtype=torch.bfloat16),
        "layers.0.q": torch.full((8, 8), fill + 1),
        "layers.0.norm": torch.full((8,), fill + 2, dtype=torch.float64),
        "layers.0.steps": torch.tensor(int(fill) + 3),
        "mask": np.full((3, 5), bool(fill)),
        "big": torch.full((big,), fill + 4),
        "empty": torch.zeros(0, 4),
    }
    weights["layers.0.t"] = torch.full((6, 4), fill + 5).t()
    return weights


BIG_PAST_THE_BUCKET = 3_000
"""Elements of "big" where the bucket is 512 B: past the bucket, it moves in 24 ops of its
own (the last one partial), as 300,000 elements did in 2,344 ops of the same 512 B."""


def test_state_dict_moves_by_name_whatever_the_order(transport: str) -> None:
    def fn(group: BaseGroup, rank: int) -> list[str]:
        sd = _model(rank, 1.0, BIG_PAST_THE_BUCKET)
        if rank:
            sd = dict(reversed(list(sd.items())))
        param = torch.nn.Parameter(torch.zeros(3)) if rank else torch.nn.Parameter(torch.ones(3))
        sd["param"] = param
        ids = {k: id(v) for k, v in sd.items()}
        out = calls.broadcast_state_dict(group, sd, 0, bucket_bytes=512)
        bad = [] if (out is None) == (rank == 0) else ["wrong return"]
        want = _model(0, 1.0, BIG_PAST_THE_BUCKET)
        want["param"] = torch.ones(3)
        for key, value in want.items():
            if not np.array_equal(host(sd[key]), host(value)):
                bad.append(key)
            if id(sd[key]) != ids[key]:
                bad.append(f"{key} replaced")
        if rank and not param.requires_grad:
            bad.append("param lost requires_grad")
        return bad

    assert run(transport, 4, fn) == [[]] * 4


def test_a_receiver_without_a_state_dict_gets_a_new_one_in_the_source_order() -> None:
    def fn(group: BaseGroup, rank: int) -> Any:
        mine = _model(0, 2.0) if rank == 0 else None
        out = calls.broadcast_state_dict(group, mine, 0)
        if rank == 0:
            return out
        want = _model(0, 2.0)
        assert out is not None and list(out) == list(want)
        for key, value in want.items():
            assert isinstance(out[key], torch.Tensor) and out[key].device.type == "cpu"
            assert tuple(out[key].shape) == tuple(value.shape), key
            assert np.array_equal(host(out[key]), host(value)), key
        return "ok"

    assert run_cpu(3, fn) == [None, "ok", "ok"]


def test_without_strict_keys_on_one_side_are_skipped() -> None:
    def fn(group: BaseGroup, rank: int) -> dict[str, list[float]]:
        if rank == 0:
            sd = {"a": torch.ones(2), "b": torch.full((3,), 2.0), "c": torch.full((1,), 3.0)}
        else:
            sd = {"b": torch.zeros(3), "extra": torch.full((2,), 9.0)}
        calls.broadcast_state_dict(group, sd, 0, strict=False, bucket_bytes=8)
        return {k: v.tolist() for k, v in sd.items()}

    results = run_cpu(2, fn)
    assert results[1] == {"b": [2.0, 2.0, 2.0], "extra": [9.0, 9.0]}
    assert results[0] == {"a": [1.0, 1.0], "b": [2.0, 2.0, 2.0], "c": [3.0]}


# --- mismatches: the same error on every rank, nothing written ------------------------------


def _state_dict_for(kind: str, rank: int) -> dict[str, Any]:
    sd = {"a": torch.zeros(3), "b": torch.zeros(4, 2), "c": torch.zeros(2, dtype=torch.int64)}
    if rank == 0:
        sd = {k: v + 1 for k, v in sd.items()}
    if rank != 2:
        return sd
    if kind == "missing":
        del sd["b"]
    elif kind == "extra":
        sd["d"] = torch.zeros(1)
    elif kind == "shape":
        sd["b"] = torch.zeros(2, 4)
    elif kind == "dtype":
        sd["c"] = torch.zeros(2, dtype=torch.int32)
    return sd


MISMATCHES = {
    "missing": "rank 2 passed an invalid argument: state_dict lacks key 'b', which src_rank 0",
    "extra": "state_dict has key 'd', which src_rank 0 does not send",
    "shape": "state_dict['b'] is float32[2, 4] on rank 2 but float32[4, 2] on src_rank 0",
    "dtype": "state_dict['c'] is int32[2] on rank 2 but int64[2] on src_rank 0",
}


@pytest.mark.parametrize("kind", sorted(MISMATCHES))
def test_a_state_dict_mismatch_raises_on_every_rank_and_writes_nothing(kind: str) -> None:
    def fn(group: BaseGroup, rank: int) -> str:
        sd = _state_dict_for(kind, rank)
        before = {k: v.clone() for k, v in sd.items()}
        with pytest.raises(ArgumentValueError) as raised:
            calls.broadcast_state_dict(group, sd, 0)
        for key, value in before.items():
            assert torch.equal(sd[key], value), key
        x = [torch.ones(2)]
        calls.allreduce_tensors(group, x)  # the group stays usable
        assert x[0].tolist() == [4.0, 4.0]
        return str(raised.value)

    messages = run_cpu(4, fn)
    assert len(set(messages)) == 1, messages
    assert MISMATCHES[kind] in messages[0]
    assert messages[0].startswith("broadcast_state_dict on group ")


LIST_MISMATCHES: dict[str, tuple[Callable[[int], Any], str, type[Exception]]] = {
    "length": (
        lambda r: [torch.zeros(2)] * 1 + ([torch.zeros(2)] if r != 1 else []),
        "list length: 2 on ranks [0, 2], 1 on rank 1",
        ArgumentValueError,
    ),
    "shape": (
        lambda r: [torch.zeros(2), torch.zeros(3 if r == 1 else 4)],
        "tensors[1] is float32[3] on rank 1 but float32[4] on rank 0",
        ArgumentValueError,
    ),
    "dtype": (
        lambda r: [np.zeros(2, np.int32 if r == 2 else np.int64), torch.zeros(1)],
        "tensors[0] is int32[2] on rank 2 but int64[2] on rank 0",
        ArgumentValueError,
    ),
    "not a tensor": (
        lambda r: [torch.zeros(2), [1.0] if r == 1 else torch.zeros(2)],
        "rank 1 passed an invalid argument: tensors[1] must be a numpy.ndarray",
        ArgumentTypeError,
    ),
}


@pytest.mark.parametrize("kind", sorted(LIST_MISMATCHES))
def test_a_list_mismatch_raises_on_every_rank_and_writes_nothing(kind: str) -> None:
    build, expected, error = LIST_MISMATCHES[kind]

    def fn(group: BaseGroup, rank: int) -> list[str]:
        out = []
        for call in ("broadcast", "allreduce"):
            xs = [x.copy() if isinstance(x, np.ndarray) else x for x in build(rank)]
            xs = [torch.full_like(x, 5.0) if isinstance(x, torch.Tensor) else x for x in xs]
            before = [host(x).copy() if not isinstance(x, list) else x for x in xs]
            with pytest.raises(error) as raised:
                if call == "broadcast":
                    calls.broadcast_tensors(group, xs, 0)
                else:
                    calls.allreduce_tensors(group, xs)
            for x, b in zip(xs, before, strict=True):
                assert isinstance(x, list) or np.array_equal(host(x), b)
            out.append(str(raised.value))
        return out

    results = run_cpu(3, fn)
    for i in range(2):
        assert len({r[i] for r in results}) == 1, results
        assert expected.replace("rank 0", "src_rank 0" if i == 0 else "rank 0") in results[0][i]


def test_different_arguments_raise_on_every_rank() -> None:
    def fn(group: BaseGroup, rank: int) -> list[str]:
        out = []
        attempts: list[Callable[[], Any]] = [
            lambda: calls.broadcast_tensors(group, [torch.zeros(2)], rank % 2),
            lambda: calls.allreduce_tensors(group, [torch.zeros(2)], "max" if rank else "sum"),
            lambda: calls.broadcast_tensors(group, [torch.zeros(2)], bucket_bytes=64 + rank),
            lambda: calls.broadcast_tensors(group, [torch.zeros(2)], 0, timeout=5),
            lambda: calls.allreduce_tensors(group, [torch.zeros(2)], bucket_bytes=4),
            lambda: calls.broadcast_tensors(group, [torch.zeros(2)], 9),
            lambda: calls.broadcast_state_dict(group, None if rank == 0 else {}, 0),
            lambda: calls.allreduce_tensors(group, [torch.zeros(2, dtype=torch.int64)], "avg"),
        ]
        for attempt in attempts:
            with pytest.raises((ArgumentValueError, ArgumentTypeError)) as raised:
                attempt()
            out.append(str(raised.value))
        return out

    results = run_cpu(2, fn)
    assert results[0] == results[1]
    wanted = [
        "root: 0 on rank 0, 1 on rank 1",
        "reduce op: SUM on rank 0, MAX on rank 1",
        "bucket_bytes: 64 on ranks [0], 65 on ranks [1]",
        "timeout must be a datetime.timedelta, got int",
        "bucket_bytes must be at least 8",
        "src_rank must be in [0, 2), got 9",
        "state_dict is required on src_rank (0), got None",
        "tensors[0]: ReduceOp.AVG does not take int64 tensors",
    ]
    for message, want in zip(results[0], wanted, strict=True):
        assert want in message, (message, want)


def test_reduced_tensors_must_not_share_memory() -> None:
    def fn(group: BaseGroup, rank: int) -> str:
        base = torch.zeros(10)
        with pytest.raises(ArgumentValueError) as raised:
            calls.allreduce_tensors(group, [torch.zeros(3), base[:6], base[4:]])
        return str(raised.value)

    assert all("tensors[1] and tensors[2] share memory" in m for m in run_cpu(2, fn))


# --- staging, async, checked groups ---------------------------------------------------------


def test_staging_stays_within_two_buckets_whatever_the_total(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: dict[int, list[int]] = {}
    lock = threading.Lock()
    original = Staging.__init__

    def counting(self: Staging, like: Any, nbytes: int) -> None:
        with lock:
            made.setdefault(threading.get_ident(), []).append(nbytes)
        original(self, like, nbytes)

    monkeypatch.setattr(Staging, "__init__", counting)
    bucket = 4096

    def fn(group: BaseGroup, rank: int) -> list[int]:
        made.pop(threading.get_ident(), None)
        xs = [torch.full((250,), float(rank)) for _ in range(400)]  # 400 KB, 100 buckets
        xs.append(torch.zeros(5000, 3).t())  # 60 KB, non-contiguous, moved in ranges
        calls.broadcast_tensors(group, xs, 0, bucket_bytes=bucket)
        assert all(float(x.sum()) == 0.0 for x in xs)
        calls.allreduce_tensors(group, xs, bucket_bytes=bucket)
        return made.get(threading.get_ident(), [])

    for sizes in run_cpu(4, fn):
        assert len(sizes) <= 2 * pipeline.DEPTH, sizes  # DEPTH per call, two calls
        assert max(sizes) <= bucket, sizes


def test_async_calls_return_one_work_and_finish_in_order(transport: str) -> None:
    def fn(group: BaseGroup, rank: int) -> list[float]:
        xs = [torch.full((1000,), float(rank + 1)) for _ in range(30)]
        ys = [np.full((7,), rank + 1, np.int64) for _ in range(3)]
        first = calls.allreduce_tensors(group, xs, bucket_bytes=1024, async_op=True)
        second = calls.broadcast_tensors(group, ys, 1, async_op=True)  # waits for the first
        assert first is not None and second is not None
        second.wait()
        first.wait()
        assert first.is_completed() and second.is_completed()
        assert first.exception() is None
        return [float(xs[0][0]), float(xs[-1][-1]), float(ys[2][3])]

    n = 4
    assert run(transport, n, fn) == [[10.0, 10.0, 2.0]] * n


def test_groups_with_check_args_run_the_bulk_calls() -> None:
    def fn(group: BaseGroup, rank: int) -> list[float]:
        checked = CheckedGroup(group)
        xs = [torch.full((3,), float(rank)), torch.full((2, 2), 1.0).t()]
        calls.allreduce_tensors(checked, xs, "max")
        sd = {"w": torch.full((4,), float(rank))}
        calls.broadcast_state_dict(checked, sd, 1)
        with pytest.raises(ArgumentValueError, match="state_dict has key 'x'"):
            calls.broadcast_state_dict(checked, {**sd, "x": torch.zeros(1)} if rank else sd, 0)
        return [float(xs[0][0]), float(xs[1][0, 1]), float(sd["w"][0])]

    assert run_cpu(2, fn) == [[1.0, 1.0, 1.0]] * 2


def test_read_only_receivers_are_written_in_place_with_a_warning() -> None:
    def fn(group: BaseGroup, rank: int) -> list[float]:
        x = np.full(5, float(rank + 1))
        x.flags.writeable = False
        calls.broadcast_tensors(group, [x], 0)
        return x.tolist()

    assert run_cpu(2, fn) == [[1.0] * 5] * 2
