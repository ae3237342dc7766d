"""Shared fixtures, and hardware markers that skip with a reason saying what is missing.

``@pytest.mark.gpu`` needs a CUDA/HIP device; its arguments name what else the test needs
on it (``GPU_NEEDS``): ``@pytest.mark.gpu("triton", "fp8")``. ``vllm`` and ``sglang`` need
the installed distribution, not only something importable under that name (a GPU device
bundle puts a stub ``vllm`` package on the path for FlashMLA's extension).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# With no GPU, Triton kernels can only run in the interpreter, which must be switched on
# before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _installed(dist: str) -> bool:
    from rocm_mla.platform import package_version

    return importlib.util.find_spec(dist) is not None and package_version(dist) is not None


def _triton_reason() -> str | None:
    from rocm_mla.backends import available_backends

    reason = available_backends().get("triton", "not registered")
    return None if reason is None else f"needs the Triton backend on this GPU: {reason}"


def _fp8_reason() -> str | None:
    from rocm_mla.backends.triton import TritonMLAImpl

    if any(d.itemsize == 1 for d in TritonMLAImpl.capabilities.kv_dtypes):
        return None
    return "needs a GPU whose Triton target converts fp8 (sm89+, gfx942, gfx950)"


#: What a ``gpu`` marker's arguments may name, and why a machine lacks it (None: it has it).
GPU_NEEDS = {"triton": _triton_reason, "fp8": _fp8_reason}


def _skip_reason(marker: str, needs: tuple[str, ...] = ()) -> str | None:
    if marker == "gpu":
        if not torch.cuda.is_available():
            return "needs a GPU: torch sees no CUDA/HIP device"
        unknown = [n for n in needs if n not in GPU_NEEDS]
        if unknown:
            raise ValueError(f"pytest.mark.gpu{needs}: unknown {unknown}; known: {list(GPU_NEEDS)}")
        return next(filter(None, (GPU_NEEDS[n]() for n in needs)), None)
    if marker == "rocm":
        if not torch.version.hip:
            return "needs a ROCm (HIP) build of torch"
        if not torch.cuda.is_available():
            return "needs a visible AMD GPU"
    if marker == "vllm" and not _installed("vllm"):
        return "needs vLLM installed (run `make test-vllm`, which uses its own venv)"
    if marker == "sglang" and not _installed("sglang"):
        return "needs SGLang installed (run `make test-sglang`, which uses its own venv)"
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker in ("gpu", "rocm", "vllm", "sglang"):
            mark = item.get_closest_marker(marker)
            if mark:
                reason = _skip_reason(marker, mark.args)
                if reason:
                    item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory):
    """A tiny random Kimi-K3 checkpoint folder (config.json + model.safetensors)."""
    from rocm_mla.models.kimi_k3.loader import make_tiny  # only the tests that ask load it

    return make_tiny("kimi_k3", tmp_path_factory.mktemp("k3"), seed=3)
