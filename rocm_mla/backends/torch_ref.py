"""The torch backend: the reference and the CPU production path.

Absorbed MLA is MQA over the latent cache: every query head scores the same 576-wide rows,
and V is the first ``head_dim_v`` columns of those rows. The decode walks the block table in
chunks of columns; each chunk is gathered once into a small buffer that stays in cache and
serves both ``Q K^T`` and ``P V``, with an online (flash) softmax across chunks. The full
gathered cache is never materialized.
"""

from __future__ import annotations

import math

import torch

from rocm_mla.backends.base import Capabilities, MLADecodeImpl
from rocm_mla.inputs import (
    FAULT_BEYOND_PLAN,
    FAULT_BEYOND_TABLE,
    FAULT_BLOCK_ID,
    KV_DTYPES,
    Q_DTYPES,
    DecodePlan,
    DecodeProblem,
    visible_lengths,
)

#: Tokens per request gathered per step: B x 256 x 576 fp32 rows stay in a CPU's L2/L3.
CHUNK_TOKENS = 256
#: Softmax weights below this are flushed to zero. They change no sum at fp32 precision,
#: and denormal operands slow CPU GEMMs by an order of magnitude.
_FLUSH_BELOW = 2.0**-100


class TorchMLAImpl(MLADecodeImpl):
    name = "torch"
    capabilities = Capabilities(
        platforms=("cpu", "cuda", "hip"), q_dtypes=Q_DTYPES, kv_dtypes=KV_DTYPES
    )

    def _decode(
        self, problem: DecodeProblem, plan: DecodePlan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch_mla_decode(problem, plan)


@torch.no_grad()
def torch_mla_decode(
    problem: DecodeProblem, plan: DecodePlan | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference decode, bounded by the plan and the cache.

    ``plan`` supplies the longest length the call may read (no host sync); without one it is
    read from the lengths (one sync). Keys are read only below that length, inside the block
    table and from block ids in ``[0, num_blocks)``; a query row that may see any other key
    comes out NaN and the cause is ORed into ``problem.fault_flag`` (``FAULT_*``).
    """
    p = problem
    batch, q_len, num_heads, head_dim = p.q.shape
    dv, block_size, device = p.head_dim_v, p.block_size, p.q.device
    rows = q_len * num_heads  # row r = i * H + h
    kv_scale = 1.0 if p.kv_scale is None else p.kv_scale
    max_blocks = p.block_table.shape[1]

    # The fp8 dequant scale of K folds into the softmax scale; the one of V into the output.
    q = (p.q.to(torch.float32) * (p.softmax_scale * kv_scale)).reshape(batch, rows, head_dim)
    visible = visible_lengths(p)  # [B, S_q], >= 0
    lens = p.cache_seqlens.to(torch.int64).clamp(min=0)
    covered = int(lens.max()) if plan is None else plan.max_seqlen
    n_cols = min(-(-covered // block_size), max_blocks)
    reach = min(covered, n_cols * block_size)  # the call reads keys below this, no further

    table = p.block_table.to(torch.int64)
    bad_block = (table < 0) | (table >= p.num_blocks)  # [B, max_blocks]
    col_start = torch.arange(max_blocks, device=device) * block_size
    no_bad = torch.iinfo(torch.int64).max
    if max_blocks:
        first_bad = torch.where(bad_block, col_start, no_bad).amin(dim=1)  # [B] key position
    else:
        first_bad = torch.full((batch,), no_bad, device=device)
    sees_bad_block = first_bad[:, None] < visible
    poisoned = sees_bad_block | (visible > reach)  # [B, S_q]
    if p.fault_flag is not None:
        bits = sees_bad_block.any() * FAULT_BLOCK_ID
        bits = bits + (visible > max_blocks * block_size).any() * FAULT_BEYOND_TABLE
        if plan is not None:
            bits = bits + (visible > plan.max_seqlen).any() * FAULT_BEYOND_PLAN
        p.fault_flag.bitwise_or_(bits.to(torch.int32))
    # Keys at or past `limit` are never seen by a row that is not poisoned: they are zeroed
    # after the gather (unused slots may hold NaN) and masked out of every score.
    limit = torch.minimum(lens, first_bad).clamp_(max=reach)
    row_visible = torch.minimum(visible, limit[:, None]).repeat_interleave(num_heads, dim=1)
    block_ids = torch.where(bad_block, 0, table)[:, :n_cols]

    running_max = torch.full((batch, rows), -math.inf, device=device)
    denom = torch.zeros(batch, rows, device=device)
    acc = torch.zeros(batch, rows, dv, device=device)
    non_finite = torch.zeros(batch, rows, dtype=torch.bool, device=device)

    cols_per_chunk = max(1, CHUNK_TOKENS // block_size)
    gathered = torch.empty(
        batch * min(cols_per_chunk, max(n_cols, 1)),
        block_size,
        head_dim,
        dtype=p.kv_cache.dtype,
        device=device,
    )
    as_fp32 = (
        None
        if p.kv_cache.dtype == torch.float32
        else torch.empty(gathered.shape, dtype=torch.float32, device=device)
    )

    for c0 in range(0, n_cols, cols_per_chunk):
        c1 = min(c0 + cols_per_chunk, n_cols)
        n = (c1 - c0) * block_size
        ids = block_ids[:, c0:c1].reshape(-1)
        kv = torch.index_select(p.kv_cache, 0, ids, out=gathered[: ids.numel()])
        if as_fp32 is not None:
            kv = as_fp32[: ids.numel()].copy_(kv)
        kv = kv.view(batch, n, head_dim)

        pos = torch.arange(c0 * block_size, c0 * block_size + n, device=device)
        kv.masked_fill_((pos[None, :] >= limit[:, None])[:, :, None], 0.0)
        scores = torch.bmm(q, kv.transpose(1, 2))
        hidden = pos[None, None, :] >= row_visible[:, :, None]
        # A non-finite key makes its score non-finite in every head, even one where it would
        # read -inf (weight 0) and leave out and lse finite.
        non_finite |= ~torch.isfinite(scores.masked_fill(hidden, 0.0)).all(dim=-1)
        scores.masked_fill_(hidden, -math.inf)
        if p.causal and q_len > 1:
            # Rows of one verify window see different keys: a non-finite key that only
            # later rows see has weight 0 in the earlier ones, and 0 * NaN would still
            # reach them. The rows that do see it are NaN through `non_finite`.
            kv[:, :, :dv] = torch.where(torch.isfinite(kv[:, :, :dv]), kv[:, :, :dv], 0.0)

        new_max = torch.maximum(running_max, scores.amax(dim=-1))
        # Rows that have seen no key yet keep weight 0 without ever computing inf - inf.
        ref = torch.where(new_max == -math.inf, 0.0, new_max)
        scale_old = torch.exp(running_max - ref)
        weights = torch.exp(scores.sub_(ref[:, :, None]))
        weights.masked_fill_(weights < _FLUSH_BELOW, 0.0)
        denom.mul_(scale_old).add_(weights.sum(dim=-1))
        acc.mul_(scale_old[:, :, None]).baddbmm_(weights, kv[:, :, :dv])
        running_max = new_max

    # Only a row that saw no key has denom exactly 0. A row that saw a non-finite input or
    # may see a key it must not read is NaN in out and lse: a zero there would read as
    # "no keys" and a merge would silently drop the partial.
    nan_rows = non_finite | poisoned.repeat_interleave(num_heads, dim=1)
    empty = denom == 0
    out = torch.where(empty[:, :, None], 0.0, acc / denom[:, :, None])
    if kv_scale != 1.0:
        out.mul_(kv_scale)
    out.masked_fill_(nan_rows[:, :, None], math.nan)
    lse = torch.where(empty, -math.inf, running_max + torch.log(denom))
    lse.masked_fill_(nan_rows, math.nan)
    return (
        out.view(batch, q_len, num_heads, dv).to(p.q.dtype),
        lse.view(batch, q_len, num_heads),
    )
