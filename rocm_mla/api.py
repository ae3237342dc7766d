"""The public kernel entry points. A user learns the package from this file.

Shapes (DeepSeek/Kimi absorbed MLA): ``D = head_dim_v + rope_dim`` = 512 + 64 = 576; the KV
cache holds one latent row of ``D`` values per token, its first ``head_dim_v`` columns are V.
"""

from __future__ import annotations

import torch

from rocm_mla.backends import available_backends, select_backend
from rocm_mla.backends.torch_ref import torch_merge_states
from rocm_mla.inputs import prepare_decode

__all__ = ["available_backends", "merge_states", "mla_decode"]


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    head_dim_v: int = 512,
    softmax_scale: float | None = None,
    causal: bool = True,
    kv_scale: float | torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed-MLA decode attention over a paged latent KV cache (FlashMLA-shaped).

    Args:
        q: ``[B, S_q, H, D]`` float32/float16/bfloat16. Per head, the absorbed query
            (``q_nope @ W_UK`` in the first ``head_dim_v`` columns, ``q_pe`` after). ``S_q``
            > 1 is a causal verify window (speculative decoding).
        kv_cache: ``[num_blocks, block_size, D]`` or ``[num_blocks, block_size, 1, D]``;
            float32/float16/bfloat16, or fp8 (e4m3fn / e4m3fnuz) with ``kv_scale``.
        block_table: ``[B, max_blocks]`` int32; entry ``j`` of request ``b`` is the cache
            block holding its tokens ``[j * block_size, (j + 1) * block_size)``. Any order;
            entries past a request's last block are ignored.
        cache_seqlens: ``[B]`` int32 tokens in the cache per request, the ``S_q`` new ones
            included; ``0 <= cache_seqlens <= max_blocks * block_size``.
        head_dim_v: V width (kv_lora_rank, 512); ``D - head_dim_v`` is the rope width.
        softmax_scale: defaults to ``D ** -0.5``.
        causal: query ``i`` of ``S_q`` sees keys ``[0, cache_seqlens - S_q + i]``; when
            False every query sees all ``cache_seqlens`` keys.
        kv_scale: per-tensor dequant scale of an fp8 cache (required for fp8, else None).
        backend: "auto", "aiter", "triton" or "torch"; None reads ``$ROCM_MLA_BACKEND``
            (default auto: aiter on gfx942/gfx950 when it can run the call, else Triton on
            a GPU, else torch).

    Returns:
        ``(out, lse)``: ``out [B, S_q, H, head_dim_v]`` in q's dtype; ``lse [B, S_q, H]``
        float32, natural log of the softmax denominator (scores already scaled). A row with
        no visible key has ``out = 0`` and ``lse = -inf``, never NaN.

    Raises:
        ValueError: a malformed argument (which one, what was expected, what came), an
            unknown backend name, or a named backend that cannot run this call (its reasons).
    """
    problem = prepare_decode(
        q,
        kv_cache,
        block_table,
        cache_seqlens,
        head_dim_v=head_dim_v,
        softmax_scale=softmax_scale,
        causal=causal,
        kv_scale=kv_scale,
    )
    impl_cls = select_backend(backend, problem)
    impl = impl_cls(
        num_heads=problem.num_heads,
        head_dim_v=head_dim_v,
        rope_dim=problem.head_dim - head_dim_v,
        softmax_scale=problem.softmax_scale,
    )
    return impl.run(problem)


def merge_states(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of N partial attentions over disjoint key sets (split-KV, DCP shards).

    Args:
        outs: ``[N, ...rows, Dv]`` partial outputs, each normalized over its own keys.
        lses: ``[N, ...rows]`` their natural-log softmax denominators.

    Returns:
        ``(out [...rows, Dv] in outs' dtype, lse [...rows] float32)``, equal to attending over
        the union of the key sets. Partials whose lse is -inf or NaN contribute nothing (their
        out may be NaN); a row where every partial is empty gives out 0 and lse -inf.
    """
    if outs.dim() < 2 or lses.shape != outs.shape[:-1]:
        raise ValueError(
            "merge_states: outs must be [N, ...rows, Dv] and lses [N, ...rows], got outs "
            f"{tuple(outs.shape)} and lses {tuple(lses.shape)}"
        )
    if outs.device != lses.device:
        raise ValueError(
            f"merge_states: outs and lses must share a device, got {outs.device} and {lses.device}"
        )
    if outs.device.type == "cpu":
        return torch_merge_states(outs, lses)
    # On a GPU the Triton kernel does the same arithmetic in one launch instead of ~10.
    from rocm_mla.kernels.merge_states import merge_states as triton_merge_states

    return triton_merge_states(outs, lses)
