"""Independent references for the tests, written apart from every backend.

``dense_mla_decode`` is the plainest possible statement of ``mla_decode``: per request, copy
the cache rows it owns into a dense tensor, then per query row a softmax over the visible
ones, in float64. ``make_paged_problem`` builds random paged caches with shuffled block
tables and NaN in every slot no request owns.
"""

from __future__ import annotations

import math

import torch


def dense_mla_decode(
    q,
    kv_cache,
    block_table,
    cache_seqlens,
    *,
    head_dim_v=512,
    softmax_scale=None,
    causal=True,
    kv_scale=None,
    row_seqlens=None,
):
    """Returns (out [B, S_q, H, Dv] float64, lse [B, S_q, H] float64).

    ``row_seqlens`` ``[B, S_q]``: row ``i`` of request ``b`` sees the first
    ``row_seqlens[b][i]`` keys (``causal`` then plays no part)."""
    if kv_cache.dim() == 4:
        kv_cache = kv_cache[:, :, 0]
    batch, q_len, num_heads, head_dim = q.shape
    block_size = kv_cache.shape[1]
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    deq = 1.0 if kv_scale is None else float(kv_scale)
    out = torch.zeros(batch, q_len, num_heads, head_dim_v, dtype=torch.float64)
    lse = torch.full((batch, q_len, num_heads), -math.inf, dtype=torch.float64)
    for b in range(batch):
        length = int(cache_seqlens[b])
        rows = [
            kv_cache[int(block_table[b, t // block_size]), t % block_size] for t in range(length)
        ]
        if not rows:
            continue
        keys = torch.stack(rows).to(torch.float64) * deq  # [L, D]
        for i in range(q_len):
            if row_seqlens is not None:
                visible = int(row_seqlens[b][i])
            else:
                visible = length - q_len + 1 + i if causal else length
            if visible <= 0:
                continue
            k = keys[:visible]
            s = (q[b, i].to(torch.float64) @ k.T) * scale  # [H, visible]
            lse[b, i] = torch.logsumexp(s, dim=-1)
            out[b, i] = torch.softmax(s, dim=-1) @ k[:, :head_dim_v]
    return out, lse


def dense_varlen_mla_decode(q, query_start_loc, kv_cache, block_table, cache_seqlens, **kw):
    """``dense_mla_decode`` of packed windows: ``q [T, H, D]``, window ``b`` in rows
    ``[qsl[b], qsl[b + 1])``; ``row_seqlens`` (optional) ``[T]``. Returns (out [T, H, Dv],
    lse [T, H]) float64, each window decoded on its own."""
    row_seqlens = kw.pop("row_seqlens", None)
    qsl = [int(v) for v in query_start_loc]
    outs, lses = [], []
    for b in range(len(qsl) - 1):
        window = q[qsl[b] : qsl[b + 1]][None]
        rows = None if row_seqlens is None else [list(row_seqlens[qsl[b] : qsl[b + 1]])]
        out, lse = dense_mla_decode(
            window,
            kv_cache,
            block_table[b : b + 1],
            cache_seqlens[b : b + 1],
            row_seqlens=rows,
            **kw,
        )
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses)


def dcp_shard(kv, block_table, lengths, world, rank, interleave, block_size=64):
    """DCP rank ``rank``'s cache of a global paged cache (pages of ``kv.shape[1]``): the
    tokens it owns (``rocm_mla.dcp.owner_rank``), in order, as a dense prefix of its own
    pages of ``block_size`` (the layout ``rocm_mla.dcp.slot_mapping`` writes), NaN elsewhere.
    Returns ``(cache, block_table, local lengths int32)``."""
    from rocm_mla.dcp import local_seq_lens, owner_rank

    local = local_seq_lens(torch.tensor(lengths), world, rank, interleave).tolist()
    pages = [max(1, -(-n // block_size)) for n in local]
    shard = torch.full((sum(pages) + 1, block_size, kv.shape[-1]), math.nan, dtype=kv.dtype)
    table = torch.full((len(lengths), max(pages)), -1, dtype=torch.int32)
    page, source_block = 0, kv.shape[1]
    for b, length in enumerate(lengths):
        positions = torch.arange(length)
        mine = positions[owner_rank(positions, world, interleave) == rank]
        for j in range(pages[b]):
            table[b, j] = page + j
        for slot, p in enumerate(mine.tolist()):
            source = kv[int(block_table[b, p // source_block]), p % source_block]
            shard[page + slot // block_size, slot % block_size] = source
        page += pages[b]
    return shard, table, torch.tensor(local, dtype=torch.int32)


def make_paged_problem(
    lengths,
    *,
    num_heads=16,
    q_len=1,
    block_size=16,
    head_dim=576,
    dtype=torch.float32,
    extra_blocks=3,
    seed=0,
    nan_fill=True,
    four_d=False,
):
    """Random q / paged cache / shuffled block table for the given per-request lengths."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    blocks_per_req = [max(1, -(-n // block_size)) for n in lengths]
    max_blocks = max(blocks_per_req) + 1
    num_blocks = sum(blocks_per_req) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    kv = torch.randn(num_blocks, block_size, head_dim, generator=gen)
    if nan_fill:
        kv_filled = torch.full_like(kv, math.nan)
    block_table = torch.full((batch, max_blocks), -1, dtype=torch.int32)
    cursor = 0
    for b, n in enumerate(lengths):
        for j in range(-(-n // block_size)):
            blk = int(perm[cursor])
            cursor += 1
            block_table[b, j] = blk
            used = min(block_size, n - j * block_size)
            if nan_fill:
                kv_filled[blk, :used] = kv[blk, :used]
    if nan_fill:
        kv = kv_filled
    q = torch.randn(batch, q_len, num_heads, head_dim, generator=gen)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    kv = kv.to(dtype)
    if four_d:
        kv = kv.unsqueeze(2)
    return q.to(dtype), kv, block_table, seqlens


def assert_same_attention(out, lse, ref_out, ref_lse, tol):
    """Same values, same empty rows (out exactly 0, lse exactly -inf), no NaN anywhere."""
    assert out.dtype == ref_out.dtype and lse.dtype == torch.float32
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty)
    assert (lse[empty] == -math.inf).all() and (out[empty] == 0).all()
    torch.testing.assert_close(out.float(), ref_out.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse[~empty], ref_lse[~empty], atol=tol, rtol=tol)
