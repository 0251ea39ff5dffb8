"""A rank's own checks of a bulk call's arguments; a failure is kept to travel to every rank.

A bulk call never raises its argument errors on one rank alone: the other ranks would
wait for it in the agreement. ``Captured`` keeps the first one, and the agreement
makes every rank raise it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from types import TracebackType
from typing import Any

from collective.bulk.meta import Listing
from collective.checks import arguments
from collective.checks.written import check_written
from collective.frameworks import kinds, memory, packing, values
from collective.frameworks.kinds import TensorSpec
from collective.groups.base import BaseGroup
from collective.types import ArgumentError, ArgumentTypeError, ArgumentValueError, ReduceOp

MIN_BUCKET_BYTES = 8
"""The smallest bucket: one element of the widest dtype."""


class Captured:
    """A block whose first argument error is kept in ``error`` instead of raised."""

    def __init__(self) -> None:
        """Start with no error."""
        self.error: ArgumentError | None = None

    def __enter__(self) -> Captured:
        """Run the checks."""
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        """Keep an argument error; let any other exception through."""
        if isinstance(error, ArgumentError):
            self.error = error
            return True
        return False


def check_bucket_bytes(value: Any, default: int) -> int:
    """Return ``value`` (``default`` when None) if it is an int of at least ``MIN_BUCKET_BYTES``."""
    if value is None:
        return default
    value = arguments.check_int(value, "bucket_bytes")
    if value < MIN_BUCKET_BYTES:
        raise ArgumentValueError(
            f"bucket_bytes must be at least {MIN_BUCKET_BYTES} (one element of any dtype), "
            f"got {value}"
        )
    return value


def check_buffers(
    group: BaseGroup, xs: list[Any], labels: list[str], reduce_op: ReduceOp | None
) -> list[TensorSpec]:
    """Return the specs of ``xs`` (named ``labels``) if ``group`` can move them in one call.

    A broadcast moves bytes, so any dtype goes on any backend; a reduction takes the
    dtypes and reductions that the group's allreduce takes. On a GPU group every
    buffer must be of one library and on one device.
    """
    specs = []
    reductions: set[str] = set()
    device, dtypes = group.device_type, group.dtypes if reduce_op is not None else kinds.DTYPES
    for x, label in zip(xs, labels, strict=True):
        values.check_values(x, label)
        spec = kinds.spec(x, label)
        if spec.dtype not in dtypes or spec.device.split(":")[0] != device:
            moved = spec if reduce_op is not None else replace(spec, dtype="uint8")
            group.check_tensor(moved, label)
        if reduce_op is not None and spec.dtype not in reductions:
            reductions.add(spec.dtype)
            try:
                group.check_reduce_op(reduce_op, spec.dtype)
            except ArgumentError as error:
                raise type(error)(f"{label}: {error}") from None
        specs.append(spec)
    if group.device_type == "cuda" and specs:
        first = specs[0]
        for spec, label in zip(specs, labels, strict=True):
            if (spec.kind, spec.device) != (first.kind, first.device):
                raise ArgumentValueError(
                    f"{label} is a {spec.kind} buffer on {spec.device} but {labels[0]} a "
                    f"{first.kind} buffer on {first.device}; one call on a GPU group takes "
                    "buffers of one library on one device"
                )
    return specs


def check_list(xs: Any, name: str) -> list[Any]:
    """Return ``xs`` as a list if it is a list or tuple (of anything)."""
    if not isinstance(xs, (list, tuple)):
        raise ArgumentTypeError(f"{name} must be a list of tensors, got {type(xs).__name__}")
    return list(xs)


def check_state_dict(state_dict: Any) -> dict[str, Any]:
    """Return ``state_dict`` as a dict if it maps str keys that UTF-8 can encode to anything.

    The keys travel to the other ranks as UTF-8; a lone surrogate (U+D800)
    has no UTF-8 form.
    """
    if not isinstance(state_dict, Mapping):
        raise ArgumentTypeError(
            f"state_dict must be a dict of str to tensors, got {type(state_dict).__name__}"
        )
    for key in state_dict:
        if not isinstance(key, str):
            raise ArgumentTypeError(
                f"state_dict keys must be str, got {type(key).__name__} key {key!r}"
            )
        try:
            key.encode()
        except UnicodeEncodeError as exc:
            raise ArgumentValueError(
                f"state_dict keys must be encodable as UTF-8, got key {key!r} ({exc.reason} "
                f"at character {exc.start})"
            ) from None
    return dict(state_dict)


def listing(specs: list[TensorSpec], names: list[str] | None) -> Listing:
    """Return the listing of buffers described by ``specs``, named ``names`` (None: a list)."""
    return Listing(
        None if names is None else tuple(names),
        tuple(s.dtype for s in specs),
        tuple(s.shape for s in specs),
    )


def check_outputs(group: BaseGroup, xs: list[Any], labels: list[str]) -> list[Any]:
    """Return views of ``xs`` to write in place, once ``check_written`` lets them be written."""
    views = [packing.writable(x) for x in xs]
    check_written(group, list(zip(labels, views, strict=True)))
    return views


def check_no_overlap(xs: list[Any], labels: list[str]) -> None:
    """Reject buffers of a reduction that share an element: it would be reduced twice.

    Views of one buffer that share no element (``x[0::2]`` and ``x[1::2]``) pass.
    """
    spans = sorted(
        (span, i) for i, x in enumerate(xs) if (span := memory.memory_span(x))[0] != span[1]
    )
    reach: list[tuple[int, int]] = []
    """The buffers whose spans may still reach the next one's, as (end, index)."""
    for (start, end), i in spans:
        reach = [(e, j) for e, j in reach if e > start]
        for _, j in reach:
            if memory.shares_elements(xs[i], xs[j]):
                first, second = sorted((i, j))
                raise ArgumentValueError(
                    f"{labels[first]} and {labels[second]} share memory; pass distinct buffers"
                )
        reach.append((end, i))
