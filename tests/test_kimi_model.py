"""Whole-model Kimi-K3 checks: paged decode == fresh prefill, PP stages, TP shards."""

from __future__ import annotations

import threading

import pytest
import torch

from rocm_mla.models.kimi_k3.loader import load_model, make_tiny
from rocm_mla.models.kimi_k3.model import pp_layer_range
from tests.model_helpers import contiguous_metadata

BLOCK, MAX_BLOCKS = 4, 8


@pytest.fixture(scope="module")
def k3(k3_dir):
    return load_model(k3_dir)


def _meta(ctx, new):
    return contiguous_metadata(ctx, new, BLOCK, MAX_BLOCKS)


def _tokens(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def _scale_err(got, ref):
    return ((got - ref).abs().max() / ref.abs().max()).item()


def _run_stages(stages, caches, meta, ids):
    io = None
    for stage, cache in zip(stages, caches, strict=True):
        io = stage(meta, cache, input_ids=ids if stage.is_first else None, intermediate=io)
    return io


def test_pp_layer_range_follows_the_vllm_rule():
    def sizes(n, pp):
        return [end - start for start, end in (pp_layer_range(n, r, pp) for r in range(pp))]

    assert sizes(93, 2) == [47, 46]
    assert sizes(93, 4) == [23, 23, 24, 23]
    assert sizes(93, 8) == [11, 11, 12, 12, 12, 12, 12, 11]
    assert sizes(9, 2) == [5, 4] and sizes(9, 3) == [3, 3, 3]
    assert pp_layer_range(9, 1, 2) == (5, 9)
    with pytest.raises(ValueError, match="pp_rank"):
        pp_layer_range(9, 2, 2)


def test_k3_decode_equals_full_prefill_of_extended_sequence(k3):
    """Two requests of different lengths: prefill, a mixed chunked step, then batched decode."""
    a, b = _tokens(9, 0), _tokens(6, 1)
    nxt, step = torch.tensor([17]), torch.tensor([3, 99])
    caches = k3.make_caches(2 * MAX_BLOCKS, BLOCK, 2)
    with torch.no_grad():
        k3(_meta([0, 0], [5, 6]), caches, input_ids=torch.cat([a[:5], b]))
        # Request 0 continues its prefill with 4 tokens while request 1 decodes one.
        chunk = k3(_meta([5, 6], [4, 1]), caches, input_ids=torch.cat([a[5:], nxt]))
        dec = k3(_meta([9, 7], [1, 1]), caches, input_ids=step)
        full_a = k3(
            _meta([0], [10]), k3.make_caches(MAX_BLOCKS, BLOCK, 1), torch.cat([a, step[:1]])
        )
        full_b = k3(
            _meta([0], [8]), k3.make_caches(MAX_BLOCKS, BLOCK, 1), torch.cat([b, nxt, step[1:]])
        )
    assert _scale_err(chunk[:4], full_a[5:9]) < 1e-4
    assert _scale_err(chunk[4], full_b[6]) < 1e-4
    assert _scale_err(dec[0], full_a[9]) < 1e-4
    assert _scale_err(dec[1], full_b[7]) < 1e-4


@pytest.mark.parametrize("pp_size", [2, 3])
def test_pp_stages_chained_by_hand_equal_unsplit_model(k3, k3_dir, pp_size):
    stages = [load_model(k3_dir, pp_rank=r, pp_size=pp_size) for r in range(pp_size)]
    for r, stage in enumerate(stages):
        start, end = pp_layer_range(9, r, pp_size)
        assert sorted(int(i) for i in stage.model.layers) == list(range(start, end))
        assert hasattr(stage.model, "embed_tokens") == (r == 0)
        assert hasattr(stage, "lm_head") == (r == pp_size - 1)
    ids = _tokens(7, 2)
    caches = [s.make_caches(MAX_BLOCKS, BLOCK, 1) for s in stages]
    ref_caches = k3.make_caches(MAX_BLOCKS, BLOCK, 1)
    with torch.no_grad():
        io = stages[0](_meta([0], [7]), caches[0], input_ids=ids)
        # Stage 0 of PP2 ends at layer 5: blocks closed at layers 0 and 3 travel as the bank.
        assert io.residual.shape == (7, {2: 2, 3: 1}[pp_size], 64)
        got = _run_stages(stages, caches, _meta([0], [7]), ids)
        ref = k3(_meta([0], [7]), ref_caches, input_ids=ids)
        assert _scale_err(got, ref) < 1e-5
        for t in range(2):
            tok = torch.tensor([5 + t])
            got = _run_stages(stages, caches, _meta([7 + t], [1]), tok)
            ref = k3(_meta([7 + t], [1]), ref_caches, input_ids=tok)
            assert _scale_err(got, ref) < 1e-5
    # Each stage owns only its own layers' caches.
    assert set(caches[0].kv) | set(caches[0].conv) == set(range(*pp_layer_range(9, 0, pp_size)))


class ThreadAllReduce:
    """An all-reduce over ranks that are threads of this process (sums in rank order)."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list[torch.Tensor | None] = [None] * size

    def for_rank(self, rank: int):
        def all_reduce(x: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = x
            self.barrier.wait()
            total = sum(self.slots[1:], self.slots[0])
            self.barrier.wait()
            return total

        return all_reduce


@pytest.mark.parametrize("arch", ["kimi_k3", "kimi_linear"])
def test_tp_shards_recombined_equal_unsharded(tmp_path, arch):
    path = make_tiny(arch, tmp_path / arch, seed=4)
    ref_model = load_model(path)
    group = ThreadAllReduce(2)
    ranks = [load_model(path, tp_rank=r, tp_size=2, all_reduce=group.for_rank(r)) for r in range(2)]
    layer = ranks[1].model.layers["3"].self_attn  # an MLA layer: half the heads
    assert layer.num_heads == 2 and layer.kv_b_proj.weight.shape[0] == 2 * 32
    ids = _tokens(6, 5)
    results: list = [None, None]

    def run(r: int) -> None:
        with torch.no_grad():
            caches = ranks[r].make_caches(MAX_BLOCKS, BLOCK, 1)
            pre = ranks[r](_meta([0], [6]), caches, input_ids=ids)
            dec = ranks[r](_meta([6], [1]), caches, input_ids=torch.tensor([9]))
        results[r] = (pre, dec)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    with torch.no_grad():
        caches = ref_model.make_caches(MAX_BLOCKS, BLOCK, 1)
        ref_pre = ref_model(_meta([0], [6]), caches, input_ids=ids)
        ref_dec = ref_model(_meta([6], [1]), caches, input_ids=torch.tensor([9]))
    for pre, dec in results:
        assert _scale_err(pre, ref_pre) < 1e-5
        assert _scale_err(dec, ref_dec) < 1e-5


def test_tp_without_all_reduce_is_refused(k3_dir):
    with pytest.raises(ValueError, match="all_reduce"):
        load_model(k3_dir, tp_rank=0, tp_size=2)


def test_process_group_is_accepted_as_the_all_reduce(k3_dir, k3, tmp_path):
    dist = torch.distributed
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = load_model(k3_dir, all_reduce=dist.group.WORLD)
        ids = _tokens(5, 6)
        with torch.no_grad():
            got = model(_meta([0], [5]), model.make_caches(MAX_BLOCKS, BLOCK, 1), input_ids=ids)
            ref = k3(_meta([0], [5]), k3.make_caches(MAX_BLOCKS, BLOCK, 1), input_ids=ids)
        torch.testing.assert_close(got, ref)
    finally:
        dist.destroy_process_group()
