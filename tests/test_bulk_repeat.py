"""A bulk call that repeats an earlier one skips its per-tensor checks, and never copies wrongly.

Each test calls the same bulk call several times on the same tensors, as a trainer
sends its weights every step, changing the values between calls, and compares every
rank's every tensor bit for bit with the source's. The second call must take the
kept description (its per-tensor checks do not run), and any change of a rank's
tensors (replaced, resized, re-typed, keys, grad flag) must be seen: the new memory
is written, or every rank raises and nothing is written.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from collective.bulk import calls, local
from collective.groups.base import BaseGroup
from collective.types import ArgumentValueError, ReduceOp
from tests.test_bulk import TRANSPORTS, run

DTYPES = (torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.int8, torch.bool)


def _model(rank: int, step: int) -> dict[str, torch.Tensor]:
    """Return a state dict of many dtypes, with views of one flat buffer and a tied weight.

    The source's values depend on ``step``; a receiver holds zeros.
    """
    gen = torch.Generator().manual_seed(step)
    flat = torch.zeros(1000, dtype=torch.float32)
    sd: dict[str, torch.Tensor] = OrderedDict()
    sd["flat.a"], sd["flat.b"], sd["flat.c"] = flat[:300].view(10, 30), flat[300:700], flat[700:]
    for i, dtype in enumerate(DTYPES):
        sd[f"w{i}"] = torch.zeros((7, i + 3), dtype=dtype)
    sd["empty"] = torch.zeros(0)
    sd["tied"] = sd["w0"]
    if rank == 0:
        for name, x in sd.items():
            if name != "tied":
                x.copy_((torch.rand(x.shape, generator=gen) * 100).to(x.dtype))
    return sd


def _bits(x: torch.Tensor) -> np.ndarray:
    return x.contiguous().view(-1).view(torch.uint8).numpy().copy()


def _differ(mine: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in want if not np.array_equal(_bits(mine[k]), _bits(want[k]))]


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the calls of the per-tensor checks (``local.check_buffers``)."""
    counted: list[int] = []
    real = local.check_buffers

    def check_buffers(*args: Any) -> Any:
        counted.append(1)
        return real(*args)

    monkeypatch.setattr(local, "check_buffers", check_buffers)
    return counted


