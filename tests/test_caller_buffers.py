"""An op leaves the caller's buffers as it found them, and takes any timeout a user can pass.

- Torch tensors stay resizable: after every op, on every CPU transport and in the bulk
  calls, each tensor the op touched is resized (``resize_`` and its storage's
  ``resize_``), as code that frees and regrows parameter storage does.
- A lazily negated view (``z.conj().imag``, the negative bit) moves the values it reads,
  on the short path and the general one, on a first call and on a cached one, and
  its result reads right; on a GPU group it is refused before anything is sent.
- A timeout up to ``timedelta.max`` is taken as no practical limit (``LONGEST_TIMEOUT``)
  per call, per ``wait``, at init and as ``gloo_timeout``, on every transport.

Ranks are threads meeting on a TCPStore (``test_shm.run_cpu``), their groups
registered under a name so that the public functions run their real call path
(``test_calls.registered``); every test asserts every rank's result.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch

import collective as col
from collective.checks import arguments
from collective.groups.cpu.group import CpuGroup
from collective.registry.lifecycle import _resolve_timeout
from collective.types import (
    LONGEST_TIMEOUT,
    ArgumentTypeError,
    ArgumentValueError,
    CpuTransport,
    GroupOptions,
)
from tests.test_calls import registered
from tests.test_shm import run_cpu

WHERE: dict[str, dict[str, Any]] = {
    "shm": {},
    "gloo": {"options": GroupOptions(cpu_transport=CpuTransport.GLOO)},
    "two nodes": {"nodes": ["a", "b"]},
}
"""The CPU transports, as ``run_cpu``'s keyword arguments."""

SIZES = {"short": 4, "long": 5000}
"""Elements of a buffer that takes the short path (on shared memory), and of one that does not."""


def _run(where: str, fn: Callable[[str, CpuGroup, int], Any], **kwargs: Any) -> list[Any]:
    return run_cpu(2, registered(fn), **WHERE[where], **kwargs)


def _regrow(x: torch.Tensor) -> None:
    """Free and regrow ``x``'s storage, as FSDP-style code does; raise if torch refuses."""
    n = x.numel()
    x.untyped_storage().resize_(0)
    x.untyped_storage().resize_(n * x.element_size())
    x.resize_(n + 1)


def _every_op(name: str, rank: int, count: int) -> list[torch.Tensor]:
    """Run every op on fresh torch tensors of ``count`` elements; return each tensor it touched."""
    touched = []

    def t(value: float) -> torch.Tensor:
        x = torch.full((count,), float(value))
        touched.append(x)
        return x

    col.allreduce(t(rank), name)
    col.reduce(t(rank), 0, name)
    col.broadcast(t(rank), 1, name)
    col.allgather([t(0), t(0)], t(rank), name)
    col.reducescatter(t(0), [t(rank), t(rank)], name)
    if rank == 0:
        col.send(t(5), 1, name)
    else:
        col.recv(t(0), 0, name)
    col.gather(t(rank), [t(0), t(0)] if rank == 0 else None, 0, name)
    col.scatter(t(0), [t(1), t(2)] if rank == 1 else None, 1, name)
    col.alltoall([t(0), t(0)], [t(rank), t(rank)], name)
    col.alltoall_single(t(0), t(rank), group_name=name)
    col.broadcast_tensors([t(rank), t(rank)], 0, name)
    col.allreduce_tensors([t(rank), t(rank)], name)
    col.broadcast_state_dict({"w": t(rank), "b": t(rank)}, 0, name)
    return touched


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("where", list(WHERE))
def test_every_op_leaves_torch_tensors_resizable(where: str, size: str) -> None:
    def fn(name: str, group: CpuGroup, rank: int) -> list[bool]:
        resizable = []
        for _ in range(2):  # a first call of each key, then a cached one
            for x in _every_op(name, rank, SIZES[size]):
                resizable.append(x.untyped_storage().resizable())
                _regrow(x)
        return resizable

    for rank, resizable in enumerate(_run(where, fn)):
        assert len(resizable) >= 50 and all(resizable), rank


def _negated(values: list[float]) -> torch.Tensor:
    """Return a float32 view that reads ``values`` through the negative bit (``z.conj().imag``)."""
    z = torch.zeros(len(values), dtype=torch.complex64)
    z.imag = -torch.tensor(values)
    view = z.conj().imag
    assert view.is_neg()
    return view


