"""The last loose inputs, refused by name before any work (issue 30, item 5).

Each refusal names the argument (or the config.json file and key, or the checkpoint tensor),
says what was expected and what came: bool lengths, ``head_dim_v=True`` and a string
``kv_scale`` in the decode entry points; prompts that are not sequences of ints; empty CLI
ids; oversized config integers; non-finite weights; an absurd ``logit_scale``.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from rocm_mla import mla_decode, plan_decode, plan_schedule
from rocm_mla.backends import backend_class
from rocm_mla.engine import LLM
from rocm_mla.engine import llm as llm_module
from rocm_mla.engine.worker import EngineOptions, StageWorker
from rocm_mla.models.kimi_k3 import KimiK3Config, load_model, make_tiny
from rocm_mla.models.kimi_k3.loader import CheckpointError

# ---- decode arguments ------------------------------------------------------------------------

HEAD_DIM_V, ROPE = 8, 4


def _decode_inputs(kv_dtype: torch.dtype = torch.float32):
    """``(q, kv_cache, block_table, cache_seqlens)`` of one request of 3 tokens, on the CPU."""
    q = torch.randn(1, 1, 2, HEAD_DIM_V + ROPE)
    kv_cache = torch.randn(2, 4, HEAD_DIM_V + ROPE).to(kv_dtype)
    block_table = torch.zeros(1, 2, dtype=torch.int32)
    return q, kv_cache, block_table, torch.tensor([3], dtype=torch.int32)


def _plan(lens):
    return plan_decode(
        lens, q_len=1, num_heads=2, head_dim_v=HEAD_DIM_V, rope_dim=ROPE, kv_dtype=torch.float32
    )


def _schedule(lens):
    return plan_schedule(
        lens, q_len=1, num_heads=2, head_dim_v=HEAD_DIM_V, rope_dim=ROPE, kv_dtype=torch.float32
    )


@pytest.mark.parametrize("planner, name", [(_plan, "plan_decode"), (_schedule, "plan_schedule")])
@pytest.mark.parametrize(
    "lens, got",
    [
        (torch.tensor([True, False]), r"torch\.bool"),
        ([True, False], r"\[True, False\]"),
        ([3, True], r"\[3, True\]"),
        (torch.tensor([3.0, 1.5]), r"torch\.float32"),
        (torch.tensor([3 + 0j]), r"torch\.complex64"),
    ],
)
def test_lengths_that_are_not_integers_are_refused_by_the_planners(planner, name, lens, got):
    with pytest.raises(ValueError, match=rf"^{name}: cache_seqlens must be .*, got .*{got}"):
        planner(lens)


def test_bool_lengths_are_refused_by_the_one_shot_call():
    q, kv_cache, block_table, _ = _decode_inputs()
    with pytest.raises(ValueError, match=r"^mla_decode: cache_seqlens must be int32, got torch\."):
        mla_decode(q, kv_cache, block_table, torch.tensor([True]), head_dim_v=HEAD_DIM_V)


@pytest.mark.parametrize("value", [True, False, 8.0, "8", np.int64(8)])
def test_head_dim_v_must_be_an_int(value):
    q, kv_cache, block_table, lens = _decode_inputs()
    with pytest.raises(ValueError, match=r"^mla_decode: head_dim_v must be an int in \(0, 12\)"):
        mla_decode(q, kv_cache, block_table, lens, head_dim_v=value)


@pytest.mark.parametrize("name", ["num_heads", "head_dim_v", "rope_dim"])
def test_the_backend_impl_refuses_bool_sizes(name):
    kwargs = {"num_heads": 2, "head_dim_v": HEAD_DIM_V, "rope_dim": ROPE, name: True}
    with pytest.raises(ValueError, match=rf"^torch: {name} must be an int >= \d, got True$"):
        backend_class("torch")(**kwargs)


@pytest.mark.parametrize(
    "scale, got",
    [
        ("1", r"'1'"),
        (b"1", r"b'1'"),
        (True, r"True"),
        (torch.tensor(True), r"\(\) torch\.bool"),
        (torch.tensor(2), r"\(\) torch\.int64"),
    ],
)
def test_kv_scale_must_be_a_number_or_a_float_tensor(scale, got):
    q, kv_cache, block_table, lens = _decode_inputs(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=rf"^mla_decode: kv_scale must be .*, got {got}"):
        mla_decode(q, kv_cache, block_table, lens, head_dim_v=HEAD_DIM_V, kv_scale=scale)


def test_numeric_kv_scales_still_pass():
    q, kv_cache, block_table, lens = _decode_inputs(torch.float8_e4m3fn)
    outs = [
        mla_decode(q, kv_cache, block_table, lens, head_dim_v=HEAD_DIM_V, kv_scale=scale)[0]
        for scale in (2, 2.0, torch.tensor(2.0), torch.tensor([2.0], dtype=torch.bfloat16))
    ]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0])


# ---- prompts ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny("kimi_linear", tmp_path_factory.mktemp("loose") / "kl", seed=2)


@pytest.fixture(scope="module")
def local(tiny):
    with LLM(tiny, block_size=4, device="cpu") as llm:
        yield llm


#: ``(prompt_token_ids, the start of the message)``: not one of them is a list of int lists.
BAD_PROMPTS = [
    ({0: [1, 2]}, r"prompt_token_ids: expected a non-empty list of token-id lists"),
    ("12", r"prompt_token_ids: expected a non-empty list of token-id lists"),
    ([{1: "a", 2: "b"}], r"prompt_token_ids\[0\]: expected a list of ints, got a dict"),
    ([[1], {1: 2}.keys()], r"prompt_token_ids\[1\]: expected a list of ints, got a dict_keys"),
    ([{3, 1, 2}], r"prompt_token_ids\[0\]: expected a list of ints, got a set"),
    ([iter([1, 2])], r"prompt_token_ids\[0\]: expected a list of ints, got a list_iterator"),
    (["12"], r"prompt_token_ids\[0\]: expected a list of ints, got a str"),
    ([[1.0, 2.0]], r"prompt_token_ids\[0\]\[0\]: expected an int token id, got 1\.0 \(float\)"),
    ([[1, True]], r"prompt_token_ids\[0\]\[1\]: expected an int token id, got True \(bool\)"),
    ([[[1], [2]]], r"prompt_token_ids\[0\]\[0\]: expected an int token id, got \[1\] \(list\)"),
    (
        [torch.tensor([[1], [2]])],
        r"prompt_token_ids\[0\]: expected a list of ints, got a 2-D Tensor",
    ),
    ([np.array([[1], [2]])], r"prompt_token_ids\[0\]: expected a list of ints, got a 2-D ndarray"),
    ([[torch.tensor([1])]], r"prompt_token_ids\[0\]\[0\]: expected an int token id, got tensor"),
]


@pytest.mark.parametrize("prompts, match", BAD_PROMPTS)
def test_generate_refuses_prompts_not_sequences_of_ints(local, monkeypatch, prompts, match):
    def work(*args, **kwargs):
        raise AssertionError("generate ran before refusing its prompts")

    monkeypatch.setattr(local, "_call", work)
    with pytest.raises(ValueError, match=f"^{match}"):
        local.generate(prompts, 1)
    with pytest.raises(ValueError, match=f"^{match}"):
        local.score(prompts)


@pytest.fixture(scope="module")
def worker(tiny) -> StageWorker:
    return StageWorker.load(str(tiny), EngineOptions(block_size=4), None, "cpu")


@pytest.mark.parametrize("prompts, match", BAD_PROMPTS)
def test_the_worker_refuses_them_too(worker, prompts, match):
    for call in (lambda: worker.generate(prompts, 1), lambda: worker.score(prompts)):
        with pytest.raises(ValueError, match=f"^{match}"):
            call()


def test_sequences_arrays_and_tensors_of_ints_are_prompts(local):
    plain = local.generate([[1, 2, 3]], 2)
    for prompt in ((1, 2, 3), range(1, 4), np.array([1, 2, 3]), torch.tensor([1, 2, 3])):
        assert local.generate([prompt], 2) == plain, prompt


# ---- CLI ids ---------------------------------------------------------------------------------


@pytest.fixture
def no_work(monkeypatch):
    """Loading weights or starting workers fails the test: every refusal must come first."""

    def work(*args, **kwargs):
        raise AssertionError("the CLI started work (loading or spawning) before refusing")

    monkeypatch.setattr(llm_module.StageWorker, "load", work)
    monkeypatch.setattr(llm_module, "WorkerGroup", work)


@pytest.mark.parametrize("ids", ["1,,2", "", ",", "1,2,", ",1", " ", "1, ,2", "1_0", "0x1", "١"])
def test_empty_or_malformed_prompt_ids_are_one_line_naming_the_flag(tiny, no_work, capsys, ids):
    from rocm_mla import cli

    argv = ["generate", "--model", str(tiny), "--prompt-ids", "1,2", "--prompt-ids", ids]
    assert cli.main([*argv, "--device", "cpu"]) == 2
    out, err = capsys.readouterr()
    assert err == (
        "rocm-mla generate: --prompt-ids: expected comma-separated integers (one id between "
        f"every two commas), got {ids!r}\n"
    ), err
    assert out == ""


def test_spaces_around_prompt_ids_are_fine():
    from rocm_mla import cli

    assert cli._parse_ids(" 1, 2 ,+3 ") == [1, 2, 3]
    assert cli._parse_ids("-1") == [-1]  # refused later, by the vocabulary check


# ---- config.json integers --------------------------------------------------------------------


def _config_text(arch: str, key: tuple, digits: str) -> str:
    """A tiny config.json as released, with the JSON number ``digits`` at ``key``."""
    text = KimiK3Config.tiny(arch).to_dict()
    raw = {"tie_word_embeddings": text.pop("tie_word_embeddings")}
    raw = {"model_type": "kimi_k3", **raw, "text_config": text} if arch == "kimi_k3" else text
    node = raw
    for part in key[:-1]:
        node = node[part]
    node[key[-1]] = "@NUMBER@"
    return json.dumps(raw).replace('"@NUMBER@"', digits)


@pytest.mark.parametrize(
    "arch, key, named",
    [
        ("kimi_linear", ("vocab_size",), "vocab_size"),
        ("kimi_k3", ("text_config", "vocab_size"), "text_config.vocab_size"),
        ("kimi_k3", ("text_config", "rope_theta"), "text_config.rope_theta"),
        (
            "kimi_linear",
            ("linear_attn_config", "full_attn_layers", 0),
            r"linear_attn_config.full_attn_layers\[0\]",
        ),
    ],
)
@pytest.mark.parametrize("digits", ["9" * 5000, "-" + "9" * 5000, "9" * 101])
def test_an_oversized_config_integer_names_the_file_and_key(tmp_path, arch, key, named, digits):
    file = tmp_path / "config.json"
    file.write_text(_config_text(arch, key, digits))
    count = len(digits.lstrip("-"))
    with pytest.raises(ValueError) as err:
        KimiK3Config.from_pretrained(tmp_path)
    text = str(err.value)
    assert "\n" not in text and "limit" not in text, text
    expected = (
        rf"{named}: expected a number of at most 100 digits, got an integer of {count} digits"
    )
    assert re.fullmatch(rf"{re.escape(str(file))}: {expected}", text), text


def test_an_oversized_integer_in_the_index_names_the_file_and_key(tiny, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        (model / name).write_bytes((tiny / name).read_bytes())
    index = model / "model.safetensors.index.json"
    index.write_text('{"metadata": {"total_size": ' + "7" * 5000 + '}, "weight_map": {}}')
    match = rf"^{re.escape(str(index))}: metadata\.total_size: expected a number of at most 100"
    with pytest.raises(CheckpointError, match=match):
        load_model(model)


@pytest.mark.parametrize("value", [10**40, 2**31, -1])
def test_an_integer_that_parses_but_is_absurd_for_its_field_is_refused(tmp_path, value):
    file = tmp_path / "config.json"
    file.write_text(_config_text("kimi_k3", ("text_config", "vocab_size"), str(value)))
    match = (
        rf"^{re.escape(str(file))}: vocab_size: expected an int in \[1, 16777216\], got {value}$"
    )
    with pytest.raises(ValueError, match=match):
        KimiK3Config.from_pretrained(tmp_path)


def test_released_sized_numbers_still_parse(tmp_path):
    (tmp_path / "config.json").write_text(
        _config_text("kimi_k3", ("text_config", "rope_theta"), "1" + "0" * 99)
    )
    assert KimiK3Config.from_pretrained(tmp_path).rope_theta == 10**99


# ---- weights ---------------------------------------------------------------------------------


def _with_tensors(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    (dst / "config.json").write_bytes((src / "config.json").read_bytes())
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


NORM = "model.layers.0.input_layernorm.weight"
EMBED = "model.embed_tokens.weight"
A_LOG = "model.layers.0.self_attn.A_log"


def test_non_finite_weights_are_refused_at_load_by_checkpoint_key(tiny, tmp_path):
    def poison(tensors):
        tensors[NORM][3] = math.nan
        tensors[EMBED][7, 1] = math.inf
        tensors[A_LOG].view(-1)[0] = -math.inf

    model = _with_tensors(tiny, tmp_path / "model", poison)
    with pytest.raises(CheckpointError) as err:
        load_model(model)
    text = str(err.value)
    assert "non-finite values (NaN or inf) (3)" in text, text
    for key, count in ((NORM, 1), (EMBED, 1), (A_LOG, 1)):
        assert f"{key}: {count} of " in text and "(in model.safetensors)" in text, text
    assert "missing" not in text, text


def test_a_weight_that_overflows_the_load_dtype_is_named(tiny, tmp_path):
    key = "model.layers.0.mlp.gate_proj.weight"

    def enlarge(tensors):
        tensors[key][0, 0] = 1e5  # finite in float32, beyond float16's 65504

    model = _with_tensors(tiny, tmp_path / "model", enlarge)
    assert load_model(model, dtype=torch.bfloat16) is not None
    with pytest.raises(CheckpointError, match=rf"{key}: 1 of \d+ values overflow torch\.float16"):
        load_model(model, dtype=torch.float16)


# ---- logit_scale -----------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, 0.0, -1.0, 1e308, 9e-7, 1.5e6, math.nan, math.inf, -math.inf])
def test_logit_scale_outside_its_range_is_refused_with_the_range(value):
    with pytest.raises(
        ValueError, match=r"^logit_scale: expected a finite number in \[1e-06, 1e\+06\], got"
    ):
        KimiK3Config(logit_scale=value)


def test_logit_scale_in_config_json_names_the_file(tmp_path):
    file = tmp_path / "config.json"
    file.write_text(_config_text("kimi_k3", ("text_config", "logit_scale"), "1e308"))
    match = rf"^{re.escape(str(file))}: logit_scale: expected a finite number in"
    with pytest.raises(ValueError, match=match):
        KimiK3Config.from_pretrained(tmp_path)


@pytest.mark.parametrize("value", [1e-6, 0.0625, 1, 1.0, 16.0, 1e6])
def test_logit_scales_in_range_pass(value):
    assert KimiK3Config(logit_scale=value).logit_scale == value
