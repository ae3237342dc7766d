"""What stage 1 is called with: the tuned config for a shape, its row grouping, the dtype
constexprs of the dots, q as stage 1 reads it, the split partials, and the launch's grid,
arguments and constexprs (``stage1_arguments``, shared by ``mla_decode`` and the occupancy
compile). Host code only; the kernel is in ``mla_decode_kernel``.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import triton
import triton.language as tl

from rocm_mla.kernels.quantize_q import quantize_q
from rocm_mla.kernels.target import TritonTarget
from rocm_mla.kernels.tuned_configs import (
    CONFIGS_ENV,
    LaunchConfig,
    RefusedShape,
    TableEntry,
    lookup,
)
from rocm_mla.targets import TargetSpec, target_spec


def _spec(target: TritonTarget | None) -> TargetSpec:
    """``target``'s registry record; no target is the interpreter."""
    return target_spec(None, None) if target is None else target.spec


def target_key(target: TritonTarget | None) -> str:
    """The ``tuned_configs.TABLES`` key of a target: the table its registry record reads
    (another AMD arch reads gfx942's, another NVIDIA GPU the ``fallback`` one)."""
    return _spec(target).table


def table_entry(
    target: TritonTarget | None,
    *,
    num_heads: int = 16,
    q_len: int = 1,
    kv_dtype: torch.dtype = torch.bfloat16,
) -> TableEntry:
    """The tuned-table entry (config and where it comes from) for a shape on ``target``."""
    spec = _spec(target)
    entry = lookup(spec.table, num_heads, q_len, kv_dtype)
    if spec.table != spec.key:
        # A borrowed table: no XCD remap or kpack outside the arch they were written for.
        config = replace(entry.config, num_xcds=spec.xcds, kpack=spec.kpack)
        entry = TableEntry(
            config,
            f"{entry.source} ({spec.table} entry, adapted for {target.arch})",
            entry.refuse,
        )
    return entry


def refusal_reason(
    target: TritonTarget | None,
    *,
    num_heads: int,
    q_len: int,
    kv_dtype: torch.dtype,
) -> str | None:
    """Why the tuned table of ``target`` refuses this shape (``TableEntry.refuse``: the row
    group its entry's config runs the S_q x H rows in), or None."""
    entry = table_entry(target, num_heads=num_heads, q_len=q_len, kv_dtype=kv_dtype)
    rows = q_len * num_heads
    block_h = group_config(entry.config, rows).block_h
    why = entry.refused(block_h)
    if why is None:
        return None
    return (
        f"the {target_key(target)} table refuses S_q {q_len} x {num_heads} heads = {rows} rows "
        f"of a {kv_dtype} cache on {_spec(target).key} ({block_h}-row groups: {why}); pass a "
        f"config, or name a table file with an entry for it in {CONFIGS_ENV}"
    )


def default_config(
    target: TritonTarget | None,
    *,
    num_heads: int = 16,
    q_len: int = 1,
    kv_dtype: torch.dtype = torch.bfloat16,
) -> LaunchConfig:
    """The tuned stage-1 config for a shape on ``target`` (``tuned_configs.py``); raises
    ``RefusedShape`` when the table refuses the shape (``refusal_reason``)."""
    reason = refusal_reason(target, num_heads=num_heads, q_len=q_len, kv_dtype=kv_dtype)
    if reason is not None:
        raise RefusedShape(f"default_config: {reason}")
    return table_entry(target, num_heads=num_heads, q_len=q_len, kv_dtype=kv_dtype).config


