"""Weight sync for RL: a trainer sends its model's weights to rollout actors after each step.

The group is declared from the driver, so the actors' code never names ranks. Three
variants: a blocking ``broadcast_state_dict`` into each rollout's model, an overlapped
one-step-off loop with ``broadcast_tensors(..., async_op=True)`` into a shadow copy,
and what a mismatch does (every rank raises the same ValueError; nothing is written).

Usage: python examples/weight_sync.py
"""

from __future__ import annotations

from datetime import timedelta

import ray
import torch

import collective as col

GROUP = "weights"
ROLLOUTS = 3


def make_model() -> torch.nn.Module:
    """Return the policy: the same architecture on the trainer and the rollouts."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(64, 16), torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)
    ).to(torch.bfloat16)


@ray.remote(num_cpus=0)
class Trainer:
    """Rank 0: trains, then sends its weights."""

    def __init__(self) -> None:
        self.model = make_model()

    def train_step(self) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(1)

    def sync(self) -> None:
        col.broadcast_state_dict(self.model.state_dict(), src_rank=0, group_name=GROUP)

    def train_and_sync_overlapped(self, steps: int) -> float:
        """Send step k's weights while step k + 1 trains (one-step-off)."""
        params = list(self.model.parameters())
        outgoing = [p.detach().clone() for p in params]
        work = None
        for _ in range(steps):
            if work is not None:
                work.wait()  # the previous send is done: outgoing may change
            with torch.no_grad():
                for out, p in zip(outgoing, params, strict=True):
                    out.copy_(p)
            work = col.broadcast_tensors(outgoing, src_rank=0, group_name=GROUP, async_op=True)
            self.train_step()  # overlaps the send
        if work is not None:
            work.wait()
        return float(outgoing[0].float().mean())

    def send_wrong(self) -> str:
        try:
            col.broadcast_state_dict(self.model.state_dict(), src_rank=0, group_name=GROUP)
        except ValueError as error:
            return str(error)
        return "no error"


@ray.remote(num_cpus=0)
class Rollout:
    """Ranks 1..n: generate with the latest weights they received."""

    def __init__(self) -> None:
        self.model = make_model()
        with torch.no_grad():
            for p in self.model.parameters():
                p.zero_()

    def receive(self) -> float:
        col.broadcast_state_dict(self.model.state_dict(), src_rank=0, group_name=GROUP)
        return self.first_weight()

    def first_weight(self) -> float:
        return float(next(self.model.parameters()).detach().float().mean())

    def receive_overlapped(self, steps: int) -> float:
        """Receive each step's weights into a shadow copy while generating, then swap them in."""
        params = list(self.model.parameters())
        shadow = [torch.empty_like(p) for p in params]
        for _ in range(steps):
            work = col.broadcast_tensors(shadow, src_rank=0, group_name=GROUP, async_op=True)
            self.first_weight()  # generate with the current weights meanwhile
            work.wait()
            with torch.no_grad():
                for p, s in zip(params, shadow, strict=True):
                    p.copy_(s)
        return self.first_weight()

    def receive_wrong(self) -> str:
        state = self.model.state_dict()
        state["extra.weight"] = torch.zeros(2)
        before = self.first_weight()
        try:
            col.broadcast_state_dict(state, src_rank=0, group_name=GROUP)
        except ValueError as error:
            assert self.first_weight() == before, "nothing is written on a mismatch"
            return str(error)
        return "no error"


def main() -> None:
    """Run the three variants on a private local Ray cluster and print what each rank saw."""
    ray.init(address="local", num_cpus=2, namespace="weight-sync", include_dashboard=False)
    try:
        trainer = Trainer.remote()
        rollouts = [Rollout.remote() for _ in range(ROLLOUTS)]
        actors = [trainer, *rollouts]
        col.declare_collective_group(
            actors,
            world_size=len(actors),
            ranks=list(range(len(actors))),
            backend="gloo",
            group_name=GROUP,
            timeout=timedelta(seconds=60),
        )
        ray.get(trainer.train_step.remote(), timeout=120)
        received = ray.get(
            [trainer.sync.remote()] + [r.receive.remote() for r in rollouts], timeout=120
        )
        print(f"blocking: rollouts hold {received[1:]}")
        steps = 3
        overlapped = ray.get(
            [trainer.train_and_sync_overlapped.remote(steps)]
            + [r.receive_overlapped.remote(steps) for r in rollouts],
            timeout=120,
        )
        print(f"overlapped: trainer sent {overlapped[0]}, rollouts hold {overlapped[1:]}")
        errors = ray.get(
            [trainer.send_wrong.remote()] + [r.receive_wrong.remote() for r in rollouts],
            timeout=120,
        )
        print(f"mismatch on every rank: {errors[0]}")
    finally:
        ray.shutdown()
    assert len(set(received[1:])) == 1 and received[1] != 0.0, received
    assert overlapped[1:] == [overlapped[0]] * ROLLOUTS, overlapped
    assert len(set(errors)) == 1 and "state_dict has key 'extra.weight'" in errors[0], errors


if __name__ == "__main__":
    main()
