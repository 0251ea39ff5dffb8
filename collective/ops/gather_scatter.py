"""Gather, scatter and all-to-all: the ops ``ray.util.collective`` lacks.

Like every op, each looks up its group, checks its arguments before anything is
sent, then calls the group; results land in the caller's buffers in place. Each
takes the path of ``list_calls``: a call is checked, and its launch built, on the
first call of its key only.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from collective.checks import arguments
from collective.checks.arguments import checking
from collective.checks.written import check_written
from collective.frameworks.kinds import split_rows
from collective.groups.base import BaseGroup
from collective.groups.launches import Launch
from collective.ops.list_calls import call, views
from collective.registry.held import get_group_handle
from collective.types import (
    AllToAllOptions,
    ArgumentTypeError,
    ArgumentValueError,
    GatherOptions,
    ScatterOptions,
)
from collective.work import Work, returned


def gather(
    tensor: Any,
    gather_list: list[Any] | Any | None = None,
    dst_rank: int = 0,
    group_name: str = "default",
    *,
    timeout: timedelta | None = None,
    async_op: bool = False,
) -> Work | None:
    """Gather every rank's ``tensor`` onto ``dst_rank``: ``gather_list[i]`` receives rank i's.

    Args:
        tensor: this rank's contribution; only read.
        gather_list: on ``dst_rank``, world-size buffers of ``tensor``'s shape and
            dtype, or one contiguous buffer of world size x ``tensor``'s elements;
            written in place. None on every other rank.
        dst_rank: the rank that receives.
        group_name: the group.
        timeout: overrides the group's timeout for this call.
        async_op: return a ``Work`` at once instead of waiting.

    """
    args, group = (tensor, gather_list), get_group_handle(group_name)
    return call(build_gather, group, "gather", args, (dst_rank,), timeout, async_op)


def scatter(
    tensor: Any,
    scatter_list: list[Any] | Any | None = None,
    src_rank: int = 0,
    group_name: str = "default",
    *,
    timeout: timedelta | None = None,
    async_op: bool = False,
) -> Work | None:
    """Scatter ``src_rank``'s ``scatter_list``: rank i's ``tensor`` receives element i.

    Args:
        tensor: this rank's result buffer; written in place on every rank.
        scatter_list: on ``src_rank``, world-size buffers of ``tensor``'s shape and
            dtype, or one contiguous buffer of world size x ``tensor``'s elements;
            only read. None on every other rank.
        src_rank: the rank that sends.
        group_name: the group.
        timeout: overrides the group's timeout for this call.
        async_op: return a ``Work`` at once instead of waiting.

    """
    args, group = (tensor, scatter_list), get_group_handle(group_name)
    return call(build_scatter, group, "scatter", args, (src_rank,), timeout, async_op)


def alltoall(
    output_tensor_list: list[Any],
    input_tensor_list: list[Any],
    group_name: str = "default",
    *,
    timeout: timedelta | None = None,
    async_op: bool = False,
) -> Work | None:
    """Send ``input_tensor_list[j]`` to rank j; ``output_tensor_list[j]`` receives rank j's.

    Args:
        output_tensor_list: world-size buffers of one dtype; written in place.
            Element j must have the shape of element i of rank j's input list,
            where i is this rank.
        input_tensor_list: world-size buffers of that dtype; only read. Sizes may
            differ per peer.
        group_name: the group.
        timeout: overrides the group's timeout for this call.
        async_op: return a ``Work`` at once instead of waiting.

    """
    args, group = (output_tensor_list, input_tensor_list), get_group_handle(group_name)
    return call(build_alltoall, group, "alltoall", args, (), timeout, async_op)


def alltoall_single(
    output: Any,
    input: Any,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group_name: str = "default",
    *,
    timeout: timedelta | None = None,
    async_op: bool = False,
) -> Work | None:
    """Split ``input`` along dim 0 and send block j to rank j; ``output`` receives theirs.

    Args:
        output: the result buffer; block j along dim 0 receives what rank j sent
            here; written in place.
        input: this rank's data; only read.
        output_split_sizes: rows of ``output`` per source rank; None splits evenly.
        input_split_sizes: rows of ``input`` per destination rank; None splits evenly.
        group_name: the group.
        timeout: overrides the group's timeout for this call.
        async_op: return a ``Work`` at once instead of waiting.

    """
    args, group = (output, input), get_group_handle(group_name)
    sizes = (output_split_sizes, input_split_sizes)
    return call(build_alltoall_single, group, "alltoall_single", args, sizes, timeout, async_op)


def build_gather(
    group: BaseGroup, x: Any, gather_list: Any, dst_rank: Any, timeout: Any, async_op: Any
) -> tuple[Launch, bool]:
    """Check a gather and return its launch; see ``gather``."""
    with checking(group, "gather"):
        spec = arguments.check_tensor(group, x, "tensor")
        dst_rank = arguments.check_rank(dst_rank, group.world_size, "dst_rank")
        outputs = arguments.check_rooted_list(
            group, gather_list, "gather_list", spec, dst_rank, "dst_rank"
        )
        named = [(f"gather_list[{i}]", t) for i, t in enumerate(outputs)]
        arguments.check_disjoint(named, [("tensor", x)])
        options = GatherOptions(dst_rank, *arguments.check_call(timeout, async_op))
        check_written(group, named)
    as_list, is_async = views(gather_list, group.world_size, spec.shape), options.async_op
    run, keep = group.prepare("gather", ([as_list(gather_list)], [x]), options)
    return (lambda args: returned(run(lambda: ([as_list(args[1])], [args[0]])), is_async)), keep


def build_scatter(
    group: BaseGroup, x: Any, scatter_list: Any, src_rank: Any, timeout: Any, async_op: Any
) -> tuple[Launch, bool]:
    """Check a scatter and return its launch; see ``scatter``."""
    with checking(group, "scatter"):
        spec = arguments.check_tensor(group, x, "tensor")
        src_rank = arguments.check_rank(src_rank, group.world_size, "src_rank")
        inputs = arguments.check_rooted_list(
            group, scatter_list, "scatter_list", spec, src_rank, "src_rank"
        )
        arguments.check_disjoint(
            [("tensor", x)], [(f"scatter_list[{i}]", t) for i, t in enumerate(inputs)]
        )
        options = ScatterOptions(src_rank, *arguments.check_call(timeout, async_op))
        check_written(group, [("tensor", x)])
    as_list, is_async = views(scatter_list, group.world_size, spec.shape), options.async_op
    run, keep = group.prepare("scatter", ([x], [as_list(scatter_list)]), options)
    return (lambda args: returned(run(lambda: ([args[0]], [as_list(args[1])])), is_async)), keep


def build_alltoall(
    group: BaseGroup, output_tensor_list: Any, input_tensor_list: Any, timeout: Any, async_op: Any
) -> tuple[Launch, bool]:
    """Check an alltoall and return its launch; see ``alltoall``."""
    with checking(group, "alltoall"):
        inputs, dtype = _same_dtype_list(group, input_tensor_list, "input_tensor_list")
        outputs, _ = _same_dtype_list(group, output_tensor_list, "output_tensor_list", dtype)
        names = ("output_tensor_list", "input_tensor_list")
        options = _alltoall_options(group, outputs, inputs, names, timeout, async_op)
    run, keep = group.prepare("alltoall", (list(outputs), list(inputs)), options)
    is_async = options.async_op
    return (lambda args: returned(run(lambda: (list(args[0]), list(args[1]))), is_async)), keep


def build_alltoall_single(
    group: BaseGroup,
    output: Any,
    input: Any,
    output_split_sizes: Any,
    input_split_sizes: Any,
    timeout: Any,
    async_op: Any,
) -> tuple[Launch, bool]:
    """Check an alltoall_single and return its launch; see ``alltoall_single``."""
    with checking(group, "alltoall"):
        in_spec = arguments.check_tensor(group, input, "input")
        out_spec = arguments.check_tensor(group, output, "output")
        if (out_spec.dtype, out_spec.shape[1:]) != (in_spec.dtype, in_spec.shape[1:]) or not (
            in_spec.shape and out_spec.shape
        ):
            raise ArgumentValueError(
                "output and input must share dtype and every dim but the first, "
                f"got output {out_spec.describe()} and input {in_spec.describe()}"
            )
        n = group.world_size
        out_sizes = arguments.check_split_sizes(
            output_split_sizes, out_spec.shape[0], n, "output_split_sizes"
        )
        in_sizes = arguments.check_split_sizes(
            input_split_sizes, in_spec.shape[0], n, "input_split_sizes"
        )
        outputs, inputs = split_rows(output, out_sizes), split_rows(input, in_sizes)
        names = ("output", "input")
        options = _alltoall_options(group, outputs, inputs, names, timeout, async_op)
    run, keep = group.prepare("alltoall", (outputs, inputs), options)
    is_async = options.async_op

    def launch(args: tuple[Any, Any]) -> Work | None:
        return returned(
            run(lambda: (split_rows(args[0], out_sizes), split_rows(args[1], in_sizes))), is_async
        )

    return launch, keep


def _same_dtype_list(
    group: BaseGroup, xs: Any, name: str, dtype: str | None = None
) -> tuple[list[Any], str]:
    """Return ``xs`` as world-size buffers of one dtype (``dtype`` when given), and the dtype."""
    if not isinstance(xs, (list, tuple)):
        raise ArgumentTypeError(f"{name} must be a list of tensors, got {type(xs).__name__}")
    if len(xs) != group.world_size:
        raise ArgumentValueError(
            f"{name} must hold {group.world_size} tensors (the world size), got {len(xs)}"
        )
    for i, x in enumerate(xs):
        spec = arguments.check_tensor(group, x, f"{name}[{i}]")
        dtype = dtype or spec.dtype
        if spec.dtype != dtype:
            raise ArgumentValueError(f"{name}[{i}] has dtype {spec.dtype}, but must be {dtype}")
    return list(xs), str(dtype)


def _alltoall_options(
    group: BaseGroup,
    outputs: list[Any],
    inputs: list[Any],
    names: tuple[str, str],
    timeout: timedelta | None,
    async_op: bool,
) -> AllToAllOptions:
    """Check what both alltoall forms share and return the options of the call."""
    named = [(f"{names[0]}[{i}]", t) for i, t in enumerate(outputs)]
    arguments.check_disjoint(named, [(f"{names[1]}[{i}]", t) for i, t in enumerate(inputs)])
    options = AllToAllOptions(*arguments.check_call(timeout, async_op))
    check_written(group, named)
    return options
