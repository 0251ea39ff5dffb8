"""torch's own backend tests, run against gloo and against collective, and their difference.

torch tests a backend with ``torch.testing._internal.distributed.distributed_test``
(``DistributedTest._DistTestBase``), driven by the environment variables ``BACKEND``,
``WORLD_SIZE`` and ``TEMP_DIR`` as torch's ``test/distributed/test_distributed_spawn.py``
drives it: each test spawns ``WORLD_SIZE`` processes that call ``init_process_group``
with ``BACKEND`` (``INIT_METHOD`` unset: ``env://``) and run the test's body.

The suite gates many tests on the backend's name (``BACKEND == "gloo"``, the sets of
``DistTestCases``). Run against ``collective``, its ``BACKEND`` is a string that is
"collective" (the name ``init_process_group`` gets) and compares and hashes equal to
"gloo" too: every test gloo runs, collective runs, branches for gloo included (they
expect gloo's own errors and messages; those that differ are listed as tests of gloo
itself). ``DistTestCases``' sets that hold "gloo" hold "collective" too.

Usage (from the repository root; a full run takes long: run it with ``nice``)::

    python -m tests.torch_suite run gloo            # every test, outcomes into the results
    python -m tests.torch_suite run collective -k test_all_reduce_sum -k test_barrier
    python -m tests.torch_suite diff                # print what passes on gloo only, and why

Each run updates its backend's outcomes in ``tests/torch_suite_results.json`` (a
``-k`` run only the tests it ran).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "torch_suite_results.json"
"""The committed outcomes of every test on each backend."""

WORLD_SIZE = 2
CHILD_ENV = "COLLECTIVE_TORCH_SUITE_OUT"
"""Set in the process that runs the tests: where it writes their outcomes."""
SELECT_ENV = "COLLECTIVE_TORCH_SUITE_SELECT"
"""The tests that process runs (names separated by commas), or all when empty."""
TEST_TIMEOUT_S = 180
"""The longest one test may run before torch's harness fails it."""

GLOO_ITSELF = {
    "test_monitored_barrier_gloo": "torch's dist.monitored_barrier refuses every backend not "
    "named gloo ('monitored_barrier is only implemented for GLOO backend'); the group's own "
    "monitored_barrier method, with Gloo's messages, passes "
    "test_monitored_barrier_gloo_rank_0_timeout",
    "test_monitored_barrier_gloo_subgroup": "the same refusal by name in dist.monitored_barrier",
    "test_barrier_timeout_full_group": "expects Gloo's wording (' Timed out ', ' closed ' or "
    "' timeout '); the barrier raises at its 1 s timeout on the waiting rank as the test wants, "
    "with the library's CollectiveTimeoutError naming the rank that never joined",
}
"""The tests that pass on gloo and not on collective because they test Gloo itself, and why."""


class GlooAlias(str):
    """The name "collective", equal (and hashed equal) to "gloo" too, for the suite's gates."""

    def __eq__(self, other: object) -> bool:
        return str.__eq__(self, other) or other == "gloo"

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash("gloo")


def _alias_backend() -> None:
    """Make ``os.environ["BACKEND"]`` read as ``GlooAlias("collective")`` in this process."""
    environ = os.environ

    class Environ(type(environ)):  # type: ignore[misc]
        def __getitem__(self, key: str) -> str:
            value = super().__getitem__(key)
            return GlooAlias(value) if key == "BACKEND" and value == "collective" else value

    os.environ = Environ(  # noqa: B003 (a view of the same data, not a new environment)
        environ._data,  # type: ignore[attr-defined]
        environ.encodekey,
        environ.decodekey,
        environ.encodevalue,
        environ.decodevalue,
    )


def _suite_class() -> type:
    """Import torch's suite for the backend in ``BACKEND`` and return its test class."""
    import collective

    collective.register_torch_backend()
    if os.environ.get("BACKEND") == "collective":
        _alias_backend()
    import torch
    from torch.testing._internal import common_distributed

    if os.environ["BACKEND"] == "collective":  # before the suite's decorators read them
        cases = common_distributed.DistTestCases
        for sets in (cases.skip_collective, cases.backend_feature):
            for names in sets.values():
                if "gloo" in names:
                    names.add("collective")
        cases.backend_feature["plugin"].add("collective")
    from torch.testing._internal.distributed.distributed_test import (
        DistributedTest,
        TestDistBackend,
    )

    class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
        def setUp(self) -> None:
            super().setUp()
            self._spawn_processes()
            torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

    return TestDistBackendWithSpawn


if os.environ.get(CHILD_ENV):
    TestDistBackendWithSpawn = _suite_class()
    TestDistBackendWithSpawn.__qualname__ = "TestDistBackendWithSpawn"


