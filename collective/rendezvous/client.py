"""How this process talks to the namespace's store actor: its handle, notices and calls.

One named detached ``StoreActor`` (``collective.rendezvous.actor``) per namespace hosts
every group. This process finds it once and keeps its handle (``connection``); the
first caller in a namespace creates it. Joining a group starts, once per process, a
thread that listens for the notices the store sends when a driver ends one of this
process's groups, and hands each to the handler that ``set_end_handler`` installed.
``RayRendezvousStore`` is a group's view of the store.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from collective.rendezvous import liveness
from collective.rendezvous.actor import STORE_ACTOR_NAME, StoreActor
from collective.rendezvous.store import RendezvousStore
from collective.types import CollectiveError

RPC_GRACE_S = 5.0
"""Extra seconds a client waits for a store actor's reply beyond the wait it asked for."""

_NOTICE_WAIT_S = 60.0
"""How long one call of the notice listener waits in the store before it is issued again."""

EndHandler = Callable[[str, str, str], None]
"""Called with (group, incarnation, reason) when a driver ends a group this process joined."""


class _Connection:
    """Hold this process's handle on the namespace's store actor, and its notice listener."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handle: Any = None
        self._listening: Any = None
        self.on_end: EndHandler = lambda group, incarnation, reason: None

    def find(self) -> Any:
        """Return the store actor's handle, or None when the namespace has none."""
        import ray

        with self._lock:
            if self._handle is None:
                try:
                    self._handle = ray.get_actor(STORE_ACTOR_NAME)
                except ValueError:
                    return None
            return self._handle

    def get_or_create(self) -> Any:
        """Return the store actor's handle, creating the actor if the namespace has none.

        A new actor is pinned to the node of this job's driver (see ``home_node``).
        """
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        with self._lock:
            if self._handle is None:
                self._handle = (
                    ray.remote(StoreActor)
                    .options(
                        name=STORE_ACTOR_NAME,
                        lifetime="detached",
                        get_if_exists=True,
                        num_cpus=0,
                        max_restarts=0,
                        max_concurrency=10_000,
                        scheduling_strategy=NodeAffinitySchedulingStrategy(home_node(), soft=False),
                    )
                    .remote()
                )
            return self._handle

    def forget(self, handle: Any) -> None:
        """Drop ``handle`` after it failed, so that the next call looks the actor up again."""
        with self._lock:
            if self._handle is handle:
                self._handle = None

    def listen(self, handle: Any) -> None:
        """Make sure a thread listens for this process's notices on ``handle``."""
        with self._lock:
            if self._listening is handle:
                return
            self._listening = handle
        thread = threading.Thread(
            target=self._listen, args=(handle,), name="collective-notices", daemon=True
        )
        thread.start()

    def _listen(self, handle: Any) -> None:
        import ray

        worker_id = ray.get_runtime_context().get_worker_id()
        acked = 0
        while True:
            try:
                ref = handle.notices.remote(worker_id, acked, _NOTICE_WAIT_S)
                notices = _result(ref, _NOTICE_WAIT_S + RPC_GRACE_S)
            except TimeoutError:
                continue
            except Exception:
                break  # the store actor exited, or Ray shut down in this process
            for seq, group, incarnation, reason in notices:
                self.on_end(group, incarnation, reason)
                acked = max(acked, seq)
        with self._lock:
            if self._listening is handle:
                self._listening = None


connection = _Connection()
"""This process's link to the namespace's store actor."""


def home_node() -> str:
    """Return the node a new store actor is pinned to: the one of this job's driver.

    The driver's node outlives the job's actors on other nodes, which may go away
    while their groups' survivors still need the store. Inside an actor or task whose
    driver Ray cannot name, it is the caller's own node.
    """
    import ray

    context = ray.get_runtime_context()
    if context.worker.mode != ray.WORKER_MODE:
        return context.get_node_id()
    return liveness.driver_node(context.get_job_id()) or context.get_node_id()


