"""The engine: paged caches, runner metadata, PP x TP x DCP workers, LLM front end, faults.

Multi-process cases run on CPU over gloo. Each configuration starts its workers once and
serves every test that uses it; together they cover each value of each axis (pp 1/2/3,
tp 1/2, dcp 1/2, interleave 1/4, torch and Triton-interpreter backends) on the tiny Kimi-K3
(Attention Residuals; pp=2 splits it mid-block) and Kimi-Linear checkpoints. Every output is
compared with the single-process engine, which is itself checked against the model's own
greedy helper and, through a transformers checkpoint, against transformers. The references
run on the CPU (device="cpu") whatever the machine, so they compare like with like; the GPU
engine is compared with them in tests/test_robust.py.
"""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch

import rocm_mla
from rocm_mla.dcp import local_seq_lens
from rocm_mla.engine import LLM, CacheFullError, WorkerError
from rocm_mla.engine.cache import FreeList, blocks_for
from rocm_mla.engine.runner import Runner
from rocm_mla.models.kimi_k3 import load_model, make_tiny
from rocm_mla.models.kimi_k3.generate import greedy_generate

# Mixed lengths; 1 and 3 are shorter than dcp * interleave = 8.
PROMPTS = [[5, 17, 33, 2, 9, 41, 7, 60, 12, 3, 77], [100, 4, 8], [250], list(range(40, 66))]
NEW = 6


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    return {arch: str(make_tiny(arch, root / arch, seed=3)) for arch in ("kimi_k3", "kimi_linear")}


@pytest.fixture(scope="module")
def reference(checkpoints):
    """Single-process engine outputs per arch: greedy tokens, EOS-cut tokens, score logits."""
    refs = {}
    for arch, path in checkpoints.items():
        with LLM(path, block_size=4, device="cpu") as llm:
            tokens = llm.generate(PROMPTS, NEW)
            eos = tokens[0][2]
            refs[arch] = {
                "tokens": tokens,
                "eos": eos,
                "eos_tokens": llm.generate(PROMPTS, NEW, eos_token_id=eos),
                "logits": llm.score(PROMPTS),
            }
    return refs


def test_single_process_engine_matches_the_model_helper(checkpoints, reference):
    for arch, path in checkpoints.items():
        expected, logits = greedy_generate(load_model(path), PROMPTS, NEW)
        assert reference[arch]["tokens"] == expected, arch
        got = torch.cat(reference[arch]["logits"])
        assert (got - logits).abs().max() <= 1e-5 * logits.abs().max(), arch


def test_eos_ends_one_request_and_frees_its_blocks(checkpoints, reference):
    ref = reference["kimi_k3"]
    cut = ref["eos_tokens"]
    eos = ref["eos"]
    for full, got in zip(ref["tokens"], cut, strict=True):
        stop = full.index(eos) + 1 if eos in full else len(full)
        assert got == full[:stop]
    assert len(cut[0]) == 3 and any(len(c) == NEW for c in cut)


def test_runner_frees_finished_requests_while_others_decode():
    runner = Runner(num_blocks=8, block_size=4, max_num_seqs=2)
    a, b = runner.admit([[1] * 5, [2] * 3], max_new_tokens=6)
    assert runner.blocks.num_free == 8 - 2 - 1
    runner.prefill([a, b])
    a.tokens.append(7)
    b.tokens.append(7)
    runner.finish(a)
    freed = runner.blocks.num_free
    assert freed == 8 - 1
    for _ in range(5):
        meta, ids = runner.decode([b])
        b.tokens.append(7)
    assert meta.seq_lens.tolist() == [len(b.tokens) - 1] and ids.tolist() == [7]
    assert runner.blocks.num_free == 8 - blocks_for(len(b.tokens) - 1, 4, 1)
    runner.finish(b)
    assert runner.blocks.num_free == 8 and runner.slots.num_free == 2


