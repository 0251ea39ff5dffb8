"""Carry a caller's current CUDA stream into another thread, and order a stream after it.

A call that finishes its work in a thread of its own must queue its GPU copies on
the stream that was current for the caller, so that they follow what the caller
queued before the call; whoever waits for the call then orders its own current
stream after the last of them. CPU buffers need none of this: every function
here does nothing for them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from collective.frameworks.cuda_buffers import current_stream
from collective.frameworks.kinds import is_cupy, is_torch


def on_gpu(x: Any) -> bool:
    """Return whether ``x`` is a cupy array or a CUDA torch tensor."""
    return is_cupy(x) or (is_torch(x) and x.device.type == "cuda")


def caller_stream(x: Any) -> int | None:
    """Return the handle of the caller's current stream for GPU buffer ``x``; None on the CPU."""
    return current_stream(x) if on_gpu(x) else None


@contextlib.contextmanager
def using_stream(x: Any, stream: int | None) -> Iterator[None]:
    """Make ``stream`` current for ``x``'s library and device in this thread, for the block."""
    if stream is None:
        yield
        return
    if is_torch(x):
        import torch

        with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=x.device)):
            yield
        return
    import cupy

    with x.device, cupy.cuda.ExternalStream(stream):
        yield


def mark(x: Any, stream: int | None) -> Callable[[], None]:
    """Record where ``stream`` has got to; return what orders the current stream after that.

    The returned function makes the caller's current stream (of ``x``'s library and
    device) wait for the work queued on ``stream`` so far, without blocking the host.
    """
    if stream is None:
        return lambda: None
    if is_torch(x):
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.ExternalStream(stream, device=x.device))
        return lambda: torch.cuda.current_stream(x.device).wait_event(event)
    import cupy

    with x.device:
        cupy_event = cupy.cuda.Event(disable_timing=True)
        cupy_event.record(cupy.cuda.ExternalStream(stream))

    def order() -> None:
        with x.device:
            cupy.cuda.get_current_stream().wait_event(cupy_event)

    return order