def store_gone(group: str, exc: BaseException) -> CollectiveError:
    """Return the error that says the store actor hosting ``group``'s rendezvous is gone."""
    return CollectiveError(
        f"the rendezvous store of group {group!r} is gone (its store actor "
        f"{STORE_ACTOR_NAME!r} died: {type(exc).__name__}): the group can no longer "
        "meet, shrink or grow, and its members no longer hear of each other's failures; "
        "destroy the group on every member and create it again, which starts a new store "
        f"actor. Ray said: {exc}"
    )


def set_end_handler(handler: EndHandler) -> None:
    """Install what runs when a driver ends a group this process joined."""
    connection.on_end = handler


def _result(ref: Any, timeout_s: float) -> Any:
    """Return the value of the object ``ref`` once it is ready; raise its error if it failed.

    Not ``ray.get``: Ray 2.60's ``ray.get`` from a thread other than the one running
    the actor's task races with that task's end on the worker's task metrics, and we
    measured the worker crash (SIGSEGV in ``TaskCounter::UnsetMetricStatus``) while
    the notices listener and the failure watches wait in threads of their own. A
    future is completed by a callback instead, outside that path.

    Raises:
        TimeoutError: the object was not ready within ``timeout_s``.

    """
    return ref.future().result(timeout=timeout_s)


def call(handle: Any, method: str, *args: Any, group: str, timeout_s: float = RPC_GRACE_S) -> Any:
    """Call ``method`` on the store actor and return its result.

    Raises:
        TimeoutError: no reply within ``timeout_s``.
        CollectiveError: the store actor is gone (died, was killed, ran out of memory,
            or its node went away); says so and what to do.

    """
    from ray.exceptions import RayError, RayTaskError

    try:
        ref = getattr(handle, method).remote(*args)
    except Exception as exc:  # Ray refuses to submit to an actor it knows is gone.
        connection.forget(handle)
        raise store_gone(group, exc) from exc
    try:
        return _result(ref, timeout_s)
    except TimeoutError as exc:
        raise TimeoutError(f"the store actor gave no reply to {method} in {timeout_s}s") from exc
    except RayTaskError:
        raise  # a defect in the store actor's method, not its loss
    except RayError as exc:
        connection.forget(handle)
        raise store_gone(group, exc) from exc


class RayRendezvousStore(RendezvousStore):
    """A ``RendezvousStore`` on one incarnation of a group in the shared store actor.

    Once that incarnation is over (its members left, or the driver destroyed
    it), every call raises ``CollectiveError`` saying why.
    """

    def __init__(self, handle: Any, group_name: str, incarnation: str) -> None:
        """Talk to ``group_name``'s ``incarnation`` in the store actor ``handle``."""
        self._handle = handle
        self._group_name = group_name
        self._incarnation = incarnation

    @property
    def handle(self) -> Any:
        """Return the store actor's handle."""
        return self._handle

    @property
    def group_name(self) -> str:
        """Return the group's name."""
        return self._group_name

    @property
    def incarnation(self) -> str:
        """Return the id of the incarnation this store's keys belong to."""
        return self._incarnation

    def call(self, method: str, *args: Any, timeout_s: float = RPC_GRACE_S) -> Any:
        """Call ``method`` of the store actor with this group and incarnation first."""
        args = (self._group_name, self._incarnation, *args)
        return call(self._handle, method, *args, group=self._group_name, timeout_s=timeout_s)

    def _gone(self, reason: str) -> CollectiveError:
        return CollectiveError(f"the rendezvous of group {self._group_name!r} is over: {reason}")

    def set(self, key: str, value: bytes) -> None:
        """Publish ``value`` under ``key``."""
        gone = self.call("set", key, value)
        if gone is not None:
            raise self._gone(gone)

    def get(self, key: str, timeout: timedelta) -> bytes:
        """Return the value of ``key``, waiting up to ``timeout`` for it."""
        seconds = timeout.total_seconds()
        status, value = self.call("get", key, seconds, timeout_s=seconds + RPC_GRACE_S)
        if status == "timeout":
            raise TimeoutError(f"key {key!r} was not set within {timeout}")
        if status == "gone":
            raise self._gone(value)
        return value

    def delete(self, key: str) -> None:
        """Remove ``key`` if it is present."""
        self.call("delete", key)
