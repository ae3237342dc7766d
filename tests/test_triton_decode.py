"""The Triton MLA decode against the torch backend, on the CPU interpreter or a GPU.

With no GPU, conftest switches on ``TRITON_INTERPRET=1``; the interpreter runs programs one
at a time in numpy, so the grid below is a hand-picked list (not a cartesian product) that
still covers every value the contract names: batch 1..4, heads 1/16/20/128, S_q 1..4, block
sizes 1/16/64, lengths 0/1/odd/>= 2K, forced slots 1/4/7/32 (the balanced schedule then cuts
requests longer than one 64-key piece across several slots where its cost model finds that
cheaper, and stage 2 merges their partials; each case states whether its schedule cuts), NaN
in every unused cache slot.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

import rocm_mla
from rocm_mla.backends.triton import TritonMLAImpl
from rocm_mla.inputs import prepare_decode
from rocm_mla.kernels import mla_decode as kernel
from rocm_mla.kernels import mla_decode_args
from rocm_mla.kernels.plan import MAX_SPLITS, MIN_TOKENS_PER_SPLIT
from rocm_mla.kernels.target import TritonTarget, triton_target
from tests.reference import assert_same_attention, dense_mla_decode, make_paged_problem
from tests.schedule_helpers import cut_requests, num_groups

if TritonMLAImpl.unavailable_reason() is not None:
    pytest.skip(TritonMLAImpl.unavailable_reason(), allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def problem(lengths, *, heads, q_len, block, dtype=torch.float32, seed=0, head_dim=576):
    q, kv, bt, lens = make_paged_problem(
        lengths,
        num_heads=heads,
        q_len=q_len,
        block_size=block,
        head_dim=head_dim,
        dtype=dtype,
        seed=seed,
    )
    return q.to(DEVICE), kv.to(DEVICE), bt.to(DEVICE), lens.to(DEVICE)


def run_both(q, kv, bt, lens, *, slots=None, causal=True, kv_scale=None, head_dim_v=512):
    impl = TritonMLAImpl(
        num_heads=q.shape[2],
        head_dim_v=head_dim_v,
        rope_dim=q.shape[3] - head_dim_v,
        num_slots=slots,
    )
    got = impl.forward(q, kv, bt, lens, causal=causal, kv_scale=kv_scale)
    want = rocm_mla.mla_decode(
        q, kv, bt, lens, causal=causal, kv_scale=kv_scale, head_dim_v=head_dim_v, backend="torch"
    )
    return got, want


def cut(q, kv, bt, lens, slots, *, config=None):
    """The requests the schedule of this call cuts across ``slots`` slots (tuned config)."""
    groups = num_groups(heads=q.shape[2], q_len=q.shape[1], kv_dtype=kv.dtype, config=config)
    return cut_requests(lens, groups=groups, slots=slots, capacity_keys=bt.shape[1] * kv.shape[1])


# Each row is one case; together they cover every listed value (see the module docstring).
GRID = [
    # lengths,            heads, S_q, block, dtype,       slots, the requests it cuts
    ([1, 0, 37, 2], 16, 1, 16, torch.float32, None, None),
    ([2053], 16, 1, 64, torch.float32, 7, {0}),
    ([2049, 5], 20, 2, 1, torch.float16, 32, {0}),
    ([9, 3, 130], 128, 4, 16, torch.float16, 7, {2}),
    ([300, 1, 0], 1, 3, 64, torch.float32, 4, {0}),
    ([131], 16, 4, 1, torch.float32, 1, set()),
    ([3, 1, 0, 2], 20, 4, 16, torch.float32, 7, set()),  # 20 units of one piece, 7 slots
    ([65, 2100], 1, 2, 16, torch.float16, 1, set()),
    ([511], 128, 1, 64, torch.float32, 32, {0}),
]


@pytest.mark.parametrize(("lengths", "heads", "q_len", "block", "dtype", "slots", "cuts"), GRID)
def test_triton_matches_torch(lengths, heads, q_len, block, dtype, slots, cuts):
    q, kv, bt, lens = problem(
        lengths, heads=heads, q_len=q_len, block=block, dtype=dtype, seed=sum(lengths)
    )
    if slots is not None:
        assert cut(q, kv, bt, lens, slots) == cuts
    (out, lse), (ref_out, ref_lse) = run_both(q, kv, bt, lens, slots=slots)
    assert_same_attention(out, lse, ref_out, ref_lse, TOL[dtype])


def test_public_api_and_non_causal_and_4d_cache():
    q, kv, bt, lens = problem([70, 0, 5], heads=16, q_len=3, block=16, seed=3)
    for causal in (True, False):
        out, lse = rocm_mla.mla_decode(
            q, kv.unsqueeze(2), bt, lens, causal=causal, backend="triton"
        )
        ref_out, ref_lse = rocm_mla.mla_decode(q, kv, bt, lens, causal=causal, backend="torch")
        assert_same_attention(out, lse, ref_out, ref_lse, TOL[torch.float32])


def test_strided_inputs():
    """q with permuted strides and a non-unit last stride; a block table that is a view."""
    q, kv, bt, lens = problem([70, 9], heads=16, q_len=2, block=16, seed=8)
    ref_out, ref_lse = rocm_mla.mla_decode(q, kv, bt, lens, backend="torch")
    q_strided = torch.empty(*q.shape[:3], 2 * q.shape[3], device=DEVICE)[..., ::2]
    q_strided.copy_(q)
    q_permuted = q.transpose(1, 2).contiguous().transpose(1, 2)
    wide_table = torch.zeros(bt.shape[0], 2 * bt.shape[1], dtype=torch.int32, device=DEVICE)
    wide_table[:, ::2] = bt
    for q_in, table in ((q_strided, bt), (q_permuted, wide_table[:, ::2])):
        out, lse = rocm_mla.mla_decode(q_in, kv, table, lens, backend="triton")
        assert_same_attention(out, lse, ref_out, ref_lse, TOL[torch.float32])


def test_small_head_dims_against_dense_reference():
    """Dv and rope that are not the production 512 + 64 (non-power-of-two Dv, masked), the
    130-key request cut across slots (partials and merge of Dv 72)."""
    q, kv, bt, lens = problem([45, 130], heads=16, q_len=2, block=16, head_dim=100, seed=4)
    assert cut(q, kv, bt, lens, 4) == {1}
    impl = TritonMLAImpl(num_heads=16, head_dim_v=72, rope_dim=28, num_slots=4)
    out, lse = impl.forward(q, kv, bt, lens)
    ref_out, ref_lse = dense_mla_decode(q.cpu(), kv.cpu(), bt.cpu(), lens.cpu(), head_dim_v=72)
    assert_same_attention(out.cpu(), lse.cpu(), ref_out.float(), ref_lse.float(), 1e-5)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
def test_fp8_cache_matches_torch_on_dequantized_cache(fp8):
    if fp8 not in TritonMLAImpl.capabilities.kv_dtypes:
        pytest.skip(f"{fp8} is not this target's fp8 ({TritonMLAImpl.target()})")
    q, kv, bt, lens = problem([77, 1, 0, 40], heads=16, q_len=2, block=1, seed=5)
    scale = 0.37
    kv8 = (kv / scale).to(fp8)  # NaN slots stay NaN in both fp8 flavours
    assert cut(q, kv8, bt, lens, 8) == {0}
    (out, lse), _ = run_both(q, kv8, bt, lens, slots=8, kv_scale=scale)
    ref_out, ref_lse = rocm_mla.mla_decode(q, kv8.float() * scale, bt, lens, backend="torch")
    assert_same_attention(out, lse, ref_out, ref_lse, TOL[torch.float32])


def test_amd_tile_shape_and_xcd_remap_under_any_target():
    """The gfx942 stage-1 shape (16 rows x 16 keys) with the 8-XCD program-id remap.

    The remap must be a bijection over any grid size: a lost slot would leave its segments
    (final rows or partials) unwritten.
    """
    config = kernel.LaunchConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, num_xcds=8)
    q, kv, bt, lens = problem([150, 17, 0], heads=20, q_len=2, block=16, seed=6)
    p = prepare_decode(
        q, kv, bt, lens, head_dim_v=512, softmax_scale=None, causal=True, kv_scale=None
    )
    ref_out, ref_lse = rocm_mla.mla_decode(q, kv, bt, lens, backend="torch")
    for slots in (1, 4, 5):  # grids of 1, 4 and 5 slots: none divides by 8
        assert cut(q, kv, bt, lens, slots, config=config) == (set() if slots == 1 else {0})
        out, lse = kernel.mla_decode(
            p.q,
            p.kv_cache,
            p.block_table,
            p.cache_seqlens,
            head_dim_v=512,
            softmax_scale=p.softmax_scale,
            num_slots=slots,
            config=config,
        )
        assert_same_attention(out, lse, ref_out, ref_lse, TOL[torch.float32])


def test_bfloat16_runs_with_fp32_tiles():
    """bf16 q and cache: on the interpreter the tiles are upcast (Triton issue 11584)."""
    q, kv, bt, lens = problem([33, 90], heads=16, q_len=1, block=16, dtype=torch.bfloat16)
    assert cut(q, kv, bt, lens, 4) == {1}
    (out, lse), (ref_out, ref_lse) = run_both(q, kv, bt, lens, slots=4)
    assert_same_attention(out, lse, ref_out, ref_lse, TOL[torch.bfloat16])


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(0, 150), min_size=1, max_size=3),
    heads=st.sampled_from([1, 3, 16, 20]),
    q_len=st.integers(1, 4),
    block=st.sampled_from([1, 16, 64]),
    slots=st.sampled_from([None, 1, 2, 5]),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
# Found by this test (with split partials then): one request whose row pads its group.
@example(lengths=[0], heads=1, q_len=1, block=1, slots=2, causal=False, seed=0)
# The same one-row request long enough to be cut: its padded row group through partials.
@example(lengths=[150], heads=1, q_len=1, block=1, slots=2, causal=False, seed=0)
def test_fuzz_triton_against_torch(lengths, heads, q_len, block, slots, causal, seed):
    q, kv, bt, lens = problem(
        lengths, heads=heads, q_len=q_len, block=block, head_dim=48, seed=seed
    )
    (out, lse), (ref_out, ref_lse) = run_both(
        q, kv, bt, lens, slots=slots, causal=causal, head_dim_v=32
    )
    assert_same_attention(out, lse, ref_out, ref_lse, TOL[torch.float32])


# ---- split heuristic and launch configuration (pure Python) ---------------------------------


def test_split_heuristic_bounds():
    cus = 304
    assert kernel.choose_num_kv_splits(8, 1, 0.0, 0, cus) == 1
    assert kernel.choose_num_kv_splits(8, 1, 100.0, 200, cus) == 1  # < 2 x 128 keys
    for batch, groups, length in [(1, 1, 32768), (1, 8, 4096), (32, 1, 16384), (128, 8, 1024)]:
        splits = kernel.choose_num_kv_splits(batch, groups, float(length), length, cus)
        assert 1 <= splits <= MAX_SPLITS
        assert splits == 1 or -(-length // splits) >= MIN_TOKENS_PER_SPLIT
    # One long request on a big GPU: split as far as the bounds allow.
    assert kernel.choose_num_kv_splits(1, 1, 32768.0, 32768, cus) == MAX_SPLITS
    # Programs already fill every compute unit exactly once: splitting only adds overhead.
    assert kernel.choose_num_kv_splits(38, 8, 4096.0, 4096, cus) == 1
    # A serial "machine" (the interpreter) never gains from splitting.
    assert kernel.choose_num_kv_splits(1, 1, 32768.0, 32768, 1) == 1


def test_planned_slots_follow_the_target():
    """The schedule balances over every resident slot: compute units x programs per CU of
    the compiled stage 1, whatever the lengths (they are not an argument any more)."""
    target = triton_target()
    config, slots = kernel.plan_launch(q_len=1, num_heads=16, kv_dtype=torch.bfloat16)
    assert config == mla_decode_args.group_config(kernel.default_config(target, num_heads=16), 16)
    assert slots == target.num_cus * kernel.programs_per_cu(
        config, target, kv_dtype=torch.bfloat16, num_heads=16, q_len=1
    )
    if target.backend == "interpreter":
        assert slots == 1  # programs run one at a time: one slot, nothing is cut


def test_hip_options_only_for_hip_targets():
    gfx942 = TritonTarget("hip", "gfx942", 304)
    gfx950 = TritonTarget("hip", "gfx950", 256)
    sm90 = TritonTarget("cuda", "sm90", 132)
    opts = kernel.default_config(gfx942).launch_options(gfx942)
    assert opts["waves_per_eu"] == 1 and opts["matrix_instr_nonkdim"] == 16
    assert opts["kpack"] == 2
    assert kernel.default_config(gfx942).num_xcds == 8
    assert "kpack" not in kernel.default_config(gfx950).launch_options(gfx950)
    for target in (sm90, TritonTarget("interpreter", None, 1)):
        opts = kernel.default_config(target).launch_options(target)
        assert not {"waves_per_eu", "matrix_instr_nonkdim", "kpack"} & set(opts)
        assert kernel.default_config(target).num_xcds == 1
    # A hip config handed a CUDA target still drops the AMD keywords.
    assert "waves_per_eu" not in kernel.default_config(gfx942).launch_options(sm90)


# ---- the backend as the registry sees it ------------------------------------------------


def test_backend_description():
    target = TritonMLAImpl.target()
    assert target == str(triton_target())
    if DEVICE == "cpu":
        assert target == "interpreter (CPU, slow, for testing)"
        assert TritonMLAImpl.auto_skip_reason() is not None
        assert TritonMLAImpl.capabilities.platforms == ("cpu",)
        assert rocm_mla.available_backends()["triton"] is None
    else:
        assert target.split()[0] in ("hip", "cuda")
        assert TritonMLAImpl.auto_skip_reason() is None
        assert "cpu" not in TritonMLAImpl.capabilities.platforms


def test_num_slots_is_validated_and_cp_is_normalized():
    q, kv, bt, lens = problem([5], heads=16, q_len=1, block=16)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="num_slots"):
            TritonMLAImpl(num_heads=16, num_slots=bad)
        with pytest.raises(ValueError, match="num_slots must be an int >= 1 or None"):
            kernel.mla_decode(q, kv, bt, lens, head_dim_v=512, softmax_scale=0.1, num_slots=bad)
    impl = TritonMLAImpl(16, 512, 64, None, -1, -1, num_slots=2)
    assert (impl.dcp_world_size, impl.dcp_rank) == (1, 0)
    impl.dcp_world_size = -1
    with pytest.raises(ValueError):
        impl.forward(q, kv, bt, lens)


# ---- ahead-of-time compilation for real GPUs, on any machine ---------------------------------

# Runs in a fresh interpreter without TRITON_INTERPRET, so that @triton.jit builds real
# kernels; triton.compile needs a GPUTarget, not a GPU. For every distinct stage-1 config the
# target's tuned table can hand out (each head/S_q bucket and KV kind, BLOCK_H shrunk as
# plan_launch shrinks it), with the constexprs mla_decode would pass, and for the merges and
# the schedule's planner, prints one JSON line per kernel.

#: Builds allowed to spill (none: the fp32-cache entries spilled under the one-trip-loop
#: guard, which stage 1 now uses at AMD verify windows only: ``no_op_guard``). The test
#: fails when a listed one stops spilling, so the list only shrinks.
KNOWN_SPILLS: set[tuple[str, str, str]] = set()

_AOT_SCRIPT = r"""
import json, re, sys
import torch
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rocm_mla.kernels import merge_states as ms, quantize_q as qq
from rocm_mla.kernels.schedule import device as planner_kernels
from rocm_mla.kernels import mla_decode_args as mda, mla_decode_kernel as mdk
from rocm_mla.kernels.target import TritonTarget
from rocm_mla.kernels import tuned_configs as tc

