"""CPU groups without Ray: every rank is a thread of this process, meeting on a TCPStore.

Every test runs on both CPU transports: ``tcp`` (``GlooGroup``, Gloo over TCP) and
``shm`` (``CpuGroup``, whose ranks here share one node, so it uses the shared-memory
arena; with 256-byte slots, so that most messages take several pipelined steps).
"""

from __future__ import annotations

import functools
import gc
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import numpy as np
import psutil
import pytest
import torch
import torch.distributed as dist

from collective.checks.check_args import CheckedGroup
from collective.groups.base import BaseGroup
from collective.groups.cpu.group import CpuGroup
from collective.groups.gloo.group import GlooGroup
from collective.rendezvous.store import TCPRendezvousStore
from collective.types import (
    AllGatherOptions,
    AllReduceOptions,
    ArgumentValueError,
    BarrierOptions,
    BroadcastOptions,
    CollectiveError,
    CollectiveTimeoutError,
    RecvOptions,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
    SendOptions,
)

GROUP_TIMEOUT = timedelta(seconds=20)
"""Default timeout of the test groups: a rank left waiting by a failed peer fails in time."""

JOIN_TIMEOUT_S = 60.0
"""Bound on waiting for all rank threads of one run; past it the test fails."""


class Absence:
    """Keeps a rank in its group, out of the op under test, until the other ranks are done.

    The absent rank calls ``stay()``; each of the ``present`` others calls ``done()``
    once it has seen the op fail. So the absent rank neither leaves early (which
    would fail the op another way) nor keeps the test waiting past the op's timeout.
    ``stay`` gives up after ``JOIN_TIMEOUT_S / 2``.
    """

    def __init__(self, present: int = 1) -> None:
        """Wait for ``present`` ranks."""
        self._left = present
        self._lock = threading.Lock()
        self._all_done = threading.Event()

    def stay(self) -> None:
        """Block until every present rank is done."""
        self._all_done.wait(JOIN_TIMEOUT_S / 2)

    def done(self) -> None:
        """Say that this present rank is done with the op."""
        with self._lock:
            self._left -= 1
            if self._left <= 0:
                self._all_done.set()


WORLD_SIZES = [1, 2, 4]
DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool"]
SHAPE = (4, 4)
CLASSIC_OPS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)
"""The reductions every dtype takes; AVG and the bitwise ops have tests of their own."""


TRANSPORTS: dict[str, Callable[..., BaseGroup]] = {
    "tcp": GlooGroup,
    "shm": functools.partial(CpuGroup, slot_bytes=256),
}
"""How each transport's group is built: ``cls(world_size, rank, name, store, timeout)``."""

_current = {"transport": "tcp"}


