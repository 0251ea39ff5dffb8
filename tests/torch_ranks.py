"""The ranks of ``test_torch_backend``: spawned processes that use the backend as torch code does.

Each function runs in every rank of a world that ``spawn_world`` starts with the spawn
method (as ``torch.multiprocessing.spawn`` does), calls ``init_process_group("collective")``
itself, runs many checks on one group and returns what each saw, for the test to
assert every rank's result.
"""

from __future__ import annotations

import os
import queue
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

JOIN_TIMEOUT_S = 240
"""The longest a spawned world may take, imports of torch under load included."""


def _rank_main(
    fn: Callable[..., Any], rank: int, world_size: int, args: tuple[Any, ...], out: Any
) -> None:
    try:
        out.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))


def spawn_world(
    fn: Callable[..., Any], world_size: int, *args: Any, expect: int | None = None
) -> dict[int, Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes; return results.

    ``expect`` is how many ranks report (fewer when a check ends a rank's process).
    Raises AssertionError with the rank's traceback when a rank raised.
    """
    context = mp.get_context("spawn")
    out = context.Queue()
    procs = [
        context.Process(target=_rank_main, args=(fn, rank, world_size, args, out), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size if expect is None else expect):
            rank, status, value = out.get(timeout=JOIN_TIMEOUT_S)
            if status != "ok":
                raise AssertionError(f"rank {rank} raised:\n{value}")
            results[rank] = value
    except queue.Empty:
        silent = sorted(set(range(world_size)) - set(results))
        raise AssertionError(f"ranks {silent} never reported") from None
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    return results


def init(rank: int, world_size: int, path: Path, seconds: float = 60, **kwargs: Any) -> None:
    """Join the default group "collective" through the file store at ``path``."""
    import torch.distributed as dist

    dist.init_process_group(
        "collective",
        init_method=f"file://{path}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=seconds),
        **kwargs,
    )


def our_segments() -> list[str]:
    """Return the shared-memory files of this library's groups made by this process."""
    from collective.groups.shm.arena import NAME_PREFIX, SHM_DIR

    mine = f"{NAME_PREFIX}{os.getpid()}-"
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(mine))


def mapped_arenas() -> list[str]:
    """Return the lines of this process's memory map that map an arena of this library."""
    from collective.groups.shm.arena import NAME_PREFIX, SHM_DIR

    with open("/proc/self/maps") as maps:
        return [line for line in maps if f"{SHM_DIR}/{NAME_PREFIX}" in line]


def ops(rank: int, world_size: int, path: Path) -> dict[str, Any]:
    """Run every op family of the backend once on one group, then the failure checks.

    Returns what this rank saw; rank 2 dies in the last failure check (see
    ``torch_rank_failures``).
    """
    import torch
    import torch.distributed as dist

    from tests.torch_rank_failures import failures

    warnings.simplefilter("ignore", FutureWarning)  # torch renames the *_tensor ops
    init(rank, world_size, path)
    seen: dict[str, Any] = {"backend": dist.get_backend(), "repr": repr(dist.group.WORLD)}
    ops_ = {
        "SUM": torch.float32,
        "PRODUCT": torch.float64,
        "MIN": torch.int32,
        "MAX": torch.bfloat16,
        "AVG": torch.float32,
        "BAND": torch.int64,
        "BOR": torch.uint8,
        "BXOR": torch.int8,
    }
    for name, dtype in ops_.items():
        t = torch.full((5,), rank + 2, dtype=dtype)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, name))
        seen[f"all_reduce_{name}"] = t.tolist()
    try:
        dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0))
    except ValueError as exc:
        seen["premul_sum"] = str(exc)
    t = torch.arange(4.0) if rank == 1 else torch.zeros(4)
    dist.broadcast(t, src=1)
    seen["broadcast"] = t.tolist()
    t = torch.full((3,), float(rank + 1))
    dist.reduce(t, dst=2, op=dist.ReduceOp.MAX)
    seen["reduce"] = t.tolist()
    outs = [torch.zeros(2, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(outs, torch.full((2,), rank))
    seen["all_gather"] = [o.tolist() for o in outs]
    flat = torch.zeros(world_size, 2)
    dist.all_gather_into_tensor(flat, torch.full((2,), float(rank)))
    seen["all_gather_into_tensor"] = flat.tolist()
    gathered = [torch.zeros(1) for _ in range(world_size)] if rank == 0 else None
    dist.gather(torch.full((1,), float(rank)), gathered, dst=0)
    seen["gather"] = [g.tolist() for g in gathered] if gathered else None
    t = torch.zeros(2)
    chunks = [torch.full((2,), float(10 + r)) for r in range(world_size)]
    dist.scatter(t, chunks if rank == 1 else None, src=1)
    seen["scatter"] = t.tolist()
    t = torch.zeros(2)
    dist.reduce_scatter(t, [torch.full((2,), float(r + rank)) for r in range(world_size)])
    seen["reduce_scatter"] = t.tolist()
    t = torch.zeros(2)
    dist.reduce_scatter_tensor(t, torch.arange(2.0 * world_size) * (rank + 1))
    seen["reduce_scatter_tensor"] = t.tolist()
    outs = [torch.zeros(r + 1) for r in range(world_size)]
    dist.all_to_all(outs, [torch.full((rank + 1,), 10.0 * rank + r) for r in range(world_size)])
    seen["all_to_all"] = [o.tolist() for o in outs]
    sizes_in = [r + 1 for r in range(world_size)]  # rank r gets r + 1 rows from everyone
    out = torch.zeros((rank + 1) * world_size)
    dist.all_to_all_single(
        out,
        torch.cat([torch.full((r + 1,), float(rank)) for r in range(world_size)]),
        output_split_sizes=[rank + 1] * world_size,
        input_split_sizes=sizes_in,
    )
    seen["all_to_all_single"] = out.tolist()
    coalesced = [torch.ones(2) * rank, torch.ones(3)]
    dist.all_reduce_coalesced(coalesced)
    seen["all_reduce_coalesced"] = [c.tolist() for c in coalesced]
    lists = [[torch.zeros(1), torch.zeros(2)] for _ in range(world_size)]
    dist.all_gather_coalesced(lists, [torch.full((1,), float(rank)), torch.full((2,), -rank * 1.0)])
    seen["all_gather_coalesced"] = [[t.tolist() for t in row] for row in lists]
    sparse = torch.sparse_coo_tensor(torch.tensor([[rank, 3]]), torch.tensor([1.0, rank]), (4,))
    dist.all_reduce(sparse)
    seen["sparse"] = sparse.to_dense().tolist()
    seen.update(_async(rank, world_size))
    seen.update(_forms(rank, world_size))
    seen.update(_p2p(rank, world_size))
    seen.update(_objects(rank, world_size))
    seen.update(_subgroups(rank, world_size))
    dist.barrier()
    dist.destroy_process_group()
    seen["mapped_after_destroy"] = mapped_arenas()
    seen["files_after_destroy"] = our_segments()
    init(rank, world_size, path.with_name(path.name + "-again"))
    t = torch.ones(2)
    dist.all_reduce(t)
    seen["reinit"] = t.tolist()
    dist.destroy_process_group()
    seen.update(_hosts(rank, world_size, path.with_name(path.name + "-hosts")))
    return failures(rank, world_size, path.with_name(path.name + "-failures"), seen)


def _async(rank: int, world_size: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    seen: dict[str, Any] = {}
    t = torch.full((4,), float(rank))
    work = dist.all_reduce(t, async_op=True)
    future = work.get_future()
    chained = future.then(lambda f: f.value()[0] * 2)
    seen["wait"] = work.wait(timeout=timedelta(seconds=60))
    seen["is_completed"] = work.is_completed()
    seen["exception"] = work.exception()
    seen["future"] = [v.tolist() for v in future.wait()]
    seen["chained"] = chained.wait().tolist()
    works = [
        dist.broadcast(torch.full((2,), float(rank)), src=i, async_op=True)
        for i in range(world_size)
    ]
    seen["many_async"] = all(w.wait() for w in works)
    import torch.distributed._functional_collectives as funcol

    world = dist.group.WORLD
    assert world is not None
    summed = funcol.all_reduce(torch.full((2,), float(rank)), "sum", world)
    seen["functional"] = funcol.wait_tensor(summed).tolist()
    return seen


def _hosts(rank: int, world_size: int, path: Path) -> dict[str, Any]:
    """Run ops on a group whose ranks 0 and 1 say they share a host and rank 2 is apart.

    Ranks meet in shared memory inside a host and over Gloo between hosts: the
    library's CPU group learns the hosts through the store, from each rank's node key.
    """
    import torch
    import torch.distributed as dist

    from collective.groups import topology

    real = topology.node_key
    topology.node_key = lambda: "host:a" if rank < 2 else "host:b"
    try:
        init(rank, world_size, path)
    finally:
        topology.node_key = real
    seen: dict[str, Any] = {"hosts_repr": repr(dist.group.WORLD)}
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    dist.broadcast(t if rank != 2 else t * 2, src=2)
    outs = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(outs, torch.full((1,), float(rank)))
    seen["hosts_collectives"] = (t.tolist(), [o.item() for o in outs])
    if rank == 0:
        got = [torch.zeros(1), torch.zeros(1)]
        sources = sorted((dist.recv(g), g.item()) for g in got)
        seen["hosts_any_source"] = sources
    else:
        dist.send(torch.full((1,), 100.0 + rank), 0)
    dist.destroy_process_group()
    return seen


def _forms(rank: int, world_size: int) -> dict[str, Any]:
    """Call the group's ops in torch's convenience forms, as hooks and programs do."""
    import torch
    import torch.distributed as dist

    pg: Any = dist.group.WORLD
    seen: dict[str, Any] = {}
    t = torch.full((2,), float(rank))
    pg.allreduce(t).wait()
    pg.allreduce([t], op=dist.ReduceOp.MAX).wait()
    seen["forms_allreduce"] = t.tolist()
    pg.broadcast(t, 2).wait()
    pg.reduce(t, 0, dist.ReduceOp.SUM).wait()
    seen["forms_rooted"] = t.tolist()
    outs = [torch.zeros(1) for _ in range(world_size)]
    pg.allgather(outs, torch.full((1,), float(rank))).wait()
    out = torch.zeros(1)
    pg.reduce_scatter(out, [torch.ones(1) for _ in range(world_size)], op=dist.ReduceOp.SUM).wait()
    pg.barrier(timeout=timedelta(seconds=60)).wait()
    seen["forms_lists"] = ([o.item() for o in outs], out.item())
    return seen


def _p2p(rank: int, world_size: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    seen: dict[str, Any] = {}
    peer_next, peer_prev = (rank + 1) % world_size, (rank - 1) % world_size
    # tags out of order: the receiver asks for tag 2 first
    if rank == 0:
        dist.send(torch.full((2,), 1.0), 1, tag=1)
        dist.send(torch.full((3,), 2.0), 1, tag=2)
    elif rank == 1:
        two, one = torch.zeros(3), torch.zeros(2)
        dist.recv(two, 0, tag=2)
        dist.recv(one, 0, tag=1)
        seen["tags"] = [two.tolist(), one.tolist()]
    # a ring of isend/irecv
    out = torch.zeros(2)
    reqs = [dist.isend(torch.full((2,), float(rank)), peer_next), dist.irecv(out, peer_prev)]
    for req in reqs:
        assert req is not None
        req.wait()
    seen["ring"] = out.tolist()
    ops = [
        dist.P2POp(dist.isend, torch.full((1,), float(rank)), peer_prev),
        dist.P2POp(dist.irecv, out[:1], peer_next),
    ]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    seen["batch"] = out[:1].tolist()
    # from any source: rank 0 receives one message from each other rank, in any order
    if rank == 0:
        sources = []
        for _ in range(world_size - 1):
            got = torch.zeros(1)
            sources.append((dist.recv(got), got.item()))
        seen["any_source"] = sorted(sources)
    else:
        dist.send(torch.full((1,), float(rank * 10)), 0)
    # a message that does not fit raises on the receiver, which stays usable
    if rank == 0:
        dist.send(torch.ones(3), 1)
        dist.send(torch.ones(2) * 7, 1)
    elif rank == 1:
        small = torch.zeros(2)
        try:
            dist.recv(small, 0)
        except ValueError as exc:
            seen["misfit"] = (str(exc), small.tolist())
        dist.recv(small, 0)
        seen["after_misfit"] = small.tolist()
    return seen


def _objects(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    seen: dict[str, Any] = {}
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, {"rank": rank})
    seen["all_gather_object"] = everyone
    gathered: list[Any] | None = [None] * world_size if rank == 2 else None
    dist.gather_object(("r", rank), gathered, dst=2)
    seen["gather_object"] = gathered
    sent = [f"from {rank}", rank] if rank == 0 else [None, None]
    dist.broadcast_object_list(sent, src=0)
    seen["broadcast_object_list"] = sent
    got: list[Any] = [None]
    lists = [[r] * r for r in range(world_size)]
    dist.scatter_object_list(got, lists if rank == 1 else None, src=1)
    seen["scatter_object_list"] = got
    return seen


def _subgroups(rank: int, world_size: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    seen: dict[str, Any] = {}
    pair = dist.new_group([0, 2])
    if rank in (0, 2):
        t = torch.full((2,), float(rank))
        dist.all_reduce(t, group=pair)
        seen["new_group"] = (dist.get_backend(pair), t.tolist(), pair.group_name)
        dist.destroy_process_group(pair)
    mine, _ = dist.new_subgroups_by_enumeration([[0, 1], [2]])
    t = torch.ones(1)
    dist.all_reduce(t, group=mine)
    seen["new_subgroups"] = t.tolist()
    try:
        dist.split_group(split_ranks=[[0, 1], [2]])
    except RuntimeError as exc:
        seen["split_group"] = str(exc)
    return seen
