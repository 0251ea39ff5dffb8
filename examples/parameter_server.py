"""A parameter server: one server actor feeds three workers and applies their gradients.

The server (rank 0 of a four-rank Gloo group) holds the model's parameters and the
data set. Every step it scatters a different minibatch to each worker, broadcasts the
parameters, gathers each worker's gradient, averages them and updates the
parameters. The workers hold nothing between steps. The program prints the loss as it
falls and checks the result against the same SGD run in one process.

Usage: python examples/parameter_server.py
"""

from __future__ import annotations

import sys

import numpy as np
import ray

import collective as col

WORLD_SIZE = 4  # rank 0 is the server, ranks 1-3 are the workers
SERVER = 0
GROUP = "param-server"
STEPS = 60
BATCH = 16  # samples per worker per step
FEATURES = 5
LEARNING_RATE = 0.1


def make_data() -> tuple[np.ndarray, np.ndarray]:
    """Return the data set: 1024 samples of a noisy linear function, one row per sample."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1024, FEATURES))
    y = x @ np.arange(1.0, FEATURES + 1) + 0.01 * rng.standard_normal(1024)
    return x, y


def minibatches(x: np.ndarray, y: np.ndarray, step: int) -> list[np.ndarray]:
    """Return one minibatch per rank for ``step``, each row its features then its target.

    The server's own entry is unused but must have the same shape as the others.
    """
    rng = np.random.default_rng(step)
    batches = [np.zeros((BATCH, FEATURES + 1))]
    for _ in range(1, WORLD_SIZE):
        rows = rng.choice(len(x), BATCH, replace=False)
        batches.append(np.column_stack([x[rows], y[rows]]))
    return batches


def gradient(w: np.ndarray, batch: np.ndarray) -> np.ndarray:
    """Return the gradient of the mean squared error of ``w`` on ``batch``."""
    x, y = batch[:, :FEATURES], batch[:, FEATURES]
    return 2.0 * x.T @ (x @ w - y) / len(y)


def update(w: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
    """Return ``w`` after one SGD step on the workers' average gradient."""
    return w - LEARNING_RATE * np.mean(grads, axis=0)


@ray.remote(num_cpus=0)
class Member:
    """The server or a worker, depending on its rank."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def run(self) -> dict[str, list[float]]:
        col.init_collective_group(WORLD_SIZE, self.rank, backend="gloo", group_name=GROUP)
        server = self.rank == SERVER
        data = make_data() if server else None  # only the server holds the data set
        w = np.zeros(FEATURES)  # the server's are the real ones; workers receive them
        batch = np.zeros((BATCH, FEATURES + 1))
        grads = [np.zeros(FEATURES) for _ in range(WORLD_SIZE)] if server else None
        losses = []
        for step in range(STEPS):
            # The server sends each rank its own minibatch; every rank receives into `batch`.
            col.scatter(batch, minibatches(*data, step) if data else None, SERVER, group_name=GROUP)
            # Every worker computes with the server's current parameters.
            col.broadcast(w, src_rank=SERVER, group_name=GROUP)
            mine = np.zeros(FEATURES) if server else gradient(w, batch)
            # The server collects one gradient per rank into `grads`, in rank order.
            col.gather(mine, grads, dst_rank=SERVER, group_name=GROUP)
            if data and grads:
                w[:] = update(w, grads[1:])  # skip the server's own, empty entry
                x, y = data
                losses.append(float(np.mean((x @ w - y) ** 2)))
        col.destroy_collective_group(GROUP)
        return {"weights": w.tolist(), "losses": losses}


def train_in_one_process() -> np.ndarray:
    """Run the same SGD steps in this process, without actors."""
    x, y = make_data()
    w = np.zeros(FEATURES)
    for step in range(STEPS):
        w = update(w, [gradient(w, b) for b in minibatches(x, y, step)[1:]])
    return w


def main() -> int:
    """Run the server and the workers, print the loss, and check the result."""
    ray.init(address="local", num_cpus=2, namespace="param-server", include_dashboard=False)
    try:
        members = [Member.remote(rank) for rank in range(WORLD_SIZE)]
        results = ray.get([m.run.remote() for m in members], timeout=300)
    finally:
        ray.shutdown()

    w, losses = np.array(results[SERVER]["weights"]), results[SERVER]["losses"]
    for step in range(0, STEPS, 10):
        print(f"step {step:2d}: loss {losses[step]:.5f}")
    print(f"step {STEPS - 1:2d}: loss {losses[-1]:.5f}")
    print(f"learned weights: {np.round(w, 3).tolist()} (the data follow [1, 2, 3, 4, 5])")
    same = np.allclose(w, train_in_one_process(), rtol=1e-12, atol=0)
    print(f"same weights as the SGD run in one process: {same}")
    learned = np.allclose(w, np.arange(1.0, FEATURES + 1), atol=0.05)
    print(f"weights within 0.05 of the truth: {learned}")
    return 0 if same and learned else 1


if __name__ == "__main__":
    sys.exit(main())
