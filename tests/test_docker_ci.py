"""The MI300X image, its scripts and the CI workflows, checked on a machine without Docker or GPU.

The linters (scripts/lint-extra.sh) catch syntax and style; these tests check what they
cannot: the image never replaces the GPU stack, the entrypoint hands the parallel sizes to
`vllm serve`, the run script passes the ROCm device flags and refuses without /dev/kfd, the
smoke script fails when a step fails, and the GPU workflow is gated on the CPU one. Every
script runs for real, with stub `vllm`, `rocm-mla` and `docker` commands on PATH.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "lint"
VENV = Path(sys.prefix)
FORBIDDEN = {"torch", "triton", "pytorch-triton-rocm", "aiter", "amd-aiter", "vllm"}
SMOKE_STEPS = [
    "info",
    "aiter_shapes",
    "pytest_gpu",
    "bench_kernel",
    "make_tiny",
    "serve_aiter",
    "serve_triton",
    "compare",
]


def run(cmd: list[str], env: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
    """Run a command with `env` added to a minimal environment; capture text output."""
    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "LANG": "C.UTF-8"}
    return subprocess.run(
        cmd, env={**base, **(env or {})}, capture_output=True, text=True, timeout=60, **kw
    )


def write_stub(folder: Path, name: str, body: str) -> None:
    """An executable bash script `folder/name` running `body`."""
    path = folder / name
    path.write_text(f"#!/usr/bin/env bash\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def recording_stub(folder: Path, name: str, log: Path, rc: int = 0, then: str = "") -> None:
    """Stub `name` that appends one JSON line {cmd, args, env} to `log`, runs the bash `then`,
    then exits `rc`."""
    recorder = (
        "import json, os, sys; "
        f"open({str(log)!r}, 'a').write(json.dumps({{'cmd': {name!r}, 'args': sys.argv[1:], "
        "'env': {k: v for k, v in os.environ.items() if k.startswith(('ROCM_MLA', 'NCCL'))}})"
        " + '\\n')"
    )
    write_stub(
        folder,
        name,
        f'{shlex.quote(sys.executable)} -c {shlex.quote(recorder)} "$@"\n{then}\nexit {rc}',
    )


def recording_bin(tmp_path: Path, name: str, *commands: str) -> tuple[dict[str, str], Path]:
    """A folder `name` of recording stubs put first on PATH; returns (env, their shared log)."""
    bin_dir, log = tmp_path / name, tmp_path / f"{name}.jsonl"
    bin_dir.mkdir()
    for command in commands:
        recording_stub(bin_dir, command, log)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}, log


def calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


# --- lint: each linter passes on the real files and rejects its bad fixture -----------------


def lint_tree(tmp_path: Path) -> Path:
    """A copy of the files scripts/lint-extra.sh checks that this issue owns."""
    tree = tmp_path / "repo"
    for rel in ["docker", ".github", "scripts/lint-extra.sh"]:
        src, dst = ROOT / rel, tree / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, dst)
    return tree


def lint(tree: Path) -> subprocess.CompletedProcess:
    return run(["bash", str(tree / "scripts/lint-extra.sh")], env={"VENV": str(VENV)})


def test_lint_extra_passes_on_real_files(tmp_path):
    result = lint(lint_tree(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    for tool in ["hadolint", "shellcheck", "actionlint"]:
        assert f"lint-extra: {tool}" in result.stdout
    assert "entrypoint.sh" in result.stdout and "rocm.yml" in result.stdout


@pytest.mark.parametrize(
    ("fixture", "dest", "finding"),
    [
        ("bad.Dockerfile", "docker/bad.Dockerfile", "DL3007"),
        ("bad.sh", "bad.sh", "SC2086"),
        ("bad-workflow.yml", ".github/workflows/bad.yml", "untrusted"),
    ],
)
def test_lint_extra_rejects_bad_fixture(tmp_path, fixture, dest, finding):
    tree = lint_tree(tmp_path)
    shutil.copy2(FIXTURES / fixture, tree / dest)
    result = lint(tree)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert finding in out and Path(dest).name in out


# --- Dockerfile --------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with continuation lines joined and comments dropped."""
    lines = [ln for ln in (DOCKER / "Dockerfile").read_text().splitlines() if ln.strip()]
    joined, current = [], ""
    for line in lines:
        if line.lstrip().startswith("#"):
            continue
        current += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            joined.append(current.strip())
            current = ""
    return [(j.split(None, 1)[0].upper(), j.split(None, 1)[1]) for j in joined]


