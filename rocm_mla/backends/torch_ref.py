"""The torch backend: the reference and the CPU production path.

Absorbed MLA is MQA over the latent cache: every query head scores the same 576-wide rows,
and V is the first ``head_dim_v`` columns of those rows. The decode walks the block table in
chunks of columns; each chunk is gathered once into a buffer small enough to stay in cache,
and both ``Q K^T`` and ``P V`` read it there: on the CPU in one fused attention call per
chunk (``_scaled_dot_product_flash_attention_for_cpu``, which returns the log-sum-exp),
elsewhere as two batched GEMMs with an online softmax. Chunks are merged through their
log-sum-exps; the full gathered cache is never materialized. On the CPU, when the fused C++
kernel (``rocm_mla.kernels.cpu_decode``) builds, every call goes to it instead (per-row
bounds and packed windows included): one pass over each request's keys for all rows of its
window, with no gather, under the same results and NaN / fault rules.

Bounds: keys are read only below the plan's ``max_seqlen``, inside the block table and from
block ids in ``[0, num_blocks)``. A query row that may see any other key comes out NaN (out
and lse) and the cause is ORed into ``problem.fault_flag`` (``FAULT_*``), with no host sync.
"""

from __future__ import annotations

import math

import torch

from rocm_mla.backends.base import Capabilities, MLADecodeImpl
from rocm_mla.inputs import (
    FAULT_BEYOND_PLAN,
    FAULT_BEYOND_TABLE,
    FAULT_BLOCK_ID,
    FAULT_NEGATIVE_LENGTH,
    FAULT_ROW_BOUND,
    FP8_DTYPES,
    KV_DTYPES,
    Q_DTYPES,
    DecodePlan,
    DecodeProblem,
    row_bound_faults,
    visible_lengths,
)
from rocm_mla.kernels import cpu_decode

#: Bytes of gathered cache per chunk, all requests together. Fewer, larger fused calls win:
#: on a 2-core Sapphire Rapids, 1 MiB chunks (L2-sized) were 2-4x slower at 4 heads (each
#: call has a fixed cost), 64 MiB ones slower at 4K context (the buffer leaves the L3 slice).
CHUNK_BYTES = 16 << 20
#: At least this many tokens per request per chunk, so a large batch still amortizes the
#: per-chunk work (masks, merge).
MIN_CHUNK_TOKENS = 64
#: Softmax weights below this are flushed to zero. They change no sum at fp32 precision,
#: and denormal operands slow CPU GEMMs by an order of magnitude.
_FLUSH_BELOW = 2.0**-100


