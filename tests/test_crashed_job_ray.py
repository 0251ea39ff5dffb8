"""A crashed job leaves nothing behind, and its rerun in the same namespace works (item 3).

The jobs are real second drivers: subprocesses that connect to this module's
cluster, make a group with two actors and declare another, then die without
destroying anything, as a crashed script does.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
import ray

from collective.rendezvous.actor import IDLE_GRACE_S, STORE_ACTOR_NAME, SWEEP_S
from tests.conftest import unique_name

DRIVER = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    import ray
    import collective as col

    ray.init(address=sys.argv[1], namespace=sys.argv[2])

    @ray.remote(num_cpus=0)
    class Worker:
        def setup(self, rank):
            col.init_collective_group(2, rank, backend="gloo", group_name="job")
            x = np.full(2, rank + 1.0)
            col.allreduce(x, "job")
            return float(x[0])

    workers = [Worker.remote() for _ in range(2)]
    sums = ray.get([w.setup.remote(r) for r, w in enumerate(workers)], timeout=120)
    col.declare_collective_group(workers, 2, [1, 0], backend="gloo", group_name="declared")
    print(sums, col.list_collective_groups(), flush=True)
    os._exit(3)
    """
)

DRIVER_TIMEOUT_S = 180


def _crashing_job(address: str, namespace: str) -> str:
    """Run one job to its crash and return what it printed."""
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, address, namespace],
        capture_output=True,
        text=True,
        timeout=DRIVER_TIMEOUT_S,
    )
    assert done.returncode == 3, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def _namespace_state(namespace: str) -> list[str] | None:
    """Return the groups in the namespace's store actor, or None once it has none."""
    try:
        store = ray.get_actor(STORE_ACTOR_NAME, namespace=namespace)
        return ray.get(store.names.remote(), timeout=30)
    except (ValueError, ray.exceptions.RayActorError):
        return None


@pytest.mark.usefixtures("no_leaks")
def test_a_crashed_jobs_rerun_works_and_nothing_is_left(ray_cluster: None) -> None:
    address = ray.get_runtime_context().gcs_address
    namespace = unique_name("crashed-job")
    assert _crashing_job(address, namespace) == "[3.0, 3.0] ['declared', 'job']"
    # The rerun takes ranks 0 and 1 of "job", held until now by the dead actors.
    assert _crashing_job(address, namespace) == "[3.0, 3.0] ['declared', 'job']"
    crashed_at = time.monotonic()
    groups_gone_s = store_gone_s = None
    while time.monotonic() - crashed_at < IDLE_GRACE_S + 10 * SWEEP_S + 20:
        state = _namespace_state(namespace)
        if state == [] and groups_gone_s is None:
            groups_gone_s = time.monotonic() - crashed_at
        if state is None:
            store_gone_s = time.monotonic() - crashed_at
            break
        time.sleep(0.1)
    print(f"\nthe crashed job's groups were gone {groups_gone_s} s after its driver died")
    print(f"its store actor exited {store_gone_s} s after its driver died")
    assert store_gone_s is not None, _namespace_state(namespace)
    assert groups_gone_s is not None and groups_gone_s < 5 * SWEEP_S + 5, groups_gone_s
