"""Ask Ray's GCS which of a group's members are dead, from inside the store actor.

A member is the actor that joined (its actor id), or, for a Ray task, its job:
a task's process cannot be looked up by itself, and it ends with its job at the
latest. The queries go to the GCS client of the calling worker, asynchronously,
so the store actor's event loop never blocks on them. Ray exposes no public API
for this without the dashboard, so this module is the one place that touches
Ray's private GCS client; if a query fails, the member counts as alive and the
next sweep asks again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

_QUERY_TIMEOUT_S = 5.0
"""The longest one GCS query may take."""


@dataclass(frozen=True)
class Member:
    """Who holds a rank: its actor id (None for a task), worker id and job id, in hex."""

    actor_id: str | None
    worker_id: str
    job_id: str

    @property
    def key(self) -> str:
        """Return what tells this member from others: its actor id, else its worker id."""
        return self.actor_id or self.worker_id


def current_member() -> Member:
    """Return the calling Ray worker or driver as a ``Member``."""
    import ray

    context = ray.get_runtime_context()
    return Member(context.get_actor_id(), context.get_worker_id(), context.get_job_id())


def _gcs() -> Any:
    """Return this worker's asynchronous GCS client (Ray-private)."""
    import ray

    worker: Any = ray._private.worker.global_worker
    return worker.gcs_client


def _dead_state() -> int:
    """Return the GCS actor table's DEAD state (Ray-private)."""
    from ray.core.generated import gcs_pb2

    table: Any = gcs_pb2
    return int(table.ActorTableData.DEAD)


async def _actor_dead(actor_id: str) -> bool:
    from ray._raylet import ActorID

    infos = await _gcs().async_get_all_actor_info(
        actor_id=ActorID.from_hex(actor_id), timeout=_QUERY_TIMEOUT_S
    )
    if not infos:
        return True
    return all(info.state == _dead_state() for info in infos.values())


async def _job_dead(job_id: str) -> bool:
    jobs = await _gcs().async_get_all_job_info(
        job_or_submission_id=job_id,
        skip_submission_job_info_field=True,
        skip_is_running_tasks_field=True,
        timeout=_QUERY_TIMEOUT_S,
    )
    return bool(jobs) and all(job.is_dead for job in jobs.values())


def driver_node(job_id: str) -> str | None:
    """Return the node id (hex) of the live driver of ``job_id``, or None if Ray does not say.

    A blocking query, for a process outside the store actor.
    """
    try:
        jobs = _gcs().get_all_job_info(
            job_or_submission_id=job_id,
            skip_submission_job_info_field=True,
            skip_is_running_tasks_field=True,
            timeout=_QUERY_TIMEOUT_S,
        )
    except Exception:
        return None
    nodes = [job.driver_address.node_id for job in jobs.values() if not job.is_dead]
    return nodes[0].hex() if nodes and nodes[0] else None


async def dead_actors(actor_ids: Iterable[str]) -> set[str]:
    """Return those of ``actor_ids`` that Ray reports dead or no longer knows."""
    ids = sorted(set(actor_ids))
    found = await asyncio.gather(*(_actor_dead(i) for i in ids), return_exceptions=True)
    return {i for i, dead in zip(ids, found, strict=True) if dead is True}


async def dead_jobs(job_ids: Iterable[str]) -> set[str]:
    """Return those of ``job_ids`` whose driver Ray reports finished or dead."""
    ids = sorted(set(job_ids))
    found = await asyncio.gather(*(_job_dead(i) for i in ids), return_exceptions=True)
    return {i for i, dead in zip(ids, found, strict=True) if dead is True}


async def dead_members(members: Iterable[Member]) -> set[str]:
    """Return the keys of ``members`` that are dead: dead actors, or tasks of dead jobs."""
    members = list(members)
    actors = await dead_actors(m.actor_id for m in members if m.actor_id)
    jobs = await dead_jobs(m.job_id for m in members if not m.actor_id)
    return {m.key for m in members if (m.actor_id in actors if m.actor_id else m.job_id in jobs)}
