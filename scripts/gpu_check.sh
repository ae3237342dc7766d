#!/usr/bin/env bash
# The GPU suite in one call, for a session with one short device lease (issue 36, item 5).
# In this order, each step under its own time limit (seconds; all set by the environment):
#   1. the gpu-marked tests (4 xdist workers when present)        GPU_CHECK_TESTS_S (120)
#   2. the benchmarks                                             GPU_CHECK_BENCH_S (200)
#      kernel_roofline --gpu (issue 37's ratio table, peers beside), benchmarks.gpu
#      --skip-e2e (one-shot vs planned, graph replay, the device planner alone),
#      schedule_gpu (the cost model's calibration rows, then GPU_CHECK_MIXES)
#   (--ncu) Nsight Compute on our stage-1 kernel and FlashMLA's at GPU_CHECK_NCU_CASES
#                                                                 GPU_CHECK_NCU_S (90)
#   (--tune) benchmarks.autotune_triton --focused on issue 37's weak shapes, candidates
#      compiled side by side first; the measured table (triton-tuned-*.json) goes into
#      the tarball, written after each shape                      GPU_CHECK_TUNE_S (150)
#   3. the whole suite (the gpu tests ran in 1), with what is left of GPU_CHECK_BUDGET_S
#      (420 in all); skipped, with a line saying so, when less than GPU_CHECK_SUITE_MIN_S
#      (60) is left.
# A step that hits its limit is interrupted (SIGINT: pytest still writes its report) and
# the next one starts; the benchmarks also stop themselves early (--budget-s) so that they
# write what they measured.
#
# $OUT (default benchmarks/results/gpu-check) gets four files, whatever happens after the
# first step: summary.txt (the summary, also printed last), gpu-check.tar.gz (every JSON,
# PNG, log and junit XML, and the ncu report), and the ratio table's kernel-roofline-*.json
# and .png. The tarball is rewritten after every step, so a call cut short keeps the steps
# before. A device call brings back at most 8 files from $OUT: keep it to these.
#
# With the device bundle (Triton 3.8.0, FlashMLA and vLLM's Triton MLA as peers):
#   source .gpu-bundle/env.sh && bash scripts/gpu_check.sh [--ncu] [--no-suite]
# Without a GPU it says so and exits 2 having run nothing; --dry-run runs the same steps on
# the CPU instead (the gpu tests skip, the benchmarks' --dry-run variants, the suite only
# collected), to check the plumbing.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2

usage="usage: bash scripts/gpu_check.sh [--ncu] [--tune] [--no-suite] [--dry-run]"
ncu=0 tune=0 suite=1 dry=0
for arg in "$@"; do
	case "$arg" in
	--ncu) ncu=1 ;;
	--tune) tune=1 ;;
	--no-suite) suite=0 ;;
	--dry-run) dry=1 ;;
	-h | --help)
		echo "$usage"
		exit 0
		;;
	*)
		echo "gpu_check: unknown argument '$arg'; $usage" >&2
		exit 2
		;;
	esac
done

PYTHON="${PYTHON:-python3}"
OUT="${OUT:-benchmarks/results/gpu-check}"
budget=${GPU_CHECK_BUDGET_S:-420}
tests_s=${GPU_CHECK_TESTS_S:-120}
bench_s=${GPU_CHECK_BENCH_S:-200}
ncu_s=${GPU_CHECK_NCU_S:-90}
tune_s=${GPU_CHECK_TUNE_S:-150}
tune_shapes=${GPU_CHECK_TUNE_SHAPES:-128,1,bf16,64,8192 128,2,bf16,64,8192 16,4,bf16,32,16384 16,1,bf16,64,8192 16,1,fp8,128,16384 128,1,fp8,64,8192}
suite_min=${GPU_CHECK_SUITE_MIN_S:-60}
mixes=${GPU_CHECK_MIXES:-uniform 8x32K,batch of 1 (32K)}
ncu_cases=${GPU_CHECK_NCU_CASES:-B64 ctx8K H128,B128 ctx16K H16 fp8}
for name in budget tests_s bench_s ncu_s tune_s suite_min; do
	[[ "${!name}" =~ ^[0-9]+$ ]] || {
		echo "gpu_check: the limit $name must be whole seconds, got '${!name}'" >&2
		exit 2
	}
done

# No network on a device machine: the source tree goes on PYTHONPATH when the package is
# not installed.
if ! "$PYTHON" -c "import rocm_mla" 2>/dev/null; then
	export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
if ! gpu=$("$PYTHON" -c "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else '')" 2>&1); then
	echo "gpu_check: $PYTHON cannot import torch: $gpu" >&2
	exit 2
