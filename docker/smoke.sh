#!/usr/bin/env bash
# GPU smoke test, run inside the rocm-mla image on a ROCm host (docker/run-mi300x.sh smoke).
#
# Steps, in order; every step runs even after one fails, so the artifacts are as complete as
# possible, and the script exits 1 when any step failed:
#   info          rocm-mla info (and --json into info.json)
#   aiter_shapes  the AITER the image ships (recorded in /opt/aiter-release.txt at build) serves
#                 every decode shape the image is for: `rocm-mla info --require-aiter` fails
#                 the step naming each shape it would refuse and why
#   pytest_gpu    the tests marked rocm or gpu, junit XML into junit-gpu.xml
#   bench_kernel  the kernel roofline benchmark, JSON + PNG into bench/
#   make_tiny     a tiny checkpoint from `rocm-mla make-tiny` (or the given SMOKE_MODEL)
#   serve_aiter   vllm serve of it (through docker/entrypoint.sh) with ROCM_MLA_BACKEND=aiter,
#                 one greedy completion over HTTP into completion-aiter.json
#   serve_triton  the same with ROCM_MLA_BACKEND=triton
#   compare       the two completions agree on their first SMOKE_MATCH_TOKENS tokens
# (serve_* and compare are named after SMOKE_BACKENDS: aiter and triton unless set.)
#
# Environment (defaults in brackets):
#   RESULTS_DIR           where everything is written [/results]; logs/ holds one log per step
#   SMOKE_TINY_ARCH       architecture for make-tiny [kimi_linear]
#   SMOKE_PORT            port of the short-lived servers [8123]
#   SMOKE_SERVER_TIMEOUT  seconds to wait for /health [900]
#   SMOKE_MAX_TOKENS      tokens generated per completion [16]
#   SMOKE_MATCH_TOKENS    leading tokens the two backends must agree on [4]
#   SMOKE_GPU_MEMORY      --gpu-memory-utilization of the servers [0.3]
#   SMOKE_BACKENDS        the two ROCM_MLA_BACKEND values served and compared [aiter triton]
#   SMOKE_AITER_SHAPES    the decode shapes aiter must serve, kind:heads:q_len[:lse] [MI300X
#                         serving: bf16 and fp8, 16 and 128 heads, S_q 1/2/4, and the bf16
#                         DCP decodes that read the LSE]
#   SMOKE_MODEL           serve this checkpoint instead of making one (make_tiny checks it)
#   SMOKE_SERVE_ARGS      more `vllm serve` arguments, split on whitespace (e.g. --dtype float32)
#   SMOKE_DRY_RUN=1       test mode: every step is a stub that succeeds, except the steps named
#                         in SMOKE_DRY_RUN_FAIL (comma-separated), which fail. Used only by
#                         tests/test_docker_ci.py to prove a failing step fails the script.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
results="${RESULTS_DIR:-/results}"
logs="$results/logs"
work="$results/work"
port="${SMOKE_PORT:-8123}"
server_pid=""

mkdir -p "$logs" "$work" || {
	echo "smoke: cannot create $logs and $work (is RESULTS_DIR=$results writable?)" >&2
	exit 1
}

step_info() {
	rocm-mla info && rocm-mla info --json >"$results/info.json"
}

# What the image serves on MI300X: plain decode of bf16 and fp8 (e4m3fnuz) caches at 16 heads
# (128-head models at TP8; fewer are padded to 16) and 128 heads (TP1), single tokens and
# speculative windows of 2 and 4, and under DCP (vLLM's -dcp) the bf16 decodes whose LSE the
# ranks combine by.
aiter_shapes="${SMOKE_AITER_SHAPES:-bf16:16:1,bf16:128:1,fp8:16:1,fp8:128:1,bf16:16:2,fp8:16:2,bf16:16:4,bf16:128:4,fp8:16:4,fp8:128:4,bf16:16:1:lse,bf16:128:1:lse}"

step_aiter_shapes() {
	echo "smoke: the image ships amd-aiter $(cat /opt/aiter-release.txt 2>/dev/null || echo '(release not recorded)')"
	rocm-mla info --require-aiter "$aiter_shapes"
}

