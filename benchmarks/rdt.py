"""Benchmark Ray Direct Transport: ours, one-sided and two-sided, against Ray's Gloo and the store.

Usage: python -m benchmarks.rdt [--quick] [--rounds N] [--runs N] [--consumers 1,3] [--full]
       [--impls collective_shm,collective,gloo,object_store] [--gloo-timeout SECONDS]
       [--devices cpu,cuda] [--json PATH] [--address ADDRESS]

One node: a trainer keeps the tensors of a workload, and each round its method
returns them to 1 or 3 rollout actors, which check them. A row's time runs from the
method call to the moment every rollout holds the tensors. Rows: ``collective_shm``
(``tensor_transport="COLLECTIVE_SHM"``, one-sided: every rollout maps the shared
memory the trainer wrote once, with no group), ``collective``
(``tensor_transport="COLLECTIVE"``, two-sided, over a group of backend
``collective``), ``gloo`` (Ray's ``tensor_transport="GLOO"`` over a ``torch_gloo``
group) and ``object_store`` (the same method without a tensor transport).
Workloads: one 256 MiB float32 tensor, a state dict of 2,000 float32 tensors of
32 KiB, and a small one of 16 tensors of 4 KiB. The first round of each row also
checks every element on every rollout; with ``--full`` every later round reads every
element once (one ``aminmax`` per tensor), so each row's time includes reading every
byte.
The rows without a group share one set of actors; each two-sided row has its own.
``--runs`` repeats the whole set in one Ray instance; each run is judged alone.

CUDA rows (``--devices`` has ``cuda``, the default; only where the Ray cluster has a GPU
and cupy imports, else the output says why): the trainer and the rollouts each take a
quarter of one GPU, and the tensors are CUDA tensors. Rows: ``collective_shm`` (the
same transport: one device buffer that every rollout reads through CUDA IPC),
``cuda_ipc`` (Ray's ``tensor_transport="CUDA_IPC"``) and ``object_store``. Workloads:
one 1 GiB float32 tensor and 2,000 of 32 KiB. They are reported apart, under
``"cuda"`` in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import ray
import torch

import collective as col
from benchmarks.__main__ import ADDRESS_HELP, init_ray
from collective.ray_plugins.hook import runtime_env

IMPLS = ("collective_shm", "collective", "gloo", "object_store")
WORKLOADS = {
    "256 MiB x 1": (1, 256 << 20),
    "32 KiB x 2000": (2000, 32 << 10),
    "4 KiB x 16": (16, 4 << 10),
}
QUICK = {"1 MiB x 1": (1, 1 << 20), "4 KiB x 50": (50, 4 << 10)}
CUDA_IMPLS = ("collective_shm", "cuda_ipc", "object_store")
CUDA_WORKLOADS = {"1 GiB x 1": (1, 1 << 30), "32 KiB x 2000": (2000, 32 << 10)}
GOALS = [
    ("32 KiB x 2000", "object_store", 3.0, "2,000 x 32 KiB: >= 3x the object store"),
    ("32 KiB x 2000", "gloo", 2.0, "2,000 x 32 KiB: >= 2x Ray's Gloo transport"),
    ("256 MiB x 1", "object_store", 2.0, "256 MiB: >= 2x the object store"),
    ("256 MiB x 1", "gloo", 2.0, "256 MiB: >= 2x Ray's Gloo transport"),
]
"""(workload, baseline row, least speedup of ``collective_shm``, claim), all at 3 consumers."""
GOAL_IMPL, GOAL_CONSUMERS = "collective_shm", 3

col.register_tensor_transport()
col.register_shm_transport()

actor_class: Any = ray.remote
"""Ray's decorator; its stubs know neither ``enable_tensor_transport`` nor actor methods."""


