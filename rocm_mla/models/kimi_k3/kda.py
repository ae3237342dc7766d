"""Kimi Delta Attention (KDA): short conv + gated delta rule with per-channel decay.

Per head, per token (fp32): ``S <- diag(exp(g_t)) S``; ``S <- S + k_t (beta_t (v_t - S^T k_t))^T``;
``o_t = S^T q_t``, with ``S [dk, dv]``, q/k L2-normalized (q also scaled by ``dk ** -0.5``).
Prefill uses an exact chunked form of the same recurrence (``kda_chunked``); decode steps the
recurrence (``kda_recurrent``). Tensor parallelism shards heads; ``o_proj`` is row-parallel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rocm_mla.models.kimi_k3.config import KimiK3Config
from rocm_mla.models.kimi_k3.ops import AllReduce, gated_rms_norm, identity_reduce


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over time with carried state, fp32.

    Args:
        x: ``[B, T, C]`` new pre-conv inputs.
        weight: ``[C, K]`` per-channel taps (the last tap multiplies the current token).
        state: ``[B, C, K - 1]`` the previous ``K - 1`` pre-conv inputs (zeros for a new
            sequence).

    Returns:
        ``(y [B, T, C] fp32, new_state [B, C, K - 1])`` (state in state's dtype).
    """
    k = weight.shape[-1]
    full = torch.cat([state.float(), x.float().transpose(1, 2)], dim=-1)  # [B, C, K-1+T]
    y = F.conv1d(full, weight.float()[:, None, :], groups=weight.shape[0])  # [B, C, T]
    return y.transpose(1, 2), full[:, :, full.shape[-1] - (k - 1) :].to(state.dtype)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last dim (the FLA kernel's eps placement)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The token-by-token delta rule (fp32).

    Args:
        q, k: ``[B, T, H, dk]`` normalized (q already scaled); v: ``[B, T, H, dv]``;
        g: ``[B, T, H, dk]`` log decay (<= 0); beta: ``[B, T, H]``; state: ``[B, H, dk, dv]``.

    Returns:
        ``(o [B, T, H, dv] fp32, state [B, H, dk, dv] fp32)``.
    """
    s = state.float()
    outs = []
    for t in range(q.shape[1]):
        s = s * g[:, t].exp()[..., None]
        pred = torch.einsum("bhk,bhkv->bhv", k[:, t], s)
        u = beta[:, t, :, None] * (v[:, t] - pred)
        s = s + k[:, t, :, :, None] * u[:, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], s))
    return torch.stack(outs, dim=1), s


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 16,
    chunks_per_group: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence as ``kda_recurrent``, solved a chunk at a time (same args/returns).

    Within a chunk with cumulative log decay ``G_t`` and start state ``S0``, the delta-rule
    corrections ``u_t = beta_t (v_t - S_{t-1}^T k_t)`` satisfy the unit lower-triangular system
    ``(I + A) u = beta (v - (k e^G)^T S0)`` with ``A_ts = beta_t (k_t . k_s e^{G_t - G_s})``
    for ``s < t``; then ``o_t = (q_t e^{G_t})^T S0 + sum_{s<=t} (q_t . k_s e^{G_t - G_s}) u_s``
    and ``S_C = e^{G_C} S0 + sum_s (k_s e^{G_C - G_s}) u_s^T``. Decays are differenced before
    ``exp`` so nothing overflows.

    The corrections are linear in ``S0``: ``u = U0 - W S0`` with ``U0``, ``W`` from one
    triangular solve that does not involve the state. Those solves and the decayed products
    are computed for ``chunks_per_group`` chunks in one batch; only the rank-C products that
    carry the state run in sequence. A long prefill then costs a handful of launches per
    chunk, not a few dozen. ``chunks_per_group`` None: 16 on a GPU (launches bound a long
    prefill there) and 1 on the CPU (per-chunk tiles stay in cache; batching them was
    slower at batch 8 x 1K, the same at 1 x 4K).
    """
    b, t_len, h, dk = k.shape
    dv = v.shape[-1]
    pad = (-t_len) % chunk_size
    # Padding tokens have k = v = beta = 0 and no decay: they leave the state unchanged.
    q, k, v, g, beta = (
        F.pad(x.float(), (0, 0) * (x.dim() - 2) + (0, pad)) for x in (q, k, v, g, beta)
    )
    n = (t_len + pad) // chunk_size

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, ...] -> [n, B, H, C, ...]
        x = x.view(b, n, chunk_size, h, *x.shape[3:])
        return x.movedim(3, 2).movedim(1, 0)

    qc, kc, vc, gc, bc = (chunks(x) for x in (q, k, v, g, beta))
    idx = torch.arange(chunk_size, device=q.device)
    lower_incl = idx[:, None] >= idx[None, :]
    strict = idx[:, None] > idx[None, :]
    eye = torch.eye(chunk_size, device=q.device)
    if chunks_per_group is None:
        chunks_per_group = 16 if q.is_cuda else 1
    s = state.float()
    outs = []
    for g0 in range(0, n, chunks_per_group):
        sl = slice(g0, min(n, g0 + chunks_per_group))
        qi, ki, vi, bi = qc[sl], kc[sl], vc[sl], bc[sl, ..., None]  # [m, B, H, C, .]
        cum = gc[sl].cumsum(dim=3)  # [m, B, H, C, dk]
        diff = cum[..., :, None, :] - cum[..., None, :, :]  # [m, B, H, C(t), C(s), dk]
        decay = diff.masked_fill(~lower_incl[:, :, None], float("-inf")).exp()
        kk = torch.einsum("mbhtc,mbhsc,mbhtsc->mbhts", ki, ki, decay).masked_fill(~strict, 0.0)
        rhs = torch.cat([bi * vi, bi * (ki * cum.exp())], dim=-1)
        u0, w = torch.linalg.solve_triangular(
            bi * kk + eye, rhs, upper=False, unitriangular=True
        ).split([dv, dk], dim=-1)  # u = u0 - w S0
        qk = torch.einsum("mbhtc,mbhsc,mbhtsc->mbhts", qi, ki, decay)
        last = cum[..., -1:, :]  # [m, B, H, 1, dk]
        qe = qi * cum.exp()
        kd = (ki * (last - cum).exp()).transpose(-1, -2)  # [m, B, H, dk, C]
        keep = last.transpose(-1, -2).exp()  # [m, B, H, dk, 1]
        # The state enters only through rank-C products (C x dk by dk x dv): the same work
        # per chunk as solving each chunk on its own, in a handful of launches.
        for j in range(qi.shape[0]):
            u = u0[j] - w[j] @ s
            outs.append(qe[j] @ s + qk[j] @ u)
            s = keep[j] * s + kd[j] @ u
    o = torch.stack(outs, dim=0).movedim(0, 1).movedim(2, 3).reshape(b, n * chunk_size, h, -1)
    return o[:, :t_len], s


