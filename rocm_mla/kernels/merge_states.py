"""Exact LSE merge of N partial attentions in Triton, and where Triton runs here.

The merge is ``rocm_mla.merge_states`` as a kernel: stage 2 of the split-KV decode and the
decode-context-parallel combine both use it. Per output row it takes the partials' natural-
log softmax denominators ``lse_n`` and weights partial ``n`` by ``exp(lse_n - max_n lse_n)``.
A partial with lse -inf saw no key and contributes nothing (its output is never read, so it
may be NaN). A NaN or +inf lse, or a NaN output of a partial with weight > 0, is a broken
result and makes the merged row NaN (out and lse): it must not pass for an empty shard. A
row whose partials are all empty gives out 0, lse -inf. The arithmetic follows
``rocm_mla.merge`` (``lse_merge_weights``) step for step, in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rocm_mla.kernels.target import TritonTarget, triton_target
from rocm_mla.merge import check_merge_args


def merge_launch_options(target: TritonTarget | None) -> dict:
    """Launch options of the merge kernels, the same for every ``target``: four warps (waves)
    a program, so that one step of ``_merge_blocks``' tile is 32 fp32 values a lane on AMD's
    64-lane waves (64 on NVIDIA's 32-lane warps), loaded at once. None of the 3.6-3.9 builds
    for sm90, gfx942 or gfx950 spills."""
    return {"num_warps": 4}


@triton.jit
def _merge_rows(
    lse_rows,  # [BLOCK_R] pointers to partial 0's lse of each row
    part_rows,  # [BLOCK_R] pointers to partial 0's output row
    out_rows,  # [BLOCK_R] pointers to the merged output rows
    out_lse_rows,  # [BLOCK_R] pointers to the merged lse
    num_parts,
    r_mask,
    stride_lses_n,
    stride_outs_n,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Merge ``num_parts`` partials (``stride_*_n`` apart) of BLOCK_R rows: the formula of
    ``rocm_mla.merge`` (module docstring), shared by both merge kernels.

    A row's partials are walked in wide steps, every load of a step independent of the
    others, so a merge of N partials waits on about N / BLOCK_P loads, not on 5 N / 4
    dependent ones (4600785's merge: a 4-partial step loaded the lses, then the outputs of
    the weighted ones; the balanced schedule cuts one long request into a partial per slot).
    """
    # Pass 1: the largest finite lse of each row, and whether any lse is NaN or +inf, over
    # BLOCK_L partials a step (one step for any unit a GPU schedule cuts).
    offs_l = tl.arange(0, BLOCK_L)
    top = tl.full([BLOCK_R], float("-inf"), tl.float32)
    broken = tl.zeros([BLOCK_R], tl.int32)
    for p0 in range(0, num_parts, BLOCK_L):
        p = (p0 + offs_l).to(tl.int64)
        lse = tl.load(
            lse_rows[None, :] + p[:, None] * stride_lses_n,
            mask=(p < num_parts)[:, None] & r_mask[None, :],
            other=float("-inf"),
        ).to(tl.float32)  # [BLOCK_L, BLOCK_R]
        bad = (lse != lse) | (lse == float("inf"))
        broken = tl.maximum(broken, tl.max(bad.to(tl.int32), axis=0))
        top = tl.maximum(top, tl.max(tl.where(bad, float("-inf"), lse), axis=0))
    # A row with no finite partial keeps exp(-inf - 0) = 0 weights, never inf - inf.
    ref = tl.where(top == float("-inf"), 0.0, top)

    # Pass 2, per Dv chunk, BLOCK_P partials a step: weights exp(lse - ref), each output
    # loaded with its lse (not after it) and dropped by a select where its weight is 0 (an
    # empty partial's output is never written: it may hold NaN, which a product would
    # spread). A NaN output of a partial with weight > 0 reaches acc; any NaN in a row's acc
    # (any chunk) is a broken row, so the whole row is rewritten as NaN after the last chunk.
    offs_p = tl.arange(0, BLOCK_P)
    total = tl.zeros([BLOCK_R], tl.float32)
    for d0 in tl.static_range(0, HEAD_DIM_V, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM_V
        total = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        for p0 in range(0, num_parts, BLOCK_P):
            p = (p0 + offs_p).to(tl.int64)
            rows_mask = (p < num_parts)[:, None] & r_mask[None, :]  # [BLOCK_P, BLOCK_R]
            lse = tl.load(
                lse_rows[None, :] + p[:, None] * stride_lses_n, mask=rows_mask, other=float("-inf")
            ).to(tl.float32)
            part = tl.load(
                part_rows[None, :, None] + p[:, None, None] * stride_outs_n + offs_d[None, None, :],
                mask=rows_mask[:, :, None] & d_mask[None, None, :],
                other=0.0,
            ).to(tl.float32)  # [BLOCK_P, BLOCK_R, BLOCK_D]
            lse = tl.where((lse != lse) | (lse == float("inf")), float("-inf"), lse)
            weight = tl.exp(lse - ref[None, :])  # [BLOCK_P, BLOCK_R]
            total += tl.sum(weight, axis=0)
            weighted = tl.where((weight > 0)[:, :, None], part * weight[:, :, None], 0.0)
            acc += tl.sum(weighted, axis=0)
        nan_cols = tl.where(d_mask[None, :] & (acc != acc), 1, 0)
        broken = tl.maximum(broken, tl.max(nan_cols, axis=1))
        safe_total = tl.where(total > 0, total, 1.0)
        merged = tl.where((total > 0)[:, None], acc / safe_total[:, None], 0.0)
        tl.store(
            out_rows[:, None] + offs_d[None, :], merged, mask=r_mask[:, None] & d_mask[None, :]
        )

    poisoned = broken > 0
    for d0 in tl.static_range(0, HEAD_DIM_V, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        nan_tile = tl.full([BLOCK_R, BLOCK_D], float("nan"), tl.float32)
        tl.store(
            out_rows[:, None] + offs_d[None, :],
            nan_tile,
            mask=(r_mask & poisoned)[:, None] & (offs_d < HEAD_DIM_V)[None, :],
        )
    seen = total > 0
    out_lse = tl.where(seen, ref + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    out_lse = tl.where(poisoned, float("nan"), out_lse)
    tl.store(out_lse_rows, out_lse, mask=r_mask)


@triton.jit
def _merge_states_kernel(
    outs_ptr,  # [N, G, R / G, Dv]
    lses_ptr,  # [N, G, R / G]
    out_ptr,  # [R, Dv]
    out_lse_ptr,  # [R] fp32
    num_parts,
    num_rows,
    rows_per_group,  # output row r is row r % rows_per_group of partial group r // it
    stride_outs_n,
    stride_outs_g,
    stride_outs_r,
    stride_lses_n,
    stride_lses_g,
    stride_lses_r,
    stride_out_r,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < num_rows
    group = (offs_r // rows_per_group).to(tl.int64)
    in_group = (offs_r % rows_per_group).to(tl.int64)
    # Index x stride products are int64: N x R x Dv partials can pass 2^31 elements.
    lse_rows = lses_ptr + group * stride_lses_g + in_group * stride_lses_r
    part_rows = outs_ptr + group * stride_outs_g + in_group * stride_outs_r
    out_rows = out_ptr + offs_r.to(tl.int64) * stride_out_r

    _merge_rows(
        lse_rows,
        part_rows,
        out_rows,
        out_lse_ptr + offs_r,
        num_parts,
        r_mask,
        stride_lses_n,
        stride_outs_n,
        HEAD_DIM_V,
        BLOCK_L,
        BLOCK_P,
        BLOCK_R,
        BLOCK_D,
    )


@triton.jit
def _merge_pieces_kernel(
    part_out_ptr,  # [P, GROUP_ROWS, Dv] fp32: stage 1's partials of cut units
    part_lse_ptr,  # [P, GROUP_ROWS] fp32
    unit_parts_ptr,  # [B * G, 2] int32: (first partial, count) per unit (schedule)
    split_units_ptr,  # [K] int32: the cut units, -1 past the last
    query_start_ptr,  # [B + 1] int32 window starts (read only with VARLEN)
    out_ptr,  # [B, rows, Dv] ([T, H, Dv] with VARLEN)
    out_lse_ptr,  # [B, rows] fp32 ([T, H] with VARLEN)
    num_groups,
    num_rows,  # S_q x H (with VARLEN: H, a token's rows)
    row_blocks,  # programs per cut unit
    stride_po_p,
    stride_po_r,
    stride_pl_p,
    stride_out_b,
    stride_out_r,
    stride_lse_b,
    GROUP_ROWS: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """Stage 2 of a balanced schedule: the rows of every unit (request, row group) cut into
    several segments merged from its partials; a unit in one segment wrote its rows itself.
    With VARLEN the windows are packed: request ``b``'s rows start at its first token's and
    end with its window."""
    pid = tl.program_id(0)
    unit = tl.load(split_units_ptr + pid // row_blocks)
    if unit >= 0:
        first = tl.load(unit_parts_ptr + unit * 2).to(tl.int64)
        count = tl.load(unit_parts_ptr + unit * 2 + 1)
        b = (unit // num_groups).to(tl.int64)
        in_group = (pid % row_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
        row = (unit % num_groups) * GROUP_ROWS + in_group
        if VARLEN:
            token0 = tl.load(query_start_ptr + b)
            window_rows = (tl.load(query_start_ptr + b + 1) - token0) * num_rows
            r_mask = (in_group < GROUP_ROWS) & (row < window_rows)
            # One token of out / out_lse holds num_rows (H) rows.
            base = token0.to(tl.int64) * num_rows
            out_rows = out_ptr + (base + row) * stride_out_r
            lse_rows = out_lse_ptr + base + row
        else:
            r_mask = (in_group < GROUP_ROWS) & (row < num_rows)
            out_rows = out_ptr + b * stride_out_b + row.to(tl.int64) * stride_out_r
            lse_rows = out_lse_ptr + b * stride_lse_b + row
        _merge_rows(
            part_lse_ptr + first * stride_pl_p + in_group,
            part_out_ptr + first * stride_po_p + in_group.to(tl.int64) * stride_po_r,
            out_rows,
            lse_rows,
            count,
            r_mask,
            stride_pl_p,
            stride_po_p,
            HEAD_DIM_V,
            BLOCK_L,
            BLOCK_P,
            BLOCK_R,
            BLOCK_D,
        )


def _merge_blocks(
    target: TritonTarget | None, num_parts: int, rows: int, head_dim_v: int
) -> dict[str, int]:
    """The tile constexprs (``BLOCK_L``, ``BLOCK_P``, ``BLOCK_R``, ``BLOCK_D``) of a merge of
    ``num_parts`` partials (at most) of ``rows`` rows."""
    parts = triton.next_power_of_2(max(num_parts, 1))
    block_d = min(triton.next_power_of_2(head_dim_v), 512)
    if target is not None and target.backend == "interpreter":
        # The interpreter pays per program and per op, not per register: take whole rows,
        # 16 partials at a time, and as many rows as keep the [P, R, D] tile near 256K.
        block_p = min(parts, 16)
        block_r = max(1, min(triton.next_power_of_2(rows), (1 << 18) // (block_p * block_d)))
        return {
            "BLOCK_L": min(parts, 128),
            "BLOCK_P": block_p,
            "BLOCK_R": block_r,
            "BLOCK_D": block_d,
        }
    # One row per GPU program (rows are plenty) and the whole Dv (512) at once: a step of
    # [16, 1, 512] fp32 is 32 KB in flight per program, 32 values a lane (AMD) or 64 (NVIDIA)
    # over ``merge_launch_options``' four warps. The lses of up to 128 partials (a unit cut
    # over every slot of an H200 at one program per SM) take one load.
    return {"BLOCK_L": min(parts, 128), "BLOCK_P": min(parts, 16), "BLOCK_R": 1, "BLOCK_D": block_d}


def launch_merge(
    outs: torch.Tensor,
    lses: torch.Tensor,
    out: torch.Tensor,
    out_lse: torch.Tensor,
    target: TritonTarget | None = None,
) -> None:
    """Merge ``outs [N, R, Dv]`` / ``lses [N, R]`` into ``out [R, Dv]`` / ``out_lse [R]``.

    ``outs [N, G, R / G, Dv]`` / ``lses [N, G, R / G]`` (any strides) hold the rows in G
    groups, e.g. stage 1's partials per request, whose rows past S_q x H pad a row group.
    ``outs`` and ``out`` must have unit stride in their last dim; ``out`` may have any float
    dtype (the fp32 result is rounded on store) and ``out_lse`` is fp32.
    """
    if outs.dim() == 3:
        outs, lses = outs.unsqueeze(1), lses.unsqueeze(1)
    if outs.dim() != 4 or tuple(lses.shape) != tuple(outs.shape[:-1]):
        raise ValueError(
            "launch_merge: outs must be [N, R, Dv] or [N, G, R / G, Dv] and lses its shape "
            f"without Dv, got {tuple(outs.shape)} and {tuple(lses.shape)}"
        )
    num_parts, groups, rows_per_group, head_dim_v = outs.shape
    rows = groups * rows_per_group
    if tuple(out.shape) != (rows, head_dim_v) or tuple(out_lse.shape) != (rows,):
        raise ValueError(
            f"launch_merge: out must be [{rows}, {head_dim_v}] and out_lse [{rows}], got "
            f"{tuple(out.shape)} and {tuple(out_lse.shape)}"
        )
    if rows == 0:
        return
    for name, t in (("outs", outs), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"launch_merge: {name} must have stride 1 in its last dim")
    target = triton_target() if target is None else target
    blocks = _merge_blocks(target, num_parts, rows, head_dim_v)
    _merge_states_kernel[(triton.cdiv(rows, blocks["BLOCK_R"]),)](
        outs,
        lses,
        out,
        out_lse,
        num_parts,
        rows,
        rows_per_group,
        outs.stride(0),
        outs.stride(1),
        outs.stride(2),
        lses.stride(0),
        lses.stride(1),
        lses.stride(2),
        out.stride(0),
        HEAD_DIM_V=head_dim_v,
        **blocks,
        **merge_launch_options(target),
    )


def launch_merge_pieces(
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    unit_parts: torch.Tensor,
    split_units: torch.Tensor,
    out: torch.Tensor,
    out_lse: torch.Tensor,
    *,
    num_groups: int,
    target: TritonTarget | None = None,
    query_start_loc: torch.Tensor | None = None,
) -> None:
    """Merge a balanced schedule's partials (``rocm_mla.kernels.schedule``) into ``out
    [B, rows, Dv]`` / ``out_lse [B, rows]``: ``part_out [P, R_g, Dv]`` / ``part_lse [P, R_g]``
    hold ``R_g`` (one row group's) rows per partial; every unit listed in ``split_units``
    merges its ``unit_parts`` range. The grid is fixed by the tables' capacity (graph-safe);
    a program of an unused entry (-1) does nothing. With ``query_start_loc`` (``[B + 1]``)
    the windows are packed: ``out [T, H, Dv]`` and ``out_lse [T, H]``, contiguous."""
    group_rows, head_dim_v = part_out.shape[1], part_out.shape[2]
    if part_out.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("launch_merge_pieces: part_out and out must have stride 1 in Dv")
    varlen = query_start_loc is not None
    if varlen:
        if not (out.is_contiguous() and out_lse.is_contiguous()):
            raise ValueError("launch_merge_pieces: packed out and out_lse must be contiguous")
        # A token's H rows, one after another: viewed as one request of T x H rows.
        out = out.view(1, -1, head_dim_v)
        out_lse, heads = out_lse.view(1, -1), out_lse.shape[1]
    target = triton_target() if target is None else target
    # The partials a unit has are known on the device only: tiles for the most a GPU
    # schedule cuts one into (the loops take more).
    blocks = _merge_blocks(target, 128, group_rows, head_dim_v)
    row_blocks = triton.cdiv(group_rows, blocks["BLOCK_R"])
    _merge_pieces_kernel[(split_units.shape[0] * row_blocks,)](
        part_out,
        part_lse,
        unit_parts,
        split_units,
        # Without packed windows any pointer will do: it is never read.
        query_start_loc if varlen else split_units,
        out,
        out_lse,
        num_groups,
        heads if varlen else out.shape[1],
        row_blocks,
        part_out.stride(0),
        part_out.stride(1),
        part_lse.stride(0),
        out.stride(0),
        out.stride(1),
        out_lse.stride(0),
        GROUP_ROWS=group_rows,
        HEAD_DIM_V=head_dim_v,
        VARLEN=varlen,
        **blocks,
        **merge_launch_options(target),
    )


def merge_states(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``rocm_mla.merge_states``: exact merge of N partials over disjoint key sets.

    Args:
        outs: ``[N, ...rows, Dv]`` partial outputs, each normalized over its own keys.
        lses: ``[N, ...rows]`` their natural-log softmax denominators.

    Returns:
        ``(out [...rows, Dv] in outs' dtype, lse [...rows] float32)``. Partials with lse -inf
        contribute nothing; a NaN or +inf lse, or a NaN output with weight > 0, makes the row
        NaN (out and lse); a row whose partials are all empty (every row when N = 0) gives
        out 0, lse -inf. Arguments are checked as ``rocm_mla.merge_states`` does
        (``check_merge_args``).
    """
    check_merge_args(outs, lses)
    num_parts, head_dim_v = outs.shape[0], outs.shape[-1]
    row_shape = outs.shape[1:-1]
    rows = row_shape.numel()
    flat_outs = outs.reshape(num_parts, rows, head_dim_v)
    if flat_outs.stride(-1) != 1:
        flat_outs = flat_outs.contiguous()
    out = torch.empty(rows, head_dim_v, dtype=outs.dtype, device=outs.device)
    out_lse = torch.empty(rows, dtype=torch.float32, device=outs.device)
    # N = 0 needs no special case: the kernel's loops run zero times, giving out 0, lse -inf.
    launch_merge(flat_outs, lses.reshape(num_parts, rows), out, out_lse)
    return out.view(*row_shape, head_dim_v), out_lse.view(row_shape)
