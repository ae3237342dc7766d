"""Every argument error before any work: named, one line from the CLI, exit 2, no traceback.

``LLM`` checks its arguments (backend name and availability, device, dtype, seed, pp/tp/dcp,
max_num_seqs, ...) before it loads a weight or starts a process; the tests make loading and
spawning fail loudly to prove it. The CLI cases run in real processes (one interpreter that
forks a child per case, so torch is imported once) and look at each child's exit code and
stderr (issue 21, items 5 and 6).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rocm_mla import cli
from rocm_mla.backends import backend_class
from rocm_mla.engine import LLM
from rocm_mla.engine import llm as llm_module
from rocm_mla.models.kimi_k3 import KimiK3Config, make_tiny

REPO = Path(__file__).resolve().parents[1]
NO_GPU = pytest.mark.skipif(
    torch.cuda.is_available(), reason="needs a host where torch sees no GPU"
)
NO_AITER = pytest.mark.skipif(
    backend_class("aiter").unavailable_reason() is None, reason="needs a host that cannot run AITER"
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(make_tiny("kimi_linear", tmp_path_factory.mktemp("args") / "kl", seed=1))


@pytest.fixture
def no_work(monkeypatch):
    """Loading weights or starting workers fails the test: every refusal must come first."""

    def work(*args, **kwargs):
        raise AssertionError("LLM started work (loading or spawning) before refusing")

    monkeypatch.setattr(llm_module.StageWorker, "load", work)
    monkeypatch.setattr(llm_module, "WorkerGroup", work)
    monkeypatch.delenv("ROCM_MLA_BACKEND", raising=False)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"pp": 0}, r"^pp: expected an int >= 1, got 0$"),
        ({"tp": "2"}, r"^tp: expected an int >= 1, got '2'$"),
        ({"dcp": True}, r"^dcp: expected an int >= 1, got True$"),
        ({"pp": 5}, r"^pp: 5 stages for 4 layers"),
        ({"seed": "x"}, r"^seed: expected an int in \[0, 2\*\*64\), got 'x'$"),
        ({"seed": -1}, r"^seed: expected an int"),
        ({"dtype": torch.int8}, r"^dtype: expected one of .* got torch\.int8$"),
        ({"dtype": torch.float64}, r"^dtype: expected one of .* got torch\.float64$"),
        ({"dtype": "float64"}, r"^dtype: expected one of .* got 'float64'$"),
        ({"device": "tpu"}, r"^device: expected 'cpu', 'cuda', 'cuda:N' or None, got 'tpu'$"),
        ({"device": 3}, r"^device: expected 'cpu', 'cuda'"),
        ({"backend": "bogus"}, r"^backend: unknown MLA backend 'bogus'"),
        ({"backend": 7}, r"^backend: expected a backend name or None, got 7$"),
        ({"max_num_seqs": 10**9}, r"^max_num_seqs: 1000000000 sequences need .* GiB of KDA"),
        ({"num_blocks": 10**12}, r"^num_blocks: 1000000000000 blocks of 16 tokens"),
        ({"kv_cache_dtype": "int4"}, r"^kv_cache_dtype: expected 'auto'"),
        ({"launcher": "mpi"}, r"^launcher: expected 'spawn' or 'torchrun'"),
    ],
)
def test_llm_arguments_are_refused_by_name_before_any_work(tiny, no_work, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny, **kwargs)
    with pytest.raises(ValueError, match=match):
        LLM.check(tiny, **kwargs)


@NO_GPU
@pytest.mark.parametrize("device, pp", [("cuda", 1), ("cuda:0", 1), ("cuda", 2)])
def test_a_gpu_device_on_a_host_without_one_is_a_named_error(tiny, no_work, device, pp):
    with pytest.raises(ValueError, match=r"^device: 'cuda(:0)?' .*torch.* sees 0 GPU\(s\)"):
        LLM(tiny, device=device, pp=pp)


@NO_AITER
def test_an_unavailable_backend_is_refused_before_loading(tiny, no_work):
    with pytest.raises(ValueError, match=r"^backend: MLA backend 'aiter' cannot run on this"):
        LLM(tiny, backend="aiter", device="cpu")


def test_the_backend_environment_variable_is_checked_before_loading(tiny, no_work, monkeypatch):
    monkeypatch.setenv("ROCM_MLA_BACKEND", "bogus")
    with pytest.raises(ValueError, match=r"unknown MLA backend 'bogus' \(from ROCM_MLA_BACKEND\)"):
        LLM(tiny, device="cpu")


def test_valid_arguments_pass_the_check(tiny, no_work):
    LLM.check(tiny, pp=2, tp=2, dcp=2, device="cpu", dtype="float32", seed=2**64 - 1)


def test_a_tokenizer_that_fails_to_decode_prints_the_ids_then_one_line(tiny, monkeypatch, capsys):
    class Broken:
        def decode(self, ids):
            raise KeyError(f"no piece for {ids[-1]}")

    monkeypatch.setattr(cli, "_tokenizer", lambda model_dir: Broken())
    argv = ["generate", "--model", tiny, "--prompt-ids", "1,2", "--max-new-tokens", "2"]
    code = cli.main([*argv, "--device", "cpu", "--block-size", "4"])
    out, err = capsys.readouterr()
    assert code == 2
    assert "[0] prompt [1, 2] -> [" in out, out
    # A slow machine may add generate's progress lines before it; the error is one line.
    last = err.splitlines()[-1]
    assert last.startswith("rocm-mla generate: --model: the tokenizer cannot decode prompt 0: ")
    assert "KeyError" in last and "Traceback" not in err, err


# ---- the CLI, in real processes -------------------------------------------------------------

#: Runs ``rocm_mla.cli.main`` once per case in a forked child, as the console script would
#: (an uncaught exception prints its traceback and exits 1), and reports exit code, output
#: and time of each (stderr through a file in the working directory). ``alarm`` bounds
#: every child.
DRIVER = r"""
import json, os, sys, time, traceback
import rocm_mla.cli as cli

