"""The engine's decode hot path: one plan per step, graph buckets, the MoE's sync-free schedule.

Graph capture itself needs a GPU (the ``gpu`` tests). On the CPU the buckets are driven by a
stand-in capture that reruns the recorded step on the same static buffers: that exercises
everything but the CUDA graph itself (padding rows, trash block and slot, static copies,
the bounds-only plan), against the eager engine's tokens.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import rocm_mla
from rocm_mla.engine.graphs import DecodeGraphs
from rocm_mla.engine.worker import EngineOptions, StageWorker
from rocm_mla.inputs import DecodePlan
from rocm_mla.models.kimi_k3 import KimiK3Config
from rocm_mla.models.kimi_k3.loader import make_tiny
from rocm_mla.models.kimi_k3.moe import MoE

PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [100, 4, 8], [250, 3, 3, 3, 1]]


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    return str(make_tiny("kimi_k3", tmp_path_factory.mktemp("hot") / "k3", seed=11))


def _eager_capture(fn):
    """Stand-in for ``cuda_graph_capture``: replay reruns ``fn`` into the recorded output."""
    out = fn()

    def replay():
        out.copy_(fn())

    return replay, out


def _worker(path: str, **options) -> StageWorker:
    return StageWorker.load(path, EngineOptions(num_blocks=64, max_num_seqs=4, **options))


def _with_cpu_graphs(worker: StageWorker) -> DecodeGraphs:
    """Give a CPU worker what a GPU one builds itself: one spare block and state slot, and
    decode graphs (here with the stand-in capture)."""
    o, config = worker.options, worker.model.config
    kv_dtype = next(iter(worker.caches.kv.values())).dtype
    worker.caches = worker.model.make_caches(
        o.num_blocks + 1, o.block_size, o.max_num_seqs + 1, kv_dtype=kv_dtype
    )
    attention = worker.runner.attention
    worker.graphs = DecodeGraphs(
        lambda meta, ids: worker._forward(meta, ids),
        kv_dtype=attention.kv_dtype,
        q_dtype=attention.q_dtype,
        num_heads=attention.num_heads,
        head_dim_v=attention.head_dim_v,
        rope_dim=attention.rope_dim,
        backend=attention.backend,
        block_size=o.block_size,
        max_seqlen=config.max_position_embeddings,
        max_batch=o.max_num_seqs,
        trash_block=o.num_blocks,
        trash_slot=o.max_num_seqs,
        device="cpu",
        capture=_eager_capture,
    )
    return worker.graphs


def test_decode_steps_carry_one_plan_for_every_layer(k3):
    worker = _worker(k3, backend="torch")
    requests = worker.runner.admit(PROMPTS, 4)
    worker.runner.prefill(requests)
    for req in requests:
        req.tokens.append(1)
    meta, _ = worker.runner.decode(requests)
    assert isinstance(meta.decode_plan, DecodePlan)
    plan = meta.decode_plan
    assert (plan.batch, plan.spec.q_len, plan.backend) == (3, 1, "torch")
    assert (plan.min_seqlen, plan.max_seqlen) == (4, 8)  # host lengths: 3+1 .. 7+1
    config = worker.model.config
    assert plan.spec.num_heads == config.num_attention_heads
    # Every MLA layer decodes with this plan object: count the calls that receive it.
    seen = []
    real = rocm_mla.api.backend_class

    def spy(name):
        cls = real(name)

        class Spy(cls):
            def run(self, problem, plan=None):
                seen.append(plan)
                return super().run(problem, plan)

        return Spy

    import rocm_mla.api as api

    api.backend_class, saved = spy, api.backend_class
    try:
        worker._forward(meta, torch.ones(3, dtype=torch.int64))
    finally:
        api.backend_class = saved
    mla_layers = sum(t == "full_attention" for t in config.layer_types)
    assert len(seen) == mla_layers and all(p is plan for p in seen)


def test_graph_buckets_reproduce_eager_generation(k3):
    eager = _worker(k3, backend="torch").generate(PROMPTS, 6)
    worker = _worker(k3, backend="torch")
    graphs = _with_cpu_graphs(worker)
    assert graphs.sizes == [1, 2, 4]
    replayed = worker.generate(PROMPTS, 6)
    assert replayed == eager
    assert sorted(graphs.buckets) == [4]  # three requests ride the bucket of four
    # A second call reuses the bucket (no new capture) and a smaller batch gets its own.
    assert worker.generate(PROMPTS, 6) == eager
    assert worker.generate(PROMPTS[:1], 3) == _worker(k3, backend="torch").generate(PROMPTS[:1], 3)
    assert sorted(graphs.buckets) == [1, 4]


def test_graph_padding_never_writes_a_real_block_or_slot(k3):
    worker = _worker(k3, backend="torch")
    graphs = _with_cpu_graphs(worker)
    worker.generate(PROMPTS[:1], 3)
    # The bucket of one had no padding; capture a bucket of four with a batch of one.
    before = {i: c.clone() for i, c in worker.caches.kv.items()}
    requests = worker.runner.admit(PROMPTS[:1], 3)
    meta, ids = worker.runner.prefill(requests)
    worker._forward(meta, ids)
    requests[0].tokens.append(1)
    meta, ids = worker.runner.decode(requests)
    graphs.sizes = [4]
    graphs.run(meta, ids)
    used = set(requests[0].blocks)
    trash = worker.options.num_blocks
    for i, cache in worker.caches.kv.items():
        changed = {
            int(b) for b in (cache != before[i]).flatten(1).any(dim=1).nonzero()[:, 0].tolist()
        }
        assert changed <= used | {trash}, f"layer {i} wrote blocks {changed - used - {trash}}"
    for req in requests:
        worker.runner.finish(req)


def test_moe_dense_schedule_equals_the_sparse_one():
    config = KimiK3Config.tiny("kimi_k3")
    moe = MoE(config)
    gen = torch.Generator().manual_seed(0)
    for p in moe.parameters():
        p.data = torch.randn(p.shape, generator=gen) * 0.2
    x = torch.randn(3, config.hidden_size, generator=gen)
    weights, ids = moe.gate(x)
    assert ids.numel() < len(moe.experts)  # the sparse schedule for this small batch
    z = x if moe.latent is None else moe.routed_expert_down_proj(x)
    sparse = moe.routed(z, weights, ids)
    dense = moe._routed_dense(z, weights, ids)
    torch.testing.assert_close(dense, sparse, atol=1e-6, rtol=1e-5)


def test_enforce_eager_is_checked_and_reaches_the_worker(k3):
    with pytest.raises(ValueError, match="enforce_eager: expected True or False"):
        rocm_mla.LLM(k3, enforce_eager="yes")
    with rocm_mla.LLM(k3, enforce_eager=True, device="cpu") as llm:
        assert llm.options.enforce_eager is True
    assert dataclasses.fields(EngineOptions)[-1].name == "enforce_eager"


@pytest.mark.gpu
def test_gpu_graph_replay_equals_eager(k3):
    with rocm_mla.LLM(k3, device="cuda", enforce_eager=True) as llm:
        eager = llm.generate(PROMPTS, 8)
    with rocm_mla.LLM(k3, device="cuda") as llm:
        replayed = llm.generate(PROMPTS, 8)
        assert llm._local.graphs is not None and llm._local.graphs.buckets
    assert replayed == eager


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter runs on CPU tensors")
def test_triton_graph_bucket_replays_two_mixes_balanced(k3, monkeypatch):
    """One bucket (4 rows) replays two different length mixes, each balanced by its own
    lengths: replan_decode rewrites the bucket plan's schedule before every replay (stale
    tables would walk the capture's empty lengths and give wrong tokens)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("ROCM_MLA_TRITON_SLOTS", "8")
    long_mix = [[7 + i % 50 for i in range(150)], [3, 1], [9, 9, 9]]
    short_mix = [[5, 17, 33, 2], [100, 4, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8]]
    eager = _worker(k3, backend="triton")
    expected = [eager.generate(long_mix, 3), eager.generate(short_mix, 3)]
    worker = _worker(k3, backend="triton")
    graphs = _with_cpu_graphs(worker)
    plans = []
    real_load = graphs._load

    def load(bucket, meta, input_ids):
        real_load(bucket, meta, input_ids)
        schedule = bucket.meta.decode_plan.launch.schedule
        plans.append((bucket.meta.decode_plan, int((schedule.split_units >= 0).sum())))

    graphs._load = load
    assert [worker.generate(long_mix, 3), worker.generate(short_mix, 3)] == expected
    assert sorted(graphs.buckets) == [2, 4]
    bucket_plan = graphs.buckets[4].meta.decode_plan
    assert bucket_plan.launch.num_slots == 8 and bucket_plan.bounds_only
    # The 150-token request of the first mix (3 pieces of 64 keys among 5) is cut (at 4
    # slots the calibrated overhead makes cutting it dearer than the imbalance).
    assert max(cut for plan, cut in plans if plan is bucket_plan) >= 1
