"""Weight sync through Ray Direct Transport: the trainer's state dict reaches each rollout directly.

The trainer's ``publish`` method is declared with
``@ray.method(tensor_transport="COLLECTIVE")``: the state dict it returns stays in
the trainer, and Ray moves it to each rollout whose task receives the reference,
through this library's shared memory (Gloo across nodes, NCCL on GPUs), never
through the object store. Only the driver changes: ``runtime_env()`` makes every
worker register the transport as it starts, and one call registers it here.

Usage: python examples/rdt_weight_sync.py
"""

from __future__ import annotations

import ray
import torch
from ray.experimental.collective import create_collective_group, destroy_collective_group

import collective as col
from collective.ray_plugins import runtime_env

ROLLOUTS = 3
STEPS = 3

col.register_tensor_transport()  # in the driver, before the classes that name it


def make_model() -> torch.nn.Module:
    """Return the policy: the same architecture on the trainer and the rollouts."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(64, 16), torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)
    ).to(torch.bfloat16)


@ray.remote(num_cpus=0)
class Trainer:
    """Trains, and publishes its weights as an object that stays here until a rollout takes it."""

    def __init__(self) -> None:
        self.model = make_model()
        self.steps = 0

    def train_step(self) -> None:
        self.steps += 1
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(1)

    @ray.method(tensor_transport="COLLECTIVE")
    def publish(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class Rollout:
    """Loads each published state dict into its own copy of the policy."""

    def __init__(self) -> None:
        self.model = make_model()

    def load(self, weights: dict[str, torch.Tensor]) -> int:
        self.model.load_state_dict(weights)
        return len(weights)

    def checksum(self) -> float:
        return float(sum(p.float().sum() for p in self.model.parameters()))


def main() -> None:
    """Train for a few steps; after each, every rollout loads the published weights."""
    ray.init(namespace="rdt-weight-sync", num_cpus=2, runtime_env=runtime_env())
    trainer = Trainer.remote()
    rollouts = [Rollout.remote() for _ in range(ROLLOUTS)]
    group = create_collective_group([trainer, *rollouts], backend="collective")
    reference = make_model()
    for step in range(1, STEPS + 1):
        ray.get(trainer.train_step.remote(), timeout=60)
        weights = trainer.publish.remote()  # stays in the trainer
        loaded = ray.get([r.load.remote(weights) for r in rollouts], timeout=120)
        with torch.no_grad():
            for p in reference.parameters():
                p.add_(1)
        want = float(sum(p.float().sum() for p in reference.parameters()))
        sums = ray.get([r.checksum.remote() for r in rollouts], timeout=60)
        print(f"step {step}: {loaded[0]} tensors on {len(sums)} rollouts, checksums {sums}")
        assert sums == [want] * ROLLOUTS, (sums, want)
    print(f"every rollout holds the trainer's weights after each step: {True}")
    destroy_collective_group(group)
    ray.shutdown()


if __name__ == "__main__":
    main()
