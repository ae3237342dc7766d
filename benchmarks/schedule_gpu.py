"""The balanced decode schedule timed on a GPU: our Triton MLA decode under three schedules and
FlashMLA, side by side on identical inputs, for the length mixes of ``benchmarks.schedule``.

``benchmarks.schedule`` ranks the schedules in a cost model without a GPU; this measures them.
Per case (a length mix x a shape: S_q 1, H 16 and 128, bf16 cache; H 16 also with an fp8
e4m3 cache on a few mixes; page 64, D 576 / Dv 512, random data, shuffled block ids):

- ``balanced``: ``kernels.mla_decode.mla_decode(..., config=config, schedule=tables)``,
  ``(config, slots) = plan.plan_launch(...)`` and ``tables = schedule.host_schedule(lengths,
  num_groups=G, num_slots=slots, capacity_keys=...)`` made on the host outside the timed
  region (the launch runs ``tables.num_programs`` programs, one per segment in launch
  order);
- ``device``: the same call with ``schedule=None, num_slots=slots``: the device planner
  (one small launch, plus the zeroed tables it fills) runs inside the timed region;
- ``planner``: that planner launch alone, into tables allocated outside (informational);
- ``uniform``: the old uniform split as tables for the same kernel:
  ``schedule.uniform_schedule(lengths, num_groups=G, splits=plan.choose_num_kv_splits(B, G,
  mean, max, slots), capacity_keys=...)``;
- ``flashmla``: ``get_mla_metadata`` (outside the timed region) + ``flash_mla_with_kvcache``
  on the same q / cache / block table / lengths, loaded and called as
  ``benchmarks.kernel_roofline`` does (``--flash-mla PATH`` / ``$ROCM_MLA_FLASH_MLA``, else
  ``flash_mla`` or ``vllm.third_party.flashmla``); bf16 cache only (its fp8 cache is its own
  656-byte format): the fp8 rows and a machine without it record why the column is empty.

Timing: ``kernel_roofline.kernel_time``: CUDA events around each call, a 512 MB buffer
rewritten before each (no input stays in L2), median of ``--repeats`` after ``--warmup``
calls. Ratios per case: ``uniform / balanced``, ``flashmla / balanced``, ``device /
balanced`` (> 1: balanced is faster). The cache is padded to a multiple of 16 blocks and the
block table to a multiple of 16 columns (never-referenced spare blocks, zero columns past a
request's last block), so Triton compiles stage 1 once per shape, not once per mix.

Correctness, once per case, on the rows that see a key: ``balanced``, ``uniform`` and
``device`` against FlashMLA (bf16 cases where it runs) or else the torch reference
(``rocm_mla.mla_decode(..., backend="torch")``): ``out_rel_err`` = max |out - ref| / max |ref|
(outputs of random data shrink as 1/sqrt(L), so an absolute bound would pass anything at
32K; the max abs error is recorded too), ``lse_max_abs_err`` (natural log, FlashMLA's
``[B, H, S_q]`` transposed); rows with no key must give out 0 and lse -inf, and nothing NaN.
Tolerances (``TOL``): bf16 2e-2 for both (the repo's bf16 test tolerance); fp8 1e-1 (the
kernel's fp8 dots round q and P to fp8, which the torch reference does not). Also recorded:
whether the device planner wrote the host planner's tables, and whether the ``device``
output equals ``balanced`` bit for bit. A failed check makes the command exit 1 (after
writing the results).

Each row records the plan it ran (``plan``: ``common.triton_plan`` of the balanced launch,
config, slots, residency, segments, partials, Triton, device, a fingerprint, and the stage-1
kernel as launched: registers, spills, shared memory, the residency they give), printed one
line per row so that a repeat on another machine can be compared plan by plan.

Calibration rows (``calibration``, run first; ``--parts calibration`` alone), for the
schedule's cost model (``schedule.cost.OVERHEAD_KEYS``, ``MERGE_KEYS``), per head count of
``--calibration-heads`` (S_q 1, bf16): segments of 1 to 64 pieces filling the
machine ``CAL_WAVES`` times, whole and cut in two (a segment of one tile against a segment of
many, with and without its partial and merge), and stage 2 alone merging 2 to 128 partials
per unit, with the least-squares fits; the fields are documented in ``calibration``.

Output: ``schedule-gpu-<device>-<date>.json`` and ``.png`` (the ratios per mix, one panel per
shape) under ``--out``, else ``$OUT``, else ``benchmarks/results/``. With no GPU visible to
torch it prints one line and writes nothing (exit 0). ``--budget-s`` (default 170) skips the
calibration shapes and cases left once the run has taken that long (recorded as skipped), so
that the command stays under about 3 minutes on an H200 whatever the compiles cost.

    python -m benchmarks.schedule_gpu [--parts calibration,mixes] [--calibration-heads 16,128]
        [--mixes NAME,...] [--heads 16,128] [--no-fp8] [--repeats N] [--warmup N]
        [--budget-s S] [--flash-mla PATH] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
import types
from pathlib import Path

import torch

from benchmarks import common, kernel_roofline
from benchmarks import schedule as schedule_bench

HEAD_DIM, HEAD_DIM_V = 576, 512
PAGE_SIZE = 64
SOFTMAX_SCALE = HEAD_DIM**-0.5
FP8_SCALE = 0.05  #: the dequant scale of the fp8 cache (kernel_roofline's)
HEADS = (16, 128)
FP8_HEADS = 16
#: benchmarks.schedule's base mixes, then these DCP-8 rank-0 shares of them.
DCP_MIXES = (schedule_bench.UNIFORM_MIX, "1x128K + 31x2K")
#: The mixes also run with an fp8 cache (at ``FP8_HEADS``).
FP8_MIXES = (schedule_bench.UNIFORM_MIX, "1x128K + 31x2K", "B128 uniform 1K-8K")
#: Cache blocks and block-table columns are padded to a multiple of this (Triton specializes
#: integer arguments on divisibility by 16: one stage-1 compile per shape).
ALIGN = 16
SEED = 20261202
WARMUP, REPEATS = 5, 30
BUDGET_S = 170.0
#: Correctness bounds per cache kind: out_rel_err (max |out - ref| / max |ref|) and the lse's
#: max abs error, over the rows that see a key.
TOL = {"bf16": {"out_rel": 2e-2, "lse": 2e-2}, "fp8": {"out_rel": 1e-1, "lse": 1e-1}}
#: What is timed per case; ``planner`` is part of ``device``, reported alone.
TIMED = ("balanced", "device", "uniform", "flashmla", "planner")
CHECKED = ("balanced", "uniform", "device")
RATIOS = ("uniform", "flashmla", "device")


@dataclasses.dataclass(frozen=True)
class Case:
    mix: str
    lengths: tuple[int, ...]
    heads: int
    kv_kind: str  #: "bf16" or "fp8"
    q_len: int = 1

    @property
    def shape(self) -> str:
        return f"H{self.heads} S_q{self.q_len} {self.kv_kind}"

    def label(self) -> str:
        return f"{self.mix} | {self.shape}"


def mix_table() -> dict[str, list[int]]:
    """The mixes timed: every base mix of ``benchmarks.schedule``, then ``DCP_MIXES``' shares."""
    every = schedule_bench.mixes()
    out = dict(schedule_bench.base_mixes())
    for name in DCP_MIXES:
        out[schedule_bench.dcp_name(name)] = every[schedule_bench.dcp_name(name)]
    return out


