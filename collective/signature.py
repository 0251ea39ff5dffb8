"""The signature of an op call: one encoding that every transport compares among its ranks.

A call (``Call``) is the op, dtype, element count, root, reduce op, list length and
shape, and for alltoall the elements to and from each peer. ``encode`` writes it
as int64 words in one fixed layout: words 0-5 (``CORE``) the op, dtype, elements,
root, reduce op and list length; 6-15 the shape (its dims count, a crc of it, its
first 8 dims); 16-17 this rank's own argument error (its kind, 0: none, and its
message's length); from 18 (``FIXED``) on, alltoall's elements to each peer, then
from each peer.

Ops, dtypes and reduce ops are their codes: an op's index in ``OPS``, a dtype's
in ``frameworks.dtypes.TABLE``, a reduce op's ``ReduceOp`` value; ``UNSET`` marks a
field the op does not use. ``checked.CheckedGroup`` allgathers the whole words,
the Gloo agreement the ``CORE`` words, NCCL's mismatch check the ``FIXED`` words,
and a shared-memory step header ``pack``s the op, dtype, reduce op and root into
one word. A mismatch is told the same way on every transport: ``shown`` names a
call's fields, ``differences`` the fields on which ranks differ.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from collective.frameworks.dtypes import CODES, ITEMSIZE, NAMES
from collective.frameworks.kinds import spec
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
    "relay",
)
"""Every op a signature names; an op's code is its index. ``relay`` is the shared-memory
transport's copy between two local ranks, a piece of an op that spans nodes."""
OP_CODES = {name: code for code, name in enumerate(OPS)}
"""The code of each op name."""
UNSET = -1
"""The value of a word that the op does not use."""

OP, DTYPE, COUNT, ROOT, REDUCE, LENGTH = range(6)
CORE = 6
"""The words of the fields every transport compares."""
NDIM, CRC, DIMS = 6, 7, 8
MAX_DIMS = 8
"""The dims a signature holds; a longer shape is told apart by its crc."""
ERROR, MESSAGE = DIMS + MAX_DIMS, DIMS + MAX_DIMS + 1
FIXED = MESSAGE + 1
"""The words of every signature; an alltoall's has ``2 * world_size`` more."""
FIELD_OF_WORD = (
    ("op", "dtype", "elements", "root", "reduce op", "list length")
    + ("shape",) * (2 + MAX_DIMS)
    + ("argument error",) * 2
)
"""The field each of the ``FIXED`` words belongs to."""

_ERRORS: tuple[type[ArgumentError], ...] = (ArgumentValueError, ArgumentTypeError)
"""An argument error's kind is its index here, plus one."""
_MAX_MESSAGE = 4096
"""The longest error message sent to the other ranks, in bytes."""
_MAX_CACHED = 1024
"""Encodings kept at most; the cache starts afresh when a new one would exceed this."""


@dataclass(frozen=True)
class Call:
    """One rank's call as the other ranks must see it too.

    ``count`` is the elements of the buffer every rank passes (the input of
    allgather and gather, the output of reducescatter and scatter); ``length`` the
    buffers in the op's list where every rank has one. ``sends`` and ``receives``
    are alltoall's elements to and from each peer (of the one dtype the ranks agree on).
    """

    op: str
    dtype: str | None = None
    count: int = UNSET
    root: int = UNSET
    reduce_op: ReduceOp | None = None
    length: int = UNSET
    shape: tuple[int, ...] | None = None
    sends: tuple[int, ...] = ()
    receives: tuple[int, ...] = ()

    def nbytes(self) -> int:
        """Return the bytes of the buffer every rank passes (0 without one)."""
        return 0 if self.dtype is None else self.count * ITEMSIZE[self.dtype]


_ENCODED: dict[tuple[Call, int], tuple[int, ...]] = {}


def encode(call: Call, world_size: int = 0) -> tuple[int, ...]:
    """Return the words of ``call`` in a group of ``world_size`` ranks; made once per call.

    An alltoall's per-peer elements are there when ``call`` has one per rank.
    """
    words = _ENCODED.get((call, world_size))
    if words is None:
        if len(_ENCODED) >= _MAX_CACHED:
            _ENCODED.clear()
        words = _ENCODED[(call, world_size)] = _encoded(call, world_size)
    return words


