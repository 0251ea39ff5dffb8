"""Register the backend "collective" with torch.distributed; torch is imported only to do so.

``import collective`` registers it when ``torch.distributed`` is already imported
(``register_if_loaded``); otherwise torch registers it itself when it is imported, through
the ``torch.backends`` entry point (``autoload``), which imports nothing of torch's
either. The backend's classes are imported when torch first builds a group of it.
"""

from __future__ import annotations

import sys
import threading
from datetime import timedelta
from typing import Any

from collective.types import ArgumentTypeError, GroupOptions

BACKEND_NAME = "collective"
"""The backend's name, as ``torch.distributed.init_process_group`` takes it."""

_lock = threading.Lock()


def register_torch_backend() -> None:
    """Register this library with ``torch.distributed`` as the backend "collective".

    Afterwards ``torch.distributed.init_process_group("collective")`` (and ``new_group``,
    ``new_subgroups``) builds process groups whose CPU tensors move through this
    library's CPU groups: shared memory among the ranks on one host, Gloo between
    hosts. ``import collective`` already calls it, as does torch on import where this
    library is installed (unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``); call it yourself
    where neither ran, e.g. in a hook that sets up worker processes. Calling it again
    is a no-op.

    CUDA tensors need a backend of their own: ``init_process_group("cpu:collective,
    cuda:nccl")`` gives them to torch's NCCL.

    Raises:
        CollectiveError: torch was built without ``torch.distributed``.

    """
    import torch.distributed as dist

    from collective.types import CollectiveError

    if not dist.is_available():
        raise CollectiveError("this torch was built without torch.distributed")
    with _lock:
        plugin = dist.Backend._plugins.get(BACKEND_NAME.upper())
        if plugin is not None and plugin.creator_fn is create_process_group:
            return
        dist.Backend.register_backend(
            BACKEND_NAME, create_process_group, extended_api=True, devices=["cpu"]
        )


def register_if_loaded() -> None:
    """Register the backend if ``torch.distributed`` is imported already; never import it."""
    if "torch.distributed" in sys.modules:
        register_torch_backend()


def autoload() -> None:
    """Register the backend as torch is imported: the ``torch.backends`` entry point.

    torch calls this while it imports itself, and a failure here would fail that import,
    so nothing escapes: a failure leaves the backend unregistered, and
    ``register_torch_backend`` raises it where it is called.
    """
    try:
        register_torch_backend()
    except Exception:  # torch's import must survive whatever goes wrong here
        return


def create_process_group(backend_options: Any, pg_options: Any) -> Any:
    """Build this rank's ``CollectiveProcessGroup``: torch's creator of the backend.

    Args:
        backend_options: torch's ``_DistributedBackendOptions``: the group's prefix store,
            this rank, the group's size, its timeout and its name.
        pg_options: the ``pg_options`` given to ``init_process_group`` or ``new_group``:
            None, or a ``collective.types.GroupOptions`` (e.g. its ``cpu_transport``).

    Raises:
        TypeError: ``pg_options`` is of another kind.
        CollectiveTimeoutError: not every rank arrived within the group's timeout.

    """
    from collective.torch_backend.connect import build_group
    from collective.torch_backend.process_group import CollectiveProcessGroup

    if pg_options is not None and not isinstance(pg_options, GroupOptions):
        raise ArgumentTypeError(
            "pg_options of the collective backend must be None or a "
            f"collective.types.GroupOptions, got {type(pg_options).__name__}"
        )
    store = backend_options.store
    timeout: timedelta = backend_options.timeout
    group = build_group(
        store,
        backend_options.group_rank,
        backend_options.group_size,
        timeout,
        str(backend_options.group_id),
        pg_options,
    )
    return CollectiveProcessGroup(group, store)
