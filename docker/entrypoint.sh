#!/usr/bin/env bash
# Image entrypoint: print `rocm-mla info`, then `exec vllm serve` with the parallel sizes.
#
#   entrypoint.sh [MODEL] [--tensor-parallel-size N] [--pipeline-parallel-size N]
#                 [--decode-context-parallel-size N] [--host H] [--port P] [VLLM SERVE ARGS...]
#   entrypoint.sh --healthcheck      (the image's HEALTHCHECK: GET /health on ROCM_MLA_PORT)
#
# Every value also comes from the environment, so `docker run -e ...` needs no arguments;
# an argument beats its variable:
#   ROCM_MLA_MODEL   model path or name (first argument, or --model)
#   ROCM_MLA_TP      --tensor-parallel-size / -tp          (default 1)
#   ROCM_MLA_PP      --pipeline-parallel-size / -pp        (default 1)
#   ROCM_MLA_DCP     --decode-context-parallel-size / -dcp (default 1)
#   ROCM_MLA_HOST    --host (default 0.0.0.0)
#   ROCM_MLA_PORT    --port (default 8000; the healthcheck reads only this variable)
# Anything else is passed to `vllm serve` unchanged, after the arguments above.
set -euo pipefail

die() {
	echo "entrypoint: $*" >&2
	exit 2
}

healthcheck() {
	# python3 rather than curl: the vLLM ROCm base image always has python3, not always curl.
	local url="http://127.0.0.1:${ROCM_MLA_PORT:-8000}/health"
	python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' "$url"
}

if [[ "${1:-}" == "--healthcheck" ]]; then
	healthcheck
	exit
fi

model="${ROCM_MLA_MODEL:-}"
tp="${ROCM_MLA_TP:-1}"
pp="${ROCM_MLA_PP:-1}"
dcp="${ROCM_MLA_DCP:-1}"
host="${ROCM_MLA_HOST:-0.0.0.0}"
port="${ROCM_MLA_PORT:-8000}"
passthrough=()

# Like `vllm serve MODEL ...`: only the first argument may be the model, because any later
# bare word is the value of a flag this script does not know.
if [[ $# -gt 0 && "$1" != -* ]]; then
	model="$1"
	shift
fi

# value_of FLAG ARGS...: the value of a `--flag VALUE` pair; fails when it is missing.
value_of() {
	[[ $# -ge 2 && "$2" != --* ]] || die "$1 needs a value"
	printf '%s' "$2"
}

while [[ $# -gt 0 ]]; do
	case "$1" in
	--model) model="$(value_of "$@")"; shift 2 ;;
	--model=*) model="${1#*=}"; shift ;;
	-tp | --tensor-parallel-size) tp="$(value_of "$@")"; shift 2 ;;
	--tensor-parallel-size=*) tp="${1#*=}"; shift ;;
	-pp | --pipeline-parallel-size) pp="$(value_of "$@")"; shift 2 ;;
	--pipeline-parallel-size=*) pp="${1#*=}"; shift ;;
	-dcp | --decode-context-parallel-size) dcp="$(value_of "$@")"; shift 2 ;;
	--decode-context-parallel-size=*) dcp="${1#*=}"; shift ;;
	--host) host="$(value_of "$@")"; shift 2 ;;
	--host=*) host="${1#*=}"; shift ;;
	--port) port="$(value_of "$@")"; shift 2 ;;
	--port=*) port="${1#*=}"; shift ;;
	*) passthrough+=("$1"); shift ;;
	esac
done

[[ -n "$model" ]] || die "no model: pass it as the first argument (or --model), or set ROCM_MLA_MODEL"
for pair in "tensor-parallel-size=$tp" "pipeline-parallel-size=$pp" \
	"decode-context-parallel-size=$dcp" "port=$port"; do
	[[ "${pair#*=}" =~ ^[1-9][0-9]*$ ]] || die "--${pair%%=*} must be a positive integer, got '${pair#*=}'"
done
# DCP shards the KV cache across the ranks of a tensor-parallel group, so it must divide TP.
((tp % dcp == 0)) || die "--decode-context-parallel-size ($dcp) must divide --tensor-parallel-size ($tp)"

# vLLM syncs HIP and CUDA visibility at import and raises when they disagree; say so up front.
if [[ -n "${HIP_VISIBLE_DEVICES:-}" && -n "${CUDA_VISIBLE_DEVICES:-}" &&
	"$HIP_VISIBLE_DEVICES" != "$CUDA_VISIBLE_DEVICES" ]]; then
	die "HIP_VISIBLE_DEVICES=$HIP_VISIBLE_DEVICES and CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES differ; set only HIP_VISIBLE_DEVICES"
fi
# The ROCm tuning guide recommends 112 RCCL channels for tensor-parallel all-reduce on MI300X.
if ((tp > 1)); then
	export NCCL_MIN_NCHANNELS="${NCCL_MIN_NCHANNELS:-112}"
fi

echo "entrypoint: rocm-mla info (ROCM_MLA_BACKEND=${ROCM_MLA_BACKEND:-unset})"
rocm-mla info || die "'rocm-mla info' failed: the rocm-mla install in this image is broken"

echo "entrypoint: vllm serve $model tp=$tp pp=$pp dcp=$dcp on $host:$port"
exec vllm serve "$model" \
	--host "$host" \
	--port "$port" \
	--tensor-parallel-size "$tp" \
	--pipeline-parallel-size "$pp" \
	--decode-context-parallel-size "$dcp" \
	${passthrough[@]+"${passthrough[@]}"}
