"""Attention Residuals (Kimi-K3): a softmax mixture over depth in place of the residual add.

The stream carried through the stack is a bank of completed block sums ``[T, n_blocks, D]``
(block 0 = the token embedding; a block closes at every layer ``L`` with ``L % B == 0``) and
``p [T, D]``, the running sum of sublayer outputs of the open block. Each sublayer input and
the final output are ``AttnRes(bank + [p])``.
"""

from __future__ import annotations

import torch

from rocm_mla.models.kimi_k3.ops import rms_norm


def attn_res_mix(
    bank: torch.Tensor, p: torch.Tensor, norm_weight: torch.Tensor, query: torch.Tensor, eps: float
) -> torch.Tensor:
    """Mix the sources ``s_i`` = bank blocks then ``p`` with softmax weights over depth.

    ``logit_i = query . RMSNorm_norm_weight(s_i)`` (keys normalized, values raw), softmax in
    fp32, ``out = sum_i alpha_i s_i``.

    Args:
        bank: ``[T, n, D]`` completed blocks (``n`` may be 0).
        p: ``[T, D]`` the open block's running sum.
        norm_weight: ``[D]``; query: ``[1, D]`` or ``[D]``.

    Returns:
        ``[T, D]`` in p's dtype.
    """
    sources = torch.cat([bank, p[:, None, :]], dim=1)  # [T, n+1, D]
    logits = (rms_norm(sources, norm_weight, eps).float() * query.reshape(-1).float()).sum(-1)
    alpha = torch.softmax(logits, dim=-1)  # [T, n+1]
    return (alpha[..., None] * sources.float()).sum(1).to(p.dtype)


def closes_block(layer: int, block_size: int) -> bool:
    """Whether global ``layer`` appends the open block ``p`` to the bank before its attention."""
    return layer % block_size == 0
