"""Sync a trainer's weights to three rollout actors after each training step, in one call.

Usage: python examples/sync_weights.py
"""

import ray
import torch

import collective as col


def policy() -> torch.nn.Module:
    """Return the policy network; each call draws new random weights."""
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))


@ray.remote(num_cpus=0)
class Trainer:
    """Rank 0: trains, then sends its weights."""

    def __init__(self) -> None:
        self.model = policy()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def train_and_sync(self) -> dict[str, torch.Tensor]:
        loss = self.model(torch.randn(32, 64)).square().mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        col.broadcast_state_dict(self.model.state_dict(), src_rank=0, group_name="weights")
        return self.model.state_dict()


@ray.remote(num_cpus=0)
class Rollout:
    """Ranks 1 to 3: receive the weights into their own model, in place."""

    def __init__(self) -> None:
        self.model = policy()  # other random weights, overwritten at each sync

    def receive(self) -> dict[str, torch.Tensor]:
        col.broadcast_state_dict(self.model.state_dict(), src_rank=0, group_name="weights")
        return self.model.state_dict()  # a rollout would generate with it now


if __name__ == "__main__":
    ray.init(namespace="sync_weights")
    trainer, rollouts = Trainer.remote(), [Rollout.remote() for _ in range(3)]
    col.declare_collective_group(
        [trainer, *rollouts], world_size=4, ranks=[0, 1, 2, 3], backend="gloo", group_name="weights"
    )
    same = True
    for _ in range(3):
        sent, *got = ray.get(
            [trainer.train_and_sync.remote()] + [r.receive.remote() for r in rollouts], timeout=120
        )
        same &= all(torch.equal(sent[name], weights[name]) for weights in got for name in sent)
    print(f"every rollout holds the trainer's weights after each step: {same}")
    ray.shutdown()
    raise SystemExit(0 if same else 1)
