"""Argument checks shared by the public functions; each raises before any communication.

Every check raises an ``ArgumentValueError`` or ``ArgumentTypeError``: a
``ValueError`` or ``TypeError`` that is also a ``RuntimeError``. An op runs its
checks inside ``checking(group, op)``: on a group built with ``check_args=True``
an argument error of one rank is then raised on every rank alike.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from datetime import timedelta
from types import TracebackType
from typing import Any

from collective.checks.check_args import CheckedGroup
from collective.frameworks import kinds, memory, values
from collective.frameworks.kinds import TensorSpec
from collective.groups.base import BaseGroup
from collective.types import (
    LONGEST_TIMEOUT,
    ArgumentError,
    ArgumentTypeError,
    ArgumentValueError,
    CpuTransport,
    GroupOptions,
    ReduceOp,
    bounded_timeout,
)

_LONGEST_MS = LONGEST_TIMEOUT / timedelta(milliseconds=1)

MAX_GROUP_NAME_BYTES = 8000
"""The longest group name, in UTF-8 bytes. Gloo's keys in the group's TCPStore start
with the name and a 34-byte incarnation prefix, and the TCPStore drops the connection
on a key of 8192 bytes or more; the rest is left for gloo's own key suffixes."""


class ArgumentGuard:
    """Run an op's local argument checks; on a checked group, agree on their failure.

    On a group built with ``check_args=True``, an argument error raised inside the
    block is sent to the other ranks through the signature exchange they are
    about to make for the same op, and every rank raises the same error. On other
    groups the error is raised on this rank only.
    """

    __slots__ = ("_group", "_op", "_peer")

    def __init__(self, group: BaseGroup, op: str, peer: int | None = None) -> None:
        """Guard the checks of ``op`` on ``group``; ``peer`` is the other end of a send/recv."""
        self._group = group
        self._op = op
        self._peer = peer

    def __enter__(self) -> None:
        """Start the checks."""

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Raise an argument error on every rank of a checked group; else let it pass."""
        if isinstance(error, ArgumentError) and isinstance(self._group, CheckedGroup):
            self._group.refuse(self._op, error, self._peer)


def checking(group: BaseGroup, op: str, peer: int | None = None) -> ArgumentGuard:
    """Return the guard that an op's argument checks run in, as a context manager."""
    return ArgumentGuard(group, op, peer)


def check_int(value: Any, name: str) -> int:
    """Return ``value`` as an int if it is one (a numpy integer too, but no bool)."""
    if type(value) is int:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


def check_group_name(group_name: Any) -> str:
    """Return ``group_name`` if it is a non-empty string the group's store can carry."""
    if not isinstance(group_name, str):
        raise ArgumentTypeError(f"group_name must be a str, got {type(group_name).__name__}")
    if not group_name:
        raise ArgumentValueError("group_name must be a non-empty string")
    if len(group_name) * 4 > MAX_GROUP_NAME_BYTES:
        size = len(group_name.encode(errors="surrogatepass"))
        if size > MAX_GROUP_NAME_BYTES:
            raise ArgumentValueError(
                f"group_name must be at most {MAX_GROUP_NAME_BYTES} bytes in UTF-8, got {size}: "
                "the keys of the group's store carry it"
            )
    return group_name


def check_world_size(world_size: Any) -> int:
    """Return ``world_size`` as an int if it is one of at least 1."""
    world_size = check_int(world_size, "world_size")
    if world_size < 1:
        raise ArgumentValueError(f"world_size must be at least 1, got {world_size}")
    return world_size


def check_rank(rank: Any, world_size: int, name: str = "rank") -> int:
    """Return ``rank`` as an int if it lies in ``[0, world_size)``."""
    rank = check_int(rank, name)
    if not 0 <= rank < world_size:
        raise ArgumentValueError(f"{name} must be in [0, {world_size}), got {rank}")
    return rank


def check_peer(rank: Any, group: BaseGroup, name: str) -> int:
    """Return a peer rank for send/recv as an int: in range and not this rank."""
    rank = check_rank(rank, group.world_size, name)
    if rank == group.rank:
        raise ArgumentValueError(f"{name} must name another rank, got this rank ({rank})")
    return rank


def check_permutation(ranks: Any, world_size: int) -> list[int]:
    """Return ``ranks`` as a list of ints if it is a permutation of ``range(world_size)``."""
    if not isinstance(ranks, (list, tuple)):
        raise ArgumentTypeError(f"ranks must be a list of ints, got {type(ranks).__name__}")
    ranks = [check_int(rank, f"ranks[{i}]") for i, rank in enumerate(ranks)]
    if sorted(ranks) != list(range(world_size)):
        raise ArgumentValueError(f"ranks must be a permutation of 0..{world_size - 1}, got {ranks}")
    return ranks