def _encoded(call: Call, world_size: int) -> tuple[int, ...]:
    words = [UNSET] * (FIXED + 2 * world_size)
    words[OP] = OP_CODES[call.op]
    words[DTYPE] = UNSET if call.dtype is None else CODES[call.dtype]
    words[COUNT], words[ROOT], words[LENGTH] = call.count, call.root, call.length
    words[REDUCE] = UNSET if call.reduce_op is None else call.reduce_op.value
    if call.shape is not None:
        words[NDIM] = len(call.shape)
        words[CRC] = zlib.crc32(repr(call.shape).encode())
        for i, dim in enumerate(call.shape[:MAX_DIMS]):
            words[DIMS + i] = dim
    words[ERROR], words[MESSAGE] = 0, 0
    if len(call.sends) == world_size and len(call.receives) == world_size:
        words[FIXED:] = [*call.sends, *call.receives]
    return tuple(words)


def decode(words: Sequence[int], world_size: int = 0) -> Call:
    """Return the call whose words are ``words`` (``CORE`` words or more); see ``encode``.

    A shape of more than ``MAX_DIMS`` dims decodes to None: its words hold only its crc.
    """

    def word(i: int) -> int:
        return int(words[i]) if i < len(words) else UNSET

    ndim = word(NDIM)
    shape = None
    if 0 <= ndim <= MAX_DIMS:
        shape = tuple(int(d) for d in words[DIMS : DIMS + ndim])
    tail = [int(w) for w in words[FIXED : FIXED + 2 * world_size]]
    return Call(
        OPS[word(OP)],
        None if word(DTYPE) == UNSET else NAMES[word(DTYPE)],
        word(COUNT),
        word(ROOT),
        None if word(REDUCE) == UNSET else ReduceOp(word(REDUCE)),
        word(LENGTH),
        shape,
        tuple(tail[:world_size]),
        tuple(tail[world_size:]),
    )


_PACKED = ((OP, 0, 8), (DTYPE, 8, 8), (REDUCE, 16, 8), (ROOT, 24, 38))
"""The (word, first bit, bits) of each field ``pack`` keeps, each stored plus one."""
PACKED_WORDS = tuple(i for i, _, _ in _PACKED)
"""The words whose fields ``pack`` keeps: op, dtype, reduce op, root."""
PACKED_FREE_BIT = 1 << 62
"""A bit of a packed word that no field uses, for its user's own flag."""


def pack(words: Sequence[int]) -> int:
    """Return the op, dtype, reduce op and root of ``words`` packed into one int64."""
    return sum((words[i] + 1) << shift for i, shift, _ in _PACKED)


def unpack(word: int) -> list[int]:
    """Return the ``CORE`` words that ``pack`` packed into ``word``; the others UNSET."""
    words = [UNSET] * CORE
    for i, shift, bits in _PACKED:
        words[i] = ((word >> shift) & ((1 << bits) - 1)) - 1
    return words


def blank(op: str, world_size: int) -> list[int]:
    """Return the signature of ``op`` with nothing else set, for a group of ``world_size``."""
    return list(encode(Call(op), world_size))


def of_call(
    op: str,
    world_size: int,
    x: Any,
    root: int = UNSET,
    reduce_op: ReduceOp | None = None,
    length: int = UNSET,
) -> list[int]:
    """Return the signature of ``op`` on buffer ``x`` (None: no buffer) with these arguments."""
    if x is None:
        return list(encode(Call(op, None, UNSET, root, reduce_op, length), world_size))
    described = spec(x, "tensor")
    shape = described.shape
    call = Call(op, described.dtype, math.prod(shape), root, reduce_op, length, shape)
    return list(encode(call, world_size))


