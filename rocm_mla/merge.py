"""The exact LSE merge of partial attentions: the one place its formula is written.

Split-KV stage 2, ``rocm_mla.merge_states`` and the DCP combine all merge partial results
of disjoint key sets by their log-sum-exps. The Triton merge kernel
(``rocm_mla.kernels.merge_states``) does the same arithmetic step for step on a GPU.
"""

from __future__ import annotations

import math

import torch


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
    # A weighted partial whose out holds NaN is broken too: its row's lse says so as well.
    lse = torch.where(torch.isnan(out).any(dim=-1), math.nan, lse)
    return out.to(outs.dtype), lse
