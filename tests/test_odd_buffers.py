"""The ops refuse a torch tensor whose memory does not hold its values, before anything moves.

Such tensors (``odd_tensors.REFUSED``: quantized, sparse, mkldnn, nested, meta;
``odd_tensors.WRAPPED``: a ``DTensor``, a ``FakeTensor``, a ``FunctionalTensor``, a
jagged nested tensor) are refused with a ``TypeError`` naming the argument, what it
is and what to pass, by the single-buffer ops, the list ops and the bulk calls, on the
rank that passes one. Its peers, which passed plain tensors, get its error on a
``check_args`` group and time out on another, their buffers untouched either way.
A ``torch.nn.Parameter`` and a subclass without ``__torch_dispatch__`` keep working.

Ranks are threads meeting on a TCPStore (``test_shm.run_cpu``), their groups
registered under a name so that the public functions run their real call path
(``test_calls.registered``); every test asserts every rank's result.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, cast

import pytest
import torch

import collective as col
from collective.checks import arguments
from collective.frameworks import cuda_buffers, kinds, values
from collective.groups.cpu.group import CpuGroup
from collective.types import ArgumentTypeError, CollectiveTimeoutError
from tests import odd_tensors
from tests.odd_tensors import REFUSED, WRAPPED
from tests.test_calls import registered
from tests.test_shm import run_cpu

KINDS = {**REFUSED, **WRAPPED}
"""Every odd kind, and what its refusal says about it."""

_REFUSAL = "must be a tensor whose memory holds its values, but "


@pytest.fixture(scope="module", autouse=True)
def _world() -> Iterator[None]:
    with odd_tensors.fake_world():
        yield


def _odd(kind: str) -> Any:
    return odd_tensors.refused(kind) if kind in REFUSED else odd_tensors.wrapped(kind)


def _plain(rank: int) -> torch.Tensor:
    return torch.full((4, 3), float(rank + 1))


Case = Callable[[str, int, Any], tuple[Callable[[], Any], list[torch.Tensor]]]
"""``case(name, rank, odd)``: the call rank ``rank`` makes (rank 0 with ``odd`` in it),
and the plain tensors it passes, which must come back unchanged."""


def _allreduce(name: str, rank: int, odd: Any) -> tuple[Callable[[], Any], list[torch.Tensor]]:
    x = odd if rank == 0 else _plain(rank)
    return (lambda: col.allreduce(x, name)), [] if rank == 0 else [x]


def _broadcast(name: str, rank: int, odd: Any) -> tuple[Callable[[], Any], list[torch.Tensor]]:
    x = odd if rank == 0 else _plain(rank)
    return (lambda: col.broadcast(x, 0, name)), [] if rank == 0 else [x]


def _recv(name: str, rank: int, odd: Any) -> tuple[Callable[[], Any], list[torch.Tensor]]:
    if rank == 0:
        return (lambda: col.recv(odd, 1, name)), []
    x = _plain(rank)
    return (lambda: col.send(x, 0, name)), [x]


def _allgather(name: str, rank: int, odd: Any) -> tuple[Callable[[], Any], list[torch.Tensor]]:
    x, outs = _plain(rank), [_plain(5), odd if rank == 0 else _plain(6)]
    return (lambda: col.allgather(outs, x, name)), [x, *outs[: 1 if rank == 0 else 2]]


def _alltoall(name: str, rank: int, odd: Any) -> tuple[Callable[[], Any], list[torch.Tensor]]:
    outs, ins = [_plain(5), _plain(6)], [odd if rank == 0 else _plain(rank), _plain(7)]
    return (lambda: col.alltoall(outs, ins, name)), [*outs, *ins[1 if rank == 0 else 0 :]]


def _allreduce_tensors(
    name: str, rank: int, odd: Any
) -> tuple[Callable[[], Any], list[torch.Tensor]]:
    xs = [_plain(rank), odd if rank == 0 else _plain(7)]
    return (lambda: col.allreduce_tensors(xs, name)), xs[: 1 if rank == 0 else 2]


def _broadcast_state_dict(
    name: str, rank: int, odd: Any
) -> tuple[Callable[[], Any], list[torch.Tensor]]:
    entries = {"b": _plain(rank), "w": odd if rank == 0 else _plain(7)}
    kept = [entries["b"]] if rank == 0 else list(entries.values())
    return (lambda: col.broadcast_state_dict(entries, 0, name)), kept


CASES: dict[str, tuple[str, Case]] = {
    "allreduce": ("tensor", _allreduce),
    "broadcast from it": ("tensor", _broadcast),
    "recv into it": ("tensor", _recv),
    "allgather into it": ("tensor_list[1]", _allgather),
    "alltoall from it": ("input_tensor_list[0]", _alltoall),
    "allreduce_tensors": ("tensors[1]", _allreduce_tensors),
    "broadcast_state_dict": ("state_dict['w']", _broadcast_state_dict),
}
"""Each op rank 0 passes an odd tensor to, as what argument, and what every rank calls."""


def _refusals(name: str, rank: int, odd: Any) -> dict[str, tuple[str, str, bool]]:
    """Run every case; return, per case, the error's type and message, and whether the
    plain tensors came back unchanged."""
    seen = {}
    for case, (_, make) in CASES.items():
        call, mine = make(name, rank, odd)
        before = [t.clone() for t in mine]
        try:
            call()
            error: BaseException | None = None
        except Exception as exc:
            error = exc
        same = all(torch.equal(a, b) for a, b in zip(before, mine, strict=True))
        seen[case] = (type(error).__name__, str(error), same)
    return seen


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_op_refuses_an_odd_tensor_and_its_peer_gets_the_error(kind: str) -> None:
    odd = _odd(kind)

    def fn(name: str, group: CpuGroup, rank: int) -> tuple[dict[str, Any], str, list[float]]:
        seen = _refusals(name, rank, odd)
        both = _odd(kind) if rank == 1 else odd
        with pytest.raises(ArgumentTypeError) as raised:
            col.allreduce(both, name)
        x = _plain(rank)
        col.allreduce(x, name)  # the group is still usable on every rank
        return seen, str(raised.value), x.flatten().tolist()

    results = run_cpu(2, registered(fn, checked=True))
    for rank, (seen, both, after) in enumerate(results):
        for other in (0, 1):
            assert re.search(f"rank {other}: tensor {_REFUSAL}{KINDS[kind]}", both), both
        assert after == [3.0] * 12
        for case, (argument, _) in CASES.items():
            kind_name, message, same = seen[case]
            assert kind_name == "ArgumentTypeError", (rank, case, kind_name, message)
            assert same, (rank, case, "a plain tensor was written")
            text = re.escape(argument) + " " + _REFUSAL + KINDS[kind]
            assert re.search(f"rank 0 passed an invalid argument: {text}", message), message


def test_a_peer_without_check_args_times_out_untouched() -> None:
    odd = _odd("dtensor")
    timeout = timedelta(seconds=2)

    def fn(name: str, group: CpuGroup, rank: int) -> tuple[str, str, float, list[float]]:
        x = odd if rank == 0 else _plain(rank)
        start = time.monotonic()
        try:
            col.allreduce(x, name, timeout=timeout)
            error: BaseException | None = None
        except Exception as exc:
            error = exc
        elapsed = time.monotonic() - start
        kept = [] if rank == 0 else x.flatten().tolist()
        return type(error).__name__, str(error), elapsed, kept

    (kind0, text0, elapsed0, _), (kind1, text1, elapsed1, kept1) = run_cpu(2, registered(fn))
    assert kind0 == "ArgumentTypeError" and re.match(f"tensor {_REFUSAL}", text0), text0
    assert elapsed0 < 1.5
    assert kind1 == CollectiveTimeoutError.__name__, text1
    assert timeout.total_seconds() - 0.5 < elapsed1 < timeout.total_seconds() + 10
    assert kept1 == [2.0] * 12


class _Marked(torch.Tensor):
    """A subclass without ``__torch_dispatch__``: it shares a plain tensor's memory."""


