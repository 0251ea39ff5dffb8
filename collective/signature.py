"""The signature of an op call: a fixed-size int64 list that ranks compare before the op.

A signature holds the op, dtype, shape, root, reduce op, list length and, for
alltoall, the element count per peer, then the kind of this rank's own argument
error (0: none) and its message's length. ``checked.CheckedGroup`` exchanges them;
this module builds them and says how they differ.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import Any

from collective.tensor import DTYPES, spec
from collective.types import ArgumentError, ArgumentTypeError, ArgumentValueError, ReduceOp

OPS = (
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
"""Every op a signature names; an op's code is its index."""
DTYPE_NAMES = sorted(DTYPES)
"""Every dtype a signature names; a dtype's code is its index."""
_MAX_DIMS = 8
UNSET = -1
"""The value of a slot that the op does not use."""
# Slots of the fixed part: op, dtype, shape crc, ndim, dims..., root, reduce op, list length,
# then the kind of this rank's own argument error (0: none) and its message's length.
_OP, _DTYPE, _CRC, _NDIM = 0, 1, 2, 3
_DIMS = 4
_ROOT, _REDUCE, _COUNT = _DIMS + _MAX_DIMS, _DIMS + _MAX_DIMS + 1, _DIMS + _MAX_DIMS + 2
_ERROR, _LENGTH = _COUNT + 1, _COUNT + 2
_FIXED = _LENGTH + 1
_ERRORS: tuple[type[ArgumentError], ...] = (ArgumentValueError, ArgumentTypeError)
"""An argument error's kind is its index here, plus one."""
_MAX_MESSAGE = 4096
"""The longest error message sent to the other ranks, in bytes."""


def blank(op: str, world_size: int) -> list[int]:
    """Return the signature of ``op`` with nothing else set, for a group of ``world_size``."""
    slots = [UNSET] * (_FIXED + 2 * world_size)
    slots[_OP] = OPS.index(op)
    slots[_ERROR], slots[_LENGTH] = 0, 0
    return slots


def of_call(
    op: str,
    world_size: int,
    x: Any,
    root: int = UNSET,
    reduce_op: ReduceOp | None = None,
    count: int = UNSET,
) -> list[int]:
    """Return the signature of ``op`` on buffer ``x`` (None: no buffer) with these arguments."""
    slots = blank(op, world_size)
    if x is not None:
        _encode_tensor(slots, x)
    slots[_ROOT] = root
    slots[_REDUCE] = reduce_op.value if reduce_op is not None else UNSET
    slots[_COUNT] = count
    return slots


def of_alltoall(world_size: int, outputs: Sequence[Any], inputs: Sequence[Any]) -> list[int]:
    """Return the signature of an alltoall: the dtype, and each peer's element counts."""
    slots = blank("alltoall", world_size)
    if inputs:
        _encode_tensor(slots, inputs[0])
        slots[_NDIM], slots[_CRC] = UNSET, UNSET
        slots[_DIMS : _DIMS + _MAX_DIMS] = [UNSET] * _MAX_DIMS
    slots[_COUNT] = len(inputs)
    n = world_size
    if len(inputs) == n and len(outputs) == n:
        slots[_FIXED : _FIXED + n] = [_numel(x) for x in inputs]
        slots[_FIXED + n :] = [_numel(x) for x in outputs]
    return slots


def failed(slots: Sequence[int]) -> bool:
    """Return whether the rank of ``slots`` failed its own argument checks."""
    return bool(slots[_ERROR])


def error_length(slots: Sequence[int]) -> int:
    """Return the length of the error message that ``slots``' rank sends (0 without one)."""
    return slots[_LENGTH]


def _encode_tensor(slots: list[int], x: Any) -> None:
    described = spec(x, "tensor")
    slots[_DTYPE] = DTYPE_NAMES.index(described.dtype)
    slots[_NDIM] = len(described.shape)
    slots[_CRC] = zlib.crc32(repr(described.shape).encode())
    for i, dim in enumerate(described.shape[:_MAX_DIMS]):
        slots[_DIMS + i] = dim


def _numel(x: Any) -> int:
    count = 1
    for dim in spec(x, "tensor").shape:
        count *= dim
    return count


def _shape(slots: Sequence[int]) -> str:
    ndim = slots[_NDIM]
    dims = [str(d) for d in slots[_DIMS : _DIMS + min(ndim, _MAX_DIMS)]]
    if ndim > _MAX_DIMS:
        dims.append(f"... ({ndim} dims, crc {slots[_CRC]})")
    return "(" + ", ".join(dims) + ("," if ndim == 1 else "") + ")"


