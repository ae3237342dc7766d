"""Backend selection by ROCM_MLA_BACKEND / backend=, and the CLI that reports it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rocm_mla
from rocm_mla.backends import BACKEND_NAMES, backend_class, select_backend
from rocm_mla.cli import main
from rocm_mla.inputs import prepare_decode
from tests.reference import make_paged_problem


def _problem():
    q, kv, bt, lens = make_paged_problem([10, 3], num_heads=16)
    return prepare_decode(
        q, kv, bt, lens, head_dim_v=512, softmax_scale=None, causal=True, kv_scale=None
    )


def test_available_backends_reports_every_name():
    avail = rocm_mla.available_backends()
    assert tuple(avail) == BACKEND_NAMES
    assert avail["torch"] is None
    for name, reason in avail.items():
        assert reason is None or (isinstance(reason, str) and reason), name


def test_auto_picks_a_backend_that_can_run(monkeypatch):
    monkeypatch.delenv("ROCM_MLA_BACKEND", raising=False)
    cls = select_backend(None, _problem())
    assert not cls.unsupported_reasons(_problem())
    assert cls.auto_skip_reason() is None


@pytest.mark.parametrize("spelling", ["torch", "TORCH", " torch "])
def test_env_var_selects(monkeypatch, spelling):
    monkeypatch.setenv("ROCM_MLA_BACKEND", spelling)
    assert select_backend(None, _problem()).name == "torch"


def test_argument_overrides_env(monkeypatch):
    monkeypatch.setenv("ROCM_MLA_BACKEND", "no-such-backend")
    assert select_backend("torch", _problem()).name == "torch"


def test_unknown_name_lists_valid_names(monkeypatch):
    monkeypatch.setenv("ROCM_MLA_BACKEND", "flashmla")
    with pytest.raises(
        ValueError, match=r"unknown MLA backend 'flashmla' \(from ROCM_MLA_BACKEND\)"
    ):
        select_backend(None, _problem())
    with pytest.raises(ValueError, match="valid names: auto, aiter, triton, torch"):
        rocm_mla.mla_decode(*make_paged_problem([4]), backend="cutlass")


def test_named_backend_that_cannot_run_says_why():
    problem = _problem()
    for name in BACKEND_NAMES:
        reasons = backend_class(name).unsupported_reasons(problem)
        if not reasons:
            continue
        with pytest.raises(ValueError) as info:
            select_backend(name, problem)
        message = str(info.value)
        assert f"MLA backend {name!r} cannot run this call" in message
        assert reasons[0] in message
        assert "Backends that can: " in message and "torch" in message


def test_cli_info_json_and_text(capsys, monkeypatch):
    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["platform"]["kind"] in ("cpu", "cuda", "hip")
    assert set(info["backends"]) == set(BACKEND_NAMES)
    assert info["backends"]["torch"]["available"] is True
    assert info["selected"] == "torch"
    assert info["env"]["ROCM_MLA_BACKEND"] == "torch"
    assert info["torch"]["version"]
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    for name in BACKEND_NAMES:
        assert f"  {name} " in text
    assert "platform:" in text and "torch:" in text


def test_cli_demo_split_model_is_identical_to_single_process(capsys):
    """The demo's model split (here 2 pipeline stages, to keep it quick) reproduces the
    single-process tokens, and says so."""
    assert main(["demo", "--pp", "2", "--tp", "1", "--dcp", "1", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "single process:" in out and "2 processes, pp=2, tp=1, dcp=1" in out
    assert out.rstrip().endswith("identical") and "tokens/s" in out


def test_cli_bad_backend_is_an_error_not_a_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "rocm_mla.cli", "demo", "--backend", "nope"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert "unknown MLA backend 'nope'" in proc.stderr and "Traceback" not in proc.stderr


def test_package_import_is_light():
    """Importing rocm_mla pulls in neither triton, aiter nor vllm."""
    code = (
        "import sys, rocm_mla; rocm_mla.available_backends; "
        "print([m for m in ('triton', 'aiter', 'vllm') if m in sys.modules])"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("cwd", ["/", str(REPO_ROOT)], ids=["elsewhere", "repository-root"])
def test_kernels_are_installed_under_the_package_only(cwd):
    """Our kernels import only as ``rocm_mla.kernels``: a top-level ``kernels``, if any, is
    another distribution's (Hugging Face's, which transformers imports), even from the
    repository root, where ``sys.path`` starts with the checkout."""
    code = (
        "import importlib.util, os, rocm_mla.kernels; "
        "spec = importlib.util.find_spec('kernels'); "
        "ours = os.path.dirname(os.path.dirname(rocm_mla.kernels.__file__)); "
        "print(spec is None or not spec.origin.startswith(ours + os.sep), "
        "os.path.relpath(rocm_mla.kernels.__file__, os.path.dirname(ours)))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=cwd
    )
    assert proc.stdout.split() == ["True", os.path.join("rocm_mla", "kernels", "__init__.py")]


def test_transformers_hub_kernels_import_from_the_repository_root():
    """transformers >= 5.25 imports Hugging Face's ``kernels`` package; a checkout whose root
    is on ``sys.path`` (pytest, ``python -c`` there) must not shadow it."""
    pytest.importorskip("transformers")
    code = (
        "import sys; sys.path.insert(0, '.'); "
        "import importlib.util, transformers.integrations.hub_kernels; "
        "spec = importlib.util.find_spec('kernels'); "
        "print('ok', spec is None or 'site-packages' in spec.origin)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["ok", "True"]
