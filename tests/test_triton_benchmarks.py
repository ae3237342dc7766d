"""The kernel roofline's arithmetic and presets, and the autotune sweep, without a GPU."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from benchmarks import autotune_triton, kernel_roofline
from rocm_mla.kernels.target import TritonTarget


def test_gpu_preset_holds_the_issue_17_cases():
    labels = {c.label() for c in kernel_roofline.PRESETS["gpu"]}
    for label in (
        "B128 ctx32K H16",
        "B32 ctx16K H16",
        "B8 ctx32K H16",
        "B128 ctx32K H128",
        "B32 ctx16K H128",
        "B64 ctx8K H128 S_q2",
        "B64 ctx8K H128 fp8",
        "B128 ctx16K H16 fp8",
        "B128 ctx16K H16",  # the bf16 twin of the fp8 H16 case
    ):
        assert label in labels, label
    tiny = kernel_roofline.PRESETS["tiny"]
    assert max(c.batch * c.context for c in tiny) <= 4 * 4096


def test_metrics_and_peer_ratios():
    lens = torch.full((2,), 1000, dtype=torch.int32)
    kv = torch.empty(1, dtype=torch.bfloat16)
    cost = kernel_roofline.roofline(lens, 16, 1, kv, torch.bfloat16)
    assert cost["bytes"] == 2000 * 576 * 2 + 2 * 16 * (576 + 512) * 2
    assert cost["flops"] == 2000 * 16 * 2 * (576 + 512)
    case = kernel_roofline.Case(2, 1000, 16, 1, "bf16")
    peaks = kernel_roofline.peak_compute("NVIDIA H200")
    m = kernel_roofline.metrics(cost, 1e-3, case, 4.8e12, peaks)
    assert math.isclose(m["pct_peak_bw"], 100 * cost["bytes"] / 1e-3 / 4.8e12)
    assert math.isclose(m["pct_peak_compute"], 100 * cost["flops"] / 1e-3 / 989e12)
    # H16 is memory-bound: the roofline time is the bandwidth time.
    assert math.isclose(m["pct_roofline"], m["pct_peak_bw"])
    fp8 = kernel_roofline.metrics(
        cost, 1e-3, kernel_roofline.Case(2, 1000, 16, 1, "fp8"), 4.8e12, peaks
    )
    assert math.isclose(fp8["pct_peak_compute"], 100 * cost["flops"] / 1e-3 / 1979e12)
    assert kernel_roofline.peak_compute("cpu-x86_64") is None
    rows = [
        {"case": "a", "peer": False, "time_us": 50.0},
        {"case": "a", "peer": True, "time_us": 100.0},
        {"case": "a", "peer": True, "time_us": 80.0},
        {"case": "b", "peer": False, "time_us": 10.0},
        {"case": "a", "peer": True, "skipped": "no"},
    ]
    kernel_roofline.add_peer_ratios(rows)
    assert rows[0]["vs_best_peer"] == 80.0 / 50.0 and rows[2]["vs_best_peer"] == 1.0
    assert "vs_best_peer" not in rows[3]  # no peer ran that case


def test_flash_mla_path_that_is_not_there(tmp_path):
    module, reason = kernel_roofline.flash_mla_module(str(tmp_path))
    assert module is None and "flash_mla_interface.py" in reason


@pytest.mark.parametrize(
    "target",
    [TritonTarget("cuda", "sm90", 132), TritonTarget("hip", "gfx942", 304)],
)
@pytest.mark.parametrize("kv_kind", ["bf16", "fp8"])
def test_autotune_sweep_is_valid_for_each_target(target, kv_kind):
    configs = autotune_triton.sweep(target, kv_kind, quick=False)
    assert len(set(configs)) == len(configs) > 8
    for config in configs:
        assert (config.fp8_qk or config.fp8_pv) == (kv_kind == "fp8")
        hip_knobs = config.waves_per_eu is not None
        assert hip_knobs == (target.backend == "hip")
        if target.arch == "gfx942":
            assert config.block_n <= 32 and config.num_stages <= 2  # 64 KB of LDS
    quick = autotune_triton.sweep(target, kv_kind, quick=True)
    assert set(quick) <= set(configs) and all(c.block_h == 64 for c in quick)


# ---- the benchmarks' planned Triton calls, on the interpreter (or a GPU) ---------------------


def _small_problem(lengths, heads, q_len, dtype=torch.float32, seed=0):
    from rocm_mla.inputs import prepare_decode
    from tests.reference import make_paged_problem

    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, kv, bt, lens = make_paged_problem(
        lengths, num_heads=heads, q_len=q_len, block_size=16, dtype=dtype, seed=seed
    )
    return prepare_decode(
        q.to(device),
        kv.to(device),
        bt.to(device),
        lens.to(device),
        head_dim_v=512,
        softmax_scale=None,
        causal=True,
        kv_scale=None,
    )


def test_roofline_times_the_triton_decode_on_its_balanced_schedule():
    """``planned_triton``: config and slots from ``plan_launch``, the lengths' host schedule
    made outside the timed call, which then matches torch."""
    from rocm_mla.backends.torch_ref import torch_mla_decode
    from rocm_mla.kernels.plan import plan_launch
    from tests.reference import assert_same_attention

    problem = _small_problem([150, 3], heads=16, q_len=2)
    call, extra = kernel_roofline.planned_triton(problem, problem.cache_seqlens.cpu())
    _, slots = plan_launch(q_len=2, num_heads=16, kv_dtype=torch.float32)
    assert extra["num_slots"] == slots and 1 <= extra["used_slots"] <= slots
    assert extra["num_partials"] == 0 or slots > 1
    out, lse = call()
    ref_out, ref_lse = torch_mla_decode(problem)
    assert_same_attention(out, lse, ref_out, ref_lse, 1e-5)


def test_autotune_checks_each_config_through_cut_units_and_the_merge():
    """The correctness check cuts every request of its problem (one piece per slot), so a
    config whose partials or merge were wrong could not win; the check passes for the
    interpreter's tuned config and fails when the output is off."""
    from rocm_mla.backends.torch_ref import torch_mla_decode
    from rocm_mla.kernels import mla_decode as kernel
    from rocm_mla.kernels.mla_decode_args import group_config
    from rocm_mla.kernels.target import triton_target

    check = _small_problem([150, 70, 5], heads=16, q_len=1, seed=1)
    config = group_config(kernel.default_config(triton_target(), num_heads=16), 16)
    schedule = autotune_triton.planned_schedule(check, config)
    assert schedule.num_partials > 0
    assert set(schedule.split_units.tolist()) - {-1} == {0, 1}  # 3 and 2 pieces, cut
    reference = torch_mla_decode(check)
    assert autotune_triton.is_correct(config, check, reference) is None
    wrong = (reference[0] + 0.1, reference[1])
    assert autotune_triton.is_correct(config, check, wrong).startswith("wrong result")


