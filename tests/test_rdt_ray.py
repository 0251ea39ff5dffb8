"""Ray Direct Transport over this library: tensors a method returns reach other actors directly.

One Ray job on the local cluster for the module, started with
``collective.ray_plugins.runtime_env()`` so that every worker registers the backend
and the transport as it starts: the driver is the only code that changes. Each test
checks every receiver's tensors bit for bit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch
from ray.experimental.collective import (
    create_collective_group,
    destroy_collective_group,
    get_collective_groups,
)

import collective as col
from collective.ray_plugins import wire
from collective.ray_plugins.hook import runtime_env
from tests import odd_tensors
from tests.conftest import RAY_TIMEOUT_S, SharedCluster, live_groups

TRANSPORT = "COLLECTIVE"
col.register_tensor_transport(TRANSPORT)  # before the classes that name it, as Ray asks
SMALL = 300
"""Small tensors per state dict: they move packed, in one message."""

actor_class: Any = ray.remote
"""Ray's decorator; its stubs know neither ``enable_tensor_transport`` nor actor methods."""


def state_dict(seed: int) -> dict[str, torch.Tensor]:
    """Return a state dict of many small tensors of every kind, and big ones, from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    out = {f"layer{i}.w": torch.randn(8, 16 + i % 5, generator=g) for i in range(SMALL)}
    out["half"] = torch.randn(33, generator=g).half()
    out["bf16"] = torch.randn(7, 3, generator=g).bfloat16()
    out["steps"] = torch.arange(5, dtype=torch.int64) + seed
    out["mask"] = torch.rand(13, generator=g) > 0.5
    out["empty"] = torch.zeros(0, 4)
    out["big"] = torch.randn(512, 1024, generator=g)  # 2 MiB: a message of its own
    out["big_t"] = torch.randn(1024, 300, generator=g).t()  # not contiguous
    return out


class _Trainer:
    """Makes state dicts that stay in the actor until another actor's task takes them."""

    @ray.method(tensor_transport=TRANSPORT)
    def weights(self, seed: int) -> dict[str, torch.Tensor]:
        return state_dict(seed)

    @ray.method(tensor_transport=TRANSPORT)
    def odd(self, kind: str) -> list[Any]:
        return [torch.ones(2), odd_tensors.refused(kind)]

    @ray.method(tensor_transport=TRANSPORT)
    def carried(self) -> dict[str, Any]:
        return odd_tensors.carried()

    def run(self, fn: Any, *args: Any) -> Any:
        return fn(*args)

    def alive(self) -> bool:
        return True


Trainer: Any = actor_class(num_cpus=0)(_Trainer)


class _Rollout:
    """Receives state dicts and checks them against the ones it makes itself."""

    def check(self, weights: dict[str, torch.Tensor], seed: int) -> dict[str, Any]:
        want = state_dict(seed)
        wrong = [
            k
            for k, v in want.items()
            if weights[k].dtype != v.dtype or not torch.equal(weights[k], v)
        ]
        storages = {weights[f"layer{i}.w"].untyped_storage().data_ptr() for i in range(SMALL)}
        return {"wrong": wrong, "keys": sorted(weights) == sorted(want), "storages": len(storages)}

    def run(self, fn: Any, *args: Any) -> Any:
        return fn(*args)


Rollout: Any = actor_class(num_cpus=0, enable_tensor_transport=True)(_Rollout)


@pytest.fixture(scope="module")
def cluster(shared_cluster: SharedCluster) -> Iterator[None]:
    """Join the local cluster as a job whose workers register the plug-ins; register them here."""
    shared_cluster.connect(namespace="rdt", runtime_env=runtime_env())
    col.register_tensor_transport()
    yield
    shared_cluster.disconnect()  # settles RDT first


@pytest.fixture(scope="module")
def pool(cluster: None) -> tuple[Any, list[Any]]:
    """Return a trainer and three rollouts, shared by the tests; each makes its own group."""
    trainer, rollouts = Trainer.remote(), [Rollout.remote() for _ in range(3)]
    ray.get([trainer.alive.remote(), *(r.run.remote(len, ()) for r in rollouts)], timeout=60)
    return trainer, rollouts


def _group(actors: list[Any]) -> Any:
    return create_collective_group(actors, backend="collective")


def test_a_state_dict_reaches_three_actors_without_the_object_store(
    pool: tuple[Any, list[Any]],
) -> None:
    trainer, rollouts = pool
    handle = _group([trainer, *rollouts])
    for seed in (1, 2):
        ref = trainer.weights.remote(seed)
        checks = ray.get([r.check.remote(ref, seed) for r in rollouts], timeout=RAY_TIMEOUT_S)
        for rank, got in enumerate(checks, start=1):
            assert got == {"wrong": [], "keys": True, "storages": 1}, (rank, got)
    stored = ray.get(  # type: ignore[call-overload]
        trainer.weights.remote(3), _use_object_store=True, timeout=RAY_TIMEOUT_S
    )
    assert all(torch.equal(stored[k], v) for k, v in state_dict(3).items())
    destroy_collective_group(handle)
    assert live_groups() == []