def test_runner_dcp_ranks_write_disjoint_slots_and_own_the_local_lengths():
    for rank in range(2):
        runner = Runner(num_blocks=16, block_size=4, max_num_seqs=4, dcp_size=2, dcp_rank=rank,
                        dcp_interleave=2)  # fmt: skip
        reqs = runner.admit([[1] * 11, [2] * 3], max_new_tokens=2)
        meta, _ = runner.prefill(reqs)
        owned = meta.slot_mapping >= 0
        slots = meta.slot_mapping[owned]
        assert len(set(slots.tolist())) == len(slots), "two tokens in one slot"
        assert int(owned.sum()) == int(local_seq_lens(meta.seq_lens, 2, rank, 2).sum())
        for req in reqs:
            req.tokens.append(9)
        meta, _ = runner.decode(reqs)
        assert meta.dcp is not None
        assert meta.dcp.dcp_local_seq_lens[:, 0].tolist() == (
            local_seq_lens(meta.seq_lens, 2, rank, 2).tolist()
        )


def test_cache_full_says_how_much_and_which_argument(checkpoints):
    with LLM(checkpoints["kimi_linear"], num_blocks=3, block_size=4, max_num_seqs=2,
             device="cpu") as llm:  # fmt: skip
        with pytest.raises(CacheFullError, match=r"needs 4 KV cache blocks .* 3 .*num_blocks"):
            llm.generate([[1] * 10], max_new_tokens=7)
        with pytest.raises(CacheFullError, match="max_num_seqs"):
            llm.generate([[1], [2], [3]], max_new_tokens=1)
        assert llm.generate([[1] * 10], max_new_tokens=3)  # nothing leaked by the rejections


def test_free_list_reuses_freed_ids():
    free = FreeList(3, "blocks", "num_blocks")
    a = free.allocate(2, "x")
    free.free(a[:1])
    assert free.allocate(2, "y") == [a[0], 2]
    with pytest.raises(CacheFullError, match="needs 1 blocks but only 0 of the 3"):
        free.allocate(1, "z")


def _triton_skip():
    reason = rocm_mla.available_backends()["triton"]
    if (
        reason is None
        and 0 < torch.cuda.device_count() < 2
        and not os.environ.get("TRITON_INTERPRET")
    ):
        reason = "its 2 ranks run on CPU (fewer GPUs than ranks): Triton needs the interpreter"
    return pytest.mark.skipif(reason is not None, reason=f"triton backend: {reason}")


# (arch, pp, tp, dcp, interleave, backend): every axis value, plus pp x tp x dcp together.
CONFIGS = [
    pytest.param(("kimi_k3", 2, 2, 2, 4, "torch"), id="k3-pp2-tp2-dcp2-il4"),
    pytest.param(("kimi_k3", 3, 1, 1, 1, "torch"), id="k3-pp3-tp1"),
    pytest.param(("kimi_linear", 2, 2, 1, 1, "torch"), id="kl-pp2-tp2"),
    pytest.param(("kimi_linear", 1, 2, 2, 1, "torch"), id="kl-tp2-dcp2-il1"),
    pytest.param(("kimi_k3", 1, 2, 2, 4, "triton"), id="k3-tp2-dcp2-triton", marks=_triton_skip()),
]


@pytest.fixture(scope="module", params=CONFIGS)
def served(request, checkpoints):
    arch, pp, tp, dcp, interleave, backend = request.param
    llm = LLM(checkpoints[arch], pp=pp, tp=tp, dcp=dcp, dcp_interleave=interleave,
              backend=backend, block_size=4)  # fmt: skip
    yield arch, backend, llm
    pids = llm.worker_pids
    llm.close()
    assert _still_running(pids) == []


def test_greedy_outputs_identical_to_single_process(served, reference):
    arch, backend, llm = served
    ref = reference[arch]
    if backend == "triton":  # the interpreter is slow: a short case
        assert llm.generate(PROMPTS[:2], 3) == [t[:3] for t in ref["tokens"][:2]]
        return
    assert llm.generate(PROMPTS, NEW) == ref["tokens"]
    assert llm.generate(PROMPTS, NEW, eos_token_id=ref["eos"]) == ref["eos_tokens"]


