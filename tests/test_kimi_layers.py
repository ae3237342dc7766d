"""Per-layer math of the Kimi-K3 / Kimi-Linear model against the reference-note equations."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from rocm_mla.models.kimi_k3 import mla as mla_module
from rocm_mla.models.kimi_k3.attn_res import attn_res_mix
from rocm_mla.models.kimi_k3.config import KimiK3Config
from rocm_mla.models.kimi_k3.kda import KimiDeltaAttention, kda_chunked, kda_recurrent
from rocm_mla.models.kimi_k3.metadata import ForwardMetadata
from rocm_mla.models.kimi_k3.mla import MultiHeadLatentAttention
from rocm_mla.models.kimi_k3.moe import MoE, Router
from rocm_mla.models.kimi_k3.ops import glu_activation, rms_norm


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _randomize(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            r = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype)
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen).mul(2.0))
            elif name.endswith("dt_bias") or "norm" in name:
                p.copy_(0.5 * r + (0 if name.endswith("dt_bias") else 1))
            else:
                p.copy_(r * p.shape[-1] ** -0.5)


# ---------------------------------------------------------------------------- AttnRes
def test_attn_res_matches_direct_softmax_formula():
    gen = torch.Generator().manual_seed(0)
    t, n, d, eps = 5, 3, 16, 1e-5
    bank, p = torch.randn(t, n, d, generator=gen), torch.randn(t, d, generator=gen)
    norm_w, query = 1 + 0.1 * torch.randn(d, generator=gen), torch.randn(1, d, generator=gen)
    out = attn_res_mix(bank, p, norm_w, query, eps)
    for row in range(t):
        sources = [bank[row, i].double() for i in range(n)] + [p[row].double()]
        logits = []
        for s in sources:
            normed = s / torch.sqrt((s * s).mean() + eps) * norm_w.double()
            logits.append(float(query[0].double() @ normed))
        m = max(logits)
        weights = [torch.exp(torch.tensor(x - m)) for x in logits]
        total = sum(weights)
        expect = sum(w / total * s for w, s in zip(weights, sources, strict=True))
        torch.testing.assert_close(out[row].double(), expect, atol=1e-5, rtol=1e-5)


def test_attn_res_with_empty_bank_is_identity():
    p = torch.randn(4, 8)
    torch.testing.assert_close(
        attn_res_mix(p.new_zeros(4, 0, 8), p, torch.ones(8), torch.randn(8), 1e-5), p
    )


# ---------------------------------------------------------------------------- KDA
def _kda_inputs(b=2, t=11, h=3, dk=4, dv=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(b, t, h, dk, generator=gen), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(b, t, h, dk, generator=gen), dim=-1)
    v = torch.randn(b, t, h, dv, generator=gen)
    g = -torch.rand(b, t, h, dk, generator=gen) * 2
    beta = torch.rand(b, t, h, generator=gen)
    s0 = torch.randn(b, h, dk, dv, generator=gen)
    return q, k, v, g, beta, s0


def test_kda_recurrence_matches_the_delta_rule_equations():
    q, k, v, g, beta, s0 = _kda_inputs(b=1, t=4, h=2)
    out, state = kda_recurrent(q, k, v, g, beta, s0)
    for h in range(2):
        s = s0[0, h].double()
        for t in range(4):
            s = torch.diag(g[0, t, h].double().exp()) @ s
            kt, vt = k[0, t, h].double(), v[0, t, h].double()
            s = s + torch.outer(kt, beta[0, t, h].double() * (vt - s.T @ kt))
            torch.testing.assert_close(out[0, t, h].double(), s.T @ q[0, t, h].double())
        torch.testing.assert_close(state[0, h].double(), s)


@pytest.mark.parametrize(("chunk", "group"), [(1, 64), (1, 3), (4, 1), (4, 2), (32, 64)])
def test_kda_chunked_equals_recurrence_with_carried_state(chunk, group):
    q, k, v, g, beta, s0 = _kda_inputs()
    ref, ref_state = kda_recurrent(q, k, v, g, beta, s0)
    out, state = kda_chunked(q, k, v, g, beta, s0, chunk_size=chunk, chunks_per_group=group)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, ref_state, atol=1e-5, rtol=1e-5)
    # Two calls carrying the state equal one call.
    a, sa = kda_chunked(q[:, :5], k[:, :5], v[:, :5], g[:, :5], beta[:, :5], s0, chunk_size=chunk)
    b, sb = kda_chunked(q[:, 5:], k[:, 5:], v[:, 5:], g[:, 5:], beta[:, 5:], sa, chunk_size=chunk)
    torch.testing.assert_close(torch.cat([a, b], 1), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sb, ref_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["kimi_k3", "kimi_linear"])
def test_kda_layer_prefill_equals_split_calls_and_single_steps(arch):
    cfg = KimiK3Config.tiny(arch)
    layer = KimiDeltaAttention(cfg)
    _randomize(layer, 1)
    x = torch.randn(2, 9, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    conv_shape, rec_shape = layer.state_shapes()
    zc, zr = torch.zeros(2, *conv_shape), torch.zeros(2, *rec_shape)
    full, conv, rec = layer(x, zc, zr)
    first, c, r = layer(x[:, :4], zc, zr)  # chunked prefill of 4, then 5 one-token steps
    outs = [first]
    for t in range(4, 9):
        o, c, r = layer(x[:, t : t + 1], c, r)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(c, conv)
    torch.testing.assert_close(r, rec, atol=1e-5, rtol=1e-5)


def test_kda_decay_forms():
    k3, linear = KimiK3Config.tiny("kimi_k3"), KimiK3Config.tiny("kimi_linear")
    x = torch.randn(1, 3, k3.hidden_size, generator=torch.Generator().manual_seed(3))
    for cfg in (k3, linear):
        layer = KimiDeltaAttention(cfg)
        _randomize(layer, 3)
        g = layer.decay(x)
        u = (layer.f_b_proj(layer.f_a_proj(x)) + layer.dt_bias).view_as(g)
        a = layer.A_log.exp()[:, None]
        if cfg.kda_gate_lower_bound is not None:  # K3: bounded in [lower_bound, 0]
            torch.testing.assert_close(g, -5.0 * torch.sigmoid(a * u))
            assert (g >= -5.0).all() and (g <= 0).all()
        else:
            torch.testing.assert_close(g, -a * torch.log1p(torch.exp(u)))


def test_kda_full_rank_gate_equals_composed_low_rank_gate():
    k3 = KimiK3Config.tiny("kimi_k3")
    low = dataclasses.replace(k3, kda_full_rank_gate=False)
    full_layer, low_layer = KimiDeltaAttention(k3), KimiDeltaAttention(low)
    _randomize(low_layer, 4)
    state = {k: v for k, v in low_layer.state_dict().items() if not k.startswith("g_")}
    full_layer.load_state_dict(state, strict=False)
    with torch.no_grad():
        full_layer.g_proj.weight.copy_(low_layer.g_b_proj.weight @ low_layer.g_a_proj.weight)
    x = torch.randn(1, 6, k3.hidden_size)
    zc, zr = (torch.zeros(1, *s) for s in full_layer.state_shapes())
    torch.testing.assert_close(
        full_layer(x, zc, zr)[0], low_layer(x, zc, zr)[0], atol=1e-5, rtol=1e-5
    )
    # The gate acts: a different g_proj changes the output.
    with torch.no_grad():
        full_layer.g_proj.weight.mul_(-1)
    assert not torch.allclose(full_layer(x, zc, zr)[0], low_layer(x, zc, zr)[0], atol=1e-3)


# ---------------------------------------------------------------------------- MLA
def _mla_outputs(cfg, seed, lens=(7, 5), split=(4, 3)):
    """MHA (fresh prefill) vs absorbed paged decode/chunked prefill for the same tokens."""
    layer = MultiHeadLatentAttention(cfg)
    _randomize(layer, seed)
    layer.absorb_weights()
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(sum(lens), cfg.hidden_size, generator=gen)
    block, blocks = 4, 3
    cache = torch.full((len(lens) * blocks, block, cfg.kv_cache_dim), float("nan"))
    ref = layer(x, ForwardMetadata.contiguous([0, 0], list(lens), block, blocks), cache.clone())
    # Prefix through MHA, then the rest through the absorbed form (chunked, unequal lengths).
    starts = [0, lens[0]]
    first = torch.cat([x[s : s + n] for s, n in zip(starts, split, strict=True)])
    rest = torch.cat([x[s + n : s + m] for s, n, m in zip(starts, split, lens, strict=True)])
    layer(first, ForwardMetadata.contiguous([0, 0], list(split), block, blocks), cache)
    rest_lens = [m - n for m, n in zip(lens, split, strict=True)]
    out = layer(rest, ForwardMetadata.contiguous(list(split), rest_lens, block, blocks), cache)
    expect = torch.cat([ref[s + n : s + m] for s, n, m in zip(starts, split, lens, strict=True)])
    return out, expect, layer, x


@pytest.mark.parametrize("arch", ["kimi_k3", "kimi_linear"])
def test_mla_absorbed_decode_equals_mha_form(arch):
    out, expect, _, _ = _mla_outputs(KimiK3Config.tiny(arch), seed=5)
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)


def test_mla_rope_absorbed_equals_mha_and_rotation_matters():
    cfg = dataclasses.replace(KimiK3Config.tiny("kimi_k3"), mla_use_nope=False)
    out, expect, _, _ = _mla_outputs(cfg, seed=6)
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)
    nope_out, _, _, _ = _mla_outputs(KimiK3Config.tiny("kimi_k3"), seed=6)
    assert not torch.allclose(out, nope_out, atol=1e-3)


def test_mla_one_token_decode_batch_equals_mha():
    out, expect, _, _ = _mla_outputs(
        KimiK3Config.tiny("kimi_k3"), seed=7, lens=(6, 6), split=(5, 5)
    )
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)


def test_mla_output_gate_and_q_lora():
    cfg = KimiK3Config.tiny("kimi_k3")
    layer = MultiHeadLatentAttention(cfg)
    _randomize(layer, 8)
    x = torch.randn(5, cfg.hidden_size)
    meta = ForwardMetadata.contiguous([0], [5], 8, 1)
    cache = torch.zeros(1, 8, cfg.kv_cache_dim)
    q, _, _ = layer.project(x, meta.positions)
    # K3 reads the checkpoint's rms_norm_eps for the latent norms.
    eps = cfg.rms_norm_eps
    q_ref = layer.q_b_proj(rms_norm(layer.q_a_proj(x), layer.q_a_layernorm.weight, eps))
    torch.testing.assert_close(q.flatten(1), q_ref)
    ungated = dataclasses.replace(cfg, mla_use_output_gate=False)
    plain = MultiHeadLatentAttention(ungated)
    plain.load_state_dict({k: v for k, v in layer.state_dict().items() if "g_proj" not in k})
    with torch.no_grad():
        layer.g_proj.weight.zero_()  # sigmoid(0) = 1/2 on every channel
    torch.testing.assert_close(layer(x, meta, cache.clone()), 0.5 * plain(x, meta, cache.clone()))


def test_mla_decode_without_absorbed_weights_raises():
    cfg = KimiK3Config.tiny("kimi_k3")
    layer = MultiHeadLatentAttention(cfg)
    meta = ForwardMetadata.contiguous([3], [1], 4, 1)
    with pytest.raises(RuntimeError, match="absorb_weights"):
        layer(torch.randn(1, cfg.hidden_size), meta, torch.zeros(1, 4, cfg.kv_cache_dim))


# ---------------------------------------------------------------------------- MoE
def test_router_bias_changes_selection_only():
    cfg = dataclasses.replace(KimiK3Config.tiny("kimi_k3"), routed_scaling_factor=2.5)
    router = Router(cfg)
    _randomize(router, 9)
    x = torch.randn(6, cfg.hidden_size)
    with torch.no_grad():
        router.e_score_correction_bias.zero_()
        w0, ids0 = router(x)
        router.e_score_correction_bias[5] = 10.0  # forces expert 5 into every top-k
        w1, ids1 = router(x)
    assert (ids1 == 5).any(-1).all()
    scores = torch.sigmoid(x @ router.weight.t())
    for w, ids in ((w0, ids0), (w1, ids1)):
        chosen = scores.gather(1, ids)
        torch.testing.assert_close(w, 2.5 * chosen / chosen.sum(-1, keepdim=True))
    torch.testing.assert_close(ids0, scores.topk(cfg.num_experts_per_token).indices)


def test_grouped_topk_keeps_best_groups():
    cfg = dataclasses.replace(
        KimiK3Config.tiny("kimi_linear"), num_expert_group=4, topk_group=1, num_experts_per_token=2
    )
    router = Router(cfg)
    with torch.no_grad():
        router.weight.zero_()
        router.e_score_correction_bias.copy_(torch.tensor([0, 0, 0.1, 0.1, 0.2, 0, 0.15, 0.15]))
    _, ids = router(torch.randn(3, cfg.hidden_size))
    # group scores (top-2 sums): 0, .2, .2, .3 -> only group 3 (experts 6, 7) is eligible,
    # although expert 4 alone has the best score.
    assert sorted(ids[0].tolist()) == [6, 7]


def test_situ_and_silu_formulas():
    gate = torch.tensor([-30.0, -1.0, 0.0, 0.5, 3.0, 50.0], dtype=torch.float64)
    up = torch.tensor([-100.0, 2.0, 1.0, -0.5, 30.0, 1000.0], dtype=torch.float64)
    got = glu_activation(gate, up, "situ", beta=4.0, linear_beta=25.0)
    expect = 4 * torch.tanh(gate / 4) / (1 + torch.exp(-gate)) * (25 * torch.tanh(up / 25))
    torch.testing.assert_close(got, expect)
    assert got.abs().max() <= 4 * 25  # both branches are soft-capped
    torch.testing.assert_close(glu_activation(gate, up, "silu"), gate / (1 + torch.exp(-gate)) * up)
    with pytest.raises(ValueError, match="hidden_act"):
        glu_activation(gate, up, "gelu")


def test_latent_moe_matches_manual_formula():
    cfg = KimiK3Config.tiny("kimi_k3")
    moe = MoE(cfg)
    _randomize(moe, 10)
    x = torch.randn(4, cfg.hidden_size)
    weights, ids = moe.gate(x)
    z = x @ moe.routed_expert_down_proj.weight.t()
    r = torch.zeros_like(z)
    for t in range(4):
        for w, e in zip(weights[t], ids[t].tolist(), strict=True):
            ex = moe.experts[e]
            h = glu_activation(z[t] @ ex.w1.weight.t(), z[t] @ ex.w3.weight.t(), "situ")
            r[t] += w * (h @ ex.w2.weight.t())
    r = rms_norm(r, moe.routed_expert_norm.weight, cfg.rms_norm_eps)
    sh = moe.shared_experts
    shared = glu_activation(x @ sh.gate_proj.weight.t(), x @ sh.up_proj.weight.t(), "situ")
    expect = r @ moe.routed_expert_up_proj.weight.t() + shared @ sh.down_proj.weight.t()
    torch.testing.assert_close(moe(x), expect, atol=1e-5, rtol=1e-5)


def test_mla_long_prefill_in_query_chunks_equals_one_call(monkeypatch):
    """Prompts longer than PREFILL_QUERY_CHUNK attend in query chunks with the same result."""
    cfg = KimiK3Config.tiny("kimi_linear")
    layer = MultiHeadLatentAttention(cfg)
    gen = torch.Generator().manual_seed(7)
    n = 300
    q = torch.randn(n, layer.num_heads, layer.nope + layer.rope, generator=gen)
    latent = torch.randn(n, cfg.kv_lora_rank, generator=gen)
    k_pe = torch.randn(n, layer.rope, generator=gen)
    with torch.no_grad():
        whole = layer.attend_fresh(q, latent, k_pe)
        monkeypatch.setattr(mla_module, "PREFILL_QUERY_CHUNK", 64)
        chunked = layer.attend_fresh(q, latent, k_pe)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)
