"""The bulk calls on a given group: agree, plan, then move; ``bulk.api`` finds the group.

Each call first makes the ranks agree on what moves (``agree``): the source's names,
dtypes and shapes, or rank 0's for a reduction. Any disagreement, and any rank's bad
argument, raises the same ``ValueError`` or ``TypeError`` on every rank before a
buffer is written. Then the tensors move in bucketed, pipelined ops of the group
(``plan``, ``pipeline``), so every backend runs them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from collective import signature
from collective.bulk import local, repeat
from collective.bulk.agree import Agreement, Claim, agree
from collective.bulk.pipeline import Moves, start
from collective.bulk.plan import plan
from collective.bulk.turns import AGREEMENT_OPS, held
from collective.checks import arguments
from collective.checks.check_args import CheckedGroup
from collective.frameworks import cuda_buffers, kinds, packing, streams
from collective.groups.base import BaseGroup
from collective.types import ArgumentValueError, ReduceOp
from collective.work import Work

BROADCAST_BUCKET_BYTES = {"cpu": 4 << 20, "cuda": 25 << 20}
"""Default bucket of the broadcasts by device. On the CPU every byte is copied by the
ranks' own cores: 4 MiB keeps two buckets per rank in the last-level cache while
they are packed, moved and unpacked, and was the fastest of 1, 4, 16 and 64 MiB for
2,000 tensors of 32 KiB at 4 ranks. On a GPU, copies are cheap and each NCCL call
costs a launch: PyTorch DDP's 25 MiB."""

ALLREDUCE_BUCKET_BYTES = 25 << 20
"""Default bucket of ``allreduce_tensors``: PyTorch DDP's ``bucket_cap_mb``."""

DIRECT_BYTES = 1 << 20
"""On the CPU, a tensor of at least this size moves in ops of its own, in place when
contiguous: packing would copy it twice more than an op's own overhead costs."""

UNSET = signature.UNSET


def broadcast_tensors(
    group: BaseGroup,
    tensors: Any,
    src_rank: Any = 0,
    *,
    bucket_bytes: Any = None,
    timeout: Any = None,
    async_op: Any = False,
) -> Work | None:
    """Run ``collective.broadcast_tensors`` on ``group``; see there."""

    def source() -> tuple[int, ReduceOp | None]:
        return arguments.check_rank(src_rank, group.world_size, "src_rank"), None

    default = _broadcast_bucket(group)
    return _list_call(
        group, "broadcast_tensors", tensors, source, bucket_bytes, default, timeout, async_op
    )


def allreduce_tensors(
    group: BaseGroup,
    tensors: Any,
    op: Any = ReduceOp.SUM,
    *,
    bucket_bytes: Any = None,
    timeout: Any = None,
    async_op: Any = False,
) -> Work | None:
    """Run ``collective.allreduce_tensors`` on ``group``; see there."""

    def reduction() -> tuple[int, ReduceOp | None]:
        return UNSET, ReduceOp.parse(op)

    default = ALLREDUCE_BUCKET_BYTES
    return _list_call(
        group, "allreduce_tensors", tensors, reduction, bucket_bytes, default, timeout, async_op
    )


