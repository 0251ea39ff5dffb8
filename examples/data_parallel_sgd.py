"""Data-parallel SGD: four CPU actors train one small torch model, each on its own data.

Each actor holds a replica of the model and a shard of the data. Every step, each
computes its gradients, one allreduce averages them across the actors, and each
applies the same update, so the replicas stay identical. The program prints the loss
as it falls, checks that the replicas are identical, and checks that they match the
model trained on all the data in one process.

Usage: python examples/data_parallel_sgd.py
"""

from __future__ import annotations

import sys

import ray
import torch

import collective as col

WORLD_SIZE = 4
GROUP = "dp-sgd"
STEPS = 40
SHARD = 64  # samples per actor
FEATURES = 8


def make_model(seed: int) -> torch.nn.Module:
    """Return the model, its weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    ).double()


def make_shard(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return rank ``rank``'s inputs and targets: a noisy linear function of the inputs."""
    generator = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(SHARD, FEATURES, generator=generator, dtype=torch.float64)
    noise = 0.05 * torch.randn(SHARD, 1, generator=generator, dtype=torch.float64)
    return x, x @ torch.linspace(-1, 1, FEATURES, dtype=torch.float64).unsqueeze(1) + noise


def parameters_of(model: torch.nn.Module) -> list[float]:
    """Return every parameter of ``model`` as one flat list."""
    return torch.nn.utils.parameters_to_vector(model.parameters()).tolist()


@ray.remote(num_cpus=0)
class Trainer:
    """One replica: its own model and its own shard of the data."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        # Each replica starts from different random weights; rank 0's are broadcast below.
        self.model = make_model(seed=rank)
        self.x, self.y = make_shard(rank)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.2)

    def setup(self) -> None:
        col.init_collective_group(WORLD_SIZE, self.rank, backend="gloo", group_name=GROUP)
        # Start every replica from rank 0's weights: broadcast writes them in place
        # (into p.detach(), which shares p's memory: a tensor that requires grad is refused).
        with torch.no_grad():
            for p in self.model.parameters():
                col.broadcast(p.detach(), src_rank=0, group_name=GROUP)

    def train(self) -> list[float]:
        losses = []
        params = list(self.model.parameters())
        for _ in range(STEPS):
            self.optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
            loss.backward()
            # One allreduce per step: pack every gradient into one buffer, average it
            # across the replicas in place, and unpack it.
            grads = torch.cat([p.grad.reshape(-1) for p in params])
            col.allreduce(grads, group_name=GROUP, op=col.ReduceOp.AVG)
            for p, g in zip(params, grads.split([p.numel() for p in params]), strict=True):
                p.grad.copy_(g.view_as(p))
            self.optimizer.step()
            # The loss over all the data is the average of the shards' losses.
            total = loss.detach().clone()
            col.allreduce(total, group_name=GROUP, op=col.ReduceOp.AVG)
            losses.append(total.item())
        return losses

    def parameters(self) -> list[float]:
        return parameters_of(self.model)

    def teardown(self) -> None:
        col.destroy_collective_group(GROUP)


def train_in_one_process() -> list[float]:
    """Train the same model on all the shards at once, as one process would."""
    model = make_model(seed=0)
    shards = [make_shard(rank) for rank in range(WORLD_SIZE)]
    x, y = torch.cat([s[0] for s in shards]), torch.cat([s[1] for s in shards])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    for _ in range(STEPS):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return parameters_of(model)


def main() -> int:
    """Train on four actors, print the loss, and check the replicas; return the exit code."""
    ray.init(address="local", num_cpus=2, namespace="dp-sgd", include_dashboard=False)
    try:
        trainers = [Trainer.remote(rank) for rank in range(WORLD_SIZE)]
        ray.get([t.setup.remote() for t in trainers], timeout=120)
        losses = ray.get([t.train.remote() for t in trainers], timeout=300)
        replicas = ray.get([t.parameters.remote() for t in trainers], timeout=120)
        ray.get([t.teardown.remote() for t in trainers], timeout=60)
    finally:
        ray.shutdown()

    for step in range(0, STEPS, 5):
        print(f"step {step:2d}: loss {losses[0][step]:.4f}")
    print(f"step {STEPS - 1:2d}: loss {losses[0][-1]:.4f}")
    identical = all(r == replicas[0] for r in replicas)
    reference = torch.tensor(train_in_one_process())
    matches = torch.allclose(torch.tensor(replicas[0]), reference, rtol=1e-9, atol=1e-12)
    fell = losses[0][-1] < 0.5 * losses[0][0]
    print(f"replicas identical on all {WORLD_SIZE} actors: {identical}")
    print(f"replicas match the model trained on all the data in one process: {matches}")
    print(f"loss fell by more than half: {fell}")
    return 0 if identical and matches and fell else 1


if __name__ == "__main__":
    sys.exit(main())
