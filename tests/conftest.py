"""Shared fixtures: one Ray job per test module, a pool of member actors, leak checks.

The modules that use ``ray_cluster`` share one local Ray cluster, started once in a
child process; each such module connects to it as a Ray job of its own, and at its end
kills what it left and disconnects, so that the next module finds the cluster as new.
Programs that such a module runs may join the cluster too (``SharedCluster.address``),
each as a job of its own. ``Programs`` runs a module's long programs in the background.
"""

from __future__ import annotations

import asyncio
import os
import selectors
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, Any

import numpy as np
import pytest
import ray

import collective as col
from collective.registry.backends import _KV_NAMESPACE
from collective.rendezvous.actor import STORE_ACTOR_NAME

RAY_TIMEOUT_S = 120
"""Bound on every ray.get in the tests, so that a hang fails instead of stalling CI."""


class _Member:
    """A test actor that runs whatever function it is sent, in its own process."""

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    def actor_id(self) -> str:
        return ray.get_runtime_context().get_actor_id() or ""


Member: Any = ray.remote(num_cpus=0)(_Member)
"""The member actor class. Applied rather than decorated, as type checkers ignore class
decorators; ``Any``, as Ray's types do not follow method calls through actor handles."""


def our_named_actors() -> list[str]:
    """Return the namespaces that hold this library's store actor."""
    return sorted(
        a["namespace"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"] == STORE_ACTOR_NAME
    )


def live_groups() -> list[str]:
    """Return the groups alive in this library's store actors, in every namespace."""
    names = []
    for namespace in our_named_actors():
        try:
            store = ray.get_actor(STORE_ACTOR_NAME, namespace=namespace)
            names += ray.get(store.names.remote(), timeout=RAY_TIMEOUT_S)
        except (ValueError, ray.exceptions.RayActorError):
            continue
    return sorted(names)


def run_all(actors: Sequence[Any], fn: Callable[..., Any], *per_actor_args: Sequence[Any]) -> list:
    """Run ``fn(*args_i)`` on actor i for every i, and return every result in order."""
    refs = [a.run.remote(fn, *(args[i] for args in per_actor_args)) for i, a in enumerate(actors)]
    return ray.get(refs, timeout=RAY_TIMEOUT_S)


def allreduce_until_failure(name: str, started: str = "") -> tuple[float, str, str]:
    """Allreduce on group ``name`` until it raises; return when, the error's type and message.

    With ``started``, first create that file, for ``wait_for_files`` in the driver.
    """
    if started:
        open(started, "w").close()
    x = np.ones(1 << 14, dtype=np.float32)
    deadline = time.monotonic() + RAY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            col.allreduce(x, name)
        except Exception as exc:
            return time.time(), type(exc).__name__, str(exc)
    return time.time(), "", "no failure"


def wait_for_files(paths: Sequence[str], settle_s: float = 0.25) -> None:
    """Wait until every file of ``paths`` exists, then ``settle_s`` more.

    The files are made by calls in actors as they begin (``allreduce_until_failure``):
    a test that kills a rank mid-op kills it once every call runs, not after a guess.
    """
    deadline = time.monotonic() + RAY_TIMEOUT_S
    while missing := [p for p in paths if not os.path.exists(p)]:
        assert time.monotonic() < deadline, f"no call made {missing}"
        time.sleep(0.01)
    time.sleep(settle_s)


def settle_rdt(timeout_s: float = 5.0) -> None:
    """Wait until Ray's RDT failure monitor has taken every transfer of this session.

    Ray keeps its RDT manager across ``ray.shutdown``: a transfer still queued for its
    monitor reaches the next session's monitor, whose ``ray.wait`` on it raises in a
    thread. Call it before ``ray.shutdown`` in a module that moved tensors by RDT.
    """
    manager = ray._private.worker.global_worker._rdt_manager
    deadline = time.monotonic() + timeout_s
    while manager is not None and time.monotonic() < deadline:
        if manager._unmonitored_transfers.empty():
            return
        time.sleep(0.05)


def unique_name(prefix: str = "g") -> str:
    """Return a group name no other test uses."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


_HEAD = """
import sys

import ray

ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
context = ray.get_runtime_context()
print(context.gcs_address, context.get_job_id(), flush=True)
sys.stdin.read()  # until the test session closes the pipe or exits
ray.shutdown()
"""
"""The program that starts and holds the shared cluster: the local cluster each module
once started itself, with its 2 CPUs and no dashboard."""


class SharedCluster:
    """The session's local Ray cluster, in a child process that the test modules connect to."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[str] | None = None
        self._log: IO[bytes] | None = None
        self._gcs: Any = None
        self.address = ""
        self._head_job = ""

    def connect(self, namespace: str, **init: Any) -> None:
        """Connect this process to the cluster as a new Ray job; start the cluster if it is down.

        ``init`` goes to ``ray.init`` with the address: what a job may choose, such as
        its ``runtime_env``.
        """
        if self._process is None or self._process.poll() is not None:
            self._start()
        ray.init(address=self.address, namespace=namespace, **init)

    def _start(self) -> None:
        from ray._private.authentication.authentication_token_setup import (
            enable_token_auth_by_default,
        )

        self.stop()
        # What ray.init(address="local") does in the starting process: the cluster's
        # token, in this process's environment for every process it starts.
        enable_token_auth_by_default()
        # The cluster's first job is the holder's, which starts no worker.
        env = {**os.environ, "RAY_prestart_worker_first_driver": "0"}
        self._log = tempfile.TemporaryFile()
        self._process = subprocess.Popen(
            [sys.executable, "-c", _HEAD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            text=True,
        )
        assert self._process.stdout is not None
        with selectors.DefaultSelector() as selector:  # not select(): fds may pass 1024
            selector.register(self._process.stdout, selectors.EVENT_READ)
            ready = selector.select(RAY_TIMEOUT_S)
        line = self._process.stdout.readline().split() if ready else []
        if len(line) != 2:
            log = self._log_tail()
            self.stop()
            raise RuntimeError(f"the shared Ray cluster did not start:\n{log}")
        self.address, self._head_job = line
        raylet: Any = ray._raylet  # Ray-private: its state API needs the dashboard
        self._gcs = raylet.GcsClient(address=self.address)

    def _log_tail(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read()[-4000:].decode(errors="replace")

    def stop(self) -> None:
        """Stop the cluster, if it runs: the next ``connect`` starts a new one."""
        process, self._process = self._process, None
        if process is not None:
            assert process.stdin is not None and process.stdout is not None
            process.stdin.close()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=60)
            process.stdout.close()
        if self._log is not None:
            self._log.close()
            self._log = None
        self._gcs = None

    def disconnect(self) -> None:
        """End this process's job; kill and remove all it left, and check that nothing is."""
        try:
            for actor in ray.util.list_named_actors(all_namespaces=True):
                try:  # named actors may be detached: they outlive their job
                    handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
                except ValueError:
                    continue
                ray.kill(handle, no_restart=True)
            from ray.experimental import internal_kv

            kv: Any = internal_kv
            kv._internal_kv_del(b"", del_by_prefix=True, namespace=_KV_NAMESPACE)
        finally:
            settle_rdt()
            ray.shutdown()  # Ray kills the job's other actors and their workers
        if self._process is None or self._process.poll() is not None:
            return  # the cluster is gone, and all in it: the next connect starts a new one
        left = self._alive()
        deadline = time.monotonic() + 30
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = self._alive()
        if left:
            self.stop()
            raise AssertionError(f"a test module left in the shared Ray cluster: {left}")

    def _alive(self) -> list[str]:
        """Return every actor and job alive in the cluster, but the holder's job."""

        async def query() -> tuple[Any, Any]:
            actors = await self._gcs.async_get_all_actor_info(timeout=RAY_TIMEOUT_S)
            jobs = await self._gcs.async_get_all_job_info(
                skip_submission_job_info_field=True,
                skip_is_running_tasks_field=True,
                timeout=RAY_TIMEOUT_S,
            )
            return actors, jobs

        from ray.core.generated import gcs_pb2

        dead: Any = gcs_pb2
        actors, jobs = asyncio.run(query())
        gone = dead.ActorTableData.DEAD
        alive = [f"actor {k.hex()}" for k, a in actors.items() if a.state != gone]
        alive += [f"job {k.hex()}" for k, j in jobs.items() if not j.is_dead]
        return [x for x in alive if x != f"job {self._head_job}"]


_shared = SharedCluster()


@pytest.fixture(scope="session")
def shared_cluster() -> Iterator[SharedCluster]:
    """Return the session's one local Ray cluster; stop it at the session's end."""
    yield _shared
    _shared.stop()


def _uses_shared_cluster(item: pytest.Item) -> bool:
    return "shared_cluster" in getattr(item, "fixturenames", ())


_sharing: set[pytest.Module | None] = set()
"""The modules with a test that uses the shared cluster."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the modules that use the shared cluster one after another.

    They keep their order among themselves and run from where the first of them
    was; every other module keeps its order. So the shared cluster starts once and
    stops once, before the first other module (see ``_others_run_without_it``).
    """
    sharing = {item.getparent(pytest.Module) for item in items if _uses_shared_cluster(item)}
    sharing.discard(None)
    _sharing.update(sharing)
    if not sharing:
        return
    block = [item for item in items if item.getparent(pytest.Module) in sharing]
    first = items.index(block[0])
    rest = [item for item in items if item.getparent(pytest.Module) not in sharing]
    items[:] = rest[:first] + block + rest[first:]


@pytest.fixture(scope="module", autouse=True)
def _others_run_without_it(request: pytest.FixtureRequest) -> None:
    """Stop the shared cluster before a module that does not use it.

    A module that starts its own Ray cluster runs, as before, with no other Ray
    cluster beside its own, and the others with no idle one. A later module that
    uses the shared cluster starts it again.
    """
    if request.node not in _sharing:
        _shared.stop()


@pytest.fixture(scope="module")
def ray_cluster(shared_cluster: SharedCluster) -> Iterator[None]:
    """Connect the module to the local Ray cluster as its own job; clean up after it.

    At the module's end every actor it left is killed (named ones too, which may be
    detached), the backends it published are removed and the job ends; the fixture
    then checks that nothing of the module's is alive in the cluster.
    """
    shared_cluster.connect(namespace="collective-tests")
    yield
    shared_cluster.disconnect()


@pytest.fixture(scope="module")
def members(ray_cluster: None) -> list[Any]:
    """Return four live member actors, shared by the module's tests."""
    actors = [Member.remote() for _ in range(4)]
    ray.get([a.actor_id.remote() for a in actors], timeout=RAY_TIMEOUT_S)
    return actors


@pytest.fixture
def no_leaks(ray_cluster: None) -> Iterator[None]:
    """Assert that a test leaves no group alive behind it, in any namespace."""
    yield
    assert live_groups() == []


class Programs:
    """Programs run as child processes, ``width`` at a time in the order started; each test
    waits for its own.

    A module whose tests each check what a long program did (an example, a benchmark's
    smoke run) starts them all at its start, so that they run while its other tests do,
    and, with a ``width`` of 2, one program's waits (for its processes to start, its
    cluster to answer) overlap another's work.
    """

    def __init__(self, width: int) -> None:
        """Run at most ``width`` programs at once."""
        self._pool = ThreadPoolExecutor(width, thread_name_prefix="program")
        self._runs: dict[str, Future[subprocess.CompletedProcess[str]]] = {}

    def start(self, key: str, command: Sequence[str], timeout_s: float, **popen: Any) -> None:
        """Queue ``command``, known as ``key``; ``popen`` goes to ``subprocess.run`` with it.

        It runs with its output captured as text; past ``timeout_s`` it is killed, and
        ``result`` raises ``subprocess.TimeoutExpired``.
        """

        def run() -> subprocess.CompletedProcess[str]:
            argv = list(command)
            return subprocess.run(
                argv, capture_output=True, text=True, timeout=timeout_s, check=False, **popen
            )

        self._runs[key] = self._pool.submit(run)

    def result(self, key: str) -> subprocess.CompletedProcess[str]:
        """Wait for program ``key`` to end; return how it ended."""
        return self._runs[key].result()

    def close(self) -> None:
        """Drop the programs that have not started; wait for the others to end."""
        self._pool.shutdown(wait=True, cancel_futures=True)


def selected(request: pytest.FixtureRequest) -> list[pytest.Item]:
    """Return the tests of the requesting module that this session runs, in their order."""
    module = request.node.getparent(pytest.Module)
    return [item for item in request.session.items if item.getparent(pytest.Module) is module]
