"""Read an object's shared-memory file from another node, through Ray's object store.

A consumer on another node than the producer cannot map the producer's file. It
runs ``read_on_node`` as a Ray task pinned to the producer's node
(``NodeAffinitySchedulingStrategy(node_id, soft=False)``): the task maps the file,
checks it and its producer as a local consumer does, and returns the whole file as
one array, whose bytes travel once through Ray's object store. The consumer then
cuts the tensors from those bytes as a local consumer cuts them from its mapping
(``segment.views``), so both paths give the same tensors, bit for bit.
"""

from __future__ import annotations

import functools
import threading
import time
from datetime import timedelta
from typing import Any

import numpy as np

from collective.frameworks.bytelist import address, raw_bytes
from collective.ray_plugins import segment
from collective.types import CollectiveError, CollectiveTimeoutError

WAIT_SLICE_S = 0.05
"""How often a waiting read looks whether it was aborted, in seconds."""


@functools.cache
def _task() -> Any:
    """Return ``read_on_node`` as a Ray remote function, made once per process."""
    import ray

    return ray.remote(num_cpus=0, max_retries=0)(read_on_node)


def read_on_node(
    path: str, obj_id: str, table: segment.Table, size: int, pid: int, started: int
) -> np.ndarray:
    """Return the whole file of ``obj_id`` at ``path``, read on the producer's node.

    Runs as a Ray task on the node of the producer ``pid`` (started at ``started``),
    and checks what a consumer on that node checks: the file is the object's, and
    its producer still runs (if it died, its file is removed).

    Raises:
        CollectiveError: the producer freed the object or died, or the file is not
            the object's.

    """
    try:
        base = segment.mapped(path, obj_id, table, size)
    except FileNotFoundError:
        raise CollectiveError(segment.gone(obj_id, pid, started)) from None
    if not segment.alive(pid, started):
        segment.unlink(path)
        raise CollectiveError(segment.gone(obj_id, pid, started))
    return np.asarray(base.numpy())


def start(
    node_id: str, path: str, obj_id: str, table: segment.Table, size: int, pid: int,
    started: int,
) -> Any:  # fmt: skip
    """Start ``read_on_node`` on node ``node_id``; return the reference to its result."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    strategy = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    return (
        _task()
        .options(scheduling_strategy=strategy)
        .remote(path, obj_id, table, size, pid, started)
    )


def fetch(
    ref: Any,
    obj_id: str,
    node_id: str,
    timeout_s: float,
    name: str,
    aborted: threading.Event | None = None,
) -> np.ndarray:
    """Wait up to ``timeout_s`` seconds for the bytes of ``obj_id`` read on ``node_id``.

    The wait looks at ``aborted`` every ``WAIT_SLICE_S``: once it is set, the read is
    cancelled and a ``CollectiveError`` raised.

    Args:
        ref: the reference ``start`` returned.
        obj_id: the object's id, for messages.
        node_id: the producer's node, for messages.
        timeout_s: how long to wait, in seconds.
        name: the transport's name, for messages.
        aborted: set when the read must end now.

    Returns:
        The whole file, read-only (it lies in Ray's object store).

    Raises:
        CollectiveTimeoutError: the bytes did not come within ``timeout_s``; the read
            is cancelled.
        CollectiveError: the reader raised (the message is the reader's), or Ray could
            not run it there (the node is gone) or cancelled it.

    """
    import ray
    from ray.exceptions import GetTimeoutError, RayError, RayTaskError

    deadline = time.monotonic() + timeout_s
    try:
        while not ray.wait([ref], timeout=min(WAIT_SLICE_S, max(deadline - time.monotonic(), 0)))[
            0
        ]:
            if aborted is not None and aborted.is_set():
                ray.cancel(ref)
                raise CollectiveError(f"the read of object {obj_id} was aborted")
            if time.monotonic() >= deadline:
                raise GetTimeoutError
        payload = ray.get(ref, timeout=max(deadline - time.monotonic(), WAIT_SLICE_S))
    except GetTimeoutError:
        ray.cancel(ref)
        raise CollectiveTimeoutError(
            f"read of object {obj_id} from node {node_id}", name, 0,
            timedelta(seconds=timeout_s), "RAY_rdt_fetch_fail_timeout_milliseconds sets the bound",
        ) from None  # fmt: skip
    except RayTaskError as exc:
        if isinstance(exc.cause, CollectiveError):
            raise CollectiveError(str(exc.cause.args[0])) from None
        raise CollectiveError(
            f"reading object {obj_id} on node {node_id} failed: {exc.cause!r}"
        ) from None
    except RayError as exc:
        raise CollectiveError(
            f"could not read object {obj_id} on node {node_id}, its producer's: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    return np.asarray(payload)


def whole(payload: np.ndarray, obj_id: str, table: segment.Table, size: int,
          private: bool) -> Any:  # fmt: skip
    """Return ``payload``, the whole file of ``obj_id``, as a checked ``uint8`` tensor.

    Args:
        payload: what ``fetch`` returned; it must outlive the result unless ``private``.
        obj_id: the object's id.
        table: the object's tensors' dtypes and shapes.
        size: the file's bytes.
        private: copy the bytes into memory of this process, to hand out views that
            may be written; else the result views ``payload`` and must only be read
            (it is copied too when ``payload`` is not aligned for every dtype).

    Raises:
        CollectiveError: ``payload`` is not the object's file.

    """
    import torch

    if payload.dtype != np.uint8 or payload.ndim != 1:
        raise CollectiveError(f"expecting the bytes of object {obj_id}, got {payload.dtype}")
    if private or address(payload) % segment.ALIGN:
        base = torch.empty(payload.nbytes, dtype=torch.uint8)
        base.numpy()[:] = payload
    else:  # read-only memory seen as writable: only ever read
        base = torch.from_numpy(raw_bytes(address(payload), payload.nbytes))
    segment.check(base, "the bytes read from another node", obj_id, table, size)
    return base
