"""Process-group layout (PP x TP, DCP inside TP) and the launcher's fault handling."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import rocm_mla
from rocm_mla.distributed import (
    ParallelLayout,
    ParallelState,
    WorkerError,
    init_parallel,
    launch,
)
from tests.test_dcp_decode import Case, global_problem, run_case, spawned_children


def test_layout_groups_for_pp2_tp4_dcp2():
    layout = ParallelLayout.for_world(8, pp=2, tp=4, dcp=2)
    assert layout.tp_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.dcp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [layout.pp_rank(r) for r in range(8)] == [0] * 4 + [1] * 4
    assert [layout.tp_rank(r) for r in range(8)] == [0, 1, 2, 3] * 2
    assert [layout.dcp_rank(r) for r in range(8)] == [0, 1] * 4
    for group in layout.dcp_groups():
        assert any(set(group) <= set(tp) for tp in layout.tp_groups())


def test_layout_defaults_tp_to_the_rest_of_the_world():
    assert ParallelLayout.for_world(6, pp=3) == ParallelLayout(pp=3, tp=2, dcp=1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 8, "pp": 2, "tp": 2}, r"world_size=8 must equal pp \* tp = 2 \* 2 = 4"),
        ({"world_size": 4, "pp": 1, "tp": 4, "dcp": 3}, "dcp=3 must divide tp=4"),
        ({"world_size": 6, "pp": 4}, "pp must be an int >= 1 that divides world_size=6"),
        ({"world_size": 4, "pp": 1, "tp": 4, "dcp": 0}, "dcp must be an int >= 1"),
        ({"world_size": 0}, "world_size must be an int >= 1"),
    ],
)
def test_impossible_layouts_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelLayout.for_world(**kwargs)


def test_init_parallel_without_env_says_how_to_start(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="torchrun"):
        init_parallel()


def report_groups(state: ParallelState, case: Case):
    """Each group's members as seen through a collective, plus a DCP decode on the DCP group."""
    members = {}
    for name in ("tp_group", "pp_group", "dcp_group"):
        group = getattr(state, name)
        seen = torch.zeros(dist.get_world_size(group), dtype=torch.int64)
        dist.all_gather_into_tensor(seen, torch.tensor([state.rank]), group=group)
        members[name] = seen.tolist()
    coords = (state.pp_rank, state.tp_rank, state.dcp_rank)
    return state.rank, coords, members, run_case(state, case)


def test_launch_builds_pp_tp_dcp_groups_and_dcp_decodes_inside_tp():
    case = Case(2, 4, 3, seed=7)
    results = launch(
        report_groups, 4, args=(case,), pp=2, tp=2, dcp=2, backend="gloo", timeout_s=150
    )
    layout = ParallelLayout(pp=2, tp=2, dcp=2)
    for rank, (reported, coords, members, _) in enumerate(results):
        assert reported == rank
        assert coords == (layout.pp_rank(rank), layout.tp_rank(rank), layout.dcp_rank(rank))
        assert members["tp_group"] == next(g for g in layout.tp_groups() if rank in g)
        assert members["pp_group"] == next(g for g in layout.pp_groups() if rank in g)
        assert members["dcp_group"] == next(g for g in layout.dcp_groups() if rank in g)
    # Both pipeline stages' DCP groups decode the same problem independently.
    q, kv, block_table, seqlens = global_problem(case)
    ref, _ = rocm_mla.mla_decode(q, kv, block_table, seqlens, backend="torch")
    for stage in (results[0:2], results[2:4]):
        out = torch.cat([r[3][0] for r in stage], dim=2)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def die_on_rank_1(state: ParallelState) -> None:
    if state.rank == 1:
        os._exit(7)
    dist.barrier()


def break_then_die_on_rank_1(state: ParallelState) -> None:
    if state.rank == 1:
        # Its sockets close first, so rank 0's barrier fails and reports before this death.
        dist.destroy_process_group()
        time.sleep(0.3)
        os._exit(7)
    dist.barrier()


def hang_on_rank_0(state: ParallelState) -> None:
    if state.rank == 0:
        time.sleep(3600)


def test_rank_that_dies_is_named_and_no_worker_survives():
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        launch(die_on_rank_1, 2, backend="gloo", timeout_s=150)
    assert time.monotonic() - start < 60
    assert info.value.rank == 1
    assert "rank 1 of 2 died with exit code 7" in str(info.value)
    assert spawned_children() == []


def test_a_death_shortly_after_the_peers_reports_is_still_the_cause():
    with pytest.raises(WorkerError) as info:
        launch(break_then_die_on_rank_1, 2, backend="gloo", timeout_s=150)
    assert info.value.rank == 1, str(info.value)
    assert "rank 1 of 2 died with exit code 7" in str(info.value)
    assert spawned_children() == []


def test_hung_rank_times_out_instead_of_hanging():
    start = time.monotonic()
    # Rank 1 returns at once; on a loaded machine it may still be starting at the deadline.
    with pytest.raises(TimeoutError, match=r"ranks \[0(, 1)?\] of 2 did not finish within 10 s"):
        launch(hang_on_rank_0, 2, backend="gloo", timeout_s=10)
    assert time.monotonic() - start < 35
    assert spawned_children() == []
