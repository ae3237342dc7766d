"""``python -m benchmarks.schedule_gpu`` without a GPU: it skips cleanly (one line, nothing
written), its case list builds valid inputs (shapes, block tables inside the cache, the
mixes' lengths) and both schedules' tables for every case, its check catches a wrong
answer, and one tiny case runs end to end (on the Triton interpreter when there is no GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("rocm_mla.kernels.schedule")

from benchmarks import schedule as schedule_bench
from benchmarks import schedule_gpu as bench
from rocm_mla.kernels.schedule import PIECE_KEYS
from rocm_mla.kernels.target import TritonTarget

ROOT = Path(__file__).resolve().parents[1]
SM90 = TritonTarget("cuda", "sm90", 132)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_skips_in_process_without_a_gpu(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("OUT", str(tmp_path))
    before = sorted(bench.common.RESULTS_DIR.glob("schedule-gpu-*"))
    assert bench.main([]) is None
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["schedule_gpu: skipped: torch sees no GPU (nothing written)"]
    assert list(tmp_path.iterdir()) == []
    assert sorted(bench.common.RESULTS_DIR.glob("schedule-gpu-*")) == before


def test_skips_as_a_command_when_no_gpu_is_visible(tmp_path):
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "HIP_VISIBLE_DEVICES": "",
        "OUT": str(tmp_path),
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.schedule_gpu"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "schedule_gpu: skipped: torch sees no GPU (nothing written)"
    assert list(tmp_path.iterdir()) == []


def test_the_case_list():
    every = schedule_bench.mixes()
    table = bench.mix_table()
    assert list(table)[: len(schedule_bench.base_mixes())] == list(schedule_bench.base_mixes())
    for name in bench.DCP_MIXES:
        assert table[schedule_bench.dcp_name(name)] == every[schedule_bench.dcp_name(name)]
    case_list = bench.cases()
    labels = [c.label() for c in case_list]
    assert len(labels) == len(set(labels))
    for name, lengths in table.items():
        mine = [c for c in case_list if c.mix == name]
        assert {(c.heads, c.kv_kind) for c in mine if c.kv_kind == "bf16"} == {
            (16, "bf16"),
            (128, "bf16"),
        }
        assert all(list(c.lengths) == lengths and c.q_len == 1 for c in mine)
    fp8 = [c for c in case_list if c.kv_kind == "fp8"]
    assert {c.mix for c in fp8} == set(bench.FP8_MIXES) and {c.heads for c in fp8} == {16}
    # The fp8 rows come last: a run cut short by its budget loses them first.
    assert [c.kv_kind for c in case_list] == ["bf16"] * (len(case_list) - len(fp8)) + ["fp8"] * len(
        fp8
    )
    assert bench.cases(["batch of 1 (32K)"], heads=(128,)) == [
        bench.Case("batch of 1 (32K)", (32768,), 128, "bf16")
    ]
    with pytest.raises(ValueError, match="unknown mix"):
        bench.cases(["no such mix"])


def _covered_keys(tables, units: int) -> list[int]:
    bounds = tables.slot_segments.tolist()
    covered = [0] * units
    for unit, first, end, _ in tables.segments[: bounds[-1]].tolist():
        assert 0 <= first <= end
        covered[unit] += end - first
    return covered


@pytest.mark.parametrize("case", bench.cases(), ids=lambda c: c.label())
def test_every_case_builds_valid_inputs_and_tables(case):
    inputs = bench.build_inputs(case, "cpu", seed=1, fill=False)
    batch = len(case.lengths)
    assert inputs.lengths == list(case.lengths) == bench.mix_table()[case.mix]
    assert inputs.seqlens.dtype == torch.int32 and inputs.seqlens.tolist() == inputs.lengths
    assert tuple(inputs.q.shape) == (batch, 1, case.heads, 576) and inputs.q.dtype == torch.bfloat16
    num_blocks = inputs.kv.shape[0]
    assert tuple(inputs.kv.shape[1:]) == (64, 576)
    if case.kv_kind == "fp8":
        assert inputs.kv.dtype == bench.kernel_roofline.fp8_dtype()
        assert inputs.kv.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
        assert inputs.kv_scale == bench.FP8_SCALE
    else:
        assert inputs.kv.dtype == torch.bfloat16 and inputs.kv_scale is None
    table = inputs.block_table
    assert table.dtype == torch.int32 and table.shape[0] == batch
    assert num_blocks % 16 == 0 and table.shape[1] % 16 == 0
    assert inputs.capacity_keys >= max(case.lengths)
    # Every block id in range; each request's blocks distinct from every other's.
    assert int(table.min()) >= 0 and int(table.max()) < num_blocks
    used = [table[b, : -(-n // 64)].tolist() for b, n in enumerate(case.lengths)]
    flat = [i for ids in used for i in ids]
    assert len(flat) == len(set(flat)) == sum(-(-n // 64) for n in case.lengths)
    assert len(flat) < num_blocks  # a spare block at least
    # Both schedules for sm90's tuned config with 2 programs per SM (no compile): every unit's
    # keys covered exactly once, and the uniform split as plan.choose_num_kv_splits says.
    plan = bench.plan_case(case, inputs, slots=264, target=SM90)
    assert plan.groups == -(-case.heads // plan.config.block_h)
    units = batch * plan.groups
    want = [-(-n // PIECE_KEYS) * PIECE_KEYS for n in case.lengths for _ in range(plan.groups)]
    assert _covered_keys(plan.balanced, units) == want
    assert plan.balanced.num_slots == 264 and plan.balanced.used_slots <= 264
    assert _covered_keys(plan.uniform, units) == want
    assert plan.uniform.num_slots == units * plan.splits


def test_the_check_catches_a_wrong_answer():
    import rocm_mla

    case = bench.Case("check", (500, 0, 70), 16, "bf16")
    inputs = bench.build_inputs(case, "cpu", seed=3)
    args = (inputs.q, inputs.kv, inputs.block_table, inputs.seqlens)
    kw = {"head_dim_v": 512, "softmax_scale": bench.SOFTMAX_SCALE, "backend": "torch"}
    ref = rocm_mla.mla_decode(*args, **kw)
    good = bench.compare(*ref, *ref, inputs, "bf16")
    assert good["ok"] and good["out_max_abs_err"] == 0 and good["lse_max_abs_err"] == 0
    # FlashMLA's lse layout [B, H, S_q] is read as ours.
    assert bench.compare(*ref, ref[0], ref[1].transpose(1, 2), inputs, "bf16")["ok"]
    # Half of each request's keys dropped: the lse and the outputs move.
    wrong = rocm_mla.mla_decode(*args[:3], inputs.seqlens // 2, **kw)
    bad = bench.compare(*wrong, *ref, inputs, "bf16")
    assert not bad["ok"] and bad["lse_max_abs_err"] > 0.3 and bad["out_rel_err"] > 0.1
    # A row without keys must be exactly 0 / -inf.
    out, lse = ref[0].clone(), ref[1].clone()
    out[1] = 1.0
    assert not bench.compare(out, lse, *ref, inputs, "bf16")["empty_rows_ok"]


def test_one_case_end_to_end(tmp_path):
    """The whole row on a tiny mix, 6 forced slots (two units cut, so stage 2 merges), the
    torch reference (no FlashMLA), and the JSON + PNG it writes."""
    case = bench.Case("tiny", (200, 0, 70), 16, "bf16")
    payload = bench.run(
        [case], device=DEVICE, warmup=0, repeats=1, slots=6, flash_reason="not loaded here"
    )
    (row,) = payload["rows"]
    assert row["G"] == 1 and row["slots"] == 6 and row["balanced_split_units"] == 2
    check = row["check"]
    assert check["reference"] == "torch" and check["ok"], check
    assert check["device_tables_match_host"] and check["device_equals_balanced"]
    for name in bench.CHECKED:
        assert check[name]["out_rel_err"] <= bench.TOL["bf16"]["out_rel"]
    times = row["time_us"]
    assert times["flashmla"] is None and row["skipped"]["flashmla"] == "not loaded here"
    assert all(times[n] > 0 for n in ("balanced", "device", "uniform", "planner"))
    assert row["ratio"]["uniform/balanced"] == pytest.approx(
        times["uniform"] / times["balanced"], rel=1e-3
    )
    assert row["ratio"]["flashmla/balanced"] is None
    assert payload["summary"]["checks_failed"] == []
    # The plan the row ran, as every GPU result records it.
    plan = row["plan"]
    assert plan["num_slots"] == row["slots"] and plan["config"]["block_h"] == 16
    assert plan["used_slots"] == row["balanced_used_slots"] <= row["slots"]
    assert plan["num_partials"] == row["balanced_partials"] and plan["fingerprint"]
    assert "launched" in plan and "plan tiny" in bench.table_text(payload)
    path = bench.write(payload, tmp_path)
    assert path.name.startswith("schedule-gpu-") and path.with_suffix(".png").is_file()
    assert json.loads(path.read_text())["rows"][0]["mix"] == "tiny"
    assert "tiny" in bench.table_text(payload)


class FakeFlashMLA:
    """FlashMLA's two calls, answered by the torch backend (lse as FlashMLA lays it out,
    [B, H, S_q]), or wrongly (zero outputs) with ``wrong``."""

    def __init__(self, wrong: bool) -> None:
        self.wrong = wrong
        self.calls = 0

    def get_mla_metadata(self, cache_seqlens, rows_per_kv_head, kv_heads):
        assert rows_per_kv_head == 16 and kv_heads == 1
        return "meta", "splits"

    def flash_mla_with_kvcache(self, q, kv4, table, lens, dv, meta, splits, **kw):
        import rocm_mla

        assert (meta, splits, dv, kv4.dim()) == ("meta", "splits", 512, 4)
        self.calls += 1
        out, lse = rocm_mla.mla_decode(q, kv4, table, lens, backend="torch", **kw)
        return (torch.zeros_like(out) if self.wrong else out), lse.transpose(1, 2)


@pytest.mark.parametrize("wrong", [False, True], ids=["flashmla-agrees", "flashmla-wrong"])
def test_the_flashmla_column(wrong):
    """FlashMLA's column through kernel_roofline's call: timed, the reference when it agrees
    with ours; when it does not, the torch reference decides and the disagreement is kept."""
    fake = FakeFlashMLA(wrong)
    case = bench.Case("tiny", (130, 0, 70), 16, "bf16")
    payload = bench.run([case], device=DEVICE, flash=fake, warmup=0, repeats=1, slots=3)
    (row,) = payload["rows"]
    assert fake.calls == 2  # the reference, then 1 timed (0 warmup)
    assert row["time_us"]["flashmla"] > 0 and row["skipped"] == {}
    assert row["ratio"]["flashmla/balanced"] > 0
    check = row["check"]
    assert check["ok"], check
    if wrong:
        assert check["reference"].startswith("torch")
        assert not any(check["vs_flashmla"][n]["ok"] for n in bench.CHECKED)
    else:
        assert check["reference"] == "flashmla" and "vs_flashmla" not in check


def test_calibration_rows(tmp_path):
    """The cost model's measurement rows on a tiny scale: segments of 1 and 2 pieces, whole
    and cut in two (2 forced slots, one wave), stage 2 alone over 2 and 3 partials, the fits
    through them, and the section they make in the payload."""
    payload = bench.run(
        [],
        device=DEVICE,
        warmup=0,
        repeats=1,
        slots=2,
        calibration_heads=(16,),
        calibration_args={"pieces": (1, 2), "waves": 1, "merges": ((1, 2), (1, 3))},
    )
    (entry,) = payload["calibration"]
    assert entry["heads"] == 16 and entry["slots"] == 2 and entry["groups"] == 1
    rows = entry["segments"]
    assert [(r["pieces"], r["cut"]) for r in rows] == [(1, False), (1, True), (2, False), (2, True)]
    for r in rows:
        assert r["segments"] == 2 and r["waves"] == 1 and r["time_us"] > 0
        assert r["keys"] == r["pieces"] * PIECE_KEYS
        assert r["requests"] == (1 if r["cut"] else 2)
        assert r["tiles"] == r["keys"] / entry["config"]["block_n"]
    for name in ("direct", "cut"):
        fit = entry["segment_fit"][name]
        mine = [r for r in rows if r["cut"] == (name == "cut")]
        # Two points: the line passes through both.
        assert fit["us_per_piece"] == pytest.approx(
            mine[1]["us_per_wave"] - mine[0]["us_per_wave"], abs=1e-3
        )
        if fit["us_per_piece"] > 0:
            assert fit["overhead_keys"] == pytest.approx(
                PIECE_KEYS * fit["fixed_us"] / fit["us_per_piece"]
            )
    merges = entry["merges"]
    assert [(m["units"], m["partials_per_unit"]) for m in merges] == [(1, 2), (1, 3)]
    assert all(m["time_us"] > 0 for m in merges)
    assert set(entry["merge_fit"]) == {"1"}
    assert payload["rows"] == [] and "calibration H16 (2 slots" in bench.table_text(payload)
    path = bench.write(payload, tmp_path)
    assert json.loads(path.read_text())["calibration"][0]["segments"] == rows


def test_parts_flag_is_checked(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--parts", "mixes,nope"])
    assert exc.value.code == 2 and "--parts: expected some of" in capsys.readouterr().err