# aligned: the int arguments the runtime specializes as multiples of 16 for every production
# shape (with the pointers, as torch allocates them).
def build(fn, pointers, consts, target, options, aligned=()):
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        else:
            sig[name] = "fp32" if name in ("qk_scale", "out_scale") else "i32"
        if aligned and (name in pointers or name in aligned):
            attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(ASTSource(fn, sig, consts, attrs), target=target, options=options)
    text = kernel.asm.get("amdgcn", "")
    spill = re.search(r"\.vgpr_spill_count:\s+(\d+)", text)
    return {"shared": kernel.metadata.shared, "vgpr_spill": int(spill.group(1)) if spill else 0}

backend, arch = sys.argv[1], sys.argv[2]
if backend == "hip":
    target = GPUTarget("hip", arch, 64)
    fp8 = torch.float8_e4m3fnuz if arch == "gfx942" else torch.float8_e4m3fn
else:
    target = GPUTarget("cuda", int(arch.removeprefix("sm")), 32)
    fp8 = torch.float8_e4m3fn
here = TritonTarget(backend, arch, 1)
kv_dtypes = {"16bit": torch.bfloat16, "fp8": fp8, "fp32": torch.float32}
kernels, used = {}, []
for heads in tc.HEAD_BUCKETS:
    for q_len in tc.Q_LEN_BUCKETS:
        for kind, kv_dtype in kv_dtypes.items():
            entry = mda.table_entry(here, num_heads=heads, q_len=q_len, kv_dtype=kv_dtype)
            used.append(entry)
            config = mda.group_config(entry.config, heads * q_len)
            q_dtype = torch.float32 if kv_dtype == torch.float32 else torch.bfloat16
            kernels.setdefault((config, kv_dtype, q_dtype), []).append((heads, q_len, kind))
