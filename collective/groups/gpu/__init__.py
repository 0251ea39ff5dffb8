"""The GPU group: NCCL among GPUs, device memory among ranks that share one, picked at init.

``connect`` builds the group of ``backend="nccl"``: the ranks exchange their GPU's UUID
through the store (never its index, which Ray and ``CUDA_VISIBLE_DEVICES`` renumber per
process), then every rank derives the same choice from what all published. Where
several GPUs hold several ranks, ``hierarchy`` (its ops) and ``running`` (connecting,
agreeing, failing) compose the shared-GPU transport inside each GPU with NCCL among one
leader per GPU; ``stages`` says what they ask of NCCL and of cupy; ``multigpu`` runs
the ``*_multigpu`` calls of ranks that drive several GPUs on such groups. Where two
ranks share one GPU and NCCL 2.30's multi-rank mode was measured faster for some ops
and sizes (``routes``, the committed ``multirank_routes.json``), ``routed`` sends
those ops to NCCL and the rest to the shared-GPU transport. This is the one
package that knows both GPU transports: it imports ``groups.nccl``,
``groups.shared_gpu``, the shared pieces of ``collective.groups``,
``collective.rendezvous``, ``collective.frameworks`` and ``collective.types``.
"""