@pytest.fixture(params=list(TRANSPORTS), autouse=True)
def transport(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test on each CPU transport; ``build_group`` builds groups of it.

    The transport goes back to tcp after the test, so that a module which imports
    ``run_ranks`` without this fixture gets tcp, whatever ran before it.
    """
    _current["transport"] = request.param
    yield request.param
    _current["transport"] = "tcp"


def build_group(*args: Any, **kwargs: Any) -> Any:
    """Build a group of the current test's transport."""
    return TRANSPORTS[_current["transport"]](*args, **kwargs)


# --- running ranks as threads ---------------------------------------------------------------


def _run_threads(targets: list[Callable[[], Any]], timeout: float) -> list[Any]:
    """Run each target in its own thread and return their results in order.

    The earliest exception raised by any target is re-raised here; a target still running
    after ``timeout`` seconds fails the test.
    """
    results: list[Any] = [None] * len(targets)
    failures: list[tuple[float, int, BaseException]] = []

    def body(i: int) -> None:
        try:
            results[i] = targets[i]()
        except BaseException as exc:
            failures.append((time.monotonic(), i, exc))

    threads = [
        threading.Thread(target=body, args=(i,), name=f"rank-{i}", daemon=True)
        for i in range(len(targets))
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    alive = [i for i, thread in enumerate(threads) if thread.is_alive()]
    if failures:
        _, rank, exc = min(failures, key=lambda f: f[0])
        others = sorted(i for _, i, _ in failures if i != rank)
        if hasattr(exc, "add_note"):
            exc.add_note(f"raised on rank {rank}; also failed: {others}; still running: {alive}")
        raise exc
    if alive:
        pytest.fail(f"ranks {alive} were still running after {timeout:g}s")
    return results


def _master_store() -> Any:
    return dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)


def _client_store(master: Any, timeout: timedelta) -> Any:
    return dist.TCPStore("127.0.0.1", master.port, None, False, timeout)


def run_ranks(
    world_size: int,
    fn: Callable[[GlooGroup, int], Any],
    timeout: float = JOIN_TIMEOUT_S,
    group_timeout: timedelta = GROUP_TIMEOUT,
) -> list[Any]:
    """Run ``fn(group, rank)`` on a fresh group, one thread per rank; return every result.

    Each call uses a new master store and a new group name. Every group built is destroyed
    before this returns or raises.
    """
    master = _master_store()
    name = f"test-{uuid.uuid4().hex[:8]}"
    groups: list[GlooGroup] = []

    def target(rank: int) -> Callable[[], Any]:
        def run() -> Any:
            store = master if rank == 0 else _client_store(master, group_timeout)
            group = build_group(
                world_size, rank, name, TCPRendezvousStore(store), group_timeout, host="127.0.0.1"
            )
            groups.append(group)
            return fn(group, rank)

        return run

    try:
        return _run_threads([target(r) for r in range(world_size)], timeout)
    finally:
        for group in groups:
            group.destroy_group()


def test_run_ranks_reraises_a_failing_ranks_error() -> None:
    def fn(group: GlooGroup, rank: int) -> int:
        if rank == 1:
            raise ZeroDivisionError("rank 1 broke")
        return rank

    with pytest.raises(ZeroDivisionError, match="rank 1 broke"):
        run_ranks(2, fn)


def test_run_ranks_gives_each_rank_its_group() -> None:
    def fn(group: GlooGroup, rank: int) -> tuple[int, int, object]:
        return group.rank, group.world_size, group.error

    assert run_ranks(4, fn) == [(r, 4, None) for r in range(4)]


# --- inputs and references ------------------------------------------------------------------


def values(rank: int, dtype: str = "int64", offset: int = 0) -> np.ndarray:
    """Return rank's small integer-valued input; a product over 4 ranks stays below 127.

    Element j is ``(j + 2 * rank + offset) % 5 + 1``, so four ranks hold four distinct
    values of 1..5 at every position. Bool inputs are bit ``rank`` of j.
    """
    j = np.arange(int(np.prod(SHAPE))).reshape(SHAPE)
    if dtype == "bool":
        return ((j + offset) >> rank) & 1 == 1
    return ((j + 2 * rank + offset) % 5 + 1).astype(dtype if dtype != "bfloat16" else "float32")


def reference(inputs: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    """Reduce ``inputs`` with numpy; bool SUM and MAX are OR, PRODUCT and MIN are AND."""
    stack = np.stack(inputs)
    if stack.dtype == np.bool_:
        if op in (ReduceOp.SUM, ReduceOp.MAX):
            return np.logical_or.reduce(stack, axis=0)
        return np.logical_and.reduce(stack, axis=0)
    stack = stack.astype(np.int64)
    reduce: dict[ReduceOp, Callable[..., np.ndarray]] = {
        ReduceOp.SUM: np.sum,
        ReduceOp.PRODUCT: np.prod,
        ReduceOp.MIN: np.min,
    }
    return reduce.get(op, np.max)(stack, axis=0)


def make(kind: str, array: np.ndarray, dtype: str) -> Any:
    """Return ``array`` as a fresh numpy array or torch tensor of ``dtype``."""
    if kind == "numpy":
        return np.array(array, dtype=dtype)
    return torch.tensor(np.asarray(array), dtype=getattr(torch, dtype))


def as_numpy(x: Any) -> np.ndarray:
    """Return a numpy copy of ``x``; bfloat16 becomes float32 (exact for our values)."""
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.bfloat16:
            x = x.float()
        return x.numpy().copy()
    return np.array(x)


def raw(x: Any) -> bytes:
    """Return the bytes of ``x``'s elements, to check that a buffer was not written."""
    if isinstance(x, torch.Tensor):
        return x.contiguous().view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(x).tobytes()


def assert_equal(got: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert got.shape == expected.shape, f"{what}: shape {got.shape} != {expected.shape}"
    if expected.dtype == np.bool_:
        assert got.dtype == np.bool_, f"{what}: dtype {got.dtype}"
        assert np.array_equal(got, expected), f"{what}: {got.tolist()} != {expected.tolist()}"
    else:
        assert np.array_equal(got.astype(np.float64), expected.astype(np.float64)), (
            f"{what}: {got.tolist()} != {expected.tolist()}"
        )


def _kinds(dtype: str) -> list[str]:
    return ["torch"] if dtype == "bfloat16" else ["numpy", "torch"]


# --- allreduce ------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_allreduce_every_dtype_and_op(world_size: int) -> None:
    cases = [(k, d, op) for d in DTYPES for k in _kinds(d) for op in CLASSIC_OPS]

    def fn(group: GlooGroup, rank: int) -> dict[tuple[str, str, ReduceOp], tuple[Any, ...]]:
        out = {}
        for kind, dtype, op in cases:
            x = make(kind, values(rank, dtype), dtype)
            group.allreduce([x], AllReduceOptions(op))
            out[kind, dtype, op] = (type(x), str(x.dtype), as_numpy(x))
        return out

    results = run_ranks(world_size, fn)
    assert len(results) == world_size
    for kind, dtype, op in cases:
        expected = reference([values(r, dtype) for r in range(world_size)], op)
        for rank, result in enumerate(results):
            typ, got_dtype, got = result[kind, dtype, op]
            what = f"{kind} {dtype} {op.name} on rank {rank} of {world_size}"
            assert typ is (np.ndarray if kind == "numpy" else torch.Tensor), what
            assert got_dtype.removeprefix("torch.") == dtype, what
            assert_equal(got, expected, what)


def test_bool_allreduce_is_logical_or_and_and() -> None:
    a = np.array([False, False, True, True])
    b = np.array([False, True, False, True])

    def fn(group: GlooGroup, rank: int) -> dict[ReduceOp, list[bool]]:
        out = {}
        for op in CLASSIC_OPS:
            x = torch.tensor(a if rank == 0 else b)
            group.allreduce([x], AllReduceOptions(op))
            out[op] = x.tolist()
        return out

    for result in run_ranks(2, fn):
        assert result[ReduceOp.SUM] == [False, True, True, True]
        assert result[ReduceOp.MAX] == [False, True, True, True]
        assert result[ReduceOp.PRODUCT] == [False, False, False, True]
        assert result[ReduceOp.MIN] == [False, False, False, True]


# --- reduce, broadcast, allgather, reducescatter ----------------------------------------------

ROOTED_KINDS = [("numpy", "float32"), ("torch", "int64"), ("torch", "bfloat16")]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_writes_only_the_root(world_size: int) -> None:
    cases = [
        (root, k, d, op)
        for root in range(world_size)
        for k, d in ROOTED_KINDS
        for op in CLASSIC_OPS
    ]

    def fn(group: GlooGroup, rank: int) -> dict[tuple[Any, ...], tuple[np.ndarray, bytes, bytes]]:
        out = {}
        for root, kind, dtype, op in cases:
            x = make(kind, values(rank, dtype), dtype)
            before = raw(x)
            group.reduce([x], ReduceOptions(reduce_op=op, root_rank=root))
            out[root, kind, dtype, op] = (as_numpy(x), before, raw(x))
        return out

    results = run_ranks(world_size, fn)
    for root, kind, dtype, op in cases:
        expected = reference([values(r, dtype) for r in range(world_size)], op)
        for rank, result in enumerate(results):
            got, before, after = result[root, kind, dtype, op]
            what = f"reduce {kind} {dtype} {op.name} root {root}, rank {rank} of {world_size}"
            if rank == root:
                assert_equal(got, expected, what)
            else:
                assert after == before, f"{what}: a non-root buffer was written"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_broadcast_from_every_root(world_size: int) -> None:
    cases = [
        (root, k, d) for root in range(world_size) for k, d in [*ROOTED_KINDS, ("numpy", "bool")]
    ]

    def fn(group: GlooGroup, rank: int) -> dict[tuple[Any, ...], tuple[np.ndarray, bytes, bytes]]:
        out = {}
        for root, kind, dtype in cases:
            x = make(kind, values(rank, dtype), dtype)
            before = raw(x)
            group.broadcast([x], BroadcastOptions(root_rank=root))
            out[root, kind, dtype] = (as_numpy(x), before, raw(x))
        return out

    results = run_ranks(world_size, fn)
    for root, kind, dtype in cases:
        for rank, result in enumerate(results):
            got, before, after = result[root, kind, dtype]
            what = f"broadcast {kind} {dtype} from {root}, rank {rank} of {world_size}"
            assert_equal(got, values(root, dtype), what)
            if rank == root:
                assert after == before, f"{what}: the source buffer changed"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_allgather_into_lists(world_size: int) -> None:
    kinds = [("numpy", "float64"), ("torch", "int32"), ("numpy", "uint8"), ("torch", "bool")]

    def fn(group: GlooGroup, rank: int) -> dict[tuple[str, str], tuple[Any, ...]]:
        out = {}
        for kind, dtype in kinds:
            x = make(kind, values(rank, dtype), dtype)
            before = raw(x)
            outputs = [make(kind, np.zeros(SHAPE), dtype) for _ in range(world_size)]
            group.allgather([outputs], [x], AllGatherOptions())
            out[kind, dtype] = ([as_numpy(o) for o in outputs], before, raw(x))
        return out

    results = run_ranks(world_size, fn)
    for kind, dtype in kinds:
        for rank, result in enumerate(results):
            outputs, before, after = result[kind, dtype]
            what = f"allgather {kind} {dtype}, rank {rank} of {world_size}"
            assert len(outputs) == world_size, what
            for i, got in enumerate(outputs):
                assert_equal(got, values(i, dtype), f"{what}, element {i}")
            assert after == before, f"{what}: the input changed"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reducescatter_gives_each_rank_its_chunk(world_size: int) -> None:
    cases = [
        (k, d, op) for k, d in [("numpy", "float32"), ("torch", "int32")] for op in CLASSIC_OPS
    ]

    def chunk(rank: int, i: int, dtype: str) -> np.ndarray:
        return values(rank, dtype, offset=3 * i)

    def fn(group: GlooGroup, rank: int) -> dict[tuple[Any, ...], tuple[Any, ...]]:
        out = {}
        for kind, dtype, op in cases:
            inputs = [make(kind, chunk(rank, i, dtype), dtype) for i in range(world_size)]
            before = [raw(x) for x in inputs]
            output = make(kind, np.zeros(SHAPE), dtype)
            group.reducescatter([output], [inputs], ReduceScatterOptions(reduce_op=op))
            out[kind, dtype, op] = (as_numpy(output), before, [raw(x) for x in inputs])
        return out

    results = run_ranks(world_size, fn)
    for kind, dtype, op in cases:
        for rank, result in enumerate(results):
            got, before, after = result[kind, dtype, op]
            what = f"reducescatter {kind} {dtype} {op.name}, rank {rank} of {world_size}"
            expected = reference([chunk(r, rank, dtype) for r in range(world_size)], op)
            assert_equal(got, expected, what)
            assert after == before, f"{what}: the input list was modified"


# --- send / recv and barrier ----------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 4])
def test_send_recv_ring(world_size: int) -> None:
    kinds = [("numpy", "float32"), ("torch", "int64"), ("torch", "bfloat16"), ("numpy", "bool")]

    cases = [(step, k, d) for step in (1, -1) for k, d in kinds]

    def fn(group: GlooGroup, rank: int) -> dict[tuple[Any, ...], tuple[Any, ...]]:
        out = {}
        for step, kind, dtype in cases:
            dst, src = (rank + step) % world_size, (rank - step) % world_size
            message = make(kind, values(rank, dtype), dtype)
            before = raw(message)
            received = make(kind, np.zeros(SHAPE), dtype)
            # Even ranks send first and odd ranks receive first, since send waits.
            if rank % 2 == 0:
                group.send([message], SendOptions(dst_rank=dst))
                group.recv([received], RecvOptions(src_rank=src))
            else:
                group.recv([received], RecvOptions(src_rank=src))
                group.send([message], SendOptions(dst_rank=dst))
            out[step, kind, dtype] = (as_numpy(received), before, raw(message))
        return out

    results = run_ranks(world_size, fn)
    for step, kind, dtype in cases:
        for rank, result in enumerate(results):
            got, before, after = result[step, kind, dtype]
            src = (rank - step) % world_size
            what = f"recv {kind} {dtype} from {src} on rank {rank} of {world_size}"
            assert_equal(got, values(src, dtype), what)
            assert after == before, f"{what}: the sent buffer changed"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_barrier_waits_for_the_last_rank(world_size: int) -> None:
    late = world_size - 1

    def fn(group: GlooGroup, rank: int) -> tuple[float, float]:
        group.barrier(BarrierOptions())  # every rank has finished connecting
        if rank == late:
            time.sleep(0.5)
        entered = time.monotonic()
        group.barrier(BarrierOptions())
        return entered, time.monotonic()

    results = run_ranks(world_size, fn)
    late_entered = results[late][0]
    for rank, (_, left) in enumerate(results):
        assert left >= late_entered, f"rank {rank} left the barrier before rank {late} entered"


# --- buffer layouts -------------------------------------------------------------------------


def test_allreduce_non_contiguous_inputs_are_written_in_place() -> None:
    def fn(group: GlooGroup, rank: int) -> dict[str, Any]:
        base_t = torch.arange(12, dtype=torch.float32).reshape(3, 4) + rank
        transposed = base_t.t()
        assert not transposed.is_contiguous()
        group.allreduce([transposed], AllReduceOptions(ReduceOp.SUM))

        base_a = np.arange(12, dtype=np.int64).reshape(3, 4) * (rank + 1)
        strided = base_a[:, ::2]
        assert not strided.flags.c_contiguous
        group.allreduce([strided], AllReduceOptions(ReduceOp.MAX))

        reversed_ = np.arange(5, dtype=np.float64)[::-1] + rank
        group.allreduce([reversed_], AllReduceOptions(ReduceOp.SUM))
        return {
            "transposed": transposed.numpy().copy(),
            "base_t": base_t.numpy().copy(),
            "strided": strided.copy(),
            "base_a": base_a.copy(),
            "reversed": reversed_.copy(),
        }

    results = run_ranks(2, fn)
    grid = np.arange(12).reshape(3, 4)
    max_cols = grid * 2  # MAX over ranks of grid * (rank + 1)
    for rank, got in enumerate(results):
        what = f"rank {rank}"
        assert_equal(got["base_t"], 2 * grid + 1, f"{what}: base of the transposed tensor")
        assert_equal(got["transposed"], (2 * grid + 1).T, f"{what}: transposed tensor")
        assert_equal(got["strided"], max_cols[:, ::2], f"{what}: strided slice")
        assert_equal(got["base_a"][:, ::2], max_cols[:, ::2], f"{what}: the slice's base")
        untouched = grid[:, 1::2] * (rank + 1)
        assert_equal(got["base_a"][:, 1::2], untouched, f"{what}: columns outside the slice")
        assert_equal(got["reversed"], 2 * np.arange(5)[::-1] + 1, f"{what}: reversed view")


def test_non_contiguous_outputs_of_broadcast_allgather_recv() -> None:
    def fn(group: GlooGroup, rank: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        base = np.zeros((2, 6), dtype=np.float32)
        target = base[:, ::2] if rank == 1 else np.full((2, 3), 7.0, dtype=np.float32)
        group.broadcast([target], BroadcastOptions(root_rank=0))
        out["broadcast"] = base.copy()

        gathered = torch.zeros(3, 2 * 2)
        views = [gathered[:, 0:2], gathered[:, 2:4]]
        group.allgather([views], [torch.full((3, 2), float(rank + 1))], AllGatherOptions())
        out["allgather"] = gathered.numpy().copy()

        received = torch.zeros(4, 3).t()
        if rank == 0:
            group.send([torch.arange(12.0).reshape(3, 4)], SendOptions(dst_rank=1))
        else:
            group.recv([received], RecvOptions(src_rank=0))
        out["recv"] = received.numpy().copy()
        return out

    results = run_ranks(2, fn)
    expected_base = np.zeros((2, 6))
    expected_base[:, ::2] = 7.0
    assert_equal(results[1]["broadcast"], expected_base, "broadcast into a strided slice")
    expected_gather = np.concatenate([np.full((3, 2), 1.0), np.full((3, 2), 2.0)], axis=1)
    for rank in range(2):
        assert_equal(results[rank]["allgather"], expected_gather, f"allgather on rank {rank}")
    assert_equal(results[1]["recv"], np.arange(12.0).reshape(3, 4), "recv into a transposed view")


def test_overlapping_outputs_raise_and_read_only_ones_are_written_in_place() -> None:
    def fn(group: GlooGroup, rank: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        expanded = torch.ones(1).expand(4)
        with pytest.raises(ArgumentValueError, match="overlapping"):
            group.allreduce([expanded], AllReduceOptions())
        with pytest.raises(ArgumentValueError, match="overlapping"):
            group.recv([expanded], RecvOptions(src_rank=1 - rank))
        assert group.error is None
        frozen = np.full(4, float(rank + 1))
        frozen.flags.writeable = False
        group.allreduce([frozen], AllReduceOptions())  # as Ray does; the API decides first
        out["after"] = frozen.copy()
        out["writeable"] = frozen.flags.writeable
        return out

    for rank, result in enumerate(run_ranks(2, fn)):
        assert_equal(result["after"], np.full(4, 3.0), f"read-only allreduce, rank {rank}")
        assert result["writeable"] is False


def test_read_only_and_expanded_inputs_are_accepted() -> None:
    def frozen(value: float) -> np.ndarray:
        a = np.full(4, value, dtype=np.float32)
        a.flags.writeable = False
        return a

    def fn(group: GlooGroup, rank: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        received = np.zeros(4, dtype=np.float32)
        if rank == 0:
            group.send([frozen(5.0)], SendOptions(dst_rank=1))
        else:
            group.recv([received], RecvOptions(src_rank=0))
        out["recv"] = received

        outputs = [np.zeros(4, dtype=np.float32) for _ in range(2)]
        group.allgather([outputs], [frozen(rank + 1.0)], AllGatherOptions())
        out["allgather"] = outputs

        expanded_outputs = [torch.zeros(4) for _ in range(2)]
        expanded = torch.full((1,), rank + 10.0).expand(4)
        group.allgather([expanded_outputs], [expanded], AllGatherOptions())
        out["allgather_expanded"] = [t.numpy() for t in expanded_outputs]

        root_buffer = frozen(9.0) if rank == 0 else np.zeros(4, dtype=np.float32)
        group.broadcast([root_buffer], BroadcastOptions(root_rank=0))
        out["broadcast"] = root_buffer

        non_root = frozen(rank + 1.0)
        reduced = non_root if rank == 1 else np.full(4, 1.0, dtype=np.float32)
        group.reduce([reduced], ReduceOptions(root_rank=0))
        out["reduce"] = reduced

        chunks = [frozen(rank + 1.0), frozen(10.0 * (rank + 1))]
        scattered = np.zeros(4, dtype=np.float32)
        group.reducescatter([scattered], [chunks], ReduceScatterOptions())
        out["reducescatter"] = scattered
        return out

    results = run_ranks(2, fn)
    assert_equal(results[1]["recv"], np.full(4, 5.0), "recv of a read-only array")
    for rank, result in enumerate(results):
        what = f"rank {rank}"
        assert_equal(result["allgather"][0], np.full(4, 1.0), f"{what}: allgather[0]")
        assert_equal(result["allgather"][1], np.full(4, 2.0), f"{what}: allgather[1]")
        assert_equal(result["allgather_expanded"][0], np.full(4, 10.0), f"{what}: expanded[0]")
        assert_equal(result["allgather_expanded"][1], np.full(4, 11.0), f"{what}: expanded[1]")
        assert_equal(result["broadcast"], np.full(4, 9.0), f"{what}: broadcast")
        assert_equal(result["reducescatter"], np.full(4, [3.0, 30.0][rank]), f"{what}: chunk")
    assert_equal(results[0]["reduce"], np.full(4, 3.0), "reduce onto root 0")
    assert_equal(results[1]["reduce"], np.full(4, 2.0), "read-only non-root buffer")


# --- failures -------------------------------------------------------------------------------


def test_allreduce_timeout_makes_the_group_unusable() -> None:
    absence = Absence()

    def fn(group: GlooGroup, rank: int) -> dict[str, Any]:
        if rank == 1:
            absence.stay()  # never joins the allreduce
            return {}
        try:
            out: dict[str, Any] = {"error_before": group.error}
            start = time.monotonic()
            try:
                group.allreduce([torch.ones(3)], AllReduceOptions(timeout=timedelta(seconds=2)))
            except CollectiveError as exc:
                out["timeout"] = exc
            out["timeout_s"] = time.monotonic() - start
            start = time.monotonic()
            try:
                group.barrier(BarrierOptions())
            except CollectiveError as exc:
                out["later"] = exc
            out["later_s"] = time.monotonic() - start
            out["error_after"] = group.error
            out["name"] = group.group_name
            return out
        finally:
            absence.done()

    result = run_ranks(2, fn)[0]
    name = result["name"]
    assert result["error_before"] is None
    exc = result.get("timeout")
    assert isinstance(exc, CollectiveTimeoutError), f"expected a timeout, got {exc!r}"
    assert isinstance(exc, TimeoutError)
    assert 1.5 <= result["timeout_s"] < 7.0, result["timeout_s"]
    assert (exc.op, exc.group_name, exc.rank) == ("allreduce", name, 0)
    assert exc.timeout == timedelta(seconds=2)
    assert "allreduce" in str(exc) and repr(name) in str(exc) and "rank 0" in str(exc)
    # rank 1's watch thread answered that it issued no op: it never joined op 1
    assert "ranks that joined it (op 1 of the group): [0]" in str(exc), str(exc)
    assert "ranks that never joined it: [1] (rank 1 has issued 0 ops)" in str(exc), str(exc)
    later = result.get("later")
    assert isinstance(later, CollectiveError), f"expected an error, got {later!r}"
    assert not isinstance(later, CollectiveTimeoutError)
    assert "unusable" in str(later) and repr(name) in str(later)
    assert result["later_s"] < 1.0, result["later_s"]
    assert result["error_after"] is exc


def test_recv_timeout_makes_the_group_unusable() -> None:
    absence = Absence()

    def fn(group: GlooGroup, rank: int) -> dict[str, Any]:
        if rank == 1:
            absence.stay()  # never sends
            return {}
        try:
            out: dict[str, Any] = {}
            start = time.monotonic()
            try:
                options = RecvOptions(src_rank=1, timeout=timedelta(seconds=2))
                group.recv([torch.zeros(3)], options)
            except CollectiveError as exc:
                out["timeout"] = exc
            out["timeout_s"] = time.monotonic() - start
            with pytest.raises(CollectiveError, match="unusable"):
                group.send([torch.zeros(3)], SendOptions(dst_rank=1))
            out["error"] = group.error
            return out
        finally:
            absence.done()

    result = run_ranks(2, fn)[0]
    exc = result.get("timeout")
    assert isinstance(exc, CollectiveTimeoutError), f"expected a timeout, got {exc!r}"
    assert (exc.op, exc.rank) == ("recv", 0)
    assert 1.5 <= result["timeout_s"] < 7.0, result["timeout_s"]
    assert result["error"] is exc


@pytest.mark.parametrize("present", [1, 0])
def test_init_times_out_when_a_rank_never_arrives(present: int) -> None:
    master = _master_store()
    name = f"test-{uuid.uuid4().hex[:8]}"

    def build() -> tuple[BaseException | None, float]:
        store = master if present == 0 else _client_store(master, timedelta(seconds=10))
        start = time.monotonic()
        try:
            group = build_group(2, present, name, TCPRendezvousStore(store), timedelta(seconds=2))
        except CollectiveError as exc:
            return exc, time.monotonic() - start
        group.destroy_group()
        return None, time.monotonic() - start

    exc, elapsed = _run_threads([build], timeout=JOIN_TIMEOUT_S)[0]
    assert isinstance(exc, CollectiveTimeoutError), f"expected a timeout, got {exc!r}"
    assert (exc.op, exc.group_name, exc.rank) == ("init", name, present)
    assert "init" in str(exc) and repr(name) in str(exc)
    # 2 s, plus slack; rank 0 also starts a TCPStore, whose reverse DNS lookup of the
    # loopback peer can stall 5 s on a resolver that drops queries.
    assert 1.5 <= elapsed < 12.0, elapsed


def test_ops_on_a_destroyed_group_raise() -> None:
    def fn(group: GlooGroup, rank: int) -> None:
        group.destroy_group()
        with pytest.raises(CollectiveError, match="destroyed"):
            group.allreduce([np.ones(2)], AllReduceOptions())
        with pytest.raises(CollectiveError, match="destroyed"):
            group.barrier(BarrierOptions())

    run_ranks(1, fn)


# --- resource hygiene -----------------------------------------------------------------------


def _threads_and_listeners() -> tuple[int, int]:
    process = psutil.Process()
    listening = [c for c in process.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
    return process.num_threads(), len(listening)


def _settled(baseline: tuple[int, int], wait_s: float = 2.0) -> tuple[int, int]:
    deadline = time.monotonic() + wait_s
    while True:
        gc.collect()
        now = _threads_and_listeners()
        if (now[0] <= baseline[0] and now[1] <= baseline[1]) or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def test_create_and_destroy_leaks_no_threads_or_sockets() -> None:
    def fn(group: GlooGroup, rank: int) -> float:
        x = torch.full((8,), float(rank + 1))
        group.allreduce([x], AllReduceOptions())
        return float(x[0])

    assert run_ranks(2, fn) == [3.0, 3.0]  # warm up torch's own thread pools
    baseline = _settled((0, 0), wait_s=0.5)
    for _ in range(10):
        assert run_ranks(2, fn) == [3.0, 3.0]
    now = _settled(baseline)
    assert now[0] <= baseline[0], f"threads: {baseline[0]} before, {now[0]} after 10 groups"
    assert now[1] <= baseline[1], f"listening sockets: {baseline[1]} before, {now[1]} after"


def test_checked_group_spreads_an_argument_error_with_an_empty_message() -> None:
    """A rank whose own check failed with an empty message still makes every rank raise."""

    def fn(group: Any, rank: int) -> list[str]:
        checked = CheckedGroup(group)
        x = np.ones(4, np.float32)
        raised = []
        with pytest.raises(ArgumentValueError) as caught:
            if rank == 0:
                checked.refuse("allreduce", ArgumentValueError(""))
            checked.allreduce([x], AllReduceOptions(ReduceOp.SUM))
        raised.append(str(caught.value))
        checked.allreduce([x], AllReduceOptions(ReduceOp.SUM)).wait()
        raised.append(f"{x[0]:g}")
        return raised

    results = run_ranks(2, fn)
    for message, _ in results:
        assert message.startswith("allreduce on group 'test-")
        assert message.endswith(": rank 0 passed an invalid argument: ")
    assert [r[1] for r in results] == ["2", "2"]
