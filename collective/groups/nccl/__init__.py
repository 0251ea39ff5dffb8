"""NCCLGroup: ``cupy.cuda.nccl`` communicators, their streams, and the multigpu variants.

``base`` makes communicators and streams and launches, aborts and destroys; ``group``
and ``p2p`` hold the ops; ``comm`` talks to cupy's NCCL binding; ``cuda`` holds the
CUDA runtime calls and the process's stream pool.
"""

from collective.groups.nccl.group import NCCLGroup

__all__ = ["NCCLGroup"]
