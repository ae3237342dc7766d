"""Dense GLU MLP and the sigmoid-routed MoE (shared experts, grouped top-k, K3 latent experts).

Tensor parallelism: every expert's and MLP's intermediate dim is split across ranks (gate/up
rows, down columns), so each rank's output is a partial sum that ``all_reduce`` completes.
The router and the latent down/up projections are replicated. With
``routed_expert_quant="mxfp4"`` the routed experts' w1/w2/w3 are ``MXFP4Linear``: packed in
memory and dequantized per expert, only for the experts a batch routes to.
"""

from __future__ import annotations

import torch
from torch import nn

from rocm_mla.models.kimi_k3.config import KimiK3Config
from rocm_mla.models.kimi_k3.mxfp4 import MXFP4Linear
from rocm_mla.models.kimi_k3.ops import AllReduce, RMSNorm, glu_activation, identity_reduce

#: Largest batch of tokens the MoE runs in its dense (sync-free) schedule outside capture.
DENSE_MAX_TOKENS = 64


class GLUMLP(nn.Module):
    """``down(act(gate(x), up(x)))`` with this rank's ``intermediate / tp_size`` columns.

    Returns this rank's partial sum ``[T, out_dim]``; the caller reduces it.
    """

    def __init__(
        self,
        in_dim: int,
        intermediate: int,
        config: KimiK3Config,
        tp_size: int = 1,
        names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
        mxfp4: bool = False,
    ) -> None:
        super().__init__()
        local = intermediate // tp_size
        self._names = names

        def linear(i: int, o: int) -> nn.Module:
            return MXFP4Linear(i, o) if mxfp4 else nn.Linear(i, o, bias=False)

        setattr(self, names[0], linear(in_dim, local))
        setattr(self, names[1], linear(in_dim, local))
        setattr(self, names[2], linear(local, in_dim))
        self.act = config.hidden_act
        self.beta = config.activation_situ_beta
        self.linear_beta = config.activation_situ_linear_beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self._names)
        return down(glu_activation(gate(x), up(x), self.act, self.beta, self.linear_beta))


