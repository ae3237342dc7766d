"""Kimi-K3 as released: latent-norm eps per arch, absent-key defaults, 2-D short-conv weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file

from rocm_mla.models.kimi_k3.config import KimiK3Config
from rocm_mla.models.kimi_k3.loader import load_model, make_tiny
from rocm_mla.models.kimi_k3.mla import MultiHeadLatentAttention
from tests.model_helpers import contiguous_metadata


def _rms64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return w.double() * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _small_latent_layer(cfg: KimiK3Config) -> MultiHeadLatentAttention:
    """An MLA layer whose latents have mean(c^2) ~ 1e-4, where eps 1e-5 vs 1e-6 matters."""
    gen = torch.Generator().manual_seed(11)
    layer = MultiHeadLatentAttention(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        layer.q_a_proj.weight.mul_(1e-2)
        layer.kv_a_proj_with_mqa.weight.mul_(1e-2)
    return layer


def test_k3_latent_norms_use_the_checkpoint_rms_norm_eps():
    cfg = KimiK3Config.tiny("kimi_k3")
    assert cfg.mla_latent_norm_eps == cfg.rms_norm_eps == 1e-5
    layer = _small_latent_layer(cfg)
    x = torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(12))
    q, latent, _ = layer.project(x, torch.arange(6))
    c = x.double() @ layer.kv_a_proj_with_mqa.weight.double().t()
    c = c[:, : cfg.kv_lora_rank]
    assert 3e-5 < c.pow(2).mean() < 3e-4  # the small-latent regime of the report
    w = layer.kv_a_layernorm.weight
    latent_ref = _rms64(c, w, 1e-5)
    cq = x.double() @ layer.q_a_proj.weight.double().t()
    q_ref = _rms64(cq, layer.q_a_layernorm.weight, 1e-5) @ layer.q_b_proj.weight.double().t()
    scale = latent_ref.abs().max()
    assert (latent.double() - latent_ref).abs().max() < 1e-5 * scale
    assert (q.flatten(1).double() - q_ref).abs().max() < 1e-5 * q_ref.abs().max()
    # The old reading (1e-6) is far off here: the test can tell the two apart.
    assert (_rms64(c, w, 1e-6) - latent_ref).abs().max() > 1e-2 * scale


def test_kimi_linear_keeps_transformers_latent_eps_and_override_wins():
    kl = KimiK3Config.tiny("kimi_linear")
    assert kl.rms_norm_eps == 1e-5 and kl.mla_latent_norm_eps == 1e-6
    pinned = dataclasses.replace(KimiK3Config.tiny("kimi_k3"), latent_norm_eps=3e-6)
    assert pinned.mla_latent_norm_eps == 3e-6
    raw = {"model_type": "kimi_k3", "text_config": {**pinned.to_dict(), "rms_norm_eps": 2e-5}}
    assert KimiK3Config.from_dict(raw).mla_latent_norm_eps == 2e-5


def _minimal_text(**over):
    text = {
        "num_attention_heads": 4, "num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 256,
        "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "num_experts": 8, "num_experts_per_token": 2, "moe_intermediate_size": 32,
        "intermediate_size": 128,
    }  # fmt: skip
    text.update(over)
    return text


def test_absent_keys_take_the_released_reading_for_k3():
    cfg = KimiK3Config.from_dict({"model_type": "kimi_k3", "text_config": _minimal_text()})
    assert cfg.rms_norm_eps == 1e-6 and cfg.mla_latent_norm_eps == 1e-6
    assert cfg.num_shared_experts == 0
    assert cfg.mlp_layer_types == ["sparse"] * 4  # first_k_dense_replace 0
    assert cfg.mla_use_nope is False
    assert cfg.layer_types == ["full_attention"] * 4  # no linear_attn_config: no KDA
    assert cfg.routed_scaling_factor == 1.0 and cfg.logit_scale == 1.0
    assert cfg.tie_word_embeddings is False and cfg.routed_expert_quant is None
    freq2 = KimiK3Config.from_dict(
        {"model_type": "kimi_k3", "text_config": _minimal_text(moe_layer_freq=2)}
    )
    assert freq2.mlp_layer_types == ["sparse", "dense", "sparse", "dense"]


def test_absent_keys_take_transformers_reading_for_kimi_linear():
    cfg = KimiK3Config.from_dict({"model_type": "kimi_linear", **_minimal_text()})
    assert cfg.rms_norm_eps == 1e-5 and cfg.mla_latent_norm_eps == 1e-6
    assert cfg.num_shared_experts == 1 and cfg.routed_scaling_factor == 2.446
    assert cfg.mlp_layer_types == ["dense", "sparse", "sparse", "sparse"]
    assert cfg.mla_use_nope is True
    assert cfg.layer_types == ["linear_attention"] * 4  # i % 4 == 0 and i > 0: none of 0..3


def test_situ_without_its_betas_is_refused():
    text = _minimal_text(hidden_act="situ", activation_situ_beta=4.0)
    with pytest.raises(ValueError, match="activation_situ_linear_beta: hidden_act 'situ'"):
        KimiK3Config.from_dict({"model_type": "kimi_k3", "text_config": text})
    text["activation_situ_linear_beta"] = None
    with pytest.raises(ValueError, match="activation_situ_linear_beta"):
        KimiK3Config.from_dict({"model_type": "kimi_k3", "text_config": text})


def test_top_level_keys_and_their_conflicts():
    text = _minimal_text(tie_word_embeddings=True)
    raw = {"model_type": "kimi_k3", "tie_word_embeddings": False, "text_config": text}
    with pytest.raises(ValueError, match="tie_word_embeddings: the top-level value contradicts"):
        KimiK3Config.from_dict(raw)
    raw["tie_word_embeddings"] = True
    assert KimiK3Config.from_dict(raw).tie_word_embeddings is True
    raw["quantization_config"] = {"quant_method": "gptq"}
    with pytest.raises(ValueError, match=r"quantization_config\.quant_method"):
        KimiK3Config.from_dict(raw)


# ---------------------------------------------------------------------------- 2-D conv
def test_two_dimensional_short_conv_weights_load_the_same(tmp_path):
    src = make_tiny("kimi_k3", tmp_path / "src", seed=9)
    dst = tmp_path / "conv2d"
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    squeezed = [k for k in tensors if "conv1d" in k]
    assert squeezed and all(tensors[k].dim() == 3 for k in squeezed)
    for k in squeezed:
        tensors[k] = tensors[k][:, 0, :].contiguous()  # [C, 1, K] -> [C, K]
    save_file(tensors, str(dst / "model.safetensors"))
    ids = torch.tensor([1, 2, 3, 4, 5])

    def logits(model):
        with torch.no_grad():
            meta = contiguous_metadata([0], [5], 4, 8)
            return model(meta, model.make_caches(8, 4, 1), input_ids=ids)

    two_d, three_d = load_model(dst), load_model(src)
    for name, tensor in three_d.state_dict().items():
        assert torch.equal(two_d.state_dict()[name], tensor), name
    # Bit-equal weights, but the smaller tensors move every offset in the mapped file, and
    # the BLAS may take another path for another alignment: logits agree to rounding.
    ref = logits(three_d)
    assert (logits(two_d) - ref).abs().max() <= 1e-5 * ref.abs().max()

    def run_tp(path):
        def noop(x):
            return x

        return load_model(path, tp_rank=1, tp_size=2, all_reduce=noop)

    a, b = run_tp(dst), run_tp(src)
    name = "model.layers.0.self_attn.q_conv1d.weight"
    assert torch.equal(dict(a.named_parameters())[name], dict(b.named_parameters())[name])
    tensors[squeezed[0]] = tensors[squeezed[0]][:, :3].contiguous()  # wrong K
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(ValueError, match=r"conv1d\.weight: expected shape"):
        load_model(dst)
