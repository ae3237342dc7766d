"""Robustness: bad input fails fast and clearly, hostile checkpoints are refused, and the
engine behaves on any machine and from any script (unguarded scripts, signals, stalls).

Multi-process cases start tiny 2-rank engines on CPU; every wait is bounded inside the test
(``subprocess`` timeouts, deadlines), so a regression fails instead of hanging.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from rocm_mla.distributed import WorkerError, backend_for
from rocm_mla.engine import LLM, CacheFullError
from rocm_mla.engine import llm as llm_module
from rocm_mla.engine.cache import FreeList
from rocm_mla.engine.llm import placement
from rocm_mla.models.kimi_k3 import KimiK3Config, load_model, make_tiny
from rocm_mla.models.kimi_k3.loader import CheckpointError
from tests.test_engine import _still_running

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """A tiny Kimi-Linear checkpoint with a short position limit (64)."""
    config = KimiK3Config.tiny("kimi_linear")
    config.max_position_embeddings = 64
    return str(make_tiny("kimi_linear", tmp_path_factory.mktemp("robust") / "kl", config=config))


@pytest.fixture(scope="module")
def local(tiny):
    with LLM(tiny, block_size=4, device="cpu") as llm:
        yield llm


# ---- block allocator and memory checks -----------------------------------------------------


def test_free_list_memory_does_not_grow_with_capacity():
    tracemalloc.start()
    try:
        free = FreeList(10**9, "KV cache blocks", "num_blocks")
        ids = free.allocate(5, "x")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    assert ids == [0, 1, 2, 3, 4] and free.num_free == 10**9 - 5
    free.free([3, 1])
    assert free.allocate(3, "y") == [3, 1, 5]  # most recently freed first, then fresh ids
    assert free.num_free == 10**9 - 6


def test_cache_full_error_keeps_its_fields_through_pickle():
    import pickle

    err = pickle.loads(pickle.dumps(CacheFullError("a batch needs 9 blocks", "num_blocks", 9)))
    assert (err.detail, err.knob, err.minimum) == ("a batch needs 9 blocks", "num_blocks", 9)
    assert str(err) == "a batch needs 9 blocks; raise LLM(num_blocks=...) to at least 9"


def test_num_blocks_beyond_memory_fails_before_allocating(tiny):
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"num_blocks: 1000000000000 blocks .* at most about \d+"):
        LLM(tiny, num_blocks=10**12, device="cpu")
    assert time.monotonic() - start < 10


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("hidden_size", 10**9, r"hidden_size: expected an int in \[1, 65536\]"),
        ("vocab_size", 10**12, r"vocab_size: expected an int in \[1, 16777216\]"),
        ("num_experts", 10**7, r"num_experts: expected an int in \[0, 65536\]"),
        ("num_hidden_layers", 10**9, r"num_hidden_layers: expected an int in \[1, 4096\]"),
        ("hidden_size", "64", "hidden_size: expected an int, got '64'"),
        ("hidden_size", 64.0, "hidden_size: expected an int, got 64.0"),
        ("rms_norm_eps", "1e-5", "rms_norm_eps: expected a finite number"),
        ("tie_word_embeddings", "no", "tie_word_embeddings: expected true or false"),
    ],
)
def test_config_values_are_type_and_range_checked_first(tmp_path, field, value, match):
    raw = KimiK3Config.tiny("kimi_linear").to_dict()
    raw[field] = value
    (tmp_path / "config.json").write_text(json.dumps(raw))
    start = time.monotonic()
    with pytest.raises(ValueError, match=match):
        LLM(tmp_path, device="cpu")
    assert time.monotonic() - start < 5


def test_config_that_cannot_fit_in_memory_is_refused_before_allocation(tmp_path):
    config = KimiK3Config.tiny("kimi_linear")
    config.vocab_size, config.hidden_size = 2**24, 2**16  # within bounds: ~2 TiB of embeddings
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    with pytest.raises(ValueError, match=r"model: the config needs at least \d+.\d GiB"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="model: the config needs at least"):
        LLM(tmp_path, pp=2, device="cpu")  # refused before any worker starts


# ---- loader path safety ----------------------------------------------------------------------


def _copy_config(src: str, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text((Path(src) / "config.json").read_text())


def test_index_entries_outside_the_model_directory_are_refused(tiny, tmp_path):
    outside = tmp_path / "secret.safetensors"
    outside.write_bytes((Path(tiny) / "model.safetensors").read_bytes())
    for entry in (str(outside), "../secret.safetensors", "sub/../../secret.safetensors"):
        model = tmp_path / "model"
        _copy_config(tiny, model)
        index = {"weight_map": {"model.embed_tokens.weight": entry}}
        (model / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(CheckpointError, match="refusing to open it") as info:
            load_model(model)
        assert entry in str(info.value)


def test_symlinks_out_of_the_model_directory_are_refused(tiny, tmp_path):
    model = tmp_path / "model"
    _copy_config(tiny, model)
    (model / "model.safetensors").symlink_to(Path(tiny) / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model.safetensors: resolves to .* outside"):
        load_model(model)
    linked = tmp_path / "linked-config"
    linked.mkdir()
    (linked / "config.json").symlink_to(Path(tiny) / "config.json")
    with pytest.raises(ValueError, match=r"config.json: resolves to .* outside"):
        KimiK3Config.from_pretrained(linked)


def test_hugging_face_cache_snapshots_may_link_to_their_blobs(tiny, tmp_path):
    repo = tmp_path / "models--org--kimi"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (repo / "blobs" / name).write_bytes((Path(tiny) / name).read_bytes())
        (snapshot / name).symlink_to(Path("../../blobs") / name)
    model = load_model(snapshot)
    assert model.config == KimiK3Config.from_pretrained(tiny)


# ---- engine input checks ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad", [1.7, "5", True, 2.0, None, torch.tensor(1.5), np.bool_(True), torch.tensor(True)]
)
def test_token_ids_must_be_ints(local, bad):
    with pytest.raises(ValueError, match=r"prompt_token_ids\[0\]\[1\]: expected an int token id"):
        local.generate([[1, bad, 3]], 1)
    if bad is not None:  # None: no EOS
        with pytest.raises(ValueError, match="eos_token_id: expected an int token id"):
            local.generate([[1]], 1, eos_token_id=bad)


def test_numpy_and_torch_integer_scalars_are_token_ids(local):
    plain = local.generate([[1, 2, 3]], 2)
    assert local.generate([[np.int64(1), torch.tensor(2), np.int32(3)]], 2) == plain
    assert local.generate([np.array([1, 2, 3])], 2) == plain


def test_prompt_plus_new_tokens_within_max_position_embeddings(local):
    with pytest.raises(ValueError, match=r"max_new_tokens: prompt 0 has 60 tokens, \+ max_new"):
        local.generate([[1] * 60], 5)
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\]: 65 tokens pass the model's"):
        local.score([[1], [2] * 65])
    assert len(local.generate([[1] * 60], 4)[0]) == 4
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 256\), got \[256, -1\]"):
        local.generate([[256, -1]], 1)


def test_generate_prints_a_throttled_progress_line(local, monkeypatch, capsys):
    monkeypatch.setattr(llm_module, "PROGRESS_PRINT_S", 0.0)
    local.generate([[1, 2]], 5, show_progress=True)
    lines = capsys.readouterr().err.splitlines()
    assert lines and all("new tokens for 1 prompt(s)" in line for line in lines)
    assert "5/5 new tokens" in lines[-1]
    monkeypatch.setattr(llm_module, "PROGRESS_PRINT_S", 3600.0)
    local.generate([[1, 2]], 5, show_progress=True)
    assert capsys.readouterr().err == ""


# ---- placement -------------------------------------------------------------------------------


def test_more_ranks_than_gpus_run_on_cpu_with_a_notice(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert placement(4, None) == ("gloo", "cpu")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "4 ranks but torch sees 1 GPU(s): running them on CPU" in err
    assert placement(1, None) == ("nccl", "cuda")
    assert placement(4, "cpu") == ("gloo", "cpu")
    with pytest.raises(ValueError, match=r"device: 'cuda' needs one GPU per rank.*device='cpu'"):
        placement(4, "cuda")
    with pytest.raises(ValueError, match="device: 'cuda:0' names one GPU"):
        placement(2, "cuda:0")
    with pytest.raises(ValueError, match="device: expected 'cpu', 'cuda' or None"):
        placement(2, "tpu")
    with pytest.raises(ValueError, match="2 processes on nccl need 2 GPUs, torch sees 1; use"):
        backend_for(2, "nccl")
    assert backend_for(2, None) == "gloo"


def test_cpu_machine_places_workers_on_cpu_silently(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert placement(4, None) == ("gloo", "cpu")
    assert capsys.readouterr().err == ""


@pytest.mark.gpu
def test_in_process_engine_on_the_gpu_matches_the_cpu(tiny):
    with LLM(tiny, block_size=4, device="cpu") as cpu:
        want_tokens, want_logits = cpu.generate([[1, 2, 3], [4]], 4), cpu.score([[1, 2, 3]])
    with LLM(tiny, block_size=4, device="cuda") as gpu:
        assert gpu._local.caches.conv and next(gpu._local.model.parameters()).is_cuda
        tokens, logits = gpu.generate([[1, 2, 3], [4]], 4), gpu.score([[1, 2, 3]])
    assert logits[0].device.type == "cpu"
    torch.testing.assert_close(logits[0], want_logits[0], rtol=1e-3, atol=1e-3)
    assert tokens == want_tokens


# ---- CLI errors: one line, exit code 2, the flag named -----------------------------------------


def _cli(capsys, *argv: str) -> tuple[int, str]:
    from rocm_mla.cli import main

    code = main(list(argv))
    err = capsys.readouterr().err
    return code, err


def test_cli_errors_are_one_line_naming_the_flag(tiny, tmp_path, capsys):
    cases = []
    cases.append((("--model", str(tmp_path / "nope")), "--model: .*nope is not a directory"))
    (tmp_path / "empty").mkdir()
    cases.append((("--model", str(tmp_path / "empty")), "--model: .*empty has no config.json"))
    bad = tmp_path / "bad"
    bad.mkdir()
    raw = json.loads((Path(tiny) / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**raw, "hidden_size": "64"}))
    cases.append((("--model", str(bad)), r"--model: .*config.json: hidden_size: expected an int"))
    cases.append(
        (
            ("--model", tiny, "--num-blocks", "2", "--block-size", "4", "--max-new-tokens", "20"),
            r"needs \d+ KV cache blocks .* raise --num-blocks to at least \d+",
        )
    )
    cases.append((("--model", tiny, "--device", "tpu"), "--device: expected 'cpu', 'cuda'"))
    cases.append((("--model", tiny, "--max-new-tokens", "64"), "--max-new-tokens: prompt 0 has"))
    for args, match in cases:
        code, err = _cli(capsys, "generate", "--prompt-ids", "1,2", *args)
        assert code == 2, (args, err)
        assert err.count("\n") == 1 and err.startswith("rocm-mla generate: "), err
        assert re.search(match, err), (match, err)
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, err = _cli(capsys, "make-tiny", "--arch", "kimi_linear", "--out", str(blocker / "x"))
    assert code == 2 and err.count("\n") == 1 and "rocm-mla make-tiny: --out: " in err, err


def test_cli_worker_error_is_one_line(tiny, tmp_path, capsys):
    broken = tmp_path / "broken"
    _copy_config(tiny, broken)
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    code, err = _cli(capsys, "generate", "--model", str(broken), "--prompt-ids", "1", "--pp", "2")
    assert code == 2 and err.count("\n") == 1, err
    assert re.search(r"worker failed: rank \d of 2 failed: \S*CheckpointError", err)


# ---- worker processes: any script, any fault, bounded ------------------------------------------


def test_worker_start_failure_reports_the_childs_own_error(tiny, tmp_path, monkeypatch):
    # An interpreter that dies before it can connect: its own words must reach the caller.
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'ImportError: no module named torch (fake)' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    start = time.monotonic()
    match = r"rank \d of 2 \(pid \d+\) exited with code 3 while starting"
    with pytest.raises(WorkerError, match=match) as e:
        LLM(tiny, pp=2, device="cpu")
    assert "ImportError: no module named torch (fake)" in str(e.value)
    assert time.monotonic() - start < 30


def _listening_ports(inodes: set[str] | None = None) -> dict[int, set[str]]:
    """Port -> local addresses of the TCP sockets listening on this host (from /proc), of
    the sockets ``inodes`` only when given."""
    ports: dict[int, set[str]] = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(name):
            continue
        for line in Path(name).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or (inodes is not None and fields[9] not in inodes):
                continue  # not listening, or not ours
            addr, port = fields[1].split(":")
            ports.setdefault(int(port, 16), set()).add(addr)
    return ports


LOOPBACK = {"0100007F", "00000000000000000000000001000000"}


def _worker_children(parent: int) -> list[int]:
    """Engine worker processes whose parent is ``parent``."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"rocm_mla.engine.worker" in cmdline:
            pids.append(int(stat.parent.name))
    return pids


