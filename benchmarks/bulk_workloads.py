"""The many-tensor workloads: what each rank holds, what it must hold after, and how to time it.

- ``uniform``: ``count`` float32 tensors of equal size, broadcast from rank 0.
- ``transformer``: a transformer-like state dict (embedding, per layer four attention
  and three MLP matrices in bfloat16 and two float32 norm weights, a final norm),
  scaled to a total size, broadcast from rank 0: a trainer's weights sent to rollout
  actors.
- ``gradients``: the same shapes in float32, allreduced (summed) on every rank.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

SOURCE = 0
"""The rank that sends the weights."""

PER_LAYER = 9
"""Tensors per transformer layer: q, k, v, o, up, gate, down, two norms."""


@dataclass(frozen=True)
class Workload:
    """Named tensors (name, shape, dtype) that one op moves: "broadcast" or "allreduce"."""

    kind: str
    op: str
    tensors: tuple[tuple[str, tuple[int, ...], str], ...]

    @property
    def nbytes(self) -> int:
        """Return the bytes of one rank's tensors."""
        return sum(math.prod(s) * _itemsize(d) for _, s, d in self.tensors)

    @property
    def label(self) -> str:
        """Return a short description: kind, count and size."""
        return f"{self.kind}: {len(self.tensors)} tensors, {human(self.nbytes)}"


def _itemsize(dtype: str) -> int:
    return int(torch.empty(0, dtype=getattr(torch, dtype)).element_size())


def human(size: float) -> str:
    """Return ``size`` bytes as text: ``32 KiB``, ``1 GiB``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.4g} {unit}"
    return f"{size:g} B"


def uniform(count: int, each: int) -> Workload:
    """Return ``count`` float32 tensors of ``each`` bytes (rounded to whole elements)."""
    elements = max(1, each // 4)
    return Workload(
        "uniform", "broadcast", tuple((f"t{i:05d}", (elements,), "float32") for i in range(count))
    )


def transformer(total: int, count: int = 400, kind: str = "transformer") -> Workload:
    """Return a transformer-like state dict of about ``total`` bytes in about ``count`` tensors.

    The hidden size is picked so that the matrices (bfloat16) come to about the total;
    the norm weights are float32.
    """
    layers = max(1, (count - 2) // PER_LAYER)
    vocab_rows = 4 * layers
    matrix = "float32" if kind == "gradients" else "bfloat16"
    # the matrices hold (16 * layers + vocab_rows) * hidden^2 elements
    elements = total / _itemsize(matrix) / (16 * layers + vocab_rows)
    hidden = max(8, int(math.sqrt(elements)) // 8 * 8)
    tensors: list[tuple[str, tuple[int, ...], str]] = [
        ("embed.weight", (vocab_rows * hidden, hidden), matrix)
    ]
    for i in range(layers):
        p = f"layers.{i}."
        tensors += [(p + n, (hidden, hidden), matrix) for n in ("q", "k", "v", "o")]
        tensors += [(p + "mlp.up", (4 * hidden, hidden), matrix)]
        tensors += [(p + "mlp.gate", (4 * hidden, hidden), matrix)]
        tensors += [(p + "mlp.down", (hidden, 4 * hidden), matrix)]
        tensors += [(p + n, (hidden,), "float32") for n in ("norm1", "norm2")]
    tensors.append(("norm.weight", (hidden,), "float32"))
    op = "allreduce" if kind == "gradients" else "broadcast"
    return Workload(kind, op, tuple(tensors))


def build(kind: str, total: int, count: int) -> Workload:
    """Return the workload ``kind`` of about ``total`` bytes in ``count`` tensors."""
    if kind == "uniform":
        return uniform(count, total // count)
    return transformer(total, count, kind)


def value(i: int, rank: int, op: str) -> float:
    """Return tensor ``i``'s fill value on ``rank`` (receivers of a broadcast hold 0)."""
    if op == "allreduce":
        return float(rank + 1)
    return float(i % 7 + 1) if rank == SOURCE else 0.0


def tensors(work: Workload, rank: int) -> dict[str, torch.Tensor]:
    """Return this rank's fresh tensors of ``work``, by name, in order."""
    return {
        name: torch.full(shape, value(i, rank, work.op), dtype=getattr(torch, dtype))
        for i, (name, shape, dtype) in enumerate(work.tensors)
    }


def wrong(work: Workload, held: dict[str, torch.Tensor], world_size: int) -> int:
    """Return how many tensors of ``held`` differ from what the op must leave on every rank."""
    total = world_size * (world_size + 1) / 2
    bad = 0
    for i, (name, _, _) in enumerate(work.tensors):
        want = total if work.op == "allreduce" else value(i, SOURCE, work.op)
        bad += not bool((held[name] == want).all())
    return bad


def timed(run: Callable[[], Any], meet: Callable[[], Any], iters: int, warmup: int) -> list[float]:
    """Return the seconds of each of ``iters`` runs after ``warmup``; the ranks meet before each."""
    for _ in range(warmup):
        meet()
        run()
    times = []
    for _ in range(iters):
        meet()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return times
