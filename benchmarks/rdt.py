"""Benchmark Ray Direct Transport: ours against Ray's Gloo transport and the object store.

Usage: python -m benchmarks.rdt [--quick] [--rounds N] [--impls collective,gloo,object_store]
       [--gloo-timeout SECONDS] [--json PATH]

One node, four actors: a trainer keeps the tensors of a workload, and each round its
method returns them to three rollout actors, which check them. A row's time runs
from the method call to the moment every rollout holds the tensors. Rows:
``collective`` (``tensor_transport="COLLECTIVE"`` over a group of backend
``collective``), ``gloo`` (Ray's ``tensor_transport="GLOO"`` over a ``torch_gloo``
group) and ``object_store`` (the same method without a tensor transport). Workloads:
one 256 MiB float32 tensor, and a state dict of 2,000 float32 tensors of 32 KiB.
The first round of each row also checks every element on every rollout.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from typing import Any

import ray
import torch

import collective as col
from collective.ray_plugins.hook import runtime_env

IMPLS = ("collective", "gloo", "object_store")
WORKLOADS = {"256 MiB x 1": (1, 256 << 20), "32 KiB x 2000": (2000, 32 << 10)}
QUICK = {"1 MiB x 1": (1, 1 << 20), "4 KiB x 50": (50, 4 << 10)}
GOALS = [
    ("256 MiB x 1", "gloo", 5.0, "256 MiB: >= 5x Ray's Gloo transport"),
    ("256 MiB x 1", "object_store", 1.5, "256 MiB: >= 1.5x the object store"),
    ("32 KiB x 2000", "object_store", 3.0, "2,000 x 32 KiB: >= 3x the object store"),
]
"""(workload, baseline row, least speedup of ``collective``, claim)."""
ROLLOUTS = 3

col.register_tensor_transport()

actor_class: Any = ray.remote
"""Ray's decorator; its stubs know neither ``enable_tensor_transport`` nor actor methods."""