class _Outcomes(unittest.TextTestResult):
    """A result that also records each test's outcome, time and reason."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outcomes: dict[str, dict[str, Any]] = {}
        self._started = 0.0

    def startTest(self, test: unittest.TestCase) -> None:  # noqa: N802 (unittest's name)
        self._started = time.monotonic()
        super().startTest(test)

    def _record(self, test: unittest.TestCase, outcome: str, reason: str = "") -> None:
        name = test.id().rsplit(".", 1)[-1]
        seconds = round(time.monotonic() - self._started, 1)
        self.outcomes[name] = {"outcome": outcome, "seconds": seconds, "reason": reason[-2000:]}

    def addSuccess(self, test: unittest.TestCase) -> None:  # noqa: N802
        super().addSuccess(test)
        self._record(test, "passed")

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:  # noqa: N802
        super().addFailure(test, err)
        self._record(test, "failed", self.failures[-1][1])

    def addError(self, test: unittest.TestCase, err: Any) -> None:  # noqa: N802
        super().addError(test, err)
        self._record(test, "failed", self.errors[-1][1])

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:  # noqa: N802
        super().addSkip(test, reason)
        self._record(test, "skipped", reason)

    def addExpectedFailure(self, test: unittest.TestCase, err: Any) -> None:  # noqa: N802
        super().addExpectedFailure(test, err)
        self._record(test, "passed", "expected failure")

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:  # noqa: N802
        super().addUnexpectedSuccess(test)
        self._record(test, "failed", "unexpected success")


def _child() -> int:
    """Run the selected tests of the suite in this process; write their outcomes."""
    loader = unittest.TestLoader()
    suite = loader.loadTestsFromTestCase(TestDistBackendWithSpawn)
    wanted = {n for n in os.environ.get(SELECT_ENV, "").split(",") if n}
    if wanted:
        suite = unittest.TestSuite(t for t in suite if t.id().rsplit(".", 1)[-1] in wanted)  # type: ignore[union-attr]
    runner = unittest.TextTestRunner(resultclass=_Outcomes, verbosity=2, stream=sys.stdout)
    result = runner.run(suite)
    outcomes = result.outcomes  # type: ignore[attr-defined]
    Path(os.environ[CHILD_ENV]).write_text(json.dumps(outcomes, indent=1, sort_keys=True))
    return 0


def run(backend: str, only: list[str], results: Path = RESULTS) -> dict[str, dict[str, Any]]:
    """Run the suite (or the tests ``only`` names) on ``backend`` at world size 2; record them.

    Returns the outcomes by test name, also merged into ``results`` under ``backend``.
    """
    with tempfile.TemporaryDirectory(prefix="torch-suite-") as temp:
        (Path(temp) / "barrier").mkdir()
        out = Path(temp) / "outcomes.json"
        env = dict(os.environ)
        env.update(
            BACKEND=backend,
            WORLD_SIZE=str(WORLD_SIZE),
            TEMP_DIR=temp,
            DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(TEST_TIMEOUT_S),
            **{CHILD_ENV: str(out), SELECT_ENV: ",".join(only)},
        )
        env.pop("INIT_METHOD", None)
        subprocess.run([sys.executable, "-m", "tests.torch_suite", "child"], env=env, check=False)
        outcomes: dict[str, dict[str, Any]] = json.loads(out.read_text()) if out.exists() else {}
    recorded = json.loads(results.read_text()) if results.exists() else {}
    tests = recorded.setdefault(backend, {}).setdefault("tests", {})
    tests.update(outcomes)
    recorded[backend]["meta"] = _meta()
    results.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
    return outcomes


def _meta() -> dict[str, Any]:
    import torch

    return {
        "torch": torch.__version__,
        "world_size": WORLD_SIZE,
        "machine": f"{platform.node()}: {os.cpu_count()} cores, {platform.machine()}",
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def difference(recorded: dict[str, Any]) -> dict[str, Any]:
    """Return each backend's counts and the tests whose outcomes differ, from ``recorded``."""
    gloo = recorded.get("gloo", {}).get("tests", {})
    ours = recorded.get("collective", {}).get("tests", {})
    counts = {
        backend: {
            outcome: sum(
                1
                for t in recorded.get(backend, {}).get("tests", {}).values()
                if t["outcome"] == outcome
            )
            for outcome in ("passed", "failed", "skipped")
        }
        for backend in ("gloo", "collective")
    }
    differ = {
        name: {
            "gloo": gloo.get(name, {}).get("outcome", "not run"),
            "collective": ours.get(name, {}).get("outcome", "not run"),
            "gloo_itself": GLOO_ITSELF.get(name, ""),
        }
        for name in sorted(set(gloo) | set(ours))
        if gloo.get(name, {}).get("outcome") != ours.get(name, {}).get("outcome")
    }
    return {"counts": counts, "differ": differ}


def main(argv: list[str]) -> int:
    """Run the command line; see the module's docstring."""
    if argv[:1] == ["child"]:
        return _child()
    parser = argparse.ArgumentParser(prog="python -m tests.torch_suite")
    sub = parser.add_subparsers(dest="command", required=True)
    running = sub.add_parser("run", help="run the suite on one backend")
    running.add_argument("backend", choices=["gloo", "collective"])
    running.add_argument("-k", dest="only", action="append", default=[], help="a test to run")
    sub.add_parser("diff", help="print the counts and the tests whose outcomes differ")
    args = parser.parse_args(argv)
    if args.command == "run":
        outcomes = run(args.backend, args.only)
        failed = sorted(n for n, t in outcomes.items() if t["outcome"] == "failed")
        print(f"{args.backend}: {len(outcomes)} tests, failed: {failed}")
        return 0
    recorded = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    found = difference(recorded)
    print(json.dumps(found["counts"], indent=1))
    unexplained = 0
    for name, outcomes in found["differ"].items():
        print(f"{name}: gloo {outcomes['gloo']}, collective {outcomes['collective']}")
        if outcomes["gloo_itself"]:
            print(f"    a test of Gloo itself: {outcomes['gloo_itself']}")
            continue
        unexplained += outcomes["gloo"] == "passed"
        reason = recorded.get("collective", {}).get("tests", {}).get(name, {}).get("reason", "")
        if reason:
            print("    " + reason.strip().splitlines()[-1][:300])
    print(f"passing on gloo only, not a test of Gloo itself: {unexplained}")
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
