"""The one-sided shared-memory transport: consumers on one node map the producer's file.

One Ray job on the local cluster for the module. The driver registers the transport before the
classes that name it, and nothing else: no collective group is made. Each test
checks every consumer's tensors bit for bit; failures kill real actors; /dev/shm
and the consumers' mappings are checked flat after the objects are dropped.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ray
import torch
from ray.experimental import set_target_for_ref

import collective as col
from tests import odd_tensors
from tests.conftest import RAY_TIMEOUT_S, SharedCluster

SHM = "COLLECTIVE_SHM"
col.register_shm_transport()  # before the classes that name it, as Ray asks
SMALL = 300

actor_class: Any = ray.remote
"""Ray's decorator; its stubs know neither ``enable_tensor_transport`` nor actor methods."""


def state_dict(seed: int, small: int = SMALL, big: bool = True) -> dict[str, torch.Tensor]:
    """Return many small tensors of many dtypes, empty and 0-d ones, and (``big``) big ones."""
    g = torch.Generator().manual_seed(seed)
    out = {f"layer{i}.w": torch.randn(8, 16 + i % 5, generator=g) for i in range(small)}
    for dtype in (torch.float16, torch.bfloat16, torch.float64, torch.complex64):
        out[str(dtype)] = torch.randn(7, 3, generator=g).to(dtype)
    for dtype in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
        out[str(dtype)] = torch.randint(-100, 100, (33,), generator=g).to(dtype)
    out["mask"] = torch.rand(13, generator=g) > 0.5
    out["scalar"] = torch.tensor(seed * 0.5)
    out["empty"] = torch.zeros(0, 4)
    if big:
        out["big"] = torch.randn(512, 1024, generator=g)  # 2 MiB
        out["big_t"] = torch.randn(1024, 300, generator=g).t()  # not contiguous
    return out


def segments(pid: int) -> list[str]:
    """Return the shared-memory files of process ``pid``."""
    return glob.glob(f"/dev/shm/collective-{pid}-*")


def wait_dead(pid: int, timeout_s: float = 30) -> None:
    """Wait until process ``pid`` no longer runs (``ray.kill`` returns before it is gone)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
        except OSError:
            return
        time.sleep(0.05)
    raise TimeoutError(f"process {pid} still runs after {timeout_s} s")


def mappings() -> int:
    """Return how many mappings of shared-memory files this process holds."""
    with open("/proc/self/maps") as f:
        return sum("/dev/shm/collective-" in line for line in f)


def wrong(got: dict[str, torch.Tensor], seed: int, small: int = SMALL) -> list[str]:
    want = state_dict(seed, small, big="big" in got)
    bad = [k for k, v in want.items() if got[k].dtype != v.dtype or not torch.equal(got[k], v)]
    return bad + ([] if sorted(got) == sorted(want) else ["keys"])


class _Producer:
    @ray.method(tensor_transport=SHM)
    def weights(self, seed: int, small: int = SMALL, delay: float = 0.0) -> dict[str, Any]:
        time.sleep(delay)
        return state_dict(seed, small, big=small == SMALL)

    @ray.method(tensor_transport=SHM)
    def pair(self) -> list[torch.Tensor]:
        return [torch.arange(10.0), torch.ones(3, 4, dtype=torch.int32)]

    @ray.method(tensor_transport=SHM)
    def odd(self, kind: str) -> list[Any]:
        return [torch.ones(2), odd_tensors.refused(kind)]

    @ray.method(tensor_transport=SHM)
    def carried(self) -> dict[str, Any]:
        return odd_tensors.carried()

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)


Producer: Any = actor_class(num_cpus=0, enable_tensor_transport=True)(_Producer)


class _Consumer:
    def check(self, got: dict[str, Any], seed: int, small: int = SMALL) -> dict[str, Any]:
        bad = wrong(got, seed, small)
        storages = {got[f"layer{i}.w"].untyped_storage().data_ptr() for i in range(small)}
        for v in got.values():
            v.zero_()  # copy-on-write: the other consumers still read the producer's bytes
        return {"wrong": bad, "storages": len(storages)}

    def hold(self, got: dict[str, Any]) -> int:
        self.held = got
        return len(got)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)


Consumer: Any = actor_class(num_cpus=0, enable_tensor_transport=True)(_Consumer)


@pytest.fixture(scope="module")
def pool(shared_cluster: SharedCluster) -> Iterator[tuple[Any, list[Any], int]]:
    """Join the local cluster; return a producer, three consumers and the producer's pid."""
    shared_cluster.connect(namespace="rdt-shm")
    producer, consumers = Producer.remote(), [Consumer.remote() for _ in range(3)]
    pid = ray.get(producer.run.remote(lambda: __import__("os").getpid()), timeout=RAY_TIMEOUT_S)
    ray.get([c.run.remote(mappings) for c in consumers], timeout=RAY_TIMEOUT_S)
    yield producer, consumers, pid
    shared_cluster.disconnect()  # settles RDT first