def group_config(config: LaunchConfig, rows: int) -> LaunchConfig:
    """``config`` with BLOCK_H fitted to a problem of ``rows`` (S_q x H) query rows.

    Fewer rows than BLOCK_H: BLOCK_H shrinks to the next power of two (at least 16, the
    smallest M a GPU dot takes; padded rows are masked). From 64 rows on (compute-bound)
    BLOCK_H may shrink to a half or a quarter where that pads fewer rows; never below
    ``min_block_h``. With
    ``rows_per_warp`` BLOCK_H and num_warps shrink together to the BLOCK_H that pads the
    fewest rows (ties: the larger), e.g. 96 rows run as three 32-row groups of 2 waves
    rather than two 64-row groups; at least two waves. A shrunk group takes the config's
    ``shrunk_*`` options where set.
    """
    shrunk = {
        "num_stages": config.num_stages
        if config.shrunk_num_stages is None
        else config.shrunk_num_stages,
        "prefetch_ids": config.prefetch_ids
        if config.shrunk_prefetch_ids is None
        else config.shrunk_prefetch_ids,
        "keys_as_m": config.keys_as_m
        if config.shrunk_keys_as_m is None
        else config.shrunk_keys_as_m,
        "block_n": config.block_n if config.shrunk_block_n is None else config.shrunk_block_n,
    }
    if config.rows_per_warp is None:
        block_h = max(config.min_block_h, min(config.block_h, triton.next_power_of_2(rows)))
        # A compute-bound request (>= 64 rows) pads the fewest rows (ties: the larger
        # BLOCK_H), e.g. 96 rows as three 32-row groups: padded rows cost issue slots there,
        # one more read of each KV tile (from L2, by the programs next to it) does not.
        if rows >= 64:
            for smaller in (block_h // 2, block_h // 4):
                if smaller >= config.min_block_h and triton.cdiv(rows, smaller) * smaller < (
                    triton.cdiv(rows, block_h) * block_h
                ):
                    block_h = smaller
        if block_h < config.block_h:
            return replace(config, block_h=block_h, **shrunk)
        return config
    best = config.block_h
    block_h = config.block_h
    # Never a single wave: a one-wave group (16 rows) of a causal verify window spills VGPRs
    # on gfx942/gfx950 in Triton 3.9 (H12 S_q 4, H24 S_q 2), and under 64 rows padding costs
    # no compute-bound issue slots.
    while block_h >= 2 * config.rows_per_warp:
        if triton.cdiv(rows, block_h) * block_h < triton.cdiv(rows, best) * best:
            best = block_h
        block_h //= 2
    if best < config.block_h:
        return replace(config, block_h=best, num_warps=best // config.rows_per_warp, **shrunk)
    return config


_TL_DTYPES = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float8_e4m3fn: tl.float8e4nv,
    torch.float8_e4m3fnuz: tl.float8e4b8,
}
#: Largest finite value of each fp8 flavour, and the power of two the softmax weights (<= 1)
#: are multiplied by before fp8 rounding, so that small weights stay above the subnormals.
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 240.0}
_P_SCALE = {torch.float8_e4m3fn: 256.0, torch.float8_e4m3fnuz: 128.0}


def _dot_types(q_dtype, kv_dtype, target: TritonTarget, config: LaunchConfig) -> dict:
    """The kernel's dtype constexprs: what each dot is fed, and whether Q / P go through fp8.

    The interpreter always computes in fp32 (it multiplies bf16 bit patterns in ``tl.dot``,
    Triton issue 11584, and has no fp8 dot) but still rounds Q and P to fp8 values when the
    config asks (``_to_fp8``), so the CPU tests check the GPU's numerics and scale
    bookkeeping.
    """
    fp8 = kv_dtype in _FP8_MAX
    interpreting = target.backend == "interpreter"
    fp8_dots = target.spec.fp8_dots
    qk_fp8 = fp8 and config.fp8_qk and fp8_dots
    pv_fp8 = fp8 and config.fp8_pv and fp8_dots
    upcast = torch.float32 if interpreting or q_dtype == torch.float32 else q_dtype
    fp8_dtype = kv_dtype if fp8 else torch.float8_e4m3fn
    if interpreting or not fp8:
        v_mode, v_dtype = "direct", kv_dtype if pv_fp8 and not interpreting else upcast
    elif pv_fp8:
        # NVIDIA's fp8 P.V takes V transposed (K-major), through registers.
        v_mode = "fp8_registers" if target.backend == "cuda" else "direct"
        v_dtype = kv_dtype
    else:
        # fp16, not q's bf16: fp8 values convert to it exactly in one step, and P (<= 1)
        # keeps 3 more mantissa bits.
        v_mode = "upcast_ptx" if target.backend == "cuda" else "upcast_masked"
        v_dtype = torch.float32 if upcast == torch.float32 else torch.float16
    return {
        "K_DTYPE": _TL_DTYPES[kv_dtype if qk_fp8 and not interpreting else upcast],
        "V_DTYPE": _TL_DTYPES[v_dtype],
        "QK_FP8": qk_fp8,
        "PV_FP8": pv_fp8,
        # How V reaches P.V (mla_decode_kernel._attend_tile).
        "V_MODE": v_mode,
        "FOLD_IN_BRANCH": target.backend != "hip",
        "KEYS_AS_M": config.keys_as_m,
        # NVIDIA: stage 1 recomputes its output rows after the walk (an opaque mov).
        "REMAT_ROWS": target.backend == "cuda",
        "FP8_DTYPE": _TL_DTYPES[fp8_dtype],
        # Smallest normal exponents: e4m3fn 2^-6, e4m3fnuz 2^-7.
        "FP8_EMULATE_MIN_EXP": (-6.0 if fp8_dtype == torch.float8_e4m3fn else -7.0)
        if interpreting
        else None,
        "FP8_MAX": _FP8_MAX[fp8_dtype],
        "P_SCALE": _P_SCALE[fp8_dtype] if pv_fp8 else 1.0,
    }


