"""Device arrays a GPU group makes for its own stages: typed views, scratch, streams.

A group over several GPUs reduces among the GPUs' leaders with NCCL on views of
device bytes: ``typed`` gives NCCL the dtype (cupy has no bfloat16, so a bfloat16
view is a torch tensor), ``empty`` makes scratch on the current stream (cupy's pool
reuses a block only on the stream that freed it, so scratch never races), and
``on_stream`` makes a torch view's NCCL call run on the op's stream.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from typing import Any

from collective.frameworks.kinds import is_torch


def _cupy() -> Any:
    return sys.modules.get("cupy") or importlib.import_module("cupy")


def typed(view: Any, dtype: str) -> Any:
    """Return the bytes ``view`` (a flat uint8 cupy array) as elements of ``dtype``, shared."""
    if dtype != "bfloat16":
        return view.view(dtype)
    import torch

    words = view.view(_cupy().int16)
    return torch.as_tensor(words, device=f"cuda:{view.device.id}").view(torch.bfloat16)


def empty(nbytes: int) -> Any:
    """Return ``nbytes`` uninitialised bytes on the current device, from the current stream."""
    cupy = _cupy()
    return cupy.empty(nbytes, dtype=cupy.uint8)


@contextlib.contextmanager
def on_stream(x: Any, stream: int) -> Iterator[None]:
    """Make ``stream`` torch's current stream for the block where ``x`` is a torch tensor.

    For a cupy array it does nothing: the group already made ``stream`` cupy's
    current stream.
    """
    if not is_torch(x):
        yield
        return
    import torch

    with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=x.device)):
        yield
