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
    KV_DTYPES,
    Q_DTYPES,
    DecodePlan,
    DecodeProblem,
    used_blocks_mask,
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
    """The reference decode. ``plan`` supplies the longest length and the keys every row
    sees (no host sync); without one they are read from the lengths (one sync)."""
    p = problem
    batch, q_len, num_heads, head_dim = p.q.shape
    dv, block_size, device = p.head_dim_v, p.block_size, p.q.device
    rows = q_len * num_heads  # row r = i * H + h
    kv_scale = 1.0 if p.kv_scale is None else p.kv_scale

    # The fp8 dequant scale of K folds into the softmax scale; the one of V into the output.
    q = (p.q.to(torch.float32) * (p.softmax_scale * kv_scale)).reshape(batch, rows, head_dim)
    visible = visible_lengths(p)  # [B, S_q]
    row_visible = visible.repeat_interleave(num_heads, dim=1)  # [B, rows]
    lens = p.cache_seqlens.to(torch.int64)

    running_max = torch.full((batch, rows), -math.inf, device=device)
    denom = torch.zeros(batch, rows, device=device)
    acc = torch.zeros(batch, rows, dv, device=device)

    if plan is None:
        max_len, all_visible = (int(v) for v in torch.stack([lens.max(), visible.min()]).tolist())
    else:
        max_len, all_visible = plan.max_seqlen, plan.min_visible
    # Tokens below all_visible are real data every row of every request may see, so the
    # chunks that lie entirely below it need no masking at all.
    # Entries past a request's last block may hold anything; point them at block 0 so the
    # gather stays in bounds (the tokens they bring are masked out below).
    block_ids = torch.where(used_blocks_mask(p), p.block_table, 0).to(torch.int64)
    cols_per_chunk = max(1, CHUNK_TOKENS // block_size)
    n_cols = min(-(-max_len // block_size), p.block_table.shape[1])
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

        t0 = c0 * block_size
        if t0 + n > all_visible:
            pos = torch.arange(t0, t0 + n, device=device)
            # Slots past a request's length are never read into a sum, even multiplied by 0:
            # they may hold NaN.
            kv.masked_fill_((pos[None, :] >= lens[:, None])[:, :, None], 0.0)
            scores = torch.bmm(q, kv.transpose(1, 2))
            scores.masked_fill_(pos[None, None, :] >= row_visible[:, :, None], -math.inf)
        else:
            scores = torch.bmm(q, kv.transpose(1, 2))

        new_max = torch.maximum(running_max, scores.amax(dim=-1))
        # Rows that have seen no key yet keep weight 0 without ever computing inf - inf.
        ref = torch.where(new_max == -math.inf, 0.0, new_max)
        scale_old = torch.exp(running_max - ref)
        weights = torch.exp(scores.sub_(ref[:, :, None]))
        weights.masked_fill_(weights < _FLUSH_BELOW, 0.0)
        denom.mul_(scale_old).add_(weights.sum(dim=-1))
        acc.mul_(scale_old[:, :, None]).baddbmm_(weights, kv[:, :, :dv])
        running_max = new_max

    # Only a row that saw no key has denom exactly 0. A non-finite input a row sees makes its
    # denom NaN, and NaN must reach out and lse: a zero there would read as "no keys" and a
    # merge would silently drop the partial.
    empty = denom == 0
    out = torch.where(empty[:, :, None], 0.0, acc / denom[:, :, None])
    if kv_scale != 1.0:
        out.mul_(kv_scale)
    lse = torch.where(empty, -math.inf, running_max + torch.log(denom))
    return (
        out.view(batch, q_len, num_heads, dv).to(p.q.dtype),
        lse.view(batch, q_len, num_heads),
    )


@torch.no_grad()
def lse_merge_weights(lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact LSE merge, as weights: the one place its formula is written.

    ``lses [N, ...rows]`` -> (``weights [N, ...rows]`` = ``exp(lse_n - logsumexp_m lse_m)``,
    merged ``lse [...rows]`` float32). A -inf lse is an empty partial: weight exactly 0. A
    NaN or +inf lse is a broken one: the row's weights and merged lse become NaN, so the
    fault reaches the output instead of vanishing. A row with no partial at all that saw a
    key gets all weights 0 and lse -inf.
    """
    lse = lses.to(torch.float32)
    broken = (torch.isnan(lse) | (lse == math.inf)).any(dim=0)
    lse = torch.where(broken[None], -math.inf, lse)
    top = lse.amax(dim=0)
    ref = torch.where(top == -math.inf, 0.0, top)
    weights = torch.exp(lse - ref)  # exactly 0 for -inf partials
    total = weights.sum(dim=0)
    seen = total > 0
    weights = weights / torch.where(seen, total, 1.0)
    merged = torch.where(seen, ref + torch.log(torch.where(seen, total, 1.0)), -math.inf)
    weights = torch.where(broken[None], math.nan, weights)
    merged = torch.where(broken, math.nan, merged)
    return weights, merged


@torch.no_grad()
def torch_merge_states(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact LSE merge of N partial attentions; see ``rocm_mla.merge_states``."""
    weights, lse = lse_merge_weights(lses)
    # Empty partials (weight exactly 0) are never read: their outputs may be NaN. A NaN
    # weight (a broken partial in the row) is kept so that the row comes out NaN.
    contrib = torch.where(weights[..., None] != 0, outs.to(torch.float32), 0.0)
    out = (contrib * weights[..., None]).sum(dim=0)
    return out.to(outs.dtype), lse
