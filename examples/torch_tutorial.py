"""PyTorch's tutorial "Writing Distributed Applications with PyTorch", on ``"collective"``.

The tutorial's programs, as it writes them: two processes started with
``torch.multiprocessing``, each calling ``dist.init_process_group(backend, rank=rank,
world_size=size)`` with ``MASTER_ADDR`` and ``MASTER_PORT`` set, then point-to-point
``send``/``recv`` and ``isend``/``irecv``, ``all_reduce`` on a ``new_group``, the other
collectives the tutorial lists (``broadcast``, ``reduce``, ``scatter``, ``gather``,
``all_gather``, ``barrier``) and its own ring allreduce built from ``isend`` and
``recv``. Two things differ from the tutorial: the backend is ``"collective"``, not
``"gloo"`` (``import collective`` registers it), and the port is a free one, not 29500,
so that two runs on one machine do not collide.

Each program prints ``Rank r has data x`` on every rank, as in the tutorial. This file
is two programs: with ``--tutorial`` it is the tutorial's; without, it runs itself with
``--tutorial``, shows what the ranks printed, and checks every rank's lines against
what the tutorial says each rank holds.

Usage: python examples/torch_tutorial.py [--backend gloo]
"""

import os
import signal
import socket
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import collective  # noqa: F401  (registers the "collective" backend with torch.distributed)

BACKEND = "collective"
RUN_TIMEOUT_S = 180


def point_to_point(rank, size):
    """Blocking point-to-point communication."""
    tensor = torch.zeros(1)
    if rank == 0:
        tensor += 1
        # Send the tensor to process 1
        dist.send(tensor=tensor, dst=1)
    else:
        # Receive tensor from process 0
        dist.recv(tensor=tensor, src=0)
    print("Rank ", rank, " has data ", tensor[0])


def immediate_point_to_point(rank, size):
    """Non-blocking point-to-point communication."""
    tensor = torch.zeros(1)
    req = None
    if rank == 0:
        tensor += 1
        # Send the tensor to process 1
        req = dist.isend(tensor=tensor, dst=1)
        print("Rank 0 started sending")
    else:
        # Receive tensor from process 0
        req = dist.irecv(tensor=tensor, src=0)
        print("Rank 1 started receiving")
    req.wait()
    print("Rank ", rank, " has data ", tensor[0])


def all_reduce(rank, size):
    """All-Reduce example."""
    group = dist.new_group([0, 1])
    tensor = torch.ones(1)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    print("Rank ", rank, " has data ", tensor[0])


def broadcast(rank, size):
    """Copy ``tensor`` from ``src`` to all other processes."""
    group = dist.new_group(list(range(size)))
    tensor = torch.tensor([rank + 1.0])
    dist.broadcast(tensor, src=0, group=group)
    print("Rank ", rank, " has data ", tensor[0])


def reduce(rank, size):
    """Apply ``op`` to every ``tensor``; only ``dst`` holds the result."""
    group = dist.new_group(list(range(size)))
    tensor = torch.ones(1)
    dist.reduce(tensor, dst=0, op=dist.ReduceOp.SUM, group=group)
    if rank == 0:
        print("Rank ", rank, " has data ", tensor[0])


def scatter(rank, size):
    """Copy the i-th tensor of ``scatter_list`` to the i-th process."""
    group = dist.new_group(list(range(size)))
    tensor = torch.empty(1)
    if rank == 0:
        scatter_list = [torch.tensor([10.0 * (i + 1)]) for i in range(size)]
        dist.scatter(tensor, scatter_list=scatter_list, src=0, group=group)
    else:
        dist.scatter(tensor, src=0, group=group)
    print("Rank ", rank, " has data ", tensor[0])


def gather(rank, size):
    """Copy ``tensor`` from all processes to ``dst``."""
    group = dist.new_group(list(range(size)))
    tensor = torch.tensor([rank + 1.0])
    if rank == 0:
        gather_list = [torch.empty(1) for _ in range(size)]
        dist.gather(tensor, gather_list=gather_list, dst=0, group=group)
        print("Rank ", rank, " has data ", [t[0].item() for t in gather_list])
    else:
        dist.gather(tensor, dst=0, group=group)


def all_gather(rank, size):
    """Copy ``tensor`` from all processes to ``tensor_list``, on all processes."""
    group = dist.new_group(list(range(size)))
    tensor = torch.tensor([rank + 1.0])
    tensor_list = [torch.empty(1) for _ in range(size)]
    dist.all_gather(tensor_list, tensor, group=group)
    print("Rank ", rank, " has data ", [t[0].item() for t in tensor_list])


