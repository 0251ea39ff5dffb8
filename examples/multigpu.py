"""Actors that drive several GPUs each: the ``*_multigpu`` calls of an NCCL group.

Every actor passes one torch tensor per GPU it holds. An actor of rank ``r`` with ``n``
GPUs holds NCCL ranks ``r * n`` to ``r * n + n - 1``, one per GPU, so a group of two
actors with two GPUs each is a four-rank NCCL job. The program uses every GPU on this
machine: one actor with all of them, or two actors with half each when there are four
or more. It prints what each GPU holds after each call and checks it.

Without a CUDA GPU, torch with CUDA, or cupy with NCCL it prints ``skipped: <reason>``
and exits with status 0.

GPU example: ``tests/gpu/run.sh`` runs it on a GPU machine.

Usage: python examples/multigpu.py
"""

from __future__ import annotations

import sys

import ray
import torch

import collective as col

GROUP = "multigpu"


def skip_reason() -> str:
    """Return why this machine cannot run the example, or an empty string if it can."""
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to torch"
    if not col.nccl_available():
        return "the NCCL backend is unavailable: it needs cupy with NCCL (pip install cupy-cuda12x)"
    return ""


@ray.remote(num_cpus=0)
class GpuWorker:
    """One rank of the group, driving every GPU that Ray gave it."""

    def run(self, world_size: int, rank: int, gpus: int) -> dict[str, list[list[float]]]:
        # Ray makes this actor's GPUs, and only those, visible as cuda:0 .. cuda:gpus-1.
        if torch.cuda.device_count() != gpus:
            raise RuntimeError(f"expected {gpus} visible GPUs, got {torch.cuda.device_count()}")
        col.init_collective_group(world_size, rank, backend="nccl", group_name=GROUP)
        total = world_size * gpus
        ids = [rank * gpus + i for i in range(gpus)]  # the NCCL rank of each local GPU
        devices = [torch.device("cuda", i) for i in range(gpus)]
        got: dict[str, list[list[float]]] = {}

        # Sum across every GPU of every actor; each local tensor receives the sum.
        xs = [torch.full((2,), float(g + 1), device=d) for g, d in zip(ids, devices, strict=True)]
        col.allreduce_multigpu(xs, GROUP)
        got["allreduce_multigpu"] = [x.tolist() for x in xs]

        # Copy rank 0's last GPU's tensor into every other GPU's.
        xs = [torch.full((2,), float(g), device=d) for g, d in zip(ids, devices, strict=True)]
        col.broadcast_multigpu(xs, src_rank=0, src_tensor=gpus - 1, group_name=GROUP)
        got["broadcast_multigpu"] = [x.tolist() for x in xs]

        # Sum onto GPU 0 of rank 0 only; every other tensor keeps its value.
        xs = [torch.full((2,), float(g + 1), device=d) for g, d in zip(ids, devices, strict=True)]
        col.reduce_multigpu(xs, dst_rank=0, dst_tensor=0, group_name=GROUP)
        got["reduce_multigpu"] = [x.tolist() for x in xs]

        # Each GPU receives every GPU's tensor, indexed by NCCL rank.
        outs = [[torch.zeros(1, device=d) for _ in range(total)] for d in devices]
        xs = [torch.full((1,), float(g), device=d) for g, d in zip(ids, devices, strict=True)]
        col.allgather_multigpu(outs, xs, GROUP)
        got["allgather_multigpu"] = [torch.cat(out).tolist() for out in outs]

        # Every GPU offers one tensor per NCCL rank; NCCL rank k receives the sum of the k-th.
        ins = [[torch.full((2,), float(k + 1), device=d) for k in range(total)] for d in devices]
        xs = [torch.zeros(2, device=d) for d in devices]
        col.reducescatter_multigpu(xs, ins, GROUP)
        got["reducescatter_multigpu"] = [x.tolist() for x in xs]

        # With two actors, rank 0's last GPU sends to rank 1's first GPU.
        if world_size > 1 and rank == 0:
            x = torch.full((2,), 7.0, device=devices[-1])
            col.send_multigpu(x, dst_rank=1, dst_gpu_index=0, group_name=GROUP)
            got["send_multigpu -> recv_multigpu"] = [x.tolist()]
        elif world_size > 1:
            x = torch.zeros(2, device=devices[0])
            col.recv_multigpu(x, src_rank=0, src_gpu_index=gpus - 1, group_name=GROUP)
            got["send_multigpu -> recv_multigpu"] = [x.tolist()]

        for i in range(gpus):
            col.synchronize(i)  # block until each GPU's queued work is done
        col.destroy_collective_group(GROUP)
        return got


def expected(world_size: int, rank: int, gpus: int) -> dict[str, list[list[float]]]:
    """Return what each of rank ``rank``'s GPUs should hold after each call."""
    total = world_size * gpus
    ids = [rank * gpus + i for i in range(gpus)]
    everyone = total * (total + 1) / 2
    want = {
        "allreduce_multigpu": [[everyone] * 2 for _ in ids],
        "broadcast_multigpu": [[float(gpus - 1)] * 2 for _ in ids],
        "reduce_multigpu": [[everyone if g == 0 else g + 1.0] * 2 for g in ids],
        "allgather_multigpu": [[float(k) for k in range(total)] for _ in ids],
        "reducescatter_multigpu": [[total * (g + 1.0)] * 2 for g in ids],
    }
    if world_size > 1:
        want["send_multigpu -> recv_multigpu"] = [[7.0] * 2]
    return want


def main() -> int:
    """Run the group on this machine's GPUs, print each GPU's results, and check them."""
    reason = skip_reason()
    if reason:
        print(f"skipped: {reason}")
        return 0
    count = torch.cuda.device_count()
    world_size = 2 if count >= 4 else 1
    gpus = count // world_size
    print(f"{world_size} actor(s) with {gpus} GPU(s) each: NCCL ranks 0-{world_size * gpus - 1}")
    ray.init(address="local", num_cpus=2, num_gpus=count, namespace=GROUP, include_dashboard=False)
    try:
        workers = [GpuWorker.options(num_gpus=gpus).remote() for _ in range(world_size)]
        refs = [w.run.remote(world_size, rank, gpus) for rank, w in enumerate(workers)]
        results = ray.get(refs, timeout=300)
    finally:
        ray.shutdown()
    ok = True
    for op in results[0]:
        print(f"\n{op}")
        for rank, result in enumerate(results):
            want = expected(world_size, rank, gpus)[op]
            ok = ok and result[op] == want
            for i, values in enumerate(result[op]):
                print(f"  rank {rank} GPU {i}: {values}" + ("" if values == want[i] else " WRONG"))
    print(f"\nevery GPU holds what it should: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
