"""NCCLGroup: ``cupy.cuda.nccl`` communicators, their streams, and the multigpu variants.

``lifecycle`` makes communicators and streams and fails, aborts and destroys; ``running``
runs an op through its cached ``launch``, blocking on the caller's stream or async;
``mismatch`` compares each op's signature among the ranks on the GPU; ``watchdog``
watches every op against its timeout; ``group`` and ``p2p`` describe the ops;
``comm`` talks to cupy's NCCL binding; ``cuda`` holds the CUDA runtime calls and the
process's stream pool. It imports the shared pieces of ``collective.groups``,
``collective.rendezvous``, ``collective.frameworks``, ``collective.signature``,
``collective.types`` and ``collective.work``; never another transport.
"""

from collective.groups.nccl.group import NCCLGroup

__all__ = ["NCCLGroup"]