def tensors(count: int, each: int) -> dict[str, torch.Tensor]:
    """Return the workload: ``count`` float32 tensors of ``each`` bytes; tensor i holds i % 251."""
    return {f"t{i}": torch.full((each // 4,), float(i % 251)) for i in range(count)}


class _Trainer:
    """Keeps one workload and returns it through each kind of transfer."""

    def keep(self, count: int, each: int) -> None:
        self.tensors = tensors(count, each)

    @ray.method(tensor_transport="COLLECTIVE")
    def collective(self) -> dict[str, torch.Tensor]:
        return self.tensors

    @ray.method(tensor_transport="GLOO")
    def gloo(self) -> dict[str, torch.Tensor]:
        return self.tensors

    def object_store(self) -> dict[str, torch.Tensor]:
        return self.tensors


Trainer: Any = actor_class(num_cpus=0, enable_tensor_transport=True)(_Trainer)


class _Rollout:
    """Takes a workload and checks it: each tensor's ends each round, every element once."""

    def take(self, got: dict[str, torch.Tensor], full: bool) -> int:
        wrong = 0
        for i in range(len(got)):
            t, want = got[f"t{i}"], float(i % 251)
            if full:
                wrong += int((t != want).sum())
            else:
                wrong += int(t[0] != want) + int(t[-1] != want)
        return wrong


Rollout: Any = actor_class(num_cpus=0, enable_tensor_transport=True)(_Rollout)


def run_impl(
    impl: str, workloads: dict[str, tuple[int, int]], rounds: int, gloo_timeout: float
) -> list[dict[str, Any]]:
    """Time ``rounds`` transfers of each workload through ``impl``; return a row per workload."""
    from ray.experimental.collective import create_collective_group, destroy_collective_group

    trainer, rollouts = Trainer.remote(), [Rollout.remote() for _ in range(ROLLOUTS)]
    actors = [trainer, *rollouts]
    handle = None
    if impl != "object_store":
        backend = "collective" if impl == "collective" else "torch_gloo"
        handle = create_collective_group(actors, backend=backend)
    method = getattr(trainer, impl)
    limit = gloo_timeout if impl == "gloo" else 300.0
    rows, status = [], "ok"
    try:
        for name, (count, each) in workloads.items():
            ray.get(trainer.keep.remote(count, each), timeout=300)
            times, wrong = [], 0
            for r in range(rounds + 1):  # round 0 warms up and checks every element
                if status != "ok":
                    break
                start = time.perf_counter()
                ref = method.remote()
                try:
                    done = ray.get([x.take.remote(ref, r == 0) for x in rollouts], timeout=limit)
                except ray.exceptions.GetTimeoutError:
                    status = f"timed out after {limit:g} s"
                    break
                elapsed = time.perf_counter() - start
                wrong += sum(done)
                if r:
                    times.append(elapsed)
                del ref
            row: dict[str, Any] = {"workload": name, "impl": impl, "count": count, "each": each}
            row.update(status=status, wrong=wrong)
            if times:
                ms = sorted(t * 1e3 for t in times)
                row["time_ms"] = {"min": ms[0], "median": statistics.median(ms), "max": ms[-1]}
            rows.append(row)
    finally:
        if handle is not None and status == "ok":
            destroy_collective_group(handle)
        for actor in actors:
            ray.kill(actor)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print its table and goals, and return the results."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.rdt", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny workloads, 1 round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--gloo-timeout", type=float, default=60.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    impls = args.impls.split(",")
    if unknown := set(impls) - set(IMPLS):
        parser.error(f"unknown impls: {sorted(unknown)}")
    if args.rounds < 1:
        parser.error(f"rounds must be at least 1, got {args.rounds}")
    workloads, rounds = (QUICK, 1) if args.quick else (WORKLOADS, args.rounds)
    ray.init(
        address="local",
        num_cpus=2,
        namespace="benchmarks-rdt",
        include_dashboard=False,
        log_to_driver=False,
        runtime_env=runtime_env(),
    )
    results = []
    try:
        for impl in impls:
            results += run_impl(impl, workloads, rounds, args.gloo_timeout)
    finally:
        ray.shutdown()
    for name in workloads:
        print(f"# {name}: 1 trainer -> {ROLLOUTS} rollouts, one node, {rounds} rounds")
        print(f"{'impl':<14}{'min ms':>10}{'median ms':>11}{'max ms':>10}  wrong  status")
        for row in (r for r in results if r["workload"] == name):
            t = row.get("time_ms", {})
            cells = "".join(
                f"{t[k]:>{w}.1f}" if t else f"{'-':>{w}}"
                for k, w in (("min", 10), ("median", 11), ("max", 10))
            )
            print(f"{row['impl']:<14}{cells}  {row['wrong']:>5}  {row['status']}")
    goals = verdicts(results)
    print("# goals (median of ours against the baseline's median)")
    for g in goals:
        print(f"{g['claim']}: {g['measured']} -> {g['verdict']}")
    data = {
        "meta": {"command": " ".join(sys.argv), "machine": platform.platform(), "rounds": rounds},
        "results": results,
        "goals": goals,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    return data


def verdicts(results: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Return each goal's measured speedup and verdict ("not measured" without both rows)."""
    medians = {
        (r["workload"], r["impl"]): r["time_ms"]["median"] for r in results if "time_ms" in r
    }
    out = []
    for workload, base, least, claim in GOALS:
        ours, theirs = medians.get((workload, "collective")), medians.get((workload, base))
        if ours is None or theirs is None:
            out.append({"claim": claim, "measured": "-", "verdict": "not measured"})
            continue
        speedup = theirs / ours
        verdict = "pass" if speedup >= least else "fail"
        out.append({"claim": claim, "measured": f"{speedup:.2f}x", "verdict": verdict})
    return out


if __name__ == "__main__":
    main()
