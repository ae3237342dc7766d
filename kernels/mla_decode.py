"""Split-KV absorbed-MLA decode in Triton: one source for HIP, CUDA and the CPU interpreter.

Absorbed MLA is MQA over a latent cache: every query head scores the same ``D = Dv + rope``
wide row per token, and V is the first ``Dv`` columns of that row. The S_q query positions
of a request (a speculative-decoding verify window) also share those rows, so the kernel
folds them into the head axis: row ``r = i * H + h`` of a request is query position ``i``,
head ``h``, and a program serves ``BLOCK_H`` such rows at once.

Stage 1: one program per (request, row group, KV split). It walks its slice of the request's
keys in ``[BLOCK_N, D]`` tiles gathered through the block table. Each tile is loaded once
and serves both ``Q K^T`` (all ``D`` columns) and ``P V`` (its first ``Dv`` columns). The
softmax is online, in fp32 and base 2; each split writes its normalized fp32 output and its
natural-log lse. With one split it writes the final output directly.

Stage 2: the exact LSE merge of the splits (``merge_states.launch_merge``).

fp8 caches carry one per-tensor dequant scale: it multiplies the softmax scale for ``Q K^T``
and the output for ``P V``, so tiles are never rescaled inside the loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from rocm_mla.kernels.merge_states import TritonTarget, launch_merge, triton_target

#: Split-count heuristic (the shape of AITER's): programs should fill whole waves of compute
#: units, and every extra split costs about this many tokens of work (its prologue, the
#: partial it writes and stage 2 reading it back).
SPLIT_OVERHEAD_TOKENS = 84.0
#: Below this many keys per split the overhead dominates; never split finer.
MIN_TOKENS_PER_SPLIT = 256
#: Upper bound on splits (stage 2 reads them all back per output row).
MAX_SPLITS = 32
#: AMD MI300X/MI355X have 8 XCDs, each with its own L2; workgroups go to them round-robin.
_XCDS = {"gfx942": 8, "gfx950": 8}


@dataclass(frozen=True)
class LaunchConfig:
    """Block shapes and launch options of stage 1 (stage 2 has its own, see merge_states).

    ``waves_per_eu``, ``matrix_instr_nonkdim`` and ``kpack`` are AMD compiler options: they are
    passed to the launch only when the target is hip (``None`` leaves them out).
    """

    block_h: int  #: query rows (S_q x heads) per program; the dots' M dimension
    block_n: int  #: keys per tile
    num_warps: int
    num_stages: int
    num_xcds: int = 1  #: > 1 remaps program ids so one request's programs share an XCD
    waves_per_eu: int | None = None
    matrix_instr_nonkdim: int | None = None
    kpack: int | None = None

    def launch_options(self, target: TritonTarget | None) -> dict:
        options = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if target is not None and target.backend == "hip":
            for key in ("waves_per_eu", "matrix_instr_nonkdim", "kpack"):
                value = getattr(self, key)
                if value is not None:
                    options[key] = value
        return options


def default_config(target: TritonTarget | None) -> LaunchConfig:
    """Per-target stage-1 defaults.

    - gfx942 (MI300X): 64 KB of LDS per CU, so 16-key tiles of 576 columns and no software
      pipelining; one wave per SIMD leaves the registers to the [16, 512] fp32 accumulator;
      16x16 MFMA with kpack 2 (sglang/vLLM's MI3xx settings); 8 XCDs.
    - gfx950 (MI355X): 160 KB of LDS allows double-buffered tiles; 8 warps split the
      accumulator so it fits without spills (32-key tiles with 8 warps spill ~120 VGPRs in
      Triton 3.9's gfx950 code); kpack is deprecated there (the compiler forces 1), so it
      is not passed.
    - Other hip archs: the gfx942 tile shape, no XCD remap.
    - CUDA: 32-key tiles, two stages.
    - Interpreter: 64 rows x 64 keys per program, because every program and every loop
      iteration costs Python time there.
    """
    if target is None or target.backend == "interpreter":
        return LaunchConfig(block_h=64, block_n=64, num_warps=4, num_stages=1)
    if target.backend == "hip":
        if target.arch == "gfx950":
            return LaunchConfig(
                block_h=16,
                block_n=16,
                num_warps=8,
                num_stages=2,
                num_xcds=_XCDS["gfx950"],
                waves_per_eu=1,
                matrix_instr_nonkdim=16,
            )
        return LaunchConfig(
            block_h=16,
            block_n=16,
            num_warps=4,
            num_stages=1,
            num_xcds=_XCDS.get(target.arch or "", 1),
            waves_per_eu=1,
            matrix_instr_nonkdim=16,
            kpack=2 if target.arch == "gfx942" else None,
        )
    return LaunchConfig(block_h=16, block_n=32, num_warps=4, num_stages=2)


def choose_num_kv_splits(
    batch: int, num_groups: int, mean_len: float, max_len: int, num_cus: int
) -> int:
    """Splits per request that best trade compute-unit fill against per-split overhead.

    Score of ``s`` splits = fill x efficiency, where fill = programs / (programs rounded up
    to whole waves of ``num_cus``) with programs = ``batch * num_groups * s``, and efficiency
    = ``mean_len / (mean_len + SPLIT_OVERHEAD_TOKENS * s)``. Candidates run from 1 to
    ``MAX_SPLITS`` while the longest request keeps ``MIN_TOKENS_PER_SPLIT`` keys per split;
    ties go to fewer splits.
    """
    if mean_len <= 0 or max_len <= 0:
        return 1
    best, best_score = 1, -1.0
    for splits in range(1, MAX_SPLITS + 1):
        if splits > 1 and -(-max_len // splits) < MIN_TOKENS_PER_SPLIT:
            break
        programs = batch * num_groups * splits
        fill = programs / (-(-programs // num_cus) * num_cus)
        score = fill * mean_len / (mean_len + SPLIT_OVERHEAD_TOKENS * splits)
        if score > best_score:
            best, best_score = splits, score
    return best


@triton.jit
def _remap_for_xcds(pid, num_programs, NUM_XCDS: tl.constexpr):
    """Renumber program ids so that consecutive new ids run on the same XCD.

    The hardware hands workgroup ``pid`` to XCD ``pid % NUM_XCDS``. Inverting that, XCD ``x``
    receives the contiguous new-id range ``[x * per_xcd, ...)`` (the first ``tall`` XCDs get
    ``per_xcd`` programs, the rest one fewer), so programs that read the same KV tiles (the
    row groups of one request and split, numbered consecutively) share one L2.
    """
    if NUM_XCDS == 1:
        new_pid = pid
    else:
        per_xcd = (num_programs + NUM_XCDS - 1) // NUM_XCDS
        tall = num_programs - (per_xcd - 1) * NUM_XCDS
        xcd = pid % NUM_XCDS
        local = pid // NUM_XCDS
        new_pid = tl.where(
            xcd < tall,
            xcd * per_xcd + local,
            tall * per_xcd + (xcd - tall) * (per_xcd - 1) + local,
        )
    return new_pid


@triton.jit
def _mla_decode_stage1(
    q_ptr,  # [B, S_q, H, D]
    kv_ptr,  # [num_blocks, PAGE_SIZE, D], unit stride in D
    block_table_ptr,  # [B, max_blocks] int32
    seqlens_ptr,  # [B] int32
    out_ptr,  # [splits, B, S_q, H, Dv] (fp32 partials) or [B, S_q, H, Dv] (final, 1 split)
    lse_ptr,  # [splits, B, S_q, H] fp32 or [B, S_q, H]
    qk_scale,  # softmax scale x kv dequant scale x log2(e): scores in base 2
    v_scale,  # kv dequant scale, applied to the output
    num_groups,
    num_splits,
    stride_q_b,
    stride_q_i,
    stride_q_h,
    stride_kv_block,
    stride_kv_token,
    stride_bt_b,
    stride_out_split,
    stride_out_b,
    stride_out_i,
    stride_out_h,
    stride_lse_split,
    stride_lse_b,
    stride_lse_i,
    stride_lse_h,
    Q_LEN: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    NUM_XCDS: tl.constexpr,
):
    num_programs = tl.num_programs(0)
    pid = _remap_for_xcds(tl.program_id(0), num_programs, NUM_XCDS)
    # Row groups vary fastest: consecutive ids read the same KV slice.
    group = pid % num_groups
    split = (pid // num_groups) % num_splits
    b = pid // (num_groups * num_splits)

    seqlen = tl.load(seqlens_ptr + b)
    rows = group * BLOCK_H + tl.arange(0, BLOCK_H)
    row_valid = rows < Q_LEN * NUM_HEADS
    qpos = rows // NUM_HEADS
    head = rows % NUM_HEADS
    # Causal: query i of S_q sees keys [0, L - S_q + i].
    visible = seqlen - (Q_LEN - 1) + qpos if CAUSAL else tl.zeros([BLOCK_H], tl.int32) + seqlen
    visible = tl.where(row_valid, visible, 0)

    # Split s of this request covers keys [s * chunk, (s + 1) * chunk), chunk a multiple of
    # the tile; the slice stops at the furthest key any row of this group may see.
    chunk = tl.cdiv(tl.cdiv(seqlen, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, tl.max(visible, axis=0))

    offs_dv = tl.arange(0, BLOCK_DV)
    offs_dr = tl.arange(0, BLOCK_DR)
    dv_mask = offs_dv < HEAD_DIM_V
    dr_mask = offs_dr < ROPE_DIM
    q_rows = q_ptr + b.to(tl.int64) * stride_q_b + qpos * stride_q_i + head * stride_q_h
    q_nope = tl.load(
        q_rows[:, None] + offs_dv[None, :], mask=row_valid[:, None] & dv_mask[None, :], other=0.0
    ).to(COMPUTE_DTYPE)
    q_rope = tl.load(
        q_rows[:, None] + HEAD_DIM_V + offs_dr[None, :],
        mask=row_valid[:, None] & dr_mask[None, :],
        other=0.0,
    ).to(COMPUTE_DTYPE)

    running_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    block_row = block_table_ptr + b.to(tl.int64) * stride_bt_b

    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        in_range = pos < end
        block = tl.load(block_row + pos // PAGE_SIZE, mask=in_range, other=0)
        token = kv_ptr + block.to(tl.int64) * stride_kv_block + (pos % PAGE_SIZE) * stride_kv_token
        # Masked loads: slots past a request's length may hold NaN, and NaN * 0 is NaN, so
        # they must never enter a product, not even with a zero weight.
        kv_nope = tl.load(
            token[:, None] + offs_dv[None, :],
            mask=in_range[:, None] & dv_mask[None, :],
            other=0.0,
        ).to(COMPUTE_DTYPE)
        kv_rope = tl.load(
            token[:, None] + HEAD_DIM_V + offs_dr[None, :],
            mask=in_range[:, None] & dr_mask[None, :],
            other=0.0,
        ).to(COMPUTE_DTYPE)

        # "ieee": fp32 tiles must not be rounded to tf32 (16-bit inputs are exact anyway).
        scores = tl.dot(q_nope, tl.trans(kv_nope), input_precision="ieee")
        scores = tl.dot(q_rope, tl.trans(kv_rope), scores, input_precision="ieee")
        scores = scores * qk_scale
        scores = tl.where(pos[None, :] < visible[:, None], scores, float("-inf"))

        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        # Rows that have seen no key yet keep weight 0 without ever computing inf - inf.
        ref = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp2(running_max - ref)
        weights = tl.exp2(scores - ref[:, None])
        denom = denom * rescale + tl.sum(weights, axis=1)
        acc = acc * rescale[:, None]
        acc = tl.dot(weights.to(COMPUTE_DTYPE), kv_nope, acc, input_precision="ieee")
        running_max = new_max

    seen = denom > 0
    safe_denom = tl.where(seen, denom, 1.0)
    out = tl.where(seen[:, None], acc * (v_scale / safe_denom)[:, None], 0.0)
    # running_max is in base 2: lse = ln(2) * (max + log2(denom)).
    lse = tl.where(seen, (running_max + tl.log2(safe_denom)) * 0.6931471805599453, float("-inf"))

    out_rows = (
        out_ptr
        + split.to(tl.int64) * stride_out_split
        + b.to(tl.int64) * stride_out_b
        + qpos * stride_out_i
        + head * stride_out_h
    )
    tl.store(out_rows[:, None] + offs_dv[None, :], out, mask=row_valid[:, None] & dv_mask[None, :])
    lse_rows = (
        lse_ptr
        + split.to(tl.int64) * stride_lse_split
        + b.to(tl.int64) * stride_lse_b
        + qpos * stride_lse_i
        + head * stride_lse_h
    )
    tl.store(lse_rows, lse, mask=row_valid)


def _group_config(config: LaunchConfig, rows: int) -> LaunchConfig:
    """``config`` with BLOCK_H shrunk for problems of fewer rows (S_q x H) than BLOCK_H.

    That cuts padded work (H = 1, S_q = 1), but keeps 16 rows, the smallest M a GPU dot
    takes; padded rows are masked.
    """
    return replace(config, block_h=max(16, min(config.block_h, triton.next_power_of_2(rows))))


def plan_launch(
    *,
    batch: int,
    q_len: int,
    num_heads: int,
    kv_dtype: torch.dtype,
    max_len: int,
    total_len: int,
    target: TritonTarget | None = None,
    config: LaunchConfig | None = None,
) -> tuple[LaunchConfig, int]:
    """The stage-1 launch config and split count for one decode step, from host-known lengths.

    Pure host arithmetic (no tensor is read): ``rocm_mla.plan_decode`` calls it once per step
    and every layer of the step launches with the answer. ``max_len``/``total_len`` are the
    longest and summed cache lengths of the batch (an upper bound works: only speed changes).
    """
    target = triton_target() if target is None else target
    if target is None:
        raise RuntimeError("plan_launch: no Triton target on this machine")
    del kv_dtype  # one table for every KV dtype until per-dtype tuning lands
    config = _group_config(default_config(target) if config is None else config, q_len * num_heads)
    num_groups = triton.cdiv(q_len * num_heads, config.block_h)
    splits = choose_num_kv_splits(
        batch, num_groups, total_len / max(batch, 1), max_len, target.num_cus
    )
    return config, splits


def plan_num_kv_splits(
    cache_seqlens: torch.Tensor,
    q_len: int,
    num_heads: int,
    config: LaunchConfig | None = None,
    target: TritonTarget | None = None,
) -> int:
    """The split count ``mla_decode`` picks when not forced (``choose_num_kv_splits``).

    Reads the lengths back to the host (one sync). The answer depends only on the lengths
    and the shape, so a caller that decodes many layers per step (or a benchmark) can plan
    once and pass ``num_kv_splits`` to every call.
    """
    max_len, total_len = (
        int(v) for v in torch.stack([cache_seqlens.max(), cache_seqlens.sum()]).tolist()
    )
    _, splits = plan_launch(
        batch=cache_seqlens.shape[0],
        q_len=q_len,
        num_heads=num_heads,
        kv_dtype=torch.float32,
        max_len=max_len,
        total_len=total_len,
        target=target,
        config=config,
    )
    return splits


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    head_dim_v: int,
    softmax_scale: float,
    causal: bool = True,
    kv_scale: float | None = None,
    num_kv_splits: int | None = None,
    config: LaunchConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV MLA decode over already validated inputs (``rocm_mla.inputs.prepare_decode``).

    Args:
        q: ``[B, S_q, H, D]`` float32/float16/bfloat16.
        kv_cache: ``[num_blocks, block_size, D]``, unit stride in D; float32/float16/bfloat16
            or fp8 with ``kv_scale``.
        block_table: ``[B, max_blocks]`` int32. cache_seqlens: ``[B]`` int32.
        head_dim_v: V width; ``D - head_dim_v`` is the rope width.
        softmax_scale: the score scale (already resolved, e.g. ``D ** -0.5``).
        causal: query ``i`` sees keys ``[0, L - S_q + i]``; else all ``L``.
        kv_scale: per-tensor dequant scale of an fp8 cache, else None.
        num_kv_splits: force the split count (>= 1); None plans it per call with
            ``plan_num_kv_splits`` (one host sync to read the lengths).
        config: stage-1 launch config; None takes ``default_config`` for this target.

    Returns:
        ``(out [B, S_q, H, Dv] in q's dtype, lse [B, S_q, H] float32)``; rows with no visible
        key get out 0 and lse -inf.
    """
    batch, q_len, num_heads, head_dim = q.shape
    rope_dim = head_dim - head_dim_v
    # The kernel indexes q's last dim, a block-table row and the lengths with unit stride.
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    cache_seqlens = cache_seqlens.contiguous()
    target = triton_target()
    if target is None:
        raise RuntimeError(
            "mla_decode (Triton): no Triton target on this machine; set TRITON_INTERPRET=1 "
            "to run the interpreter on CPU"
        )
    config = _group_config(default_config(target) if config is None else config, q_len * num_heads)
    rows = q_len * num_heads
    num_groups = triton.cdiv(rows, config.block_h)
    if num_kv_splits is None:
        num_kv_splits = plan_num_kv_splits(cache_seqlens, q_len, num_heads, config, target)
    elif isinstance(num_kv_splits, bool) or not isinstance(num_kv_splits, int) or num_kv_splits < 1:
        raise ValueError(
            f"mla_decode: num_kv_splits must be an int >= 1 or None, got {num_kv_splits!r}"
        )

    out = torch.empty(batch, q_len, num_heads, head_dim_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, q_len, num_heads, dtype=torch.float32, device=q.device)
    if num_kv_splits == 1:
        part_out, part_lse = out.unsqueeze(0), lse.unsqueeze(0)
    else:
        part_out = torch.empty(
            num_kv_splits,
            batch,
            q_len,
            num_heads,
            head_dim_v,
            dtype=torch.float32,
            device=q.device,
        )
        part_lse = torch.empty(
            num_kv_splits, batch, q_len, num_heads, dtype=torch.float32, device=q.device
        )

    interpreting = target.backend == "interpreter"
    # The interpreter multiplies bf16 bit patterns in tl.dot (Triton issue 11584), so it gets
    # fp32 tiles; GPUs keep 16-bit dot inputs and accumulate in fp32.
    compute = torch.float32 if interpreting or q.dtype == torch.float32 else q.dtype
    dequant = 1.0 if kv_scale is None else float(kv_scale)
    grid = (batch * num_groups * num_kv_splits,)
    _mla_decode_stage1[grid](
        q,
        kv_cache,
        block_table,
        cache_seqlens,
        part_out,
        part_lse,
        softmax_scale * dequant * math.log2(math.e),
        dequant,
        num_groups,
        num_kv_splits,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        kv_cache.stride(0),
        kv_cache.stride(1),
        block_table.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_out.stride(3),
        part_lse.stride(0),
        part_lse.stride(1),
        part_lse.stride(2),
        part_lse.stride(3),
        Q_LEN=q_len,
        NUM_HEADS=num_heads,
        HEAD_DIM_V=head_dim_v,
        ROPE_DIM=rope_dim,
        PAGE_SIZE=kv_cache.shape[1],
        CAUSAL=bool(causal),
        BLOCK_H=config.block_h,
        BLOCK_N=config.block_n,
        BLOCK_DV=max(16, triton.next_power_of_2(head_dim_v)),
        BLOCK_DR=max(16, triton.next_power_of_2(rope_dim)),
        COMPUTE_DTYPE=_TL_DTYPES[compute],
        NUM_XCDS=config.num_xcds,
        **config.launch_options(target),
    )
    if num_kv_splits > 1:
        launch_merge(
            part_out.view(num_kv_splits, batch * rows, head_dim_v),
            part_lse.view(num_kv_splits, batch * rows),
            out.view(batch * rows, head_dim_v),
            lse.view(batch * rows),
            target,
        )
    return out, lse
