"""torch's entry point for the torch.distributed backend "collective" of ``ray-collective``.

torch calls ``autoload`` as it imports itself (the ``torch.backends`` entry point;
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns it off). It registers the backend's name with
a creator that imports ``collective`` only when torch builds a group of it, so a process
that imports torch pays no import of this library. It lives outside the ``collective``
package because importing any module of that package imports the whole package first.
"""

from __future__ import annotations

from typing import Any

BACKEND_NAME = "collective"
"""The backend's name, as ``collective.torch_backend.names`` holds it."""


def autoload() -> None:
    """Register the backend with torch.distributed, unless it is registered already.

    Never raises: a failure here would fail torch's own import. Where it did not
    register, ``collective.register_torch_backend()`` raises why.
    """
    try:
        import torch.distributed as dist

        if dist.is_available() and BACKEND_NAME.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(
                BACKEND_NAME, create_process_group, extended_api=True, devices=["cpu"]
            )
    except Exception:  # torch's import must survive whatever goes wrong here
        return


def create_process_group(backend_options: Any, pg_options: Any) -> Any:
    """Build this rank's process group: ``collective.torch_backend.register``'s creator."""
    from collective.torch_backend.register import create_process_group as create

    return create(backend_options, pg_options)
