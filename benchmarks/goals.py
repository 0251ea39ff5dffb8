"""Issue 10's speed goals, each checked against one run: the claim, the value, pass or fail."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.report import COPY, OURS, OURS_GLOO, RAY, STORE, TORCH, human

PASS, FAIL, NOT_MEASURED = "pass", "fail", "not measured"

LATENCY_BOUND_US = 20.0
LATENCY_SPEEDUP = 10.0
ALLREDUCE_SHARE = 1 / 3
COPY_SHARE = 0.5


@dataclass(frozen=True)
class Goal:
    """One goal: what it claims, what this run measured, and the verdict."""

    claim: str
    measured: str
    verdict: str


Records = list[dict[str, Any]]


def _time(records: Records, impl: str, op: str, world_size: int, size: int) -> float | None:
    for r in records:
        if (r["impl"], r["op"], r["world_size"], r["size"]) == (impl, op, world_size, size):
            return r["time_us"]["median"]
    return None


def _probe(probes: Records, impl: str, world_size: int) -> float | None:
    for p in probes:
        if (p["impl"], p["world_size"]) == (impl, world_size):
            return p["median_us"]
    return None


def _worst(
    records: Records,
    base: str,
    keep: Callable[[dict[str, Any]], bool],
    impl: str = OURS,
    largest: bool = True,
) -> tuple[float, dict[str, Any]] | None:
    """Return the largest (or smallest) time ratio ``base``/``impl`` of the kept points."""
    ratios = []
    for r in records:
        if r["impl"] != impl or not keep(r):
            continue
        other = _time(records, base, r["op"], r["world_size"], r["size"])
        if other:
            ratios.append((r["time_us"]["median"] / other, r))
    if not ratios:
        return None
    pick = max if largest else min
    return pick(ratios, key=lambda x: x[0])


def _where(r: dict[str, Any]) -> str:
    return f"{r['op']} {human(r['size'])}, {r['world_size']} ranks"


def _latency_goals(probes: Records) -> list[Goal]:
    ours, torch = _probe(probes, OURS, 2), _probe(probes, TORCH, 2)
    claim = f"8-byte allreduce in Ray actors (2 ranks): median <= {LATENCY_BOUND_US:g} us"
    goals = [
        Goal(claim, "not in this run", NOT_MEASURED)
        if ours is None
        else Goal(claim, f"{ours:.1f} us", PASS if ours <= LATENCY_BOUND_US else FAIL)
    ]
    claim = f"... and >= {LATENCY_SPEEDUP:g}x faster than raw torch gloo in the same run"
    if ours is None or torch is None:
        goals.append(Goal(claim, "not in this run", NOT_MEASURED))
    else:
        speedup = torch / ours
        verdict = PASS if speedup >= LATENCY_SPEEDUP else FAIL
        goals.append(Goal(claim, f"{speedup:.1f}x ({TORCH} {torch:.1f} us)", verdict))
    return goals


def _ratio_goal(
    claim: str,
    found: tuple[float, dict[str, Any]] | None,
    bound: float,
    covered: str,
    at_most: bool = True,
) -> Goal:
    if found is None:
        return Goal(claim, "not in this run", NOT_MEASURED)
    value, r = found
    ok = value <= bound if at_most else value >= bound
    return Goal(claim, f"worst {value:.2f} at {_where(r)}{covered}", PASS if ok else FAIL)


def _sizes(records: Records, keep: Callable[[dict[str, Any]], bool]) -> str:
    sizes = sorted({r["size"] for r in records if keep(r)})
    return f" ({len(sizes)} sizes, {human(sizes[0])} to {human(sizes[-1])})" if sizes else ""


def evaluate(records: Records, probes: Records) -> list[Goal]:
    """Return every goal's verdict on this run's ``records`` and latency ``probes``."""
    goals = _latency_goals(probes)

    def big_allreduce(r: dict[str, Any]) -> bool:
        in_range = 64 << 10 <= r["size"] <= 256 << 20
        return r["op"] == "allreduce" and r["world_size"] == 2 and in_range

    goals.append(
        _ratio_goal(
            "allreduce (2 ranks) takes <= 1/3 of raw torch gloo's time, 64 KiB to 256 MiB",
            _worst(records, TORCH, big_allreduce),
            ALLREDUCE_SHARE,
            _sizes(records, big_allreduce),
        )
    )
    goals.append(
        _ratio_goal(
            "allreduce (2 ranks) beats the object store at 256 MiB",
            _worst(
                records,
                STORE,
                lambda r: (r["op"], r["world_size"], r["size"]) == ("allreduce", 2, 256 << 20),
            ),
            1.0,
            "",
        )
    )

    def big_copy(r: dict[str, Any]) -> bool:
        return (
            r["op"] in ("broadcast", "allgather") and r["world_size"] == 2 and r["size"] >= 1 << 20
        )

    found = _worst(records, COPY, big_copy, largest=True)
    share = None if found is None else (1 / found[0], found[1])
    goals.append(
        _ratio_goal(
            "broadcast and allgather (2 ranks) reach >= 1/2 of the plain-copy peer at >= 1 MiB",
            share,
            COPY_SHARE,
            _sizes(records, big_copy),
            at_most=False,
        )
    )

    def four(r: dict[str, Any]) -> bool:
        return r["world_size"] == 4

    goals.append(
        _ratio_goal(
            "at 4 ranks no op is slower than raw torch gloo at any size",
            _worst(records, TORCH, four),
            1.0,
            _sizes(records, four),
        )
    )

    def reducescatter(r: dict[str, Any]) -> bool:
        return r["op"] == "reducescatter"

    goals.append(
        _ratio_goal(
            f"Gloo path ({OURS_GLOO}) reducescatter is not slower than {RAY} at any size",
            _worst(records, RAY, reducescatter, impl=OURS_GLOO),
            1.0,
            _sizes(records, reducescatter),
        )
    )
    return goals


def text(goals: list[Goal]) -> str:
    """Return the goals as lines of text: verdict, claim, measured value."""
    lines = ["# goals (time ratios are ours over the baseline: below 1 is faster)"]
    lines += [f"{g.verdict.upper():>12}  {g.claim}: {g.measured}" for g in goals]
    return "\n".join(lines)


def as_json(goals: list[Goal]) -> list[dict[str, str]]:
    """Return the goals as plain dicts for the JSON output."""
    return [asdict(g) for g in goals]
