"""Argument checks shared by the public functions; each raises before any communication."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import numpy as np

from collective import tensor
from collective.groups.base import BaseGroup
from collective.tensor import TensorSpec
from collective.types import CpuTransport, GroupOptions, ReduceOp


def check_int(value: Any, name: str) -> int:
    """Return ``value`` if it is an int (not a bool), else raise ``TypeError``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


def check_group_name(group_name: Any) -> str:
    """Return ``group_name`` if it is a non-empty string."""
    if not isinstance(group_name, str):
        raise TypeError(f"group_name must be a str, got {type(group_name).__name__}")
    if not group_name:
        raise ValueError("group_name must be a non-empty string")
    return group_name


def check_world_size(world_size: Any) -> int:
    """Return ``world_size`` if it is an int of at least 1."""
    if check_int(world_size, "world_size") < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    return world_size


def check_rank(rank: Any, world_size: int, name: str = "rank") -> int:
    """Return ``rank`` if it lies in ``[0, world_size)``."""
    if not 0 <= check_int(rank, name) < world_size:
        raise ValueError(f"{name} must be in [0, {world_size}), got {rank}")
    return rank


def check_peer(rank: Any, group: BaseGroup, name: str) -> int:
    """Return a peer rank for send/recv: in range and not this rank."""
    check_rank(rank, group.world_size, name)
    if rank == group.rank:
        raise ValueError(f"{name} must name another rank, got this rank ({rank})")
    return rank


def check_permutation(ranks: Any, world_size: int) -> list[int]:
    """Return ``ranks`` as a list if it is a permutation of ``range(world_size)``."""
    if not isinstance(ranks, (list, tuple)):
        raise TypeError(f"ranks must be a list of ints, got {type(ranks).__name__}")
    for i, rank in enumerate(ranks):
        check_int(rank, f"ranks[{i}]")
    if sorted(ranks) != list(range(world_size)):
        raise ValueError(f"ranks must be a permutation of 0..{world_size - 1}, got {list(ranks)}")
    return list(ranks)


