#!/usr/bin/env bash
# Create (or refresh) the separate venv the `sglang` tests run in, and print its path.
#
# SGLang's wheel pins a CUDA torch and CUDA kernel packages (sgl-kernel, flashinfer...) that
# have no CPU build, so it is installed with --no-deps next to the CPU torch, plus the
# pure-Python packages that importing its attention registry, model runner, DeepSeek model
# and MLA test kit needs (found by importing them, SGLang 0.5.23), and triton (the
# interpreter runs SGLang's Triton MLA backend and ours on the CPU). The versions SGLang
# pins are kept where it pins them.
#
# torchvision: SGLang imports it at module level on every model's path and its wheels for
# this torch are CUDA builds, which fail to import here. The venv gets a stand-in instead
# (scripts/sglang_standins/torchvision.py, copied into site-packages): its names resolve,
# and using one raises. Text models never use it.
#
# The venv lives outside the clone, keyed by the SGLang version, so repeated runs reuse it
# (cold build about 2 minutes, ~2.5 GB). This package is installed into it editable with
# --no-deps on every call, so the tests see the working tree and its sglang.srt.plugins
# entry point.
#
# Environment:
#   SGLANG_VERSION  SGLang release to test against (default 0.5.23)
#   SGLANG_VENV     venv path (default $XDG_CACHE_HOME/rocm-mla/sglang-$SGLANG_VERSION-venv)
#   TORCH           torch spec (default torch==2.13.0, the CPU build)
#   PYTHON          interpreter that creates the venv (default python3)
set -euo pipefail

SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
CACHE_ROOT="${XDG_CACHE_HOME:-$HOME/.cache}/rocm-mla"
SGLANG_VENV="${SGLANG_VENV:-$CACHE_ROOT/sglang-$SGLANG_VERSION-venv}"
TORCH="${TORCH:-torch==2.13.0}"
PYTHON="${PYTHON:-python3}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Written last, only once the imports the tests need work: an interrupted install is redone.
STAMP="$SGLANG_VENV/.sglang-$SGLANG_VERSION-installed"
PY="$SGLANG_VENV/bin/python"

if [ ! -f "$STAMP" ]; then
    echo "sglang_env: installing sglang==$SGLANG_VERSION (--no-deps) into $SGLANG_VENV" >&2
    mkdir -p "$(dirname "$SGLANG_VENV")"
    test -x "$PY" || "$PYTHON" -m venv "$SGLANG_VENV"
    "$PY" -m pip install --quiet --upgrade pip
    "$PY" -m pip install --quiet "$TORCH" triton "pytest>=8" "hypothesis>=6.100" numpy safetensors
    "$PY" -m pip install --quiet --no-deps "sglang==$SGLANG_VERSION"
    # What importing sglang.srt.layers.attention, model_runner, models.deepseek_v2 and the
    # MLA test kit needs; the pins are SGLang 0.5.23's own.
    "$PY" -m pip install --quiet "transformers==5.19.0" "compressed-tensors==0.18.0" \
        "apache-tvm-ffi==0.1.11" "openai==2.8.0" "sentencepiece==0.2.1" \
        orjson psutil pybase64 requests pillow starlette msgspec pydantic pyzmq tqdm \
        IPython aiohttp dill gguf partial_json_parser uvicorn fastapi einops
    site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    mkdir -p "$site/torchvision"
    cp "$REPO/scripts/sglang_standins/torchvision.py" "$site/torchvision/__init__.py"
    "$PY" -c "import torch; assert not torch.version.cuda, 'the SGLang test venv needs the CPU torch'" >&2
    "$PY" -c "import sglang.srt.layers.attention.attention_registry, \
sglang.srt.model_executor.model_runner, sglang.srt.models.deepseek_v2, \
sglang.test.kits.attention_unittest.attention_methods.mla_attention, triton" >&2
    touch "$STAMP"
fi
"$PY" -m pip install --quiet --no-deps --force-reinstall -e "$REPO" >&2
echo "$SGLANG_VENV"
