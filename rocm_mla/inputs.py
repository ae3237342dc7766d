"""Validation of ``mla_decode`` arguments, done once before any kernel runs.

Every check names the argument, what was expected and what came. Value checks (lengths,
block ids) read the tensors, which costs one host sync on a GPU; they are what stops a bad
block table from becoming an illegal memory access inside a kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
Q_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16, *FP8_DTYPES)


@dataclass(frozen=True)
class DecodeProblem:
    """The validated arguments of one decode call, in the layout every backend consumes."""

    q: torch.Tensor  #: [B, S_q, H, D]
    kv_cache: torch.Tensor  #: [num_blocks, block_size, D] (a view; 4-D caches are squeezed)
    block_table: torch.Tensor  #: [B, max_blocks] int32
    cache_seqlens: torch.Tensor  #: [B] int32
    head_dim_v: int
    softmax_scale: float
    causal: bool
    kv_scale: float | None  #: per-tensor dequant scale of an fp8 cache, else None

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def q_len(self) -> int:
        return self.q.shape[1]

    @property
    def num_heads(self) -> int:
        return self.q.shape[2]

    @property
    def head_dim(self) -> int:
        return self.q.shape[3]

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.shape[0]

    @property
    def block_size(self) -> int:
        return self.kv_cache.shape[1]


def _fail(arg: str, expected: str, got: object) -> ValueError:
    return ValueError(f"mla_decode: {arg} must be {expected}, got {got}")


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}"


def prepare_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    head_dim_v: int,
    softmax_scale: float | None,
    causal: bool,
    kv_scale: float | torch.Tensor | None,
) -> DecodeProblem:
    """Check every argument of ``mla_decode`` and return the normalized problem."""
    for name, t in (
        ("q", q),
        ("kv_cache", kv_cache),
        ("block_table", block_table),
        ("cache_seqlens", cache_seqlens),
    ):
        if not isinstance(t, torch.Tensor):
            raise _fail(name, "a torch.Tensor", type(t).__name__)

    if q.dim() != 4:
        raise _fail("q", "4-D [batch, q_len, num_heads, head_dim]", _describe(q))
    if q.dtype not in Q_DTYPES:
        raise _fail("q", "float32, float16 or bfloat16", _describe(q))
    batch, q_len, num_heads, head_dim = q.shape
    if batch < 1 or q_len < 1 or num_heads < 1:
        raise _fail("q", "non-empty in batch, q_len and num_heads", _describe(q))
    if not isinstance(head_dim_v, int) or not 0 < head_dim_v < head_dim:
        raise _fail(
            "head_dim_v", f"an int in (0, {head_dim}) (q's head_dim holds V plus rope)", head_dim_v
        )

    if kv_cache.dim() == 4:
        if kv_cache.shape[2] != 1:
            raise _fail(
                "kv_cache",
                "[num_blocks, block_size, D] or [num_blocks, block_size, 1, D] (one latent head)",
                _describe(kv_cache),
            )
        kv_cache = kv_cache.squeeze(2)
    if kv_cache.dim() != 3:
        raise _fail(
            "kv_cache",
            "[num_blocks, block_size, D] or [num_blocks, block_size, 1, D]",
            _describe(kv_cache),
        )
    if kv_cache.shape[2] != head_dim:
        raise _fail("kv_cache", f"last dim {head_dim} (q's head_dim)", _describe(kv_cache))
    if kv_cache.shape[0] < 1 or kv_cache.shape[1] < 1:
        raise _fail("kv_cache", "at least one block of at least one token", _describe(kv_cache))
    if kv_cache.dtype not in KV_DTYPES:
        raise _fail(
            "kv_cache", "float32, float16, bfloat16 or fp8 (e4m3fn/e4m3fnuz)", kv_cache.dtype
        )
    if kv_cache.stride(-1) != 1:
        raise _fail("kv_cache", "contiguous in its last dim", f"stride {kv_cache.stride()}")

    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise _fail("block_table", f"2-D [{batch}, max_blocks]", _describe(block_table))
    if block_table.dtype != torch.int32:
        raise _fail("block_table", "int32", block_table.dtype)
    if cache_seqlens.dim() != 1 or cache_seqlens.shape[0] != batch:
        raise _fail("cache_seqlens", f"1-D [{batch}]", _describe(cache_seqlens))
    if cache_seqlens.dtype != torch.int32:
        raise _fail("cache_seqlens", "int32", cache_seqlens.dtype)
    for name, t in (("kv_cache", kv_cache), ("block_table", block_table)):
        if t.device != q.device:
            raise _fail(name, f"on q's device {q.device}", t.device)
    if cache_seqlens.device != q.device:
        raise _fail("cache_seqlens", f"on q's device {q.device}", cache_seqlens.device)

    if softmax_scale is None:
        softmax_scale = head_dim**-0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise _fail("softmax_scale", "a positive finite float or None", repr(softmax_scale))
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise _fail("softmax_scale", "a positive finite float or None", softmax_scale)

    if kv_cache.dtype in FP8_DTYPES:
        if kv_scale is None:
            raise _fail("kv_scale", f"the per-tensor scale of the {kv_cache.dtype} cache", None)
        if isinstance(kv_scale, torch.Tensor):
            if kv_scale.numel() != 1:
                raise _fail("kv_scale", "a scalar (per-tensor scale)", _describe(kv_scale))
            kv_scale = float(kv_scale.item())
        kv_scale = float(kv_scale)
        if not (math.isfinite(kv_scale) and kv_scale > 0):
            raise _fail("kv_scale", "a positive finite scale", kv_scale)
    elif kv_scale is not None:
        raise _fail(
            "kv_scale", f"None for a {kv_cache.dtype} cache (only fp8 caches scale)", kv_scale
        )

    capacity = block_table.shape[1] * kv_cache.shape[1]
    if batch:
        lo, hi = torch.aminmax(cache_seqlens)
        lo, hi = int(lo), int(hi)
        if lo < 0:
            raise _fail("cache_seqlens", "non-negative", f"a minimum of {lo}")
        if hi > capacity:
            raise _fail(
                "cache_seqlens",
                f"at most the block table's capacity {block_table.shape[1]} blocks x "
                f"{kv_cache.shape[1]} tokens = {capacity}",
                f"a maximum of {hi}",
            )
        used = _used_blocks_mask(block_table, cache_seqlens, kv_cache.shape[1])
        if bool(used.any()):
            ids = block_table[used]
            bad = (ids < 0) | (ids >= kv_cache.shape[0])
            if bool(bad.any()):
                first = int(ids[bad][0])
                raise _fail(
                    "block_table",
                    f"block ids in [0, {kv_cache.shape[0]}) (kv_cache's num_blocks) for every "
                    "block that cache_seqlens uses",
                    f"{int(bad.sum())} out-of-range ids, first {first}",
                )

    return DecodeProblem(
        q=q,
        kv_cache=kv_cache,
        block_table=block_table,
        cache_seqlens=cache_seqlens,
        head_dim_v=head_dim_v,
        softmax_scale=float(softmax_scale),
        causal=bool(causal),
        kv_scale=kv_scale if kv_cache.dtype in FP8_DTYPES else None,
    )


def _used_blocks_mask(
    block_table: torch.Tensor, cache_seqlens: torch.Tensor, block_size: int
) -> torch.Tensor:
    """[B, max_blocks] bool: the block-table entries that hold some of each request's tokens."""
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    needed = (cache_seqlens.to(torch.int64) + block_size - 1) // block_size
    return cols[None, :] < needed[:, None]


def used_blocks_mask(problem: DecodeProblem) -> torch.Tensor:
    return _used_blocks_mask(problem.block_table, problem.cache_seqlens, problem.block_size)


def visible_lengths(problem: DecodeProblem) -> torch.Tensor:
    """[B, S_q] int64: how many keys query row i sees (``L - S_q + 1 + i`` when causal, >= 0)."""
    lens = problem.cache_seqlens.to(torch.int64)[:, None]
    if not problem.causal:
        return lens.expand(-1, problem.q_len)
    offs = torch.arange(problem.q_len, device=lens.device) - (problem.q_len - 1)
    return (lens + offs[None, :]).clamp_(min=0)
