"""Whether a torch tensor's memory holds its values: the tensors whose memory does not.

The library reads and writes a tensor's elements where its data pointer and strides
say they lie. Some tensors hold more than that, or something else: quantized ones
(their memory holds integers; the scale and zero point lie beside it), sparse and
mkldnn ones (not strided), nested ones (pieces that lie apart), meta ones (no memory)
and tensors of a subclass that defines ``__torch_dispatch__`` (a ``DTensor``, a
``FakeTensor``, a ``FunctionalTensor``: a wrapper whose values, if any, lie in other
tensors; a ``DTensor``'s data pointer is 0 and its shape the global one). A subclass
that does not define it (``torch.nn.Parameter``, ``class T(torch.Tensor): pass``)
shares a plain tensor's memory and holds its values.

``not_values`` says why such a tensor's memory does not hold its values;
``check_values`` refuses it as an op's argument. The ops run the check once per call
signature, on their checked path: a tensor of exactly ``torch.Tensor`` that they
cache pays nothing for it per call.
"""

from __future__ import annotations

import sys
from typing import Any

from collective.frameworks.kinds import is_torch
from collective.types import ArgumentTypeError


def not_values(t: Any) -> str:
    """Return why torch tensor ``t``'s memory does not hold its values densely; "" if it does.

    The reason starts with what ``t`` is ("it is quantized ...", "its layout is ...",
    "its class is ...") and ends with what to pass instead. A tensor whose memory
    holds its values costs a few attribute reads.
    """
    torch = sys.modules["torch"]
    kind = type(t)
    wraps = kind.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__
    if not (wraps or t.is_nested or t.is_quantized or t.is_meta) and t.layout is torch.strided:
        return ""
    if t.is_nested:
        return "it is a nested tensor; pass its pieces (t.unbind()) as tensors of their own"
    if wraps:
        return (
            f"its class is {kind.__qualname__}, a subclass of torch.Tensor that defines "
            f"__torch_dispatch__, whose memory does not hold its values; {_instead(t)}"
        )
    if t.is_quantized:
        return (
            f"it is quantized ({t.dtype}, {t.qscheme()}): its memory holds integers without "
            "their scale and zero point; pass t.dequantize(), or t.int_repr() with the "
            "quantizer's parameters"
        )
    if t.layout is not torch.strided:
        return (
            f"its layout is {t.layout}, whose memory does not hold the elements densely; "
            "pass t.to_dense()"
        )
    return "it is on the meta device and holds no data; pass a tensor on the cpu or a GPU"


def _instead(t: Any) -> str:
    """Return what to pass instead of ``t``, a tensor of a ``__torch_dispatch__`` subclass."""
    if callable(getattr(t, "to_local", None)) and callable(getattr(t, "full_tensor", None)):
        return "pass t.to_local() for this rank's shard, or t.full_tensor() for all of it"
    return "pass a plain tensor that holds the values"


def check_values(x: Any, name: str) -> None:
    """Refuse ``x``, an op's argument named ``name``, if it is a torch tensor ``not_values`` names.

    Raises:
        ArgumentTypeError: the message names ``name``, what it is and what to pass.

    """
    if is_torch(x):
        why = not_values(x)
        if why:
            raise refused(name, why)


def refused(name: str, why: str) -> ArgumentTypeError:
    """Return the error refusing argument ``name``, for which ``not_values`` said ``why``."""
    return ArgumentTypeError(f"{name} must be a tensor whose memory holds its values, but {why}")
