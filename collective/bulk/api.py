"""Move many tensors in one call: a trainer's weights to rollout actors, a model's gradients.

Each call first makes the ranks agree on what moves: the source's names, dtypes and
shapes (rank 0's for a reduction) reach every rank, which compares its own. Any
disagreement, and any rank's bad argument, raises the same ``ValueError`` or
``TypeError`` on every rank before a buffer is written. Then the bytes move in
buckets through the group's ordinary ops, packing one bucket while the previous one
moves, so every backend runs them; a rank stages at most two buckets at a time.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from collective.bulk import calls
from collective.registry.held import get_group_handle
from collective.types import ReduceOp
from collective.work import Work


def broadcast_tensors(
    tensors: list[Any],
    src_rank: int = 0,
    group_name: str = "default",
    *,
    bucket_bytes: int | None = None,
    timeout: timedelta | None = None,
    async_op: bool = False,
) -> Work | None:
    """Copy ``src_rank``'s ``tensors`` into every other rank's ``tensors``, in place.

    Every rank passes a list of the same length whose i-th tensors agree in dtype and
    shape; a disagreement raises a ``ValueError`` on every rank, naming the first
    index that differs, before any buffer is written. The source's tensors are only
    read. Tensors of at least 1 MiB on a CPU group (a bucket on a GPU group) move in
    ops of their own, straight into a contiguous receiver; the others are packed
    into buckets.

    Args:
        tensors: numpy arrays, torch tensors or cupy arrays of any dtype, shape and
            strides, bigger than a bucket too; written in place on every rank but
            ``src_rank``, a tensor that requires grad as under ``torch.no_grad()``.
            On an nccl group, all of one library on one GPU.
        src_rank: the rank that sends.
        group_name: the group.
        bucket_bytes: the most bytes one op moves (by default 4 MiB on a gloo group,
            25 MiB on an nccl group); every rank must pass the same.
        timeout: overrides the group's timeout for each op of the call.
        async_op: return one ``Work`` for the whole call at once. Until its ``wait``
            has returned, the tensors must not be touched and no other op may be
            issued on the group (another bulk call waits for it by itself). A
            ``wait`` that runs out aborts the group and ends the call's writes.

    """
    group = get_group_handle(group_name)
    return calls.broadcast_tensors(
        group,
        tensors,
        src_rank,
        bucket_bytes=bucket_bytes,
        timeout=timeout,
        async_op=async_op,
    )


def allreduce_tensors(
    tensors: list[Any],
    group_name: str = "default",
    op: ReduceOp | str = ReduceOp.SUM,
    *,
    bucket_bytes: int | None = None,
    timeout: timedelta | None = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce each of ``tensors`` across the group; every rank's ``tensors`` receive the results.

    Each tensor keeps its dtype, and its result equals that of ``allreduce`` on it
    alone, except in the last bits of a floating-point SUM, PRODUCT or AVG that Gloo
    or NCCL reduces at three or more ranks (see the weight-sync guide). Every rank
    passes a list of the same length whose i-th tensors agree in dtype and shape; a
    disagreement raises a ``ValueError`` on every rank, naming the first index that
    differs, before any buffer is written. No element of one rank may be in two of
    its tensors. Buckets hold one dtype each.

    Args:
        tensors: numpy arrays, torch tensors or cupy arrays of any shape and strides,
            of dtypes that ``op`` takes on the backend (as ``allreduce``); written in
            place on every rank. On an nccl group, all of one library on one GPU.
        group_name: the group.
        op: the reduction; AVG takes floating-point tensors, BAND/BOR/BXOR integer and bool.
        bucket_bytes: the most bytes one op moves (25 MiB by default, PyTorch DDP's
            bucket size); every rank must pass the same.
        timeout: overrides the group's timeout for each op of the call.
        async_op: return one ``Work`` for the whole call at once. Until its ``wait``
            has returned, the tensors must not be touched and no other op may be
            issued on the group (another bulk call waits for it by itself). A
            ``wait`` that runs out aborts the group and ends the call's writes.

    """
    group = get_group_handle(group_name)
    return calls.allreduce_tensors(
        group, tensors, op, bucket_bytes=bucket_bytes, timeout=timeout, async_op=async_op
    )


def broadcast_state_dict(
    state_dict: dict[str, Any] | None,
    src_rank: int = 0,
    group_name: str = "default",
    *,
    strict: bool = True,
    bucket_bytes: int | None = None,
    timeout: timedelta | None = None,
) -> dict[str, Any] | None:
    """Copy ``src_rank``'s state dict into every other rank's, matched by name, in place.

    The source's names, dtypes and shapes reach every rank first, and a receiver's
    entries are matched to them by name, whatever their order. A missing or extra
    key (with ``strict``), or a dtype or shape that differs, raises a ``ValueError``
    on every rank, naming the first key that differs in the source's order, before
    any buffer is written. The source's tensors are only read. Entries that are one
    tensor (tied weights) are written once per name, so the source must hold equal
    values under those names, as a source with the same ties does.

    Args:
        state_dict: on ``src_rank``, its dict of str to tensors; only read. On a
            receiver, its own dict, written in place (a tensor that requires grad,
            such as a parameter, as under ``torch.no_grad()``), or None for a new one.
        src_rank: the rank that sends.
        group_name: the group.
        strict: whether a receiver's keys must equal the source's; with False, a
            key on one side only is skipped on that receiver.
        bucket_bytes: the most bytes one op moves (by default 4 MiB on a gloo group,
            25 MiB on an nccl group); every rank must pass the same.
        timeout: overrides the group's timeout for each op of the call.

    Returns:
        None on ``src_rank``. On a receiver, the dict that holds the result: its own,
        or for None a new dict, in the source's order, of new torch tensors: on the
        CPU for a gloo group, on the current CUDA device for an nccl group (numpy or
        cupy arrays where torch is not installed).

    """
    group = get_group_handle(group_name)
    return calls.broadcast_state_dict(
        group, state_dict, src_rank, strict=strict, bucket_bytes=bucket_bytes, timeout=timeout
    )
