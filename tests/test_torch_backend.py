"""torch.distributed's backend "collective" in real spawned processes, as torch programs use it.

Each test starts one world of spawned processes that calls ``init_process_group(
"collective")`` itself and runs many checks on it (spawned processes import torch,
which costs seconds each); the ranks live in ``tests.torch_ranks`` and
``tests.torch_rank_failures``. Every rank's result is asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import torch_suite
from tests.torch_ranks import ops, spawn_world

ROOT = Path(__file__).resolve().parent.parent
WORLD = 3


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """Run every op family, then the failure checks, in one world of three ranks.

    Returns what each rank saw, as JSON reads it (tuples are lists): rank 2, which
    dies in the last check, wrote its part to a file.
    """
    path = tmp_path_factory.mktemp("ops") / "store"
    found = spawn_world(ops, WORLD, path, expect=WORLD - 1)
    seen = {rank: json.loads(json.dumps(found[rank])) for rank in found}
    seen[2] = json.loads(Path(f"{path}-failures.rank2").read_text())
    return seen


def test_the_group_is_the_backend_over_shared_memory(seen: dict[int, dict[str, Any]]) -> None:
    for rank in range(WORLD):
        assert seen[rank]["backend"] == "collective"
        assert "transport='shm'" in seen[rank]["repr"], seen[rank]["repr"]


def test_all_reduce_takes_every_reduction_gloo_has_and_avg(
    seen: dict[int, dict[str, Any]],
) -> None:
    # each rank contributes rank + 2: 2, 3, 4
    expected = {"SUM": 9, "PRODUCT": 24, "MIN": 2, "MAX": 4, "AVG": 3, "BAND": 0, "BOR": 7}
    expected["BXOR"] = 2 ^ 3 ^ 4
    for rank in range(WORLD):
        for name, value in expected.items():
            assert seen[rank][f"all_reduce_{name}"] == [value] * 5, (rank, name)
        assert "PREMUL_SUM" in seen[rank]["premul_sum"]


def test_rooted_ops_write_where_torch_says(seen: dict[int, dict[str, Any]]) -> None:
    for rank in range(WORLD):
        assert seen[rank]["broadcast"] == [0.0, 1.0, 2.0, 3.0]
        assert seen[rank]["reduce"] == ([3.0] * 3 if rank == 2 else [rank + 1.0] * 3)
        assert seen[rank]["gather"] == ([[0.0], [1.0], [2.0]] if rank == 0 else None)
        assert seen[rank]["scatter"] == [10.0 + rank] * 2


def test_gathers_scatters_and_all_to_alls(seen: dict[int, dict[str, Any]]) -> None:
    for rank in range(WORLD):
        got = seen[rank]
        assert got["all_gather"] == [[r, r] for r in range(WORLD)]
        assert got["all_gather_into_tensor"] == [[float(r)] * 2 for r in range(WORLD)]
        assert got["reduce_scatter"] == [3.0 * rank + 3] * 2
        assert got["reduce_scatter_tensor"] == [12.0 * rank, 12.0 * rank + 6]
        assert got["all_to_all"] == [[10.0 * k + rank] * (k + 1) for k in range(WORLD)]
        assert got["all_to_all_single"] == [float(k) for k in range(WORLD) for _ in range(rank + 1)]
        assert got["all_reduce_coalesced"] == [[3.0, 3.0], [3.0, 3.0, 3.0]]
        assert got["all_gather_coalesced"] == [[[float(j)], [-float(j)] * 2] for j in range(WORLD)]
        assert got["sparse"] == [1.0, 1.0, 1.0, 3.0]  # each rank's 1 at its rank, 0+1+2 at 3


def test_async_work_waits_polls_and_completes_its_future(seen: dict[int, dict[str, Any]]) -> None:
    for rank in range(WORLD):
        got = seen[rank]
        assert (got["wait"], got["is_completed"], got["exception"]) == (True, True, None)
        assert got["future"] == [[3.0] * 4]
        assert got["chained"] == [6.0] * 4
        assert got["many_async"] is True
        assert got["functional"] == [3.0, 3.0]


def test_the_convenience_forms_of_the_groups_ops(seen: dict[int, dict[str, Any]]) -> None:
    for rank in range(WORLD):
        got = seen[rank]
        assert got["forms_allreduce"] == [3.0, 3.0]  # 0 + 1 + 2, then the max of threes
        assert got["forms_rooted"] == ([9.0, 9.0] if rank == 0 else [3.0, 3.0])
        assert got["forms_lists"] == [[0.0, 1.0, 2.0], 3.0]


def test_send_recv_match_tags_sources_and_refuse_a_message_that_does_not_fit(
    seen: dict[int, dict[str, Any]],
) -> None:
    assert seen[1]["tags"] == [[2.0] * 3, [1.0] * 2]
    for rank in range(WORLD):
        assert seen[rank]["ring"] == [float((rank - 1) % WORLD)] * 2
        assert seen[rank]["batch"] == [float((rank + 1) % WORLD)]
    assert seen[0]["any_source"] == [[1, 10.0], [2, 20.0]]
    message, tensor = seen[1]["misfit"]
    assert "rank 0 sent 3 float32 elements" in message and "2 float32" in message, message
    assert tensor == [0.0, 0.0]
    assert seen[1]["after_misfit"] == [7.0, 7.0]


def test_object_helpers_go_through_the_ops(seen: dict[int, dict[str, Any]]) -> None:
    for rank in range(WORLD):
        got = seen[rank]
        assert got["all_gather_object"] == [{"rank": r} for r in range(WORLD)]
        assert got["gather_object"] == ([["r", r] for r in range(WORLD)] if rank == 2 else None)
        assert got["broadcast_object_list"] == ["from 0", 0]
        assert got["scatter_object_list"] == [[rank] * rank]


def test_subgroups_run_on_the_backend_and_split_group_says_why_not(
    seen: dict[int, dict[str, Any]],
) -> None:
    for rank in (0, 2):
        backend, summed, name = seen[rank]["new_group"]
        assert (backend, summed) == ("collective", [2.0, 2.0]) and name, seen[rank]["new_group"]
    assert [seen[r]["new_subgroups"] for r in range(WORLD)] == [[2.0], [2.0], [1.0]]
    for rank in range(WORLD):
        assert "No device associated with the default pg" in seen[rank]["split_group"]


def test_destroy_leaves_no_shared_memory_and_a_new_group_works(
    seen: dict[int, dict[str, Any]],
) -> None:
    for rank in range(WORLD):
        assert seen[rank]["mapped_after_destroy"] == []
        assert seen[rank]["files_after_destroy"] == []
        assert seen[rank]["reinit"] == [3.0, 3.0]


def test_ranks_on_two_hosts_meet_in_shared_memory_and_over_gloo(
    seen: dict[int, dict[str, Any]],
) -> None:
    for rank in range(WORLD):
        got = seen[rank]
        assert "transport='hierarchical'" in got["hosts_repr"], got["hosts_repr"]
        # all_reduce gives 6 everywhere; rank 2 broadcasts a copy of its 6 doubled
        expected = [6.0] * 3 if rank == 2 else [12.0] * 3
        assert got["hosts_collectives"] == [expected, [0.0, 1.0, 2.0]]
    assert seen[0]["hosts_any_source"] == [[1, 101.0], [2, 102.0]]


def test_disagreeing_calls_raise_on_every_rank_with_nothing_written(
    seen: dict[int, dict[str, Any]],
) -> None:
    for rank in range(WORLD):
        got = seen[rank]
        for check, what in (("sizes", "elements"), ("dtypes", "float"), ("ops", "MAX")):
            kind, message, runtime = got[check]
            assert kind == "CollectiveError" and runtime, (rank, check, got[check])
            assert what in message, (rank, check, message)
        assert got["sizes_after"] == [1.0] * (5 if rank == 1 else 4)
        assert got["dtypes_after"] == [1.0] * 4
        assert got["ops_after"] == [1.0] * 3
    # ranks 0 and 1 name root 0, rank 2 root 1: the ranks whose data it touches raise,
    # rank 1 may receive what it asked for, rank 0's tensor
    for rank in (0, 2):
        kind, message, _ = seen[rank]["roots"]
        assert kind == "CollectiveError" and "root" in message, seen[rank]["roots"]
        assert seen[rank]["roots_after"] == [float(rank)] * 3
    assert seen[1]["roots"][0] in ("returned", "CollectiveError"), seen[1]["roots"]
    assert seen[1]["roots_after"] in ([0.0] * 3, [1.0] * 3), seen[1]["roots_after"]


def test_a_wait_ends_by_the_timeout_naming_the_rank_that_never_came(
    seen: dict[int, dict[str, Any]],
) -> None:
    for rank in (0, 1):  # rank 2 never calls
        got = seen[rank]
        # the first rank to time out names rank 2 and tells the other, whose wait ends
        for check in ("timeout", "wait_timeout"):
            kind, message, _ = got[check]
            assert kind in ("CollectiveTimeoutError", "CollectiveError"), got[check]
            assert "timed out" in message and "never joined it: [2]" in message, message
        assert 2.5 < got["waited"] < 30, got["waited"]
    for rank in range(WORLD):
        assert seen[rank]["mapped_after_failures"] == []


def test_a_rank_that_dies_is_named_by_the_others(seen: dict[int, dict[str, Any]]) -> None:
    for rank in (0, 1):
        kind, message, _ = seen[rank]["dead"]
        assert kind == "CollectiveError" and "rank 2 died" in message, seen[rank]["dead"]


ENTRY_POINT = """
import sys, torch, torch.distributed as dist
print("collective" in sys.modules, "COLLECTIVE" in dist.Backend._plugins)
if "COLLECTIVE" in dist.Backend._plugins:
    dist.init_process_group("collective", store=dist.HashStore(), rank=0, world_size=1)
    t = torch.ones(2)
    dist.all_reduce(t)
    print(type(dist.group.WORLD).__name__, t.tolist())
    dist.destroy_process_group()
