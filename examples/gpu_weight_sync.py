"""Weight sync on GPUs: a trainer on one GPU sends its weights to rollouts on the others.

One actor per GPU (``num_gpus=1``): rank 0 trains and, after each step,
``broadcast_state_dict`` copies its model's CUDA weights over NCCL into every rollout's
own model, in place, matched by name; each rollout then checks that its weights equal
the trainer's. A ``backend="nccl"`` group of one rank per GPU runs plain NCCL; for a
trainer and rollouts that share one GPU, see ``colocated_weight_sync.py``.

It needs two or more GPUs, torch with CUDA and cupy with NCCL; otherwise it prints
``skipped: <reason>`` and exits with status 0.

GPU example: ``tests/gpu/run.sh`` runs it on a GPU machine.

Usage: python examples/gpu_weight_sync.py
"""

from __future__ import annotations

import sys

import ray
import torch

import collective as col

GROUP = "gpu-weights"
STEPS = 3


def skip_reason() -> str:
    """Return why this machine cannot run the example, or an empty string if it can."""
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to torch"
    if torch.cuda.device_count() < 2:
        return "it needs two GPUs (for one GPU, see colocated_weight_sync.py)"
    if not col.nccl_available():
        return "the NCCL backend is unavailable: it needs cupy with NCCL (pip install cupy-cuda12x)"
    return ""


def make_model() -> torch.nn.Module:
    """Return the policy: the same architecture on every actor."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64))


@ray.remote(num_gpus=1, num_cpus=0)
class Actor:
    """Rank 0 trains and sends; every other rank receives into its own model."""

    def setup(self, world_size: int, rank: int) -> None:
        self.rank = rank
        self.model = make_model().cuda()
        if rank != 0:
            with torch.no_grad():
                for p in self.model.parameters():
                    p.zero_()
        col.init_collective_group(world_size, rank, backend="nccl", group_name=GROUP)

    def step(self, step: int) -> list[float]:
        if self.rank == 0:
            with torch.no_grad():
                for p in self.model.parameters():
                    p.add_(float(step + 1))
        col.broadcast_state_dict(self.model.state_dict(), src_rank=0, group_name=GROUP)
        return [float(p.double().sum().item()) for p in self.model.parameters()]

    def close(self) -> None:
        col.destroy_collective_group(GROUP)


def main() -> int:
    """Run the trainer and the rollouts for ``STEPS`` steps; check every rollout's weights."""
    reason = skip_reason()
    if reason:
        print(f"skipped: {reason}")
        return 0
    world_size = min(torch.cuda.device_count(), 4)
    ray.init(
        address="local", num_cpus=2, num_gpus=world_size, namespace=GROUP, include_dashboard=False
    )
    ok = True
    try:
        actors = [Actor.remote() for _ in range(world_size)]
        ray.get([a.setup.remote(world_size, r) for r, a in enumerate(actors)], timeout=120)
        for step in range(STEPS):
            sums = ray.get([a.step.remote(step) for a in actors], timeout=120)
            same = all(s == sums[0] for s in sums[1:])
            ok = ok and same
            print(f"step {step}: every rollout's weights equal the trainer's: {same}")
        ray.get([a.close.remote() for a in actors], timeout=60)
    finally:
        ray.shutdown()
    print(f"every rollout holds the trainer's weights after each step: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
