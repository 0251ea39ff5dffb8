"""Register the backend "collective" with torch.distributed; torch is imported only to do so.

``import collective`` registers it when ``torch.distributed`` is already imported
(``register_if_loaded``); otherwise torch registers it itself when it is imported, through
the ``torch.backends`` entry point (the top-level module ``collective_torch_backend``,
whose creator calls this one's). The backend's classes are imported when torch first
builds a group of it.
"""

from __future__ import annotations

import sys
import threading
from datetime import timedelta
from typing import Any

from collective.torch_backend.names import BACKEND_NAME
from collective.types import ArgumentTypeError, GroupOptions

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

    CUDA tensors need a backend of their own:
    ``init_process_group("cpu:collective,cuda:nccl")`` gives them to torch's NCCL.

    Raises:
        CollectiveError: torch was built without ``torch.distributed``.

    """
    import torch.distributed as dist

    from collective.types import CollectiveError

    if not dist.is_available():
        raise CollectiveError("this torch was built without torch.distributed")
    with _lock:
        plugin = dist.Backend._plugins.get(BACKEND_NAME.upper())
        if plugin is not None and plugin.creator_fn in _creators():
            return
        dist.Backend.register_backend(
            BACKEND_NAME, create_process_group, extended_api=True, devices=["cpu"]
        )


def register_if_loaded() -> None:
    """Register the backend if ``torch.distributed`` is imported already; never import it."""
    if "torch.distributed" in sys.modules:
        register_torch_backend()


def _creators() -> tuple[Any, ...]:
    """Return the creators that register this backend: this module's and the entry point's."""
    try:
        import collective_torch_backend
    except ImportError:  # a checkout that is not installed
        return (create_process_group,)
    return (create_process_group, collective_torch_backend.create_process_group)


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