def _list_call(
    group: BaseGroup,
    op: str,
    tensors: Any,
    how: Callable[[], tuple[int, ReduceOp | None]],
    bucket_bytes: Any,
    default_bucket: int,
    timeout: Any,
    async_op: Any,
) -> Work | None:
    """Run bulk call ``op`` on a list: a broadcast from a root, or (``how`` says) a reduction."""
    data = _unwrapped(group)
    with held(data, op) as turn:
        root, reduce_op, xs, listing = UNSET, None, [], None
        checked_timeout, is_async, bucket, reads, kept, hit = None, False, 0, False, None, False
        with local.Captured() as captured:
            root, reduce_op = how()
            checked_timeout, is_async = arguments.check_call(timeout, async_op)
            bucket = local.check_bucket_bytes(bucket_bytes, default_bucket)
            xs = local.check_list(tensors, "tensors")
            reads = reduce_op is not None or group.rank == root
            call = (op, root, reduce_op, bucket, reads)
            kept = repeat.find(data, call, None, xs)
            if kept is None:
                labels = [f"tensors[{i}]" for i in range(len(xs))]
                specs = local.check_buffers(group, xs, labels, reduce_op)
                writes = reduce_op is not None or not reads
                views = local.check_outputs(group, xs, labels) if writes else xs
                if reduce_op is not None:
                    local.check_no_overlap(views, labels)
                listing = local.listing(specs, None)
                kept = repeat.keep(data, call, None, xs, listing)
                xs = views
            else:
                listing, hit = kept.listing, True
        ok = captured.error is None
        count, bucket = (len(xs), bucket) if ok else (UNSET, 0)
        listing = listing if ok else None
        claim = Claim(op, "tensors", root, reduce_op, count, bucket, listing, True, captured.error)
        like = _like(group, xs)
        capturing = _capturing(like)
        if is_async and capturing:
            raise ArgumentValueError(
                f"async_op must be False while a CUDA graph is captured, got {async_op!r}"
            )
        turn.bound(AGREEMENT_OPS, checked_timeout or group.timeout)
        agreement = agree(data, claim, checked_timeout, _on_device(like), capturing=capturing)
        writes = reduce_op is not None or not reads
        mine = (lambda: _writable(xs)) if hit and writes else (lambda: xs)
        moves = _moves(
            data, agreement, bucket, mine, xs, kept, reads, like, checked_timeout, root, reduce_op
        )
        return start(op, moves, is_async, turn)


def broadcast_state_dict(
    group: BaseGroup,
    state_dict: Any,
    src_rank: Any = 0,
    *,
    strict: Any = True,
    bucket_bytes: Any = None,
    timeout: Any = None,
) -> dict[str, Any] | None:
    """Run ``collective.broadcast_state_dict`` on ``group``; see there."""
    data = _unwrapped(group)
    with held(data, "broadcast_state_dict") as turn:
        root, entries, listing, values = UNSET, {}, None, []
        checked_timeout, is_strict, kept, hit = None, True, None, False
        receiving = False
        with local.Captured() as captured:
            root = arguments.check_rank(src_rank, group.world_size, "src_rank")
            receiving = group.rank != root
            checked_timeout = arguments.check_timeout(timeout)
            is_strict = arguments.check_bool(strict, "strict")
            bucket = local.check_bucket_bytes(bucket_bytes, _broadcast_bucket(group))
            if state_dict is None and not receiving:
                raise ArgumentValueError(f"state_dict is required on src_rank ({root}), got None")
            if state_dict is not None:
                call = ("broadcast_state_dict", root, is_strict, bucket, receiving)
                plain = type(state_dict) in (dict, OrderedDict)
                names = tuple(state_dict) if plain else None
                values = list(state_dict.values()) if plain else []
                kept = repeat.find(data, call, names, values) if plain else None
                if kept is None:
                    entries = local.check_state_dict(state_dict)
                    labels = [f"state_dict[{key!r}]" for key in entries]
                    values = list(entries.values())
                    specs = local.check_buffers(group, values, labels, None)
                    if receiving:
                        views = local.check_outputs(group, values, labels)
                        entries = dict(zip(entries, views, strict=True))
                    listing = local.listing(specs, list(entries))
                    kept = repeat.keep(data, call, listing.names, values, listing)
                else:
                    listing, hit = kept.listing, True
        given = state_dict is not None and captured.error is None
        listing = listing if given else None
        bucket = bucket if captured.error is None else 0
        claim = Claim(
            "broadcast_state_dict", "state_dict", root, None, UNSET, bucket, listing, is_strict,
            captured.error,
        )  # fmt: skip
        turn.bound(AGREEMENT_OPS, checked_timeout or group.timeout)
        like = _like(group, values)
        agreement = agree(
            data, claim, checked_timeout, _on_device(like), capturing=_capturing(like)
        )
        result = state_dict if receiving else None
        if state_dict is None and agreement.source_order is not None:
            source = agreement.source_order
            names = source.names or ()
            result = entries = {
                name: packing.empty(dtype, shape, group.device_type)
                for name, dtype, shape in zip(names, source.dtypes, source.shapes, strict=True)
            }
            values = list(entries.values())
        layout = agreement.layout

        def ordered() -> list[Any]:
            mine = entries
            if hit:
                views = _writable(values) if receiving else values
                mine = dict(zip(names or (), views, strict=True))
            return [mine.get(name) for name in layout.names or ()]

        moves = _moves(
            data, agreement, bucket, ordered, values, kept, not receiving, like,
            checked_timeout, root,
        )  # fmt: skip
        start("broadcast_state_dict", moves, False, turn)
        return result


