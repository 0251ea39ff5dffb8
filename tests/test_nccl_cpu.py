"""The nccl backend on a machine without a GPU: dtype tables, buffers, ID exchange, errors.

GPU buffers cannot be made here, so the buffer tests use ``FakeCupyArray``: a host
array dressed as a cupy array (module ``cupy``, ``__cuda_array_interface__``, a
device id). The unique-ID exchange runs for real, with fake ID bytes, on a torch
TCPStore and on the Ray store actor.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import ray
import torch
import torch.distributed as dist

import collective as col
from collective.frameworks import cuda_buffers, kinds
from collective.frameworks.cuda_buffers import NCCL_DTYPES
from collective.frameworks.kinds import TensorSpec
from collective.groups.nccl.comm import (
    NCCL_REDUCE_OPS,
    UNIQUE_ID_BYTES,
    encode_unique_id,
    exchange_unique_id,
    unique_id_argument,
)
from collective.groups.nccl.group import NCCLGroup
from collective.rendezvous.membership import join_store, leave_store
from collective.rendezvous.store import RendezvousStore, TCPRendezvousStore, meet
from collective.types import CollectiveError, CollectiveTimeoutError, ReduceOp
from tests.conftest import RAY_TIMEOUT_S, run_all, unique_name

NCCL_H_DTYPES = {
    "int8": 0,
    "uint8": 1,
    "int32": 2,
    "int64": 4,
    "float16": 6,
    "float32": 7,
    "float64": 8,
    "bfloat16": 9,
}
"""``ncclDataType_t`` in nccl.h: ncclInt8=0, ncclUint8=1, ncclInt32=2, ncclInt64=4, ..."""

FAKE_ID = bytes(range(256))[:UNIQUE_ID_BYTES][::-1]
"""128 bytes with values above 127, which a signed C char holds as negatives."""

SHORT = timedelta(seconds=1)
SLACK_S = 10.0
"""A timed-out wait must return within its timeout plus this, even on a loaded machine."""


class FakeCupyArray:
    """A host numpy array presented as a cupy array on GPU ``device``."""

    __module__ = "cupy"

    def __init__(self, array: np.ndarray, device: int = 0) -> None:
        self._array = array
        self.dtype: Any = array.dtype
        self.shape = array.shape
        self.device = SimpleNamespace(id=device)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        interface = self._array.__array_interface__
        strides = None if self._array.flags.c_contiguous else self._array.strides
        return {
            "shape": self._array.shape,
            "typestr": interface["typestr"],
            "data": interface["data"],
            "strides": strides,
            "version": 3,
        }


# --- dtype and reduction tables ---------------------------------------------------------


def test_nccl_dtype_table_matches_nccl_h() -> None:
    assert NCCL_DTYPES == NCCL_H_DTYPES
    assert NCCLGroup.dtypes == frozenset(NCCL_H_DTYPES)
    assert "bool" not in NCCLGroup.dtypes


def test_nccl_reduce_ops_match_nccl_h() -> None:
    assert NCCL_REDUCE_OPS == {
        ReduceOp.SUM: 0,
        ReduceOp.PRODUCT: 1,
        ReduceOp.MAX: 2,
        ReduceOp.MIN: 3,
        ReduceOp.AVG: 4,
    }
    assert NCCLGroup.supported_ops == frozenset(NCCL_REDUCE_OPS)


@pytest.mark.parametrize("dtype", sorted(NCCL_H_DTYPES))
def test_cuda_buffer_describes_a_gpu_array(dtype: str) -> None:
    host = np.zeros((3, 5), dtype="float32" if dtype == "bfloat16" else dtype)
    fake = FakeCupyArray(host, device=3)
    if dtype == "bfloat16":
        fake.dtype = SimpleNamespace(name="bfloat16", itemsize=2)
    buf = cuda_buffers.cuda_buffer(fake, "tensor")
    assert buf.ptr == host.__array_interface__["data"][0]
    assert (buf.count, buf.dtype, buf.device) == (15, dtype, 3)
    assert buf.nccl_dtype == NCCL_H_DTYPES[dtype]
    assert buf.nbytes == 15 * fake.dtype.itemsize
    assert kinds.spec(fake, "tensor").device == "cuda:3"


def test_cuda_buffer_rejects_a_non_contiguous_gpu_array() -> None:
    fake = FakeCupyArray(np.zeros((4, 6), dtype=np.float32)[:, ::2])
    with pytest.raises(ValueError, match="tensor must be contiguous"):
        cuda_buffers.cuda_buffer(fake, "tensor")


@pytest.mark.parametrize("dtype", ["bool", "uint32", "complex64"])
def test_cuda_buffer_rejects_dtypes_nccl_does_not_move(dtype: str) -> None:
    with pytest.raises(TypeError, match=f"tensor has dtype {dtype}"):
        cuda_buffers.cuda_buffer(FakeCupyArray(np.zeros(4, dtype=dtype)), "tensor")


@pytest.mark.parametrize("make", [np.ones, torch.ones], ids=["numpy", "torch"])
def test_cuda_buffer_rejects_a_cpu_tensor(make: Any) -> None:
    with pytest.raises(TypeError, match=r"x must be a cupy array or a CUDA torch tensor.*cpu"):
        cuda_buffers.cuda_buffer(make(4), "x")


def _bare_group(cls: type) -> Any:
    """Return an instance of ``cls`` without connecting it, to test its checks alone."""
    return object.__new__(cls)


def test_nccl_group_rejects_a_cpu_tensor_with_type_error() -> None:
    group = _bare_group(NCCLGroup)
    with pytest.raises(TypeError, match=r"tensor must be a cuda tensor for a nccl group.*cpu"):
        group.check_tensor(kinds.spec(np.ones(4, dtype=np.float32), "tensor"), "tensor")
    group.check_tensor(kinds.spec(FakeCupyArray(np.ones(4, np.float32)), "tensor"), "tensor")


def test_gloo_group_rejects_a_gpu_tensor_with_type_error() -> None:
    from collective.groups.gloo.group import GlooGroup

    group = _bare_group(GlooGroup)
    spec = TensorSpec("cupy", (4,), "float32", "cuda:0")
    with pytest.raises(TypeError, match=r"tensor must be a cpu tensor for a gloo group.*cuda:0"):
        group.check_tensor(spec, "tensor")


@pytest.mark.parametrize("op", [ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR])
def test_nccl_rejects_bitwise_reductions(op: ReduceOp) -> None:
    with pytest.raises(ValueError, match=f"does not support ReduceOp.{op.name}"):
        _bare_group(NCCLGroup).check_reduce_op(op, "int32")


def test_nccl_avg_takes_floats_only() -> None:
    group = _bare_group(NCCLGroup)
    group.check_reduce_op(ReduceOp.AVG, "bfloat16")
    with pytest.raises(TypeError, match=r"ReduceOp.AVG does not take int32"):
        group.check_reduce_op(ReduceOp.AVG, "int32")


# --- unique IDs --------------------------------------------------------------------------


class Cupy13Communicator:
    """cupy 13's ``NcclCommunicator.__init__(self, int ndev, tuple commId, int rank)``.

    Cython refuses an argument of another type with TypeError before calling NCCL;
    this stands in for it where cupy 14 is installed (the contract tests check the
    installed binding itself).
    """

    def __init__(self, ndev: int, commId: tuple[int, ...], rank: int) -> None:  # noqa: N803
        if not isinstance(commId, tuple):
            raise TypeError("Argument 'commId' has incorrect type (expected tuple, got bytes)")
        raise AssertionError("the unique-ID probe must not reach NCCL")


def test_unique_id_survives_encoding_in_the_form_each_cupy_takes() -> None:
    signed = tuple(b - 256 if b > 127 else b for b in FAKE_ID)
    assert encode_unique_id(signed) == FAKE_ID  # cupy 13's get_unique_id, on x86
    assert encode_unique_id(tuple(FAKE_ID)) == FAKE_ID  # ... where C's char is unsigned
    assert encode_unique_id(FAKE_ID) == FAKE_ID  # cupy 14's
    taken = unique_id_argument(Cupy13Communicator, FAKE_ID)
    assert isinstance(taken, tuple) and encode_unique_id(taken) == FAKE_ID
    with pytest.raises(ValueError, match="128 bytes, got 3"):
        unique_id_argument(Cupy13Communicator, b"abc")
    with pytest.raises(ValueError, match="128 bytes, got 3"):
        encode_unique_id(b"abc")


def _exchange(store: RendezvousStore, key: str, rank: int, timeout: timedelta) -> bytes:
    return exchange_unique_id(store, key, rank == 0, lambda: FAKE_ID, timeout, "g", rank)


def _tcp_stores(world_size: int) -> list[TCPRendezvousStore]:
    master = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30))
    clients = [
        dist.TCPStore("127.0.0.1", master.port, None, False, timedelta(seconds=30))
        for _ in range(world_size - 1)
    ]
    return [TCPRendezvousStore(s) for s in [master, *clients]]


def test_unique_id_exchange_on_a_tcp_store() -> None:
    stores = _tcp_stores(3)
    results: dict[int, bytes] = {}

    def rank_body(rank: int) -> None:
        results[rank] = _exchange(stores[rank], "nccl/g/collective/0", rank, timedelta(seconds=30))

    threads = [threading.Thread(target=rank_body, args=(r,)) for r in (2, 1, 0)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == {0: FAKE_ID, 1: FAKE_ID, 2: FAKE_ID}


def test_unique_id_exchange_times_out_on_a_tcp_store() -> None:
    stores = _tcp_stores(2)
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="never published") as info:
        _exchange(stores[1], "nccl/g/collective/0", 1, SHORT)
    assert isinstance(info.value, TimeoutError)
    assert (info.value.group_name, info.value.rank) == ("g", 1)
    assert SHORT.total_seconds() <= time.monotonic() - start + 0.1 < SHORT.total_seconds() + SLACK_S


_ACTOR_STORES: dict[str, Any] = {}
"""Each member actor's joined store, by group name, between the steps of one test."""


