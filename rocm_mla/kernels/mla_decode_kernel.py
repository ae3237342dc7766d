"""Split-KV absorbed-MLA decode in Triton: one source for HIP, CUDA and the CPU interpreter.

Absorbed MLA is MQA over a latent cache: every query head scores the same ``D = Dv + rope``
wide row per token, and V is the first ``Dv`` columns of that row. The S_q query positions
of a request (a speculative-decoding verify window) also share those rows, so the kernel
folds them into the head axis: row ``r = i * H + h`` of a request is query position ``i``,
head ``h``, and a program serves ``BLOCK_H`` such rows at once (64 on Hopper, the M of one
wgmma), so each KV tile is loaded once for all of them.

Stage 1: one program per segment of the balanced schedule (``schedule``): a request, a
row group and a key range. It walks that slice of the request's keys in ``[BLOCK_N, D]``
tiles gathered through the block table. Each tile is loaded once and serves both ``Q K^T``
(all ``D`` columns) and ``P V`` (its first ``Dv`` columns); with ``dv_chunks=2`` the V
columns and the accumulator are two ``Dv/2`` halves, two smaller dots that reuse one ``P``.
The softmax is online, in fp32 and base 2; a segment of a cut unit writes its normalized
fp32 partial and its natural-log lse; a unit's only segment writes the final output.

Stage 2: the exact LSE merge of the partials (``merge_states.launch_merge_pieces``).

fp8 caches carry one per-tensor dequant scale: it multiplies the softmax scale for ``Q K^T``
and the output for ``P V``, so tiles are never rescaled inside the loop. Where the hardware
has fp8 dots (sm89+, gfx942, gfx950) ``Q K^T`` takes the tile as it is, Q quantized per row
once per call before stage 1 (``quantize_q``; its scale joins that row's softmax scale);
``P V`` runs in fp16 on V converted as it is read (an fp8 V operand would be transposed
byte by byte: ``_attend_tile``), or, with a config's ``fp8_pv``, in fp8 with the softmax
weights quantized under a fixed power-of-two lift. Without fp8 dots the tiles are upcast to
Q's 16-bit type.

Non-finite input is never mistaken for "no key": a NaN or infinite score of a key a row may
see (NaN/Inf in q or in a visible cache element, an overflowing scale) makes that row's out
and lse NaN; rows with no visible key give out 0 and lse -inf. In a causal verify window
the keys from the window's first one (``L - S_q + 1``) on are seen by some rows and not
others, and ``0 x NaN`` would still reach the rows that give such a key weight 0. The walk
takes the keys every row sees with one limit for all rows, straight from the loaded tile to
the dots; the window's own keys (at most ``S_q - 1``) follow in small tail tiles whose P.V
leaves out the keys no row scores finitely (a non-finite V element makes every row's score
of its key non-finite), so the rows that do not see such a key never multiply it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from rocm_mla.inputs import (
    FAULT_BEYOND_TABLE,
    FAULT_BLOCK_ID,
    FAULT_NEGATIVE_LENGTH,
    FAULT_ROW_BOUND,
)
from rocm_mla.kernels.quantize_q import to_fp8

_FAULT_BLOCK_ID = tl.constexpr(FAULT_BLOCK_ID)
_FAULT_BEYOND_TABLE = tl.constexpr(FAULT_BEYOND_TABLE)
_FAULT_NEGATIVE_LENGTH = tl.constexpr(FAULT_NEGATIVE_LENGTH)
_FAULT_ROW_BOUND = tl.constexpr(FAULT_ROW_BOUND)
#: Block-table columns stage 1 checks per step of its bad-id scan.
_BLOCK_C = tl.constexpr(256)


@triton.jit
def _fold_scores(
    scores,
    scores_rope,
    pos,
    lo,
    row_scale,
    visible,
    running_max,
    denom,
    ROWS_DIFFER: tl.constexpr,
    ROW_SCALES: tl.constexpr,
    V_DTYPE: tl.constexpr,
    PV_FP8: tl.constexpr,
    FP8_DTYPE: tl.constexpr,
    FP8_EMULATE_MIN_EXP: tl.constexpr,
    P_SCALE: tl.constexpr,
):
    """The online-softmax step of one tile's scores: ``(running_max, denom, rescale, p,
    finite_key)``.

    Keys at or past ``visible`` are not seen (one limit per row with ``ROWS_DIFFER``, and
    none below ``lo``; else one for all). ``ROW_SCALES``: ``row_scale`` is per row (fp8 Q),
    else one scalar."""
    if ROW_SCALES:
        scores = scores * row_scale[:, None] + scores_rope * row_scale[:, None]
    else:
        scores = scores * row_scale + scores_rope * row_scale
    if ROWS_DIFFER:
        seen_key = (pos[None, :] < visible[:, None]) & (pos >= lo)[None, :]
    else:
        seen_key = (pos < visible)[None, :]
    # A NaN or infinite score of a visible key (NaN/Inf in q or the cache, an overflowing
    # scale) must not pass for "no key" or weight 0: it poisons the row's denominator,
    # hence its out and lse. A comparison, not s - s, which FMA contraction may break.
    finite = tl.abs(scores) < float("inf")
    nonfinite = tl.where(seen_key & finite, 0.0, 1.0)
    nonfinite = tl.where(seen_key, nonfinite, 0.0)
    poison = tl.where(tl.max(nonfinite, axis=1) > 0, float("nan"), 0.0)
    # Keys some row scores finitely (unused, hence compiled away, outside GUARD_V tiles).
    # A non-finite element of a key's V (its first Dv columns) makes every row's score of
    # it non-finite, q = 0 padding included; so a key no row scores finitely may drop out
    # of P.V: the rows that see it are poisoned above, the others give it weight 0.
    finite_key = tl.max(finite.to(tl.int32), axis=0) > 0
    scores = tl.where(seen_key, scores, float("-inf"))

    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    # Rows that have seen no key yet keep weight 0 without ever computing inf - inf.
    ref = tl.where(new_max == float("-inf"), 0.0, new_max)
    rescale = tl.exp2(running_max - ref)
    weights = tl.exp2(scores - ref[:, None])
    denom = denom * rescale + tl.sum(weights, axis=1) + poison
    # Weights are <= 1; P_SCALE lifts them off fp8's subnormal floor (undone in out_scale).
    if PV_FP8:
        p = to_fp8(weights * P_SCALE, FP8_DTYPE, V_DTYPE, FP8_EMULATE_MIN_EXP)
    else:
        p = weights.to(V_DTYPE)
    return new_max, denom, rescale, p, finite_key


@triton.jit
def _opaque_upcast(x, V_DTYPE: tl.constexpr):
    """``x`` converted to ``V_DTYPE`` in its own layout, behind a PTX move the compiler
    cannot see through (a move with side effects: a pure one is moved past like any
    elementwise op), so the conversion stays where the tile was read wide (``_attend_tile``:
    why)."""
    x = x.to(V_DTYPE)
    PACK: tl.constexpr = 2 if V_DTYPE.primitive_bitwidth == 16 else 1
    return tl.inline_asm_elementwise(
        "mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=PACK
    )


@triton.jit
def _attend_tile(
    first,  # the tile's first key position
    lo,  # with ROWS_DIFFER: keys below it are not seen
    end,
    block_row,
    kv_ptr,
    num_blocks,
    stride_kv_block,
    stride_kv_token,
    q_nope,
    q_rope,
    q_nope_hi,
    row_scale,
    visible,
    running_max,
    denom,
    acc,
    acc_hi,
    next_block,
    HEAD_DIM_V: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DV_CHUNKS: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    K_DTYPE: tl.constexpr,
    V_DTYPE: tl.constexpr,
    PV_FP8: tl.constexpr,
    V_MODE: tl.constexpr,
    FOLD_IN_BRANCH: tl.constexpr,
    KEYS_AS_M: tl.constexpr,
    FP8_DTYPE: tl.constexpr,
    FP8_EMULATE_MIN_EXP: tl.constexpr,
    P_SCALE: tl.constexpr,
    PREFETCH_IDS: tl.constexpr,
    GUARD_V: tl.constexpr,
    ROWS_DIFFER: tl.constexpr,
    ROW_SCALES: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr,
):
    """One KV tile of stage 1's walk: load it, fold it into the online softmax state.

    ``GUARD_V`` (a verify window's tail tiles, which some rows see and others do not):
    P.V reads V again without the keys no row scores finitely. Keys past ``end`` are not
    loaded, nor seen. ``visible``: the per-row key limits with ``ROWS_DIFFER`` (and ``lo``
    a lower one), else the scalar ``end``. ``TILE_IN_PAGE``: the tile lies in one page (one
    block id; ``next_block`` is then a scalar). Returns ``(running_max, denom, acc, acc_hi,
    next_block)``."""
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_dr = tl.arange(0, BLOCK_DR)
    dv_mask = offs_dv < HEAD_DIM_V
    dv_mask_hi = BLOCK_DV + offs_dv < HEAD_DIM_V
    dr_mask = offs_dr < ROPE_DIM
    pos = first + tl.arange(0, BLOCK_N)
    # pos < end <= capacity: every column read from the table is below max_blocks.
    in_range = pos < end
    if TILE_IN_PAGE:
        if PREFETCH_IDS:
            block = next_block
            ahead = first < end - BLOCK_N
            next_block = tl.load(block_row + (first + BLOCK_N) // PAGE_SIZE, mask=ahead, other=0)
        else:
            block = tl.load(block_row + first // PAGE_SIZE)
    elif PREFETCH_IDS:
        block = next_block
        # The mask compares without pos + BLOCK_N, which may wrap past 2^31 - 1 in lanes
        # it drops.
        ahead = pos < end - BLOCK_N
        next_block = tl.load(block_row + (pos + BLOCK_N) // PAGE_SIZE, mask=ahead, other=0)
    else:
        block = tl.load(block_row + pos // PAGE_SIZE, mask=in_range, other=0)
    # A bad id (as uint32 a negative one is above 2^31) is clamped to the last block for
    # the address only, so every load stays inside kv_cache; the rows that may see such
    # a key are poisoned after the loop whatever it read (first_bad). Cheaper than a
    # second load mask: one unsigned min per key; back to int32 (the result is below
    # num_blocks) so the offset math stays what it was.
    block = tl.minimum(block.to(tl.uint32, bitcast=True), num_blocks - 1)
    block = block.to(tl.int32, bitcast=True)
    if TILE_IN_PAGE:
        token = (
            kv_ptr
            + block.to(tl.int64) * stride_kv_block
            + (first % PAGE_SIZE + tl.arange(0, BLOCK_N)).to(tl.int64) * stride_kv_token
        )
    else:
        token = (
            kv_ptr
            + block.to(tl.int64) * stride_kv_block
            + (pos % PAGE_SIZE).to(tl.int64) * stride_kv_token
        )
    # Masked loads: slots past a request's length may hold NaN, and NaN * 0 is NaN, so
    # they must never enter a product, not even with a zero weight.
    key_mask = in_range[:, None]
    kv_nope = tl.load(
        token[:, None] + offs_dv[None, :], mask=key_mask & dv_mask[None, :], other=0.0
    )
    kv_rope = tl.load(
        token[:, None] + HEAD_DIM_V + offs_dr[None, :], mask=key_mask & dr_mask[None, :], other=0.0
    )
    # "ieee": fp32 tiles must not be rounded to tf32 (16-bit and fp8 inputs are exact).
    # KEYS_AS_M: keys as the dots' M, rows as N: S^T = K Q^T, and (below) O^T = V^T P^T,
    # with Q^T formed once before the walk (so its shared copy is made once, not per tile).
    # sm90's fp8 wgmma has M = 64 (per warpgroup) and N any multiple of 8: a group of 16 or
    # 32 rows then issues no padded rows. The softmax step works on S (a transpose is a
    # layout change); the accumulator is carried as O^T.
    if KEYS_AS_M:
        scores = tl.dot(kv_nope.to(K_DTYPE), q_nope, input_precision="ieee")
    else:
        scores = tl.dot(q_nope, tl.trans(kv_nope.to(K_DTYPE)), input_precision="ieee")
    if DV_CHUNKS == 2:
        kv_nope_hi = tl.load(
            token[:, None] + BLOCK_DV + offs_dv[None, :],
            mask=key_mask & dv_mask_hi[None, :],
            other=0.0,
        )
        if KEYS_AS_M:
            scores = tl.dot(kv_nope_hi.to(K_DTYPE), q_nope_hi, scores, input_precision="ieee")
        else:
            scores = tl.dot(
                q_nope_hi, tl.trans(kv_nope_hi.to(K_DTYPE)), scores, input_precision="ieee"
            )
    if KEYS_AS_M:
        scores = tl.trans(scores)
        scores_rope = tl.trans(tl.dot(kv_rope.to(K_DTYPE), q_rope, input_precision="ieee"))
    else:
        scores_rope = tl.dot(q_rope, tl.trans(kv_rope.to(K_DTYPE)), input_precision="ieee")
    # ``FOLD_IN_BRANCH`` (CUDA): the softmax step sits in a branch (always taken: the walk
    # stops at ``end``) so that no dot depends on the score dots within one block of code.
    # Triton lays the warps of a dot whose result reaches another dot along M only ([8, 1]
    # on sm90): a 64-row tile then has both warpgroups compute the whole Q.K^T. Past a
    # region boundary it sees no chain, gives Q.K^T [4, 2] (each warpgroup its 32 keys) and
    # shares P through shared memory, as FlashMLA does. The two score dots stay separate
    # (summed in the branch) for the same reason. The other branch yields no constant tile
    # (that would take 8 KB of shared memory for its P operand). AMD wants the chain: its
    # 16-row MFMAs then give each wave its own rows of both dots ([4, 1]), so P stays in
    # the wave's registers and the softmax reduces within it; past a branch a 32-key fp8
    # tile got [2, 2] (P through LDS, cross-wave reductions), which spilled on gfx950.
    if not FOLD_IN_BRANCH or first < end:
        new_max, denom, rescale, p, finite_key = _fold_scores(
            scores,
            scores_rope,
            pos,
            lo,
            row_scale,
            visible,
            running_max,
            denom,
            ROWS_DIFFER,
            ROW_SCALES,
            V_DTYPE,
            PV_FP8,
            FP8_DTYPE,
            FP8_EMULATE_MIN_EXP,
            P_SCALE,
        )
    else:
        new_max = running_max
        rescale = tl.zeros_like(running_max) + 1.0
        p = (scores * 0.0).to(V_DTYPE)
        finite_key = pos < end
    if GUARD_V:
        # V loaded again (the tail's tiles are few and in L2), without the keys no row
        # scores finitely: no 0 x NaN reaches a row that does not see such a key. No
        # round trip of the tile through registers, unlike zeroing its non-finite elements.
        v_mask = (in_range & finite_key)[:, None]
        kv_nope = tl.load(
            token[:, None] + offs_dv[None, :], mask=v_mask & dv_mask[None, :], other=0.0
        )
        if DV_CHUNKS == 2:
            kv_nope_hi = tl.load(
                token[:, None] + BLOCK_DV + offs_dv[None, :],
                mask=v_mask & dv_mask_hi[None, :],
                other=0.0,
            )
    # How V reaches P.V (``mla_decode_args._dot_types``). An fp8 cache: P.V runs in 16 bits
    # ("upcast_ptx" / "upcast_masked"), because a K-major fp8 operand would need V (keys x
    # Dv, Dv contiguous) transposed byte by byte through shared memory (sm90: 128 STS.U8 or
    # LDS.U8 a tile, a 29-way bank conflict; gfx942: 256 ds_read_u8), while a 16-bit one is
    # read transposed by the hardware (ldmatrix.trans, wgmma's MN-major operand, LDS u16
    # reads, gfx950's transposing ones). The tile is converted in registers as it was read
    # (wide); something the compiler cannot move the operand's layout change past must
    # follow, or it reads the fp8 tile in that (transposed) layout again and converts after.
    # NVIDIA: an opaque move (a masked select cost 250-320 more loop instructions there).
    # AMD: a select of the keys in range (what the load already zeroed), since Triton 3.8's
    # AMD pipeliner cannot predicate an opaque move it runs a trip early. Q.K^T keeps fp8
    # (K is K-major as stored).
    if V_MODE == "upcast_ptx":
        kv_nope = _opaque_upcast(kv_nope, V_DTYPE)
        if DV_CHUNKS == 2:
            kv_nope_hi = _opaque_upcast(kv_nope_hi, V_DTYPE)
    elif V_MODE == "upcast_masked":
        kv_nope = tl.where(in_range[:, None], kv_nope.to(V_DTYPE), 0.0)
        if DV_CHUNKS == 2:
            kv_nope_hi = tl.where(in_range[:, None], kv_nope_hi.to(V_DTYPE), 0.0)
    elif V_MODE == "fp8_registers":
        # fp8 P.V on NVIDIA (fp8 wgmma reads K-major operands only): a no-op bitcast on the
        # loaded tile leaves its load a plain dot operand, which Triton copies asynchronously
        # into the pipelined shared buffers, and the transpose reads it from there; with V's
        # dot as its only other use, the load itself would go to registers, synchronously.
        kv_nope = kv_nope.to(tl.int8, bitcast=True).to(V_DTYPE, bitcast=True)
        if DV_CHUNKS == 2:
            kv_nope_hi = kv_nope_hi.to(tl.int8, bitcast=True).to(V_DTYPE, bitcast=True)
    if KEYS_AS_M:
        p = tl.trans(p)
        acc = tl.dot(
            tl.trans(kv_nope.to(V_DTYPE)), p, acc * rescale[None, :], input_precision="ieee"
        )
        if DV_CHUNKS == 2:
            acc_hi = tl.dot(
                tl.trans(kv_nope_hi.to(V_DTYPE)),
                p,
                acc_hi * rescale[None, :],
                input_precision="ieee",
            )
    else:
        acc = tl.dot(p, kv_nope.to(V_DTYPE), acc * rescale[:, None], input_precision="ieee")
        if DV_CHUNKS == 2:
            acc_hi = tl.dot(
                p, kv_nope_hi.to(V_DTYPE), acc_hi * rescale[:, None], input_precision="ieee"
            )
    return new_max, denom, acc, acc_hi, next_block


@triton.jit
def _store_rows(
    out_rows,  # [BLOCK_H] pointers to each row's first output value
    lse_rows,  # [BLOCK_H] pointers to each row's lse
    out,
    out_hi,
    lse,
    row_valid,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DV_CHUNKS: tl.constexpr,
    FULL_ROWS: tl.constexpr,
):
    """Store a group's output rows (and the V half ``out_hi`` with ``DV_CHUNKS == 2``).
    Masks are written apart from the q loads' (which CSE would merge and keep live through
    the walk), and there are none where every row has a slot and every column is real
    (``FULL_ROWS``): no row mask then stays live through the walk either."""
    offs_dv = tl.arange(0, BLOCK_DV)
    FULL: tl.constexpr = FULL_ROWS and HEAD_DIM_V == BLOCK_DV * DV_CHUNKS
    if FULL:
        tl.store(out_rows[:, None] + offs_dv[None, :], out)
    else:
        tl.store(
            out_rows[:, None] + offs_dv[None, :],
            out,
            mask=(offs_dv < HEAD_DIM_V)[None, :] & row_valid[:, None],
        )
    if DV_CHUNKS == 2:
        if FULL:
            tl.store(out_rows[:, None] + BLOCK_DV + offs_dv[None, :], out_hi)
        else:
            tl.store(
                out_rows[:, None] + BLOCK_DV + offs_dv[None, :],
                out_hi,
                mask=(BLOCK_DV + offs_dv < HEAD_DIM_V)[None, :] & row_valid[:, None],
            )
    if FULL_ROWS:
        tl.store(lse_rows, lse)
    else:
        tl.store(lse_rows, lse, mask=row_valid)


@triton.jit
def _decode_segment(
    segment,  # its row of the schedule's segments table
    live,  # False (with MASKED): a program with nothing to do, every row masked off
    segments_ptr,  # [*, 4] int32: (unit = b * num_groups + group, first key, end key, partial)
    num_groups,
    q_ptr,
    q_scale_ptr,
    kv_ptr,
    block_table_ptr,
    seqlens_ptr,
    query_start_ptr,
    row_seqlens_ptr,
    out_ptr,
    lse_ptr,
    part_out_ptr,
    part_lse_ptr,
    fault_ptr,
    qk_scale,
    out_scale,
    num_blocks,
    max_blocks,
    stride_q_b,
    stride_q_i,
    stride_q_h,
    stride_kv_block,
    stride_kv_token,
    stride_bt_b,
    stride_out_b,
    stride_out_h,
    stride_lse_b,
    stride_lse_h,
    stride_part_p,
    stride_part_r,
    stride_part_lse_p,
    Q_LEN: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DV_CHUNKS: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    K_DTYPE: tl.constexpr,
    V_DTYPE: tl.constexpr,
    QK_FP8: tl.constexpr,
    PV_FP8: tl.constexpr,
    V_MODE: tl.constexpr,
    FOLD_IN_BRANCH: tl.constexpr,
    KEYS_AS_M: tl.constexpr,
    REMAT_ROWS: tl.constexpr,
    FP8_DTYPE: tl.constexpr,
    FP8_EMULATE_MIN_EXP: tl.constexpr,
    P_SCALE: tl.constexpr,
    NUM_XCDS: tl.constexpr,
    HAS_FAULT_FLAG: tl.constexpr,
    PREFETCH_IDS: tl.constexpr,
    VARLEN: tl.constexpr,
    ROW_BOUNDS: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One segment of the schedule (``_mla_decode_stage1``): walk the request's keys
    ``[seg_start, seg_stop)`` for one row group, write its partial or its final rows."""
    unit = tl.load(segments_ptr + segment * 4)
    b = unit // num_groups
    group = unit % num_groups
    seg_start = tl.load(segments_ptr + segment * 4 + 1)  # multiples of the piece, so of the tile
    seg_stop = tl.load(segments_ptr + segment * 4 + 2)
    part = tl.load(segments_ptr + segment * 4 + 3)  # its partial, or -1: the unit's only one
    seqlen = tl.load(seqlens_ptr + b)
    rows = group * BLOCK_H + tl.arange(0, BLOCK_H)
    # The request's window: its first token in q (and in out, lse, the row bounds) and its
    # length. Windows of different lengths (VARLEN) are packed; Q_LEN is the longest.
    if VARLEN:
        token0 = tl.load(query_start_ptr + b)
        window = tl.load(query_start_ptr + b + 1) - token0
    else:
        token0 = b * Q_LEN
        window = Q_LEN
    # A masked-off program (``live`` False) has no valid row and a length of 0: it reads
    # no key, sets no fault and stores nothing.
    if MASKED:
        seqlen = tl.where(live, seqlen, 0)
        row_limit = tl.where(live, window * NUM_HEADS, 0)
    else:
        row_limit = window * NUM_HEADS
    row_valid = rows < row_limit
    # Index x stride products are int64: a cache view or a batch of q can pass 2^31 elements.
    qpos = (rows // NUM_HEADS).to(tl.int64)
    head = (rows % NUM_HEADS).to(tl.int64)
    if ROW_BOUNDS:
        # Each row's own bound (decode context parallelism: a causal window's rows see
        # counts of this rank's keys that differ by 0 or 1 per row, not by exactly 1). A
        # bound outside [0, L] is a broken contract: the row is poisoned below.
        visible = tl.load(row_seqlens_ptr + token0 + qpos, mask=row_valid, other=0)
        bad_bound = row_valid & ((visible < 0) | (visible > seqlen))
    elif CAUSAL:
        # Query i of a window of S_q sees keys [0, L - S_q + i]. A length <= 0 sees nothing;
        # testing it first keeps L - S_q + i from wrapping at L near -2^31.
        visible = tl.where(seqlen > 0, seqlen - (window - 1) + (rows // NUM_HEADS), 0)
    else:
        visible = tl.zeros([BLOCK_H], tl.int32) + seqlen
    visible = tl.where(row_valid & (visible > 0), visible, 0)

    # Planned calls do not check lengths or block ids on the host, so the kernel only reads
    # keys that exist: key p lives in table column p // PAGE_SIZE, which must be below
    # max_blocks, and its block id in [0, num_blocks). A row that may see a key past the
    # table is poisoned up front; the walk stops at the table's end. int64 scalars: a
    # length near 2^31 - 1 rounded up to whole tiles would wrap in int32.
    capacity = tl.cast(max_blocks, tl.int64) * PAGE_SIZE
    beyond_table = visible.to(tl.int64) > capacity
    # The segment's slice stops at the furthest key any row of this group may see.
    end = tl.minimum(
        tl.minimum(seg_stop.to(tl.int64), tl.max(visible, axis=0).to(tl.int64)), capacity
    )
    start = tl.minimum(seg_start.to(tl.int64), end).to(tl.int32)

    offs_dv = tl.arange(0, BLOCK_DV)
    offs_dr = tl.arange(0, BLOCK_DR)
    dv_mask = offs_dv < HEAD_DIM_V
    dv_mask_hi = BLOCK_DV + offs_dv < HEAD_DIM_V
    dr_mask = offs_dr < ROPE_DIM
    if VARLEN:
        q_rows = q_ptr + (token0.to(tl.int64) + qpos) * stride_q_i + head * stride_q_h
    else:
        q_rows = q_ptr + b.to(tl.int64) * stride_q_b + qpos * stride_q_i + head * stride_q_h
    q_nope = tl.load(
        q_rows[:, None] + offs_dv[None, :], mask=row_valid[:, None] & dv_mask[None, :], other=0.0
    )
    q_rope = tl.load(
        q_rows[:, None] + HEAD_DIM_V + offs_dr[None, :],
        mask=row_valid[:, None] & dr_mask[None, :],
        other=0.0,
    )
    if DV_CHUNKS == 2:
        q_nope_hi = tl.load(
            q_rows[:, None] + BLOCK_DV + offs_dv[None, :],
            mask=row_valid[:, None] & dv_mask_hi[None, :],
            other=0.0,
        )
    if QK_FP8:
        # Q comes quantized per row (``quantize_q``): its scale joins that row's softmax
        # scale. Loaded, not computed here, it is an operand the dots read from shared
        # memory on sm90.
        q_scale = tl.load(
            q_scale_ptr + token0.to(tl.int64) * NUM_HEADS + rows, mask=row_valid, other=1.0
        )
        row_scale = qk_scale * q_scale
    else:
        row_scale = qk_scale
    q_nope = q_nope.to(K_DTYPE)
    q_rope = q_rope.to(K_DTYPE)
    if DV_CHUNKS == 2:
        q_nope_hi = q_nope_hi.to(K_DTYPE)
    if KEYS_AS_M:
        # Q^T, the dots' N operand, formed once (_attend_tile takes it transposed).
        q_nope = tl.trans(q_nope)
        q_rope = tl.trans(q_rope)
        if DV_CHUNKS == 2:
            q_nope_hi = tl.trans(q_nope_hi)

    running_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    if KEYS_AS_M:  # carried as O^T (see _attend_tile)
        acc = tl.zeros([BLOCK_DV, BLOCK_H], tl.float32)
    else:
        acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    if DV_CHUNKS == 2:
        acc_hi = tl.zeros_like(acc)
    else:
        # Placeholders the tile step carries untouched with one V part.
        acc_hi = tl.zeros([1], tl.float32)
        q_nope_hi = tl.zeros([1], tl.float32)
    block_row = block_table_ptr + b.to(tl.int64) * stride_bt_b
    end = end.to(tl.int32)
    # Which rows may see a key whose block id is bad: the first key of [start, end) in such a
    # column, found once per page before the walk rather than once per key in it. Counted
    # in steps, written to stay clear of int32 wrap near 2^31.
    first_bad = tl.full([_BLOCK_C], 2**31 - 1, tl.int32)
    col_start = start // PAGE_SIZE
    col_end = tl.where(end > start, (end - 1) // PAGE_SIZE + 1, col_start)
    for step in range(0, tl.cdiv(col_end - col_start, _BLOCK_C)):
        cols = col_start + step * _BLOCK_C + tl.arange(0, _BLOCK_C)
        ids = tl.load(block_row + cols, mask=cols < col_end, other=0)
        bad = (cols < col_end) & (ids.to(tl.uint32, bitcast=True) >= num_blocks)
        first_bad = tl.minimum(
            first_bad, tl.where(bad, tl.maximum(cols * PAGE_SIZE, start), 2**31 - 1)
        )
    first_bad = tl.min(first_bad, axis=0)
    # A negative length is a broken contract, not "no keys": every row of the request is NaN.
    unreadable = (first_bad < visible) | beyond_table | (seqlen < 0)
    if ROW_BOUNDS:
        unreadable = unreadable | bad_bound
    # Their denominators start as NaN (a NaN denom stays NaN through the walk): nothing
    # of this scan stays live through the loop.
    denom = tl.where(unreadable, float("nan"), denom)
    if HAS_FAULT_FLAG:
        faults = tl.where(first_bad < 2**31 - 1, _FAULT_BLOCK_ID, 0)
        beyond = tl.max(beyond_table.to(tl.int32), axis=0) > 0
        faults = faults | tl.where(beyond, _FAULT_BEYOND_TABLE, 0)
        faults = faults | tl.where(seqlen < 0, _FAULT_NEGATIVE_LENGTH, 0)
        if ROW_BOUNDS:
            misbound = tl.max(bad_bound.to(tl.int32), axis=0) > 0
            faults = faults | tl.where(misbound, _FAULT_ROW_BOUND, 0)
        tl.atomic_or(fault_ptr, faults, mask=faults != 0)

    # Rows of one verify window see different keys: a key only later rows see has weight 0
    # in the earlier ones, and 0 x NaN (a non-finite V element) would still reach them. Only
    # the window's own keys, from its first one (L - S_q + 1) on, are seen by some rows and
    # not others, at most S_q - 1 of them. The walk takes the keys below it, which every
    # row sees, with one limit for all rows and V straight from the loaded tile into P.V;
    # the window's keys follow in tail tiles of BLOCK_W keys (see below).
    # With per-row bounds or windows of different lengths, the keys every row of the group
    # sees end at its rows' smallest bound (a DCP window's differ by at most S_q - 1).
    WINDOW: tl.constexpr = (CAUSAL and Q_LEN > 1) or ROW_BOUNDS
    if WINDOW:
        if ROW_BOUNDS or VARLEN:
            shared = tl.min(tl.where(row_valid, visible, 2**31 - 1), axis=0)
        else:
            # Compared first, so that L - S_q + 1 cannot wrap at L near -2^31.
            shared = tl.where(seqlen > Q_LEN - 1, seqlen - (Q_LEN - 1), 0)
        shared_end = tl.minimum(tl.maximum(shared, start), end)
    else:
        shared_end = end
    # PREFETCH_IDS: the block ids of each tile are loaded one trip ahead (loop-carried), so
    # the KV loads of a trip depend on no load of that trip and Triton's software pipeliner
    # gives them their own LDS buffers (AMD's stays single-buffered otherwise).
    # A tile inside one page (tiles start at multiples of BLOCK_N): one block id per tile.
    TILE_IN_PAGE: tl.constexpr = PAGE_SIZE % BLOCK_N == 0
    if PREFETCH_IDS:
        if TILE_IN_PAGE:
            next_block = tl.load(block_row + start // PAGE_SIZE, mask=start < shared_end, other=0)
        else:
            next_pos = start + tl.arange(0, BLOCK_N)
            next_block = tl.load(
                block_row + next_pos // PAGE_SIZE, mask=next_pos < shared_end, other=0
            )
    else:
        next_block = tl.zeros([BLOCK_N], tl.int32)
    # One masked walk (an unmasked walk of the whole tiles plus the last one apart costs
    # AMD VGPRs in Triton 3.9 and saves sm90 none that matter).
    # The loop counts tiles, not keys: n0 + BLOCK_N would wrap past an end near 2^31 - 1.
    num_tiles = tl.where(shared_end > start, (shared_end - start - 1) // BLOCK_N + 1, 0)
    for tile in range(0, num_tiles):
        running_max, denom, acc, acc_hi, next_block = _attend_tile(
            start + tile * BLOCK_N,
            start,
            shared_end,
            block_row,
            kv_ptr,
            num_blocks,
            stride_kv_block,
            stride_kv_token,
            q_nope,
            q_rope,
            q_nope_hi,
            row_scale,
            shared_end,
            running_max,
            denom,
            acc,
            acc_hi,
            next_block,
            HEAD_DIM_V,
            ROPE_DIM,
            PAGE_SIZE,
            BLOCK_N,
            BLOCK_DV,
            DV_CHUNKS,
            BLOCK_DR,
            K_DTYPE,
            V_DTYPE,
            PV_FP8,
            V_MODE,
            FOLD_IN_BRANCH,
            KEYS_AS_M,
            FP8_DTYPE,
            FP8_EMULATE_MIN_EXP,
            P_SCALE,
            PREFETCH_IDS,
            False,
            False,
            QK_FP8,
            TILE_IN_PAGE,
        )
    if WINDOW:
        # The window's keys [shared_end, end): tiles of BLOCK_W keys (at least S_q - 1 where
        # BLOCK_N allows, so mostly one), not pipelined, whose P.V leaves out the keys no
        # row scores finitely (GUARD_V). Per-row limits, and a lower
        # one: the tiles start at multiples of BLOCK_W (no lane wraps past 2^31 - 1), so
        # the first may hold keys the walk took; they are read (they exist) but not seen.
        # A tail tile lies in one page where BLOCK_W divides it (one block id).
        no_ids = tl.zeros([BLOCK_W], tl.int32)  # no ids are prefetched
        aligned = shared_end // BLOCK_W * BLOCK_W
        num_tail = tl.where(end > shared_end, (end - 1 - aligned) // BLOCK_W + 1, 0)
        for tile in tl.range(0, num_tail, num_stages=1):
            running_max, denom, acc, acc_hi, no_ids = _attend_tile(
                aligned + tile * BLOCK_W,
                shared_end,
                end,
                block_row,
                kv_ptr,
                num_blocks,
                stride_kv_block,
                stride_kv_token,
                q_nope,
                q_rope,
                q_nope_hi,
                row_scale,
                visible,
                running_max,
                denom,
                acc,
                acc_hi,
                no_ids,
                HEAD_DIM_V,
                ROPE_DIM,
                PAGE_SIZE,
                BLOCK_W,
                BLOCK_DV,
                DV_CHUNKS,
                BLOCK_DR,
                K_DTYPE,
                V_DTYPE,
                PV_FP8,
                V_MODE,
                FOLD_IN_BRANCH,
                KEYS_AS_M,
                FP8_DTYPE,
                FP8_EMULATE_MIN_EXP,
                P_SCALE,
                False,
                True,
                True,
                QK_FP8,
                PAGE_SIZE % BLOCK_W == 0,
            )

    # Only denom == 0 means "no visible key"; a poisoned (NaN) denom makes out and lse NaN.
    empty = denom == 0
    safe_denom = tl.where(empty, 1.0, denom)
    norm = out_scale / safe_denom
    # running_max is in base 2: lse = ln(2) * (max + log2(denom)).
    lse = tl.where(empty, float("-inf"), (running_max + tl.log2(safe_denom)) * 0.6931471805599453)

    if REMAT_ROWS:
        # The output rows from an opaque copy of the group id (a mov the compiler cannot
        # see through), so they are recomputed here rather than the q loads' row indices
        # staying live through the walk (sm90 H128: 15 registers, spilled at 255).
        group = tl.inline_asm_elementwise(
            "mov.u32 $0, $1;", "=r,r", [group], dtype=tl.int32, is_pure=False, pack=1
        )
        rows = group * BLOCK_H + tl.arange(0, BLOCK_H)
        row_valid = rows < row_limit
    if KEYS_AS_M:
        acc = tl.trans(acc)
        if DV_CHUNKS == 2:
            acc_hi = tl.trans(acc_hi)
    out = tl.where(empty[:, None], 0.0, acc * norm[:, None])
    out_hi = tl.where(empty[:, None], 0.0, acc_hi * norm[:, None]) if DV_CHUNKS == 2 else out
    if part >= 0:
        # A partial has a slot for every row of the group (padding rows included); a
        # masked-off program's row 0 may name one: it stores under the row mask.
        in_group = tl.arange(0, BLOCK_H).to(tl.int64)
        _store_rows(
            part_out_ptr + part.to(tl.int64) * stride_part_p + in_group * stride_part_r,
            part_lse_ptr + part.to(tl.int64) * stride_part_lse_p + in_group,
            out,
            out_hi,
            lse,
            in_group < tl.where(live, BLOCK_H, 0) if MASKED else row_valid,
            HEAD_DIM_V,
            BLOCK_DV,
            DV_CHUNKS,
            not MASKED,
        )
    else:
        # Out and lse hold a window's rows (position, head) adjacent: a packed window's first
        # row is its first token's.
        first_row = token0.to(tl.int64) if VARLEN else b.to(tl.int64)
        _store_rows(
            out_ptr + first_row * stride_out_b + rows.to(tl.int64) * stride_out_h,
            lse_ptr + first_row * stride_lse_b + rows.to(tl.int64) * stride_lse_h,
            out,
            out_hi,
            lse,
            row_valid,
            HEAD_DIM_V,
            BLOCK_DV,
            DV_CHUNKS,
            Q_LEN * NUM_HEADS % BLOCK_H == 0 and not MASKED and not VARLEN,
        )


@triton.jit
def _mla_decode_stage1(
    q_ptr,  # [B, S_q, H, D] ([T, H, D] with VARLEN); with QK_FP8 quantized per row
    q_scale_ptr,  # [T, H] fp32 row scales of q (read only with QK_FP8)
    kv_ptr,  # [num_blocks, PAGE_SIZE, D], unit stride in D
    block_table_ptr,  # [B, max_blocks] int32
    seqlens_ptr,  # [B] int32
    query_start_ptr,  # [B + 1] int32 window starts (read only with VARLEN)
    row_seqlens_ptr,  # [T] int32 each query row's KV bound (read only with ROW_BOUNDS)
    launch_order_ptr,  # [programs] int32: the segment program p walks, or -1 (none)
    segments_ptr,  # [*, 4] int32: (unit = b * num_groups + group, first key, end key, partial)
    out_ptr,  # [B, S_q, H, Dv] final rows, q's dtype ([T, H, Dv] with VARLEN)
    lse_ptr,  # [B, S_q, H] fp32 ([T, H] with VARLEN)
    part_out_ptr,  # [P, BLOCK_H, Dv] fp32 partials of units cut into several segments
    part_lse_ptr,  # [P, BLOCK_H] fp32
    fault_ptr,  # [1] int32, FAULT_* bits ORed in (read only with HAS_FAULT_FLAG)
    qk_scale,  # softmax scale x kv dequant scale x log2(e): scores in base 2
    out_scale,  # kv dequant scale / P_SCALE, applied to the output
    num_groups,
    num_blocks,
    max_blocks,
    stride_q_b,
    stride_q_i,
    stride_q_h,
    stride_kv_block,
    stride_kv_token,
    stride_bt_b,
    stride_out_b,
    stride_out_h,
    stride_lse_b,
    stride_lse_h,
    stride_part_p,
    stride_part_r,
    stride_part_lse_p,
    Q_LEN: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DV_CHUNKS: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    K_DTYPE: tl.constexpr,
    V_DTYPE: tl.constexpr,
    QK_FP8: tl.constexpr,
    PV_FP8: tl.constexpr,
    V_MODE: tl.constexpr,
    FOLD_IN_BRANCH: tl.constexpr,
    KEYS_AS_M: tl.constexpr,
    REMAT_ROWS: tl.constexpr,
    FP8_DTYPE: tl.constexpr,
    FP8_EMULATE_MIN_EXP: tl.constexpr,
    P_SCALE: tl.constexpr,
    NUM_XCDS: tl.constexpr,
    HAS_FAULT_FLAG: tl.constexpr,
    PREFETCH_IDS: tl.constexpr,
    VARLEN: tl.constexpr,
    ROW_BOUNDS: tl.constexpr,
    NO_OP_GUARD: tl.constexpr,
):
    """Stage 1: one program per segment of the balanced schedule (``schedule``), in the
    launch order its planner chose: the hardware hands out programs in id order to whichever
    slot frees first (on AMD, within the XCD of ``pid % NUM_XCDS``), and that order makes
    it run the planned packing (``schedule``: "Launch order"). One segment per program,
    not a loop over a slot's list: a persistent loop let LLVM hoist the layouts' thread-id
    index math out of it, live through the walk (sm90: up to 972 B of spills at 255
    registers; gfx942: 20-46 more VGPRs), which one straight walk never has."""
    segment = tl.load(launch_order_ptr + tl.program_id(0))
    # -1: a program with nothing to do, skipped in the form that compiles without spills
    # (bench static; ``mla_decode_args.no_op_guard``): NVIDIA branches past it. On AMD a
    # branch costs 1-9 VGPR spills (96-row groups with 64-bit addressing): there a verify
    # window skips it with a loop of at most one trip ("loop"), and every other shape runs
    # the walk masked off ("mask": no valid row, length 0, so it loads, walks and stores
    # nothing). The loop spills 4 VGPRs at AMD's 32-row single-query groups and ~1000 B on
    # sm90 (LICM hoists the index math out of it again); the mask spills at AMD windows
    # and at sm90's.
    if NO_OP_GUARD == "branch":
        if segment >= 0:
            _decode_segment(
                segment,
                True,
                segments_ptr,
                num_groups,
                q_ptr,
                q_scale_ptr,
                kv_ptr,
                block_table_ptr,
                seqlens_ptr,
                query_start_ptr,
                row_seqlens_ptr,
                out_ptr,
                lse_ptr,
                part_out_ptr,
                part_lse_ptr,
                fault_ptr,
                qk_scale,
                out_scale,
                num_blocks,
                max_blocks,
                stride_q_b,
                stride_q_i,
                stride_q_h,
                stride_kv_block,
                stride_kv_token,
                stride_bt_b,
                stride_out_b,
                stride_out_h,
                stride_lse_b,
                stride_lse_h,
                stride_part_p,
                stride_part_r,
                stride_part_lse_p,
                Q_LEN,
                NUM_HEADS,
                HEAD_DIM_V,
                ROPE_DIM,
                PAGE_SIZE,
                CAUSAL,
                BLOCK_H,
                BLOCK_N,
                BLOCK_W,
                BLOCK_DV,
                DV_CHUNKS,
                BLOCK_DR,
                K_DTYPE,
                V_DTYPE,
                QK_FP8,
                PV_FP8,
                V_MODE,
                FOLD_IN_BRANCH,
                KEYS_AS_M,
                REMAT_ROWS,
                FP8_DTYPE,
                FP8_EMULATE_MIN_EXP,
                P_SCALE,
                NUM_XCDS,
                HAS_FAULT_FLAG,
                PREFETCH_IDS,
                VARLEN,
                ROW_BOUNDS,
                False,
            )
    else:
        live = segment >= 0
        first = tl.maximum(segment, 0)
        last = tl.maximum(segment + 1, 0) if NO_OP_GUARD == "loop" else first + 1
        for one in range(first, last):
            _decode_segment(
                one,
                live,
                segments_ptr,
                num_groups,
                q_ptr,
                q_scale_ptr,
                kv_ptr,
                block_table_ptr,
                seqlens_ptr,
                query_start_ptr,
                row_seqlens_ptr,
                out_ptr,
                lse_ptr,
                part_out_ptr,
                part_lse_ptr,
                fault_ptr,
                qk_scale,
                out_scale,
                num_blocks,
                max_blocks,
                stride_q_b,
                stride_q_i,
                stride_q_h,
                stride_kv_block,
                stride_kv_token,
                stride_bt_b,
                stride_out_b,
                stride_out_h,
                stride_lse_b,
                stride_lse_h,
                stride_part_p,
                stride_part_r,
                stride_part_lse_p,
                Q_LEN,
                NUM_HEADS,
                HEAD_DIM_V,
                ROPE_DIM,
                PAGE_SIZE,
                CAUSAL,
                BLOCK_H,
                BLOCK_N,
                BLOCK_W,
                BLOCK_DV,
                DV_CHUNKS,
                BLOCK_DR,
                K_DTYPE,
                V_DTYPE,
                QK_FP8,
                PV_FP8,
                V_MODE,
                FOLD_IN_BRANCH,
                KEYS_AS_M,
                REMAT_ROWS,
                FP8_DTYPE,
                FP8_EMULATE_MIN_EXP,
                P_SCALE,
                NUM_XCDS,
                HAS_FAULT_FLAG,
                PREFETCH_IDS,
                VARLEN,
                ROW_BOUNDS,
                NO_OP_GUARD == "mask",
            )
