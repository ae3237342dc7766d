"""The tuned launch tables, the occupancy-based slot count, every config shape class the
tables hand out, and the fp8-dot path, on the CPU interpreter (or a GPU when present).

Shape classes run through ``kernels.mla_decode.mla_decode`` with the config forced, so the
interpreter executes exactly the block shapes (16/32/64 rows, 16..64 keys, one or two Dv
halves) and fp8 options a GPU would get from the table; ``cut=True`` runs them over enough
slots that the balanced schedule cuts every request longer than one 64-key piece (stage 1's
partials and stage 2's merge), ``cut=False`` over one slot.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

import rocm_mla
from rocm_mla.backends.triton import TritonMLAImpl
from rocm_mla.inputs import prepare_decode
from rocm_mla.kernels import mla_decode as kernel
from rocm_mla.kernels import mla_decode_args
from rocm_mla.kernels import schedule as sch
from rocm_mla.kernels import tuned_configs as tables
from rocm_mla.kernels.target import TritonTarget, triton_target
from tests.reference import assert_same_attention, dense_mla_decode, make_paged_problem
from tests.schedule_helpers import assert_cuts_long_requests, num_groups, piece_slots

if TritonMLAImpl.unavailable_reason() is not None:
    pytest.skip(TritonMLAImpl.unavailable_reason(), allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
SM90 = TritonTarget("cuda", "sm90", 132)
GFX942 = TritonTarget("hip", "gfx942", 304)
GFX950 = TritonTarget("hip", "gfx950", 256)


def prepared(lengths, *, heads, q_len, block=16, dtype=torch.float32, seed=0, head_dim=576):
    q, kv, bt, lens = make_paged_problem(
        lengths,
        num_heads=heads,
        q_len=q_len,
        block_size=block,
        head_dim=head_dim,
        dtype=dtype,
        seed=seed,
    )
    q, kv, bt, lens = q.to(DEVICE), kv.to(DEVICE), bt.to(DEVICE), lens.to(DEVICE)
    return q, kv, bt, lens


def run_kernel(q, kv, bt, lens, *, config, cut, head_dim_v=512, kv_scale=None, slots=None):
    """``mla_decode`` with ``config``: with ``cut`` over one slot per piece, so the device
    planner cuts every request of more than one piece (asserted), else over one slot;
    ``slots`` forces the count instead (unchecked)."""
    if slots is None:
        capacity = bt.shape[1] * kv.shape[1]
        groups = num_groups(heads=q.shape[2], q_len=q.shape[1], kv_dtype=kv.dtype, config=config)
        slots = piece_slots(lens, groups=groups, capacity_keys=capacity) if cut else 1
        if cut:
            assert_cuts_long_requests(lens, groups=groups, slots=slots, capacity_keys=capacity)
    p = prepare_decode(
        q, kv, bt, lens, head_dim_v=head_dim_v, softmax_scale=None, causal=True, kv_scale=kv_scale
    )
    return kernel.mla_decode(
        p.q,
        p.kv_cache,
        p.block_table,
        p.cache_seqlens,
        head_dim_v=head_dim_v,
        softmax_scale=p.softmax_scale,
        kv_scale=kv_scale,
        num_slots=slots,
        config=config,
    )


# ---- the tables -------------------------------------------------------------------------------


def test_lookup_prefers_the_most_specific_entry():
    assert kernel.target_key(SM90) == "sm90"
    assert kernel.target_key(TritonTarget("cuda", "sm80", 108)) == "fallback"
    assert kernel.target_key(TritonTarget("hip", "gfx90a", 104)) == "gfx942"
    assert kernel.target_key(TritonTarget("interpreter", None, 1)) == "interpreter"
    # H128 on gfx942 has its own (row-owned) rows per KV kind; H16 S_q 1 takes the default.
    h128 = kernel.default_config(GFX942, num_heads=128, kv_dtype=torch.bfloat16)
    h16 = kernel.default_config(GFX942, num_heads=16, kv_dtype=torch.bfloat16)
    h16_verify = kernel.default_config(GFX942, num_heads=16, q_len=4, kv_dtype=torch.bfloat16)
    fp8 = kernel.default_config(GFX942, num_heads=128, kv_dtype=torch.float8_e4m3fnuz)
    assert (h128.block_h, h128.dv_chunks, h128.rows_per_warp) == (64, 2, 16)
    assert h16 == tables.TABLES["gfx942"][("*", "*", "*")].config
    assert h16_verify == h128
    # fp8 on gfx942 and gfx950 has row-owned rows too (16-key tiles); H16 S_q 1 keeps the
    # general (replicated) entry.
    fp8_h16 = kernel.default_config(GFX942, num_heads=16, kv_dtype=torch.float8_e4m3fnuz)
    # P.V in fp16 (issue 37): an fp8 V operand is read byte by byte, transposed.
    assert fp8.fp8_qk and not fp8.fp8_pv and (fp8.rows_per_warp, fp8.block_n) == (16, 16)
    assert fp8_h16.fp8_qk and fp8_h16.rows_per_warp is None
    gfx950 = TritonTarget("hip", "gfx950", 256)
    fp8_950 = kernel.default_config(gfx950, num_heads=128, kv_dtype=torch.float8_e4m3fn)
    assert fp8_950.fp8_qk and not fp8_950.fp8_pv
    assert (fp8_950.rows_per_warp, fp8_950.block_n) == (16, 16)
    fp8_950_h16 = kernel.default_config(gfx950, num_heads=16, kv_dtype=torch.float8_e4m3fn)
    assert fp8_950_h16.fp8_qk and fp8_950_h16.rows_per_warp is None
    # A hip arch without its own table keeps gfx942's shapes, minus XCD remap and kpack.
    other = kernel.default_config(TritonTarget("hip", "gfx90a", 104))
    assert other.num_xcds == 1 and other.kpack is None and other.block_n == h16.block_n


@pytest.mark.parametrize(("release", "keys_64"), [((3, 9), 64), ((3, 8), 32)])
def test_sm90_configs_per_group_size_and_amd_is_marked_unmeasured(release, keys_64):
    """sm90 bf16: the issue-17 sweep's 64 x 64 tile on 8 warps, two stages for a 64-row
    (wgmma) group (Triton 3.8: 32-key tiles, three stages, where 64 keys spill); a group
    shrunk under 64 rows (mma.sync) takes three stages and 64 keys with the block ids a trip
    ahead. All unmeasured in this form (compiled evidence only)."""
    stages_64 = 2 if keys_64 == 64 else 3
    # Triton 3.8's verify windows run 32-row groups (64-row ones spill there).
    window_rows = 64 if release >= (3, 9) else 32
    window = (window_rows, stages_64 if window_rows == 64 else 3, window_rows == 32)
    for heads, q_len, rows, stages, prefetch in (
        (128, 1, 64, stages_64, False),
        (128, 2, *window),
        (24, 2, *window),
        (12, 4, *window),
        (48, 1, 64, stages_64, False),
        (16, 1, 16, 3, True),
        (24, 1, 32, 3, True),
        (96, 1, 32, 3, True),
        (12, 8, 32, 3, True),
    ):
        entry = tables.lookup("sm90", heads, q_len, torch.bfloat16, release)
        block_h = window_rows if q_len > 1 and heads * q_len >= 48 else 64
        assert (entry.config.block_h, entry.config.num_warps) == (block_h, 8)
        assert entry.source.startswith("unmeasured")
        group = mla_decode_args.group_config(entry.config, heads * q_len)
        assert (group.block_h, group.num_stages, group.prefetch_ids) == (rows, stages, prefetch)
        assert group.num_warps == 8 and group.block_n == (keys_64 if rows == 64 else 64)
    # fp8 (every release): 64-row groups on wgmma (rows as M) in 32-key tiles; a group
    # shrunk under 64 rows has keys as M (wgmma's N is its rows), 64-key tiles, three
    # stages, the block ids a trip ahead.
    for heads, q_len, rows, keys_as_m, stages in (
        (128, 1, 64, False, 3),
        (128, 2, 64, False, 3),
        (48, 1, 64, False, 3),
        (96, 1, 32, True, 3),
        (12, 8, 32, True, 3),
        (24, 1, 32, True, 3),
        (16, 1, 16, True, 3),
        (12, 1, 16, True, 3),
    ):
        fp8 = torch.float8_e4m3fn
        entry = tables.lookup("sm90", heads, q_len, fp8, release)
        assert entry.source.startswith("unmeasured") and entry.config.fp8_qk
        group = mla_decode_args.group_config(entry.config, heads * q_len)
        assert (group.block_h, group.keys_as_m, group.num_stages) == (rows, keys_as_m, stages)
        assert group.block_n == (32 if rows == 64 else 64) and group.num_warps == 8
        assert group.prefetch_ids == keys_as_m
    for key, table in tables.TABLES.items():
        if key in ("gfx942", "gfx950"):
            assert all(e.source.startswith("unmeasured") for e in table.values())
        assert ("*", "*", "*") in table or key == "sm90"


def test_table_file_round_trip_and_bad_files(tmp_path):
    config = tables.LaunchConfig(block_h=64, block_n=32, num_warps=8, num_stages=2, dv_chunks=2)
    path = tmp_path / "sm90.json"
    path.write_text(
        json.dumps(
            {
                "target": "sm90",
                "device": "NVIDIA H200",
                "entries": [
                    {"heads": "128", "q_len": "2", "kv": "16bit", "config": config.to_dict()}
                ],
            }
        )
    )
    loaded = tables.load_table_file(path)
    entry = loaded["sm90"][("128", "2", "16bit")]
    assert entry.config == config and entry.source == "measured: NVIDIA H200"
    saved = dict(tables.TABLES["sm90"])
    try:
        tables.install_table_file(path)
        assert kernel.default_config(SM90, num_heads=128, q_len=2) == config
        assert kernel.default_config(SM90, num_heads=128, q_len=1).block_n == 64
    finally:
        tables.TABLES["sm90"] = saved
    path.write_text(json.dumps({"target": "sm91", "entries": []}))
    with pytest.raises(ValueError, match="target"):
        tables.load_table_file(path)
    path.write_text(
        json.dumps(
            {
                "target": "sm90",
                "entries": [{"heads": "100", "q_len": "1", "kv": "fp8", "config": {}}],
            }
        )
    )
    with pytest.raises(ValueError, match="100"):
        tables.load_table_file(path)
    with pytest.raises(ValueError, match="block_h"):
        tables.LaunchConfig(block_h=48, block_n=64, num_warps=4, num_stages=1)
    with pytest.raises(ValueError, match="dv_chunks"):
        tables.LaunchConfig(block_h=64, block_n=64, num_warps=4, num_stages=1, dv_chunks=4)


def _segments_per_unit(tables: sch.ScheduleTables) -> dict[int, int]:
    used = int(tables.slot_segments[-1])
    counts: dict[int, int] = {}
    for unit in tables.segments[:used, 0].tolist():
        counts[unit] = counts.get(unit, 0) + 1
    return counts


def test_occupancy_shapes_the_slot_count():
    big = kernel.default_config(SM90, num_heads=128)
    # The 64 x 64 x 3-stage bf16 config fills an H200 SM's shared memory: one per SM.
    assert kernel.programs_per_cu(big, SM90, kv_dtype=torch.bfloat16) == 1
    small = tables.LaunchConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)
    assert kernel.programs_per_cu(small, SM90, kv_dtype=torch.bfloat16) > 1
    # fp8 halves the tile: at least as many resident programs as bf16.
    fp8_count = kernel.programs_per_cu(small, SM90, kv_dtype=torch.float8_e4m3fn)
    assert fp8_count >= kernel.programs_per_cu(small, SM90, kv_dtype=torch.bfloat16)
    # The slots are the SMs times the compiled kernel's residency: a config that holds more
    # programs per SM gets more slots.
    config_big, slots_big = kernel.plan_launch(
        q_len=1, num_heads=16, kv_dtype=torch.bfloat16, target=SM90
    )
    _, slots_small = kernel.plan_launch(
        q_len=1, num_heads=16, kv_dtype=torch.bfloat16, target=SM90, config=small
    )
    assert slots_big == SM90.num_cus * kernel.programs_per_cu(
        config_big, SM90, kv_dtype=torch.bfloat16, num_heads=16
    )
    assert slots_small > slots_big >= SM90.num_cus
    # B1 H16 at 32K: the one request is cut over (almost) every slot, whole pieces each.
    tables_ = sch.host_schedule([32768], num_groups=1, num_slots=slots_big, capacity_keys=32768)
    assert tables_.used_slots >= 0.9 * slots_big
    assert _segments_per_unit(tables_) == {0: tables_.used_slots}
    # B128 H128 at 32K: 128 x 2 groups already fill 132 SMs about twice over: each unit
    # walks at most two segments, and every slot holds work.
    config, slots = kernel.plan_launch(q_len=1, num_heads=128, kv_dtype=torch.bfloat16, target=SM90)
    groups = -(-128 // config.block_h)
    tables_ = sch.host_schedule(
        [32768] * 128, num_groups=groups, num_slots=slots, capacity_keys=32768
    )
    assert config.block_h == 64 and tables_.used_slots == slots == SM90.num_cus
    assert max(_segments_per_unit(tables_).values()) <= 2


def test_plan_launch_shrinks_rows_and_never_reads_a_tensor(monkeypatch):
    """plan_launch is host arithmetic: it must work with every tensor read forbidden."""

    def no_sync(*args, **kwargs):
        raise AssertionError("plan_launch read a tensor")

    monkeypatch.setattr(torch.Tensor, "item", no_sync)
    monkeypatch.setattr(torch.Tensor, "tolist", no_sync)
    config, slots = kernel.plan_launch(
        q_len=1, num_heads=16, kv_dtype=torch.bfloat16, target=SM90, cache_bytes=1 << 30
    )
    assert config.block_h == 16 and slots >= SM90.num_cus
    config, _ = kernel.plan_launch(q_len=2, num_heads=16, kv_dtype=torch.bfloat16, target=SM90)
    assert config.block_h == 32
    monkeypatch.undo()  # the launch's own argument checks read the lengths once
    with pytest.raises(ValueError, match="num_slots"):
        q, kv, bt, lens = prepared([5], heads=16, q_len=1)
        run_kernel(q, kv, bt, lens, config=config, cut=False, slots=0)


@pytest.mark.parametrize("given", ["num_slots", "schedule"])
def test_planned_call_makes_no_device_to_host_transfer(monkeypatch, given):
    """mla_decode with the config and either the slots (the device planner runs inside) or
    a ready schedule reads no tensor on the host; the 140-key request is cut, so stage 2
    runs too."""
    q, kv, bt, lens = prepared([140, 7], heads=16, q_len=1, seed=2)
    want, want_lse = rocm_mla.mla_decode(q, kv, bt, lens, backend="torch")
    p = prepare_decode(
        q, kv, bt, lens, head_dim_v=512, softmax_scale=None, causal=True, kv_scale=None
    )
    config, slots = kernel.plan_launch(q_len=1, num_heads=16, kv_dtype=kv.dtype)
    slots = max(slots, 4)
    capacity = bt.shape[1] * kv.shape[1]
    groups = num_groups(heads=16, q_len=1, kv_dtype=kv.dtype, config=config)
    assert_cuts_long_requests(lens, groups=groups, slots=slots, capacity_keys=capacity)
    schedule = None
    if given == "schedule":
        schedule = sch.empty_tables(2, groups, slots, q.device)
        sch.device_schedule(p.cache_seqlens, schedule, capacity_keys=capacity)

    def no_sync(*args, **kwargs):
        raise AssertionError("a planned mla_decode read a tensor back to the host")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, no_sync)
    out, lse = kernel.mla_decode(
        p.q,
        p.kv_cache,
        p.block_table,
        p.cache_seqlens,
        head_dim_v=512,
        softmax_scale=p.softmax_scale,
        config=config,
        schedule=schedule,
        num_slots=None if schedule is not None else slots,
    )
    monkeypatch.undo()
    assert_same_attention(out, lse, want, want_lse, TOL[torch.float32])


# ---- every config shape class the tables hand out, on the interpreter --------------------------


def _table_shape_classes():
    """Distinct (rows, keys, Dv halves, fp8 dots, ids ahead, keys as M) among all tables'
    entries and their shrunk groups (``group_config``: half the rows at least, with the
    ``shrunk_*`` options), once."""
    classes = {}
    for target_key, table in tables.TABLES.items():
        for key, entry in table.items():
            c = entry.config
            groups = [c]
            if c.block_h > 16:
                groups.append(mla_decode_args.group_config(c, c.block_h // 2))
            for g in groups:
                shape = (
                    g.block_h, g.block_n, g.dv_chunks, g.fp8_qk, g.fp8_pv, g.prefetch_ids,
                    g.keys_as_m,
                )  # fmt: skip
                classes.setdefault(shape, []).append((target_key, key))
    return sorted(classes.items())


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize(("shape", "where"), _table_shape_classes())
def test_every_table_shape_class_matches_torch(shape, where, page):
    """Page 16: tiles of 32 or 64 keys span pages (a block id per key); page 64: tiles of 16
    to 64 keys lie in one page (one block id per tile), several tiles per page."""
    block_h, block_n, dv_chunks, fp8_qk, fp8_pv, prefetch_ids, keys_as_m = shape
    config = tables.LaunchConfig(
        block_h=block_h,
        block_n=block_n,
        num_warps=4,
        num_stages=1,
        dv_chunks=dv_chunks,
        fp8_qk=fp8_qk,
        fp8_pv=fp8_pv,
        prefetch_ids=prefetch_ids,
        keys_as_m=keys_as_m,
    )
    # Enough rows that the group holds block_h of them (64 = 16 heads x 4 positions).
    heads, q_len = (16, block_h // 16)
    if fp8_qk or fp8_pv:
        problem = prepared([70, 3], heads=heads, q_len=q_len, block=page, seed=block_n)
    else:
        problem = prepared(
            [70, 3], heads=heads, q_len=q_len, block=page, dtype=torch.float16, seed=7
        )
    assert_config_matches_torch(*problem, config=config, cut=True)


def assert_config_matches_torch(q, kv, bt, lens, *, config, cut):
    """Stage 1 with ``config`` against the torch reference: with fp8 dots on the cache
    quantized to e4m3 (scale 0.25), their rounding modelled; else to q's dtype's tolerance."""
    if config.fp8_qk or config.fp8_pv:
        kv8 = (kv / 0.25).to(torch.float8_e4m3fn)
        out, lse = run_kernel(q, kv8, bt, lens, config=config, cut=cut, kv_scale=0.25)
        assert_fp8_dot_result(out, lse, q, kv8, bt, lens, 0.25, config)
        return
    out, lse = run_kernel(q, kv, bt, lens, config=config, cut=cut)
    ref_out, ref_lse = rocm_mla.mla_decode(q, kv, bt, lens, backend="torch")
    assert_same_attention(out, lse, ref_out, ref_lse, TOL[q.dtype])


def fold_scores_in_branch(monkeypatch, fold: bool) -> None:
    """Stage 1 with its softmax step in a branch (CUDA's structure) or with the dots (AMD's),
    whatever the target; the two are the same arithmetic, laid out differently by Triton."""
    dot_types = mla_decode_args._dot_types

    def forced(*args, **kwargs):
        return {**dot_types(*args, **kwargs), "FOLD_IN_BRANCH": fold}

    monkeypatch.setattr(kernel, "_dot_types", forced)  # where mla_decode looks it up


@pytest.mark.parametrize("fold_in_branch", [True, False])
@pytest.mark.parametrize(
    ("block_h", "block_n", "fp8", "heads", "q_len", "lengths"),
    [
        (64, 16, False, 16, 4, [70, 3]),  # a 64-row window group (tail tiles of 16 keys)
        (64, 32, True, 128, 1, [66, 0]),  # AMD's fp8 row-owned shape, two 64-row groups
        (32, 32, True, 12, 2, [109, 9]),  # a shrunk fp8 group of a window (tail of 32 keys)
    ],
)
def test_softmax_in_or_out_of_a_branch_matches_torch(
    monkeypatch, fold_in_branch, block_h, block_n, fp8, heads, q_len, lengths
):
    fold_scores_in_branch(monkeypatch, fold_in_branch)
    config = tables.LaunchConfig(
        block_h=block_h,
        block_n=block_n,
        num_warps=4,
        num_stages=1,
        dv_chunks=2,
        fp8_qk=fp8,
        fp8_pv=fp8,
        prefetch_ids=True,
    )
    if fp8:
        q, kv, bt, lens = prepared(lengths, heads=heads, q_len=q_len, block=64, seed=5)
        kv8 = (kv / 0.25).to(torch.float8_e4m3fn)
        out, lse = run_kernel(q, kv8, bt, lens, config=config, cut=True, kv_scale=0.25)
        assert_fp8_dot_result(out, lse, q, kv8, bt, lens, 0.25, config)
        return
    q, kv, bt, lens = prepared(lengths, heads=heads, q_len=q_len, block=64, dtype=torch.float16)
    out, lse = run_kernel(q, kv, bt, lens, config=config, cut=True)
    ref_out, ref_lse = rocm_mla.mla_decode(q, kv, bt, lens, backend="torch")
    assert_same_attention(out, lse, ref_out, ref_lse, TOL[torch.float16])


@pytest.mark.parametrize(
    ("block_h", "block_n", "dv_chunks", "heads", "q_len", "lengths", "cut"),
    [
        (16, 16, 2, 1, 3, [37, 0], False),  # H = 1: 3 real rows of 16
        (16, 16, 2, 1, 3, [101, 0], True),  # the same through partials of padded groups
        (32, 32, 2, 16, 2, [70, 5], True),
        (64, 64, 1, 128, 1, [66], True),  # H = 128: two 64-row groups
        (64, 16, 2, 20, 3, [19, 2, 0], False),  # 60 rows, padded to 64
        (64, 16, 2, 20, 3, [83, 2, 0], True),  # the same through padded partials
        (64, 64, 1, 48, 1, [66, 5, 0], True),  # DCP4's 48 gathered heads in a 64-row group
        (16, 16, 1, 8, 1, [150, 3], True),  # H = 8: 8 real rows of 16, cut in three
        # One request through padded partials: the batch stride addresses nothing.
        (16, 16, 2, 1, 1, [101], True),  # 1 real row of 16
        (64, 64, 1, 48, 1, [66], True),
    ],
)
def test_row_groups_and_dv_halves_across_head_counts(
    block_h, block_n, dv_chunks, heads, q_len, lengths, cut
):
    """Rows that pad their group (H 1, 8, 20 x S_q 3 = 60, 48) through stage 1's direct
    store (one slot) and through its partials (a slot for every row of the group, the pad
    rows' never merged into the output) against torch."""
    config = tables.LaunchConfig(
        block_h=block_h, block_n=block_n, num_warps=4, num_stages=1, dv_chunks=dv_chunks
    )
    q, kv, bt, lens = prepared(lengths, heads=heads, q_len=q_len, seed=sum(lengths))
    out, lse = run_kernel(q, kv, bt, lens, config=config, cut=cut)
    ref_out, ref_lse = rocm_mla.mla_decode(q, kv, bt, lens, backend="torch")
    assert_same_attention(out, lse, ref_out, ref_lse, TOL[torch.float32])


@pytest.mark.parametrize(
    ("block_h", "block_n", "dv_chunks", "heads", "q_len", "lengths", "cut", "block", "kind"),
    [
        (32, 64, 1, 96, 1, [70, 5], True, 16, "fp16"),  # three 32-row groups, tiles over pages
        (16, 64, 2, 12, 1, [70, 0], False, 64, "fp16"),  # 12 rows of 16, V halves, one slot
        (32, 16, 1, 24, 4, [97, 50], True, 16, "fp32"),  # a window's tail tiles of BLOCK_N keys
        (32, 64, 1, 12, 2, [109, 9], True, 64, "fp8"),  # fp8 dots, a window, rows padded
        (32, 64, 1, 96, 1, [66, 3], True, 64, "fp8"),
    ],
)
def test_keys_as_m_matches_torch(
    block_h, block_n, dv_chunks, heads, q_len, lengths, cut, block, kind
):
    """Keys as the dots' M (S^T = K Q^T, O^T = V^T P^T; sm90's fp8 groups under 64 rows):
    the same attention as the torch reference, the fp8 dots' rounding modelled."""
    fp8 = kind == "fp8"
    # 4 warps, 1 stage (the interpreter runs neither).
    config = tables.LaunchConfig(
        block_h, block_n, 4, 1, dv_chunks, fp8_qk=fp8, fp8_pv=fp8, prefetch_ids=True, keys_as_m=True
    )
    dtype = {"fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float32}[kind]
    problem = prepared(
        lengths, heads=heads, q_len=q_len, block=block, dtype=dtype, seed=sum(lengths)
    )
    assert_config_matches_torch(*problem, config=config, cut=cut)


def test_dv_halves_with_a_dv_that_is_not_a_power_of_two():
    """Dv 72 pads to 128: the second half holds 8 real columns and 56 masked ones (through
    the partials of the cut 140-key request too)."""
    config = tables.LaunchConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, dv_chunks=2)
    q, kv, bt, lens = prepared([45, 140], heads=16, q_len=2, head_dim=100, seed=4)
    out, lse = run_kernel(q, kv, bt, lens, config=config, cut=True, head_dim_v=72)
    ref_out, ref_lse = dense_mla_decode(q.cpu(), kv.cpu(), bt.cpu(), lens.cpu(), head_dim_v=72)
    assert_same_attention(out.cpu(), lse.cpu(), ref_out.float(), ref_lse.float(), 1e-5)


# ---- fp8 dots ---------------------------------------------------------------------------------


def quantize_rows_like_the_kernel(q: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """q rounded the way ``fp8_qk`` rounds it: per (token, head) row, amax -> fp8's max."""
    fp8_max = torch.finfo(fp8).max
    qf = q.float()
    amax = qf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / fp8_max, torch.ones_like(amax))
    return (qf / scale).to(fp8).float() * scale


def assert_fp8_dot_result(out, lse, q, kv8, bt, lens, kv_scale, config, tol=2e-3):
    """The fp8-dot result against torch on the dequantized cache, with the rounding modelled.

    fp8_qk: torch gets the same per-row fp8 rounding of q, so scores agree to fp32 accuracy.
    fp8_pv: each weight is rounded to fp8 (relative error <= 2^-4), so each output may move by
    at most max|V| / 16 of its row's keys; the lse (exact fp32 denominators) does not move.
    """
    fp8 = kv8.dtype
    q_ref = quantize_rows_like_the_kernel(q, fp8).to(q.dtype) if config.fp8_qk else q
    kv_ref = kv8.float() * kv_scale
    ref_out, ref_lse = rocm_mla.mla_decode(q_ref, kv_ref, bt, lens, backend="torch")
    out, lse, ref_out, ref_lse = out.cpu(), lse.cpu(), ref_out.cpu(), ref_lse.cpu()
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty) and (out[empty] == 0).all()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    # fp32 scores of the same fp8 values; the interpreter's fp8 rounding ties differently.
    torch.testing.assert_close(lse[~empty], ref_lse[~empty], atol=tol, rtol=tol)
    if config.fp8_pv:
        v_max = kv_ref[..., :512].nan_to_num(0.0).abs().max().cpu()
        assert (out.float() - ref_out.float()).abs().max() <= v_max / 16 + tol
    else:
        torch.testing.assert_close(out.float(), ref_out.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
@pytest.mark.parametrize(("fp8_qk", "fp8_pv"), [(True, False), (False, True), (True, True)])
def test_fp8_dots_match_torch_with_the_rounding_modelled(fp8, fp8_qk, fp8_pv):
    if fp8 not in TritonMLAImpl.capabilities.kv_dtypes:
        pytest.skip(f"{fp8} is not this target's fp8 ({TritonMLAImpl.target()})")
    config = tables.LaunchConfig(
        block_h=32, block_n=32, num_warps=4, num_stages=1, fp8_qk=fp8_qk, fp8_pv=fp8_pv
    )
    q, kv, bt, lens = prepared([77, 1, 0, 40], heads=16, q_len=2, seed=5)
    kv8 = (kv / 0.37).to(fp8)
    out, lse = run_kernel(q, kv8, bt, lens, config=config, cut=True, kv_scale=0.37)
    assert_fp8_dot_result(out, lse, q, kv8, bt, lens, 0.37, config)


def test_fp8_options_are_ignored_for_16_bit_caches():
    """fp8_qk/fp8_pv only apply to fp8 caches: a bf16-table entry with them is exact."""
    config = tables.LaunchConfig(
        block_h=16, block_n=16, num_warps=4, num_stages=1, fp8_qk=True, fp8_pv=True
    )
    q, kv, bt, lens = prepared([33, 4], heads=16, q_len=1, dtype=torch.float16, seed=3)
    out, lse = run_kernel(q, kv, bt, lens, config=config, cut=False)
    ref_out, ref_lse = rocm_mla.mla_decode(q, kv, bt, lens, backend="torch")
    assert_same_attention(out, lse, ref_out, ref_lse, TOL[torch.float16])


def test_dot_types_per_target():
    cfg = tables.LaunchConfig(
        block_h=64, block_n=64, num_warps=8, num_stages=3, fp8_qk=True, fp8_pv=True
    )
    import triton.language as tl

    sm90 = mla_decode_args._dot_types(torch.bfloat16, torch.float8_e4m3fn, SM90, cfg)
    assert sm90["K_DTYPE"] == tl.float8e4nv and sm90["QK_FP8"] and sm90["PV_FP8"]
    assert sm90["FP8_EMULATE_MIN_EXP"] is None and sm90["P_SCALE"] == 256.0
    gfx942 = mla_decode_args._dot_types(torch.bfloat16, torch.float8_e4m3fnuz, GFX942, cfg)
    assert gfx942["V_DTYPE"] == tl.float8e4b8 and gfx942["FP8_MAX"] == 240.0
    sm100 = mla_decode_args._dot_types(
        torch.bfloat16, torch.float8_e4m3fn, TritonTarget("cuda", "sm100", 148), cfg
    )
    assert sm100["QK_FP8"]
    # sm80 has no fp8 dot: the tiles are upcast to q's type.
    sm80 = mla_decode_args._dot_types(
        torch.bfloat16, torch.float8_e4m3fn, TritonTarget("cuda", "sm80", 1), cfg
    )
    assert sm80["K_DTYPE"] == tl.bfloat16 and not sm80["QK_FP8"] and sm80["P_SCALE"] == 1.0
    # fp8 P.V on sm90 takes V through registers; without it V is upcast to fp16 as loaded,
    # behind an opaque move (NVIDIA) or a select of the keys in range (AMD); P is not lifted.
    assert sm90["V_MODE"] == "fp8_registers" and gfx942["V_MODE"] == "direct"
    assert sm80["V_MODE"] == "upcast_ptx" and sm80["V_DTYPE"] == tl.float16
    fp16_pv = replace(cfg, fp8_pv=False)
    for target, mode in ((SM90, "upcast_ptx"), (GFX942, "upcast_masked")):
        types = mla_decode_args._dot_types(torch.bfloat16, torch.float8_e4m3fn, target, fp16_pv)
        assert (types["V_MODE"], types["V_DTYPE"], types["P_SCALE"]) == (mode, tl.float16, 1.0)
        assert types["QK_FP8"] and not types["PV_FP8"]
    fp32_q = mla_decode_args._dot_types(torch.float32, torch.float8_e4m3fn, SM90, fp16_pv)
    assert fp32_q["V_DTYPE"] == tl.float32
    assert mla_decode_args._dot_types(torch.bfloat16, torch.bfloat16, SM90, fp16_pv)["V_MODE"] == (
        "direct"
    )
    here = triton_target()
    if here.backend == "interpreter":
        emu = mla_decode_args._dot_types(torch.float32, torch.float8_e4m3fn, here, cfg)
        assert emu["K_DTYPE"] == tl.float32 and emu["FP8_EMULATE_MIN_EXP"] == -6.0
    assert math.isclose(
        mla_decode_args._dot_types(torch.bfloat16, torch.bfloat16, SM90, cfg)["P_SCALE"], 1.0
    )


# ---- AMD row-owned configs: rows_per_warp and the groups they shrink to ----------------------


def test_row_owned_groups_pad_the_fewest_rows():
    config = tables.LaunchConfig(
        block_h=64, block_n=16, num_warps=4, num_stages=2, dv_chunks=2, rows_per_warp=16
    )
    fitted = {
        rows: (c.block_h, c.num_warps)
        for rows in (16, 24, 48, 64, 96, 128, 192)
        for c in [mla_decode_args.group_config(config, rows)]
    }
    assert fitted == {
        16: (32, 2),
        24: (32, 2),
        48: (64, 4),
        64: (64, 4),
        96: (32, 2),
        128: (64, 4),
        192: (64, 4),
    }
    with pytest.raises(ValueError, match="rows_per_warp"):
        tables.LaunchConfig(block_h=64, block_n=16, num_warps=2, num_stages=1, rows_per_warp=16)


def test_fewest_padded_rows_from_64_rows_and_the_floor():
    """Without rows_per_warp: under 64 rows the next power of two; from 64 on the BLOCK_H
    (down to a quarter) that pads the fewest rows; never under min_block_h."""
    config = tables.LaunchConfig(block_h=64, block_n=64, num_warps=8, num_stages=2)
    fitted = {
        rows: mla_decode_args.group_config(config, rows).block_h for rows in (12, 48, 64, 80, 96)
    }
    assert fitted == {12: 16, 48: 64, 64: 64, 80: 16, 96: 32}
    floor = replace(config, min_block_h=64)
    assert {mla_decode_args.group_config(floor, rows).block_h for rows in (12, 48, 96)} == {64}
    with pytest.raises(
        ValueError, match="min_block_h must be a power of two in \\[16, block_h\\], got 128"
    ):
        replace(config, min_block_h=128)
    with pytest.raises(ValueError, match="shrunk_num_stages must be >= 1, got 0"):
        replace(config, shrunk_num_stages=0)


#: Kimi-K3 shapes on MI300X / MI355X (12 heads per rank at TP 8, 24 at TP 4, 96 at TP 1, with
#: verify windows) and H16 / H128: every row-owned group the planner can pick.
ROW_OWNED_SHAPES = [(96, 1), (12, 8), (24, 4), (128, 1), (16, 4), (24, 1)]


@pytest.mark.parametrize("target", [GFX942, GFX950], ids=lambda t: t.arch)
@pytest.mark.parametrize(("heads", "q_len"), ROW_OWNED_SHAPES)
@pytest.mark.parametrize("kind", ["16bit", "fp8"])
def test_amd_compute_bound_configs_on_the_interpreter(target, heads, q_len, kind):
    """The planned AMD config of each shape, BLOCK_H/num_warps as fitted, against torch;
    where the shape has 64 rows or more, every wave owns distinct rows."""
    fp8 = torch.float8_e4m3fnuz if target.arch == "gfx942" else torch.float8_e4m3fn
    kv_dtype = fp8 if kind == "fp8" else torch.bfloat16
    config = kernel.default_config(target, num_heads=heads, q_len=q_len, kv_dtype=kv_dtype)
    config = mla_decode_args.group_config(config, heads * q_len)
    # fp8 keeps the replicated 16-row entry (the row-owned ones spill, tuned_configs).
    if heads * q_len >= 64 and kind != "fp8":
        assert config.rows_per_warp == 16 and config.block_h == 16 * config.num_warps
        assert -(-(heads * q_len) // config.block_h) * config.block_h <= 1.15 * heads * q_len
        assert config.num_stages >= 2
    # 69 keys: two pieces, cut; a window of up to 7 keys (62..68) across the cut at 64.
    if kind == "fp8":
        q, kv, bt, lens = prepared([69, 5], heads=heads, q_len=q_len, seed=heads)
        kv8 = (kv.float() / 0.25).to(fp8)
        out, lse = run_kernel(q, kv8, bt, lens, config=config, cut=True, kv_scale=0.25)
        assert_fp8_dot_result(out, lse, q, kv8, bt, lens, 0.25, config)
        return
    q, kv, bt, lens = prepared([69, 5], heads=heads, q_len=q_len, dtype=torch.float16, seed=heads)
    out, lse = run_kernel(q, kv, bt, lens, config=config, cut=True)
    ref_out, ref_lse = rocm_mla.mla_decode(q, kv, bt, lens, backend="torch")
    assert_same_attention(out, lse, ref_out, ref_lse, TOL[torch.float16])


def test_stage1_refuses_partials_without_a_slot_for_every_row_of_a_group():
    """Stage 1 stores a cut unit's partial unmasked, a row for each of the group's BLOCK_H
    rows (pad rows included), with unit strides in the last dims; ``stage1_arguments``
    refuses any other partial buffer (and final rows whose S_q and H are not adjacent)
    before the launch."""
    q, kv, bt, lens = prepared([20, 3], heads=20, q_len=3)
    config = tables.LaunchConfig(block_h=64, block_n=16, num_warps=4, num_stages=1)
    target = triton_target()
    dot_types = mla_decode_args._dot_types(q.dtype, kv.dtype, target, config)
    tables_ = sch.host_schedule([20, 3], num_groups=1, num_slots=2, capacity_keys=32)
    out = torch.empty(2, 3, 20, 512, device=DEVICE)
    lse = torch.empty(2, 3, 20, device=DEVICE)

    def arguments(part_out, part_lse, out=out, lse=lse):
        return mla_decode_args.stage1_arguments(
            q, None, kv, bt, lens, tables_.launch_order, tables_.segments, out, lse,
            part_out, part_lse, None, head_dim_v=512, softmax_scale=0.1, causal=True,
            kv_scale=None, num_groups=1, config=config, target=target, dot_types=dot_types,
        )  # fmt: skip

    part_out, part_lse = mla_decode_args.partial_buffers(2, 64, 512, DEVICE)
    assert part_out.shape == (2, 64, 512) and part_lse.shape == (2, 64)
    grid, _, _ = arguments(part_out, part_lse)
    # One program per launch position of the tables (their capacity: mla_decode launches
    # a host schedule's own count).
    assert grid == (sch.launch_capacity(2, 2, 1),) and tables_.num_programs <= grid[0]
    malformed = [
        (torch.empty(2, 60, 512), torch.empty(2, 60)),  # S_q x H rows, not BLOCK_H
        (torch.empty(2, 2, 64, 512), torch.empty(2, 2, 64)),  # per request, the old layout
        (torch.empty(2, 64, 1024)[..., ::2], part_lse),  # Dv strided
        (part_out, torch.empty(2, 128)[:, ::2]),  # the lse's rows strided
        (part_out, torch.empty(3, 64)),  # an lse of other partials
    ]
    for bad_out, bad_lse in malformed:
        with pytest.raises(RuntimeError, match=r"partials must be \[P, 64, Dv\]"):
            arguments(bad_out.to(DEVICE), bad_lse.to(DEVICE))
    # The final rows: query i, head h at row i x H + h (S_q and H adjacent).
    heads_first = torch.empty(2, 20, 3, 512, device=DEVICE).transpose(1, 2)
    with pytest.raises(RuntimeError, match="out must hold S_q and H adjacent"):
        arguments(part_out, part_lse, out=heads_first)
    heads_first = torch.empty(2, 20, 3, device=DEVICE).transpose(1, 2)
    with pytest.raises(RuntimeError, match="lse must hold S_q and H adjacent"):
        arguments(part_out, part_lse, lse=heads_first)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fnuz])
def test_gfx942_row_owned_windows_run_one_stage_below_triton_3_8(kv_dtype):
    """Triton 3.6's gfx942 builds of the row-owned verify windows spill 34-127 VGPRs with
    two stages (bench static); below 3.8 those windows take one stage, nothing else moves."""
    for heads, q_len in ((24, 2), (12, 4), (128, 2), (96, 8)):
        old = tables.lookup("gfx942", heads, q_len, kv_dtype, (3, 6)).config
        new = tables.lookup("gfx942", heads, q_len, kv_dtype, (3, 8)).config
        assert (old.num_stages, new.num_stages) == (1, 2) and old.rows_per_warp == 16
        assert dataclasses.replace(old, num_stages=2) == new
    for heads, q_len in ((128, 1), (16, 2), (12, 1)):
        old = tables.lookup("gfx942", heads, q_len, kv_dtype, (3, 6))
        assert old == tables.lookup("gfx942", heads, q_len, kv_dtype, (3, 9))
