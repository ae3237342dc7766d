"""The exact LSE merge of partial attentions: the one place its formula is written.

Split-KV stage 2, ``rocm_mla.merge_states`` and the DCP combine all merge partial results
of disjoint key sets by their log-sum-exps. The Triton merge kernel
(``rocm_mla.kernels.merge_states``) does the same arithmetic step for step on a GPU.
"""

from __future__ import annotations

import math

import torch

from rocm_mla.platform import same_device

#: What ``merge_states`` merges: float partials (an int ``outs`` would be truncated on the
#: way back), fp32 math inside.
MERGE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_merge_args(outs: object, lses: object) -> None:
    """Raise a ``ValueError`` naming the argument unless ``outs``/``lses`` can be merged.

    Host metadata only (no tensor is read), so it runs before every merge, on every path.
    """
    for name, value in (("outs", outs), ("lses", lses)):
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"merge_states: {name} must be a torch.Tensor (stack a list of partials with "
                f"torch.stack), got {type(value).__name__}"
            )
    for name, t in (("outs", outs), ("lses", lses)):
        if t.dtype not in MERGE_DTYPES:
            raise ValueError(
                f"merge_states: {name} must be float32, float16 or bfloat16, got {t.dtype}"
            )
    if outs.dim() < 2 or lses.shape != outs.shape[:-1]:
        raise ValueError(
            "merge_states: outs must be [N, ...rows, Dv] and lses [N, ...rows], got outs "
            f"{tuple(outs.shape)} and lses {tuple(lses.shape)}"
        )
    if outs.shape[-1] < 1:
        raise ValueError(
            f"merge_states: outs must have Dv >= 1 values per row, got {tuple(outs.shape)}"
        )
    if not same_device(outs.device, lses.device):
        raise ValueError(
            f"merge_states: outs and lses must share a device, got {outs.device} and {lses.device}"
        )


@torch.no_grad()
def lse_merge_weights(lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact LSE merge, as weights: the one place its formula is written.

    ``lses [N, ...rows]`` -> (``weights [N, ...rows]`` = ``exp(lse_n - logsumexp_m lse_m)``,
    merged ``lse [...rows]`` float32). A -inf lse is an empty partial: weight exactly 0. A
    NaN or +inf lse is a broken one: the row's weights and merged lse become NaN, so the
    fault reaches the output instead of vanishing. A row with no partial at all that saw a
    key gets all weights 0 and lse -inf; so does every row when N = 0 (no partial at all).
    """
    lse = lses.to(torch.float32)
    broken = (torch.isnan(lse) | (lse == math.inf)).any(dim=0)
    lse = torch.where(broken[None], -math.inf, lse)
    # amax has no identity for an empty dim; -inf is the max of no partials.
    top = lse.amax(dim=0) if lse.shape[0] else lse.new_full(lse.shape[1:], -math.inf)
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
    check_merge_args(outs, lses)
    weights, lse = lse_merge_weights(lses)
    # Empty partials (weight exactly 0) are never read: their outputs may be NaN. A NaN
    # weight (a broken partial in the row) is kept so that the row comes out NaN.
    contrib = torch.where(weights[..., None] != 0, outs.to(torch.float32), 0.0)
    out = (contrib * weights[..., None]).sum(dim=0)
    # A weighted partial whose out holds NaN is broken too: the whole row (every column, and
    # its lse) says so, as the Triton kernel's does.
    broken = torch.isnan(out).any(dim=-1)
    out = out.masked_fill(broken[..., None], math.nan)
    lse = torch.where(broken, math.nan, lse)
    return out.to(outs.dtype), lse