fi
if [[ -z "$gpu" && $dry -eq 0 ]]; then
	echo "gpu_check: torch sees no GPU (CUDA_VISIBLE_DEVICES='${CUDA_VISIBLE_DEVICES-unset}'): nothing run; --dry-run runs the steps' plumbing on the CPU" >&2
	exit 2
fi
if [[ -n "$gpu" && $dry -eq 1 ]]; then
	echo "gpu_check: --dry-run is the CPU check of this script; this machine has a GPU ($gpu): run it without --dry-run" >&2
	exit 2
fi
if [[ -f .gpu-bundle/env.sh && "${PYTHONPATH:-}" != */tmp/gpu-bundle* ]]; then
	echo "gpu_check: .gpu-bundle is here but not sourced: the image's Triton compiles (source .gpu-bundle/env.sh first)" >&2
fi

mkdir -p "$OUT" || exit 2
work=$(mktemp -d)
mkdir -p "$work/results" "$work/logs"
steps="$work/steps.tsv"
: >"$steps"
start=$SECONDS
status=0
{
	echo "gpu_check $(date -u +%FT%TZ) on ${gpu:-the CPU (dry run)}, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
	"$PYTHON" -c "import json; from benchmarks.common import environment; print(json.dumps(environment(), indent=1))"
	command -v nvidia-smi >/dev/null && nvidia-smi
} >"$work/logs/environment.txt" 2>&1

# Everything of the run into the tarball, and the summary (printed last when called last).
pack() {
	"$PYTHON" - "$work" "$OUT" <<'PY' >"$OUT/summary.txt" 2>&1
import glob, importlib, json, os, sys
import xml.etree.ElementTree as ET

work, out = sys.argv[1], sys.argv[2]
lines = []


def section(title, module, render, pattern):
    found = sorted(glob.glob(os.path.join(work, "results", pattern)), key=os.path.getmtime)
    if not found:
        return
    try:
        payload = json.load(open(found[-1]))
        text = getattr(importlib.import_module(module), render)(payload)
    except Exception as exc:  # a partial payload must not hide the rest of the summary
        text = f"cannot render {os.path.basename(found[-1])}: {type(exc).__name__}: {exc}"
    lines.extend(["", f"== {title}", text])


section("kernel_roofline --gpu", "benchmarks.kernel_roofline", "table_text", "kernel-roofline-*.json")
section("benchmarks.gpu", "benchmarks.gpu", "summary_text", "gpu-*.json")
section("schedule_gpu", "benchmarks.schedule_gpu", "table_text", "schedule-gpu-*.json")
failed = []
counts = {}
for path in sorted(glob.glob(os.path.join(work, "junit-*.xml"))):
    name = os.path.basename(path)[6:-4]
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:
        counts[name] = f"unreadable junit ({exc})"
        continue
    suites = [root] if root.tag == "testsuite" else list(root)
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts[name] = (
        f"{total['tests']} tests: {total['tests'] - total['failures'] - total['errors'] - total['skipped']} "
        f"passed, {total['failures']} failed, {total['errors']} errors, {total['skipped']} skipped"
    )
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{name}: {case.get('classname')}::{case.get('name')}")
if failed:
    lines.extend(["", f"== failed tests ({len(failed)})", *failed[:30]])
lines.extend(["", "== gpu_check steps", f"{'step':<18} {'rc':>4} {'time':>10}  result"])
for row in open(os.path.join(work, "steps.tsv")):
    step, rc, secs, limit, note = row.rstrip("\n").split("\t")
    result = note if step not in counts else counts[step] + ("" if note == "ok" else f"; {note}")
    lines.append(f"{step:<18} {rc:>4} {secs:>4}/{limit:<4} s  {result}")
print("\n".join(lines))
PY
	cp "$OUT/summary.txt" "$work/summary.txt"
	tar -czf "$OUT/gpu-check.tar.gz" -C "$work" .
	for file in "$work"/results/kernel-roofline-*; do
		[[ -f "$file" ]] && cp "$file" "$OUT/"
	done
}

# step NAME LIMIT NOTE COMMAND...: run COMMAND under LIMIT seconds, its output in a log.
step() {
	local name=$1 limit=$2 note=$3 rc began
	shift 3
	began=$SECONDS
	echo "== $name (limit ${limit} s): $*"
	timeout -s INT -k 20 "$limit" "$@" >"$work/logs/$name.log" 2>&1
	rc=$?
	tail -n 5 "$work/logs/$name.log"
	case $rc in
	0) ;;
	124 | 130 | 137)
		note="stopped at its ${limit} s limit"
		status=1
		;;
	*)
		note="failed"
		status=1
		;;
	esac
	printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - began))" "$limit" "$note" >>"$steps"
	pack
}

left() { echo $((budget - (SECONDS - start))); }