"""


def test_torch_registers_the_backend_at_import_without_importing_the_library(
    tmp_path: Path,
) -> None:
    def probe(autoload: str) -> list[str]:
        env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD=autoload)
        done = subprocess.run(
            [sys.executable, "-c", ENTRY_POINT],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
            env=env,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.splitlines()

    assert probe("1") == ["False True", "CollectiveProcessGroup [1.0, 1.0]"]
    assert probe("0") == ["False False"]


ONE_RANK = """
import sys, datetime, torch, torch.distributed as dist
import collective
collective.register_torch_backend(); collective.register_torch_backend()
dist.init_process_group("cpu:collective,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1)
t = torch.ones(3)
dist.all_reduce(t)
pg = dist.group.WORLD
print(type(pg).__name__, dist.get_backend_config(), t.tolist())
try:
    dist.all_reduce(torch.ones(2, device="meta"))
except RuntimeError as exc:
    print(exc)
dist.destroy_process_group()
"""


def test_registration_is_idempotent_and_a_device_config_routes_cpu_tensors_here(
    tmp_path: Path,
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", ONE_RANK],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    first, meta = done.stdout.splitlines()[:2]
    assert first == "CollectiveProcessGroup cpu:collective,cuda:nccl [1.0, 1.0, 1.0]", first
    assert "No backend type associated with device type meta" in meta, meta


FAST_SUITE = [
    "test_all_reduce_sum",
    "test_scatter_full_group",
    "test_send_recv_any_source",
    "test_accumulate_gradients_no_sync_allreduce_hook",
]
"""A part of torch's own suite (``tests.torch_suite``) run on collective: all_reduce, scatter on
a new group, receives from any source, a DDP communication hook, about 5 s each (each spawns
two processes that import torch); the ops world covers the other families."""


def test_a_fast_part_of_torchs_own_backend_tests_passes(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    outcomes = torch_suite.run("collective", FAST_SUITE, results)
    assert sorted(outcomes) == sorted(FAST_SUITE), sorted(outcomes)
    failed = {n: t["reason"][-1500:] for n, t in outcomes.items() if t["outcome"] != "passed"}
    assert not failed, json.dumps(failed, indent=1)
