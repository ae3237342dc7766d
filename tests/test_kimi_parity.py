"""Parity with transformers' KimiLinearForCausalLM on tiny random Kimi-Linear checkpoints.

Each checkpoint is written by transformers' own ``save_pretrained`` and read by our loader;
prefill logits must match within 1e-4 of the logit scale and greedy continuations (our paged
decode vs ``generate``) must be identical.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from rocm_mla.models.kimi_k3.loader import load_model  # noqa: E402
from tests.model_helpers import greedy_generate  # noqa: E402

BASE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_attention_heads=2,
    num_key_value_heads=2,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=None,
)

CONFIGS = {
    # Kimi-Linear layout: q_proj, 3:1 KDA:MLA, one shared expert.
    "plain": dict(
        num_hidden_layers=4,
        num_local_experts=4,
        num_experts_per_tok=2,
        linear_attn_config={"head_dim": 8, "num_heads": 2, "short_conv_kernel_size": 4,
                            "full_attn_layers": [2, 4], "kda_layers": [1, 3]},
    ),
    # q LoRA, grouped top-k (4 groups, 2 kept), 2 dense layers, other scaling.
    "lora_grouped": dict(
        num_hidden_layers=4,
        q_lora_rank=12,
        num_local_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.7,
        first_k_dense_replace=2,
        linear_attn_config={"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4,
                            "full_attn_layers": [3], "kda_layers": [1, 2, 4]},
    ),
    # Odd head dims, 4 MLA heads, more shared experts, no renormalization.
    "wide_heads": dict(
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        qk_nope_head_dim=12,
        qk_rope_head_dim=4,
        v_head_dim=8,
        n_shared_experts=2,
        norm_topk_prob=False,
        num_local_experts=6,
        num_experts_per_tok=2,
        linear_attn_config={"head_dim": 8, "num_heads": 4, "short_conv_kernel_size": 4,
                            "full_attn_layers": [1, 3], "kda_layers": [2]},
    ),
}  # fmt: skip


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Unit-scale random weights (transformers' 0.02 init makes near-constant logits)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                continue  # keep the FLA-style decay init
            randn = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * randn)
            elif "e_score_correction_bias" in name:
                p.copy_(0.05 * randn)
            elif "embed_tokens" in name:
                p.copy_(randn)
            else:
                p.copy_(randn * p.shape[-1] ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    cfg = transformers.KimiLinearConfig(**{**BASE, **CONFIGS[request.param]})
    torch.manual_seed(0)
    hf = transformers.KimiLinearForCausalLM(cfg).eval()
    _randomize(hf, seed=len(request.param))
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, load_model(path)


def test_prefill_logits_and_greedy_match_transformers(pair):
    hf, ours = pair
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(2, BASE["vocab_size"], (32,), generator=gen)
    with torch.no_grad():
        ref_logits = hf(prompt[None]).logits[0]
        ref_new = hf.generate(
            prompt[None],
            attention_mask=torch.ones(1, 32, dtype=torch.long),
            max_new_tokens=16,
            do_sample=False,
        )[0, 32:].tolist()
    new, logits = greedy_generate(ours, [prompt.tolist()], max_new_tokens=16)
    scale = ref_logits.abs().max()
    err = (logits - ref_logits).abs().max() / scale
    assert err < 1e-4, f"prefill logits differ by {err:.2e} of the logit scale"
    assert new[0] == ref_new