def _join(name: str, rank: int, world_size: int) -> None:
    _ACTOR_STORES[name] = join_store(name, rank, world_size, "nccl", timedelta(seconds=30))[0]


def test_meet_returns_once_every_rank_arrived() -> None:
    stores = _tcp_stores(3)
    done: list[int] = []

    def rank_body(rank: int) -> None:
        meet(stores[rank], "nccl/g/init", rank, 3, timedelta(seconds=30))
        done.append(rank)

    threads = [threading.Thread(target=rank_body, args=(r,)) for r in (1, 2, 0)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(done) == [0, 1, 2]


@pytest.mark.parametrize("rank", [0, 1])
def test_meet_times_out_when_a_rank_never_arrives(rank: int) -> None:
    stores = _tcp_stores(3)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        meet(stores[rank], "nccl/g/init", rank, 3, SHORT)
    assert time.monotonic() - start < SHORT.total_seconds() + SLACK_S


def _exchange_in_actor(name: str, rank: int, timeout_s: float) -> Any:
    start = time.monotonic()
    try:
        return _exchange(
            _ACTOR_STORES[name], "nccl/g/p2p/0.0-1.0", rank, timedelta(seconds=timeout_s)
        )
    except CollectiveTimeoutError as exc:
        return exc, time.monotonic() - start


def _leave(name: str, rank: int) -> None:
    leave_store(_ACTOR_STORES.pop(name), rank)


def test_unique_id_exchange_on_the_ray_store_actor(members: list, no_leaks: None) -> None:
    name, pair = unique_name("nccl-id"), members[:2]
    run_all(pair, _join, [name, name], [0, 1], [2, 2])
    try:
        results = run_all(pair, _exchange_in_actor, [name, name], [0, 1], [30, 30])
    finally:
        run_all(pair, _leave, [name, name], [0, 1])
    assert results == [FAKE_ID, FAKE_ID]


def test_unique_id_exchange_times_out_on_the_ray_store_actor(members: list, no_leaks: None) -> None:
    name, timeout_s = unique_name("nccl-id"), SHORT.total_seconds()
    ray.get(members[1].run.remote(_join, name, 1, 2), timeout=RAY_TIMEOUT_S)
    try:
        error, elapsed = ray.get(
            members[1].run.remote(_exchange_in_actor, name, 1, timeout_s), timeout=RAY_TIMEOUT_S
        )
    finally:
        ray.get(members[1].run.remote(_leave, name, 1), timeout=RAY_TIMEOUT_S)
    assert isinstance(error, CollectiveTimeoutError), repr(error)
    assert "never published" in str(error)
    assert timeout_s - 0.1 <= elapsed < timeout_s + SLACK_S


# --- clear errors without cupy or a GPU ----------------------------------------------------


def _cupy_and_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


needs_no_gpu = pytest.mark.skipif(_cupy_and_gpu(), reason="cupy and a GPU are present here")


@needs_no_gpu
def test_nccl_is_unavailable_and_says_what_to_install() -> None:
    assert col.nccl_available() is False
    assert col.is_backend_available("nccl") is False
    assert col.gloo_available() is True
    with pytest.raises(CollectiveError, match=r"collective\[nccl\]|num_gpus"):
        NCCLGroup(1, 0, "g", _tcp_stores(1)[0])


def _init_nccl(name: str) -> tuple[BaseException | None, bool]:
    try:
        col.init_collective_group(1, 0, backend="nccl", group_name=name)
    except Exception as exc:
        return exc, col.is_group_initialized(name)
    return None, col.is_group_initialized(name)


@needs_no_gpu
def test_init_nccl_in_an_actor_says_what_to_install(members: list, no_leaks: None) -> None:
    error, exists = ray.get(
        members[0].run.remote(_init_nccl, unique_name("nccl")), timeout=RAY_TIMEOUT_S
    )
    assert type(error) is CollectiveError, repr(error)
    assert "pip install cupy-cuda12x" in str(error) or "num_gpus" in str(error)
    assert not exists


def _use_declared(name: str) -> BaseException | None:
    try:
        col.allreduce(np.ones(2), name)
    except Exception as exc:
        return exc
    return None


@needs_no_gpu
def test_a_cpu_driver_declares_an_nccl_group_and_members_learn_what_to_install(
    members: list, no_leaks: None
) -> None:
    name = unique_name("nccl-declared")
    col.declare_collective_group(members[:2], 2, [0, 1], backend="nccl", group_name=name)
    try:
        error = ray.get(members[0].run.remote(_use_declared, name), timeout=RAY_TIMEOUT_S)
    finally:
        col.destroy_collective_group(name)
    assert type(error) is CollectiveError, repr(error)
    assert "nccl backend is not available" in str(error)


def _multigpu_on_gloo(name: str) -> list[str]:
    col.init_collective_group(1, 0, backend="gloo", group_name=name)
    x = np.ones(4, dtype=np.float32)
    calls = [
        lambda: col.allreduce_multigpu([x], name),
        lambda: col.reduce_multigpu([x], 0, 0, name),
        lambda: col.broadcast_multigpu([x], 0, 0, name),
        lambda: col.allgather_multigpu([[x]], [x], name),
        lambda: col.reducescatter_multigpu([x], [[x]], name),
        lambda: col.send_multigpu(x, 0, 0, name),
        lambda: col.recv_multigpu(x, 0, 0, name),
    ]
    errors = []
    try:
        for call in calls:
            try:
                call()
            except ValueError as exc:
                errors.append(str(exc))
        fake = FakeCupyArray(np.ones(4, dtype=np.float32))
        try:
            col.allreduce(fake, name)
        except TypeError as exc:
            errors.append(str(exc))
    finally:
        col.destroy_collective_group(name)
    return errors


def test_multigpu_calls_on_a_gloo_group_say_they_need_nccl(members: list, no_leaks: None) -> None:
    errors = ray.get(
        members[0].run.remote(_multigpu_on_gloo, unique_name("mg")), timeout=RAY_TIMEOUT_S
    )
    functions = ["allreduce", "reduce", "broadcast", "allgather", "reducescatter", "send", "recv"]
    assert len(errors) == len(functions) + 1, errors
    for function, error in zip(functions, errors, strict=False):
        assert f"{function}_multigpu needs a group on GPUs (backend='nccl')" in error
        assert "gloo backend" in error
    assert "tensor must be a cpu tensor for a gloo group, got one on cuda:0" in errors[-1]


def test_multigpu_names_are_exported_with_rays_signatures() -> None:
    import inspect

    from ray.util.collective import collective as ray_collective

    for name in [
        "allreduce_multigpu",
        "reduce_multigpu",
        "broadcast_multigpu",
        "allgather_multigpu",
        "reducescatter_multigpu",
        "send_multigpu",
        "recv_multigpu",
        "synchronize",
    ]:
        ours = inspect.signature(getattr(col, name)).parameters
        theirs = inspect.signature(getattr(ray_collective, name)).parameters
        positional = [p for p in ours.values() if p.kind is not p.KEYWORD_ONLY]
        assert [p.name for p in positional] == list(theirs), name
        assert all(ours[p].default == theirs[p].default for p in theirs if p != "op"), name
        assert name in col.__all__


@needs_no_gpu
def test_synchronize_without_a_gpu_says_what_to_install() -> None:
    with pytest.raises(ValueError, match="gpu_id must be at least 0, got -1"):
        col.synchronize(-1)
    with pytest.raises(CollectiveError, match=r"pip install cupy-cuda12x .*ray-collective\[nccl\]"):
        col.synchronize(0)
