"""One dtype table and one signature encoding serve every transport's mismatch check.

The table covers every dtype the library accepts (numpy, torch with bfloat16 and
bool); each transport builds its words from ``signature.encode`` (the argument
agreement all of them, Gloo the core, NCCL the fixed part, a shared-memory header a
packed word); a call decodes back from its words; and calls that differ in any one
field give different words on every transport, told in the same field names.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

import collective
from collective import signature
from collective.frameworks import dtypes as table
from collective.frameworks.cuda_buffers import NCCL_DTYPES
from collective.frameworks.kinds import DTYPES, spec
from collective.frameworks.packing import ITEMSIZE
from collective.groups.cpu.group import CpuGroup
from collective.groups.gloo.agree import WIDTH, Records, disagreement
from collective.groups.nccl import mismatch
from collective.groups.shm import steps
from collective.signature import CORE, FIXED, UNSET, Call
from collective.types import FLOAT_DTYPES, AllReduceOptions, CollectiveError, ReduceOp
from tests.test_shm import run_cpu

PUBLIC_OPS = (
    "allreduce",
    "barrier",
    "reduce",
    "broadcast",
    "allgather",
    "reducescatter",
    "send",
    "recv",
    "gather",
    "scatter",
    "alltoall",
    "broadcast_tensors",
    "allreduce_tensors",
    "broadcast_state_dict",
)


def test_the_table_holds_every_dtype_the_library_accepts_with_its_size() -> None:
    assert set(table.NAMES) == DTYPES and len(table.NAMES) == len(DTYPES)
    assert [d.code for d in table.TABLE] == list(range(len(table.TABLE)))
    assert ITEMSIZE == table.ITEMSIZE
    assert set(NCCL_DTYPES) <= DTYPES and FLOAT_DTYPES <= DTYPES
    for name in DTYPES:
        x = torch.zeros(3, dtype=getattr(torch, name))
        assert spec(x, "x").dtype == name
        assert x.element_size() == ITEMSIZE[name] == signature.itemsize(name)
        if name != "bfloat16":
            assert spec(np.zeros(3, dtype=name), "x").dtype == name
            assert np.dtype(name).itemsize == ITEMSIZE[name]


def test_every_public_op_has_a_code() -> None:
    assert set(PUBLIC_OPS) <= set(collective.__all__)
    assert set(PUBLIC_OPS) <= set(signature.OPS)
    assert len(set(signature.OPS)) == len(signature.OPS)
    assert all(signature.OP_CODES[op] == i for i, op in enumerate(signature.OPS))


def _calls() -> list[Call]:
    return [
        Call(op, dtype, 7, 1, reduce_op, 3, (7,))
        for op in signature.OPS
        for dtype in [None, *table.NAMES]
        for reduce_op in [None, *ReduceOp]
    ]


def test_a_call_decodes_from_its_words_and_its_packed_header() -> None:
    for call in _calls():
        words = signature.encode(call)
        assert len(words) == FIXED
        assert signature.decode(words) == call
        packed = signature.unpack(signature.pack(words))
        assert [packed[i] for i in signature.PACKED_WORDS] == [
            words[i] for i in signature.PACKED_WORDS
        ]
    long = Call("allgather", "int8", 512, shape=(2,) * 9)
    assert signature.decode(signature.encode(long)) == dataclasses.replace(long, shape=None)
    a2a = Call("alltoall", "float32", length=3, sends=(1, 2, 3), receives=(4, 5, 6))
    assert signature.decode(signature.encode(a2a, 3), 3) == a2a


def test_an_encoding_is_made_once_per_call() -> None:
    call = Call("reduce", "float32", 8, 1, ReduceOp.MAX)
    assert signature.encode(call) is signature.encode(Call("reduce", "float32", 8, 1, ReduceOp.MAX))


# One field changed at a time: op, dtype, elements, root, reduce op, list length.
_BASE = Call("reduce", "float32", 8, 1, ReduceOp.SUM, 2, (8,))
_CHANGED = {
    "op": dataclasses.replace(_BASE, op="allreduce"),
    "dtype": dataclasses.replace(_BASE, dtype="int32"),
    "elements": dataclasses.replace(_BASE, count=9, shape=(9,)),
    "root": dataclasses.replace(_BASE, root=0),
    "reduce op": dataclasses.replace(_BASE, reduce_op=ReduceOp.MAX),
    "list length": dataclasses.replace(_BASE, length=3),
}


def _checked(call: Call) -> list[int]:
    x = np.zeros(call.shape or (), dtype=call.dtype)
    return signature.of_call(call.op, 2, x, call.root, call.reduce_op, call.length)


def _gloo(call: Call) -> list[int]:
    records = Records(2)
    records.fill(call, None)
    return records.mine[: WIDTH * 8].numpy().view(np.int64).tolist()


def _shm(call: Call) -> tuple[int, int]:
    reduce_op = UNSET if call.reduce_op is None else call.reduce_op.value
    return steps.pack((call.op, call.dtype or "", reduce_op, call.root)), call.nbytes()


def _nccl(call: Call) -> list[int]:
    x = np.zeros(call.shape or (), dtype=call.dtype)
    return mismatch.words(call.op, x, call.root, call.reduce_op).tolist()


def test_each_transport_builds_its_words_from_the_one_encoding() -> None:
    words = signature.encode(_BASE)
    assert _checked(_BASE)[:FIXED] == list(words) and WIDTH == CORE
    assert _gloo(_BASE) == list(words[:CORE])
    assert _shm(_BASE) == (signature.pack(words), _BASE.nbytes())
    one_buffer = signature.encode(dataclasses.replace(_BASE, length=UNSET))
    assert _nccl(_BASE)[1 : mismatch.WORDS] == list(one_buffer) and mismatch.FIELDS == FIXED


@pytest.mark.parametrize("field", list(_CHANGED))
def test_calls_that_differ_in_one_field_differ_on_every_transport(field: str) -> None:
    other = _CHANGED[field]
    assert _checked(other) != _checked(_BASE)
    assert _gloo(other) != _gloo(_BASE)
    if field != "list length":  # a shared-memory op checks list lengths locally
        assert _shm(other) != _shm(_BASE)
    if field != "list length":  # nor does NCCL's check take one: its ops take one buffer
        assert _nccl(other) != _nccl(_BASE)


@pytest.mark.parametrize("field", ["op", "dtype", "elements", "root", "reduce op"])
def test_every_transport_names_the_field_that_differs(field: str) -> None:
    """The argument agreement, Gloo, shared memory and NCCL name a field alike."""
    other = _CHANGED[field]
    mine, theirs = (
        signature.shown(signature.encode(_BASE)),
        signature.shown(signature.encode(other)),
    )
    line = f"{field}: {mine[field]} on rank 0, {theirs[field]} on rank 1"
    checked = signature.describe_mismatch([_checked(_BASE), _checked(other)], 2)
    assert line in checked
    assert line in str(disagreement(_BASE.op, "g", [_gloo(_BASE), _gloo(other)]))
    ranks = [0, 1]
    shm = [steps.describe(*_shm(c), ranks)[1] for c in (_BASE, other)]
    assert line in signature.differences(shm)
    # NCCL's check learns each word's lowest and highest value among the ranks.
    both = np.maximum(np.asarray(_nccl(_BASE)), np.asarray(_nccl(other)))
    word = signature.FIELD_OF_WORD.index(field)
    low, high = sorted([signature.encode(_BASE)[word], signature.encode(other)[word]])
    shown = f"{signature.value(field, low)} .. {signature.value(field, high)}"
    assert f"{field}: {shown}" in mismatch.differences(both)


def test_a_shared_memory_mismatch_names_the_field() -> None:
    def fn(group: CpuGroup, rank: int) -> Any:
        x = np.ones(4, dtype="float32" if rank == 0 else "float64")
        try:
            group.allreduce([x], AllReduceOptions())
        except CollectiveError as exc:
            return str(exc)
        return "returned"

    for message in run_cpu(2, fn):
        assert (
            "dtype: float64 on rank 1, float32 on rank 0" in message
            or "dtype: float32 on rank 0, float64 on rank 1" in message
        ), message