pytest_args=(-p no:cacheprovider -q -rfEs)
if "$PYTHON" -c "import pytest_timeout" 2>/dev/null; then
	pytest_args+=(--timeout 150)
fi

# 1. the gpu tests, collected from the files that mark any (collecting the others could wait
# on a build this step does not need, such as the CPU decode kernel's).
# Their compiles dominate: xdist runs them side by side.
mapfile -t gpu_files < <(grep -l 'mark\.gpu' tests/test_*.py)
xdist=0
"$PYTHON" -c "import xdist" 2>/dev/null && xdist=1
gpu_args=("${pytest_args[@]}")
((xdist && !dry)) && gpu_args+=(-n 4)
step gpu-tests "$tests_s" "ok" "$PYTHON" -m pytest "${gpu_args[@]}" -m gpu \
	--junitxml "$work/junit-gpu-tests.xml" "${gpu_files[@]}"

# 2. the benchmarks: the ratio table gets the most (its shapes compile side by side first);
# each stops itself before its limit.
bench_end=$((SECONDS + bench_s))
mode=(--gpu) dry_flag=()
((dry)) && mode=(--dry-run) dry_flag=(--dry-run)
limit=$((bench_s - 70))
step kernel-roofline "$limit" "ok" "$PYTHON" -m benchmarks.kernel_roofline "${mode[@]}" \
	--budget-s $((limit - 30)) --out "$work/results"
limit=$((bench_end - SECONDS - 35))
((limit > 40)) && limit=40
if ((limit >= 10)); then
	step bench-gpu "$limit" "ok" "$PYTHON" -m benchmarks.gpu --skip-e2e "${dry_flag[@]}" \
		--out "$work/results"
fi
limit=$((bench_end - SECONDS))
if ((limit >= 15)); then
	step schedule-gpu "$limit" "ok" "$PYTHON" -m benchmarks.schedule_gpu \
		--mixes "$mixes" --no-fp8 --budget-s $((limit - 15)) --out "$work/results"
else
	printf 'schedule-gpu\t-\t0\t%s\tnot run: %s s left of the benchmarks\n' "$limit" "$limit" \
		>>"$steps"
fi

# The optional ncu pass: two kernels, two shapes, hardware counters (clocks left alone).
if ((ncu)); then
	if ! command -v ncu >/dev/null; then
		printf 'ncu\t-\t0\t%s\tnot run: no ncu on PATH\n' "$ncu_s" >>"$steps"
	elif ((dry)); then
		printf 'ncu\t-\t0\t%s\tnot run: --dry-run\n' "$ncu_s" >>"$steps"
	else
		step ncu "$ncu_s" "ok" ncu --clock-control none \
			--kernel-name "regex:_mla_decode_stage1|flash" --launch-count 8 \
			--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
			--section LaunchStats --section WarpStateStats --section SchedulerStats \
			--section ComputeWorkloadAnalysis --section SourceCounters \
			"$PYTHON" -m benchmarks.kernel_roofline --profile-once --cases "$ncu_cases"
	fi
fi

# The optional autotune of the weak shapes (--focused candidates, compiled side by side).
if ((tune)); then
	if ((dry)); then
		printf 'tune\t-\t0\t%s\tnot run: --dry-run\n' "$tune_s" >>"$steps"
	else
		shape_args=()
		for shape in $tune_shapes; do shape_args+=(--shape "$shape"); done
		step tune "$tune_s" "ok" "$PYTHON" -m benchmarks.autotune_triton --focused --jobs 12 \
			--rep-ms 60 "${shape_args[@]}" --out "$work/results/triton-tuned-sm90.json"
	fi
fi

# 3. the whole suite, in what is left; xdist spreads it over the cores when present.
limit=$(left)
if ((!suite)); then
	printf 'suite\t-\t0\t-\tnot run: --no-suite\n' >>"$steps"
elif ((limit < suite_min)); then
	printf 'suite\t-\t0\t%s\tnot run: %s s left of %s, under GPU_CHECK_SUITE_MIN_S=%s\n' \
		"$limit" "$limit" "$budget" "$suite_min" >>"$steps"
else
	suite_args=("${pytest_args[@]}" -m "not gpu and not vllm and not sglang and not rocm")
	((dry)) && suite_args+=(--collect-only)
	((xdist && !dry)) && suite_args+=(-n 8)
	step suite "$limit" "ok" "$PYTHON" -m pytest "${suite_args[@]}" \
		--junitxml "$work/junit-suite.xml" tests
fi

pack
rm -rf "$work"
cat "$OUT/summary.txt"
echo "gpu_check: $((SECONDS - start)) s; files in $OUT: $(find "$OUT" -maxdepth 1 -type f -printf '%f ')"
exit "$status"
