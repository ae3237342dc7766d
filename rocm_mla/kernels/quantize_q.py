"""Per-row fp8 quantization of the query, for stage 1's fp8 ``Q K^T``.

Each query row (request, position, head) is scaled by its own ``amax / FP8_MAX`` and rounded
to fp8 once per call, here, rather than by every stage-1 program that reads the row (one per
KV split). Stage 1 then loads Q as it loads the cache: on sm90 the wgmma reads a loaded
operand from shared memory, where a Q computed in the kernel would be held in registers for
the whole walk (72 per thread at 64 rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Rows per program: a row is one 576-wide (padded to 1024) vector.
_BLOCK_R = 4


@triton.jit
def to_fp8(x, FP8_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr, EMULATE_MIN_EXP: tl.constexpr):
    """``x`` rounded to fp8 e4m3 (in range by construction), returned as ``OUT_DTYPE``.

    ``EMULATE_MIN_EXP`` (the interpreter: the exponent of the type's smallest normal, else
    None): Triton 3.9's interpreter gets fp32 -> fp8 wrong (errors of 64 at values below
    200), so the rounding is done in fp32 arithmetic: 3 mantissa bits, the exponent floored
    at the smallest normal's (subnormals keep its ulp), to nearest with ties up.
    """
    if EMULATE_MIN_EXP is not None:
        exp = tl.floor(tl.log2(tl.maximum(tl.abs(x), 1e-30)))
        exp = tl.maximum(exp, EMULATE_MIN_EXP)
        ulp = tl.exp2(exp - 3.0)
        y = (tl.floor(x / ulp + 0.5) * ulp).to(OUT_DTYPE)
    else:
        y = x.to(FP8_DTYPE).to(OUT_DTYPE)
    return y


@triton.jit
def _quantize_q_kernel(
    q_ptr,  # [B, S_q, H, D], unit stride in D
    out_ptr,  # [B * S_q * H, D] contiguous, OUT_DTYPE
    scale_ptr,  # [B * S_q * H] fp32
    num_rows,
    num_heads,
    q_len,
    stride_q_b,
    stride_q_i,
    stride_q_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8_DTYPE: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    FP8_EMULATE_MIN_EXP: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    row_valid = rows < num_rows
    mask = row_valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    # int64 offsets: a batch of q can pass 2^31 elements.
    head = (rows % num_heads).to(tl.int64)
    pos = ((rows // num_heads) % q_len).to(tl.int64)
    b = (rows // (num_heads * q_len)).to(tl.int64)
    src = q_ptr + b * stride_q_b + pos * stride_q_i + head * stride_q_h
    x = tl.load(src[:, None] + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    # NaN/Inf pass through as NaN (x / amax), which poisons the row's scores in stage 1.
    amax = tl.max(tl.abs(x), axis=1)
    quant = tl.where(amax > 0, amax / FP8_MAX, 1.0)
    y = to_fp8(x / quant[:, None], FP8_DTYPE, OUT_DTYPE, FP8_EMULATE_MIN_EXP)
    dst = out_ptr + rows.to(tl.int64) * HEAD_DIM
    tl.store(dst[:, None] + offs_d[None, :], y, mask=mask)
    tl.store(scale_ptr + rows, quant, mask=row_valid)


def quantize_q(
    q: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    fp8_dtype,
    emulate_min_exp: float | None,
    fp8_max: float,
    out_tl_dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_fp8 [B, S_q, H, D] out_dtype, scale [B, S_q, H] fp32)`` with ``q ~ q_fp8 * scale``
    per row. ``out_dtype`` is the fp8 type itself on a GPU, fp32 (fp8 values) under the
    interpreter, which has no fp8 arithmetic."""
    batch, q_len, num_heads, head_dim = q.shape
    out = torch.empty(batch, q_len, num_heads, head_dim, dtype=out_dtype, device=q.device)
    scale = torch.empty(batch, q_len, num_heads, dtype=torch.float32, device=q.device)
    rows = batch * q_len * num_heads
    if rows == 0:
        return out, scale
    _quantize_q_kernel[(triton.cdiv(rows, _BLOCK_R),)](
        q,
        out,
        scale,
        rows,
        num_heads,
        q_len,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        HEAD_DIM=head_dim,
        BLOCK_R=_BLOCK_R,
        BLOCK_D=triton.next_power_of_2(head_dim),
        FP8_DTYPE=fp8_dtype,
        OUT_DTYPE=out_tl_dtype,
        FP8_EMULATE_MIN_EXP=emulate_min_exp,
        FP8_MAX=fp8_max,
        num_warps=4,
    )
    return out, scale
