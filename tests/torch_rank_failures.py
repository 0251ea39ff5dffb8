"""The failing ranks of ``test_torch_backend``: disagreeing calls, timeouts, a rank that dies.

Each check builds the default group anew on one file store (which also checks that a
group built again on the same store meets under a new incarnation), makes the ranks
fail as a user's program would, and records what each rank raised and what its
tensor holds after.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from tests.torch_ranks import mapped_arenas


def failures(rank: int, world_size: int, path: Path, seen: dict[str, Any]) -> dict[str, Any]:
    """Run the failure checks on groups of ``world_size`` ranks into ``seen``; return it.

    Rank 2 dies in the last check: it writes what it saw to ``path`` + ".rank2" first.
    """
    import torch
    import torch.distributed as dist

    store = dist.FileStore(str(path), world_size)

    def check(name: str, body: Callable[[], Any], seconds: float = 60) -> None:
        dist.init_process_group(
            "collective",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=seconds),
        )
        try:
            seen[name] = ("returned", body())
        except Exception as exc:  # every rank records what it raised
            seen[name] = (type(exc).__name__, str(exc), isinstance(exc, RuntimeError))
        finally:
            dist.destroy_process_group()

    sizes = torch.ones(4 if rank != 1 else 5)
    check("sizes", lambda: dist.all_reduce(sizes))
    seen["sizes_after"] = sizes.tolist()
    dtypes = torch.ones(4, dtype=torch.float64 if rank == 2 else torch.float32)
    check("dtypes", lambda: dist.all_reduce(dtypes))
    seen["dtypes_after"] = dtypes.tolist()
    reduced = torch.ones(3)
    op = dist.ReduceOp.MAX if rank == 0 else dist.ReduceOp.SUM
    check("ops", lambda: dist.all_reduce(reduced, op=op))
    seen["ops_after"] = reduced.tolist()
    rooted = torch.full((3,), float(rank))
    check("roots", lambda: dist.broadcast(rooted, src=0 if rank < 2 else 1))
    seen["roots_after"] = rooted.tolist()

    def skipped_barrier() -> Any:
        if rank != 2:
            started = time.monotonic()
            try:
                dist.barrier()
            finally:
                seen["waited"] = time.monotonic() - started
        return None

    check("timeout", skipped_barrier, seconds=3)
    seen["mapped_after_failures"] = mapped_arenas()

    def wait_timeout() -> Any:
        work = dist.all_reduce(torch.ones(2), async_op=True) if rank != 2 else None
        return work.wait(timeout=timedelta(seconds=2)) if work is not None else None

    check("wait_timeout", wait_timeout)

    def dies() -> Any:
        t = torch.ones(2)
        dist.all_reduce(t)
        if rank == 2:
            Path(f"{path}.rank2").write_text(json.dumps(seen))
            os._exit(0)
        time.sleep(0.5)
        dist.all_reduce(t)
        return t.tolist()

    check("dead", dies)
    return seen
