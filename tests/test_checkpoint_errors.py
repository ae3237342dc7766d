"""Malformed checkpoints and configs: one line naming the file and key, before any work.

Structure is checked before use (objects where objects belong, lists, booleans as booleans,
bounded JSON nesting), every tensor's dtype is checked against its parameter, and the memory
pre-check counts exactly the bytes the model allocates. Also the absent-key defaults and
router/activation readings chosen against upstream (issue 21, items 5 and 8).
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rocm_mla.models.kimi_k3 import KimiK3Config, load_model, make_tiny
from rocm_mla.models.kimi_k3 import limits as limits_module
from rocm_mla.models.kimi_k3 import loader as loader_module
from rocm_mla.models.kimi_k3.limits import check_memory, stage_parameter_bytes
from rocm_mla.models.kimi_k3.loader import CheckpointError
from rocm_mla.models.kimi_k3.model import KimiK3ForCausalLM
from rocm_mla.models.kimi_k3.moe import Router

PACKAGE = Path(__file__).resolve().parents[1] / "rocm_mla" / "models" / "kimi_k3"


@pytest.fixture(scope="module")
def kl_dir(tmp_path_factory) -> Path:
    return make_tiny("kimi_linear", tmp_path_factory.mktemp("kl"), seed=5)


def _raw(arch: str) -> dict:
    """A tiny config.json as released (K3 nested under text_config, Kimi-Linear flat)."""
    text = KimiK3Config.tiny(arch).to_dict()
    top = {"tie_word_embeddings": text.pop("tie_word_embeddings")}
    if arch == "kimi_k3":
        return {"model_type": "kimi_k3", **top, "text_config": text}
    return {**text, **top}


def _one_line_error(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


# ---- config.json -----------------------------------------------------------------------------


def _linear(raw: dict) -> dict:
    return raw.get("text_config", raw)


@pytest.mark.parametrize(
    "content, match",
    [
        ("[]", r"config\.json: expected a JSON object at the top level, got a list of 0"),
        ("null", r"config\.json: expected a JSON object at the top level, got null"),
        ("5", r"config\.json: expected a JSON object at the top level, got a number"),
        ("[" * 100_000, r"config\.json: JSON nested too deeply"),
        ('{"model_type": ', r"config\.json: not valid JSON \(Expecting value at line 1"),
        (b"\xff\xfe{", r"config\.json: not valid JSON"),
    ],
)
def test_config_json_that_is_not_an_object_names_the_file(tmp_path, content, match):
    file = tmp_path / "config.json"
    if isinstance(content, bytes):
        file.write_bytes(content)
    else:
        file.write_text(content)
    with pytest.raises(ValueError, match=match) as err:
        KimiK3Config.from_pretrained(tmp_path)
    assert str(file) in _one_line_error(err)


@pytest.mark.parametrize("arch", ["kimi_k3", "kimi_linear"])
@pytest.mark.parametrize(
    "key, value, match",
    [
        ("linear_attn_config", [1, 2], r"linear_attn_config: expected an object or null, got a l"),
        ("linear_attn_config", "kda", r"linear_attn_config: expected an object or null, got a s"),
        ("layer_types", 5, r"layer_types: expected a list of layer types .*got a number \(5\)"),
        ("layer_types", "full", r"layer_types: expected a list of layer types"),
        ("mlp_layer_types", 5, r"mlp_layer_types: expected a list of MLP types"),
        ("first_k_dense_replace", True, r"first_k_dense_replace: expected in \[0, \d+\]"),
    ],
)
def test_config_keys_of_the_wrong_kind_name_file_and_key(tmp_path, arch, key, value, match):
    raw = _raw(arch)
    _linear(raw)[key] = value
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=match) as err:
        KimiK3Config.from_pretrained(tmp_path)
    assert _one_line_error(err).startswith(str(tmp_path / "config.json") + ": ")


@pytest.mark.parametrize("value", ["false", "true", 0, 1, None])
def test_use_full_rank_gate_must_be_a_boolean(value):
    raw = _raw("kimi_k3")
    raw["text_config"]["linear_attn_config"]["use_full_rank_gate"] = value
    with pytest.raises(ValueError, match=r"linear_attn_config\.use_full_rank_gate: expected true"):
        KimiK3Config.from_dict(raw)


@pytest.mark.parametrize("key", ["full_attn_layers", "kda_layers"])
def test_layer_lists_must_be_lists_of_ints(key):
    raw = _raw("kimi_linear")
    raw["linear_attn_config"][key] = 4
    with pytest.raises(ValueError, match=f"linear_attn_config.{key}: expected a list of 1-based"):
        KimiK3Config.from_dict(raw)
    raw["linear_attn_config"][key] = [True]
    with pytest.raises(ValueError, match=f"linear_attn_config.{key}: expected 1-based layer"):
        KimiK3Config.from_dict(raw)


def _key_paths(obj: object, prefix: tuple = ()):
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield (*prefix, key)
            yield from _key_paths(value, (*prefix, key))


_KINDS = (None, [], [5], "x", "false", 5, -1, 1.5, True, {}, {"a": 1}, 10**30)


@pytest.mark.parametrize("arch", ["kimi_k3", "kimi_linear"])
def test_every_key_replaced_by_every_json_kind_is_parsed_or_one_named_line(arch):
    """No value of any JSON kind in any key escapes as another exception than ValueError, or
    as more than one line; a value of another kind than released that parses is a null
    (the key's absent default), replaces a null (a nullable key), or changes nothing (a key
    this text model does not read)."""
    raw = _raw(arch)
    base = KimiK3Config.from_dict(raw)
    for path in list(_key_paths(raw)):
        for value in _KINDS:
            changed = copy.deepcopy(raw)
            node = changed
            for key in path[:-1]:
                node = node[key]
            released = node[path[-1]]
            node[path[-1]] = value
            try:
                parsed = KimiK3Config.from_dict(changed)
            except ValueError as err:
                assert "\n" not in str(err), (path, value, str(err))
                continue
            kinds = {type(released), type(value)}
            same_kind = len(kinds) == 1 or kinds == {int, float}
            nullable = None in (released, value)
            assert same_kind or nullable or parsed == base, (path, value, parsed)


# ---- index.json and tensors ------------------------------------------------------------------


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for name in ("config.json", "model.safetensors"):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


@pytest.mark.parametrize(
    "content, match",
    [
        ("[]", r"index\.json: expected a JSON object at the top level, got a list of 0"),
        ('{"weight_map": [1]}', r"index\.json: weight_map: expected an object"),
        ('{"weight_map": ', r"index\.json: not valid JSON \(Expecting value"),
        ("[" * 100_000, r"index\.json: JSON nested too deeply"),
    ],
)
def test_malformed_index_json_names_the_file(kl_dir, tmp_path, monkeypatch, content, match):
    model = _copy_checkpoint(kl_dir, tmp_path / "model")
    (model / "model.safetensors.index.json").write_text(content)

    def build(*args, **kwargs):
        raise AssertionError("the model was built before the index was read")

    monkeypatch.setattr(loader_module, "KimiK3ForCausalLM", build)
    with pytest.raises(CheckpointError, match=match) as err:
        load_model(model)
    assert str(model / "model.safetensors.index.json") in _one_line_error(err)


@pytest.mark.parametrize(
    "key", ["model.layers.0.input_layernorm.weight", "model.embed_tokens.weight"]
)
def test_integer_tensor_where_a_float_belongs_names_key_file_and_dtype(kl_dir, tmp_path, key):
    model = _copy_checkpoint(kl_dir, tmp_path / "model")
    tensors = load_file(model / "model.safetensors")
    tensors[key] = tensors[key].to(torch.int32)
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        load_model(model)
    text = str(err.value)
    assert f"{key}: expected a floating-point dtype" in text, text
    assert "got I32 (in model.safetensors)" in text and "missing" not in text, text


@pytest.mark.parametrize("dtype", [torch.int8, torch.float64, torch.bool])
def test_load_model_refuses_a_non_model_dtype(kl_dir, dtype):
    with pytest.raises(ValueError, match=r"dtype: expected one of \(torch.float32"):
        load_model(kl_dir, dtype=dtype)


# ---- the memory pre-check counts every parameter ----------------------------------------------


def _allocated_bytes(model: KimiK3ForCausalLM) -> int:
    """Bytes of every distinct parameter and buffer, plus the absorbed MLA decode weights."""
    tensors = {t.data_ptr(): t.nbytes for t in (*model.parameters(), *model.buffers())}
    model.absorb_weights()
    absorbed = sum(
        layer.self_attn.w_uk_t.nbytes + layer.self_attn.w_uv.nbytes
        for layer in model.model.layers.values()
        if layer.is_mla
    )
    return sum(tensors.values()) + absorbed


def _configs():
    for arch in ("kimi_k3", "kimi_linear"):
        tiny = KimiK3Config.tiny(arch)
        yield f"{arch}", tiny
        yield f"{arch}-tied", dataclasses.replace(tiny, tie_word_embeddings=True)
    k3 = KimiK3Config.tiny("kimi_k3")
    yield (
        "kimi_k3-mxfp4",
        dataclasses.replace(k3, routed_expert_quant="mxfp4", moe_intermediate_size=64),
    )
    yield (
        "kimi_k3-no-latent-norm",
        dataclasses.replace(
            k3, latent_moe_use_norm=False, kda_full_rank_gate=False, q_lora_rank=None
        ),
    )


@pytest.mark.parametrize("name, config", list(_configs()), ids=[n for n, _ in _configs()])
@pytest.mark.parametrize("pp, tp", [(1, 1), (2, 1), (1, 2), (3, 2)])
def test_counted_bytes_equal_the_bytes_each_stage_allocates(name, config, pp, tp):
    for rank in range(pp):
        model = KimiK3ForCausalLM(
            config, pp_rank=rank, pp_size=pp, tp_size=tp, all_reduce=lambda x: x
        )
        counted = stage_parameter_bytes(config, pp_rank=rank, pp_size=pp, tp_size=tp, itemsize=4)
        assert counted == _allocated_bytes(model), (name, pp, tp, rank)


def test_counted_bytes_equal_a_loaded_bf16_model_with_its_fp32_parameters(k3_dir):
    model = load_model(k3_dir, dtype=torch.bfloat16)
    config = KimiK3Config.from_pretrained(k3_dir)
    tensors = {t.data_ptr(): t.nbytes for t in model.parameters()}
    absorbed = sum(
        layer.self_attn.w_uk_t.nbytes + layer.self_attn.w_uv.nbytes
        for layer in model.model.layers.values()
        if layer.is_mla
    )
    assert stage_parameter_bytes(config, itemsize=2) == sum(tensors.values()) + absorbed


def _free(monkeypatch, gib: int) -> None:
    monkeypatch.setattr(limits_module, "available_bytes", lambda device: gib * 1024**3)


def test_a_config_whose_size_is_in_q_b_and_kv_b_is_refused(monkeypatch):
    # ~1 TiB in q_b_proj and ~2 TiB in kv_b_proj, almost nothing elsewhere: a count that
    # leaves them out lets this through to a terabyte allocation.
    config = dataclasses.replace(
        KimiK3Config.tiny("kimi_k3"),
        num_attention_heads=4096,
        q_lora_rank=65536,
        kv_lora_rank=65536,
        qk_nope_head_dim=4096,
        v_head_dim=4096,
    )
    _free(monkeypatch, 64)
    with pytest.raises(ValueError, match=r"model: the config needs at least \d+\.\d GiB"):
        check_memory(config, device="cpu", param_itemsize=2)


def test_kda_state_beyond_memory_names_max_num_seqs(monkeypatch):
    config = KimiK3Config.tiny("kimi_linear")
    _free(monkeypatch, 1)
    with pytest.raises(ValueError, match=r"max_num_seqs: 1000000000 sequences need .* fit"):
        check_memory(config, device="cpu", num_blocks=4, block_size=4, max_num_seqs=10**9)
    with pytest.raises(ValueError, match=r"num_blocks: 1000000000 blocks of 16 tokens"):
        check_memory(config, device="cpu", num_blocks=10**9, block_size=16, max_num_seqs=4)


# ---- absent keys and upstream readings (item 8) ----------------------------------------------


@pytest.mark.parametrize("arch, default", [("kimi_k3", 11008), ("kimi_linear", 9216)])
def test_absent_intermediate_size_takes_the_upstream_default(arch, default):
    # kimi_k3: the config class shipped with K3 (and vLLM's KimiLinearConfig): 11008;
    # kimi_linear: transformers' KimiLinearConfig, the parity tests' reference: 9216.
    raw = _raw(arch)
    _linear(raw).pop("intermediate_size")
    assert KimiK3Config.from_dict(raw).intermediate_size == default


@pytest.mark.parametrize("name", ["activation_situ_beta", "activation_situ_linear_beta"])
def test_situ_without_its_betas_is_refused(name):
    raw = _raw("kimi_k3")
    raw["text_config"].pop(name)
    with pytest.raises(ValueError, match=f"{name}: hidden_act 'situ' needs it"):
        KimiK3Config.from_dict(raw)


@pytest.mark.parametrize("renormalize", [True, False])
def test_a_single_routed_weight_is_renormalized_like_upstream(renormalize):
    config = dataclasses.replace(
        KimiK3Config.tiny("kimi_linear"), num_experts_per_token=1, moe_renormalize=renormalize
    )
    router = Router(config)
    with torch.no_grad():
        router.weight.normal_(generator=torch.Generator().manual_seed(0))
    x = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(1))
    weights, ids = router(x)
    scores = torch.sigmoid(x @ router.weight.t()).gather(1, ids)
    expected = torch.ones_like(scores) if renormalize else scores
    torch.testing.assert_close(weights, expected * config.routed_scaling_factor)


def _imports(module: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_the_model_package_has_no_import_cycle():
    """Every import counts, ``TYPE_CHECKING`` ones too: a cycle there is still a cycle."""
    prefix = "rocm_mla.models.kimi_k3."
    graph = {
        prefix + f.stem: {m for m in _imports(f) if m.startswith(prefix)}
        for f in PACKAGE.glob("*.py")
        if f.stem != "__init__"
    }

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    cycles = sorted(m for m in graph if reaches(m, m, {m}))
    assert not cycles, f"modules on an import cycle: {cycles}"


def test_tp_checks_only_the_dimensions_of_layers_the_model_has():
    # An all-MoE K3 config without intermediate_size (default 11008, not a multiple of 3)
    # shards no dense MLP, so tp=3 is fine; one dense layer makes the default count.
    raw = _raw("kimi_k3")
    text = raw["text_config"]
    text.pop("intermediate_size")
    text.update(num_attention_heads=12, num_key_value_heads=12, first_k_dense_replace=0)
    text["moe_intermediate_size"] = 48
    text["linear_attn_config"]["num_heads"] = 12
    KimiK3Config.from_dict(raw).check_tp(3)
    text["first_k_dense_replace"] = 1
    with pytest.raises(ValueError, match="intermediate_size: expected a multiple of tp_size=3"):
        KimiK3Config.from_dict(raw).check_tp(3)
