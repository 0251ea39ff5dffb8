"""Collective communication for Ray actors, a drop-in for ``ray.util.collective``."""

from collective._version import __version__ as __version__
from collective.bulk.api import allreduce_tensors, broadcast_state_dict, broadcast_tensors
from collective.groups.base import BaseGroup
from collective.ops.collectives import (
    allgather,
    allreduce,
    barrier,
    broadcast,
    recv,
    reduce,
    reducescatter,
    send,
)
from collective.ops.gather_scatter import alltoall, alltoall_single, gather, scatter
from collective.ops.graphs import watch
from collective.ops.multigpu import (
    allgather_multigpu,
    allreduce_multigpu,
    broadcast_multigpu,
    recv_multigpu,
    reduce_multigpu,
    reducescatter_multigpu,
    send_multigpu,
    synchronize,
)
from collective.ray_plugins.register import (
    register_ray_backend,
    register_shm_transport,
    register_tensor_transport,
)
from collective.registry.backends import register_collective_backend
from collective.registry.elastic import (
    grow_declared_group,
    grow_group,
    shrink_declared_group,
    shrink_group,
)
from collective.registry.held import get_group_handle
from collective.registry.lifecycle import (
    create_collective_group,
    declare_collective_group,
    destroy_all_collective_groups,
    destroy_collective_group,
    init_collective_group,
)
from collective.registry.queries import (
    get_collective_group_size,
    get_collective_groups,
    get_rank,
    gloo_available,
    is_backend_available,
    is_group_initialized,
    list_collective_groups,
    nccl_available,
)
from collective.registry.subgroups import new_group
from collective.torch_backend.register import register_if_loaded as _register_if_loaded
from collective.torch_backend.register import register_torch_backend
from collective.types import (
    ArgumentError,
    ArgumentTypeError,
    ArgumentValueError,
    Backend,
    CollectiveError,
    CollectiveTimeoutError,
    GroupNotFoundError,
    ReduceOp,
)
from collective.work import Work

__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "ArgumentValueError",
    "Backend",
    "BaseGroup",
    "CollectiveError",
    "CollectiveTimeoutError",
    "GroupNotFoundError",
    "ReduceOp",
    "Work",
    "allgather",
    "allgather_multigpu",
    "allreduce",
    "allreduce_multigpu",
    "allreduce_tensors",
    "alltoall",
    "alltoall_single",
    "barrier",
    "broadcast",
    "broadcast_multigpu",
    "broadcast_state_dict",
    "broadcast_tensors",
    "create_collective_group",
    "declare_collective_group",
    "destroy_all_collective_groups",
    "destroy_collective_group",
    "gather",
    "get_collective_group_size",
    "get_collective_groups",
    "get_group_handle",
    "get_rank",
    "gloo_available",
    "grow_declared_group",
    "grow_group",
    "init_collective_group",
    "is_backend_available",
    "is_group_initialized",
    "list_collective_groups",
    "nccl_available",
    "new_group",
    "recv",
    "recv_multigpu",
    "reduce",
    "reduce_multigpu",
    "reducescatter",
    "reducescatter_multigpu",
    "register_collective_backend",
    "register_ray_backend",
    "register_shm_transport",
    "register_tensor_transport",
    "register_torch_backend",
    "scatter",
    "send",
    "send_multigpu",
    "shrink_declared_group",
    "shrink_group",
    "synchronize",
    "watch",
]

_register_if_loaded()