def stage1_q(
    q: torch.Tensor, kv_dtype: torch.dtype, dot_types: dict, target: TritonTarget
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(the q stage 1 reads, its per-row scales or None)``: with fp8 ``Q K^T`` q quantized
    per row by ``quantize_q`` (fp8 values in fp32 under the interpreter), else q itself.
    Packed windows (``q [T, H, D]``) come back in that shape."""
    if not dot_types["QK_FP8"]:
        return q, None
    interpreting = target.backend == "interpreter"
    packed = q.dim() == 3
    quantized, scale = quantize_q(
        q.unsqueeze(1) if packed else q,
        out_dtype=torch.float32 if interpreting else kv_dtype,
        out_tl_dtype=dot_types["K_DTYPE"],
        fp8_dtype=dot_types["FP8_DTYPE"],
        emulate_min_exp=dot_types["FP8_EMULATE_MIN_EXP"],
        fp8_max=dot_types["FP8_MAX"],
    )
    return (quantized.squeeze(1), scale) if packed else (quantized, scale)


def partial_buffers(
    capacity: int, group_rows: int, head_dim_v: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1's fp32 partials ``(out [capacity, group_rows, Dv], lse [capacity, group_rows])``
    for a schedule's cut units: one slot per segment of such a unit, with a row for every
    row of its group (BLOCK_H, padding rows included), so stage 1 stores them unmasked."""
    return (
        torch.empty(capacity, group_rows, head_dim_v, dtype=torch.float32, device=device),
        torch.empty(capacity, group_rows, dtype=torch.float32, device=device),
    )


def no_op_guard(target: TritonTarget, *, causal: bool, q_len: int, row_bounds: bool = False) -> str:
    """How stage 1 skips a program with nothing to do (``_mla_decode_stage1``), in the form
    that compiles without spills (bench static): ``"branch"`` on NVIDIA and the
    interpreter, on AMD ``"loop"`` (a loop of at most one trip) at verify windows (causal,
    or rows with their own bounds) and ``"mask"`` (the walk with every row masked off)
    elsewhere."""
    if target.backend != "hip":
        return "branch"
    return "loop" if (causal and q_len > 1) or row_bounds else "mask"


def stage1_arguments(
    q: torch.Tensor,
    q_scale: torch.Tensor | None,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    launch_order: torch.Tensor,
    segments: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    fault_flag: torch.Tensor | None,
    *,
    head_dim_v: int,
    softmax_scale: float,
    causal: bool,
    kv_scale: float | None,
    num_groups: int,
    config: LaunchConfig,
    target: TritonTarget,
    dot_types: dict,
    query_start_loc: torch.Tensor | None = None,
    max_q_len: int | None = None,
    row_seqlens: torch.Tensor | None = None,
) -> tuple[tuple[int], tuple, dict]:
    """``(grid, args, kwargs)`` of the stage-1 launch: what ``mla_decode`` runs and what
    ``programs_per_cu`` compiles (on meta tensors) to read the kernel's resources. ``q`` and
    ``q_scale`` as ``stage1_q`` gives them; ``dot_types`` from the caller's q dtype.
    ``launch_order`` / ``segments``: a schedule's tables (``schedule``), one program per
    launch position; ``out`` / ``lse`` the final ``[B, S_q, H(, Dv)]`` rows, ``part_out`` /
    ``part_lse`` the ``partial_buffers`` of its cut units. With ``query_start_loc`` (``[B + 1]``)
    the windows are packed: ``q [T, H, D]``, ``out [T, H, Dv]``, ``lse [T, H]``, and
    ``max_q_len`` the longest; ``row_seqlens`` (``[T]``): every query row's KV bound."""
    varlen = query_start_loc is not None
    if varlen:
        # A token's rows sit where a uniform window's position would: stride_q_i / the
        # output's position stride step one token, and stride_q_b is unused.
        q_len = max_q_len
        _, num_heads, head_dim = q.shape
        q_strides = (q.stride(0), q.stride(0), q.stride(1))
        out = out.unsqueeze(1)
        lse = lse.unsqueeze(1)
    else:
        _, q_len, num_heads, head_dim = q.shape
        q_strides = (q.stride(0), q.stride(1), q.stride(2))
    rope_dim = head_dim - head_dim_v
    dequant = 1.0 if kv_scale is None else float(kv_scale)
    padded_dv = max(16, triton.next_power_of_2(head_dim_v))
    # Two V halves only when each half is still a whole dot tile.
    dv_chunks = config.dv_chunks if padded_dv >= 32 else 1
    grid = (launch_order.shape[0],)
    # A causal verify window's own keys (S_q - 1) go through tail tiles of BLOCK_W keys: as
    # few as hold them, at least the K of one dot (32 for fp8 operands), at most BLOCK_N.
    fp8_dot = dot_types["QK_FP8"] or dot_types["PV_FP8"]
    block_w = min(
        config.block_n, max(32 if fp8_dot else 16, triton.next_power_of_2(max(q_len - 1, 1)))
    )
    if config.keys_as_m:
        # Keys are the dots' M: a tail tile of fewer keys than the walk's would pad them.
        block_w = config.block_n
    # Stage 1 addresses an output row (query i, head h) as row i x H + h, and a partial's
    # rows (a slot for each of BLOCK_H) and values with unit strides: the buffers are ours.
    # Packed windows step a token with the first stride: it must be H rows.
    for name, buffer in (("out", out), ("lse", lse)):
        token_stride = buffer.stride(0) if varlen else buffer.stride(1)
        if token_stride != num_heads * buffer.stride(2):
            raise RuntimeError(
                f"stage1_arguments: {name} must hold S_q and H adjacent (a token's stride "
                f"== H x stride(2)), got strides {buffer.stride()}"
            )
    if (
        part_out.dim() != 3
        or part_out.shape[1] != config.block_h
        or part_out.stride(2) != 1
        or tuple(part_lse.shape) != tuple(part_out.shape[:2])
        or part_lse.stride(1) != 1
    ):
        raise RuntimeError(
            f"stage1_arguments: partials must be [P, {config.block_h}, Dv] and [P, "
            f"{config.block_h}] with unit strides in their last dims, got "
            f"{tuple(part_out.shape)} {part_out.stride()} and {tuple(part_lse.shape)} "
            f"{part_lse.stride()}"
        )
    args = (
        q,
        # Without fp8 Q any pointer will do: QK_FP8=False never reads it.
        part_lse if q_scale is None else q_scale,
        kv_cache,
        block_table,
        cache_seqlens,
        # Without packed windows or row bounds any pointer will do: they are never read.
        cache_seqlens if query_start_loc is None else query_start_loc,
        cache_seqlens if row_seqlens is None else row_seqlens,
        launch_order,
        segments,
        out,
        lse,
        part_out,
        part_lse,
        # Without a flag any pointer will do: HAS_FAULT_FLAG=False compiles the atomic away.
        part_lse if fault_flag is None else fault_flag,
        softmax_scale * dequant * math.log2(math.e),
        dequant / dot_types["P_SCALE"],
        num_groups,
        kv_cache.shape[0],
        block_table.shape[1],
        *q_strides,
        kv_cache.stride(0),
        kv_cache.stride(1),
        block_table.stride(0),
        out.stride(0),
        out.stride(2),
        lse.stride(0),
        lse.stride(2),
        part_out.stride(0),
        part_out.stride(1),
        part_lse.stride(0),
    )
    kwargs = dict(
        Q_LEN=q_len,
        NUM_HEADS=num_heads,
        HEAD_DIM_V=head_dim_v,
        ROPE_DIM=rope_dim,
        PAGE_SIZE=kv_cache.shape[1],
        CAUSAL=bool(causal),
        BLOCK_H=config.block_h,
        BLOCK_N=config.block_n,
        BLOCK_W=block_w,
        BLOCK_DV=padded_dv // dv_chunks,
        DV_CHUNKS=dv_chunks,
        BLOCK_DR=max(16, triton.next_power_of_2(rope_dim)),
        NUM_XCDS=config.num_xcds,
        HAS_FAULT_FLAG=fault_flag is not None,
        PREFETCH_IDS=config.prefetch_ids,
        VARLEN=varlen,
        ROW_BOUNDS=row_seqlens is not None,
        NO_OP_GUARD=no_op_guard(
            target, causal=bool(causal), q_len=q_len, row_bounds=row_seqlens is not None
        ),
        # FP8_MAX is quantize_q's.
        **{k: v for k, v in dot_types.items() if k != "FP8_MAX"},
        **config.launch_options(target),
    )
    return grid, args, kwargs