# ---- autotune --compiled: the choice over a table key's shapes, and its refusals ----------


def _result(passes: bool, *, issued=1.0, resident=1, regs=900, spills=0, failed=("no_spills",)):
    """A bench-static result of one candidate at one shape (B 8, 32, 128), and its kernels."""
    gates = {"compiles": {"pass": True}}
    for gate in failed:
        gates[gate] = {"pass": passes}
    per_batch = [
        {"batch": b, "stage1": f"k{regs}-{spills}", "issued_over_useful": issued,
         "resident_per_unit": resident}
        for b in (8, 32, 128)
    ]  # fmt: skip
    return {"gates": gates, "per_batch": per_batch}


KERNELS = {
    f"k{regs}-{spills}": {"regs_per_thread": regs, "vgpr_spill_count": spills}
    for regs in (780, 900, 1013, 1024)
    for spills in (0, 41)
}


def _config(**kw):
    from rocm_mla.kernels.tuned_configs import LaunchConfig

    return LaunchConfig(
        **{"block_h": 64, "block_n": 32, "num_warps": 4, "num_stages": 2, "dv_chunks": 2, **kw}
    )


def test_compiled_choice_passes_the_most_shapes_then_ranks_by_evidence():
    h64, h96 = (64, 1, "bf16"), (96, 1, "bf16")
    split = _config(rows_per_warp=16)
    keys_m = _config(shrunk_keys_as_m=True, min_block_h=32)
    results = [
        # passes at 64 rows with the fewest registers, spills at 96 (three 32-row groups)
        (split, [(h64, _result(True, regs=780)), (h96, _result(False, regs=1024, spills=41))]),
        (keys_m, [(h64, _result(True, regs=900)), (h96, _result(True, regs=1013))]),
    ]
    config, evidence, failed = autotune_triton._choose_compiled(results, KERNELS)
    assert config == keys_m and failed == []
    assert evidence == {
        "issued_over_useful": 1.0, "resident_per_cu": 1, "block_n": 32, "registers": 1013
    }  # fmt: skip
    # Passing the same shapes, the fewer registers (at its worst shape) wins.
    both = [(split, results[1][1]), (keys_m, [(h64, _result(True)), (h96, _result(True))])]
    assert autotune_triton._choose_compiled(both, KERNELS)[0] == keys_m
    # No candidate passes anywhere: no entry.
    none = [(split, [(h96, _result(False, spills=41))])]
    assert autotune_triton._choose_compiled(none, KERNELS) is None


def test_compiled_refusals_name_the_row_group_and_never_a_passing_one():
    split = _config(rows_per_warp=16)
    windows = [(12, 4, "fp8"), (12, 8, "fp8"), (16, 4, "fp8"), (16, 8, "fp8")]
    why = {(12, 8, "fp8"): "no_spills (41 VGPRs spilled)"}
    # 96 rows run as 32-row groups of 2 waves; 48, 64 and 128 rows as 64-row groups.
    assert autotune_triton._refusals(split, windows, [(12, 8, "fp8")], why) == [
        {"block_h": 32, "why": "H12 S_q 8: no_spills (41 VGPRs spilled)"}
    ]
    # A failing shape in a group a passing shape also runs cannot be refused by its group.
    why[(16, 8, "fp8")] = "issued_over_useful (1.53)"
    assert autotune_triton._refusals(split, windows, [(16, 8, "fp8")], why) is None


def test_compiled_failure_names_each_gate_with_its_figure():
    result = _result(False, issued=1.529, spills=41, failed=("issued_over_useful", "no_spills"))
    text = autotune_triton._failure(result, KERNELS)
    assert text == "issued_over_useful (1.53), no_spills (41 VGPRs spilled)"


def test_compiled_choice_prefers_failures_it_can_refuse():
    # 96 rows of an fp8 window fail with both: as three 32-row groups (refusable: no other
    # shape runs 32-row groups) or as two padded 64-row groups (not: 64-row groups pass at 64).
    h16, h12 = (16, 4, "fp8"), (12, 8, "fp8")
    split = _config(rows_per_warp=16)
    padded = _config(min_block_h=64)
    results = [
        (padded, [(h16, _result(True, regs=780)), (h12, _result(False, issued=1.333))]),
        (split, [(h16, _result(True, regs=900)), (h12, _result(False, spills=41))]),
    ]
    config, _, failed = autotune_triton._choose_compiled(results, KERNELS)
    assert config == split and failed == [h12]