_FIELDS = {
    "op": lambda s: OPS[s[_OP]],
    "dtype": lambda s: DTYPE_NAMES[s[_DTYPE]] if s[_DTYPE] != UNSET else "none",
    "shape": lambda s: _shape(s) if s[_NDIM] != UNSET else "none",
    "root": lambda s: str(s[_ROOT]) if s[_ROOT] != UNSET else "none",
    "reduce op": lambda s: ReduceOp(s[_REDUCE]).name if s[_REDUCE] != UNSET else "none",
    "list length": lambda s: str(s[_COUNT]) if s[_COUNT] != UNSET else "none",
}


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def mark_error(slots: list[int], error: ArgumentError | None) -> bytes:
    """Put ``error``'s kind and message length into ``slots``; return the encoded message."""
    if error is None:
        slots[_ERROR], slots[_LENGTH] = 0, 0
        return b""
    kind = next((i for i, cls in enumerate(_ERRORS) if isinstance(error, cls)), 0)
    message = str(error).encode(errors="replace")[:_MAX_MESSAGE]
    slots[_ERROR], slots[_LENGTH] = kind + 1, len(message)
    return message


def argument_error(
    op: str, group_name: str, signatures: Sequence[Sequence[int]], messages: Sequence[bytes]
) -> ArgumentError:
    """Return the error every rank raises when some ranks' own argument checks failed."""
    failed = [r for r, s in enumerate(signatures) if s[_ERROR]]
    texts = [messages[r][: signatures[r][_LENGTH]].decode(errors="replace") for r in failed]
    cls = _ERRORS[signatures[failed[0]][_ERROR] - 1]
    if len(failed) == 1:
        detail = f"rank {failed[0]} passed an invalid argument: {texts[0]}"
    else:
        detail = "ranks passed invalid arguments: " + "; ".join(
            f"rank {r}: {t}" for r, t in zip(failed, texts, strict=True)
        )
    return cls(f"{op} on group {group_name!r}: {detail}")


def describe_mismatch(signatures: Sequence[Sequence[int]], world_size: int) -> list[str]:
    """Return one line per way the ranks' signatures differ; empty when they agree."""
    lines = differences([{f: show(s[:_FIXED]) for f, show in _FIELDS.items()} for s in signatures])
    if lines or signatures[0][_OP] != OPS.index("alltoall"):
        return lines
    sends = [s[_FIXED : _FIXED + world_size] for s in signatures]
    recvs = [s[_FIXED + world_size : _FIXED + 2 * world_size] for s in signatures]
    return unpaired(sends, recvs, "elements")


def differences(shown: Sequence[Mapping[str, str]]) -> list[str]:
    """Return one line per field whose value differs among the ranks; ``shown[r]`` is rank r's.

    A line reads ``"dtype: float32 on rank 0, float64 on ranks [1, 2]"``.
    """
    lines = []
    for field in shown[0]:
        by_value: dict[str, list[int]] = {}
        for rank, values in enumerate(shown):
            by_value.setdefault(values[field], []).append(rank)
        if len(by_value) > 1:
            parts = ", ".join(f"{v} on {_ranks(r)}" for v, r in by_value.items())
            lines.append(f"{field}: {parts}")
    return lines


def unpaired(
    sends: Sequence[Sequence[int]], recvs: Sequence[Sequence[int]], unit: str
) -> list[str]:
    """Return one line per pair of ranks whose alltoall sizes differ; empty when all pair up.

    ``sends[i][j]`` is what rank i sends rank j, ``recvs[i][j]`` what rank i expects
    from rank j, both counted in ``unit``.
    """
    lines = []
    n = len(sends)
    for i in range(n):
        for j in range(n):
            if recvs[i][j] != sends[j][i]:
                lines.append(
                    f"rank {i} expects {recvs[i][j]} {unit} from rank {j}, "
                    f"which sends it {sends[j][i]}"
                )
    return lines


def describe_pair(
    op: str, mine: Sequence[int], other: Sequence[int], rank: int, peer: int
) -> list[str]:
    """Return one line per way a send and a recv between ``rank`` and ``peer`` differ."""
    lines = []
    if OPS[other[_OP]] != ("recv" if op == "send" else "send") or other[_ROOT] != rank:
        lines.append(f"rank {peer} called {OPS[other[_OP]]} with peer {other[_ROOT]}")
    for field in ("dtype", "shape"):
        a, b = _FIELDS[field](mine), _FIELDS[field](other)
        if a != b:
            lines.append(f"{field}: {a} on rank {rank}, {b} on rank {peer}")
    return lines
