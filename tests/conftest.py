"""Shared fixtures, and hardware markers that skip with a reason saying what is missing."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# With no GPU, Triton kernels can only run in the interpreter, which must be switched on
# before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _skip_reason(marker: str) -> str | None:
    if marker == "gpu" and not torch.cuda.is_available():
        return "needs a GPU: torch sees no CUDA/HIP device"
    if marker == "rocm":
        if not torch.version.hip:
            return "needs a ROCm (HIP) build of torch"
        if not torch.cuda.is_available():
            return "needs a visible AMD GPU"
    if marker == "vllm" and importlib.util.find_spec("vllm") is None:
        return "needs vLLM (run `make test-vllm`, which uses its own venv)"
    if marker == "sglang" and importlib.util.find_spec("sglang") is None:
        return "needs SGLang (run `make test-sglang`, which uses its own venv)"
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker in ("gpu", "rocm", "vllm", "sglang"):
            if item.get_closest_marker(marker):
                reason = _skip_reason(marker)
                if reason:
                    item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory):
    """A tiny random Kimi-K3 checkpoint folder (config.json + model.safetensors)."""
    from rocm_mla.models.kimi_k3.loader import make_tiny  # only the tests that ask load it

    return make_tiny("kimi_k3", tmp_path_factory.mktemp("k3"), seed=3)