@pytest.mark.parametrize("size", [1, *SIZES.values()])
@pytest.mark.parametrize("where", list(WHERE))
def test_a_negated_view_moves_the_values_it_reads(where: str, size: int) -> None:
    def fn(name: str, group: CpuGroup, rank: int) -> list[list[float]]:
        out = []
        for i in range(3):  # a plain buffer of the same key first, then a negated one, ...
            plain = torch.full((size,), float(rank + 1))
            negated = _negated([float(rank + 1)] * size)
            for x in [plain, negated] if i != 1 else [negated, plain]:
                col.allreduce(x, name)
                out.append(x.tolist())
            # the root reads through the negative bit, the other rank writes through it
            x = _negated([7.0 + i if rank == 0 else 0.0] * size)
            col.broadcast(x, 0, name)
            out.append(x.tolist())
            xs = [_negated([rank + 1.0] * size), torch.full((size,), rank + 1.0)]
            col.allreduce_tensors(xs, name)
            ys = [torch.full((size,), -1.0 - rank), _negated([rank + 2.0] * size)]
            col.broadcast_tensors(ys, 0, name)
            out += [x.tolist() for x in xs + ys]
        return out

    each = ([3.0] * size, [3.0] * size, [-1.0] * size, [2.0] * size)
    want = [v for i in range(3) for v in ([3.0] * size, [3.0] * size, [7.0 + i] * size, *each)]
    assert _run(where, fn) == [want, want]


def test_a_negated_view_reads_right_after_the_op_writes_it() -> None:
    def fn(name: str, group: CpuGroup, rank: int) -> tuple[list[float], list[float]]:
        z = torch.zeros(1, dtype=torch.complex64)
        z.imag = torch.tensor([-float(rank + 1)])
        view = z.conj().imag
        col.allreduce(view, name)
        col.allreduce(view, name)
        return view.tolist(), z.imag.tolist()

    assert _run("shm", fn) == [([6.0], [-6.0]), ([6.0], [-6.0])]


def test_a_gpu_group_refuses_a_negated_view_before_sending() -> None:
    class Gpu:
        device_type = "cuda"

        def check_tensor(self, spec: Any, name: str) -> None:
            pass

    with pytest.raises(ArgumentValueError, match=r"tensor has its negative bit set.*resolve_neg"):
        arguments.check_tensor(Gpu(), _negated([1.0, 2.0]), "tensor")  # type: ignore[arg-type]


HUGE = [timedelta(days=366), timedelta(days=250 * 365), timedelta(days=300 * 365), timedelta.max]


@pytest.mark.parametrize("where", list(WHERE))
def test_any_timeout_works_as_no_practical_limit(where: str) -> None:
    def fn(name: str, group: CpuGroup, rank: int) -> list[list[float]]:
        out = []
        for timeout in HUGE:
            for count in SIZES.values():
                x = np.full(count, rank + 1.0)
                col.allreduce(x, name, timeout=timeout)
                work = col.allreduce(x, name, timeout=timeout, async_op=True)
                assert work is not None
                with pytest.raises(ArgumentTypeError, match=r"must be a datetime\.timedelta"):
                    work.wait(5)  # type: ignore[arg-type]
                work.wait(timeout)
                col.allreduce_tensors([torch.from_numpy(x)], name, timeout=timeout)
                col.barrier(name, timeout=timeout)
                out.append(x[:2].tolist())
        return out

    want = [[12.0, 12.0], [12.0, 12.0]] * len(HUGE)
    assert _run(where, fn, timeout=LONGEST_TIMEOUT) == [want, want]


def test_longer_timeouts_are_bounded_and_bad_ones_refused() -> None:
    for timeout in HUGE:
        assert arguments.check_timeout(timeout) == LONGEST_TIMEOUT
        assert _resolve_timeout(30000, timeout) == LONGEST_TIMEOUT
    for ms in (1e12, 1e300, math.inf):
        assert arguments.check_milliseconds(ms, "gloo_timeout") == LONGEST_TIMEOUT
    assert arguments.check_timeout(timedelta(days=2)) == timedelta(days=2)
    for bad in (timedelta(0), -timedelta(seconds=1)):
        with pytest.raises(ArgumentValueError, match="timeout must be positive"):
            arguments.check_timeout(bad)
    with pytest.raises(ArgumentValueError, match="gloo_timeout must be a positive number"):
        arguments.check_milliseconds(math.nan, "gloo_timeout")