def flat(pid: int, consumers: list[Any]) -> tuple[list[str], list[int]]:
    """Wait up to 10 s for Ray to free the objects; return the files and mappings left."""
    deadline = time.monotonic() + 10
    while segments(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return segments(pid), ray.get([c.run.remote(mappings) for c in consumers], timeout=60)


def test_every_consumer_and_the_driver_read_the_object_with_no_group(
    pool: tuple[Any, list[Any], int],
) -> None:
    producer, consumers, pid = pool
    for seed in (1, 2):
        ref = producer.weights.remote(seed)
        checks = ray.get([c.check.remote(ref, seed) for c in consumers], timeout=RAY_TIMEOUT_S)
        assert checks == [{"wrong": [], "storages": 1}] * 3  # one mapping for the small ones
        assert wrong(ray.get(ref, timeout=RAY_TIMEOUT_S), seed) == []
        assert segments(pid)
        del ref
    ref = producer.pair.remote()
    into = [torch.full((10,), -1.0), torch.zeros(3, 4, dtype=torch.int32)]
    set_target_for_ref(ref, into)
    got = ray.get(ref, timeout=RAY_TIMEOUT_S)
    assert got[0] is into[0] and torch.equal(into[0], torch.arange(10.0))
    assert torch.equal(into[1], torch.ones(3, 4, dtype=torch.int32))
    del ref, got
    assert flat(pid, consumers) == ([], [0, 0, 0])


def test_a_hundred_objects_leave_dev_shm_and_the_mappings_flat(
    pool: tuple[Any, list[Any], int],
) -> None:
    producer, consumers, pid = pool
    for seed in range(100):
        ref = producer.weights.remote(seed, 20)
        checks = ray.get([c.check.remote(ref, seed, 20) for c in consumers], timeout=RAY_TIMEOUT_S)
        assert [c["wrong"] for c in checks] == [[], [], []], seed
        del ref
    assert flat(pid, consumers) == ([], [0, 0, 0])


def test_registering_again_is_a_no_op_and_other_names_are_refused() -> None:
    col.register_shm_transport()
    col.register_shm_transport("collective_shm")
    with pytest.raises(ValueError, match="one of Ray's own transports"):
        col.register_shm_transport("nixl")
    col.register_tensor_transport("collective_two_sided")
    with pytest.raises(ValueError, match="already names the transport CollectiveTransport"):
        col.register_shm_transport("collective_two_sided")


def _extract(obj_id: str, tensors: list[torch.Tensor]) -> Any:
    from ray.experimental.rdt.util import get_tensor_transport_manager

    return get_tensor_transport_manager(SHM).extract_tensor_transport_metadata(obj_id, tensors)


def _free(obj_id: str, meta: Any) -> None:
    from ray.experimental.rdt.util import get_tensor_transport_manager

    get_tensor_transport_manager(SHM).garbage_collect(obj_id, meta, [])


def _read(meta: Any, into: list[torch.Tensor] | None = None) -> Any:
    """Read ``meta``'s object here; return the tensors, or the error's message."""
    from ray.experimental.rdt.util import get_tensor_transport_manager

    from collective.ray_plugins.shm_transport import ShmCommunicatorMetadata

    manager = get_tensor_transport_manager(SHM)
    try:
        return manager.recv_multiple_tensors(meta.obj_id, meta, ShmCommunicatorMetadata(), into)
    except col.CollectiveError as exc:
        return str(exc)


def _read_then_abort(meta: Any) -> tuple[str, float]:
    """Copy ``meta``'s object into buffers by 4 KiB chunks, abort once it started; say how."""
    from ray.experimental.rdt.util import get_tensor_transport_manager

    from collective.ray_plugins import shm_transport
    from collective.ray_plugins.shm_transport import ShmCommunicatorMetadata

    manager: Any = get_tensor_transport_manager(SHM)
    into = [torch.empty(shape, dtype=dtype) for shape, dtype in meta.tensor_meta]
    outcome: list[Any] = []
    thread = threading.Thread(target=lambda: outcome.append(_read(meta, into)))
    chunk, shm_transport.CHUNK_BYTES = shm_transport.CHUNK_BYTES, 4096
    try:
        thread.start()
        while not manager._reads.count() and thread.is_alive():
            time.sleep(0.0005)
        start = time.monotonic()
        manager.abort_transport(meta.obj_id, ShmCommunicatorMetadata())
        thread.join(timeout=10)
    finally:
        shm_transport.CHUNK_BYTES = chunk
    return str(outcome[0] if outcome else "still reading"), time.monotonic() - start


_HELD: dict[str, Any] = {}
"""Tensors a consumer keeps between two of its calls, by object id."""


def _hold(meta: Any) -> int:
    _HELD[meta.obj_id] = _read(meta)
    return len(_HELD[meta.obj_id])


def _held_then_drop(obj_id: str) -> bool:
    """Return whether the tensors kept of ``obj_id`` are all ones; drop them."""
    return all(bool((t == 1).all()) for t in _HELD.pop(obj_id))


def test_abort_ends_a_copy_at_once_and_a_read_after_the_free_is_refused(
    pool: tuple[Any, list[Any], int],
) -> None:
    producer, consumers, pid = pool
    meta = ray.get(producer.run.remote(_extract, "x", [torch.ones(16 << 20)]), timeout=60)
    message, delay = ray.get(consumers[0].run.remote(_read_then_abort, meta), timeout=60)
    assert message == "Ray aborted the read of object x" and delay < 0.5
    assert ray.get(consumers[1].run.remote(_hold, meta), timeout=60) == 1
    ray.get(producer.run.remote(_free, "x", meta), timeout=60)
    assert segments(pid) == []
    assert "object x was freed" in ray.get(consumers[2].run.remote(_read, meta), timeout=60)
    assert ray.get(consumers[1].run.remote(_held_then_drop, "x"), timeout=60)
    assert flat(pid, consumers) == ([], [0, 0, 0])


def test_a_consumer_that_dies_holding_the_object_leaves_it_to_the_others(
    pool: tuple[Any, list[Any], int],
) -> None:
    producer, consumers, pid = pool
    doomed = Consumer.remote()
    ref = producer.weights.remote(5)
    assert ray.get(doomed.hold.remote(ref), timeout=RAY_TIMEOUT_S) == len(state_dict(5))
    ray.kill(doomed)
    checks = ray.get([c.check.remote(ref, 5) for c in consumers], timeout=RAY_TIMEOUT_S)
    assert [c["wrong"] for c in checks] == [[], [], []]
    del ref
    assert flat(pid, consumers) == ([], [0, 0, 0])


_CYCLES = """
import glob, json, os, sys, time
import ray, torch
import collective as col

col.register_shm_transport()
mine, counts = f"/dev/shm/collective-{os.getpid()}-*", []
for cycle in range(5):
    ray.init(address=sys.argv[1], namespace="rdt-shm-cycles", log_to_driver=False)
    x = torch.full((1024,), float(cycle))
    ref = ray.put(x, _tensor_transport="COLLECTIVE_SHM")
    assert torch.equal(ray.get(ref, timeout=60), x)
    made = len(glob.glob(mine))
    # The last round keeps the session's node handle, as code that keeps Ray's
    # internals might: its file then goes at the next ray.init.
    kept = ray._private.worker.global_worker.node if cycle == 4 else None
    ray.shutdown()  # the reference is still alive
    at_shutdown = len(glob.glob(mine))
    del ref
    counts.append([made, at_shutdown, len(glob.glob(mine))])
ray.init(address=sys.argv[1], namespace="rdt-shm-cycles", log_to_driver=False)
counts.append([len(glob.glob(mine))])
ray.shutdown()
print(json.dumps(counts))
"""


def test_a_driver_that_shuts_down_holding_a_reference_leaves_no_file(
    pool: tuple[Any, list[Any], int], shared_cluster: SharedCluster
) -> None:
    """Five rounds of init, put, shutdown with the reference alive, then the reference dropped.

    The file goes at the shutdown, or at the next ``ray.init`` when the session's end
    went unseen. A fresh driver process: it counts only its own files, before it exits.
    """
    done = subprocess.run(
        [sys.executable, "-c", _CYCLES, shared_cluster.address],
        capture_output=True, text=True, timeout=RAY_TIMEOUT_S * 3, env=os.environ,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rounds = [[1, 0, 0]] * 4 + [[1, 1, 1], [0]]
    assert json.loads(done.stdout.splitlines()[-1]) == rounds, done.stdout


def test_odd_views_reach_a_consumer_and_the_driver_whole(
    pool: tuple[Any, list[Any], int],
) -> None:
    producer, consumers, pid = pool
    ref = producer.carried.remote()
    assert ray.get(consumers[0].run.remote(odd_tensors.stripped, ref), timeout=60) == []
    assert odd_tensors.stripped(ray.get(ref, timeout=60)) == []
    del ref
    assert flat(pid, consumers) == ([], [0, 0, 0])


@pytest.mark.parametrize("kind", list(odd_tensors.REFUSED))
def test_a_tensor_the_transport_cannot_carry_whole_is_refused_at_the_put(kind: str) -> None:
    why = odd_tensors.REFUSED[kind]
    tensors = [torch.ones(2), odd_tensors.refused(kind)]
    with pytest.raises(TypeError, match=f"{SHM!r} cannot move tensor 1 of the object whole: {why}"):
        ray.put(tensors, _tensor_transport=SHM)
    assert segments(os.getpid()) == []
    assert not any(map(odd_tensors.rdt_holds_tensor, tensors))


def test_a_method_that_returns_one_fails_its_task_and_its_consumers(
    pool: tuple[Any, list[Any], int],
) -> None:
    producer, consumers, pid = pool
    ref = producer.odd.remote("quantized per channel")
    why = f"{SHM!r} cannot move tensor 1 of the object whole: it is quantized"
    with pytest.raises(ray.exceptions.RayTaskError, match=why):
        ray.get(ref, timeout=60)
    with pytest.raises(ray.exceptions.RayTaskError, match=why):
        ray.get(consumers[0].run.remote(len, ref), timeout=60)
    assert segments(pid) == []
    assert not ray.get(producer.run.remote(odd_tensors.rdt_holds, ref.hex()), timeout=60)


def test_a_producer_that_dies_is_an_error_in_every_consumer(
    pool: tuple[Any, list[Any], int],
) -> None:
    producer, consumers, pid = pool
    doomed = Producer.remote()
    ref = doomed.weights.remote(6, 10, 30.0)  # dies before it returns
    pending = [c.check.remote(ref, 6, 10) for c in consumers]
    time.sleep(0.5)
    ray.kill(doomed)
    for task in pending:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(task, timeout=30)
    ref = producer.weights.remote(7, 10)
    ray.wait([ref], timeout=RAY_TIMEOUT_S)
    assert len(segments(pid)) == 1
    ray.kill(producer)  # dies after it returned: its file is still there
    wait_dead(pid)
    for consumer in consumers:
        with pytest.raises(ray.exceptions.RayTaskError, match=rf"\(pid {pid}\) died"):
            ray.get(consumer.check.remote(ref, 7, 10), timeout=30)
    assert segments(pid) == []  # the first consumer that saw it dead removed the file
