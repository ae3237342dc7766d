"""Small shared pieces: RMSNorm, gated RMSNorm, GLU activations (SiLU, SiTU), RoPE, TP slices."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed
import torch.nn.functional as F
from torch import nn

AllReduce = Callable[[torch.Tensor], torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim, computed in fp32, x's dtype out."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim with a learned scale ``weight [dim]``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """KDA output norm: ``RMSNorm(x) * weight * sigmoid(gate)``, all in fp32, x's dtype out."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float() * torch.sigmoid(gate.float())).to(x.dtype)


def glu_activation(
    gate: torch.Tensor, up: torch.Tensor, kind: str, beta: float = 4.0, linear_beta: float = 25.0
) -> torch.Tensor:
    """GLU activation ``act(gate) * up``.

    ``silu``: ``silu(gate) * up``. ``situ`` (Kimi-K3): ``[beta * tanh(gate / beta) *
    sigmoid(gate)] * [linear_beta * tanh(up / linear_beta)]`` in fp32 -- the tanh soft-caps
    bound both branches, which is why K3 can train in low precision without outliers.
    """
    if kind == "silu":
        return F.silu(gate) * up
    if kind == "situ":
        g, u = gate.float(), up.float()
        act = beta * torch.tanh(g / beta) * torch.sigmoid(g)
        return (act * (linear_beta * torch.tanh(u / linear_beta))).to(gate.dtype)
    raise ValueError(f"hidden_act: expected 'silu' or 'situ', got {kind!r}")


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate the last dim of ``x [T, ..., d]`` by ``positions [T]`` (half-split pairs).

    Pairs are ``(x[i], x[i + d/2])`` (the GPT-NeoX layout). Only used when ``mla_use_nope`` is
    False; Kimi-K3 and Kimi-Linear never rotate.
    """
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, d/2]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
    cos, sin = angles.cos().view(shape), angles.sin().view(shape)
    x1, x2 = x.float()[..., : d // 2], x.float()[..., d // 2 :]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


def shard_range(total: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """The ``[start, end)`` of rank ``tp_rank``'s even, contiguous share of ``total``."""
    if total % tp_size:
        raise ValueError(f"tp_size: {total} is not divisible by tp_size={tp_size}")
    step = total // tp_size
    return tp_rank * step, (tp_rank + 1) * step


def as_all_reduce(
    group: AllReduce | torch.distributed.ProcessGroup | None,
) -> AllReduce | None:
    """A TP all-reduce callable from a callable, a ``torch.distributed`` group, or None."""
    if group is None or callable(group):
        return group

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        torch.distributed.all_reduce(x, group=group)
        return x

    return all_reduce


def identity_reduce(x: torch.Tensor) -> torch.Tensor:
    """The all-reduce of a single-rank group."""
    return x