def test_registering_again_anywhere_is_a_no_op(pool: tuple[Any, list[Any]]) -> None:
    col.register_tensor_transport()
    col.register_tensor_transport("collective")
    rollout = pool[1][0]
    assert ray.get(rollout.run.remote(col.register_tensor_transport), timeout=RAY_TIMEOUT_S) is None
    with pytest.raises(ValueError, match="one of Ray's own transports"):
        col.register_tensor_transport("gloo")
    with pytest.raises(TypeError, match="name must be a str"):
        col.register_tensor_transport(None)  # type: ignore[arg-type]


def test_a_pair_without_a_group_is_refused_at_the_call(pool: tuple[Any, list[Any]]) -> None:
    with pytest.raises(ValueError, match="create_collective_group"):
        pool[0].weights.remote(0)


def _recv_then_abort(group_name: str) -> tuple[str, float]:
    """Wait for tensors rank 0 never sends, abort after 0.5 s; return the error and its delay."""
    from ray.experimental.rdt.util import get_tensor_transport_manager

    from collective.ray_plugins.transport import CollectiveCommunicatorMetadata, ObjectMetadata

    manager = get_tensor_transport_manager(TRANSPORT)
    meta = ObjectMetadata([(torch.Size([4]), torch.float32)], "cpu", obj_id="never")
    comm = CollectiveCommunicatorMetadata(group_name, src_rank=0, dst_rank=1)
    outcome: list[str] = []

    def receive() -> None:
        try:
            manager.recv_multiple_tensors("never", meta, comm)
            outcome.append("received")
        except col.CollectiveError as exc:
            outcome.append(str(exc))

    thread = threading.Thread(target=receive)
    thread.start()
    time.sleep(0.5)
    start = time.monotonic()
    manager.abort_transport("never", comm)
    thread.join(timeout=10)
    return (outcome[0] if outcome else "still waiting"), time.monotonic() - start


def test_abort_ends_a_pending_receive_within_a_second(pool: tuple[Any, list[Any]]) -> None:
    trainer, rollouts = pool
    handle = _group([trainer, rollouts[0]])
    message, delay = ray.get(rollouts[0].run.remote(_recv_then_abort, handle.name), timeout=60)
    assert "Ray aborted the transfer of object never" in message
    assert delay < 1.0
    destroy_collective_group(handle)
    assert live_groups() == []


def test_a_receiver_that_dies_ends_the_transfer_and_the_producer_goes_on(
    pool: tuple[Any, list[Any]],
) -> None:
    trainer, rollouts = pool
    doomed = Rollout.remote()
    handle = _group([trainer, doomed])
    ref = trainer.weights.remote(5)
    ray.wait([ref], timeout=RAY_TIMEOUT_S)  # made: the next call starts its transfer at once
    ray.kill(doomed)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(doomed.check.remote(ref, 5), timeout=RAY_TIMEOUT_S)
    deadline = time.monotonic() + 10
    while get_collective_groups([trainer]) and time.monotonic() < deadline:
        time.sleep(0.2)
    if get_collective_groups([trainer]):
        # The kill came before Ray started the transfer, so Ray had nothing to abort
        # and keeps the group: the producer must still go on once it is destroyed.
        destroy_collective_group(handle)
    again = _group([trainer, rollouts[0]])
    assert ray.get(rollouts[0].check.remote(ref, 5), timeout=RAY_TIMEOUT_S)["wrong"] == []
    destroy_collective_group(again)
    assert handle.name not in live_groups()


def test_odd_views_reach_every_receiver_whole_as_plain_dense_tensors(
    pool: tuple[Any, list[Any]],
) -> None:
    """Conjugate and negative views among them: a big one moves alone, resolved."""
    trainer, rollouts = pool
    handle = _group([trainer, rollouts[0]])
    try:
        ref = trainer.carried.remote()
        assert ray.get(rollouts[0].run.remote(odd_tensors.stripped, ref), timeout=60) == []
    finally:
        destroy_collective_group(handle)


@pytest.mark.parametrize("kind", ["quantized per tensor", "sparse coo", "meta"])
def test_a_tensor_the_transport_cannot_carry_whole_fails_the_producers_task(
    pool: tuple[Any, list[Any]], kind: str
) -> None:
    trainer, rollouts = pool
    handle = _group([trainer, rollouts[0]])
    try:
        ref = trainer.odd.remote(kind)
        why = f"{TRANSPORT!r} cannot move tensor 1 of the object whole: "
        with pytest.raises(ray.exceptions.RayTaskError, match=why + odd_tensors.REFUSED[kind]):
            ray.get(rollouts[0].run.remote(len, ref), timeout=60)
        assert not ray.get(trainer.run.remote(odd_tensors.rdt_holds, ref.hex()), timeout=60)
    finally:
        destroy_collective_group(handle)


def test_layout_moves_every_tensor_once_aligned_and_bounded() -> None:
    metas = [((n,), torch.float32) for n in (3, 0, 300_000, 17, 1, 5_000_000, 2)]
    metas += [((wire.BUCKET_BYTES // 4 // 3,), torch.float32)] * 4
    messages = wire.layout(metas)
    moved = [m.direct for m in messages if m.direct is not None]
    moved += [i for m in messages for i, _ in m.packed]
    assert sorted(moved) == [i for i, m in enumerate(metas) if wire.nbytes_of(m) > 0]
    for m in messages:
        assert m.nbytes <= wire.BUCKET_BYTES or m.direct is not None
        assert all(offset % wire.ALIGN == 0 for _, offset in m.packed)
        if m.packed:
            last, offset = m.packed[-1]
            assert m.nbytes == offset + wire.nbytes_of(metas[last])
