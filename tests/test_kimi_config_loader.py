"""Config parsing (both layouts, aliases, errors) and checkpoint loading (formats, errors)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from rocm_mla.models.kimi_k3.config import KimiK3Config
from rocm_mla.models.kimi_k3.loader import CheckpointError, load_model, make_tiny, tp_shard_dim
from tests.model_helpers import contiguous_metadata


def _linear_raw(**over):
    raw = KimiK3Config.tiny("kimi_linear").to_dict()
    raw.update(over)
    return raw


# ---------------------------------------------------------------------------- config
def test_tiny_round_trips_through_both_layouts(tmp_path):
    for arch in ("kimi_k3", "kimi_linear"):
        path = make_tiny(arch, tmp_path / arch)
        raw = json.loads((path / "config.json").read_text())
        assert raw["model_type"] == arch and ("text_config" in raw) == (arch == "kimi_k3")
        assert KimiK3Config.from_pretrained(path) == KimiK3Config.tiny(arch)


def test_k3_layer_pattern_and_features_from_released_style_config():
    cfg = KimiK3Config.tiny("kimi_k3")
    assert [i for i in range(9) if cfg.is_mla(i)] == [3, 7, 8]  # 1-based [4, 8, 9]
    assert not cfg.is_moe(0) and all(cfg.is_moe(i) for i in range(1, 9))
    raw = {"model_type": "kimi_k3", "text_config": cfg.to_dict(), "vision_config": {"x": 1}}
    parsed = KimiK3Config.from_dict(raw)
    assert parsed.attn_res_block_size == 3 and parsed.kda_gate_lower_bound == -5.0
    assert parsed.routed_expert_hidden_size == 32 and parsed.hidden_act == "situ"


def test_transformers_aliases_are_accepted():
    raw = _linear_raw()
    for name, alias in (
        ("num_experts", "num_local_experts"),
        ("num_experts_per_token", "num_experts_per_tok"),
        ("num_shared_experts", "n_shared_experts"),
        ("moe_renormalize", "norm_topk_prob"),
        ("max_position_embeddings", "model_max_length"),
    ):
        raw[alias] = raw.pop(name)
    raw["moe_renormalize_unused"] = True  # unknown keys are ignored, like transformers' extras
    raw["layer_types"] = ["linear_attention"] * 3 + ["full_attention"]
    assert KimiK3Config.from_dict(raw) == KimiK3Config.tiny("kimi_linear")


def test_small_preset_is_the_benchmark_config():
    cfg = KimiK3Config.small()
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (1024, 8, 32000)
    assert [i + 1 for i in range(8) if cfg.is_mla(i)] == [4, 8]
    assert (cfg.kda_num_heads, cfg.kda_head_dim, cfg.num_attention_heads) == (8, 128, 8)
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.kv_cache_dim) == (512, 64, 576)
    assert (cfg.num_experts, cfg.num_experts_per_token) == (16, 2)


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"num_local_experts": 9}, "num_experts"),  # contradicts num_experts
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
        ({"layer_types": ["full_attention"] * 4}, "layer_types"),
        ({"mlp_layer_types": ["sparse"] * 4}, "mlp_layer_types"),
        ({"first_k_dense_replace": 9}, "first_k_dense_replace"),
        ({"num_key_value_heads": 1}, "num_key_value_heads"),
        ({"model_type": "llama"}, "model_type"),
        ({"num_experts_per_token": 20}, "num_experts_per_token"),
    ],
)
def test_bad_config_values_name_the_field(over, field):
    with pytest.raises(ValueError, match=field):
        KimiK3Config.from_dict(_linear_raw(**over))


def test_layer_lists_must_cover_every_layer():
    raw = _linear_raw()
    raw["linear_attn_config"] = {**raw["linear_attn_config"], "kda_layers": [1, 2]}
    with pytest.raises(ValueError, match="kda_layers"):
        KimiK3Config.from_dict(raw)
    raw["linear_attn_config"] = {**raw["linear_attn_config"], "kda_layers": [1, 2, 3, 4]}
    with pytest.raises(ValueError, match="kda_layers"):
        KimiK3Config.from_dict(raw)


# ---------------------------------------------------------------------------- loading
def test_tp_shard_rules():
    assert tp_shard_dim("model.layers.3.self_attn.kv_b_proj.weight") == 0
    assert tp_shard_dim("model.layers.3.self_attn.o_proj.weight") == 1
    assert tp_shard_dim("model.layers.1.block_sparse_moe.experts.2.w2.weight") == 1
    for replicated in (
        "model.layers.1.block_sparse_moe.routed_expert_down_proj.weight",
        "model.layers.1.block_sparse_moe.gate.weight",
        "model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.0.self_attn.f_a_proj.weight",
    ):
        assert tp_shard_dim(replicated) is None


def _logits(model):

    with torch.no_grad():
        caches = model.make_caches(2, 8, 1)
        return model(contiguous_metadata([0], [5], 8, 2), caches, torch.arange(5))


def _rewrite(src, dst, edit):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_sharded_checkpoint_with_vision_and_mtp_keys_loads_the_same(k3_dir, tmp_path):
    tensors = load_file(k3_dir / "model.safetensors")
    tensors["vision_tower.patch_embed.weight"] = torch.zeros(2, 2)
    tensors["mm_projector.proj.0.weight"] = torch.zeros(2, 2)
    tensors["language_model.model.layers.9.self_attn.q_a_proj.weight"] = torch.zeros(2, 2)  # MTP
    keys = sorted(tensors)
    out = tmp_path / "sharded"
    out.mkdir()
    (out / "config.json").write_text((k3_dir / "config.json").read_text())
    weight_map = {}
    for i, part in enumerate((keys[::2], keys[1::2])):
        name = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, out / name)
        weight_map.update(dict.fromkeys(part, name))
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    torch.testing.assert_close(_logits(load_model(out)), _logits(load_model(k3_dir)))


def test_dtype_conversion_keeps_router_and_decay_fp32(k3_dir):
    model = load_model(k3_dir, dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    assert params["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert params["model.layers.0.self_attn.A_log"].dtype == torch.float32
    assert (
        params["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"].dtype
        == torch.float32
    )


LAYER = "language_model.model.layers."


def _drop(t):
    t.pop(LAYER + "2.self_attn.q_proj.weight")


def _extra(t):
    t[LAYER + "2.self_attn.extra"] = torch.zeros(1)


def _reshape(t):
    t[LAYER + "3.self_attn.kv_b_proj.weight"] = torch.zeros(3, 16)


@pytest.mark.parametrize(
    ("edit", "message"),
    [(_drop, "missing tensors"), (_extra, "unexpected tensors"), (_reshape, "wrong shapes")],
)
def test_mismatched_checkpoint_lists_the_problem(k3_dir, tmp_path, edit, message):
    bad = _rewrite(k3_dir, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=message) as info:
        load_model(bad)
    assert "layers." in str(info.value)


def test_many_missing_tensors_are_summarized(k3_dir, tmp_path):
    def drop_layer_one(t):
        for k in [k for k in t if ".layers.1." in k]:
            t.pop(k)

    bad = _rewrite(k3_dir, tmp_path / "bad", drop_layer_one)
    with pytest.raises(CheckpointError, match=r"and \d+ more"):
        load_model(bad)


def test_truncated_file_gives_a_clear_error(k3_dir, tmp_path):
    bad = tmp_path / "truncated"
    bad.mkdir()
    (bad / "config.json").write_text((k3_dir / "config.json").read_text())
    data = (k3_dir / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_model(bad)


def test_released_k3_text_config_values():
    full = [*range(4, 93, 4), 93]
    text = {
        "model_type": "kimi_linear", "num_hidden_layers": 93, "hidden_size": 7168,
        "vocab_size": 163840, "max_position_embeddings": 1048576, "rms_norm_eps": 1e-5,
        "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "intermediate_size": 33792, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "num_attention_heads": 96, "num_key_value_heads": 96, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "mla_use_nope": True, "mla_use_output_gate": True,
        "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2,
        "moe_intermediate_size": 3072, "routed_expert_hidden_size": 3584,
        "latent_moe_use_norm": True, "moe_router_activation_func": "sigmoid",
        "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
        "moe_renormalize": True, "routed_scaling_factor": 1.0, "attn_res_block_size": 12,
        "num_nextn_predict_layers": 0, "tie_word_embeddings": False,
        "linear_attn_config": {
            "num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
            "use_full_rank_gate": True, "gate_lower_bound": -5.0, "full_attn_layers": full,
            "kda_layers": [i for i in range(1, 94) if i not in full],
        },
    }  # fmt: skip
    cfg = KimiK3Config.from_dict({"model_type": "kimi_k3", "text_config": text})
    mla = [i for i in range(93) if cfg.is_mla(i)]
    assert len(mla) == 24 and mla[-2:] == [91, 92] and not cfg.is_mla(0)
    assert not cfg.is_moe(0) and cfg.is_moe(92)
    assert (cfg.kv_cache_dim, cfg.qk_head_dim) == (576, 192)
    assert abs(cfg.softmax_scale - 192**-0.5) < 1e-12


def test_non_prefix_mlp_layer_types_round_trip():
    cfg = KimiK3Config.tiny("kimi_linear")
    cfg.mlp_layer_types = ["dense", "sparse", "dense", "sparse"]
    assert KimiK3Config.from_dict(cfg.to_dict()).mlp_layer_types == cfg.mlp_layer_types