tl_name = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8e4nv",
           torch.float8_e4m3fnuz: "fp8e4b8"}
tl_type = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e4m3fnuz: tl.float8e4b8}
for (config, kv_dtype, q_dtype), shapes in kernels.items():
    dot_types = mda._dot_types(q_dtype, kv_dtype, here, config)
    consts = dict(Q_LEN=1, NUM_HEADS=128, HEAD_DIM_V=512, ROPE_DIM=64, PAGE_SIZE=64,
                  CAUSAL=True, BLOCK_H=config.block_h, BLOCK_N=config.block_n,
                  BLOCK_W=min(config.block_n, 32 if kv_dtype == fp8 else 16),
                  BLOCK_DV=512 // config.dv_chunks, DV_CHUNKS=config.dv_chunks, BLOCK_DR=64,
                  NUM_XCDS=config.num_xcds, HAS_FAULT_FLAG=True, PREFETCH_IDS=config.prefetch_ids,
                  VARLEN=False, ROW_BOUNDS=False,
                  NO_OP_GUARD=mda.no_op_guard(here, causal=True, q_len=1),
                  **{k: v for k, v in dot_types.items() if k != "FP8_MAX"})
    # With fp8 Q K^T stage 1 reads q quantized per row (quantize_q).
    q_type = kv_dtype if dot_types["QK_FP8"] else q_dtype
    pointers = {"q_ptr": "*" + tl_name[q_type], "q_scale_ptr": "*fp32",
                "kv_ptr": "*" + tl_name[kv_dtype],
                "block_table_ptr": "*i32", "seqlens_ptr": "*i32", "launch_order_ptr": "*i32",
                "query_start_ptr": "*i32", "row_seqlens_ptr": "*i32",
                "segments_ptr": "*i32", "out_ptr": "*" + tl_name[q_dtype], "lse_ptr": "*fp32",
                "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "fault_ptr": "*i32"}
    missing = [n for n in mdk._mla_decode_stage1.arg_names
               if n.endswith("_ptr") and n not in pointers]
    assert not missing, f"stage-1 pointers without a type here: {missing}"
    # A cache row is 576 elements (a page of them per block): the runtime specializes both
    # KV strides as multiples of 16, which keeps the tile loads vectorized. Lengths, block
    # counts and the q / out strides are left unknown.
    stage1 = build(mdk._mla_decode_stage1, pointers, consts, target, config.launch_options(here),
                   aligned=("stride_kv_block", "stride_kv_token"))
    print(json.dumps({"kernel": "stage1", "config": config.to_dict(), "kv": str(kv_dtype),
                      "shapes": shapes, **stage1}))
table = tc.TABLES[mda.target_key(here)]
unused = [str(k) for k, e in table.items() if not any(e is u for u in used)]
print(json.dumps({"kernel": "coverage", "unused_entries": unused}))
consts = dict(HEAD_DIM_V=512, **ms._merge_blocks(here, 8, 64, 512))
pointers = {"outs_ptr": "*fp32", "lses_ptr": "*fp32", "out_ptr": "*bf16", "out_lse_ptr": "*fp32"}
merge = build(ms._merge_states_kernel, pointers, consts, target, ms.merge_launch_options(here))
print(json.dumps({"kernel": "merge", **merge}))
# Stage 2 of the balanced schedule, for every row-group size stage 1 compiled above.
for block_h in sorted({config.block_h for config, _, _ in kernels}):
    consts = dict(GROUP_ROWS=block_h, HEAD_DIM_V=512, VARLEN=False,
                  **ms._merge_blocks(here, 128, block_h, 512))
    pointers = {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "unit_parts_ptr": "*i32",
                "split_units_ptr": "*i32", "query_start_ptr": "*i32", "out_ptr": "*bf16",
                "out_lse_ptr": "*fp32"}
    pieces = build(ms._merge_pieces_kernel, pointers, consts, target,
                   ms.merge_launch_options(here))
    print(json.dumps({"kernel": "merge_pieces", "group_rows": block_h, **pieces}))
wide = ("keys_ptr", "line_ptr", "first_ptr", "head_ptr")
pointers = {n: "*i64" if n in wide else "*i32"
            for n in planner_kernels._plan_schedule_kernel.arg_names if n.endswith("_ptr")}
planner = build(planner_kernels._plan_schedule_kernel, pointers,
                planner_kernels.PLANNER_CONSTEXPRS, target,
                {"num_warps": planner_kernels.PLAN_WARPS})
print(json.dumps({"kernel": "plan_schedule", **planner}))
pointers = {n: "*i64" if n == "starts_ptr" else "*i32"
            for n in planner_kernels._launch_order_kernel.arg_names if n.endswith("_ptr")}
order = build(planner_kernels._launch_order_kernel, pointers,
              dict(POOL_SHIFT=planner_kernels.POOL_SHIFT, BLOCK=planner_kernels.ORDER_BLOCK),
              target, {"num_warps": 4})
print(json.dumps({"kernel": "launch_order", **order}))
consts = dict(HEAD_DIM=576, BLOCK_R=qq._BLOCK_R, BLOCK_D=1024, FP8_DTYPE=tl_type[fp8],
              OUT_DTYPE=tl_type[fp8], FP8_EMULATE_MIN_EXP=None, FP8_MAX=mda._FP8_MAX[fp8])
pointers = {"q_ptr": "*bf16", "out_ptr": "*" + tl_name[fp8], "scale_ptr": "*fp32"}
quant = build(qq._quantize_q_kernel, pointers, consts, target, {"num_warps": 4})
print(json.dumps({"kernel": "quantize_q", **quant}))
"""

#: Shared memory (LDS) per workgroup: MI300X 64 KB, MI355X 160 KB, H100/H200 227 KB.
_SHARED_LIMIT = {"gfx942": 64 << 10, "gfx950": 160 << 10, "sm90": 227 << 10}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "arch"), [("hip", "gfx942"), ("hip", "gfx950"), ("cuda", "sm90")]
)
def test_default_configs_compile_for_gpus_without_spilling(backend, arch):
    """Every stage-1 config of the target's tuned table (the merges, the schedule's planner,
    the fp8 Q quantization) compiles for MI300X / MI355X / H100 with its launch options (HIP
    knobs included), fits the LDS/shared memory, and spills no VGPRs on AMD. Stage 1 is
    built with the KV strides known to be multiples of 16, as for every 576-wide cache
    (else gfx950's fp8 row-owned groups load the tile byte by byte and spill 24 VGPRs);
    ``bench static`` compiles the planned launches with all of the runtime's
    specialization."""
    import json
    import os
    import subprocess
    import sys

    from triton.backends import backends

    if {"hip": "amd", "cuda": "nvidia"}[backend] not in backends:
        pytest.skip(f"this Triton build has no {backend} backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _AOT_SCRIPT, backend, arch],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    kernels = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    names = [k["kernel"] for k in kernels]
    coverage = kernels[names.index("coverage")]
    assert coverage["unused_entries"] == [], "table entries no lookup reaches"
    kernels.remove(coverage)
    names.remove("coverage")
    # Each KV kind of the table got at least one compiled stage-1 kernel, and each of its
    # row-group sizes a stage-2 merge of the schedule's partials.
    stage1 = [k for k in kernels if k["kernel"] == "stage1"]
    kinds = {shape[2] for k in stage1 for shape in k["shapes"]}
    assert kinds == {"16bit", "fp8", "fp32"}
    groups = {k["config"]["block_h"] for k in stage1}
    assert {k["group_rows"] for k in kernels if k["kernel"] == "merge_pieces"} == groups
    for name in ("merge", "plan_schedule", "launch_order", "quantize_q"):
        assert names.count(name) == 1, names
    known = [k for k in kernels if (arch, k["kernel"], k.get("kv")) in KNOWN_SPILLS]
    for k in kernels:
        assert k["shared"] <= _SHARED_LIMIT[arch], k
        if k not in known:
            assert k["vgpr_spill"] == 0, k
    assert not known or any(k["vgpr_spill"] > 0 for k in known), (
        f"now spill-free, drop from KNOWN_SPILLS: {[(arch, k['kv']) for k in known]}"
    )


# ---- real GPUs only -------------------------------------------------------------------------


@pytest.mark.gpu("triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "q_len"), [(16, 1), (128, 2), (20, 4)])
def test_gpu_production_shapes(dtype, heads, q_len):
    lengths = [4096, 1, 0, 3001, 17, 8191, 640, 2]
    q, kv, bt, lens = problem(lengths, heads=heads, q_len=q_len, block=64, dtype=dtype, seed=9)
    for slots in (None, 1, 7, 32):
        (out, lse), (ref_out, ref_lse) = run_both(q, kv, bt, lens, slots=slots)
        assert_same_attention(out, lse, ref_out, ref_lse, TOL[dtype])


@pytest.mark.gpu("triton", "fp8")
@pytest.mark.parametrize(("heads", "q_len"), [(16, 1), (16, 2), (128, 1)])
def test_gpu_fp8_cache(heads, q_len):
    """The tuned fp8 path (fp8 dots where the GPU has them) with its rounding modelled."""
    from tests.test_triton_tuning import assert_fp8_dot_result

    fp8 = next(d for d in TritonMLAImpl.capabilities.kv_dtypes if d.itemsize == 1)
    q, kv, bt, lens = problem(
        [2048, 5, 300], heads=heads, q_len=q_len, block=64, dtype=torch.bfloat16
    )
    kv8 = (kv.float() / 0.5).to(fp8)
    config = kernel.default_config(triton_target(), num_heads=heads, q_len=q_len, kv_dtype=fp8)
    out, lse = rocm_mla.mla_decode(q, kv8, bt, lens, kv_scale=0.5, backend="triton")
    assert_fp8_dot_result(out, lse, q, kv8, bt, lens, 0.5, config, tol=TOL[torch.bfloat16])


@pytest.mark.rocm
def test_rocm_target_and_knobs():
    target = triton_target()
    assert target.backend == "hip" and TritonMLAImpl.target().startswith("hip gfx")
    fp8 = torch.float8_e4m3fnuz if target.arch == "gfx942" else torch.float8_e4m3fn
    assert fp8 in TritonMLAImpl.capabilities.kv_dtypes
    config = kernel.default_config(target)
    assert "waves_per_eu" in config.launch_options(target)
    # The defaults (HIP knobs, XCD remap on gfx942/gfx950) compile and are correct.
    q, kv, bt, lens = problem([9000, 3], heads=128, q_len=1, block=1, dtype=torch.bfloat16)
    (out, lse), (ref_out, ref_lse) = run_both(q, kv, bt, lens)
    assert_same_attention(out, lse, ref_out, ref_lse, TOL[torch.bfloat16])
