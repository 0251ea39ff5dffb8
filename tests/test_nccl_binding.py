"""cupy's real NCCL binding and CUDA runtime without a GPU: what the nccl backend relies on.

The test extras install the real ``cupy-cuda12x`` and ``nvidia-nccl-cu12``. The
unique ID is made and round-trips in the form the installed communicator takes; each
communicator method, called on a communicator that was never initialised, reaches
NCCL with the right argument types and raises TypeError with wrong ones; each CUDA
runtime call the backend makes reaches CUDA, or refuses a wrong type; and NCCL drops
a whole group call in which it refused a call, which ``nccl_comm.discard_group``
relies on. ``tests/test_nccl_contract.py`` checks the backend's own calls on top.
"""

from __future__ import annotations

from typing import Any

import pytest

from collective.groups.nccl.comm import encode_unique_id, unique_id_argument
from tests.nccl_binding import INVALID_ARGUMENT, UNHANDLED_CUDA_ERROR, real_nccl, real_runtime
from tests.nccl_threads import CONTRACT

pytestmark = CONTRACT

D2D = 3
"""``cudaMemcpyDeviceToDevice``."""

COMM = real_nccl.NcclCommunicator
GOOD_ARGS: dict[str, tuple[Any, ...]] = {
    "allReduce": (1 << 40, 1 << 40, 4, 7, 0, 0),
    "reduce": (1 << 40, 1 << 40, 4, 7, 0, 0, 0),
    "broadcast": (1 << 40, 1 << 40, 4, 7, 0, 0),
    "bcast": (1 << 40, 4, 7, 0, 0),
    "allGather": (1 << 40, 1 << 40, 4, 7, 0),
    "reduceScatter": (1 << 40, 1 << 40, 4, 7, 0, 0),
    "send": (1 << 40, 4, 7, 1, 0),
    "recv": (1 << 40, 4, 7, 1, 0),
    "check_async_error": (),
    "device_id": (),
    "rank_id": (),
    "size": (),
}


def test_get_unique_id_round_trips_in_the_form_the_communicator_takes() -> None:
    uid = real_nccl.get_unique_id()
    shared = encode_unique_id(uid)
    assert isinstance(shared, bytes) and len(shared) == 128
    assert unique_id_argument(COMM, shared) == uid
    with pytest.raises(real_nccl.NcclError) as info:
        COMM(1, unique_id_argument(COMM, shared), 0)
    assert info.value.status == UNHANDLED_CUDA_ERROR
    other_form = tuple(shared) if isinstance(uid, bytes) else shared
    with pytest.raises(TypeError, match="commId"):
        COMM(1, other_form, 0)


@pytest.mark.parametrize("method", sorted(GOOD_ARGS))
def test_each_communicator_method_reaches_nccl_and_refuses_wrong_types(method: str) -> None:
    comm = COMM.__new__(COMM)
    with pytest.raises(real_nccl.NcclError) as info:
        getattr(comm, method)(*GOOD_ARGS[method])
    assert info.value.status == INVALID_ARGUMENT
    with pytest.raises(TypeError):
        getattr(comm, method)(*GOOD_ARGS[method], 0)
    if GOOD_ARGS[method]:
        with pytest.raises(TypeError):
            getattr(comm, method)(*GOOD_ARGS[method][:-1], None)


def test_abort_destroy_and_group_calls_reach_nccl() -> None:
    comm = COMM.__new__(COMM)
    comm.abort()
    comm.destroy()
    real_nccl.groupStart()
    real_nccl.groupEnd()
    with pytest.raises(real_nccl.NcclError):
        real_nccl.groupEnd()


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("eventRecord", (0x10, 0x20)),
        ("streamWaitEvent", (0x20, 0x10, 0)),
        ("memcpyAsync", (1 << 40, 2 << 40, 64, D2D, 0x20)),
        ("streamCreateWithFlags", (1,)),
    ],
)
def test_each_runtime_call_reaches_cuda_and_refuses_wrong_types(
    name: str, args: tuple[int, ...]
) -> None:
    with pytest.raises(real_runtime.CUDARuntimeError):
        getattr(real_runtime, name)(*args)
    with pytest.raises(TypeError):
        getattr(real_runtime, name)(*args[:-1], None)


def test_nccl_drops_a_group_in_which_it_refused_a_call() -> None:
    comm = real_nccl.NcclCommunicator.__new__(real_nccl.NcclCommunicator)
    real_nccl.groupStart()
    with pytest.raises(real_nccl.NcclError):
        comm.send(0, 0, 0, 0, 0)
    with pytest.raises(real_nccl.NcclError) as info:
        real_nccl.groupEnd()
    assert info.value.status == INVALID_ARGUMENT
    real_nccl.groupStart()
    real_nccl.groupEnd()