def of_alltoall(world_size: int, outputs: Sequence[Any], inputs: Sequence[Any]) -> list[int]:
    """Return the signature of an alltoall: the dtype, and each peer's element counts."""
    dtype = spec(inputs[0], "tensor").dtype if inputs else None
    sends: tuple[int, ...] = ()
    receives: tuple[int, ...] = ()
    if len(inputs) == world_size and len(outputs) == world_size:
        sends = tuple(math.prod(spec(x, "tensor").shape) for x in inputs)
        receives = tuple(math.prod(spec(x, "tensor").shape) for x in outputs)
    call = Call("alltoall", dtype, length=len(inputs), sends=sends, receives=receives)
    return list(encode(call, world_size))


def failed(slots: Sequence[int]) -> bool:
    """Return whether the rank of ``slots`` failed its own argument checks."""
    return bool(slots[ERROR])


def error_length(slots: Sequence[int]) -> int:
    """Return the length of the error message that ``slots``' rank sends (0 without one)."""
    return slots[MESSAGE]


def mark_error(slots: list[int], error: ArgumentError | None) -> bytes:
    """Put ``error``'s kind and message length into ``slots``; return the encoded message."""
    if error is None:
        slots[ERROR], slots[MESSAGE] = 0, 0
        return b""
    kind = next((i for i, cls in enumerate(_ERRORS) if isinstance(error, cls)), 0)
    message = str(error).encode(errors="replace")[:_MAX_MESSAGE]
    slots[ERROR], slots[MESSAGE] = kind + 1, len(message)
    return message


def argument_error(
    op: str, group_name: str, signatures: Sequence[Sequence[int]], messages: Sequence[bytes]
) -> ArgumentError:
    """Return the error every rank raises when some ranks' own argument checks failed."""
    failed = [r for r, s in enumerate(signatures) if s[ERROR]]
    texts = [messages[r][: signatures[r][MESSAGE]].decode(errors="replace") for r in failed]
    cls = _ERRORS[signatures[failed[0]][ERROR] - 1]
    if len(failed) == 1:
        detail = f"rank {failed[0]} passed an invalid argument: {texts[0]}"
    else:
        detail = "ranks passed invalid arguments: " + "; ".join(
            f"rank {r}: {t}" for r, t in zip(failed, texts, strict=True)
        )
    return cls(f"{op} on group {group_name!r}: {detail}")


def value(field: str, code: int) -> str:
    """Return how a message shows ``code``, one word of ``field`` (not the shape)."""
    if code == UNSET:
        return "none"
    if field == "op":
        return OPS[code] if 0 <= code < len(OPS) else f"unknown op {code}"
    if field == "dtype":
        return NAMES[code] if 0 <= code < len(NAMES) else f"unknown dtype {code}"
    if field == "reduce op":
        known = code in ReduceOp._value2member_map_
        return ReduceOp(code).name if known else f"unknown reduce op {code}"
    return str(code)


def _shape(words: Sequence[int]) -> str:
    ndim = words[NDIM]
    if ndim == UNSET:
        return "none"
    dims = [str(d) for d in words[DIMS : DIMS + min(ndim, MAX_DIMS)]]
    if ndim > MAX_DIMS:
        dims.append(f"... ({ndim} dims, crc {words[CRC]})")
    return "(" + ", ".join(dims) + ("," if ndim == 1 else "") + ")"


def shown(words: Sequence[int]) -> dict[str, str]:
    """Return the fields of one rank's words as a mismatch's message names them.

    ``words`` holds at least the ``CORE`` words; with ``FIXED`` or more the shape too.
    """
    fields = {name: value(name, words[i]) for i, name in enumerate(FIELD_OF_WORD[:CORE])}
    if len(words) >= FIXED:
        fields["shape"] = _shape(words)
    return fields


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def differences(
    fields: Sequence[Mapping[str, str]], ranks: Sequence[int] | None = None
) -> list[str]:
    """Return one line per field whose value differs among the ranks.

    ``fields[i]`` is the fields of rank ``ranks[i]`` (of rank i without ``ranks``),
    as ``shown`` gives them. A line reads ``"dtype: float32 on rank 0, float64 on ranks [1, 2]"``.
    """
    names = list(ranks) if ranks is not None else list(range(len(fields)))
    lines = []
    for field in fields[0]:
        by_value: dict[str, list[int]] = {}
        for rank, values in zip(names, fields, strict=True):
            by_value.setdefault(values[field], []).append(rank)
        if len(by_value) > 1:
            parts = ", ".join(f"{v} on {_ranks(r)}" for v, r in by_value.items())
            lines.append(f"{field}: {parts}")
    return lines


