#!/usr/bin/env bash
# Every check that needs a GPU, in order of value, for a session with a short GPU lease:
#   1. make bench-gpu's script (call overhead, graph replay, engine vs transformers, profile)
#   2. the kernel roofline with peers (vLLM's Triton MLA, FlashMLA, AITER when importable)
#   3. the gpu-marked tests, then the whole suite (minus vllm/rocm marks)
# Results (JSON, PNG, junit XML, logs) land in $OUT (default benchmarks/results).
#
# Works on a machine with a GPU torch but no network: when the package is not installed, the
# source tree goes on PYTHONPATH.
#
#   OUT=/tmp/out bash scripts/gpu_check.sh            # all of it
#   GPU_CHECK_SKIP_E2E=1 bash scripts/gpu_check.sh    # kernel parts only (about 2 minutes)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
PYTHON="${PYTHON:-python3}"
status=0

if ! "$PYTHON" -c "import rocm_mla.kernels.mla_decode" 2>/dev/null; then
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no GPU'; print(torch.cuda.get_device_name())" \
    || { echo "gpu_check: torch sees no GPU" >&2; exit 2; }

run() {
    local name="$1"
    shift
    echo "== $name: $*"
    if ! "$@" 2>&1 | tee "$OUT/$name.log"; then
        echo "gpu_check: $name failed" >&2
        status=1
    fi
}

e2e_flags=()
if [ -n "${GPU_CHECK_SKIP_E2E:-}" ]; then
    e2e_flags=(--skip-e2e)
fi
run bench-gpu "$PYTHON" -m benchmarks.gpu "${e2e_flags[@]}"
run kernel-roofline "$PYTHON" -m benchmarks.kernel_roofline --gpu
run schedule-gpu "$PYTHON" -m benchmarks.schedule_gpu
run pytest-gpu "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider --junitxml "$OUT/pytest-gpu.xml"
run pytest-all "$PYTHON" -m pytest -q -m "not vllm and not rocm" -p no:cacheprovider \
    --junitxml "$OUT/pytest-all.xml"
cp benchmarks/results/*.json benchmarks/results/*.png benchmarks/results/*.txt "$OUT/" 2>/dev/null
exit "$status"