def test_a_parameter_and_a_plain_subclass_still_work() -> None:
    def fn(name: str, group: CpuGroup, rank: int) -> list[list[float]]:
        p = torch.nn.Parameter(torch.full((3,), rank + 1.0), requires_grad=False)
        m = torch.full((3,), rank + 1.0).as_subclass(_Marked)
        outs = [torch.zeros(3).as_subclass(_Marked), torch.zeros(3)]
        for _ in range(2):  # a first call, and one of the same signature
            col.allreduce(p, name)
            col.allgather(outs, m, name)
        col.allreduce_tensors([p, m], name)
        assert type(p) is torch.nn.Parameter and type(m) is _Marked
        return [p.tolist(), m.tolist(), outs[0].tolist(), outs[1].tolist()]

    for got in run_cpu(2, registered(fn)):
        assert got == [[12.0] * 3, [3.0] * 3, [1.0] * 3, [2.0] * 3]


@pytest.mark.parametrize("kind", list(KINDS))
def test_what_a_refusal_says(kind: str) -> None:
    odd = _odd(kind)
    with pytest.raises(ArgumentTypeError, match=f"^x {_REFUSAL}{KINDS[kind]}"):
        values.check_values(odd, "x")
    assert re.match(KINDS[kind], values.not_values(odd))


def test_a_multigpu_list_refuses_an_odd_tensor_before_its_group_looks_at_it() -> None:
    odd, no_group = _odd("dtensor"), cast(Any, None)
    with pytest.raises(ArgumentTypeError, match=rf"^tensor_list\[0\] {_REFUSAL}"):
        arguments.check_gpu_tensor_list(no_group, [odd, torch.ones(2)], "tensor_list")


def test_plain_tensors_views_and_subclasses_hold_their_values() -> None:
    z = torch.randn(4, dtype=torch.complex64)
    for t in (
        torch.ones(2),
        torch.ones(4, 2).t(),
        torch.ones(4).expand(2, 4),
        z.conj().imag,  # a negative view: staged, not refused
        torch.nn.Parameter(torch.ones(2)),
        torch.ones(2).as_subclass(_Marked),
    ):
        assert values.not_values(t) == ""
    with pytest.raises(ArgumentTypeError, match="unsupported dtype complex64"):
        kinds.spec(z.conj(), "tensor")  # a conjugate view: no complex dtype moves


def test_a_fake_cuda_tensor_is_refused_as_a_gpu_buffer() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(4, 3, device="cuda")
    with pytest.raises(ArgumentTypeError, match=f"^tensor {_REFUSAL}{WRAPPED['fake tensor']}"):
        cuda_buffers.cuda_buffer(fake, "tensor")