def _broadcast_bucket(group: BaseGroup) -> int:
    return BROADCAST_BUCKET_BYTES.get(group.device_type, ALLREDUCE_BUCKET_BYTES)


def _unwrapped(group: BaseGroup) -> BaseGroup:
    """Return the group that moves a bulk call's data.

    A group with ``check_args`` compares every op's arguments; the bulk call's own
    agreement compares more, so its ops go to the group underneath.
    """
    return group.inner if isinstance(group, CheckedGroup) else group


def _like(group: BaseGroup, xs: list[Any]) -> Any:
    """Return a buffer next to which staging and control messages go: ``xs[0]`` if it fits."""
    on_gpu = group.device_type == "cuda"
    if xs and kinds.is_buffer(xs[0]) and streams.on_gpu(xs[0]) == on_gpu:
        return xs[0]
    return packing.empty("uint8", (0,), "cuda") if on_gpu else None


def _capturing(like: Any) -> bool:
    """Return whether the caller's stream on ``like`` (a GPU buffer, or None) captures a graph."""
    return like is not None and streams.on_gpu(like) and cuda_buffers.capturing(like)


def _on_device(like: Any) -> Callable[[Any], Any]:
    return lambda array: packing.to_device(array, like)


def _writable(xs: list[Any]) -> list[Any]:
    """Return views of ``xs`` to write in place (``packing.writable``); checks have passed."""
    return [packing.writable(x) for x in xs]


def _moves(
    group: BaseGroup,
    agreement: Agreement,
    bucket_bytes: int,
    ordered: Callable[[], list[Any]],
    held: list[Any],
    kept: repeat.Kept | None,
    reads: bool,
    like: Any,
    timeout: timedelta | None,
    root: int,
    reduce_op: ReduceOp | None = None,
) -> Moves:
    """Return what this rank does to move its tensors as agreed.

    ``ordered`` returns the rank's tensors in layout order (views to write where it
    writes), None where it has none; ``held`` are its tensors, which the moves keep
    alive. What ``kept`` holds for the agreed layout is used, and what is made is
    kept there.
    """
    writes = reduce_op is not None or not reads
    layout = agreement.layout
    mine = kept.moves_for(layout) if kept is not None else None
    if reduce_op is None and group.takes_lists:
        if mine is not None and mine.runs is not None:
            return Moves(group, [], held, reads, writes, like, timeout, root, whole=mine.runs)
        xs = ordered()
        whole = [
            x
            if x is not None
            else packing.empty(layout.dtypes[i], layout.shapes[i], group.device_type)
            for i, x in enumerate(xs)
        ]
        if kept is None:
            return Moves(group, [], held, reads, writes, like, timeout, root, whole=whole)
        kept.scratch = {i: whole[i] for i, x in enumerate(xs) if x is None}
        runs = repeat.runs(kept, whole)
        return Moves(group, [], held, reads, writes, like, timeout, root, whole=runs)
    bulk_ops = mine.bulk_ops if mine is not None else None
    if bulk_ops is None:
        direct = DIRECT_BYTES if group.device_type == "cpu" else bucket_bytes
        bulk_ops = plan(layout, bucket_bytes, direct, typed=reduce_op is not None)
        if kept is not None:
            kept.bulk_ops = bulk_ops
    return Moves(group, bulk_ops, ordered(), reads, writes, like, timeout, root, reduce_op)
