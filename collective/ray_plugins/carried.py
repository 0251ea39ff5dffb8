"""What the tensor transports carry whole: the rest is refused at the producer's call.

Both transports move a tensor as its shape, its dtype and its elements' bytes, and
the consumer gets a plain dense tensor of them. A tensor that holds more than that
would arrive stripped of it, so it is refused before anything is written: quantized
tensors (their scale and zero point), sparse, mkldnn and nested tensors (their
indices or pieces), meta tensors (no data) and subclasses of ``torch.Tensor`` (their
own state; ``torch.nn.Parameter`` excepted, which arrives as a plain tensor). The ops
refuse all of these too (``frameworks.values``) but a subclass that does not define
``__torch_dispatch__``, whose memory holds its values: refusing it is the
transports' own rule.
Conjugate and negative views, non-contiguous and expanded tensors move whole: their
values arrive, resolved and contiguous.

A refused object leaves nothing behind: no file, and no entry in Ray's store of the
producer's objects, which holds the tensors before the transport sees them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from collective.frameworks.values import not_values
from collective.types import ArgumentTypeError


def refuse_uncarried(obj_id: str, tensors: Sequence[Any], transport: str) -> None:
    """Raise unless ``transport`` moves each of object ``obj_id``'s ``tensors`` whole.

    Raises:
        TypeError: a tensor is quantized, not strided, nested, on the meta device or
            of a subclass of ``torch.Tensor``; the message names it and why. Ray's
            store of the object in this process is emptied first.

    """
    for i, tensor in enumerate(tensors):
        why = _stripped(tensor)
        if why:
            _forget(obj_id)
            raise ArgumentTypeError(
                f"tensor transport {transport!r} cannot move tensor {i} of the object whole: {why}"
            )


def _stripped(t: Any) -> str:
    """Return what a plain dense copy of tensor ``t`` would lose, or "" if nothing.

    Beyond what ``values.not_values`` names, the state of any subclass of
    ``torch.Tensor`` but ``torch.nn.Parameter``.
    """
    import torch

    why = not_values(t)
    if why or type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter):
        return why
    return (
        f"its class is {type(t).__qualname__}, a subclass of torch.Tensor whose own "
        "state would be lost; pass plain tensors (a DTensor's t.to_local(), for one)"
    )


def _forget(obj_id: str) -> None:
    """Drop object ``obj_id`` from Ray's store of this process's objects, if it is there.

    Ray stores a method's (or ``ray.put``'s) tensors before it asks the transport
    for their metadata, and keeps them there when that fails.
    """
    from ray._private import worker

    manager = getattr(worker.global_worker, "_rdt_manager", None)
    store = getattr(manager, "rdt_store", None)
    if store is not None and store.has_object(obj_id):
        store.pop_object(obj_id)