def allreduce(send, recv):
    """Implementation of a ring-reduce with addition."""  # noqa: D401 (the tutorial's words)
    rank = dist.get_rank()
    size = dist.get_world_size()
    send_buff = send.clone()
    recv_buff = send.clone()
    accum = send.clone()

    left = ((rank - 1) + size) % size
    right = (rank + 1) % size

    for i in range(size - 1):
        if i % 2 == 0:
            # Send send_buff
            send_req = dist.isend(send_buff, right)
            dist.recv(recv_buff, left)
            accum[:] += recv_buff[:]
        else:
            # Send recv_buff
            send_req = dist.isend(recv_buff, right)
            dist.recv(send_buff, left)
            accum[:] += send_buff[:]
        send_req.wait()
    recv[:] = accum[:]


def ring_allreduce(rank, size):
    """Run the tutorial's own ring allreduce on a tensor holding rank + 1."""
    recv = torch.zeros(4)
    allreduce(torch.full((4,), rank + 1.0), recv)
    print("Rank ", rank, " has data ", recv[0])


PROGRAMS = [
    point_to_point,
    immediate_point_to_point,
    all_reduce,
    broadcast,
    reduce,
    scatter,
    gather,
    all_gather,
    ring_allreduce,
]


def run(rank, size):
    """Run the tutorial's programs one after another, then meet at a barrier."""
    for program in PROGRAMS:
        program(rank, size)
    dist.barrier()
    dist.destroy_process_group()


def init_process(rank, size, fn, backend=BACKEND):
    """Initialize the distributed environment."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group(backend, rank=rank, world_size=size)
    fn(rank, size)


def tutorial(backend):
    """Start two processes and wait for them: the tutorial's ``__main__``."""
    size = 2
    processes = []
    mp.set_start_method("spawn")
    for rank in range(size):
        p = mp.Process(target=init_process, args=(rank, size, run, backend))
        p.start()
        processes.append(p)

    for p in processes:
        p.join()
    sys.exit(max(p.exitcode for p in processes))


EXPECTED = {
    0: [
        "has data tensor(1.)",
        "started sending",
        "has data tensor(1.)",
        "has data tensor(2.)",
        "has data tensor(1.)",
        "has data tensor(2.)",
        "has data tensor(10.)",
        "has data [1.0, 2.0]",
        "has data [1.0, 2.0]",
        "has data tensor(3.)",
    ],
    1: [
        "has data tensor(1.)",
        "started receiving",
        "has data tensor(1.)",
        "has data tensor(2.)",
        "has data tensor(1.)",
        "has data tensor(20.)",
        "has data [1.0, 2.0]",
        "has data tensor(3.)",
    ],
}
"""What each rank prints, in order: every program's line, as the tutorial says."""


def lines_by_rank(output):
    """Return each rank's ``Rank r ...`` lines, in the order it printed them."""
    lines = {}
    for line in output.splitlines():
        words = line.split()
        if len(words) > 1 and words[0] == "Rank" and words[1].isdigit():
            lines.setdefault(int(words[1]), []).append(" ".join(words[2:]))
    return lines


def free_port():
    """Return a TCP port that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(backend):
    """Run the tutorial in a child process; check what every rank printed."""
    # Buffered output: each rank's lines come out whole, at its exit, not mixed with the
    # other rank's.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env["MASTER_PORT"] = str(free_port())
    command = [sys.executable, __file__, "--tutorial", "--backend", backend]
    child = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        output, _ = child.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # the tutorial's processes too
        output, _ = child.communicate()
        print(output)
        sys.exit(f"the tutorial did not end within {RUN_TIMEOUT_S} s")
    print(output, end="")
    printed = lines_by_rank(output)
    ok = child.returncode == 0
    for rank, expected in EXPECTED.items():
        right = printed.get(rank) == expected
        print(f"rank {rank} printed what the tutorial says it holds: {right}")
        ok = ok and right
    print(f"the tutorial's programs ran on {backend!r}: {ok}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    chosen = sys.argv[sys.argv.index("--backend") + 1] if "--backend" in sys.argv else BACKEND
    if "--tutorial" in sys.argv:
        tutorial(chosen)
    else:
        main(chosen)
