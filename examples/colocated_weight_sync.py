"""Weight sync between a trainer and rollout actors that share one GPU.

Reinforcement-learning post-training often puts the trainer and the rollout engines on
the same GPU (Ray actors with ``num_gpus=0.25``). Here one trainer and three rollout
actors share GPU 0 in a ``backend="nccl"`` group: the group sees that every rank is on
one GPU and moves bytes through device memory they all map (CUDA IPC), with no NCCL
and no setting. Each step the trainer changes its 400 weight tensors (about 64 MiB)
and ``broadcast_state_dict`` copies them into every rollout's own tensors, in place;
each rollout then checks every tensor, and the program prints the time per sync.

Without a CUDA GPU, torch with CUDA, or cupy with NCCL it prints ``skipped: <reason>``
and exits with status 0.

GPU example: ``tests/gpu/run.sh`` runs it on a GPU machine.

Usage: python examples/colocated_weight_sync.py
"""

from __future__ import annotations

import sys
import time

import ray
import torch

import collective as col

GROUP = "colocated"
ROLLOUTS = 3
STEPS = 5
TENSORS = 400


def skip_reason() -> str:
    """Return why this machine cannot run the example, or an empty string if it can."""
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to torch"
    if not col.nccl_available():
        return "the NCCL backend is unavailable: it needs cupy with NCCL (pip install cupy-cuda12x)"
    return ""


def weights(step: int) -> dict[str, torch.Tensor]:
    """Return the trainer's weights after ``step``: 400 tensors of mixed shapes and dtypes."""
    out = {}
    for i in range(TENSORS):
        dtype = torch.bfloat16 if i % 3 == 0 else torch.float32
        rows = 16 + (i * 7) % 48
        out[f"layer{i}.weight"] = torch.full((rows, 1024), float(step + i % 11), dtype=dtype)
    return out


@ray.remote(num_gpus=0.25, num_cpus=0)
class Trainer:
    """Rank 0: holds the weights and sends them after each step."""

    def setup(self) -> str:
        col.init_collective_group(ROLLOUTS + 1, 0, backend="nccl", group_name=GROUP)
        return col.get_group_handle(GROUP).transport

    def sync(self, step: int) -> float:
        state = {k: v.cuda() for k, v in weights(step).items()}
        torch.cuda.synchronize()
        start = time.perf_counter()
        col.broadcast_state_dict(state, src_rank=0, group_name=GROUP)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def close(self) -> None:
        col.destroy_collective_group(GROUP)


@ray.remote(num_gpus=0.25, num_cpus=0)
class Rollout:
    """Ranks 1-3: receive the weights into their own tensors, then check them."""

    def setup(self, rank: int) -> str:
        col.init_collective_group(ROLLOUTS + 1, rank, backend="nccl", group_name=GROUP)
        self.state = {k: torch.zeros_like(v, device="cuda") for k, v in weights(0).items()}
        return col.get_group_handle(GROUP).transport

    def sync(self, step: int) -> bool:
        col.broadcast_state_dict(self.state, src_rank=0, group_name=GROUP)
        want = weights(step)
        return all(torch.equal(self.state[k].cpu(), v) for k, v in want.items())

    def close(self) -> None:
        col.destroy_collective_group(GROUP)


def main() -> int:
    """Sync the weights ``STEPS`` times; print each sync's time and whether the rollouts match."""
    reason = skip_reason()
    if reason:
        print(f"skipped: {reason}")
        return 0
    ray.init(address="local", num_cpus=2, num_gpus=1, namespace=GROUP, include_dashboard=False)
    try:
        trainer = Trainer.remote()
        rollouts = [Rollout.remote() for _ in range(ROLLOUTS)]
        setups = [trainer.setup.remote()] + [r.setup.remote(i + 1) for i, r in enumerate(rollouts)]
        transports = ray.get(setups, timeout=120)
        print(f"transport of each rank: {transports}")
        nbytes = sum(t.numel() * t.element_size() for t in weights(0).values())
        ok = True
        for step in range(STEPS):
            refs = [trainer.sync.remote(step)] + [r.sync.remote(step) for r in rollouts]
            seconds, *checks = ray.get(refs, timeout=120)
            ok = ok and all(checks)
            rate = nbytes * ROLLOUTS / seconds / 1e9
            print(
                f"step {step}: {nbytes / 2**20:.0f} MiB to {ROLLOUTS} rollouts in "
                f"{seconds * 1e3:.1f} ms (timed on the trainer: {rate:.1f} GB/s to all); "
                f"all match: {all(checks)}"
            )
        ray.get([a.close.remote() for a in [trainer, *rollouts]], timeout=60)
    finally:
        ray.shutdown()
    print(f"every rollout holds the trainer's weights after each step: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