def pip_installs() -> list[list[str]]:
    """The argument list of every `pip install` in a RUN instruction."""
    installs = []
    for op, args in dockerfile_instructions():
        if op != "RUN":
            continue
        lexer = shlex.shlex(args, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        command: list[str] = []
        for token in [*lexer, ";"]:
            if token not in {"&&", "||", "|", ";"}:
                command.append(token)
                continue
            if "pip" in command[:3] and "install" in command:
                installs.append(command[command.index("install") + 1 :])
            command = []
    return installs


def test_dockerfile_base_image_is_pinned_vllm_rocm_release():
    args = [a for op, a in dockerfile_instructions() if op == "ARG" and a.startswith("BASE_IMAGE")]
    assert args, "no ARG BASE_IMAGE"
    image = args[0].split("=", 1)[1]
    assert re.fullmatch(r"vllm/vllm-openai-rocm:v0\.33\.\d+", image), image
    froms = [a for op, a in dockerfile_instructions() if op == "FROM"]
    assert froms[0].startswith("${BASE_IMAGE}")


def test_dockerfile_installs_package_with_no_deps_and_never_the_gpu_stack():
    installs = pip_installs()
    local = [words for words in installs if "." in words]
    assert local, "the package itself is never installed"
    for words in installs:
        options = [w for w in words if w.startswith("-")]
        requirements = [w for w in words if not w.startswith("-") and w != "."]
        if "." in words:
            assert "--no-deps" in options, words
        else:
            # Anything else installed must be held to the base image's GPU stack.
            assert "--constraint" in options or "-c" in options, words
            requirements = requirements[1:]  # the constraints file
        names = {re.split(r"[=<>!~\[ ]", r, maxsplit=1)[0].lower() for r in requirements}
        assert not names & FORBIDDEN, f"installs {names & FORBIDDEN}: {words}"
    text = (DOCKER / "Dockerfile").read_text()
    assert "apt-get" not in text and "conda" not in text


def test_dockerfile_environment_entrypoint_and_healthcheck():
    instructions = dockerfile_instructions()
    env = " ".join(a for op, a in instructions if op == "ENV")
    for setting in ["ROCM_MLA_BACKEND=auto", "VLLM_ROCM_USE_AITER=1", "HIP_FORCE_DEV_KERNARG=1"]:
        assert setting in env
    # The final stage is the default build target: it must be the serving one.
    last_stage = instructions[max(i for i, (op, _) in enumerate(instructions) if op == "FROM") :]
    ops = dict(last_stage)
    assert "entrypoint.sh" in ops["ENTRYPOINT"]
    assert "--healthcheck" in ops["HEALTHCHECK"] and "start-period" in ops["HEALTHCHECK"]
    # Nothing assumes root: caches live under a world-writable /cache, not $HOME.
    assert "HF_HOME=/cache/huggingface" in env
    assert "chmod 1777 /cache" in " ".join(a for op, a in instructions if op == "RUN")


def test_dockerfile_records_the_aiter_release_it_ships():
    runs = [a for op, a in dockerfile_instructions() if op == "RUN"]
    recording = [r for r in runs if "/opt/aiter-release.txt" in r]
    assert len(recording) == 1, "the runtime stage must write /opt/aiter-release.txt once"
    # From amd-aiter's metadata (importing AITER needs a GPU), before the package goes in.
    assert "m.version('amd-aiter')" in recording[0]
    assert recording[0].index("aiter-release.txt") < recording[0].index("--no-deps -e .")


def test_smoke_checks_the_aiter_shapes_the_image_is_for():
    text = (DOCKER / "smoke.sh").read_text()
    default = re.search(r'aiter_shapes="\$\{SMOKE_AITER_SHAPES:-([^}]*)\}"', text)
    assert default, "smoke.sh names no default SMOKE_AITER_SHAPES"
    shapes = default.group(1).split(",")
    for kind in ("bf16", "fp8"):
        for heads in ("16", "128"):
            assert f"{kind}:{heads}:1" in shapes
    assert any(s.endswith(":lse") for s in shapes), "DCP's LSE decodes are not checked"
    assert 'rocm-mla info --require-aiter "$aiter_shapes"' in text
    assert "/opt/aiter-release.txt" in text


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_entrypoint_healthcheck_hits_health_endpoint():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = str(server.server_address[1])
        ok = run(["bash", str(DOCKER / "entrypoint.sh"), "--healthcheck"], {"ROCM_MLA_PORT": port})
        assert ok.returncode == 0, ok.stderr
    finally:
        server.shutdown()
        server.server_close()
    down = run(["bash", str(DOCKER / "entrypoint.sh"), "--healthcheck"], {"ROCM_MLA_PORT": port})
    assert down.returncode != 0


# --- entrypoint ------------------------------------------------------------------------------


@pytest.fixture
def stubs(tmp_path):
    """A bin folder with recording `vllm` and `rocm-mla` stubs; returns (env, log)."""
    return recording_bin(tmp_path, "bin", "vllm", "rocm-mla")


def entrypoint(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return run(["bash", str(DOCKER / "entrypoint.sh"), *args], env)


def serve_flags(args: list[str]) -> dict[str, str]:
    assert args[0] == "serve"
    return {args[i]: args[i + 1] for i in range(2, 12, 2)}


def test_entrypoint_sizes_from_env(stubs):
    env, log = stubs
    sizes = {"ROCM_MLA_MODEL": "/models/k3", "ROCM_MLA_TP": "8", "ROCM_MLA_PP": "2"}
    result = entrypoint({**env, **sizes, "ROCM_MLA_DCP": "4"})
    assert result.returncode == 0, result.stderr
    info, serve = calls(log)
    assert (info["cmd"], info["args"]) == ("rocm-mla", ["info"])  # printed before serving
    assert serve["cmd"] == "vllm" and serve["args"][1] == "/models/k3"
    assert serve_flags(serve["args"]) == {
        "--host": "0.0.0.0",
        "--port": "8000",
        "--tensor-parallel-size": "8",
        "--pipeline-parallel-size": "2",
        "--decode-context-parallel-size": "4",
    }
    assert serve["args"][12:] == []
    assert serve["env"]["NCCL_MIN_NCHANNELS"] == "112"  # tensor parallel: RCCL tuning on


def test_entrypoint_arguments_beat_env_and_pass_the_rest(stubs):
    env, log = stubs
    result = entrypoint(
        {**env, "ROCM_MLA_TP": "8", "ROCM_MLA_MODEL": "/models/other", "ROCM_MLA_PORT": "9000"},
        "/models/tiny",
        "-tp",
        "4",
        "--pipeline-parallel-size=2",
        "--max-model-len",
        "4096",
        "-dcp",
        "2",
        "--enforce-eager",
    )
    assert result.returncode == 0, result.stderr
    serve = calls(log)[-1]["args"]
    assert serve[1] == "/models/tiny"
    assert serve_flags(serve) == {
        "--host": "0.0.0.0",
        "--port": "9000",
        "--tensor-parallel-size": "4",
        "--pipeline-parallel-size": "2",
        "--decode-context-parallel-size": "2",
    }
    assert serve[12:] == ["--max-model-len", "4096", "--enforce-eager"]


def test_entrypoint_single_gpu_leaves_rccl_alone(stubs):
    env, log = stubs
    assert entrypoint(env, "/models/tiny").returncode == 0
    serve = calls(log)[-1]
    assert serve_flags(serve["args"])["--tensor-parallel-size"] == "1"
    assert "NCCL_MIN_NCHANNELS" not in serve["env"]


@pytest.mark.parametrize(
    ("extra_env", "args", "message"),
    [
        ({}, ["--tensor-parallel-size", "2"], "no model"),
        ({}, ["/m", "-tp", "two"], "must be a positive integer, got 'two'"),
        ({}, ["/m", "-tp", "0"], "must be a positive integer, got '0'"),
        ({}, ["/m", "-tp", "4", "-dcp", "3"], "(3) must divide --tensor-parallel-size (4)"),
        ({}, ["/m", "--port"], "--port needs a value"),
        ({"HIP_VISIBLE_DEVICES": "0", "CUDA_VISIBLE_DEVICES": "1"}, ["/m"], "differ"),
    ],
)
def test_entrypoint_rejects_bad_input_before_serving(stubs, extra_env, args, message):
    env, log = stubs
    result = entrypoint({**env, **extra_env}, *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert not [c for c in calls(log) if c["cmd"] == "vllm"]


def test_entrypoint_stops_when_rocm_mla_info_fails(stubs, tmp_path):
    env, log = stubs
    recording_stub(tmp_path / "bin", "rocm-mla", log, rc=1)
    result = entrypoint(env, "/models/tiny")
    assert result.returncode == 2 and "rocm-mla info' failed" in result.stderr
    assert [c["cmd"] for c in calls(log)] == ["rocm-mla"]


# --- run-mi300x.sh ----------------------------------------------------------------------------


@pytest.fixture
def docker_stub(tmp_path):
    return recording_bin(tmp_path, "dbin", "docker")


@pytest.mark.parametrize(
    ("variable", "default"), [("KFD_DEVICE", "/dev/kfd"), ("DRI_DEVICE", "/dev/dri")]
)
def test_run_script_defaults_to_the_rocm_device_nodes(docker_stub, tmp_path, variable, default):
    """With the variable unset the script uses the host's node: it passes it to docker when
    the node exists (a ROCm host) and refuses naming it when it does not (this machine)."""
    env, log = docker_stub
    devices = device_env(tmp_path)
    del devices[variable]
    result = run(["bash", str(DOCKER / "run-mi300x.sh")], {**env, **devices, "DRY_RUN": "1"})
    if Path(default).exists():
        assert result.returncode == 0, result.stderr
        assert f"--device {default} " in result.stdout
    else:
        assert result.returncode == 1
        assert f"{default} not found" in result.stderr
    assert calls(log) == []  # a dry run never runs docker


def test_run_script_refuses_without_kfd(docker_stub, tmp_path):
    env, log = docker_stub
    missing = tmp_path / "no-kfd"
    result = run(["bash", str(DOCKER / "run-mi300x.sh")], {**env, "KFD_DEVICE": str(missing)})
    assert result.returncode == 1
    assert f"{missing} not found" in result.stderr and "ROCm" in result.stderr
    assert calls(log) == []  # docker never ran


def device_env(tmp_path: Path) -> dict[str, str]:
    kfd, dri = tmp_path / "kfd", tmp_path / "dri"
    kfd.touch()
    dri.mkdir()
    return {"KFD_DEVICE": str(kfd), "DRI_DEVICE": str(dri), "VIDEO_GID": "44", "RENDER_GID": "109"}


def test_run_script_passes_device_flags_to_docker(docker_stub, tmp_path):
    env, log = docker_stub
    devices = device_env(tmp_path)
    extra = {
        "HIP_VISIBLE_DEVICES": "0,1",
        "MODEL_DIR": "/data/models",
        "PORT": "9000",
        "ROCM_MLA_BACKEND": "triton",
        "ROCM_MLA_TP": "2",
    }
    result = run(
        ["bash", str(DOCKER / "run-mi300x.sh"), "/models/k3", "--max-model-len", "8192"],
        {**env, **devices, **extra},
    )
    assert result.returncode == 0, result.stderr
    (call,) = calls(log)
    args = call["args"]
    joined = " ".join(args)
    assert args[:2] == ["run", "--rm"]
    for flag in [
        f"--device {devices['KFD_DEVICE']}",
        f"--device {devices['DRI_DEVICE']}",
        "--group-add 44",
        "--group-add 109",
        "--ipc=host",
        "--shm-size 16G",
        "--security-opt seccomp=unconfined",
        "-e HIP_VISIBLE_DEVICES=0,1",
        "-e ROCM_MLA_BACKEND",
        "-e ROCM_MLA_TP",
        "-v /data/models:/models:ro",
        "-p 9000:8000",
    ]:
        assert flag in joined, flag
    assert args[-4:] == ["rocm-mla:latest", "/models/k3", "--max-model-len", "8192"]


def test_run_script_smoke_mode_and_dry_run(docker_stub, tmp_path):
    env, log = docker_stub
    results = tmp_path / "results"
    smoke_env = {
        **env,
        **device_env(tmp_path),
        "RESULTS_DIR": str(results),
        "IMAGE": "img:1",
        "RUN_USER": "1001:1001",
    }
    result = run(["bash", str(DOCKER / "run-mi300x.sh"), "smoke"], smoke_env)
    assert result.returncode == 0, result.stderr
    args = calls(log)[0]["args"]
    joined = " ".join(args)
    assert "--entrypoint /opt/rocm-mla/docker/smoke.sh img:1" in joined
    assert f"-v {results}:/results" in joined and results.is_dir()
    assert "--user 1001:1001 -e HOME=/cache" in joined
    # DRY_RUN prints the same command, shell-quoted, and runs nothing.
    dry = run(["bash", str(DOCKER / "run-mi300x.sh"), "smoke"], {**smoke_env, "DRY_RUN": "1"})
    assert dry.returncode == 0 and len(calls(log)) == 1
    assert shlex.split(dry.stdout) == ["docker", *args]


# --- smoke.sh -------------------------------------------------------------------------------


def smoke(tmp_path: Path, fail: str = "") -> subprocess.CompletedProcess:
    env = {"RESULTS_DIR": str(tmp_path / "results"), "SMOKE_DRY_RUN": "1"}
    return run(["bash", str(DOCKER / "smoke.sh")], {**env, "SMOKE_DRY_RUN_FAIL": fail})


def ran_steps(out: str) -> list[str]:
    return re.findall(r"^== smoke step (\w+)$", out, flags=re.M)


def test_smoke_runs_every_step_and_passes(tmp_path):
    result = smoke(tmp_path)
    assert result.returncode == 0, result.stdout
    assert ran_steps(result.stdout) == SMOKE_STEPS
    assert sorted(p.stem for p in (tmp_path / "results/logs").iterdir()) == sorted(SMOKE_STEPS)


@pytest.mark.parametrize("step", SMOKE_STEPS)
def test_smoke_fails_when_any_step_fails(tmp_path, step):
    result = smoke(tmp_path, fail=step)
    assert result.returncode == 1
    assert f"smoke: FAILED steps: {step}\n" in result.stdout
    assert ran_steps(result.stdout) == SMOKE_STEPS  # the later steps still ran


def test_smoke_reports_all_failed_steps(tmp_path):
    result = smoke(tmp_path, fail="info,compare")
    assert result.returncode == 1
    assert "smoke: FAILED steps: info compare" in result.stdout


# Stand-ins for the tools the real smoke steps call. `python3 -m ...` (pytest, the benchmark)
# writes what the step checks for; any other python3 call (the completion and compare
# scripts, the entrypoint's healthcheck) runs the real interpreter.
FAKE_PYTHON3 = """
if [[ "$1" == -m ]]; then
    for arg in "$@"; do [[ "$arg" != --junitxml=* ]] || touch "${arg#--junitxml=}"; done
    if [[ "$2" == benchmarks.kernel_roofline ]]; then
        mkdir -p "$4" && touch "$4/roofline.json" "$4/roofline.png"
    fi
    exit 0
fi
exec %s "$@"
"""
FAKE_ROCM_MLA = """
if [[ "$1" == make-tiny ]]; then
    while [[ $# -gt 0 && "$1" != --out ]]; do shift; done
    mkdir -p "$2" && echo '{}' >"$2/config.json"
fi
"""
# `vllm serve ... --port P`: an OpenAI-style server on 127.0.0.1:P that answers /health and
# one completion with token ids.
FAKE_VLLM_SERVER = """
import http.server, json, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class Handler(http.server.BaseHTTPRequestHandler):
    def reply(self, code, body=b""):
        self.send_response(code)
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        self.reply(200 if self.path == "/health" else 404)
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.reply(200, json.dumps({"choices": [{"token_ids": [5, 6, 7, 8]}]}).encode())
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow  # the script polls the servers' /health every 5 s
def test_smoke_real_steps_use_both_backends_and_the_entrypoint(tmp_path):
    env, log = recording_bin(tmp_path, "bin")
    bin_dir, results = tmp_path / "bin", tmp_path / "results"
    python = shlex.quote(sys.executable)
    recording_stub(bin_dir, "python3", log, then=FAKE_PYTHON3 % python)
    recording_stub(bin_dir, "rocm-mla", log, then=FAKE_ROCM_MLA)
    server = f'exec {python} -c {shlex.quote(FAKE_VLLM_SERVER)} "$@"'
    recording_stub(bin_dir, "vllm", log, then=server)
    port = str(free_port())
    env = {**env, "RESULTS_DIR": str(results), "SMOKE_PORT": port}
    result = run(["bash", str(DOCKER / "smoke.sh")], env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert ran_steps(result.stdout) == SMOKE_STEPS
    assert "smoke: the backends agree on the first 4 of 4 tokens" in result.stdout

    required = [c["args"] for c in calls(log) if "--require-aiter" in c["args"]]
    assert len(required) == 1 and required[0][:2] == ["info", "--require-aiter"]
    assert "bf16:128:1:lse" in required[0][2].split(",")
    made = [c for c in calls(log) if c["args"][:1] in (["-m"], ["make-tiny"], ["serve"])]
    pytest_call, bench, tiny, *serves = (c["args"] for c in made)
    assert pytest_call[:3] == ["-m", "pytest", str(ROOT / "tests")]
    assert "rocm or gpu" in pytest_call and f"--junitxml={results}/junit-gpu.xml" in pytest_call
    assert bench == ["-m", "benchmarks.kernel_roofline", "--out", f"{results}/bench"]
    assert tiny == ["make-tiny", "--arch", "kimi_linear", "--out", f"{results}/work/tiny"]
    # Each backend is served through the entrypoint (rocm-mla info first, then vllm serve).
    serving = [c for c in calls(log) if c["cmd"] == "vllm" or c["args"] == ["info"]]
    assert [c["cmd"] for c in serving] == ["rocm-mla", "rocm-mla", "vllm", "rocm-mla", "vllm"]
    vllm_calls = [c for c in serving if c["cmd"] == "vllm"]
    assert [c["env"]["ROCM_MLA_BACKEND"] for c in vllm_calls] == ["aiter", "triton"]
    for serve in serves:
        assert serve[1] == f"{results}/work/tiny" and serve_flags(serve)["--port"] == port
        assert "--enforce-eager" in serve and "--skip-tokenizer-init" in serve
    for backend in ("aiter", "triton"):
        payload = json.loads((results / f"completion-{backend}.json").read_text())
        assert payload["choices"][0]["token_ids"] == [5, 6, 7, 8]


# --- workflows ------------------------------------------------------------------------------


def workflow(name: str) -> dict:
    data = yaml.safe_load((ROOT / ".github/workflows" / name).read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as True
    return data


def test_ci_workflow_runs_lint_tests_and_vllm_tests_on_push_and_pr():
    ci = workflow("ci.yml")
    assert {"push", "pull_request", "workflow_call"} <= set(ci["on"])
    commands = [
        s.get("run", "").split(" ")[:2] for job in ci["jobs"].values() for s in job["steps"]
    ]
    for target in [["make", "lint"], ["make", "test"], ["make", "test-vllm"]]:
        assert target in commands, target
    assert all(job["runs-on"] == "ubuntu-latest" for job in ci["jobs"].values())


def test_rocm_workflow_is_gated_scheduled_and_cleans_up():
    rocm = workflow("rocm.yml")
    assert "schedule" in rocm["on"] and "workflow_dispatch" in rocm["on"]
    assert rocm["concurrency"]["cancel-in-progress"] is True
    assert rocm["jobs"]["cpu"]["uses"] == "./.github/workflows/ci.yml"
    gpu = rocm["jobs"]["mi300x"]
    assert gpu["needs"] == "cpu"
    assert gpu["runs-on"] == ["self-hosted", "linux", "rocm", "mi300x"]
    steps = gpu["steps"]
    runs = " ".join(s.get("run", "") for s in steps)
    assert "docker build -f docker/Dockerfile --target smoke" in runs
    assert "docker/run-mi300x.sh smoke" in runs
    upload = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact"))
    assert upload["if"] == "always()"
    for artifact in ["junit-gpu.xml", "bench/", "logs/"]:
        assert artifact in upload["with"]["path"]
    cleanup = steps[-1]
    assert cleanup["if"] == "always()" and 'docker rm -f "$RUN_NAME"' in cleanup["run"]
