"""Elastic data-parallel SGD on Ray actors: a worker dies, the rest go on, a replacement joins.

Four workers train one small model, each on its own slice of every batch, and average
their gradients with ``allreduce_tensors`` at each step. The driver kills one worker
mid-run. The survivors catch the error, call ``shrink_group``, agree on the newest
weights, split each batch among three and keep training. The driver then starts a
replacement: the survivors call ``grow_group(world_size=4)`` while the replacement
calls ``init_collective_group(4, 3, ...)``, and rank 0 sends the current weights with
``broadcast_state_dict``. Training goes on with four workers. At the end the program
checks that every replica holds the same parameters, and exits with status 1 if not.

Usage: python examples/elastic_sgd.py
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import ray
import torch

import collective as col

GROUP = "sgd"
WORKERS = 4
BATCH = 96
"""Samples per step, split evenly among the workers, whether three or four."""
SAMPLES = 4800
STEPS = 600
KILL_AT = 150
"""The driver kills a worker once every worker has done this many steps."""
GROW_AT = 300
"""The survivors train to this step, then the group grows back to four."""
VICTIM = 2
LEARNING_RATE = 0.2
TIMEOUT = timedelta(seconds=60)
RAY_TIMEOUT_S = 300


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    """Return the dataset: the same on every worker."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 8, generator=generator)
    teacher = torch.randn(8, 1, generator=generator)
    return x, torch.sin(0.3 * x @ teacher) + 0.05 * torch.randn(SAMPLES, 1, generator=generator)


@ray.remote(num_cpus=0, max_concurrency=2)
class Worker:
    """One data-parallel replica; its second thread answers ``progress`` while it trains."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)  # every worker starts from other weights: rank 0's are sent
        self.model = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
        )
        self.x, self.y = make_data()
        self.step, self.rank, self.size = 0, -1, 0

    def join(self, world_size: int, rank: int) -> str:
        """Join the group as ``rank``, at the start or as a newcomer of a grow; take the weights."""
        col.init_collective_group(world_size, rank, "gloo", GROUP, timeout=TIMEOUT)
        self.rank, self.size = rank, world_size
        source = self._agree()
        return f"rank {rank} joined; took rank {source}'s weights at step {self.step}"

    def progress(self) -> int:
        """Return the steps done so far."""
        return self.step

    def train(self, until: int) -> list[tuple[int, str]]:
        """Train to step ``until``, shrinking the group if a worker dies; return what happened."""
        story = []
        while self.step < until:
            try:
                loss = self._step()
            except col.CollectiveError as error:
                story.append((self.step, self._shrink(error)))
                continue
            if self.rank == 0 and (self.step % 100 == 0 or self.step == 1):
                story.append((self.step, f"loss {loss:.4f} on {self.size} workers"))
        return story

    def _step(self) -> float:
        """Take one step on this worker's slice of the batch, with gradients averaged."""
        start = self.step * BATCH % SAMPLES
        mine = torch.arange(start, start + BATCH)[self.rank :: self.size]
        self.model.zero_grad()
        loss = torch.nn.functional.mse_loss(self.model(self.x[mine]), self.y[mine])
        loss.backward()
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        mean_loss = loss.detach().reshape(1)
        col.allreduce_tensors([*grads, mean_loss], GROUP, op=col.ReduceOp.AVG)
        with torch.no_grad():
            for p, g in zip(self.model.parameters(), grads, strict=True):
                p.sub_(LEARNING_RATE * g)
        self.step += 1
        return float(mean_loss)

    def _shrink(self, error: Exception) -> str:
        """Drop the dead workers from the group and agree on the newest weights."""
        old, started = self.rank, time.monotonic()
        self.rank = col.shrink_group(GROUP, timeout=TIMEOUT)
        self.size = col.get_collective_group_size(GROUP)
        took = time.monotonic() - started
        source = self._agree()
        return (
            f"rank {old}: {type(error).__name__} in step {self.step + 1}; shrunk to "
            f"{self.size} workers in {took:.2f} s, now rank {self.rank}; resumed from "
            f"rank {source}'s weights at step {self.step}"
        )

    def grow(self, world_size: int) -> str:
        """Let newcomers in, up to ``world_size`` workers, and send them the weights."""
        started = time.monotonic()
        col.grow_group(GROUP, world_size, timeout=TIMEOUT)
        self.size = world_size
        took = time.monotonic() - started
        source = self._agree()
        return (
            f"rank {self.rank}: grew to {world_size} workers in {took:.2f} s; "
            f"rank {source} sent the weights"
        )

    def _agree(self) -> int:
        """Take the weights and step of the rank furthest along (the lowest such); return it.

        A death can strike after some ranks finished a step and before the others
        did, so the ranks may be one step apart. A newcomer is at step 0.
        """
        steps = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        col.allgather(steps, torch.tensor([self.step]), GROUP)
        source = max(range(self.size), key=lambda r: int(steps[r]))
        col.broadcast_state_dict(self.model.state_dict(), src_rank=source, group_name=GROUP)
        self.step = int(steps[source])
        return source

    def parameters(self) -> list[torch.Tensor]:
        """Return a copy of this replica's parameters."""
        return [p.detach().clone() for p in self.model.parameters()]


