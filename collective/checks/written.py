"""Checks on the buffers an op writes: grad leaves, overlapping and read-only memory, aliases.

A read-only buffer is what Ray hands out: a numpy array that an actor method gets
as its argument or from ``ray.get``, mapped from the object store, or a torch
tensor over one. ``ray.util.collective`` writes such buffers in place, and so do
we by default, with one warning per process; a group with ``strict_buffers``
refuses them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from collective.frameworks import kinds, memory
from collective.groups.base import BaseGroup
from collective.types import ArgumentValueError

_logger = logging.getLogger("collective")
_warned = threading.Event()
"""Set once this process has logged the read-only buffer warning."""

_STRICT = ". strict_buffers is set, so the op refuses it: pass a copy (np.array(x), x.clone())"
_ADVICE = (
    ". The op writes it in place, as ray.util.collective does. To avoid this, pass a copy "
    "(np.array(x), x.clone()), or refuse such buffers with strict_buffers=True on "
    "init_collective_group/declare_collective_group or COLLECTIVE_STRICT_BUFFERS=1. "
    "This warning is logged once per process."
)


def check_written(group: BaseGroup, outputs: Sequence[tuple[str, Any]]) -> None:
    """Reject buffers the op may not write in place; warn once about read-only ones.

    A torch leaf tensor that requires grad and a buffer whose elements share memory
    are refused. A read-only buffer (see ``memory.write_hazards``) is refused when
    the group has ``strict_buffers``; otherwise it is written in place, as
    ``ray.util.collective`` does, and the first one logs a warning in this process.

    Args:
        group: the group the op runs on.
        outputs: ``(name, buffer)`` pairs that the op writes on this rank.

    Raises:
        ArgumentValueError: a buffer may not be written.

    """
    for name, x in outputs:
        hazards = memory.write_hazards(x)
        if not hazards:
            continue
        if hazards & memory.GRAD_LEAF:
            raise ArgumentValueError(
                f"{name} is a leaf tensor that requires grad, which the op would overwrite "
                f"in place behind autograd's back; pass {name}.detach() to write its data, "
                "or a copy"
            )
        if hazards & memory.OVERLAPPING:
            raise ArgumentValueError(memory.overlap_message(name))
        if hazards & memory.READ_ONLY:
            if group.options.strict_buffers:
                raise ArgumentValueError(read_only_message(name, x) + _STRICT)
            if not _warned.is_set():
                _warned.set()
                _logger.warning(read_only_message(name, x) + _ADVICE)


def read_only_message(name: str, x: Any) -> str:
    """Return what is wrong with writing the read-only buffer ``x`` called ``name``."""
    kind = "numpy array" if kinds.spec(x, name).kind == "numpy" else "torch tensor"
    return (
        f"{name} is a read-only {kind}, usually one that Ray mapped from its object store "
        "(an actor method's argument or a ray.get result); writing it in place changes the "
        "object for every other reader of it on this node"
    )


def same_as_output(output: Any, inputs: list[Any], name: str, list_name: str) -> list[int]:
    """Return the indices of the buffers of ``inputs`` that are ``output`` itself.

    The op reads those from a copy of ``output`` taken before it runs, so
    ``reducescatter(chunks[rank], chunks)`` reads every chunk before the result
    lands in ``chunks[rank]``, and no other chunk changes.

    Raises:
        ArgumentValueError: ``output`` overlaps an input without being exactly it.

    """
    found = memory.aliasing(output, inputs)
    if memory.PARTIAL in found:
        i = found.index(memory.PARTIAL)
        raise ArgumentValueError(
            f"{name} and {list_name}[{i}] share memory; {name} may be one of the "
            f"buffers of {list_name}, but not a part of one"
        )
    return [i for i, how in enumerate(found) if how == memory.SAME]
