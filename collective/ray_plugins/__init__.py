"""Inside Ray: this library as a ``ray.util.collective`` backend and as a Ray Direct Transport."""

from collective.ray_plugins.hook import runtime_env
from collective.ray_plugins.register import register_ray_backend, register_tensor_transport

__all__ = ["register_ray_backend", "register_tensor_transport", "runtime_env"]
