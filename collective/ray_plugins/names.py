"""The plug-ins' names and their check; imports no Ray, so ``import collective`` stays light."""

from __future__ import annotations

from typing import Any

from collective.types import ArgumentTypeError, ArgumentValueError

DEFAULT_NAME = "COLLECTIVE"
"""The backend's and the transport's name by default, as Ray keys them (upper case)."""

SHM_NAME = "COLLECTIVE_SHM"
"""The one-sided shared-memory transport's name by default."""


def check_name(name: Any) -> str:
    """Return ``name`` in upper case, as Ray keys its registries, if it is a non-empty str.

    Raises:
        ArgumentTypeError: ``name`` is no str.
        ArgumentValueError: ``name`` is empty.

    """
    if not isinstance(name, str):
        raise ArgumentTypeError(f"name must be a str, got {type(name).__name__}")
    if not name:
        raise ArgumentValueError("name must be a non-empty string")
    return name.upper()