class KimiDeltaAttention(nn.Module):
    """One KDA layer on this TP rank's ``H / tp_size`` heads (checkpoint ``self_attn.*``)."""

    def __init__(self, config: KimiK3Config, tp_size: int = 1, all_reduce: AllReduce | None = None):
        super().__init__()
        d = config.hidden_size
        self.num_heads = config.kda_num_heads // tp_size
        self.head_dim = dk = config.kda_head_dim
        p = self.num_heads * dk
        self.conv_size = config.kda_conv_size
        self.q_proj = nn.Linear(d, p, bias=False)
        self.k_proj = nn.Linear(d, p, bias=False)
        self.v_proj = nn.Linear(d, p, bias=False)
        self.q_conv1d = nn.Conv1d(p, p, self.conv_size, groups=p, bias=False)
        self.k_conv1d = nn.Conv1d(p, p, self.conv_size, groups=p, bias=False)
        self.v_conv1d = nn.Conv1d(p, p, self.conv_size, groups=p, bias=False)
        self.f_a_proj = nn.Linear(d, dk, bias=False)
        self.f_b_proj = nn.Linear(dk, p, bias=False)
        self.b_proj = nn.Linear(d, self.num_heads, bias=False)
        self.full_rank_gate = config.kda_full_rank_gate
        if self.full_rank_gate:
            self.g_proj = nn.Linear(d, p, bias=False)
        else:
            self.g_a_proj = nn.Linear(d, dk, bias=False)
            self.g_b_proj = nn.Linear(dk, p, bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(p, dtype=torch.float32))
        # Checkpoint key ``o_norm.weight``: the scale of the gated RMSNorm (``gated_rms_norm``).
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(dk))
        self.o_proj = nn.Linear(p, d, bias=False)
        self.gate_lower_bound = config.kda_gate_lower_bound
        self.eps = config.rms_norm_eps
        self.all_reduce = all_reduce or identity_reduce

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-sequence ``(conv [3P, K-1], recurrent [H, dk, dv])`` shapes on this rank."""
        p = self.num_heads * self.head_dim
        return (3 * p, self.conv_size - 1), (self.num_heads, self.head_dim, self.head_dim)

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        """Per-channel log decay ``g [B, T, H, dk]`` (fp32, <= 0) from ``x [B, T, D]``.

        K3: ``lower_bound * sigmoid(exp(A_log) * u)``; Kimi-Linear: ``-exp(A_log) *
        softplus(u)``; ``u = f_b(f_a(x)) + dt_bias``.
        """
        u = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()
        u = u.view(*x.shape[:2], self.num_heads, self.head_dim)
        a = self.A_log.float().exp()[:, None]
        if self.gate_lower_bound is not None:
            return self.gate_lower_bound * torch.sigmoid(a * u)
        return -a * F.softplus(u)

    def forward(
        self, x: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run ``T`` new tokens of ``B`` sequences.

        Args:
            x: ``[B, T, D]`` normalized layer input.
            conv_state: ``[B, 3P, K-1]`` previous pre-conv q|k|v inputs (zeros when new).
            recurrent_state: ``[B, H, dk, dv]`` (zeros when new).

        Returns:
            ``(out [B, T, D], conv_state, recurrent_state)`` (the states after the T tokens).
        """
        b, t, _ = x.shape
        h, dk = self.num_heads, self.head_dim
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        weight = torch.cat(
            [
                c.weight.reshape(-1, self.conv_size)
                for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)
            ]
        )
        mixed, conv_state = causal_conv(mixed, weight, conv_state)
        q, k, v = F.silu(mixed).view(b, t, 3, h, dk).unbind(2)
        q = l2_normalize(q) * dk**-0.5
        k = l2_normalize(k)
        g = self.decay(x)
        beta = torch.sigmoid(self.b_proj(x).float())
        core = kda_recurrent if t == 1 else kda_chunked
        o, s = core(q, k, v, g, beta, recurrent_state)
        gate = self.g_proj(x) if self.full_rank_gate else self.g_b_proj(self.g_a_proj(x))
        o = gated_rms_norm(o, gate.view(b, t, h, dk), self.o_norm.weight, self.eps).to(x.dtype)
        out = self.o_proj(o.reshape(b, t, h * dk))
        return self.all_reduce(out), conv_state, s.to(recurrent_state.dtype)
