"""Watch the replay of a CUDA graph: the one work of an NCCL group no watchdog sees.

Ops captured in a CUDA graph record nothing for the watchdog (recording is a stream
operation, which capture would take into the graph), so a replay whose peer never
replays would wait for ever. ``watch``, called after ``graph.replay()``, puts the work
queued on the stream so far under the group's watchdog, as an op of the group.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from collective.checks import arguments
from collective.frameworks import cuda_buffers
from collective.registry.held import get_group_handle


def watch(
    group_name: str = "default", stream: Any = None, *, timeout: timedelta | None = None
) -> None:
    """Fail the group if the work queued on ``stream`` so far has not ended within ``timeout``.

    Call it right after ``graph.replay()`` of a CUDA graph that holds the group's
    ops: if a peer never replays, the watchdog aborts the group's communicators at
    the deadline, so the replay's kernels end and the stream moves on, and the
    group's next call raises ``CollectiveTimeoutError``. It returns at once, and
    writes no buffer.

    Args:
        group_name: an NCCL group whose ops the graph holds.
        stream: the stream the graph replays on: a ``torch.cuda.Stream``, a cupy
            stream or a stream handle; None: torch's current stream (cupy's without
            torch) on the current device.
        timeout: the longest the work may take; the group's timeout by default.

    Raises:
        ValueError: the group is not on GPUs, or ``stream`` captures a graph now.
        TypeError: ``stream`` or ``timeout`` is of a wrong kind.
        CollectiveError: the group has failed already.

    """
    group = get_group_handle(group_name)
    arguments.check_multigpu_group(group, "watch")
    limit = arguments.check_timeout(timeout) or group.timeout
    handle, device = cuda_buffers.stream_of(stream)
    group.watch_stream(handle, device, limit)