class DenseMLP(GLUMLP):
    """The dense MLP of the first ``first_k_dense_replace`` layers (checkpoint ``mlp.*``)."""

    def __init__(self, config: KimiK3Config, tp_size: int = 1, all_reduce: AllReduce | None = None):
        super().__init__(config.hidden_size, config.intermediate_size, config, tp_size)
        self.all_reduce = all_reduce or identity_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, D]`` -> ``[T, D]``."""
        return self.all_reduce(super().forward(x))


class Router(nn.Module):
    """Sigmoid router (checkpoint ``gate.weight [E, D]``, ``gate.e_score_correction_bias [E]``)."""

    def __init__(self, config: KimiK3Config) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(config.num_experts, dtype=torch.float32), requires_grad=False
        )
        self.top_k = config.num_experts_per_token
        self.grouped = config.use_grouped_topk and config.num_expert_group > 1
        self.num_groups = config.num_expert_group
        self.topk_group = config.topk_group
        self.renormalize = config.moe_renormalize
        self.scale = config.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Route ``x [T, D]`` -> ``(weights [T, k] fp32, expert ids [T, k] int64)``.

        The correction bias only decides which experts are chosen (aux-loss-free balancing);
        the weights are the unbiased sigmoid scores of the chosen experts.
        """
        scores = self.scores(x)
        ids = self.choose(scores)
        return self.weigh(scores, ids), ids

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """The sigmoid scores ``[T, E]`` of ``x [T, D]``, computed in fp32."""
        return torch.sigmoid(x.float() @ self.weight.float().t())

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """The ``top_k`` expert ids ``[T, k]`` of ``scores [T, E]`` plus the correction bias,
        within the best ``topk_group`` groups when grouped.

        A discrete choice: two experts whose scores lie a rounding apart trade places between
        precisions or devices, and the token's output jumps (make_tiny's random checkpoints
        have margins down to 1e-4). A comparison across precisions therefore holds the ids
        of its reference run and calls ``weigh`` (tests/test_mxfp4.py).
        """
        choice = scores + self.e_score_correction_bias.float()
        if self.grouped:
            t, e = choice.shape
            per_group = choice.view(t, self.num_groups, e // self.num_groups)
            # DeepSeek-V3 group score: the sum of each group's two best experts.
            group_score = per_group.topk(min(2, e // self.num_groups), dim=-1).values.sum(-1)
            keep = group_score.topk(self.topk_group, dim=-1).indices
            group_mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
            expert_mask = group_mask[:, :, None].expand_as(per_group).reshape(t, e)
            choice = choice.masked_fill(~expert_mask, float("-inf"))
        return choice.topk(self.top_k, dim=-1).indices

    def weigh(self, scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The weights ``[T, k]`` fp32 of experts ``ids [T, k]`` from ``scores [T, E]``:
        renormalized over the k when configured, times ``routed_scaling_factor``."""
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scale


class MoE(nn.Module):
    """Routed experts + shared experts (checkpoint ``block_sparse_moe.*``).

    Without latent MoE: ``out = sum_k w_k E_k(x) + shared(x)``. With K3's latent MoE
    (``routed_expert_hidden_size``): ``z = routed_expert_down_proj(x)``, experts run on ``z``,
    ``r = routed_expert_up_proj(RMSNorm(sum_k w_k E_k(z)))``, ``out = r + shared(x)``; the
    norm is nonlinear, so the routed partial sums are all-reduced before it.
    """

    def __init__(self, config: KimiK3Config, tp_size: int = 1, all_reduce: AllReduce | None = None):
        super().__init__()
        if tp_size > 1 and all_reduce is None and config.routed_expert_hidden_size is not None:
            raise ValueError(
                "all_reduce: latent MoE with tp_size > 1 needs the TP all-reduce (the latent "
                "RMSNorm runs on the full routed sum)"
            )
        self.all_reduce = all_reduce or identity_reduce
        self.latent = config.routed_expert_hidden_size
        d = config.hidden_size
        expert_dim = self.latent or d
        self.gate = Router(config)
        mxfp4 = config.routed_expert_quant == "mxfp4"
        self.experts = nn.ModuleList(
            GLUMLP(
                expert_dim, config.moe_intermediate_size, config, tp_size, ("w1", "w3", "w2"), mxfp4
            )
            for _ in range(config.num_experts)
        )
        self.shared_experts = (
            GLUMLP(d, config.moe_intermediate_size * config.num_shared_experts, config, tp_size)
            if config.num_shared_experts
            else None
        )
        if self.latent is not None:
            self.routed_expert_down_proj = nn.Linear(d, self.latent, bias=False)
            self.routed_expert_up_proj = nn.Linear(self.latent, d, bias=False)
            self.routed_expert_norm = (
                RMSNorm(self.latent, config.rms_norm_eps) if config.latent_moe_use_norm else None
            )

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial ``sum_k w_k E_{ids_k}(x)`` for ``x [T, d_e]`` -> ``[T, d_e]``.

        Two schedules, the same sum. Sparse: each routed expert on its own tokens; finding
        them reads the routing back to the host (a sync per expert on a GPU). Dense: every
        expert on every token, weighted by a ``[T, E]`` combine matrix that is 0 where it
        was not chosen; no sync, so a decode step can be captured in a CUDA/HIP graph. Dense
        is taken on a GPU for decode-sized batches (at most ``DENSE_MAX_TOKENS`` tokens)
        whose ``T * top_k`` reaches the expert count: they touch about every expert's weights
        anyway, and weight reads, not the ``E / top_k`` times larger math, bound the cost.
        A prefill, and anything on the CPU (no syncs to save, math-bound), stays sparse.
        Dense is always taken while a graph is being captured.
        """
        num_experts, tokens = len(self.experts), x.shape[0]
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        small = x.is_cuda and tokens <= DENSE_MAX_TOKENS and ids.numel() >= num_experts
        if capturing or small:
            return self._routed_dense(x, weights, ids)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            tok, slot = torch.nonzero(ids == e, as_tuple=True)
            y = self.experts[e](x[tok]) * weights[tok, slot, None].to(x.dtype)
            out.index_add_(0, tok, y)
        return out

    def _routed_dense(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        combine = torch.zeros(x.shape[0], len(self.experts), device=x.device)
        combine.scatter_add_(1, ids, weights.to(combine.dtype))  # [T, E]
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            w = combine[:, e, None]
            # Tokens that did not choose e take nothing from it, not even an overflow's NaN.
            out += torch.where(w != 0, expert(x) * w.to(x.dtype), 0.0)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, D]`` -> ``[T, D]`` (complete when ``all_reduce`` is the TP all-reduce)."""
        weights, ids = self.gate(x)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        if self.latent is None:
            out = self.routed(x, weights, ids)
            return self.all_reduce(out if shared is None else out + shared)
        r = self.all_reduce(self.routed(self.routed_expert_down_proj(x), weights, ids))
        if self.routed_expert_norm is not None:
            r = self.routed_expert_norm(r)
        r = self.routed_expert_up_proj(r)
        return r if shared is None else r + self.all_reduce(shared)