def check_timeout(timeout: Any) -> timedelta | None:
    """Return ``timeout`` if it is None or a positive ``timedelta``."""
    if timeout is None:
        return None
    if not isinstance(timeout, timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, got {type(timeout).__name__}")
    if timeout <= timedelta(0):
        raise ValueError(f"timeout must be positive, got {timeout}")
    return timeout


def check_tensor(group: BaseGroup, x: Any, name: str) -> TensorSpec:
    """Return the spec of ``x`` if ``group``'s backend can use it."""
    spec = tensor.spec(x, name)
    group.check_tensor(spec, name)
    return spec


def check_tensor_list(
    group: BaseGroup, xs: Any, name: str, like: TensorSpec, length: int
) -> list[Any]:
    """Return ``xs`` as a list of ``length`` buffers of ``like``'s shape and dtype."""
    if not isinstance(xs, (list, tuple)):
        raise TypeError(f"{name} must be a list of tensors, got {type(xs).__name__}")
    if len(xs) != length:
        raise ValueError(f"{name} must hold {length} tensors (the world size), got {len(xs)}")
    for i, x in enumerate(xs):
        spec = check_tensor(group, x, f"{name}[{i}]")
        if (spec.shape, spec.dtype) != (like.shape, like.dtype):
            raise ValueError(
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
        ValueError: two of the buffers overlap, naming both.

    """
    for i, (name, x) in enumerate(outputs):
        for other_name, other in list(outputs[:i]) + list(others):
            if tensor.overlaps(x, other):
                raise ValueError(f"{name} and {other_name} share memory; pass distinct buffers")


def check_bool(value: Any, name: str) -> bool:
    """Return ``value`` if it is a bool, else raise ``TypeError``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_call(timeout: Any, async_op: Any) -> tuple[timedelta | None, bool]:
    """Return the per-call ``(timeout, async_op)`` every op's options end with, checked."""
    return check_timeout(timeout), check_bool(async_op, "async_op")


def check_reduce_op(group: BaseGroup, op: Any, spec: TensorSpec) -> ReduceOp:
    """Return ``op`` as a ``ReduceOp`` if ``group`` can apply it to ``spec``'s dtype."""
    reduce_op = ReduceOp.parse(op)
    group.check_reduce_op(reduce_op, spec.dtype)
    return reduce_op


def check_outputs(group: BaseGroup, xs: Any, name: str, like: TensorSpec, length: int) -> list[Any]:
    """Return ``xs`` as ``length`` buffers like ``like``: a list, or views of one flat buffer.

    A single contiguous buffer of ``length`` times ``like``'s element count and of
    its dtype stands for the list of its consecutive chunks; writing a chunk writes it.
    """
    if not tensor.is_buffer(xs):
        return check_tensor_list(group, xs, name, like, length)
    spec = check_tensor(group, xs, name)
    count = int(np.prod(like.shape, dtype=np.int64)) * length
    if spec.dtype != like.dtype or int(np.prod(spec.shape, dtype=np.int64)) != count:
        raise ValueError(
            f"{name} must be a list of {length} tensors or one tensor of {count} "
            f"{like.dtype} elements (world size x tensor), got {spec.describe()}"
        )
    if not tensor.is_contiguous(xs):
        raise ValueError(f"{name} must be contiguous when passed as one flat tensor")
    return tensor.chunks(xs, length, like.shape)


def check_rooted_list(
    group: BaseGroup, xs: Any, name: str, like: TensorSpec, root: int, root_name: str
) -> list[Any]:
    """Return the list a rooted op needs: ``xs`` on the root, nothing on other ranks.

    Raises:
        ValueError: ``xs`` is missing on the root or given on another rank.

    """
    if group.rank != root:
        if xs is not None:
            raise ValueError(
                f"{name} must be None on ranks other than {root_name} ({root}), "
                f"got {type(xs).__name__} on rank {group.rank}"
            )
        return []
    if xs is None:
        raise ValueError(f"{name} is required on {root_name} ({root}), got None")
    return check_outputs(group, xs, name, like, group.world_size)


def check_split_sizes(sizes: Any, rows: int, world_size: int, name: str) -> list[int]:
    """Return ``sizes``, or an even split of ``rows`` when None, as world-size row counts."""
    if sizes is None:
        if rows % world_size:
            raise ValueError(
                f"{name} is None, so dim 0 ({rows}) must divide by the world size ({world_size})"
            )
        return [rows // world_size] * world_size
    if not isinstance(sizes, (list, tuple)):
        raise TypeError(f"{name} must be a list of ints, got {type(sizes).__name__}")
    if len(sizes) != world_size:
        raise ValueError(f"{name} must hold {world_size} sizes (the world size), got {len(sizes)}")
    for i, size in enumerate(sizes):
        if check_int(size, f"{name}[{i}]") < 0:
            raise ValueError(f"{name}[{i}] must be non-negative, got {size}")
    if sum(sizes) != rows:
        raise ValueError(f"{name} must sum to dim 0 of its tensor ({rows}), got {sum(sizes)}")
    return list(sizes)


def check_multigpu_group(group: BaseGroup, function: str) -> None:
    """Reject a ``*_multigpu`` call on a group whose backend does not drive GPUs."""
    if group.device_type != "cuda":
        raise ValueError(
            f"{function} needs a group on GPUs (backend='nccl'), but group "
            f"{group.group_name!r} uses the {group.backend_name()} backend"
        )


def check_gpu_tensor_list(group: BaseGroup, xs: Any, name: str) -> list[Any]:
    """Return ``xs`` as a list if it holds at least one tensor that ``group`` takes."""
    if not isinstance(xs, (list, tuple)):
        raise TypeError(f"{name} must be a list of tensors, got {type(xs).__name__}")
    if not xs:
        raise ValueError(f"{name} must hold at least one tensor, got an empty list")
    for i, x in enumerate(xs):
        check_tensor(group, x, f"{name}[{i}]")
    return list(xs)


def check_index(value: Any, length: int, name: str) -> int:
    """Return ``value`` if it is an int in ``[0, length)``."""
    if not 0 <= check_int(value, name) < length:
        raise ValueError(f"{name} must be in [0, {length}), got {value}")
    return value


def check_non_negative(value: Any, name: str) -> int:
    """Return ``value`` if it is an int of at least 0."""
    if check_int(value, name) < 0:
        raise ValueError(f"{name} must be at least 0, got {value}")
    return value


def check_group_options(strict_buffers: Any, cpu_transport: Any) -> GroupOptions:
    """Return a group's ``GroupOptions``; None fields are read from the environment later."""
    if strict_buffers is not None:
        check_bool(strict_buffers, "strict_buffers")
    transport = None if cpu_transport is None else CpuTransport.parse(cpu_transport)
    return GroupOptions(strict_buffers, transport)
