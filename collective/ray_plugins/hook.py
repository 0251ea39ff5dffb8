"""Register the plug-ins in every worker of a job: a ``runtime_env`` with a setup hook."""

from __future__ import annotations

import os
from typing import Any

from collective.ray_plugins.names import DEFAULT_NAME, check_name
from collective.types import ArgumentValueError

BACKEND_VARIABLE = "COLLECTIVE_RAY_BACKEND"
"""The environment variable that names the backend the hook registers."""

TRANSPORT_VARIABLE = "COLLECTIVE_RAY_TRANSPORT"
"""The environment variable that names the transport the hook registers, if set."""

HOOK = "collective.ray_plugins.hook.setup_worker"
"""The hook, as Ray's ``worker_process_setup_hook`` takes it: a module path."""


def runtime_env(
    backend: str = DEFAULT_NAME,
    transport: str | None = DEFAULT_NAME,
    base: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Return a ``runtime_env`` whose workers register the plug-ins as they start.

    Pass it to ``ray.init(runtime_env=...)`` (or to a job's or an actor's options):
    every worker then registers Ray collective backend ``backend`` and, unless
    ``transport`` is None, tensor transport ``transport``, before it runs anything,
    so the actors' code needs no change. The driver still registers them itself.

    Args:
        backend: the backend's name.
        transport: the transport's name (it also registers backend ``transport``), or
            None for the backend alone.
        base: a runtime_env to extend; its ``env_vars`` are kept, and it must not
            have a ``worker_process_setup_hook`` of its own.

    Raises:
        TypeError: a name is no str.
        ValueError: a name is empty, or ``base`` has a setup hook already.

    """
    env = dict(base or {})
    if env.get("worker_process_setup_hook") not in (None, HOOK):
        raise ArgumentValueError("base already has a worker_process_setup_hook")
    variables = {**env.get("env_vars", {}), BACKEND_VARIABLE: check_name(backend)}
    if transport is not None:
        variables[TRANSPORT_VARIABLE] = check_name(transport)
    env["env_vars"] = variables
    env["worker_process_setup_hook"] = HOOK
    return env


def setup_worker() -> None:
    """Register the backend and transport that the environment names, in this worker."""
    from collective.ray_plugins.register import register_ray_backend, register_tensor_transport

    register_ray_backend(os.environ.get(BACKEND_VARIABLE, DEFAULT_NAME))
    transport = os.environ.get(TRANSPORT_VARIABLE)
    if transport:
        register_tensor_transport(transport)
