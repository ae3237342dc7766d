"""The words the vLLM integration and ``rocm-mla info`` use: the start-up refusal of a named
backend and the first-decode line. No vLLM needed: these run in the main venv."""

from __future__ import annotations

import pytest
import torch

import rocm_mla
from rocm_mla.backends.triton import TritonMLAImpl
from rocm_mla.cli import main
from rocm_mla.integrations.common import describe_plan, startup_refusal


def test_auto_and_runnable_backends_are_never_refused():
    assert startup_refusal("auto", device_kind="cuda", kv_dtypes=(torch.float64,)) is None
    assert startup_refusal("torch", device_kind="cpu", kv_dtypes=(torch.float32,)) is None


def test_refusal_names_the_reason_and_the_backends_that_can(monkeypatch):
    monkeypatch.setattr(
        TritonMLAImpl, "unavailable_reason", classmethod(lambda cls: "no GPU Triton target")
    )
    message = startup_refusal("triton", device_kind="cpu")
    assert message.startswith(
        "rocm-mla: ROCM_MLA_BACKEND=triton cannot run on this machine: no GPU Triton target. "
    )
    assert "Backends that can: torch " in message


def test_refusal_checks_the_engine_device_and_the_cache_dtype():
    # The CPU interpreter target (conftest sets TRITON_INTERPRET=1 here) serves CPU engines only.
    assert TritonMLAImpl.capabilities.platforms == ("cpu",)
    message = startup_refusal("triton", device_kind="cuda")
    assert "the engine runs on cuda, this backend on cpu" in message
    message = startup_refusal("torch", device_kind="cpu", kv_dtypes=(torch.float8_e5m2,))
    assert "KV cache float8_e5m2, supported: " in message


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_first_decode_line_states_backend_target_and_launch(backend):
    plan = rocm_mla.plan_decode(
        [300, 17], q_len=4, num_heads=12, kv_dtype=torch.float32, backend=backend
    )
    line = describe_plan(plan)
    assert line.startswith(f"rocm-mla: decode with {backend} (")
    assert line.endswith(") for 12 heads, q_len 4, kv float32")
    if backend == "triton":
        launch = plan.launch
        config = launch.config
        assert f"BLOCK_H {config.block_h}, BLOCK_N {config.block_n}" in line
        assert f"{config.num_warps} warps, {launch.balanced}" in line
        assert f"{launch.num_slots} slots" in launch.balanced
        assert "interpreter" in line
    else:
        assert line.startswith("rocm-mla: decode with torch (cpu)")


def test_info_prints_the_decode_line(capsys, monkeypatch):
    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    assert "decode:   rocm-mla: decode with torch (cpu) for 12 heads, q_len 1, kv bfloat16" in text
