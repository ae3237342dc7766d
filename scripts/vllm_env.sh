#!/usr/bin/env bash
# Create (or refresh) the separate venv the `vllm` tests run in, and print its path.
#
# vLLM pins its own torch, so it never goes into the main .venv. The venv lives outside the
# clone, keyed by the vLLM version, so repeated CI runs reuse the ~8.6 GB install; a fresh
# machine builds it in about five minutes. This package is installed into it editable with
# --no-deps on every call (the clone may have moved since the last run), so the tests see the
# working tree.
#
# Environment:
#   VLLM_VERSION    vLLM release to test against (default 0.33.0)
#   VLLM_VENV       venv path (default $XDG_CACHE_HOME/rocm-mla/vllm-$VLLM_VERSION-venv)
#   PYTHON          interpreter that creates the venv (default python3)
set -euo pipefail

VLLM_VERSION="${VLLM_VERSION:-0.33.0}"
CACHE_ROOT="${XDG_CACHE_HOME:-$HOME/.cache}/rocm-mla"
VLLM_VENV="${VLLM_VENV:-$CACHE_ROOT/vllm-$VLLM_VERSION-venv}"
PYTHON="${PYTHON:-python3}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Written last, only after vLLM installed completely: an interrupted install is redone.
STAMP="$VLLM_VENV/.vllm-$VLLM_VERSION-installed"

if [ ! -f "$STAMP" ]; then
    echo "vllm_env: installing vllm==$VLLM_VERSION into $VLLM_VENV (about 5 minutes, ~8.6 GB)" >&2
    mkdir -p "$(dirname "$VLLM_VENV")"
    test -x "$VLLM_VENV/bin/python" || "$PYTHON" -m venv "$VLLM_VENV"
    "$VLLM_VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VLLM_VENV/bin/python" -m pip install --quiet "vllm==$VLLM_VERSION" "pytest>=8" "hypothesis>=6.100"
    touch "$STAMP"
fi
"$VLLM_VENV/bin/python" -m pip install --quiet --no-deps --force-reinstall -e "$REPO" >&2
echo "$VLLM_VENV"
