"""``rocm-mla bench schedule`` (benchmarks/schedule.py) on a tiny subset, no compile: the row
fields, hand-computed bounds, every schedule at or above every lower bound, the old uniform
split far behind the balanced schedule on one long request among short ones, never ahead of
it on the held-out mixes, and the fit the calibrated constants come from."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("triton")

from benchmarks import schedule as bench
from rocm_mla.kernels.schedule.cost import MERGE_KEYS, OVERHEAD_KEYS, merge_cost

LONG_SHORT = "1x128K + 31x2K"
#: gfx942 H128 S_q1 bf16: two 64-row groups (G 2); 2 programs per CU forced -> S = 608.
SHAPE = ("gfx942", 128, 1, "bf16")
PPC = 2
OVERHEAD = OVERHEAD_KEYS


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
        for field in ("makespan", "chain", "cost"):
            assert set(row[field]) == {"old", "balanced", "flashmla"}
        for name in row["cost"]:
            assert set(row["ratio"][name]) == {"lb_a", "lb_b", "lb_c"}
        assert set(row["lb_total"]) == {"lb_a", "lb_b", "lb_c"}
        assert {
            "lb_c",
            "lb_b",
            "lb_a",
            "uniform_lb_c",
            "not_costlier_than_old",
            "pass",
        } <= set(row["gates"])
        assert row["held_out"] is False
    assert payload["mixes"][LONG_SHORT] == [131072] + [2048] * 31
    assert payload["cost_model"]["overhead_keys"] == OVERHEAD
    summary = payload["summary"]
    assert summary["rows"] == 2 and summary["pass"] + summary["fail"] == 2
    assert summary["bounds_violated"] == 0


def test_bounds_by_hand(payload: dict) -> None:
    row = _row(payload, bench.UNIFORM_MIX)
    # 8 x 32768 keys x 2 groups over 608 slots: 8192 pieces -> 14 per slot.
    assert row["lb_b"] == 14 * 64 + OVERHEAD
    assert row["lb_a"] == pytest.approx(2 * 8 * 32768 / 608 + OVERHEAD, abs=0.01)
    row = _row(payload, LONG_SHORT)
    # (2048 + 31 * 32) pieces x 2 groups = 6080 over 608 slots: exactly 10 each.
    assert row["lb_b"] == 10 * 64 + OVERHEAD


def test_total_bound_by_hand() -> None:
    """One unit of 100 pieces on 10 slots: a makespan of 10 pieces merges 10 partials, one
    of 20 merges 5, ...; the bound is the least makespan + merge from the stage bound up."""
    merge = MERGE_KEYS
    stage = 10 * 64 + OVERHEAD
    want = min(
        OVERHEAD + -(-100 // count) * 64 + (merge * count if count > 1 else 0)
        for count in range(1, 11)
    )
    assert bench.total_bound([6400], 1, stage, 1 << 30) == want
    # Capped: no makespan above ``high`` is tried.
    assert bench.total_bound([6400], 1, stage, stage) == stage + 10 * merge


def test_old_and_flashmla_schedules_by_hand() -> None:
    # Old split (uniform_schedule): 2 splits of L 100 (2 pieces) and L 40 (1 piece, its
    # second split empty), group fastest, then split, then request: 64, 64, 64, 0 keys,
    # on 3 slots earliest free first (ties: the lowest slot).
    assert bench.old_loads([100, 40], 1, 3, 2) == [2 * OVERHEAD + 64, 64 + OVERHEAD, 64 + OVERHEAD]
    # FlashMLA: blocks [5, 0, 2], total (5+5) + (0+5) + (2+5) = 22, payload 11 + 5 = 16: part 0
    # takes unit 0 (10) and unit 1 (5), unit 2 (7) does not fit in the 1 left and 1 <= 5
    # takes nothing; part 1 takes unit 2. No unit spans two parts: nothing merged.
    loads, chain = bench.flashmla_loads([300, 0, 100], 1, 2)
    assert loads == [5 * 64 + 2 * OVERHEAD, 2 * 64 + OVERHEAD] and chain == 0
    # Blocks [5, 2]: total 17, payload 9 + 5 = 14; unit 1 (2 + 5) does not fit in the 4
    # left after unit 0, so part 1 takes it.
    assert bench.flashmla_loads([300, 100], 1, 2) == ([5 * 64 + OVERHEAD, 2 * 64 + OVERHEAD], 0)
    # A cut: one unit of 40 blocks over 2 parts: total 45, payload 23 + 5 = 28; part 0
    # takes 23 blocks, part 1 the other 17, merged.
    assert bench.flashmla_loads([40 * 64], 1, 2) == ([23 * 64 + OVERHEAD, 17 * 64 + OVERHEAD], 2)


def test_schedules_never_beat_a_lower_bound(payload: dict) -> None:
    for row in payload["rows"]:
        assert row["bounds_hold"]
        for name, makespan in row["makespan"].items():
            bound = max(row["lb_a"], row["lb_b"], row["lb_c"])
            assert makespan >= bound, (row["mix"], name, makespan, bound)
            assert row["cost"][name] >= max(row["lb_total"].values())
        assert row["lb_c"] >= row["lb_b"]


def test_old_planner_is_far_behind_on_one_long_request(payload: dict) -> None:
    row = _row(payload, LONG_SHORT)
    # The old split cuts every request alike, so the 128K request's splits dominate.
    assert row["cost"]["old"] >= 2.5 * row["cost"]["balanced"]
    assert row["ratio"]["balanced"]["lb_b"] <= bench.MAX_RATIO
    assert row["gates"]["lb_c"] and row["gates"]["pass"]
    uniform = _row(payload, bench.UNIFORM_MIX)
    assert uniform["gates"]["not_costlier_than_old"] is True
    assert uniform["cost"]["balanced"] <= uniform["cost"]["old"]


#: The held-out mix where the line packing alone cost more than the old split: 256 requests
#: of 256-2K keys, a DCP-8 rank's share (32-256 keys: 1-4 pieces a unit, each less than the
#: overhead a cut adds). The old split runs those units whole in several waves, and list
#: scheduling packs whole units tighter than the line's cuts: the line cost 1.076 x the old
#: split on gfx950 (512 units on 256 slots), 1.0045 on sm90. The host planner now runs them
#: whole there (``kernels.schedule``, "Whole units").
MANY_TINY = bench.dcp_name("B256 uniform 256-2K")


@pytest.mark.parametrize(
    ("target", "heads", "q_len", "ppc"),
    [
        ("sm90", 16, 1, 1),
        ("sm90", 128, 1, 1),
        ("gfx942", 16, 1, 2),
        ("gfx950", 128, 4, 1),
        ("gfx950", 16, 8, 1),
    ],
)
def test_held_out_mixes_never_cost_more_than_the_old_split(target, heads, q_len, ppc) -> None:
    """The mixes the model was not fitted on, batch of 1 included (and their DCP shares):
    never costlier than the old split, ``MANY_TINY`` included."""
    every = bench.mixes()
    held_out = {n: v for n, v in every.items() if n.split(" / ")[0] in bench.held_out_mixes()}
    assert len(held_out) == 2 * len(bench.held_out_mixes())
    for mix, lengths in held_out.items():
        row = bench.measure(bench.TARGETS[target], heads, q_len, "bf16", mix, lengths, ppc=ppc)
        assert row["held_out"] and row["bounds_hold"], mix
        assert row["gates"]["not_costlier_than_old"], (mix, row["cost"])
        if mix != MANY_TINY:
            assert row["gates"]["lb_c"], (mix, row["ratio"]["balanced"])


def test_random_lengths_respect_the_bounds() -> None:
    """On random small batches every schedule covers its keys and no bound exceeds any
    makespan or cost (a bound a schedule beats would mean the cost model is wrong)."""
    rng = random.Random(7)
    for _ in range(200):
        lengths = [rng.choice([0, 1, 63, 64, 65, rng.randint(0, 5000)]) for _ in range(6)]
        if not any(lengths):
            lengths[0] = 1
        groups, slots = rng.randint(1, 3), rng.randint(1, 24)
        splits, pools = rng.randint(1, 8), rng.choice([1, 2, 8])
        balanced = bench.balanced_loads(lengths, groups, slots, pools)
        flash, flash_chain = bench.flashmla_loads(lengths, groups, slots)
        old = max(bench.old_loads(lengths, groups, slots, splits))
        makespans = [max(balanced["loads"]), old, max(flash)]
        costs = [
            balanced["cost"],
            old + merge_cost(splits),
            max(flash) + merge_cost(flash_chain),
        ]
        lb_a, lb_b = bench.lower_bounds(lengths, groups, slots)
        lb_c = bench.lower_bound_c(lengths, groups, slots, lb_b, makespans[0])
        assert lb_c is not None
        total = bench.total_bound(lengths, groups, lb_c, max(costs))
        for makespan, cost in zip(makespans, costs, strict=True):
            assert makespan >= max(lb_a, lb_b, lb_c), (lengths, groups, slots, makespans)
            assert cost >= total, (lengths, groups, slots, costs, total)


def test_writes_markdown_and_plot(payload: dict, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    text = bench.markdown(payload)
    assert "## gfx942" in text and LONG_SHORT in text
    bench.plot(payload, tmp_path / "schedule.png")
    assert (tmp_path / "schedule.png").stat().st_size > 0


def test_cli_knows_the_benchmark() -> None:
    from rocm_mla import cli

    assert cli.BENCHMARKS["schedule"] == "benchmarks.schedule"


def test_cli_runs_a_benchmark_in_the_checkout_without_touching_the_import_path(capfd) -> None:
    """``rocm-mla bench`` runs ``python -m benchmarks.<name>`` in the checkout (its exit code
    is the command's); this process's sys.path stays as it was."""
    import sys

    from rocm_mla import cli

    before = list(sys.path)
    assert cli.main(["bench", "schedule", "--help"]) == 0
    assert sys.path == before
    assert "usage:" in capfd.readouterr().out


def test_the_fit_gives_the_calibrated_overhead(payload: dict) -> None:
    """The committed H200 timings fit the overhead the model charges (``OVERHEAD_KEYS``;
    and the merge of the kernel they timed, ``schedule.cost.MERGE_KEYS``'s comment), within the
    timing's spread: half the rows within 6 us."""
    result = payload["cost_model"]["fit"]
    assert result["overhead_keys"] == OVERHEAD_KEYS
    assert result["calibrated"] == {
        "overhead_keys": OVERHEAD_KEYS,
        "merge_keys_per_partial": MERGE_KEYS,
    }
    assert result["merge_keys_per_partial"] == 8
    assert result["abs_residual_us"]["median"] <= 6.0
    assert len(result["residuals"]) == 44
    assert set(result["shapes"]) == set(bench.FIT_SHAPES)