results = []
for argv, env in json.load(sys.stdin):
    out_r, out_w = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.close(out_r)
        os.dup2(out_w, 1)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 0)
        err_file = os.open(f"child-{os.getpid()}.err", os.O_CREAT | os.O_WRONLY)
        os.dup2(err_file, 2)
        os.environ.update(env)
        import signal
        signal.alarm(120)
        try:
            code = cli.main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    os.close(out_w)
    with os.fdopen(out_r) as f:
        out = f.read()
    _, status = os.waitpid(pid, 0)
    err_path = f"child-{pid}.err"
    with open(err_path) as f:
        err = f.read()
    os.unlink(err_path)
    results.append({"code": os.waitstatus_to_exitcode(status), "out": out, "err": err,
                    "seconds": time.monotonic() - start})
print(json.dumps(results))
"""


def _edit_config(src: str, dst: Path, edit) -> str:
    dst.mkdir()
    (dst / "model.safetensors").write_bytes((Path(src) / "model.safetensors").read_bytes())
    raw = json.loads((Path(src) / "config.json").read_text())
    text = edit(raw)
    (dst / "config.json").write_text(text if isinstance(text, str) else json.dumps(raw))
    return str(dst)


def _set(path: tuple, value):
    def edit(raw):
        node = raw
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return edit


def _cases(tiny: str, root: Path) -> list[tuple[str, list[str], dict, str]]:
    """``(id, argv, env, what the line must name)``; every case must exit 2 in one line."""
    gen = ["generate", "--prompt-ids", "1,2", "--max-new-tokens", "2", "--model"]
    cases = [
        ("pp0", [*gen, tiny, "--pp", "0"], {}, "--pp: expected an int >= 1, got 0"),
        ("demo-pp0", ["demo", "--pp", "0"], {}, "--pp: expected an int >= 1, got 0"),
        ("dcp3", ["demo", "--tp", "2", "--dcp", "3"], {}, "dcp=3 must divide tp=2"),
        ("dtype", [*gen, tiny, "--dtype", "float64"], {}, "--dtype: expected one of"),
        ("seqs", [*gen, tiny, "--max-num-seqs", str(10**9)], {}, "--max-num-seqs: 1000000000"),
        ("neg-new", [*gen, tiny, "--max-new-tokens", "-1"], {}, "--max-new-tokens: expected"),
        ("vocab", [*gen, tiny, "--prompt-ids", "9999"], {}, "--prompt-ids[1]: token ids"),
        ("env-backend", [*gen, tiny], {"ROCM_MLA_BACKEND": "bogus"}, "'bogus' (from ROCM_MLA"),
        ("backend", [*gen, tiny, "--backend", "bogus"], {}, "--backend: unknown MLA backend"),
    ]
    if not torch.cuda.is_available():
        cases.append(("cuda", [*gen, tiny, "--device", "cuda"], {}, "--device: 'cuda' but"))
    if backend_class("aiter").unavailable_reason() is not None:
        cases.append(("aiter", [*gen, tiny, "--backend", "aiter"], {}, "--backend: MLA backend"))
    configs = {
        "list": (lambda raw: "[]", "config.json: expected a JSON object at the top level"),
        "null": (lambda raw: "null", "config.json: expected a JSON object at the top level"),
        "deep": (lambda raw: "[" * 100_000, "config.json: JSON nested too deeply"),
        "lac-list": (_set(("linear_attn_config",), [1]), "config.json: linear_attn_config:"),
        "lac-str": (_set(("linear_attn_config",), "kda"), "config.json: linear_attn_config:"),
        "layer-types": (_set(("layer_types",), 5), "config.json: layer_types: expected a list"),
        "gate": (
            _set(("linear_attn_config", "use_full_rank_gate"), "false"),
            "config.json: linear_attn_config.use_full_rank_gate: expected true or false",
        ),
        "terabytes": (_terabytes, "--model: the config needs at least"),
    }
    for name, (edit, named) in configs.items():
        path = _edit_config(tiny, root / name, edit)
        cases.append((name, [*gen, path], {}, named))
    index = Path(_edit_config(tiny, root / "index-list", lambda raw: None))
    (index / "model.safetensors.index.json").write_text("[]")
    cases.append(("index-list", [*gen, str(index)], {}, "model.safetensors.index.json: expected"))
    index = Path(_edit_config(tiny, root / "index-bad", lambda raw: None))
    (index / "model.safetensors.index.json").write_text('{"weight_map": ')
    cases.append(("index-bad", [*gen, str(index)], {}, "index.json: not valid JSON"))
    int32 = Path(_edit_config(tiny, root / "int32", lambda raw: None))
    tensors = load_file(int32 / "model.safetensors")
    key = "model.layers.0.input_layernorm.weight"
    tensors[key] = tensors[key].to(torch.int32)
    save_file(tensors, str(int32 / "model.safetensors"), metadata={"format": "pt"})
    cases.append(("int32", [*gen, str(int32)], {}, f"{key}: expected a floating-point dtype"))
    tok = Path(_edit_config(tiny, root / "tokenizer", lambda raw: None))
    (tok / "tokenizer.json").write_text("{not json")
    cases.append(("tokenizer", [*gen, str(tok)], {}, "--model: the tokenizer files in"))
    return cases


def _terabytes(raw: dict) -> None:
    # q_b_proj / kv_b_proj alone hold ~3 TiB; the rest of the model is tiny.
    raw.update(
        num_attention_heads=4096,
        num_key_value_heads=4096,
        q_lora_rank=65536,
        kv_lora_rank=65536,
        qk_nope_head_dim=4096,
        v_head_dim=4096,
        mla_use_output_gate=False,
    )


@pytest.mark.slow
def test_every_cli_argument_error_is_one_line_exit_2_without_traceback(tiny, tmp_path):
    cases = _cases(tiny, tmp_path)
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER],
        input=json.dumps([[argv, env] for _, argv, env, _ in cases]),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.splitlines()[-1])
    failures = []
    for (name, _, _, named), result in zip(cases, results, strict=True):
        err = result["err"]
        ok = (
            result["code"] == 2
            and "Traceback" not in err
            and err.count("\n") == 1
            and err.startswith("rocm-mla ")
            and named in err
            and "prompt" not in result["out"]  # refused before generating anything
        )
        if not ok:
            failures.append(f"{name}: exit {result['code']}, stderr {err[-600:]!r}")
    assert not failures, "\n".join(failures)
    demo = results[[c[0] for c in cases].index("demo-pp0")]
    assert demo["seconds"] < 15, demo  # refused before the single-process run, not after it


def test_released_style_config_passes_the_cli_model_check(tiny):
    config = cli._check_model_dir(tiny)
    assert isinstance(config, KimiK3Config) and config.arch == "kimi_linear"
