"""Inside Ray: this library as a ``ray.util.collective`` backend and as a Ray Direct Transport.

``backend`` is the group Ray's collective registry builds (a subclass of Ray's
``BaseGroup`` that runs on ours); ``transport`` is the two-sided
``TensorTransportManager`` of Ray Direct Transport, which moves an object's tensors
with ``wire``; ``shm_transport`` is the one-sided one, whose consumers map the
shared-memory file that ``segment`` writes (and ``held`` unlinks when the object is
freed or its Ray session ends), or read it from another node through
``remote_read``, and whose CUDA objects (``cuda_objects``) lie in one device buffer
(``cuda_buffer``) that consumers on the GPU open through CUDA IPC (``cuda_gpus``);
``carried`` refuses for both what they cannot move whole; ``register`` registers
them in this process and ``hook`` in every worker of a job; ``names`` holds their
names. It sits
at the top, beside the public names: it imports ``collective.ops``,
``collective.registry``, ``collective.groups`` (and the arena helpers of
``collective.groups.shm``, the ``Device`` of ``collective.groups.shared_gpu``),
``collective.checks``, ``collective.frameworks``,
``collective.types`` and ``collective.work``, and nothing imports it but
``collective``.
"""

from collective.ray_plugins.hook import runtime_env
from collective.ray_plugins.register import (
    register_ray_backend,
    register_shm_transport,
    register_tensor_transport,
)

__all__ = [
    "register_ray_backend",
    "register_shm_transport",
    "register_tensor_transport",
    "runtime_env",
]