def _socket_inodes(pids: list[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    return inodes


SCRIPT = """
import os, sys, rocm_mla
llm = rocm_mla.LLM(sys.argv[1], pp=2, block_size=4, device="cpu")
print("pids", *llm.worker_pids, flush=True)
print("tokens", llm.generate([[1, 2, 3]], 3), flush=True)
if sys.argv[2] == "long":
    print("long", flush=True)
    while True:  # until interrupted, however fast the machine
        llm.generate([[1, 2]], 62)
"""


def _sigint_default() -> None:
    """In a child before exec: SIGINT at its default. A shell's background job (``nohup make
    test &``) starts with SIGINT ignored, and an ignored signal stays ignored across exec, so
    the children of tests that send it would never see it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _run_script(mode: str, tiny: str, stop=None, timeout: float = 180):
    proc = subprocess.Popen(
        [sys.executable, "-", tiny, mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        preexec_fn=_sigint_default,
    )
    proc.stdin.write(SCRIPT)
    proc.stdin.close()
    lines = []
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        for line in proc.stdout:
            lines.append(line.split())
            if stop is not None and line.startswith("long"):
                stop(proc)
        err = proc.stderr.read()
        proc.wait()
    finally:
        timer.cancel()
    return proc.returncode, lines, err


def test_unguarded_script_from_stdin_runs_and_exits_without_close(tiny, local):
    start = time.monotonic()
    code, lines, err = _run_script("short", tiny)
    assert code == 0, err
    assert time.monotonic() - start < 150
    pids = [int(p) for p in lines[0][1:]]
    assert " ".join(lines[1][1:]) == str(local.generate([[1, 2, 3]], 3))
    assert _still_running(pids) == []


def test_sigint_to_the_parent_alone_stops_all_with_one_keyboard_interrupt(tiny):
    sent = {}

    def interrupt(proc):
        time.sleep(0.5)
        sent["at"] = time.monotonic()
        proc.send_signal(signal.SIGINT)

    code, lines, err = _run_script("long", tiny, stop=interrupt)
    assert "at" in sent, err
    assert time.monotonic() - sent["at"] < 20
    assert code != 0 and err.count("KeyboardInterrupt") == 1 and err.count("Traceback") == 1, err
    assert _still_running([int(p) for p in lines[0][1:]]) == []


def test_terminal_ctrl_c_prints_one_line(tiny):
    """Ctrl-C in a terminal signals the whole foreground process group."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rocm_mla.cli", "generate", "--model", tiny, "--pp", "2",
         "--device", "cpu", "--block-size", "4", "--prompt-ids", "1,2", "--max-new-tokens", "62"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        start_new_session=True, preexec_fn=_sigint_default,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        # Interrupt once the workers exist: they are still starting (importing torch takes
        # longer than this on any machine), the longest phase of a short generate.
        while time.monotonic() < deadline and proc.poll() is None:
            if len(_worker_children(proc.pid)) >= 2:
                break
            time.sleep(0.1)
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [line for line in err.splitlines() if "new tokens for" not in line]
    assert proc.returncode == 130, err
    assert lines == ["rocm-mla generate: interrupted (workers stopped)"], err


def test_stopped_worker_becomes_a_worker_error_naming_it(tiny):
    llm = LLM(tiny, pp=2, block_size=4, device="cpu", call_timeout_s=6)
    pids = llm.worker_pids
    os.kill(pids[1], signal.SIGSTOP)
    start = time.monotonic()
    try:
        with pytest.raises(WorkerError, match=r"rank 1 of 2 .* sent no heartbeat") as info:
            llm.generate([[1, 2, 3]], 4)
        assert info.value.rank == 1
        assert time.monotonic() - start < 30
        assert _still_running(pids) == []
        with pytest.raises(RuntimeError, match="closed"):
            llm.generate([[1]], 1)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        llm.close()


def test_close_with_a_long_call_in_flight_stops_the_workers(tiny):
    llm = LLM(tiny, pp=2, block_size=4, device="cpu")
    pids = llm.worker_pids
    raised = []

    def long_call():
        try:
            while True:  # until close() ends it, however fast the machine
                llm.generate([[1, 2]], 62)
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=long_call)
    thread.start()
    time.sleep(2.0)
    start = time.monotonic()
    llm.close()
    assert time.monotonic() - start < 20
    thread.join(timeout=20)
    assert not thread.is_alive()
    assert raised and isinstance(raised[0], RuntimeError), raised
    assert _still_running(pids) == []


def test_env_rendezvous_listens_on_master_addr_only(monkeypatch):
    from rocm_mla.distributed import _env_store, free_port

    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    server = _env_store(0, 2, 10.0)
    client = _env_store(1, 2, 10.0)
    client.set("key", "value")
    assert server.get("key") == b"value"
    ours = _listening_ports(_socket_inodes([os.getpid()]))
    assert ours.get(port) == {"0100007F"}, ours
    monkeypatch.delenv("MASTER_ADDR")
    with pytest.raises(ValueError, match="env:// needs MASTER_ADDR and MASTER_PORT"):
        _env_store(0, 2, 10.0)


def test_every_listening_socket_of_the_engine_is_on_loopback(tiny, monkeypatch, capsys):
    monkeypatch.setattr(llm_module, "PROGRESS_PRINT_S", 0.0)
    with LLM(tiny, pp=2, block_size=4, device="cpu") as llm:
        assert llm.generate([[1, 2, 3]], 2, show_progress=True)
        # The sampler rank's progress reaches this process (its first step always does).
        assert "/2 new tokens for 1 prompt(s)" in capsys.readouterr().err
        ours = _listening_ports(_socket_inodes([os.getpid(), *llm.worker_pids]))
        # The rendezvous store stopped listening once both ranks joined (tests/test_rendezvous.py).
        assert llm._group._store.port not in ours
        assert all(addrs <= LOOPBACK for addrs in ours.values()), ours


def test_killed_worker_is_named_with_its_signal(tiny):
    llm = LLM(tiny, pp=2, block_size=4, device="cpu")
    pids = llm.worker_pids
    os.kill(pids[0], signal.SIGKILL)
    start = time.monotonic()
    match = r"rank 0 of 2 \(pid \d+\) was killed by SIGKILL during a call"
    try:
        with pytest.raises(WorkerError, match=match) as e:
            llm.generate([[1, 2, 3]], 2)
        assert e.value.rank == 0 and time.monotonic() - start < 30
        assert _still_running(pids) == []
    finally:
        llm.close()


def test_a_dcp_rank_killed_mid_step_ends_the_run_naming_it(tiny):
    """tp=2 with dcp=2: the ranks meet in every MLA layer (q gather, LSE combine). One killed
    while a generate is in flight leaves its peer waiting in a collective; the call still
    ends in bounded time with a WorkerError naming the killed rank, and no worker lingers."""
    llm = LLM(tiny, tp=2, dcp=2, block_size=4, device="cpu", call_timeout_s=20)
    pids = llm.worker_pids
    raised: list[BaseException] = []

    def long_call():
        try:
            while True:  # until the kill ends it, however fast the machine
                llm.generate([[1, 2, 3], [4, 5]], 40)
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=long_call)
    try:
        thread.start()
        time.sleep(3.0)
        start = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        thread.join(timeout=60)
        assert not thread.is_alive() and time.monotonic() - start < 60
        assert raised and isinstance(raised[0], WorkerError), raised
        assert raised[0].rank == 1
        assert re.search(r"rank 1 of 2 \(pid \d+\) was killed by SIGKILL", str(raised[0]))
        assert _still_running(pids) == []
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        llm.close()
