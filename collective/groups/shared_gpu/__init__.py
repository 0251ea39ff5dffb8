"""The shared-GPU transport: ranks on one GPU move bytes through device memory they all map.

Each rank allocates its own slots with ``cudaMalloc`` and exports them, and a pair of
interprocess events per slot, through CUDA IPC once, when the transport connects;
every other rank of the GPU opens them once (``arena``). The ops are the shared-memory
transport's collectives (``groups.shm.algorithms``) over those device slots: the host
side of every step (who may write a slot, who has read it, which op and signature it
carries) lives in a host shared-memory arena, as on the CPU, and ``steps`` adds the
device side: an event recorded on the caller's stream before a step is posted, and a
stream wait on the writer's event after it is collected, so no kernel ever waits for
another process (kernels of processes that share a GPU are time-sliced). ``device``
is the one place that calls the CUDA runtime, through cupy; ``reduce`` holds the
reductions on device memory. ``mail`` sends and receives between
two ranks through the sender's device mailboxes; ``running`` and ``group`` make the
``SharedGpuGroup`` of ranks that all share one GPU. This room imports ``groups.shm``
(the step protocol it builds on), the shared pieces of ``collective.groups``,
``collective.rendezvous``, ``collective.frameworks``, ``collective.signature``,
``collective.types`` and ``collective.work``.
"""