def test_score_logits_match_single_process(served, reference):
    arch, backend, llm = served
    if backend == "triton":
        pytest.skip("score is a prefill: it never reaches the decode backend")
    for got, want in zip(llm.score(PROMPTS), reference[arch]["logits"], strict=True):
        assert got.shape == want.shape
        assert (got - want).abs().max() <= 1e-4 * max(1.0, want.abs().max())


def _still_running(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    """Of ``pids``, those still running after up to ``timeout_s`` (zombies count as gone)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except FileNotFoundError:
                continue
            if state != "Z":
                alive.append(pid)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def test_worker_fault_raises_in_the_caller_naming_the_rank(checkpoints):
    llm = LLM(checkpoints["kimi_linear"], pp=2, num_blocks=4, block_size=4)
    pids = llm.worker_pids
    assert len(pids) == 2 and _still_running(pids, 0) == pids
    # A rejected batch leaves the workers serving.
    with pytest.raises(CacheFullError, match="num_blocks"):
        llm.generate([[1] * 30], 4)
    assert len(llm.generate([[1, 2, 3]], 2)[0]) == 2
    llm._inject_fault(1)
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 of 2 failed") as info:
        llm.generate([[1, 2, 3]], 4)
    assert time.monotonic() - start < 60
    assert info.value.rank == 1 and "injected fault on rank 1" in str(info.value)
    assert _still_running(pids) == []
    # (Other engines of this module may still be serving: only this one's children count.)
    assert [p for p in multiprocessing.active_children() if p.pid in pids] == []
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([[1]], 1)
    llm.close()


def test_transformers_parity_through_the_engine(tmp_path):
    """transformers' KimiLinearForCausalLM vs the engine: paged (block 4, blocks reused across
    requests), batched, mixed prompt lengths; prefill logits and greedy continuations."""
    transformers = pytest.importorskip("transformers")
    from tests.test_kimi_parity import BASE, CONFIGS, _randomize

    cfg = transformers.KimiLinearConfig(**{**BASE, **CONFIGS["plain"]})
    torch.manual_seed(0)
    hf = transformers.KimiLinearForCausalLM(cfg).eval()
    _randomize(hf, seed=5)
    hf.save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, BASE["vocab_size"], (n,), generator=gen).tolist()
               for n in (23, 6, 14)]  # fmt: skip
    new = 8
    with LLM(tmp_path, block_size=4, num_blocks=18, device="cpu") as llm:
        got_logits = llm.score(prompts)
        got_tokens = llm.generate(prompts, new)
    for prompt, logits, tokens in zip(prompts, got_logits, got_tokens, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref_logits = hf(ids).logits[0]
            ref_tokens = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False
            )[0, len(prompt) :].tolist()
        assert (logits - ref_logits).abs().max() <= 1e-4 * ref_logits.abs().max()
        assert tokens == ref_tokens


def test_cli_generate_prints_ids_and_speed(checkpoints, reference, capsys):
    from rocm_mla.cli import main

    args = ["generate", "--model", checkpoints["kimi_k3"], "--max-new-tokens", str(NEW),
            "--device", "cpu"]  # fmt: skip
    for prompt in PROMPTS[:2]:
        args += ["--prompt-ids", ",".join(map(str, prompt))]
    assert main(args) == 0
    out = capsys.readouterr().out
    for i, tokens in enumerate(reference["kimi_k3"]["tokens"][:2]):
        assert f"[{i}] prompt {PROMPTS[i]} -> {tokens}" in out
    assert "tokens/s" in out and "no tokenizer files" in out


def test_llm_is_exported_lazily_from_the_package():
    assert rocm_mla.LLM is LLM


def test_fp8_latent_cache(checkpoints, reference):
    """An fp8 cache (scale 1) is what the MLA layers decode from; the prefill token is exact
    and the first tokens decoded from the quantized cache agree with the fp32 cache's."""
    with LLM(checkpoints["kimi_k3"], kv_cache_dtype="fp8", backend="torch", block_size=4,
             device="cpu") as llm:  # fmt: skip
        assert {c.dtype for c in llm._local.caches.kv.values()} == {torch.float8_e4m3fn}
        got = llm.generate(PROMPTS, 2)
    assert got == [t[:2] for t in reference["kimi_k3"]["tokens"]]