step_pytest_gpu() {
	# From a scratch folder: the source tree may be read-only for a non-root container user,
	# and pytest/hypothesis write their caches into the working directory.
	(cd "$work" && python3 -m pytest "$repo/tests" -m "rocm or gpu" -p no:cacheprovider \
		--junitxml="$results/junit-gpu.xml" -q)
	local rc=$?
	# pytest exits 5 when it selects nothing: on a ROCm host that means the GPU tests vanished.
	((rc != 5)) || echo "smoke: no test is marked rocm or gpu; the GPU suite is missing"
	return "$rc"
}

step_bench_kernel() {
	(cd "$repo" && python3 -m benchmarks.kernel_roofline --out "$results/bench") || return 1
	compgen -G "$results/bench/*.json" >/dev/null || {
		echo "smoke: the benchmark wrote no JSON into $results/bench"
		return 1
	}
	compgen -G "$results/bench/*.png" >/dev/null || {
		echo "smoke: the benchmark wrote no PNG into $results/bench"
		return 1
	}
}

tiny="${SMOKE_MODEL:-$work/tiny}"
read -r -a backends <<<"${SMOKE_BACKENDS:-aiter triton}"
((${#backends[@]} == 2)) || {
	echo "smoke: SMOKE_BACKENDS must name two backends, got '${SMOKE_BACKENDS:-}'" >&2
	exit 1
}
read -r -a serve_args <<<"${SMOKE_SERVE_ARGS:-}"

step_make_tiny() {
	if [[ -n "${SMOKE_MODEL:-}" ]]; then
		[[ -f "$tiny/config.json" ]] || echo "smoke: SMOKE_MODEL=$tiny has no config.json"
		[[ -f "$tiny/config.json" ]]
		return
	fi
	rm -rf "$tiny"
	rocm-mla make-tiny --arch "${SMOKE_TINY_ARCH:-kimi_linear}" --out "$tiny" &&
		[[ -f "$tiny/config.json" ]]
}

stop_server() {
	[[ -n "$server_pid" ]] || return 0
	# The server runs in its own session (setsid), so this reaches vLLM's engine and worker
	# processes too, not only the API server.
	kill -TERM -- "-$server_pid" 2>/dev/null
	local waited=0
	while kill -0 "$server_pid" 2>/dev/null && ((waited < 60)); do
		sleep 1
		waited=$((waited + 1))
	done
	kill -KILL -- "-$server_pid" 2>/dev/null
	wait "$server_pid" 2>/dev/null
	server_pid=""
}
trap stop_server EXIT

# serve_and_complete BACKEND: serve the tiny checkpoint with ROCM_MLA_BACKEND=BACKEND and
# write one greedy completion to completion-BACKEND.json.
serve_and_complete() {
	local backend="$1"
	local log="$logs/server-$backend.log" out="$results/completion-$backend.json"
	[[ -f "$tiny/config.json" ]] || {
		echo "smoke: no tiny checkpoint at $tiny (make_tiny failed)"
		return 1
	}
	local args=(--served-model-name tiny --max-model-len 512 --enforce-eager
		--gpu-memory-utilization "${SMOKE_GPU_MEMORY:-0.3}" ${serve_args[@]+"${serve_args[@]}"})
	# The prompt is token ids, so a checkpoint without tokenizer files can still be served.
	compgen -G "$tiny/tokenizer*" >/dev/null || args+=(--skip-tokenizer-init)

	ROCM_MLA_BACKEND="$backend" ROCM_MLA_PORT="$port" \
		setsid "$here/entrypoint.sh" "$tiny" "${args[@]}" >"$log" 2>&1 &
	server_pid=$!
	echo "smoke: vllm serve (ROCM_MLA_BACKEND=$backend) pid $server_pid, log $log"

	local deadline=$((SECONDS + ${SMOKE_SERVER_TIMEOUT:-900}))
	until ROCM_MLA_PORT="$port" "$here/entrypoint.sh" --healthcheck 2>/dev/null; do
		if ! kill -0 "$server_pid" 2>/dev/null; then
			echo "smoke: the server exited before it became healthy; last lines of $log:"
			tail -n 40 "$log"
			server_pid=""
			return 1
		fi
		if ((SECONDS > deadline)); then
			echo "smoke: the server was not healthy after ${SMOKE_SERVER_TIMEOUT:-900} s"
			stop_server
			return 1
		fi
		sleep 5
	done

	python3 - "$port" "$out" "${SMOKE_MAX_TOKENS:-16}" <<'PY'
import json
import sys
import urllib.request

port, out, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
# Greedy, fixed length (ignore_eos), token ids back (return_token_ids): two backends can then
# be compared token by token without a tokenizer.
body = {
    "model": "tiny",
    "prompt": [1, 2, 3, 4, 5, 6, 7, 8],
    "max_tokens": max_tokens,
    "temperature": 0.0,
    "ignore_eos": True,
    "return_token_ids": True,
}
request = urllib.request.Request(
    f"http://127.0.0.1:{port}/v1/completions",
    data=json.dumps(body).encode(),
    headers={"Content-Type": "application/json"},
)
with urllib.request.urlopen(request, timeout=300) as response:
    payload = json.load(response)
with open(out, "w") as f:
    json.dump(payload, f, indent=2)
token_ids = payload["choices"][0].get("token_ids")
if not token_ids:
    sys.exit(f"smoke: the completion has no token_ids: {payload['choices'][0]}")
print(f"smoke: completion token ids {token_ids}")
PY
	local rc=$?
	stop_server
	return "$rc"
}

step_compare() {
	python3 - "$results/completion-${backends[0]}.json" "$results/completion-${backends[1]}.json" \
		"${SMOKE_MATCH_TOKENS:-4}" "${backends[@]}" <<'PY'
import json
import sys

paths, need, names = sys.argv[1:3], int(sys.argv[3]), sys.argv[4:6]
ids = []
for path in paths:
    try:
        with open(path) as f:
            ids.append(json.load(f)["choices"][0]["token_ids"])
    except (OSError, KeyError, IndexError, ValueError) as err:
        sys.exit(f"smoke: no completion to compare in {path}: {err}")
first, second = ids
same = 0
for a, b in zip(first, second):
    if a != b:
        break
    same += 1
for name, token_ids in zip(names, ids):
    print(f"smoke: {name:<6} {token_ids}")
print(f"smoke: the backends agree on the first {same} of {len(first)} tokens")
# A random tiny model has nearly flat logits, so rounding differences between two correct
# kernels may flip a late greedy choice; the first tokens must still agree.
if same < need:
    sys.exit(
        f"smoke: {names[0]} and {names[1]} diverge at token {same}; expected at least {need} equal"
    )
PY
}

steps=(info aiter_shapes pytest_gpu bench_kernel make_tiny "serve_${backends[0]}" "serve_${backends[1]}" compare)
failed=()

for name in "${steps[@]}"; do
	echo "== smoke step $name"
	start=$SECONDS
	if [[ -n "${SMOKE_DRY_RUN:-}" ]]; then
		echo "stub for step $name" >"$logs/$name.log"
		[[ ",${SMOKE_DRY_RUN_FAIL:-}," != *",$name,"* ]]
	else
		# Not a pipeline: the step must run in this shell, so that the EXIT trap sees the
		# server it may have started.
		if [[ "$name" == serve_* ]]; then
			serve_and_complete "${name#serve_}"
		else
			"step_$name"
		fi > >(tee "$logs/$name.log") 2>&1
	fi
	rc=$?
	if ((rc == 0)); then
		echo "== smoke step $name: ok ($((SECONDS - start)) s)"
	else
		echo "== smoke step $name: FAILED ($((SECONDS - start)) s, log $logs/$name.log)"
		failed+=("$name")
	fi
done

if ((${#failed[@]})); then
	echo "smoke: FAILED steps: ${failed[*]}"
	exit 1
fi
echo "smoke: all ${#steps[@]} steps passed"