class TorchMLAImpl(MLADecodeImpl):
    name = "torch"
    capabilities = Capabilities(
        platforms=("cpu", "cuda", "hip"),
        q_dtypes=Q_DTYPES,
        kv_dtypes=KV_DTYPES,
        varlen=True,
        row_bounds=True,
    )

    def _decode(
        self, problem: DecodeProblem, plan: DecodePlan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch_mla_decode(problem, plan)


@torch.no_grad()
def torch_mla_decode(
    problem: DecodeProblem, plan: DecodePlan | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch decode. ``plan`` supplies the longest length the call may read (no host
    sync); without one it is read from the lengths (one sync)."""
    p = problem
    if p.q.device.type == "cpu" and cpu_kernel_unavailable() is None:
        return cpu_decode.decode(
            p.q,
            p.kv_cache,
            p.block_table,
            p.cache_seqlens,
            head_dim_v=p.head_dim_v,
            softmax_scale=p.softmax_scale,
            causal=p.causal,
            kv_scale=p.kv_scale,
            max_seqlen=None if plan is None else plan.max_seqlen,
            fault_flag=p.fault_flag,
            row_seqlens=p.row_seqlens,
            query_start_loc=p.query_start_loc,
            max_q_len=p.max_q_len,
        )
    batch, block_size, device = p.batch, p.block_size, p.q.device
    max_blocks = p.block_table.shape[1]

    visible = visible_lengths(p)  # [B, S_q], >= 0
    bad_bound = row_bound_faults(p)  # [B, S_q]
    lens = p.cache_seqlens.to(torch.int64).clamp(min=0)
    covered = int(lens.max()) if plan is None else plan.max_seqlen
    n_cols = min(-(-covered // block_size), max_blocks)
    reach = min(covered, n_cols * block_size)  # the call reads keys below this, no further

    table = p.block_table.to(torch.int64)
    bad_block = (table < 0) | (table >= p.num_blocks)  # [B, max_blocks]
    col_start = torch.arange(max_blocks, device=device) * block_size
    if max_blocks:
        first_bad = torch.where(bad_block, col_start, _NO_KEY).amin(dim=1)  # [B] key position
    else:
        first_bad = torch.full((batch,), _NO_KEY, device=device)
    sees_bad_block = first_bad[:, None] < visible
    negative = (p.cache_seqlens < 0)[:, None]  # a broken contract, not "no keys"
    poisoned = sees_bad_block | (visible > reach) | negative | bad_bound  # [B, S_q]
    if p.fault_flag is not None:
        bits = sees_bad_block.any() * FAULT_BLOCK_ID + negative.any() * FAULT_NEGATIVE_LENGTH
        bits = bits + (visible > max_blocks * block_size).any() * FAULT_BEYOND_TABLE
        bits = bits + bad_bound.any() * FAULT_ROW_BOUND
        if plan is not None:
            bits = bits + (visible > plan.max_seqlen).any() * FAULT_BEYOND_PLAN
        p.fault_flag.bitwise_or_(bits.to(torch.int32))
    # Keys at or past `limit` are never seen by a row that is not poisoned: they are zeroed
    # after the gather (unused slots may hold NaN) and masked out of every score.
    limit = torch.minimum(lens, first_bad).clamp_(max=reach)
    chunks = _Chunks(p, torch.where(bad_block, 0, table)[:, :n_cols], limit)
    row_visible = torch.minimum(visible, limit[:, None])  # [B, S_q]

    q = _padded_windows(p) if p.varlen else p.q  # [B, S_q, H, D]
    if device.type == "cpu":
        out, lse = _attend_fused(p, q, chunks, row_visible)
    else:
        out, lse = _attend_bmm(p, q, chunks, row_visible)

    # A row that may see a key it must not read, or saw a non-finite key, is NaN in out and
    # lse: a zero there would read as "no keys" and a merge would silently drop the partial.
    nan_rows = poisoned | (chunks.first_non_finite[:, None] < row_visible)  # [B, S_q]
    # A row that saw no key holds 0 / -inf whatever its query (the merge left 0 / 0 there).
    empty = (row_visible == 0)[:, :, None] & ~nan_rows[:, :, None]
    nan_rows = nan_rows[:, :, None] | (~empty & (torch.isnan(lse) | torch.isnan(out).any(-1)))
    out = _fill_rows(_fill_rows(out.to(p.q.dtype), nan_rows, math.nan), empty, 0.0)
    lse = lse.masked_fill(nan_rows, math.nan).masked_fill_(empty, -math.inf)
    if p.varlen:
        return _packed_windows(p, out), _packed_windows(p, lse)
    return out, lse


def _padded_windows(p: DecodeProblem) -> torch.Tensor:
    """Packed windows ``q [T, H, D]`` laid out as ``[B, S_q, H, D]`` (``S_q`` the longest),
    zeros past each window's end (rows that see no key)."""
    qsl = p.query_start_loc.to(torch.int64)
    offs = torch.arange(p.q_len, device=p.q.device)[None, :]
    tokens = qsl[:-1, None] + offs
    in_window = tokens < qsl[1:, None]
    padded = p.q[tokens.clamp(max=p.num_tokens - 1)]
    return padded.masked_fill_(~in_window[:, :, None, None], 0.0)


def _packed_windows(p: DecodeProblem, rows: torch.Tensor) -> torch.Tensor:
    """``[B, S_q, ...]`` per window back to ``[T, ...]`` in q's token order."""
    qsl = p.query_start_loc.to(torch.int64)
    tokens = torch.arange(p.num_tokens, device=rows.device)
    requests = torch.searchsorted(qsl[1:], tokens, right=True)
    return rows[requests, tokens - qsl[requests]]


def cpu_kernel_unavailable() -> str | None:
    """None when CPU calls run the fused C++ kernel, else why they run the torch ops."""
    return cpu_decode.available()


def _fill_rows(t: torch.Tensor, rows: torch.Tensor, value: float) -> torch.Tensor:
    """``t[rows] = value`` in place for a bool ``rows`` that broadcasts over t's leading dims.

    On the CPU ``masked_fill_`` with a row mask broadcast over the last dim is a scalar loop
    (20x slower than the GEMMs it guards); an ``index_fill_`` of the few rows is a memset. On
    a GPU the index list would be a host sync, and ``masked_fill_`` is fast there.
    """
    flat = t.view(-1, t.shape[-1])
    rows = rows.expand(t.shape[:-1])
    if t.device.type == "cpu":
        flat.index_fill_(0, rows.reshape(-1).nonzero().view(-1), value)
    else:
        flat.masked_fill_(rows.reshape(-1, 1), value)
    return t


#: "No such key": above every position a length can reach.
_NO_KEY = torch.iinfo(torch.int64).max


class _Chunks:
    """The block table walked in chunks of columns, each gathered into one reused buffer.

    Every chunk comes back as ``[B, n, D]`` rows in the compute dtype with the keys at or
    past ``limit`` and the probed non-finite ones zeroed (a softmax weight of 0 times NaN is
    still NaN). The first probed non-finite key position of each request is kept in
    ``first_non_finite``.
    """

    def __init__(self, p: DecodeProblem, block_ids: torch.Tensor, limit: torch.Tensor) -> None:
        batch, n_cols = block_ids.shape
        compute = _compute_dtype(p.q.dtype, p.kv_cache.dtype)
        row_bytes = p.head_dim * torch.empty((), dtype=compute).element_size()
        cols = CHUNK_BYTES // (batch * p.block_size * row_bytes)
        cols = max(cols, -(-MIN_CHUNK_TOKENS // p.block_size), 1)
        self.cols = min(cols, max(n_cols, 1))
        self.problem, self.block_ids, self.limit = p, block_ids, limit
        shape = (batch * self.cols, p.block_size, p.head_dim)
        self.gathered = torch.empty(shape, dtype=p.kv_cache.dtype, device=p.q.device)
        self.converted = (
            None
            if compute == p.kv_cache.dtype
            else torch.empty(shape, dtype=compute, device=p.q.device)
        )
        self.first_non_finite = torch.full((batch,), _NO_KEY, device=p.q.device)
        # A non-finite value in V makes out NaN in every row that sees it (its weight times
        # it, or a NaN/inf score); one only in the rope part can score -inf and drop out of a
        # head silently. So the rope columns are probed, and all of them when some rows
        # must not see a key others do (a causal window, per-row bounds, ragged windows).
        self.probe_from = 0 if _rows_differ(p) else p.head_dim_v

    def __iter__(self):
        p, batch = self.problem, self.block_ids.shape[0]
        for c0 in range(0, self.block_ids.shape[1], self.cols):
            ids = self.block_ids[:, c0 : c0 + self.cols].reshape(-1)
            kv = torch.index_select(p.kv_cache, 0, ids, out=self.gathered[: ids.numel()])
            if self.converted is not None:
                kv = self.converted[: ids.numel()].copy_(kv)
            t0 = c0 * p.block_size
            kv = kv.view(batch, -1, p.head_dim)
            pos = torch.arange(t0, t0 + kv.shape[1], device=kv.device)
            beyond = pos[None, :] >= self.limit[:, None]
            # 0 * x is NaN exactly when x is not finite: two vectorized passes where
            # isfinite().all() takes four. (A GEMV by zeros would be one, but torch's bf16
            # GEMV spreads a NaN to the neighbouring row.)
            probe = kv[:, :, self.probe_from :].mul(0.0).sum(dim=-1)
            non_finite = torch.isnan(probe) & ~beyond
            first = torch.where(non_finite, pos, _NO_KEY).amin(dim=1)
            torch.minimum(self.first_non_finite, first, out=self.first_non_finite)
            _fill_rows(kv, beyond | non_finite, 0.0)
            yield t0, pos, kv


def _rows_differ(p: DecodeProblem) -> bool:
    """Whether the query rows of one request may see different keys."""
    return (p.causal and p.q_len > 1) or p.varlen or p.row_seqlens is not None


def _compute_dtype(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> torch.dtype:
    """The dtype both GEMMs run in: the 16-bit one of q when the cache holds it exactly
    (the same dtype, or fp8), else float32."""
    if q_dtype != torch.float32 and kv_dtype in (q_dtype, *FP8_DTYPES):
        return q_dtype
    return torch.float32


def _attend_fused(
    p: DecodeProblem, q: torch.Tensor, chunks: _Chunks, row_visible: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU: one fused attention call per chunk (scores never leave the kernel), the chunks
    merged through their log-sum-exps. ``q [B, S_q, H, D]``. Returns out [B, S_q, H, Dv]
    and lse (float32)."""
    batch, q_len, num_heads, head_dim = q.shape
    rows = q_len * num_heads
    kv_scale = 1.0 if p.kv_scale is None else p.kv_scale
    compute = _compute_dtype(p.q.dtype, p.kv_cache.dtype)
    scale = p.softmax_scale * kv_scale  # the K dequant scale folds into the softmax scale
    if compute == torch.float32:
        # Scaled up front as the reference does, so that a score that overflows is inf.
        q, scale = q.to(torch.float32) * scale, 1.0
    q = q.reshape(batch, 1, rows, head_dim)
    per_row = _rows_differ(p)
    out = lse = None
    for t0, pos, kv in chunks:
        hidden = pos[None, None, :] >= row_visible[:, :, None]  # [B, S_q, n]
        hidden = hidden.repeat_interleave(num_heads, dim=1) if per_row else hidden[:, :1]
        mask = torch.zeros(hidden.shape, dtype=compute, device=kv.device)
        mask.masked_fill_(hidden, -math.inf)
        kv = kv[:, None]
        o, m = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, kv, kv, 0.0, False, attn_mask=mask[:, None], scale=scale
        )[:2]
        # The kernel gives a row without keys in this chunk lse 0; here it is -inf.
        sees = (row_visible > t0).repeat_interleave(num_heads, dim=1)
        m = m.view(batch, rows).masked_fill(~sees, -math.inf)
        o = o.view(batch, rows, head_dim)[:, :, : p.head_dim_v]
        out, lse = (o.to(torch.float32), m) if out is None else _merge(out, lse, o, m)
    if out is None:  # no column to read
        out = torch.zeros(batch, rows, p.head_dim_v, device=q.device)
        lse = torch.full((batch, rows), -math.inf, device=q.device)
    if kv_scale != 1.0:
        out = out * kv_scale
    return out.view(batch, q_len, num_heads, -1), lse.view(batch, q_len, num_heads)


def _merge(
    out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, m: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two softmax partials over disjoint keys as one; NaN in either stays NaN."""
    new = torch.maximum(lse, m)
    ref = torch.where(new == -math.inf, 0.0, new)  # both empty: weights 0, not inf - inf
    w_old, w_new = torch.exp(lse - ref), torch.exp(m - ref)
    total = w_old + w_new
    out = (out * (w_old / total)[:, :, None]).add_(o * (w_new / total)[:, :, None])
    return out, ref + torch.log(total)


def _attend_bmm(
    p: DecodeProblem, q: torch.Tensor, chunks: _Chunks, row_visible: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPU: two batched GEMMs per chunk with an online softmax (float32 throughout);
    ``q [B, S_q, H, D]``."""
    batch, q_len, num_heads, head_dim = q.shape
    rows, dv, device = q_len * num_heads, p.head_dim_v, q.device
    kv_scale = 1.0 if p.kv_scale is None else p.kv_scale
    q = (q.to(torch.float32) * (p.softmax_scale * kv_scale)).reshape(batch, rows, head_dim)
    row_visible = row_visible.repeat_interleave(num_heads, dim=1)  # [B, rows]
    running_max = torch.full((batch, rows), -math.inf, device=device)
    denom = torch.zeros(batch, rows, device=device)
    acc = torch.zeros(batch, rows, dv, device=device)
    for _, pos, kv in chunks:
        kv = kv.to(torch.float32)
        scores = torch.bmm(q, kv.transpose(1, 2))
        scores.masked_fill_(pos[None, None, :] >= row_visible[:, :, None], -math.inf)
        new_max = torch.maximum(running_max, scores.amax(dim=-1))
        # Rows that have seen no key yet keep weight 0 without ever computing inf - inf.
        ref = torch.where(new_max == -math.inf, 0.0, new_max)
        scale_old = torch.exp(running_max - ref)
        weights = torch.exp(scores.sub_(ref[:, :, None]))
        weights.masked_fill_(weights < _FLUSH_BELOW, 0.0)
        denom.mul_(scale_old).add_(weights.sum(dim=-1))
        acc.mul_(scale_old[:, :, None]).baddbmm_(weights, kv[:, :, :dv])
        running_max = new_max
    out = acc / denom[:, :, None]
    if kv_scale != 1.0:
        out.mul_(kv_scale)
    lse = running_max + torch.log(denom)
    return out.view(batch, q_len, num_heads, dv), lse.view(batch, q_len, num_heads)
