"""Small shared pieces: RMSNorm, gated RMSNorm, GLU activations (SiLU, SiTU), RoPE, TP slices,
the vocab-parallel embedding and LM head."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed
import torch.nn.functional as F
from torch import nn

AllReduce = Callable[[torch.Tensor], torch.Tensor]
# Concatenates each TP rank's ``[T, n]`` along the last dim, in rank order -> ``[T, tp * n]``.
AllGather = Callable[[torch.Tensor], torch.Tensor]


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


def as_all_gather(
    group: AllReduce | torch.distributed.ProcessGroup | None, tp_rank: int, tp_size: int
) -> AllGather | None:
    """A TP all-gather along the last dim from a ``torch.distributed`` group, or, given only an
    all-reduce callable, one built on it (each rank contributes its block of a zero tensor;
    adding zeros is exact, so the result equals a real gather)."""
    if group is None:
        return None
    if not callable(group):

        def gather(x: torch.Tensor) -> torch.Tensor:
            parts = [torch.empty_like(x) for _ in range(tp_size)]
            torch.distributed.all_gather(parts, x.contiguous(), group=group)
            return torch.cat(parts, dim=-1)

        return gather
    all_reduce = group

    def gather_by_sum(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-1]
        full = x.new_zeros(*x.shape[:-1], tp_size * n)
        full[..., tp_rank * n : (tp_rank + 1) * n] = x
        return all_reduce(full)

    return gather_by_sum


def vocab_shard(vocab_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """``(start, rows)``: rank ``tp_rank`` owns token ids ``[start, start + rows)``.

    Every rank holds ``ceil(vocab / tp)`` rows; rows past ``vocab_size`` (only on the last
    ranks, when the vocabulary does not divide) are padding that no token id reaches and whose
    logits are cut off after the gather.
    """
    rows = -(-vocab_size // tp_size)
    return tp_rank * rows, rows


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over TP ranks (``weight [ceil(V/tp), D]``).

    Each rank looks up the ids it owns, writes zeros for the others, and the TP all-reduce
    sums the one non-zero contribution per token.
    """

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        all_reduce: AllReduce | None = None,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.start, rows = vocab_shard(vocab_size, tp_rank, tp_size)
        self.weight = nn.Parameter(torch.zeros(rows, dim))
        self.all_reduce = all_reduce or identity_reduce

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [T]`` int64 -> ``[T, D]``."""
        local = ids - self.start
        owned = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(torch.where(owned, local, 0), self.weight)
        return self.all_reduce(out.masked_fill(~owned[:, None], 0))


class ParallelLMHead(nn.Module):
    """LM head with the vocabulary split over TP ranks (``weight [ceil(V/tp), D]``).

    Each rank computes its slice of the logits; the all-gather concatenates them and the pad
    columns past ``vocab_size`` are cut. ``logit_scale`` multiplies the result.
    """

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        all_gather: AllGather | None = None,
        logit_scale: float = 1.0,
    ) -> None:
        super().__init__()
        if tp_size > 1 and all_gather is None:
            raise ValueError("all_gather: a vocab-parallel LM head with tp_size > 1 needs it")
        self.vocab_size = vocab_size
        _, rows = vocab_shard(vocab_size, tp_rank, tp_size)
        self.weight = nn.Parameter(torch.zeros(rows, dim))
        self.all_gather = all_gather
        self.logit_scale = logit_scale

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """``h [T, D]`` -> logits ``[T, vocab_size]``."""
        logits = F.linear(h, self.weight)
        if self.all_gather is not None:
            logits = self.all_gather(logits)
        logits = logits[..., : self.vocab_size]
        return logits if self.logit_scale == 1.0 else logits * self.logit_scale
