"""Every op of NCCLGroup on every dtype, blocking and async, at world sizes 1, 2 and 3.

World size 1 runs in this process on GPU 0; world sizes 2 and 3 run as rank
processes, rank r on GPU r, or sharing the GPUs where there are fewer, each rank then
claiming a host of its own for NCCL (world size 3 takes float32 only). Each rank's
buffers are read back without explicit synchronisation, so stream ordering is checked
too. No Ray: the ranks meet on a torch TCPStore.
"""

from __future__ import annotations

import pytest

from tests.gpu import cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bool(cases.no_gpu_reason()), reason=cases.no_gpu_reason() or "-"),
]


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize(("op", "kind", "dtype"), cases.op_cases())
@pytest.mark.parametrize("world_size", [1, 2, 3], ids=["ws1", "ws2", "ws3"])
def test_op(
    request: pytest.FixtureRequest, world_size: int, op: str, kind: str, dtype: str, async_op: bool
) -> None:
    if kind == "torch" and not cases.torch_cuda():
        pytest.skip("this torch build has no CUDA")
    if world_size == 3 and dtype != "float32":
        pytest.skip("world size 3 takes float32 only")
    if world_size == 1:
        group = request.getfixturevalue("solo")
        results = [cases.run_op(group, 0, op, kind, dtype, async_op)]
    else:
        pool = request.getfixturevalue("pair" if world_size == 2 else "trio")
        results = pool.run(cases.run_op_on_rank, op, kind, dtype, async_op)
    cases.check(op, dtype, results)


@pytest.mark.parametrize("kind", cases.KINDS)
def test_send_recv_between_two_gpus(request: pytest.FixtureRequest, kind: str) -> None:
    """Rank 0 sends to rank 1's GPU; rank 1 sends 8 elements back (gpu index = ordinal)."""
    if kind == "torch" and not cases.torch_cuda():
        pytest.skip("this torch build has no CUDA")
    pool = request.getfixturevalue("pair")
    first, second = pool.run(cases.send_recv_on_rank, kind)
    cases.close(second, cases.values(0), "float32", "rank 1 received rank 0's tensor")
    expected = cases.values(0).reshape(-1)
    expected[:8] = cases.values(1, offset=3).reshape(-1)[:8]
    cases.close(first.reshape(-1), expected, "float32", "rank 0 received 8 elements back")
