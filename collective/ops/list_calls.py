"""The call path of the ops on lists of buffers: make the key, look it up, launch.

It is ``calls``' path for allgather, reducescatter and barrier, and for the ops of
``gather_scatter`` (gather, scatter, alltoall, alltoall_single) and ``multigpu``: the first call of
a key runs every local check once, inside ``checking`` (so a ``check_args``
group raises one rank's argument error on every rank), and builds a launch that
the group keeps (``groups.launches``); a later call of the same key is a dict
lookup and the launch, which calls the group's op. On a ``check_args`` group that
op agrees with the other ranks on every call.

A list argument's key holds every buffer's key (``BaseGroup.key_of``) and its
address; a flat buffer's key holds its key and address too. The addresses of all
of a call's buffers are in its key because the checks on where the buffers lie
relative to each other (outputs that overlap, an output that is one of the inputs)
depend on them: a call whose buffers lie otherwise is checked anew. A call with
an argument that has no key is checked and built every time, its launch not kept.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from datetime import timedelta
from typing import Any

from collective.checks import arguments
from collective.checks.arguments import checking
from collective.checks.written import check_written, same_as_output
from collective.frameworks import kinds
from collective.groups.base import BaseGroup
from collective.groups.launches import Launch
from collective.ops.calls import REDUCE_OP_VALUES
from collective.types import (
    AllGatherOptions,
    BarrierOptions,
    ReduceOp,
    ReduceScatterOptions,
)
from collective.work import Work, returned

Builder = Callable[..., "tuple[Launch, bool]"]
"""Checks a call's arguments (all but the group and the key) and returns its launch, and
whether it may be kept for later calls of the same key (see ``BaseGroup.prepare``)."""


def arg_key(group: BaseGroup, x: Any) -> Hashable | None:
    """Return the key of one argument: a buffer, a list (or tuple) of arguments, or None.

    A buffer's part is its ``placed_key``: its ``key_of`` and its address; None when it
    has no key.
    """
    if x is None:
        return ("none",)
    if x.__class__ is list or x.__class__ is tuple:
        parts = []
        for b in x:
            k = arg_key(group, b)
            if k is None:
                return None
            parts.append(k)
        return ("list", *parts)
    k = group.placed_key(x)
    return None if k is None else ("buffer", k)


def call_key(
    group: BaseGroup,
    op: str,
    args: tuple[Any, ...],
    extra: tuple[Any, ...],
    timeout: Any,
    async_op: Any,
) -> Hashable | None:
    """Return the key of a call of ``op`` on ``args``, or None when it must be checked every time.

    ``extra`` holds the call's other arguments, each of which must be a root (an
    ``int``), a reduction (a ``ReduceOp`` or its name) or a list of split sizes (of
    ``int``) for the call to have a key.
    """
    if async_op.__class__ is not bool or not (timeout is None or timeout.__class__ is timedelta):
        return None
    parts: list[Hashable] = [op, timeout, async_op]
    try:
        for value in extra:
            if value.__class__ is int:
                parts.append(value)
            elif value.__class__ is ReduceOp:
                parts.append(("op", value._value_))
            elif value.__class__ is list or value.__class__ is tuple:
                if not all(v.__class__ is int for v in value):
                    return None
                parts.append(("sizes", *value))
            else:  # a reduction's name; anything else has no key (KeyError, TypeError)
                parts.append(("op", REDUCE_OP_VALUES[value]))
        for x in args:
            k = arg_key(group, x)
            if k is None:
                return None
            parts.append(k)
    except Exception:  # an argument the checks must see; it is checked on the first call
        return None
    return tuple(parts)


def call(
    build: Builder,
    group: BaseGroup,
    op: str,
    args: tuple[Any, ...],
    extra: tuple[Any, ...],
    timeout: Any,
    async_op: Any,
) -> Work | None:
    """Run ``op`` on ``args`` through the group's launch of the call's key, built if new.

    ``build(group, *args, *extra, timeout, async_op)`` checks the call and returns
    its launch, which is called with ``args``, and whether to keep it. A launch that
    raises is not kept.

    Raises:
        ArgumentError: an argument check failed (on a first call of its key).
        CollectiveError: the op failed.

    """
    key = call_key(group, op, args, extra, timeout, async_op)
    launch = group.launches.get(key)
    if launch is not None:
        return launch(args)
    launch, keep = build(group, *args, *extra, timeout, async_op)
    return group.launches.run_first(key, launch, args, keep)


def views(xs: Any, count: int, shape: tuple[int, ...]) -> Callable[[Any], list[Any]]:
    """Return how a checked list argument like ``xs`` becomes its list of buffers on a call.

    A list stays as it is; a flat buffer becomes its ``count`` chunks of ``shape``;
    None (the list of a rank that is not the root) becomes an empty list.
    """
    if xs is None:
        return lambda xs: []
    if kinds.is_buffer(xs):
        return lambda xs: kinds.chunks(xs, count, shape)
    return list


def build_allgather(
    group: BaseGroup, tensor_list: Any, x: Any, timeout: Any, async_op: Any
) -> tuple[Launch, bool]:
    """Check an allgather and return its launch; see ``api.allgather``."""
    with checking(group, "allgather"):
        spec = arguments.check_tensor(group, x, "tensor")
        n = group.world_size
        outputs = arguments.check_outputs(group, tensor_list, "tensor_list", spec, n, disjoint=True)
        options = AllGatherOptions(*arguments.check_call(timeout, async_op))
        check_written(group, [(f"tensor_list[{i}]", t) for i, t in enumerate(outputs)])
    as_list, is_async = views(tensor_list, n, spec.shape), options.async_op
    run, keep = group.prepare("allgather", ([as_list(tensor_list)], [x]), options)

    def launch(args: tuple[Any, Any]) -> Work | None:
        return returned(run(lambda: ([as_list(args[0])], [args[1]])), is_async)

    return launch, keep


def build_reducescatter(
    group: BaseGroup, x: Any, tensor_list: Any, reduce_op: Any, timeout: Any, async_op: Any
) -> tuple[Launch, bool]:
    """Check a reducescatter and return its launch; see ``api.reducescatter``.

    An input that is the output itself is read from a copy of it taken on each call;
    such a call's group op is found anew each time, the copy being new.
    """
    with checking(group, "reducescatter"):
        spec = arguments.check_tensor(group, x, "tensor")
        n = group.world_size
        inputs = arguments.check_outputs(group, tensor_list, "tensor_list", spec, n)
        reduce_op = arguments.check_reduce_op(group, reduce_op, spec)
        options = ReduceScatterOptions(reduce_op, *arguments.check_call(timeout, async_op))
        check_written(group, [("tensor", x)])
        same = same_as_output(x, inputs, "tensor", "tensor_list")
    as_list, is_async = views(tensor_list, n, spec.shape), options.async_op
    if not same:
        run, keep = group.prepare("reducescatter", ([x], [as_list(tensor_list)]), options)
        return (lambda args: returned(run(lambda: ([args[0]], [as_list(args[1])])), is_async)), keep
    reducescatter = group.reducescatter

    def launch(args: tuple[Any, Any]) -> Work | None:
        output, inputs = args[0], as_list(args[1])
        copy = kinds.copy_of(output)
        for i in same:
            inputs[i] = copy
        return returned(reducescatter([output], [inputs], options), is_async)

    return launch, True


def build_barrier(group: BaseGroup, timeout: Any, async_op: Any) -> tuple[Launch, bool]:
    """Check a barrier and return its launch; see ``api.barrier``."""
    with checking(group, "barrier"):
        options = BarrierOptions(*arguments.check_call(timeout, async_op))
    run, is_async = group.barrier, options.async_op
    return (lambda args: returned(run(options), is_async)), True