def mismatch(op: str, group_name: str, lines: Sequence[str], who: str = "the ranks") -> str:
    """Return the message of ``op``'s ranks (``who``) whose calls differ in ``lines``."""
    return f"{op} on group {group_name!r}: {who} passed different arguments; " + "; ".join(lines)


def describe_mismatch(signatures: Sequence[Sequence[int]], world_size: int) -> list[str]:
    """Return one line per way the ranks' signatures differ; empty when they agree."""
    lines = differences([shown(s[:FIXED]) for s in signatures])
    if lines or signatures[0][OP] != OP_CODES["alltoall"]:
        return lines
    sends = [s[FIXED : FIXED + world_size] for s in signatures]
    recvs = [s[FIXED + world_size : FIXED + 2 * world_size] for s in signatures]
    return unpaired(sends, recvs)


def unpaired(
    sends: Sequence[Sequence[int]], recvs: Sequence[Sequence[int]], ranks: Sequence[int] = ()
) -> list[str]:
    """Return one line per pair of ranks whose alltoall elements differ; empty when all pair up.

    ``sends[i][j]`` is what rank i sends rank j, ``recvs[i][j]`` what rank i expects
    from rank j; ``ranks`` names the ranks (their indices without it).
    """
    n = len(sends)
    name = list(ranks) or list(range(n))
    return [
        f"rank {name[i]} expects {recvs[i][j]} elements from rank {name[j]}, "
        f"which sends it {sends[j][i]}"
        for i in range(n)
        for j in range(n)
        if recvs[i][j] != sends[j][i]
    ]


def describe_pair(
    op: str, mine: Sequence[int], other: Sequence[int], rank: int, peer: int
) -> list[str]:
    """Return one line per way a send and a recv between ``rank`` and ``peer`` differ."""
    lines = []
    theirs = value("op", other[OP])
    if theirs != ("recv" if op == "send" else "send") or other[ROOT] != rank:
        lines.append(f"rank {peer} called {theirs} with peer {other[ROOT]}")
    lines += differences([_dtype_shape(mine), _dtype_shape(other)], [rank, peer])
    return lines


def _dtype_shape(words: Sequence[int]) -> dict[str, str]:
    return {"dtype": value("dtype", words[DTYPE]), "shape": _shape(words)}


def describe(call: Call) -> str:
    """Return ``call`` in a few words, e.g. ``reduce (SUM) of 8 int8 elements with root 1``."""
    parts = [call.op]
    if call.reduce_op is not None:
        parts.append(f"({call.reduce_op.name})")
    if call.dtype is not None:
        count = call.count
        parts.append(f"of {count} {call.dtype} element{'' if count == 1 else 's'}")
    if call.root != UNSET:
        parts.append(f"with root {call.root}")
    return " ".join(parts)


def buffer_text(dtype_code: int, nbytes: int) -> str:
    """Return ``nbytes`` of dtype ``dtype_code`` as a buffer, e.g. ``float32[8]``."""
    if not 0 <= dtype_code < len(NAMES):
        return f"{nbytes} bytes of unknown dtype code {dtype_code}"
    name = NAMES[dtype_code]
    return f"{name}[{nbytes // ITEMSIZE[name]}]"


def dtype_code(dtype: str) -> int:
    """Return the code of ``dtype`` (a dtype name), as every signature and header carries it."""
    return CODES[dtype]


def itemsize(dtype: str) -> int:
    """Return the bytes of one element of ``dtype``, a dtype name; 1 for a name not in the table.

    An empty name stands for bytes; the public functions reject other dtypes, but a
    group's own ops move any numpy dtype as bytes.
    """
    return ITEMSIZE.get(dtype, 1)
