"""A script for ``torchrun --nproc_per_node 4`` on the ``"collective"`` backend.

``torchrun`` starts four processes and hands each its rank, the world size and the
address of its store in the environment; ``dist.init_process_group("collective")``
reads them (``env://``) and the ranks meet in shared memory through that store. Each
rank then runs the ops a training script uses (``all_reduce``, ``broadcast``,
``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_to_all_single``, ``send``
and ``recv`` round a ring, ``all_gather_object`` and ``barrier``) on inputs built from
its rank, checks each result and prints one line saying whether all were right.

Run without ``torchrun``, it starts itself under it, as
``python -m torch.distributed.run --standalone --nproc_per_node 4`` (``--standalone``
picks a free port), and checks that every rank printed its line.

Usage: torchrun --standalone --nproc_per_node 4 examples/torch_torchrun.py
       python examples/torch_torchrun.py
"""

import os
import signal
import subprocess
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import collective  # noqa: F401  (registers the "collective" backend with torch.distributed)

BACKEND = "collective"
NPROC = 4
RUN_TIMEOUT_S = 240


def check_ops(rank: int, size: int) -> dict[str, bool]:
    """Run each op on inputs built from ``rank``; return whether each result is right."""
    ok = {}
    x = torch.full((8,), rank + 1.0)
    dist.all_reduce(x)
    ok["all_reduce"] = torch.equal(x, torch.full((8,), size * (size + 1) / 2))

    x = torch.full((8,), float(rank))
    dist.broadcast(x, src=size - 1)
    ok["broadcast"] = torch.equal(x, torch.full((8,), size - 1.0))

    gathered = torch.empty(size * 2)
    dist.all_gather_into_tensor(gathered, torch.full((2,), float(rank)))
    ok["all_gather_into_tensor"] = torch.equal(
        gathered, torch.arange(size, dtype=torch.float32).repeat_interleave(2)
    )

    out = torch.empty(2)
    dist.reduce_scatter_tensor(out, torch.arange(size * 2, dtype=torch.float32) * (rank + 1))
    total = size * (size + 1) / 2
    ok["reduce_scatter_tensor"] = torch.equal(out, torch.tensor([2 * rank, 2 * rank + 1]) * total)

    out = torch.empty(size, dtype=torch.int64)
    dist.all_to_all_single(out, torch.arange(size) + 10 * rank)
    ok["all_to_all_single"] = torch.equal(out, torch.arange(size) * 10 + rank)

    received = torch.empty(3)
    right, left = (rank + 1) % size, (rank - 1) % size
    if rank % 2 == 0:
        dist.send(torch.full((3,), float(rank)), dst=right)
        dist.recv(received, src=left)
    else:
        dist.recv(received, src=left)
        dist.send(torch.full((3,), float(rank)), dst=right)
    ok["send/recv"] = torch.equal(received, torch.full((3,), float(left)))

    objects: list[object] = [None] * size
    dist.all_gather_object(objects, {"rank": rank})
    ok["all_gather_object"] = objects == [{"rank": r} for r in range(size)]

    dist.barrier()
    return ok


def rank_main() -> int:
    """One rank under ``torchrun``: join the group, check the ops, print one line."""
    dist.init_process_group(BACKEND, timeout=timedelta(seconds=60))
    rank, size = dist.get_rank(), dist.get_world_size()
    ok = check_ops(rank, size)
    wrong = [op for op, right in ok.items() if not right]
    # One write per line, so that the ranks' lines do not mix.
    sys.stdout.write(
        f"rank {rank} of {size} on {dist.get_backend()!r}, local rank "
        f"{os.environ['LOCAL_RANK']}: every op's result is right: {not wrong}"
        + (f" (wrong: {', '.join(wrong)})" if wrong else "")
        + "\n"
    )
    sys.stdout.flush()
    dist.destroy_process_group()
    return 0 if not wrong else 1


def main() -> int:
    """Run this script under ``torchrun``; check that every rank printed its line."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", str(NPROC), __file__]
    torchrun = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = torchrun.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(torchrun.pid, signal.SIGKILL)  # torchrun and the ranks it started
        torchrun.communicate()
        print(f"torchrun did not end within {RUN_TIMEOUT_S} s")
        return 1
    print(stdout, end="")
    if torchrun.returncode != 0:
        print(stderr[-4000:])
    lines = [
        f"rank {rank} of {NPROC} on {BACKEND!r}, local rank {rank}: "
        "every op's result is right: True"
        for rank in range(NPROC)
    ]
    ok = torchrun.returncode == 0 and all(line in stdout.splitlines() for line in lines)
    print(f"every rank ran every op right under torchrun: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(rank_main() if "TORCHELASTIC_RUN_ID" in os.environ else main())