def check_timeout(timeout: Any) -> timedelta | None:
    """Return ``timeout`` if it is None or a positive ``timedelta``, at most ``LONGEST_TIMEOUT``.

    A longer one (``timedelta.max`` included) means no practical limit: it waits
    ``LONGEST_TIMEOUT``, the longest every transport's clock holds.
    """
    return bounded_timeout(timeout)


def check_milliseconds(value: Any, name: str) -> timedelta:
    """Return ``value``, a positive number of milliseconds (int or float), as a timedelta.

    As with ``check_timeout``, more than ``LONGEST_TIMEOUT`` (``math.inf`` included)
    waits ``LONGEST_TIMEOUT``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name} must be a number of ms, got {type(value).__name__}")
    if math.isnan(value) or not float(value) > 0:
        raise ArgumentValueError(f"{name} must be a positive number of ms, got {value}")
    return timedelta(milliseconds=min(float(value), _LONGEST_MS))


def check_tensor(group: BaseGroup, x: Any, name: str) -> TensorSpec:
    """Return the spec of ``x`` if ``group``'s backend can use it (GPU ones: contiguous).

    A torch tensor whose memory does not hold its values (``values.not_values``) is
    refused.
    """
    values.check_values(x, name)
    spec = kinds.spec(x, name)
    group.check_tensor(spec, name)
    if group.device_type == "cuda" and not kinds.is_contiguous(x):
        raise ArgumentValueError(kinds.contiguous_message(x, name, "for NCCL"))
    return spec


def check_tensor_list(
    group: BaseGroup, xs: Any, name: str, like: TensorSpec, length: int
) -> list[Any]:
    """Return ``xs`` as a list of ``length`` buffers of ``like``'s shape and dtype."""
    if not isinstance(xs, (list, tuple)):
        raise ArgumentTypeError(f"{name} must be a list of tensors, got {type(xs).__name__}")
    if len(xs) != length:
        raise ArgumentValueError(
            f"{name} must hold {length} tensors (the world size), got {len(xs)}"
        )
    for i, x in enumerate(xs):
        spec = check_tensor(group, x, f"{name}[{i}]")
        if (spec.shape, spec.dtype) != (like.shape, like.dtype):
            raise ArgumentValueError(
                f"{name}[{i}] is {spec.describe()} but must match tensor, {like.describe()}"
            )
    return list(xs)


def check_disjoint(
    outputs: Sequence[tuple[str, Any]], others: Sequence[tuple[str, Any]] = ()
) -> None:
    """Reject outputs that share memory with each other or with ``others``.

    Args:
        outputs: ``(name, buffer)`` pairs that the op writes.
        others: ``(name, buffer)`` pairs that the op reads.

    Raises:
        ArgumentValueError: two of the buffers overlap, naming both.

    """
    spans = [(name, memory.memory_span(x)) for name, x in outputs]
    other_spans = [(name, memory.memory_span(x)) for name, x in others]
    for i, (name, span) in enumerate(spans):
        for other_name, other in spans[:i] + other_spans:
            if memory.spans_overlap(span, other):
                raise ArgumentValueError(
                    f"{name} and {other_name} share memory; pass distinct buffers"
                )


def check_bool(value: Any, name: str) -> bool:
    """Return ``value`` if it is a bool."""
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_call(timeout: Any, async_op: Any) -> tuple[timedelta | None, bool]:
    """Return the per-call ``(timeout, async_op)`` every op's options end with, checked."""
    return check_timeout(timeout), check_bool(async_op, "async_op")


def check_reduce_op(group: BaseGroup, op: Any, spec: TensorSpec) -> ReduceOp:
    """Return ``op`` as a ``ReduceOp`` if ``group`` can apply it to ``spec``'s dtype."""
    reduce_op = ReduceOp.parse(op)
    group.check_reduce_op(reduce_op, spec.dtype)
    return reduce_op


