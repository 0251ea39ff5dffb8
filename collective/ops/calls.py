"""One path for every call of an op: make its key, look it up, launch; check and build once.

A call's key holds what its checks and its launch depend on: the op; the buffer's
description, as the group's backend gives it (``BaseGroup.key_of``: dtype, shape,
strides, whether it may be written, and for the nccl backend its address, device
and the caller's stream); the reduction, the root, the timeout and ``async_op``.
The first call of a key runs every local check once, inside ``checking`` (so a
``check_args`` group raises one rank's argument error on every rank), and asks the
group's builder for the op (``BaseGroup.build``) for a launch, which the group
keeps (see ``groups.launches``). A later call of the same key is a dict lookup and
the launch: nothing is checked or described again. A call that has no key (an
argument of an unusual type, a buffer that requires grad) is checked and built
every time, and its launch is not kept.

``ONE_BUFFER`` is the table of the ops that take one buffer (allreduce, reduce,
broadcast, send, recv): what each checks and which options it builds, written once
for every backend. A backend builds their launches in ``BaseGroup.build``. The
other ops (on lists of buffers, barrier, the exchange and ``*_multigpu`` ops) take
the same path through ``list_calls``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from collective.checks import arguments
from collective.checks.arguments import checking
from collective.checks.written import check_written
from collective.groups.base import BaseGroup
from collective.types import (
    AllReduceOptions,
    BroadcastOptions,
    RecvOptions,
    ReduceOp,
    ReduceOptions,
    SendOptions,
)
from collective.work import Work

REDUCE_OP_VALUES: dict[Any, int] = {
    alias: op._value_ for op in ReduceOp for alias in (op.name, op.name.lower())
}
"""The value of each ``ReduceOp`` by its names, as the public ops take them.

Keys hold a reduction's value, not the member: hashing an enum member runs Python
code (``Enum.__hash__``), hashing an int does not. ``None`` (no reduction) is -1."""
REDUCE_OP_VALUES[None] = -1


@dataclass(frozen=True)
class OneBufferOp:
    """What a public op on one buffer checks, and the options it hands its group."""

    name: str
    reduces: bool
    root_name: str | None
    """The name of the root's argument; None for an op without a root."""
    written: Callable[[int, int], bool]
    """Whether rank ``rank``'s buffer is written, with root ``root``: ``written(rank, root)``."""
    options: Callable[[ReduceOp, int, timedelta | None, bool], Any]
    """Builds the op's options from the checked reduction, root, timeout and ``async_op``."""
    peer: bool = False
    """Whether the root is the peer of a send or recv: another rank, checked first."""


ALLREDUCE = OneBufferOp(
    "allreduce",
    True,
    None,
    lambda rank, root: True,
    lambda op, root, timeout, async_op: AllReduceOptions(op, timeout, async_op),
)
REDUCE = OneBufferOp(
    "reduce",
    True,
    "dst_rank",
    lambda rank, root: rank == root,
    lambda op, root, timeout, async_op: ReduceOptions(op, root, 0, timeout, async_op),
)
BROADCAST = OneBufferOp(
    "broadcast",
    False,
    "src_rank",
    lambda rank, root: rank != root,
    lambda op, root, timeout, async_op: BroadcastOptions(root, 0, timeout, async_op),
)
SEND = OneBufferOp(
    "send",
    False,
    "dst_rank",
    lambda rank, root: False,
    lambda op, root, timeout, async_op: SendOptions(root, 0, 0, timeout, async_op),
    peer=True,
)
RECV = OneBufferOp(
    "recv",
    False,
    "src_rank",
    lambda rank, root: True,
    lambda op, root, timeout, async_op: RecvOptions(root, 0, 0, timeout, async_op),
    peer=True,
)
ONE_BUFFER = {op.name: op for op in (ALLREDUCE, REDUCE, BROADCAST, SEND, RECV)}
"""The ops on one buffer, by name: the ops ``BaseGroup.build`` builds launches of."""


def call(
    op: OneBufferOp,
    group: BaseGroup,
    x: Any,
    reduce_op: Any,
    root: Any,
    timeout: Any,
    async_op: Any,
) -> Work | None:
    """Run ``op`` on ``x`` through the group's launch of the call's key, built if new.

    ``reduce_op`` is None for an op that reduces nothing, ``root`` -1 for one
    without a root (the peer for send and recv); the others are the public op's
    arguments as the caller gave them.

    Raises:
        ArgumentError: an argument check failed (on a first call of its key).
        CollectiveError: the op failed.

    """
    key: Hashable | None = None
    if (
        async_op.__class__ is bool
        and root.__class__ is int
        and (timeout is None or timeout.__class__ is timedelta)
    ):
        value = -1
        try:
            value = (
                reduce_op._value_
                if reduce_op.__class__ is ReduceOp
                else REDUCE_OP_VALUES[reduce_op]
            )
            buffer = group.key_of(x)
        except Exception:  # an argument the checks must see; it is checked below
            buffer = None
        if buffer is not None:
            key = (op.name, buffer, value, root, timeout, async_op)
    launch = group.launches.get(key)
    if launch is not None:
        return launch(x)
    return first_call(op, group, key, x, reduce_op, root, timeout, async_op)


def first_call(
    op: OneBufferOp,
    group: BaseGroup,
    key: Hashable | None,
    x: Any,
    reduce_op: Any,
    root: Any,
    timeout: Any,
    async_op: Any,
) -> Work | None:
    """Check a call of ``op``, build its launch and run it; keep it under ``key`` unless None.

    A launch that raises is not kept.
    """
    peer = None
    if op.peer and op.root_name is not None:
        root = peer = arguments.check_peer(root, group, op.root_name)
    with checking(group, op.name, peer):
        spec = arguments.check_tensor(group, x, "tensor")
        if op.root_name is not None and not op.peer:
            root = arguments.check_rank(root, group.world_size, op.root_name)
        if op.reduces:
            reduce_op = arguments.check_reduce_op(group, reduce_op, spec)
        options = op.options(reduce_op, root, *arguments.check_call(timeout, async_op))
        check_written(group, [("tensor", x)] if op.written(group.rank, root) else [])
    launch, keep = group.build(op.name, x, options)
    return group.launches.run_first(key, launch, x, keep)