def tell(stories: list[list[tuple[int, str]]]) -> None:
    """Print what the workers reported, once each, in step order."""
    entries = dict.fromkeys(entry for story in stories for entry in story)
    for step, line in sorted(entries, key=lambda entry: entry[0]):
        print(f"step {step:>3}: {line}")


def main() -> int:
    """Train, lose a worker, shrink, grow back, and check every replica; return the status."""
    ray.init(address="local", num_cpus=2, namespace="elastic-sgd", include_dashboard=False)
    try:
        workers = [Worker.remote(seed) for seed in range(WORKERS)]
        joins = [w.join.remote(WORKERS, r) for r, w in enumerate(workers)]
        joined = ray.get(joins, timeout=RAY_TIMEOUT_S)
        print(f"{WORKERS} workers in group {GROUP!r}: {joined[1]}")
        runs = [w.train.remote(GROW_AT) for w in workers]
        while min(ray.get([w.progress.remote() for w in workers], timeout=RAY_TIMEOUT_S)) < KILL_AT:
            time.sleep(0.01)
        ray.kill(workers[VICTIM])
        survivors = [w for r, w in enumerate(workers) if r != VICTIM]
        stories = ray.get([run for r, run in enumerate(runs) if r != VICTIM], timeout=RAY_TIMEOUT_S)
        tell([*stories, [(KILL_AT, f"driver: killed rank {VICTIM}")]])
        replacement = Worker.remote(WORKERS)
        ray.get(replacement.progress.remote(), timeout=RAY_TIMEOUT_S)
        print(f"driver: started a replacement; the {len(survivors)} survivors grow the group")
        grown = [w.grow.remote(WORKERS) for w in survivors]
        grown.append(replacement.join.remote(WORKERS, WORKERS - 1))
        for line in ray.get(grown, timeout=RAY_TIMEOUT_S):
            print(f"step {GROW_AT:>3}: {line}")
        workers = [*survivors, replacement]
        tell(ray.get([w.train.remote(STEPS) for w in workers], timeout=RAY_TIMEOUT_S))
        replicas = ray.get([w.parameters.remote() for w in workers], timeout=RAY_TIMEOUT_S)
    finally:
        ray.shutdown()
    same = all(
        all(torch.equal(a, b) for a, b in zip(replicas[0], other, strict=True))
        for other in replicas[1:]
    )
    verdict = "identical" if same else "DIFFERENT"
    print(f"after {STEPS} steps, the parameters of the {len(replicas)} replicas are {verdict}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
