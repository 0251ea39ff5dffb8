"""What a rank does to capture the public ops in one CUDA graph and replay it.

Each rank process registers its NCCLGroup under its name, so the public functions
(``collective.allreduce(x, name)`` ...) reach it as they reach a group in an actor.
``capture_public_ops_on_rank`` runs every op once outside capture (communicators,
launches and checks are built then), captures them all in one ``torch.cuda.graph``,
then replays the graph on new inputs and returns what each op's output held after
each replay; ``expected`` says what that must be. Importable without torch's CUDA.
"""

from __future__ import annotations

import time

import numpy as np

from benchmarks.nccl_ranks import RankContext
from tests.gpu import cases

N = 4
"""Elements of every input."""

OPS = ("allreduce", "broadcast", "reduce", "allgather", "reducescatter", "send/recv", "tensors")
"""The outputs a replay reports, in order; send/recv only at world size 2 or more."""


def _inputs(rank: int, ws: int, k: int) -> dict[str, np.ndarray]:
    """Return what each op's buffers hold before replay ``k`` on ``rank``."""
    full = np.full
    return {
        "allreduce": full(N, rank + 1.0 + k),
        "broadcast": full(N, 10.0 * (rank + 1) + k),
        "reduce": full(N, rank + 1.0 + k),
        "allgather": full(N, 100.0 * rank + k),
        "reducescatter": np.concatenate([full(N, (rank + 1.0) * (j + 1) + k) for j in range(ws)]),
        "send/recv": full(N, 7.0 + k if rank == 0 else -1.0),
        "tensors_p": full(N, rank + 1.0 + k),
        "tensors_q": full(N + 2, 2.0 * (rank + 1) + k),
    }


def expected(rank: int, ws: int, k: int) -> list[list[float]]:
    """Return what ``capture_public_ops_on_rank`` must report for replay ``k`` on ``rank``."""
    ranks = range(ws)
    mine = _inputs(rank, ws, k)
    out = [
        [float(sum(r + 1 + k for r in ranks))] * N,
        [10.0 + k] * N,
        [float(sum(r + 1 + k for r in ranks))] * N if rank == 0 else mine["reduce"].tolist(),
        [float(100 * r + k) for r in ranks for _ in range(N)],
        [float(sum((r + 1) * (rank + 1) + k for r in ranks))] * N,
    ]
    if ws > 1:
        out.append([7.0 + k] * N)
    p = [float(sum(r + 1 + k for r in ranks))] * N
    q = [float(sum(2 * (r + 1) + k for r in ranks))] * (N + 2)
    out.append(p + q)
    return out


def capture_public_ops_on_rank(context: RankContext, replays: int) -> list[list[list[float]]]:
    """Capture allreduce, broadcast, reduce, allgather, reducescatter, send/recv and
    ``allreduce_tensors`` on torch CUDA tensors in one graph; replay it ``replays`` times.

    Returns, per replay, each op's output after the replay, in ``OPS``'s order.
    """
    import torch

    import collective as col
    from collective.registry import held

    group, rank, ws = cases._GROUPS[0], context.rank, context.world_size
    name = group.group_name
    held.create_group(name, lambda: (group, context.store))
    device = torch.device("cuda", cases.gpu_of(rank))
    bufs = {key: torch.zeros(len(v), device=device) for key, v in _inputs(rank, ws, 0).items()}
    gathered = torch.zeros(N * ws, device=device)
    scattered = torch.zeros(N, device=device)
    chunks = list(bufs["reducescatter"].split(N))

    def fill(k: int) -> None:
        for key, values in _inputs(rank, ws, k).items():
            bufs[key].copy_(torch.from_numpy(values).to(torch.float32))

    def ops() -> None:
        col.allreduce(bufs["allreduce"], name)
        col.broadcast(bufs["broadcast"], 0, name)
        col.reduce(bufs["reduce"], 0, name)
        col.allgather(gathered, bufs["allgather"], name)
        col.reducescatter(scattered, chunks, name)
        if ws > 1 and rank == 0:
            col.send(bufs["send/recv"], 1, name)
        elif ws > 1 and rank == 1:
            col.recv(bufs["send/recv"], 0, name)
        col.allreduce_tensors([bufs["tensors_p"], bufs["tensors_q"]], name)

    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm up: communicators, launches, signature checks
        for k in range(3):
            fill(k)
            ops()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    time.sleep(0.1)  # the watchdog sees the warm-up finish: it queries nothing during capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops()
    seen = []
    for k in range(replays):
        fill(k)
        graph.replay()
        outs = [bufs["allreduce"], bufs["broadcast"], bufs["reduce"], gathered, scattered]
        if ws > 1:
            outs.append(bufs["send/recv"])
        outs.append(torch.cat([bufs["tensors_p"], bufs["tensors_q"]]))
        seen.append([o.cpu().tolist() for o in outs])
    torch.cuda.synchronize(device)
    return seen


def capture_unseen_bulk_call_on_rank(context: RankContext) -> tuple[str, str]:
    """Capture an ``allreduce_tensors`` whose tensors the ranks never agreed on.

    Returns the error's type name and message ("", "" if it did not raise).
    """
    import torch

    import collective as col
    from collective.registry import held

    group = cases._GROUPS[0]
    name = group.group_name
    held.create_group(name, lambda: (group, context.store))
    device = torch.device("cuda", cases.gpu_of(context.rank))
    xs = [torch.ones(3, device=device), torch.ones(5, device=device)]
    col.allreduce(xs[0], name)  # warm up the communicator outside capture
    torch.cuda.synchronize(device)
    time.sleep(0.1)
    graph = torch.cuda.CUDAGraph()
    found = ("", "")
    try:
        with torch.cuda.graph(graph):
            try:
                col.allreduce_tensors(xs, name)
            except Exception as exc:  # the test asserts which
                found = (type(exc).__name__, str(exc))
    except Exception as exc:  # ending a capture that raised may fail too
        found = found if found[0] else (type(exc).__name__, str(exc))
    return found