def tensors(count: int, each: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Return the workload: ``count`` float32 tensors of ``each`` bytes; tensor i holds i % 251."""
    return {f"t{i}": torch.full((each // 4,), float(i % 251), device=device) for i in range(count)}


class _Trainer:
    """Keeps one workload and returns it through each kind of transfer."""

    def keep(self, count: int, each: int, device: str = "cpu") -> None:
        self.tensors = tensors(count, each, device)

    @ray.method(tensor_transport="COLLECTIVE_SHM")
    def collective_shm(self) -> dict[str, torch.Tensor]:
        return self.tensors

    @ray.method(tensor_transport="COLLECTIVE")
    def collective(self) -> dict[str, torch.Tensor]:
        return self.tensors

    @ray.method(tensor_transport="GLOO")
    def gloo(self) -> dict[str, torch.Tensor]:
        return self.tensors

    @ray.method(tensor_transport="CUDA_IPC")
    def cuda_ipc(self) -> dict[str, torch.Tensor]:
        return self.tensors

    def object_store(self) -> dict[str, torch.Tensor]:
        return self.tensors


Trainer: Any = actor_class(num_cpus=0, enable_tensor_transport=True)(_Trainer)


class _Rollout:
    """Takes a workload and checks it: every element, every tensor's range, or each one's ends."""

    def take(self, got: dict[str, torch.Tensor], how: str) -> int:
        wrong = 0
        for i in range(len(got)):
            t, want = got[f"t{i}"], float(i % 251)
            if how == "every":
                wrong += int((t != want).sum())
            elif how == "read":  # one pass over every byte, no allocation
                low, high = torch.aminmax(t)
                wrong += int(low != want) + int(high != want)
            else:
                wrong += int(t[0] != want) + int(t[-1] != want)
        return wrong


Rollout: Any = actor_class(num_cpus=0, enable_tensor_transport=True)(_Rollout)


GROUPS = {"collective": "collective", "gloo": "torch_gloo"}
"""The backend of the collective group that each two-sided row's actors share."""


def run_impls(
    impls: list[str],
    workloads: dict[str, tuple[int, int]],
    consumers: list[int],
    rounds: int,
    gloo_timeout: float,
    full: bool = False,
    device: str = "cpu",
) -> list[dict[str, Any]]:
    """Time ``rounds`` transfers of each workload through each of ``impls``, on one set of actors.

    A two-sided row has its actors to itself, with their group; the rows without a
    group share theirs. On ``device="cuda"`` every actor takes an equal share of one GPU.
    """
    from ray.experimental.collective import create_collective_group, destroy_collective_group

    share = {"num_gpus": 1 / (1 + max(consumers))} if device == "cuda" else {}
    trainer = Trainer.options(**share).remote()
    rollouts = [Rollout.options(**share).remote() for _ in range(max(consumers))]
    actors = [trainer, *rollouts]
    handle = None
    if impls[0] in GROUPS:
        handle = create_collective_group(actors, backend=GROUPS[impls[0]])
    limit = gloo_timeout if impls[0] == "gloo" else 300.0
    rows, status = [], "ok"
    try:
        for name, (count, each) in workloads.items():
            ray.get(trainer.keep.remote(count, each, device), timeout=300)
            for impl, n in ((impl, n) for impl in impls for n in consumers):
                method = getattr(trainer, impl)
                times, wrong = [], 0
                for r in range(rounds + 1):  # round 0 warms up and checks every element
                    if status != "ok":
                        break
                    start = time.perf_counter()
                    ref = method.remote()
                    how = "every" if r == 0 else "read" if full else "ends"
                    takes = [x.take.remote(ref, how) for x in rollouts[:n]]
                    try:
                        done = ray.get(takes, timeout=limit)
                    except ray.exceptions.GetTimeoutError:
                        status = f"timed out after {limit:g} s"
                        break
                    elapsed = time.perf_counter() - start
                    wrong += sum(done)
                    if r:
                        times.append(elapsed)
                    del ref
                row: dict[str, Any] = {"workload": name, "impl": impl, "consumers": n}
                row.update({"device": device} if device != "cpu" else {})
                row.update(count=count, each=each, status=status, wrong=wrong)
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


def run_cuda(
    impls: list[str],
    workloads: dict[str, tuple[int, int]],
    consumers: list[int],
    rounds: int,
    runs: int,
    full: bool,
) -> dict[str, Any]:
    """Run the CUDA rows ``runs`` times; return ``{"results": rows}``, or ``{"skipped": why}``."""
    why = cuda_unavailable()
    if why:
        return {"skipped": why}
    results: list[dict[str, Any]] = []
    for run in range(runs):
        rows = run_impls(impls, workloads, consumers, rounds, 300.0, full, "cuda")
        results += [{"run": run, **row} for row in rows]
    return {"results": results}


def cuda_unavailable() -> str:
    """Return why the CUDA rows cannot run here (no GPU in the Ray cluster, no cupy), or ""."""
    if ray.cluster_resources().get("GPU", 0) < 1:
        return "the Ray cluster has no GPU"
    try:
        import cupy  # noqa: F401 (the one-sided transport's CUDA path needs it)
    except ImportError as exc:
        return f"cupy is not importable ({exc})"
    return ""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print its tables and goals, and return the results."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.rdt", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny workloads, 1 round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--consumers", default="1,3")
    parser.add_argument("--full", action="store_true", help="read every element every round")
    parser.add_argument("--impls", default=",".join(dict.fromkeys(IMPLS + CUDA_IMPLS)))
    parser.add_argument("--gloo-timeout", type=float, default=60.0)
    parser.add_argument("--devices", default="cpu,cuda", help="the rows to run: cpu, cuda")
    parser.add_argument("--json", default=None)
    parser.add_argument("--address", default=None, help=ADDRESS_HELP)
    args = parser.parse_args(argv)
    impls = args.impls.split(",")
    if unknown := set(impls) - set(IMPLS) - set(CUDA_IMPLS):
        parser.error(f"unknown impls: {sorted(unknown)}")
    devices = args.devices.split(",")
    if not devices or set(devices) - {"cpu", "cuda"}:
        parser.error(f"devices are cpu and cuda, got {args.devices!r}")
    cpu_impls = [i for i in impls if i in IMPLS] if "cpu" in devices else []
    cuda_impls = [i for i in impls if i in CUDA_IMPLS] if "cuda" in devices else []
    if args.rounds < 1 or args.runs < 1:
        parser.error(f"rounds and runs must be at least 1, got {args.rounds} and {args.runs}")
    consumers = sorted({int(n) for n in args.consumers.split(",")})
    if consumers[0] < 1:
        parser.error(f"consumers must be at least 1, got {consumers[0]}")
    workloads, rounds = (QUICK, 1) if args.quick else (WORKLOADS, args.rounds)
    cuda_workloads = QUICK if args.quick else CUDA_WORKLOADS
    init_ray(
        args.address, namespace="benchmarks-rdt", log_to_driver=False, runtime_env=runtime_env()
    )
    results: list[dict[str, Any]] = []
    cuda: dict[str, Any] = {}
    try:
        shared = [i for i in cpu_impls if i not in GROUPS]
        sets = ([shared] if shared else []) + [[i] for i in cpu_impls if i in GROUPS]
        for run in range(args.runs):
            for impls_set in sets:
                rows = run_impls(
                    impls_set, workloads, consumers, rounds, args.gloo_timeout, args.full
                )
                results += [{"run": run, **row} for row in rows]
        if cuda_impls:
            cuda = run_cuda(cuda_impls, cuda_workloads, consumers, rounds, args.runs, args.full)
    finally:
        ray.shutdown()
    print_tables(results, workloads, consumers, rounds)
    if "skipped" in cuda:
        print(f"# CUDA rows: not run: {cuda['skipped']}")
    elif cuda:
        print_tables(cuda["results"], cuda_workloads, consumers, rounds, "one GPU")
    goals = [g for run in range(args.runs) for g in verdicts(results, run)]
    print("# goals (3 consumers; median of collective_shm against the baseline's, per run)")
    for g in goals:
        print(f"run {g['run']}: {g['claim']}: {g['measured']} -> {g['verdict']}")
    data = {
        "meta": {
            "command": " ".join(["python -m benchmarks.rdt", *sys.argv[1:]]),
            "machine": platform.platform(),
            "cpus": os.cpu_count(),
            "ray": ray.__version__,
            "load_at_end": [round(x, 2) for x in os.getloadavg()],
            "rounds": rounds,
            "runs": args.runs,
            "full": args.full,
        },
        "results": results,
        "goals": goals,
        "cuda": cuda,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    return data


def print_tables(
    results: list[dict[str, Any]],
    workloads: dict[str, tuple[int, int]],
    consumers: list[int],
    rounds: int,
    where: str = "one node",
) -> None:
    """Print a table per workload and number of consumers: each run's median per row."""
    for name in workloads:
        for n in consumers:
            rows = [r for r in results if r["workload"] == name and r["consumers"] == n]
            print(f"# {name}: 1 trainer -> {n} rollouts, {where}, {rounds} rounds per run")
            print(f"{'impl':<16}{'medians ms (per run)':>28}  wrong  status")
            for impl in dict.fromkeys(r["impl"] for r in rows):
                mine = [r for r in rows if r["impl"] == impl]
                cells = ", ".join(
                    f"{r['time_ms']['median']:.1f}" if "time_ms" in r else "-" for r in mine
                )
                wrong = sum(r["wrong"] for r in mine)
                status = ",".join(sorted({r["status"] for r in mine}))
                print(f"{impl:<16}{cells:>28}  {wrong:>5}  {status}")


def verdicts(results: list[dict[str, Any]], run: int = 0) -> list[dict[str, Any]]:
    """Return each goal's measured speedup and verdict in ``run`` ("not measured" without rows)."""
    medians = {
        (r["workload"], r["impl"]): r["time_ms"]["median"]
        for r in results
        if "time_ms" in r and r.get("run", 0) == run and r["consumers"] == GOAL_CONSUMERS
    }
    out = []
    for workload, base, least, claim in GOALS:
        ours, theirs = medians.get((workload, GOAL_IMPL)), medians.get((workload, base))
        row: dict[str, Any] = {"run": run, "claim": claim}
        if ours is None or theirs is None:
            out.append({**row, "measured": "-", "verdict": "not measured"})
            continue
        speedup = theirs / ours
        verdict = "pass" if speedup >= least else "fail"
        out.append({**row, "measured": f"{speedup:.2f}x", "verdict": verdict})
    return out


if __name__ == "__main__":
    main()