def check_outputs(
    group: BaseGroup, xs: Any, name: str, like: TensorSpec, length: int, disjoint: bool = False
) -> list[Any]:
    """Return ``xs`` as ``length`` buffers like ``like``: a list, or views of one flat buffer.

    A single contiguous buffer of ``length`` times ``like``'s element count and of
    its dtype stands for the list of its consecutive chunks; writing a chunk writes it.
    With ``disjoint``, the buffers of a list must not share memory (the chunks of
    one buffer never do); pass it for buffers the op writes.
    """
    if not kinds.is_buffer(xs):
        buffers = check_tensor_list(group, xs, name, like, length)
        if disjoint:
            check_disjoint([(f"{name}[{i}]", t) for i, t in enumerate(buffers)])
        return buffers
    spec = check_tensor(group, xs, name)
    count = math.prod(like.shape) * length
    if spec.dtype != like.dtype or math.prod(spec.shape) != count:
        raise ArgumentValueError(
            f"{name} must be a list of {length} tensors or one tensor of {count} "
            f"{like.dtype} elements (world size x tensor), got {spec.describe()}"
        )
    if not kinds.is_contiguous(xs):
        raise ArgumentValueError(
            kinds.contiguous_message(xs, name, "when passed as one flat tensor")
        )
    return kinds.chunks(xs, length, like.shape)


def check_rooted_list(
    group: BaseGroup, xs: Any, name: str, like: TensorSpec, root: int, root_name: str
) -> list[Any]:
    """Return the list a rooted op needs: ``xs`` on the root, nothing on other ranks.

    Raises:
        ArgumentValueError: ``xs`` is missing on the root or given on another rank.

    """
    if group.rank != root:
        if xs is not None:
            raise ArgumentValueError(
                f"{name} must be None on ranks other than {root_name} ({root}), "
                f"got {type(xs).__name__} on rank {group.rank}"
            )
        return []
    if xs is None:
        raise ArgumentValueError(f"{name} is required on {root_name} ({root}), got None")
    return check_outputs(group, xs, name, like, group.world_size)


def check_split_sizes(sizes: Any, rows: int, world_size: int, name: str) -> list[int]:
    """Return ``sizes``, or an even split of ``rows`` when None, as world-size row counts."""
    if sizes is None:
        if rows % world_size:
            raise ArgumentValueError(
                f"{name} is None, so dim 0 ({rows}) must divide by the world size ({world_size})"
            )
        return [rows // world_size] * world_size
    if not isinstance(sizes, (list, tuple)):
        raise ArgumentTypeError(f"{name} must be a list of ints, got {type(sizes).__name__}")
    if len(sizes) != world_size:
        raise ArgumentValueError(
            f"{name} must hold {world_size} sizes (the world size), got {len(sizes)}"
        )
    sizes = [check_non_negative(size, f"{name}[{i}]") for i, size in enumerate(sizes)]
    if sum(sizes) != rows:
        raise ArgumentValueError(
            f"{name} must sum to dim 0 of its tensor ({rows}), got {sum(sizes)}"
        )
    return sizes


def check_multigpu_group(group: BaseGroup, function: str) -> None:
    """Reject a ``*_multigpu`` call on a group whose backend does not drive GPUs."""
    if group.device_type != "cuda":
        raise ArgumentValueError(
            f"{function} needs a group on GPUs (backend='nccl'), but group "
            f"{group.group_name!r} uses the {group.backend_name()} backend"
        )


def check_gpu_tensor_list(group: BaseGroup, xs: Any, name: str) -> list[Any]:
    """Return ``xs`` as a list if it holds at least one tensor that ``group`` takes."""
    if not isinstance(xs, (list, tuple)):
        raise ArgumentTypeError(f"{name} must be a list of tensors, got {type(xs).__name__}")
    if not xs:
        raise ArgumentValueError(f"{name} must hold at least one tensor, got an empty list")
    for i, x in enumerate(xs):
        check_tensor(group, x, f"{name}[{i}]")
    return list(xs)


def check_index(value: Any, length: int, name: str) -> int:
    """Return ``value`` as an int if it is one in ``[0, length)``."""
    value = check_int(value, name)
    if not 0 <= value < length:
        raise ArgumentValueError(f"{name} must be in [0, {length}), got {value}")
    return value


def check_non_negative(value: Any, name: str) -> int:
    """Return ``value`` as an int if it is one of at least 0."""
    value = check_int(value, name)
    if value < 0:
        raise ArgumentValueError(f"{name} must be at least 0, got {value}")
    return value


def check_group_options(strict_buffers: Any, cpu_transport: Any) -> GroupOptions:
    """Return a group's ``GroupOptions``; None fields are read from the environment later."""
    if strict_buffers is not None:
        check_bool(strict_buffers, "strict_buffers")
    transport = None if cpu_transport is None else CpuTransport.parse(cpu_transport)
    return GroupOptions(strict_buffers, transport)