def _refill(sd: dict[str, torch.Tensor], step: int) -> None:
    """Write the source's values of ``step`` into ``sd`` in place."""
    want = _model(0, step)
    with torch.no_grad():
        for name, x in sd.items():
            x.copy_(want[name])


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_repeated_state_dict_skips_the_checks_and_moves_every_step_bit_for_bit(
    world_size: int, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    counted = _counting(monkeypatch)

    def fn(group: BaseGroup, rank: int) -> list[list[str]]:
        sd = _model(rank, 0)
        wrong = []
        for step in range(4):
            if rank == 0:
                _refill(sd, step)
            calls.broadcast_state_dict(group, sd, 0)
            wrong.append(_differ(sd, _model(0, step)))
            assert sd["tied"] is sd["w0"]
        return wrong

    assert run(transport, world_size, fn) == [[[]] * 4] * world_size
    assert len(counted) == world_size, "only the first call checks each tensor"


def test_a_replaced_tensor_is_written_not_the_memory_of_the_old_one() -> None:
    def fn(group: BaseGroup, rank: int) -> list[str]:
        sd = _model(rank, 1)
        calls.broadcast_state_dict(group, sd, 0)
        old = sd["w1"]
        if rank == 2:
            sd["w1"] = torch.zeros_like(old)
        if rank == 0:
            _refill(sd, 2)
        calls.broadcast_state_dict(group, sd, 0)
        wrong = _differ(sd, _model(0, 2))
        if rank == 2 and not torch.equal(old, _model(0, 1)["w1"]):
            wrong.append("the old tensor was written")
        return wrong

    assert run("shm", 4, fn) == [[]] * 4


def test_tensors_freed_and_made_anew_are_written() -> None:
    def fn(group: BaseGroup, rank: int) -> list[list[str]]:
        wrong = []
        for step in range(3):
            sd = _model(rank, step)
            calls.broadcast_state_dict(group, sd, 0)
            wrong.append(_differ(sd, _model(0, step)))
            del sd
        return wrong

    assert run("shm", 4, fn) == [[[]] * 3] * 4


def _change(kind: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def resize(sd: dict[str, torch.Tensor]) -> None:
        sd["w0"].resize_(3, 7)

    def grow(sd: dict[str, torch.Tensor]) -> None:
        sd["w0"].resize_(8, 3)

    def retype(sd: dict[str, torch.Tensor]) -> None:
        sd["w3"].data = sd["w3"].view(torch.float64)

    def key(sd: dict[str, torch.Tensor]) -> None:
        sd["extra"] = torch.zeros(3)

    return {"resize": resize, "grow": grow, "retype": retype, "key": key}[kind]


@pytest.mark.parametrize("kind", ["resize", "grow", "retype", "key"])
@pytest.mark.parametrize("changer", [0, 3])
def test_a_rank_whose_tensors_changed_in_place_makes_every_rank_raise(
    kind: str, changer: int
) -> None:
    def fn(group: BaseGroup, rank: int) -> str:
        sd = _model(rank, 1)
        calls.broadcast_state_dict(group, sd, 0)
        if rank == 0:
            _refill(sd, 2)
        if rank == changer:
            _change(kind)(sd)
        before = {k: _bits(x) for k, x in sd.items()}
        with pytest.raises(ArgumentValueError) as raised:
            calls.broadcast_state_dict(group, sd, 0)
        unchanged = all(np.array_equal(before[k], _bits(x)) for k, x in sd.items())
        assert unchanged, f"rank {rank} was written"
        return str(raised.value)

    messages = run("shm", 4, fn)
    assert len(set(messages)) == 1, messages


@pytest.mark.parametrize("changer", [0, 3])
def test_a_tensor_that_now_requires_grad_moves_as_under_no_grad(changer: int) -> None:
    def fn(group: BaseGroup, rank: int) -> list[str]:
        sd = _model(rank, 1)
        calls.broadcast_state_dict(group, sd, 0)
        if rank == 0:
            _refill(sd, 2)
        if rank == changer:
            sd["w0"].requires_grad_(True)
        calls.broadcast_state_dict(group, sd, 0)
        return _differ(sd, _model(0, 2))

    assert run("shm", 4, fn) == [[]] * 4


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_repeated_lists_broadcast_and_allreduce_bit_for_bit(
    transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    counted = _counting(monkeypatch)

    def fn(group: BaseGroup, rank: int) -> list[bool]:
        xs = list(_model(rank, 3).values())[:-1]
        flat = torch.zeros(64, dtype=torch.int64)
        sums = [flat[:10], flat[10:40], torch.zeros(5, 3, dtype=torch.float64)]
        ok = []
        for step in range(3):
            if rank == 0:
                for x, w in zip(xs, list(_model(0, step).values()), strict=False):
                    x.copy_(w)
            calls.broadcast_tensors(group, xs, 0)
            want = list(_model(0, step).values())
            ok += [torch.equal(x, w) for x, w in zip(xs, want, strict=False)]
            for x in sums:
                x.fill_(rank + step)
            calls.allreduce_tensors(group, sums, ReduceOp.SUM)
            total = sum(r + step for r in range(group.world_size))
            ok += [bool(x.eq(total).all()) for x in sums]
        return ok

    results = run(transport, 4, fn)
    assert all(all(r) for r in results), results
    assert len(counted) == 2 * 4, "each call checks its tensors once per rank"


def test_non_contiguous_tensors_are_checked_and_moved_every_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counted = _counting(monkeypatch)

    def fn(group: BaseGroup, rank: int) -> list[bool]:
        base = torch.zeros(6, 8, dtype=torch.bfloat16)
        sd = {"t": base.t(), "s": torch.zeros(20)[::2]}
        ok = []
        for step in range(3):
            if rank == 0:
                sd["t"].copy_(torch.arange(48).view(8, 6) + step)
                sd["s"].copy_(torch.arange(10) * step)
            calls.broadcast_state_dict(group, sd, 0)
            ok.append(torch.equal(sd["t"], (torch.arange(48).view(8, 6) + step).bfloat16()))
            ok.append(torch.equal(sd["s"], torch.arange(10.0) * step))
        return ok

    assert run("shm", 4, fn) == [[True] * 6] * 4
    assert len(counted) == 3 * 4
