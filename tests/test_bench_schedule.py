"""``rocm-mla bench schedule`` (benchmarks/schedule.py) on a tiny subset, no compile: the row
fields, hand-computed bounds, every schedule at or above every lower bound, and the old
uniform split far behind the balanced schedule on one long request among short ones."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("triton")
# The schedule under measure (rocm_mla/kernels/schedule.py), landed separately from this benchmark.
pytest.importorskip("rocm_mla.kernels.schedule")

from benchmarks import schedule as bench

LONG_SHORT = "1x128K + 31x2K"
#: gfx942 H128 S_q1 bf16: two 64-row groups (G 2); 2 programs per CU forced -> S = 608.
SHAPE = ("gfx942", 128, 1, "bf16")
PPC = 2


@pytest.fixture(scope="module")
def payload() -> dict:
    mixes = bench.mixes()
    subset = {name: mixes[name] for name in (bench.UNIFORM_MIX, LONG_SHORT)}
    return bench.run(
        [bench.TARGETS["gfx942"]],
        workers=1,
        programs_per_cu=PPC,
        mix_lengths=subset,
        shape_list=[SHAPE],
    )


def _row(payload: dict, mix: str) -> dict:
    (row,) = [r for r in payload["rows"] if r["mix"] == mix]
    return row


def test_rows_have_the_fields(payload: dict) -> None:
    json.dumps(payload)  # the JSON the command writes
    assert len(payload["rows"]) == 2
    for row in payload["rows"]:
        for field in ("target", "H", "S_q", "dtype", "G", "block_h", "S", "mix", "B"):
            assert field in row, field
        assert (row["target"], row["H"], row["S_q"], row["dtype"]) == SHAPE
        assert row["G"] == 2 and row["block_h"] == 64
        assert row["S"] == 304 * PPC
        assert set(row["makespan"]) == {"old", "balanced", "flashmla"}
        for name in row["makespan"]:
            assert set(row["ratio"][name]) == {"lb_a", "lb_b", "lb_c"}
        assert {
            "lb_c",
            "lb_b",
            "lb_a",
            "uniform_lb_c",
            "uniform_not_worse_than_old",
            "pass",
        } <= set(row["gates"])
    assert payload["mixes"][LONG_SHORT] == [131072] + [2048] * 31
    summary = payload["summary"]
    assert summary["rows"] == 2 and summary["pass"] + summary["fail"] == 2
    assert summary["bounds_violated"] == 0


def test_bounds_by_hand(payload: dict) -> None:
    row = _row(payload, bench.UNIFORM_MIX)
    # 8 x 32768 keys x 2 groups over 608 slots: 8192 pieces -> 14 per slot.
    assert row["lb_b"] == 14 * 64 + 84
    assert row["lb_a"] == pytest.approx(2 * 8 * 32768 / 608 + 84, abs=0.01)
    row = _row(payload, LONG_SHORT)
    # (2048 + 31 * 32) pieces x 2 groups = 6080 over 608 slots: exactly 10 each.
    assert row["lb_b"] == 10 * 64 + 84


def test_old_and_flashmla_schedules_by_hand() -> None:
    # Old launch: group fastest, then split, then request; chunk = 64 (ceil(50 / 16) * 16)
    # for L 100 and 32 for L 40.
    assert bench.old_programs([100, 40], 2, 2, 16) == [64, 64, 36, 36, 32, 32, 8, 8]
    # Four programs of 148 on 3 slots, earliest free first (ties: the lowest slot).
    assert bench.old_loads([100, 40], 1, 3, 2, 16) == [296, 148, 148]
    # FlashMLA: blocks [5, 0, 2], total (5+5) + (0+5) + (2+5) = 22, payload 11 + 5 = 16: part 0
    # takes unit 0 (10) and unit 1 (5), unit 2 (7) does not fit in the 1 left and 1 <= 5
    # takes nothing; part 1 takes unit 2.
    assert bench.flashmla_loads([300, 0, 100], 1, 2) == [5 * 64 + 84 + 84, 2 * 64 + 84]
    # Blocks [5, 2]: total 17, payload 9 + 5 = 14; unit 1 (2 + 5) does not fit in the 4
    # left after unit 0, so part 1 takes it.
    assert bench.flashmla_loads([300, 100], 1, 2) == [5 * 64 + 84, 2 * 64 + 84]
    # A cut: one unit of 40 blocks over 2 parts: total 45, payload 23 + 5 = 28; part 0
    # takes 23 blocks, part 1 the other 17.
    assert bench.flashmla_loads([40 * 64], 1, 2) == [23 * 64 + 84, 17 * 64 + 84]


def test_schedules_never_beat_a_lower_bound(payload: dict) -> None:
    for row in payload["rows"]:
        assert row["bounds_hold"]
        for name, makespan in row["makespan"].items():
            bound = max(row["lb_a"], row["lb_b"], row["lb_c"])
            assert makespan >= bound, (row["mix"], name, makespan, bound)
        assert row["lb_c"] >= row["lb_b"]


def test_old_planner_is_far_behind_on_one_long_request(payload: dict) -> None:
    row = _row(payload, LONG_SHORT)
    # The old split cuts every request alike, so the 128K request's splits dominate.
    assert row["makespan"]["old"] >= 2.5 * row["makespan"]["balanced"]
    assert row["ratio"]["balanced"]["lb_b"] <= bench.MAX_RATIO
    assert row["gates"]["lb_c"] and row["gates"]["pass"]
    uniform = _row(payload, bench.UNIFORM_MIX)
    assert uniform["gates"]["uniform_not_worse_than_old"] is True
    assert uniform["makespan"]["balanced"] <= uniform["makespan"]["old"]


def test_random_lengths_respect_the_bounds() -> None:
    """On random small batches every schedule covers its keys and no bound exceeds any
    makespan (a bound a schedule beats would mean the cost model is wrong)."""
    rng = random.Random(7)
    for _ in range(200):
        lengths = [rng.choice([0, 1, 63, 64, 65, rng.randint(0, 5000)]) for _ in range(6)]
        if not any(lengths):
            lengths[0] = 1
        groups, slots = rng.randint(1, 3), rng.randint(1, 24)
        splits, block_n = rng.randint(1, 8), rng.choice([16, 32, 64])
        pools = rng.choice([1, 2, 8])
        keys = bench.old_programs(lengths, groups, splits, block_n)
        assert sum(keys) == groups * sum(lengths)
        makespans = [
            max(bench.balanced_loads(lengths, groups, slots, pools)["loads"]),
            max(bench.old_loads(lengths, groups, slots, splits, block_n)),
            max(bench.flashmla_loads(lengths, groups, slots)),
        ]
        lb_a, lb_b = bench.lower_bounds(lengths, groups, slots)
        lb_c = bench.lower_bound_c(lengths, groups, slots, lb_b, makespans[0])
        assert lb_c is not None
        for makespan in makespans:
            assert makespan >= max(lb_a, lb_b, lb_c), (lengths, groups, slots, makespans)


def test_writes_markdown_and_plot(payload: dict, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    text = bench.markdown(payload)
    assert "## gfx942" in text and LONG_SHORT in text
    bench.plot(payload, tmp_path / "schedule.png")
    assert (tmp_path / "schedule.png").stat().st_size > 0


def test_cli_knows_the_benchmark() -> None:
    from rocm_mla import cli

    assert cli.BENCHMARKS["schedule"] == "benchmarks.schedule"


def test_the_gate_is_lb_c_up_to_one_piece() -> None:
    """Gated on (c): 1.15 x (c), or one piece over it where slots hold few pieces (a DCP-8
    share of short requests: (b) cannot be met there, one piece more is already 1.19 x)."""
    mix = bench.dcp_name("lognormal B32 median 2K")
    target = bench.TARGETS["sm90"]
    row = bench.measure(target, 12, 8, "bf16", mix, bench.mixes()[mix], ppc=1)
    assert row["G"] == 3 and row["S"] == 132
    assert row["lb_b"] == row["lb_c"] == 4 * 64 + 84
    assert row["makespan"]["balanced"] == row["lb_c"] + 64  # 1.19 x: over 1.15 x (b) ...
    assert not row["gates"]["lb_b"]
    assert row["gates"]["lb_c"] and row["gates"]["pass"]  # ... within one piece of (c)
