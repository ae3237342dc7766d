#!/usr/bin/env bash
# Run the rocm-mla image on an MI300X (gfx942) host with the ROCm device flags.
#
#   docker/run-mi300x.sh [ENTRYPOINT ARGS...]   serve: args go to docker/entrypoint.sh
#   docker/run-mi300x.sh smoke                  run docker/smoke.sh, results in RESULTS_DIR
#
# Environment (defaults in brackets):
#   IMAGE                image to run [rocm-mla:latest]
#   RUN_NAME             container name [rocm-mla-serve, or rocm-mla-smoke]
#   HIP_VISIBLE_DEVICES  GPUs the container may use [0]; 0,1,...,7 for TP=8
#   MODEL_DIR            host folder mounted read-only at /models [none]
#   HF_CACHE_DIR         host Hugging Face cache mounted at /cache/huggingface [none]
#   RESULTS_DIR          host folder mounted at /results [./results in smoke mode, else none]
#   PORT                 host port published to the server's ROCM_MLA_PORT [8000]
#   SHM_SIZE             shared memory for RCCL and worker processes [16G]
#   KFD_DEVICE           the ROCm compute device node [/dev/kfd]
#   DRI_DEVICE           the GPU render nodes [/dev/dri]
#   VIDEO_GID, RENDER_GID  groups owning those nodes [looked up on the host]
#   RUN_USER             uid:gid to run as instead of root, e.g. "$(id -u):$(id -g)" [root]
#   DRY_RUN=1            print the docker command instead of running it
# Other ROCM_MLA_* variables set here (ROCM_MLA_BACKEND, ROCM_MLA_TP, ...) are passed through.
set -euo pipefail

die() {
	echo "run-mi300x: $*" >&2
	exit 1
}

kfd="${KFD_DEVICE:-/dev/kfd}"
dri="${DRI_DEVICE:-/dev/dri}"
[[ -e "$kfd" ]] || die "$kfd not found: this host has no ROCm kernel driver (amdgpu/KFD) loaded, so the container could not reach a GPU. Run on a ROCm host with an MI300X, or set KFD_DEVICE if the node lives elsewhere."
[[ -e "$dri" ]] || die "$dri not found: the GPU render nodes are missing. Check that the amdgpu driver is loaded, or set DRI_DEVICE."

mode=serve
if [[ "${1:-}" == "smoke" ]]; then
	mode=smoke
	shift
fi

image="${IMAGE:-rocm-mla:latest}"
name="${RUN_NAME:-rocm-mla-$mode}"

# The device nodes belong to the host's video and render groups; the container user joins
# them by number, because the image's /etc/group need not have the same names.
gid_of() {
	getent group "$1" | cut -d: -f3
}
video_gid="${VIDEO_GID:-$(gid_of video || true)}"
render_gid="${RENDER_GID:-$(gid_of render || true)}"
[[ -n "$video_gid$render_gid" ]] || die "neither a video nor a render group exists on this host; set VIDEO_GID or RENDER_GID to the group that owns $kfd"

cmd=(docker run --rm --name "$name"
	--device "$kfd" --device "$dri"
	--ipc=host --shm-size "${SHM_SIZE:-16G}"
	--cap-add SYS_PTRACE --security-opt seccomp=unconfined
	-e "HIP_VISIBLE_DEVICES=${HIP_VISIBLE_DEVICES:-0}")
[[ -z "$video_gid" ]] || cmd+=(--group-add "$video_gid")
[[ -z "$render_gid" ]] || cmd+=(--group-add "$render_gid")

while IFS='=' read -r var _; do
	cmd+=(-e "$var")
done < <(env | grep -E '^ROCM_MLA_[A-Z_]*=' || true)
# A uid with no passwd entry in the image has HOME=/ and no user name (torch's caches ask
# for one), so give it both; the image keeps every cache under the world-writable /cache.
[[ -z "${RUN_USER:-}" ]] || cmd+=(--user "$RUN_USER" -e HOME=/cache -e USER=rocm-mla)
[[ -z "${HF_TOKEN:-}" ]] || cmd+=(-e HF_TOKEN)
[[ -z "${MODEL_DIR:-}" ]] || cmd+=(-v "$MODEL_DIR:/models:ro")
[[ -z "${HF_CACHE_DIR:-}" ]] || cmd+=(-v "$HF_CACHE_DIR:/cache/huggingface")

if [[ "$mode" == smoke ]]; then
	results="${RESULTS_DIR:-$PWD/results}"
	[[ -n "${DRY_RUN:-}" ]] || mkdir -p "$results"
	cmd+=(-v "$results:/results" -e RESULTS_DIR=/results
		--entrypoint /opt/rocm-mla/docker/smoke.sh "$image")
else
	[[ -z "${RESULTS_DIR:-}" ]] || cmd+=(-v "$RESULTS_DIR:/results")
	cmd+=(-p "${PORT:-8000}:${ROCM_MLA_PORT:-8000}" "$image")
fi
cmd+=("$@")

if [[ -n "${DRY_RUN:-}" ]]; then
	printf '%q ' "${cmd[@]}"
	echo
	exit 0
fi
command -v docker >/dev/null || die "docker is not installed or not on PATH"
exec "${cmd[@]}"