def cases(mixes: list[str] | None = None, *, heads=HEADS, fp8: bool = True) -> list[Case]:
    """Per mix (in ``mix_table`` order) every bf16 shape, then the fp8 ones last: a run cut
    short by the budget loses whole mixes, and the optional fp8 rows first."""
    table = mix_table()
    names = list(table) if mixes is None else mixes
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"unknown mix {unknown}; expected some of {list(table)}")
    out = [Case(n, tuple(table[n]), h, "bf16") for n in names for h in heads]
    if fp8 and FP8_HEADS in heads:
        out += [Case(n, tuple(table[n]), FP8_HEADS, "fp8") for n in names if n in FP8_MIXES]
    return out


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclasses.dataclass
class Inputs:
    q: torch.Tensor  #: [B, S_q, H, 576] bf16
    kv: torch.Tensor  #: [num_blocks, 64, 576] bf16, or fp8 with ``kv_scale``
    block_table: torch.Tensor  #: [B, width] int32
    seqlens: torch.Tensor  #: [B] int32
    lengths: list[int]
    kv_scale: float | None

    @property
    def capacity_keys(self) -> int:
        return self.block_table.shape[1] * self.kv.shape[1]


def build_inputs(case: Case, device: str, seed: int, *, fill: bool = True) -> Inputs:
    """Random q and paged cache for ``case``; request ``b``'s blocks are a slice of one random
    permutation of all blocks (so no two requests share one, and none is in order).
    ``fill=False`` leaves q and the cache uninitialized (shapes and tables only)."""
    lengths = list(case.lengths)
    blocks = [-(-max(n, 0) // PAGE_SIZE) for n in lengths]
    # At least one spare block (never referenced), a multiple of ALIGN of them in all.
    num_blocks = _round_up(sum(blocks) + 1, ALIGN)
    width = _round_up(max(max(blocks), 1), ALIGN)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    table = torch.zeros(len(lengths), width, dtype=torch.int32)
    cursor = 0
    for b, n in enumerate(blocks):
        table[b, :n] = perm[cursor : cursor + n].to(torch.int32)
        cursor += n
    fp8 = case.kv_kind == "fp8"
    kv_dtype = kernel_roofline.fp8_dtype() if fp8 else torch.bfloat16
    q_shape = (len(lengths), case.q_len, case.heads, HEAD_DIM)
    if fill:
        gen = torch.Generator(device=device).manual_seed(seed)
        q = torch.randn(q_shape, generator=gen, device=device, dtype=torch.bfloat16)
        kv = torch.randn(
            num_blocks, PAGE_SIZE, HEAD_DIM, generator=gen, device=device, dtype=torch.bfloat16
        )
        if fp8:
            kv = (kv / FP8_SCALE).to(kv_dtype)
    else:
        q = torch.empty(q_shape, device=device, dtype=torch.bfloat16)
        kv = torch.empty(num_blocks, PAGE_SIZE, HEAD_DIM, device=device, dtype=kv_dtype)
    return Inputs(
        q=q,
        kv=kv,
        block_table=table.to(device),
        seqlens=torch.tensor(lengths, dtype=torch.int32, device=device),
        lengths=lengths,
        kv_scale=FP8_SCALE if fp8 else None,
    )


@dataclasses.dataclass
class Plan:
    config: object  #: LaunchConfig
    groups: int
    slots: int
    splits: int  #: the uniform split count
    balanced: object  #: ScheduleTables (host)
    uniform: object  #: ScheduleTables


def shape_launch(case: Case, inputs: Inputs, *, slots: int | None = None, target=None):
    """``(config, slots)`` of a case: what ``plan.plan_launch`` plans (it compiles stage 1
    once per shape for the occupancy), or with ``slots`` given the tuned config of
    ``target`` (None: this machine's) and that many slots without compiling."""
    from rocm_mla.kernels import plan
    from rocm_mla.kernels.mla_decode_args import default_config, group_config
    from rocm_mla.kernels.target import triton_target

    target = triton_target() if target is None else target
    kv = inputs.kv
    if slots is None:
        return plan.plan_launch(
            q_len=case.q_len,
            num_heads=case.heads,
            kv_dtype=kv.dtype,
            target=target,
            q_dtype=inputs.q.dtype,
            head_dim=HEAD_DIM,
            head_dim_v=HEAD_DIM_V,
            page_size=kv.shape[1],
            cache_bytes=kv.numel() * kv.element_size(),
        )
    config = default_config(target, num_heads=case.heads, q_len=case.q_len, kv_dtype=kv.dtype)
    return group_config(config, case.q_len * case.heads), slots


def plan_case(case: Case, inputs: Inputs, *, slots: int | None = None, target=None) -> Plan:
    """The case's launch (``shape_launch``), then both schedules' tables."""
    import triton

    from rocm_mla.kernels import plan
    from rocm_mla.kernels import schedule as sch

    config, slots = shape_launch(case, inputs, slots=slots, target=target)
    groups = triton.cdiv(case.q_len * case.heads, config.block_h)
    lengths = inputs.lengths
    batch = len(lengths)
    splits = plan.choose_num_kv_splits(
        batch, groups, sum(lengths) / max(batch, 1), max(lengths), slots
    )
    device = inputs.q.device
    common_args = {"num_groups": groups, "capacity_keys": inputs.capacity_keys, "device": device}
    return Plan(
        config=config,
        groups=groups,
        slots=slots,
        splits=splits,
        balanced=sch.host_schedule(
            lengths, num_slots=slots, num_pools=config.num_xcds, **common_args
        ),
        uniform=sch.uniform_schedule(lengths, splits=splits, **common_args),
    )


# ---- correctness ----------------------------------------------------------------------------


def _visible(inputs: Inputs) -> torch.Tensor:
    """[B, S_q] bool: the causal rows that see at least one key."""
    q_len = inputs.q.shape[1]
    lens = inputs.seqlens.to(torch.int64)
    seen = lens[:, None] - q_len + 1 + torch.arange(q_len, device=lens.device)
    return seen > 0


def _as_rows(lse: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    """An lse as [B, S_q, H] float32 (FlashMLA returns [B, H, S_q])."""
    batch, q_len, heads, _ = inputs.q.shape
    if tuple(lse.shape) == (batch, heads, q_len) and heads != q_len:
        lse = lse.transpose(1, 2)
    return lse.reshape(batch, q_len, heads).float()


def compare(out, lse, ref_out, ref_lse, inputs: Inputs, kind: str) -> dict:
    """Errors of (out, lse) against the reference on the rows that see a key; rows that see
    none must be out 0 and lse -inf, and nothing may be NaN."""
    tol = TOL[kind]
    rows = _visible(inputs)  # [B, S_q]
    lse, ref_lse = _as_rows(lse, inputs), _as_rows(ref_lse, inputs)
    out, ref_out = out.float(), ref_out.float()
    empty_ok = bool((out[~rows] == 0).all() and (lse[~rows] == -math.inf).all())
    no_nan = not bool(torch.isnan(out).any() or torch.isnan(lse).any())
    if rows.any():
        diff = (out[rows] - ref_out[rows]).abs()
        out_err = float(diff.max())
        ref_max = float(ref_out[rows].abs().max())
        out_rel = out_err / ref_max if ref_max > 0 else (0.0 if out_err == 0 else math.inf)
        lse_err = float((lse[rows] - ref_lse[rows]).abs().max())
    else:
        out_err = out_rel = lse_err = 0.0
    if math.isnan(out_err) or math.isnan(lse_err):
        out_rel = lse_err = math.inf
    ok = empty_ok and no_nan and out_rel <= tol["out_rel"] and lse_err <= tol["lse"]
    return {
        "out_max_abs_err": out_err,
        "out_rel_err": out_rel,
        "lse_max_abs_err": lse_err,
        "empty_rows_ok": empty_ok,
        "no_nan": no_nan,
        "ok": ok,
    }


def tables_equal(a, b) -> bool:
    """Whether two schedules' tables hold the same segments (device vs host planner)."""
    bounds = a.slot_segments.cpu()
    if not torch.equal(bounds, b.slot_segments.cpu()):
        return False
    n = int(bounds[-1])
    return (
        torch.equal(a.segments[:n].cpu(), b.segments[:n].cpu())
        and torch.equal(a.unit_parts.cpu(), b.unit_parts.cpu())
        and torch.equal(a.split_units.cpu(), b.split_units.cpu())
        and torch.equal(a.launch_order.cpu(), b.launch_order.cpu())
    )


# ---- one case -------------------------------------------------------------------------------


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else round(num / den, 4)


def measure(
    case: Case,
    inputs: Inputs,
    *,
    flash,
    flush,
    warmup: int,
    repeats: int,
    slots: int | None = None,
    peak_bw: float | None = None,
    stage1: common.Stage1Kernels | None = None,
) -> dict:
    """One row: every schedule timed, the checks, the ratios (``flash``: the FlashMLA module
    or None, with ``flash_reason`` why not set by the caller in the row's ``skipped``), and
    the plan (``common.triton_plan`` of the balanced launch; with ``stage1``, the kernel as
    launched)."""
    import rocm_mla
    from rocm_mla.inputs import prepare_decode
    from rocm_mla.kernels import mla_decode as kernel
    from rocm_mla.kernels import schedule as sch

    device = inputs.q.device.type
    plan = plan_case(case, inputs, slots=slots)
    args = (inputs.q, inputs.kv, inputs.block_table, inputs.seqlens)
    common_kw = {
        "head_dim_v": HEAD_DIM_V,
        "softmax_scale": SOFTMAX_SCALE,
        "kv_scale": inputs.kv_scale,
        "config": plan.config,
    }

    def balanced():
        return kernel.mla_decode(*args, schedule=plan.balanced, **common_kw)

    def uniform():
        return kernel.mla_decode(*args, schedule=plan.uniform, **common_kw)

    def device_planned():
        return kernel.mla_decode(*args, schedule=None, num_slots=plan.slots, **common_kw)

    planner_tables = sch.empty_tables(
        len(inputs.lengths), plan.groups, plan.slots, device, plan.config.num_xcds
    )

    def planner():
        sch.device_schedule(inputs.seqlens, planner_tables, capacity_keys=inputs.capacity_keys)

    calls = {"balanced": balanced, "device": device_planned, "uniform": uniform}
    calls["planner"] = planner
    skipped = {}
    flash_call = None
    if flash is not None:
        problem = prepare_decode(
            *args,
            head_dim_v=HEAD_DIM_V,
            softmax_scale=SOFTMAX_SCALE,
            causal=True,
            kv_scale=inputs.kv_scale,
        )
        try:
            flash_call, reason = kernel_roofline.flash_mla_call(flash, problem)
        except Exception as exc:  # the peer must not end the run
            flash_call, reason = None, f"failed: {type(exc).__name__}: {exc}"
        if flash_call is None:
            skipped["flashmla"] = reason
        else:
            calls["flashmla"] = flash_call

    # Correctness first (the first calls also compile, outside any timing).
    stage1 = stage1 or common.Stage1Kernels()
    stage1.before()
    outputs = {name: calls[name]() for name in CHECKED}
    launched = stage1.after(shape=(case.heads, case.q_len, case.kv_kind))
    planner()

    def torch_reference():
        return rocm_mla.mla_decode(
            *args,
            head_dim_v=HEAD_DIM_V,
            softmax_scale=SOFTMAX_SCALE,
            kv_scale=inputs.kv_scale,
            backend="torch",
        )

    ref_name, ref = "torch", None
    if flash_call is not None:
        try:
            ref = flash_call()
            ref_name = "flashmla"
        except Exception as exc:  # the peer must not end the run
            skipped["flashmla"] = f"failed: {type(exc).__name__}: {exc}"
            del calls["flashmla"]
    ref = torch_reference() if ref is None else ref
    check = {"reference": ref_name, "tolerance": TOL[case.kv_kind]}
    for name, (out, lse) in outputs.items():
        check[name] = compare(out, lse, ref[0], ref[1], inputs, case.kv_kind)
    if ref_name == "flashmla" and not all(check[name]["ok"] for name in CHECKED):
        # Ours and FlashMLA disagree: the torch reference decides (and the FlashMLA
        # comparison is kept), so that a peer's quirk (e.g. on zero lengths) is not ours.
        check["vs_flashmla"] = {name: check[name] for name in CHECKED}
        check["reference"] = "torch (ours disagreed with FlashMLA)"
        ref = torch_reference()
        for name, (out, lse) in outputs.items():
            check[name] = compare(out, lse, ref[0], ref[1], inputs, case.kv_kind)
    check["device_tables_match_host"] = tables_equal(planner_tables, plan.balanced)
    check["device_equals_balanced"] = bool(
        torch.equal(outputs["device"][0], outputs["balanced"][0])
        and torch.equal(outputs["device"][1], outputs["balanced"][1])
    )
    check["ok"] = all(check[name]["ok"] for name in CHECKED)
    del outputs, ref

    times = {}
    for name in TIMED:
        if name not in calls:
            times[name] = None
            continue
        try:
            seconds = kernel_roofline.kernel_time(
                calls[name], flush, device=device, warmup=warmup, repeats=repeats
            )
        except Exception as exc:
            if name != "flashmla":
                raise
            skipped["flashmla"] = f"failed: {type(exc).__name__}: {exc}"
            times[name] = None
            continue
        times[name] = round(seconds * 1e6, 3)

    lens_host = torch.tensor(inputs.lengths, dtype=torch.int64)
    cost = kernel_roofline.roofline(lens_host, case.heads, case.q_len, inputs.kv, inputs.q.dtype)
    gb_per_s = {
        name: round(cost["bytes"] / (t * 1e-6) / 1e9, 2) if t else None
        for name, t in times.items()
        if name != "planner"
    }
    row = {
        "mix": case.mix,
        "shape": case.shape,
        "B": len(inputs.lengths),
        "H": case.heads,
        "S_q": case.q_len,
        "kv_dtype": str(inputs.kv.dtype).removeprefix("torch."),
        "sum_len": sum(inputs.lengths),
        "max_len": max(inputs.lengths),
        "num_blocks": inputs.kv.shape[0],
        "table_width": inputs.block_table.shape[1],
        "block_h": plan.config.block_h,
        "block_n": plan.config.block_n,
        "G": plan.groups,
        "slots": plan.slots,
        "balanced_used_slots": plan.balanced.used_slots,
        "balanced_partials": plan.balanced.num_partials,
        "balanced_split_units": int((plan.balanced.split_units >= 0).sum()),
        "uniform_splits": plan.splits,
        "uniform_programs": plan.uniform.num_slots,
        "time_us": times,
        "ratio": {f"{n}/balanced": _ratio(times[n], times["balanced"]) for n in RATIOS},
        "gb_per_s": gb_per_s,
        "bytes": cost["bytes"],
        "check": check,
        "skipped": skipped,
        "plan": {
            **common.triton_plan(
                types.SimpleNamespace(
                    config=plan.config, num_slots=plan.slots, schedule=plan.balanced
                ),
                num_heads=case.heads,
                q_len=case.q_len,
                kv_dtype=inputs.kv.dtype,
            ),
            "launched": launched,
        },
    }
    if peak_bw:
        row["pct_peak_bw"] = {
            name: round(100 * v * 1e9 / peak_bw, 2) if v else None for name, v in gb_per_s.items()
        }
    return row


# ---- calibration rows: the planner's cost model, measured ------------------------------------

#: Pieces (``schedule.PIECE_KEYS`` keys each: one or more tiles of BLOCK_N keys) per segment
#: in the segment rows.
CAL_PIECES = (1, 2, 4, 16, 64)
#: Waves of ``slots`` programs each segment row launches: the machine full, a few times over.
CAL_WAVES = 4
#: (requests, partials per unit) of the merge rows: one request cut many ways, then a batch.
CAL_MERGES = ((1, 2), (1, 8), (1, 32), (1, 128), (32, 2), (32, 8), (32, 32))
CAL_HEADS = (16, 128)
#: What a run measures (``--parts``), in this order.
PARTS = ("calibration", "mixes")


def _fit(xs: list[float], ys: list[float]) -> dict:
    """Least squares ``y = fixed + slope * x`` and its residuals."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    fixed = my - slope * mx
    residuals = [round(y - fixed - slope * x, 3) for x, y in zip(xs, ys, strict=True)]
    return {"fixed": fixed, "slope": slope, "residuals": residuals}


def calibration(
    heads: int,
    *,
    device: str,
    flush,
    warmup: int,
    repeats: int,
    slots: int | None = None,
    pieces=CAL_PIECES,
    waves: int = CAL_WAVES,
    merges=CAL_MERGES,
) -> dict:
    """Rows to calibrate the schedule's cost model on this GPU, at ``heads`` (S_q 1, bf16).

    Segment rows (``segments``): ``waves x slots`` stage-1 programs, each one segment of
    ``pieces`` pieces (``uniform_schedule`` tables: ``cut`` False, every request whole, so
    no partial and no merge; ``cut`` True, every request cut in two, so each segment writes
    a partial and stage 2 merges pairs). Fields: ``pieces``, ``keys``, ``tiles`` (keys /
    BLOCK_N), ``cut``, ``requests``, ``segments``, ``waves`` (segments / slots),
    ``time_us`` (the whole call), ``us_per_wave``. ``segment_fit[direct|cut]``: least
    squares ``us_per_wave = fixed_us + us_per_piece x pieces``, its ``residuals_us``, and
    ``overhead_keys = PIECE_KEYS x fixed_us / us_per_piece``: a segment's fixed cost in keys,
    the cost model's ``OVERHEAD_KEYS`` (``cut`` adds the partial's write and its
    share of the merge).

    Merge rows (``merges``): stage 2 alone (``merge_states.launch_merge_pieces``) over
    ``units`` = requests x row groups cut units of ``partials_per_unit`` random partials
    each; ``time_us``. ``merge_fit[requests]``: ``time_us = fixed_us + us_per_partial x
    partials_per_unit``, residuals.

    ``slots`` forces the slot count (no occupancy compile: the CPU test).
    """
    import triton

    from rocm_mla.kernels import mla_decode as kernel
    from rocm_mla.kernels import schedule as sch
    from rocm_mla.kernels.merge_states import launch_merge_pieces
    from rocm_mla.kernels.mla_decode_args import partial_buffers

    piece = sch.PIECE_KEYS
    probe_case = Case("calibration", (piece,), heads, "bf16")
    config, slots = shape_launch(
        probe_case, build_inputs(probe_case, device, SEED, fill=False), slots=slots
    )
    groups = triton.cdiv(heads, config.block_h)

    def timed(fn) -> float:
        fn()  # compiles, outside the timing
        seconds = kernel_roofline.kernel_time(
            fn, flush, device=device, warmup=warmup, repeats=repeats
        )
        return round(seconds * 1e6, 3)

    segment_rows = []
    for count in pieces:
        for cut in (False, True):
            per_unit = 2 if cut else 1
            batch = max(1, waves * slots // (groups * per_unit))
            case = Case("calibration", (count * piece * per_unit,) * batch, heads, "bf16")
            inputs = build_inputs(case, device, SEED + count)
            tables = sch.uniform_schedule(
                inputs.lengths,
                num_groups=groups,
                splits=per_unit,
                capacity_keys=inputs.capacity_keys,
                device=inputs.q.device,
            )

            def call(inputs=inputs, tables=tables):
                return kernel.mla_decode(
                    inputs.q, inputs.kv, inputs.block_table, inputs.seqlens,
                    head_dim_v=HEAD_DIM_V, softmax_scale=SOFTMAX_SCALE, config=config,
                    schedule=tables,
                )  # fmt: skip

            time_us = timed(call)
            segments = batch * groups * per_unit
            segment_rows.append(
                {
                    "pieces": count,
                    "keys": count * piece,
                    "tiles": count * piece / config.block_n,
                    "cut": cut,
                    "requests": batch,
                    "segments": segments,
                    "waves": segments / slots,
                    "time_us": time_us,
                    "us_per_wave": round(time_us * slots / segments, 3),
                }
            )
            del inputs, tables
    segment_fit = {}
    for name, cut in (("direct", False), ("cut", True)):
        mine = [r for r in segment_rows if r["cut"] is cut]
        fit = _fit([r["pieces"] for r in mine], [r["us_per_wave"] for r in mine])
        segment_fit[name] = {
            "fixed_us": fit["fixed"],
            "us_per_piece": fit["slope"],
            "overhead_keys": piece * fit["fixed"] / fit["slope"] if fit["slope"] > 0 else None,
            "residuals_us": fit["residuals"],
        }

    merge_rows = []
    gen = torch.Generator(device=device).manual_seed(SEED)
    for requests, parts in merges:
        units = requests * groups
        tables = sch.uniform_schedule(
            [parts * piece] * requests,
            num_groups=groups,
            splits=parts,
            capacity_keys=parts * piece,
            device=device,
        )
        # As a balanced schedule lists them: the cut units, then -1 up to the slot count.
        split_units = torch.full((max(slots, units),), -1, dtype=torch.int32, device=device)
        split_units[:units] = torch.arange(units, dtype=torch.int32, device=device)
        part_out, part_lse = partial_buffers(units * parts, config.block_h, HEAD_DIM_V, device)
        part_out.normal_(generator=gen)
        part_lse.normal_(generator=gen)
        out = torch.empty(requests, heads, HEAD_DIM_V, dtype=torch.bfloat16, device=device)
        lse = torch.empty(requests, heads, dtype=torch.float32, device=device)

        def merge(parts=(part_out, part_lse), tables=tables, units=split_units, to=(out, lse)):
            launch_merge_pieces(*parts, tables.unit_parts, units, *to, num_groups=groups)

        merge_rows.append(
            {
                "requests": requests,
                "units": units,
                "partials_per_unit": parts,
                "partials": units * parts,
                "time_us": timed(merge),
            }
        )
        del part_out, part_lse
    merge_fit = {}
    for requests in dict.fromkeys(r["requests"] for r in merge_rows):
        mine = [r for r in merge_rows if r["requests"] == requests]
        fit = _fit([r["partials_per_unit"] for r in mine], [r["time_us"] for r in mine])
        merge_fit[str(requests)] = {
            "fixed_us": fit["fixed"],
            "us_per_partial": fit["slope"],
            "residuals_us": fit["residuals"],
        }
    return {
        "heads": heads,
        "q_len": 1,
        "kv_dtype": "bfloat16",
        "config": config.to_dict(),
        "slots": slots,
        "groups": groups,
        "piece_keys": piece,
        "segments": segment_rows,
        "segment_fit": segment_fit,
        "merges": merge_rows,
        "merge_fit": merge_fit,
    }


def calibration_text(entry: dict) -> str:
    fit, merge = entry["segment_fit"], entry["merge_fit"]
    worst = max(abs(v) for f in fit.values() for v in f["residuals_us"])
    parts = [
        f"{name} {_fmt(f['fixed_us'], '.2f')} us + {_fmt(f['us_per_piece'], '.3f')} us/piece "
        f"per wave = {_fmt(f['overhead_keys'], '.0f')} keys"
        for name, f in fit.items()
    ]
    merges = [
        f"B{req}: {_fmt(f['fixed_us'], '.1f')} us + {_fmt(f['us_per_partial'], '.3f')} us/partial"
        for req, f in merge.items()
    ]
    return (
        f"calibration H{entry['heads']} ({entry['slots']} slots, BLOCK_N "
        f"{entry['config']['block_n']}): segment {'; '.join(parts)} (max residual "
        f"{worst:.2f} us); merge {'; '.join(merges)}"
    )


# ---- the run --------------------------------------------------------------------------------


def run(
    case_list: list[Case],
    *,
    device: str = "cuda",
    flash=None,
    flash_reason: str | None = None,
    warmup: int = WARMUP,
    repeats: int = REPEATS,
    budget_s: float = BUDGET_S,
    slots: int | None = None,
    calibration_heads: tuple[int, ...] = (),
    calibration_args: dict | None = None,
) -> dict:
    """The calibration rows at ``calibration_heads`` (``calibration``, with
    ``calibration_args``), then every case in order (inputs built per case, freed after);
    what is left once ``budget_s`` has passed is recorded as skipped. ``slots`` forces the
    slot count (no occupancy compile; the CPU test)."""
    start = time.perf_counter()
    flush = kernel_roofline.CacheFlush(device)
    peak_bw = common.peak_bandwidth() if device != "cpu" else None
    stage1 = common.Stage1Kernels()
    rows, skipped_cases, calibrations = [], [], []
    for heads in calibration_heads:
        if time.perf_counter() - start > budget_s:
            skipped_cases.append(
                {"case": f"calibration H{heads}", "reason": f"time budget {budget_s} s"}
            )
            continue
        entry = calibration(
            heads,
            device=device,
            flush=flush,
            warmup=warmup,
            repeats=repeats,
            slots=slots,
            **(calibration_args or {}),
        )
        calibrations.append(entry)
        print(calibration_text(entry), flush=True)
    for i, case in enumerate(case_list):
        if time.perf_counter() - start > budget_s:
            skipped_cases.append({"case": case.label(), "reason": f"time budget {budget_s} s"})
            continue
        common.progress(i, len(case_list), case.label())
        inputs = build_inputs(case, device, SEED + i)
        row = measure(
            case,
            inputs,
            flash=flash,
            flush=flush,
            warmup=warmup,
            repeats=repeats,
            slots=slots,
            peak_bw=peak_bw,
            stage1=stage1,
        )
        if flash is None:
            row["skipped"]["flashmla"] = flash_reason or "FlashMLA not loaded"
        rows.append(row)
        del inputs
        if device != "cpu":
            torch.cuda.empty_cache()
    if skipped_cases:
        sys.stderr.write("\n")
    payload = {
        "benchmark": "schedule-gpu",
        "environment": common.environment(),
        "device": common.device_name(),
        "page_size": PAGE_SIZE,
        "head_dim": HEAD_DIM,
        "head_dim_v": HEAD_DIM_V,
        "softmax_scale": SOFTMAX_SCALE,
        "fp8_scale": FP8_SCALE,
        "seed": SEED,
        "warmup": warmup,
        "repeats": repeats,
        "timing": "CUDA events around each call, 512 MB flush before each, median",
        "tolerance": TOL,
        "flashmla": None if flash is not None else (flash_reason or "not loaded"),
        "slots_forced": slots,
        "mixes": {c.mix: list(c.lengths) for c in case_list},
        "rows": rows,
        "calibration": calibrations,
        "skipped_cases": skipped_cases,
    }
    payload["summary"] = summarize(rows)
    payload["wall_s"] = round(time.perf_counter() - start, 1)
    return payload


def _geomean(values: list[float]) -> float | None:
    values = [v for v in values if v]
    return round(math.exp(statistics.fmean(math.log(v) for v in values)), 4) if values else None


def summarize(rows: list[dict]) -> dict:
    by_shape = {}
    for shape in dict.fromkeys(r["shape"] for r in rows):
        mine = [r for r in rows if r["shape"] == shape]
        entry = {"cases": len(mine)}
        for name in RATIOS:
            key = f"{name}/balanced"
            values = [r["ratio"][key] for r in mine if r["ratio"][key] is not None]
            entry[key] = {
                "geomean": _geomean(values),
                "min": min(values) if values else None,
                "max": max(values) if values else None,
            }
        by_shape[shape] = entry
    failed = [f"{r['mix']} | {r['shape']}" for r in rows if not r["check"]["ok"]]
    return {
        "cases": len(rows),
        "checks_failed": failed,
        "device_tables_differ": [
            f"{r['mix']} | {r['shape']}" for r in rows if not r["check"]["device_tables_match_host"]
        ],
        "by_shape": by_shape,
    }


def _fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def table_text(payload: dict) -> str:
    lines = [
        f"{'mix':<34} {'shape':<15} {'balanced':>9} {'device':>9} {'uniform':>9} "
        f"{'flashmla':>9} {'planner':>8}  {'unif/bal':>8} {'fmla/bal':>8} {'dev/bal':>7}  "
        "check (max rel err out, abs err lse)"
    ]
    for r in payload["rows"]:
        t, q = r["time_us"], r["ratio"]
        c = r["check"]
        worst_out = max(c[n]["out_rel_err"] for n in CHECKED)
        worst_lse = max(c[n]["lse_max_abs_err"] for n in CHECKED)
        lines.append(
            f"{r['mix'][:34]:<34} {r['shape']:<15} {_fmt(t['balanced']):>9} "
            f"{_fmt(t['device']):>9} {_fmt(t['uniform']):>9} {_fmt(t['flashmla']):>9} "
            f"{_fmt(t['planner']):>8}  {_fmt(q['uniform/balanced'], '.3f'):>8} "
            f"{_fmt(q['flashmla/balanced'], '.3f'):>8} {_fmt(q['device/balanced'], '.3f'):>7}  "
            f"{'ok' if c['ok'] else 'FAIL'} vs {c['reference']} ({worst_out:.2e}, "
            f"{worst_lse:.2e})"
        )
    lines.append("(times in us; ratios > 1: balanced is faster)")
    for r in payload["rows"]:
        lines.append(f"plan {r['mix'][:34]:<34} {r['shape']:<15} {common.plan_text(r['plan'])}")
    for entry in payload["calibration"]:
        lines.append(calibration_text(entry))
    for shape, s in payload["summary"]["by_shape"].items():
        parts = [
            f"{key} geomean {_fmt(v['geomean'], '.3f')} [{_fmt(v['min'], '.3f')}, "
            f"{_fmt(v['max'], '.3f')}]"
            for key, v in s.items()
            if key != "cases"
        ]
        lines.append(f"{shape}: " + "; ".join(parts))
    reasons = sorted({v for r in payload["rows"] for v in r["skipped"].values()})
    for reason in reasons:
        lines.append(f"flashmla skipped: {reason}")
    for s in payload["skipped_cases"]:
        lines.append(f"skipped {s['case']}: {s['reason']}")
    return "\n".join(lines)


def plot(payload: dict, path: Path) -> None:
    """Per shape, the time ratios to balanced per mix (> 1: balanced faster)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"]
    shapes = list(dict.fromkeys(r["shape"] for r in rows)) or ["(no case ran)"]
    fig, axes = plt.subplots(len(shapes), 1, figsize=(12, 3.8 * len(shapes)), squeeze=False)
    width = 0.8 / len(RATIOS)
    for ax, shape in zip(axes[:, 0], shapes, strict=True):
        mine = [r for r in rows if r["shape"] == shape]
        for i, name in enumerate(RATIOS):
            key = f"{name}/balanced"
            xs = [j + i * width for j, r in enumerate(mine) if r["ratio"][key] is not None]
            ys = [r["ratio"][key] for r in mine if r["ratio"][key] is not None]
            ax.bar(xs, ys, width, label=key)
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(mine))])
        ax.set_xticklabels(
            [f"{r['mix']}\n{_fmt(r['time_us']['balanced'])} us" for r in mine],
            rotation=30,
            ha="right",
            fontsize=7,
        )
        ax.set_ylabel("time / balanced time")
        ax.set_title(f"{shape} (label: mix, balanced time)", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{payload['device']}: MLA decode schedules, page {PAGE_SIZE}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(payload: dict, out_dir: Path | None) -> Path:
    path = common.write_results("schedule-gpu", payload, out_dir)
    plot(payload, path.with_suffix(".png"))
    return path


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def main(argv: list[str] | None = None) -> Path | None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.schedule_gpu", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--parts",
        type=_csv,
        default=list(PARTS),
        help=f"what to run, comma-separated, in this order: {','.join(PARTS)} (default: both)",
    )
    parser.add_argument(
        "--calibration-heads",
        type=_csv,
        default=[str(h) for h in CAL_HEADS],
        help="head counts of the calibration rows (default 16,128)",
    )
    parser.add_argument("--mixes", type=_csv, help="comma-separated mix names (default: all)")
    parser.add_argument("--heads", type=_csv, default=[str(h) for h in HEADS], help="16,128")
    parser.add_argument("--no-fp8", action="store_true", help="skip the fp8 H16 rows")
    parser.add_argument("--warmup", type=int, default=WARMUP)
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument(
        "--budget-s", type=float, default=BUDGET_S, help="skip the cases left after this long"
    )
    parser.add_argument(
        "--flash-mla",
        metavar="PATH",
        help="flash_mla_interface.py (or its folder); default $ROCM_MLA_FLASH_MLA, then imports",
    )
    parser.add_argument("--no-peers", action="store_true", help="skip FlashMLA")
    parser.add_argument("--out", type=Path, help="results folder (default: $OUT, else results/)")
    args = parser.parse_args(argv)
    if args.warmup < 0 or args.repeats < 1:
        parser.error("--warmup must be >= 0 and --repeats >= 1")
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown or not args.parts:
        parser.error(f"--parts: expected some of {list(PARTS)}, got {args.parts}")
    try:
        heads = tuple(int(h) for h in args.heads)
        cal_heads = tuple(int(h) for h in args.calibration_heads)
        case_list = cases(args.mixes, heads=heads, fp8=not args.no_fp8)
    except ValueError as exc:
        parser.error(str(exc))
    if "mixes" not in args.parts:
        case_list = []
    if "calibration" not in args.parts:
        cal_heads = ()
    if not torch.cuda.is_available():
        print("schedule_gpu: skipped: torch sees no GPU (nothing written)")
        return None

    flash, flash_reason = None, "--no-peers"
    if not args.no_peers:
        flash, flash_reason = kernel_roofline.flash_mla_module(args.flash_mla)
        if flash is None:
            print(f"schedule_gpu: FlashMLA columns skipped: {flash_reason}", file=sys.stderr)
    payload = run(
        case_list,
        device="cuda",
        flash=flash,
        flash_reason=flash_reason,
        warmup=args.warmup,
        repeats=args.repeats,
        budget_s=args.budget_s,
        calibration_heads=cal_heads,
    )
    out_dir = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    path = write(payload, out_dir)
    print(table_text(payload))
    print(f"wrote {path} and {path.with_suffix('.png')} in {payload['wall_s']} s")
    failed = payload["summary"]["checks_failed"]
    if failed:
        print(f"schedule_gpu: correctness check FAILED in {len(failed)} cases: {failed}")
        raise SystemExit(1)
    return path


if __name__ == "__main__":
    main()
