"""The torch backend against the independent dense reference, and input validation."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rocm_mla
from tests.reference import dense_mla_decode, make_paged_problem

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def check_against_dense(q, kv, bt, lens, *, dtype, causal=True, kv_scale=None, **kw):
    out, lse = rocm_mla.mla_decode(
        q, kv, bt, lens, causal=causal, kv_scale=kv_scale, backend="torch", **kw
    )
    ref_out, ref_lse = dense_mla_decode(q, kv, bt, lens, causal=causal, kv_scale=kv_scale, **kw)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert out.shape == (*q.shape[:3], kw.get("head_dim_v", 512))
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty)
    assert (lse[empty] == -math.inf).all() and (out[empty] == 0).all()
    torch.testing.assert_close(lse.double()[~empty], ref_lse[~empty], atol=tol, rtol=tol)


# One case per row, together covering batch 1..8, heads 1/16/128, S_q 1..4, block sizes
# 1/16/64, lengths 0/1/odd/long (>= 4K), both dtypes. Unused slots hold NaN throughout.
GRID = [
    # lengths,                         heads, S_q, block, dtype
    ([1], 1, 1, 1, torch.float32),
    ([0, 1, 2, 3], 16, 1, 16, torch.float32),
    ([37, 0, 129, 5, 1, 64], 16, 2, 64, torch.float32),
    ([4097, 33], 16, 1, 64, torch.float32),
    ([4099], 128, 3, 16, torch.float32),
    ([3, 4, 9, 17, 2, 1, 65, 300], 128, 4, 1, torch.float32),
    ([255, 256, 257], 1, 4, 16, torch.float32),
    ([0, 0], 16, 2, 16, torch.float32),
    ([5000, 1], 16, 4, 64, torch.bfloat16),
    ([1, 2, 3, 4, 77, 111, 513], 128, 2, 16, torch.bfloat16),
    ([63, 64, 65], 16, 3, 1, torch.bfloat16),
    ([21, 4100], 1, 1, 16, torch.bfloat16),
]


@pytest.mark.parametrize(("lengths", "heads", "q_len", "block", "dtype"), GRID)
def test_torch_matches_dense_reference(lengths, heads, q_len, block, dtype):
    q, kv, bt, lens = make_paged_problem(
        lengths, num_heads=heads, q_len=q_len, block_size=block, dtype=dtype, seed=len(lengths)
    )
    check_against_dense(q, kv, bt, lens, dtype=dtype)


def test_non_causal_and_4d_cache_and_custom_scale():
    q, kv, bt, lens = make_paged_problem([9, 300], q_len=3, block_size=16, four_d=True, seed=5)
    check_against_dense(q, kv, bt, lens, dtype=torch.float32, causal=False, softmax_scale=0.07)


def test_small_latent_dims():
    q, kv, bt, lens = make_paged_problem([17, 3], num_heads=4, head_dim=96, block_size=16)
    check_against_dense(q, kv, bt, lens, dtype=torch.float32, head_dim_v=64)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
def test_fp8_cache_equals_dequantized(fp8):
    q, kv, bt, lens = make_paged_problem([40, 300, 0], block_size=16, nan_fill=False, seed=9)
    scale = 0.05
    kv8 = (kv / scale).clamp(-200, 200).to(fp8)
    out, lse = rocm_mla.mla_decode(q, kv8, bt, lens, kv_scale=scale, backend="torch")
    deq = kv8.to(torch.float32) * scale
    ref_out, ref_lse = rocm_mla.mla_decode(q, deq, bt, lens, backend="torch")
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_unused_slots_never_leak():
    """Garbage (NaN, inf) in every slot no request owns, and in unused block-table entries."""
    q, kv, bt, lens = make_paged_problem([3, 70, 16], block_size=16, seed=2)
    kv = torch.where(torch.isnan(kv), torch.tensor(math.inf), kv)
    bt[bt < 0] = 10_000  # out of range, but past every request's last block: ignored
    out, lse = rocm_mla.mla_decode(q, kv, bt, lens, backend="torch")
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)
@given(
    lengths=st.lists(st.integers(0, 600), min_size=1, max_size=5),
    heads=st.sampled_from([1, 2, 16, 20]),
    q_len=st.integers(1, 4),
    block=st.sampled_from([1, 4, 16, 64]),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fuzz_against_dense(lengths, heads, q_len, block, causal, seed):
    q, kv, bt, lens = make_paged_problem(
        lengths, num_heads=heads, q_len=q_len, block_size=block, head_dim=80, seed=seed
    )
    check_against_dense(q, kv, bt, lens, dtype=torch.float32, causal=causal, head_dim_v=64)


# ---- merge_states -----------------------------------------------------------------------


def test_merge_states_of_split_equals_unsplit():
    q, kv, bt, lens = make_paged_problem([700, 513, 64], num_heads=16, block_size=16, seed=4)
    full_out, full_lse = rocm_mla.mla_decode(q, kv, bt, lens, backend="torch")
    # Three disjoint key ranges per request, cut on block boundaries (some empty).
    cuts = [0, 16, 32 * 16, 10_000]
    outs, lses = [], []
    for lo, hi in itertools.pairwise(cuts):
        part_lens = (lens.clamp(min=lo, max=hi) - lo).to(torch.int32)
        part_bt = torch.zeros_like(bt)
        n = bt.shape[1] - lo // 16
        part_bt[:, :n] = bt[:, lo // 16 :]
        o, lse = rocm_mla.mla_decode(q, kv, part_bt, part_lens, causal=False, backend="torch")
        outs.append(o)
        lses.append(lse)
    out, lse = rocm_mla.merge_states(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(out, full_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, full_lse, atol=1e-5, rtol=1e-5)


def test_merge_states_drops_empty_partials_and_propagates_nan():
    gen = torch.Generator().manual_seed(0)
    outs = torch.randn(3, 5, 8, generator=gen)
    lses = torch.randn(3, 5, generator=gen)
    outs[1] = math.nan
    lses[1] = -math.inf  # an empty shard: garbage output, -inf lse
    lses[2, 0] = math.nan  # a broken partial: its row must come out NaN
    lses[2, 4] = math.inf  # an overflowed one: NaN too
    outs[0, 3] = math.nan  # a partial that saw a NaN (finite lse, NaN out)
    lses[:, 3] = -math.inf  # ... but in a row where every partial is empty
    out, lse = rocm_mla.merge_states(outs, lses)
    for row in (0, 4):
        assert torch.isnan(out[row]).all() and torch.isnan(lse[row])
    w = torch.softmax(lses[[0, 2], 1:3], dim=0)
    torch.testing.assert_close(out[1:3], (w[..., None] * outs[[0, 2], 1:3]).sum(0))
    torch.testing.assert_close(lse[1:3], torch.logsumexp(lses[[0, 2], 1:3], dim=0))
    assert (out[3] == 0).all() and lse[3] == -math.inf
    outs[0, 1, 2] = math.nan  # a NaN output in a partial with weight > 0 reaches the row
    out, _ = rocm_mla.merge_states(outs, lses)
    assert torch.isnan(out[1]).any()


def test_merge_states_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="merge_states: outs must be"):
        rocm_mla.merge_states(torch.zeros(2, 3, 8), torch.zeros(2, 4))


# ---- input validation -------------------------------------------------------------------


def _good():
    return make_paged_problem([20, 5], num_heads=2, block_size=16, head_dim=80, seed=1)


def _call(q, kv, bt, lens, **kw):
    kw.setdefault("head_dim_v", 64)
    return rocm_mla.mla_decode(q, kv, bt, lens, backend="torch", **kw)


BAD_INPUTS = [
    ("q rank", lambda q, kv, bt, L: (q[0], kv, bt, L, {}), "q must be 4-D"),
    ("q dtype", lambda q, kv, bt, L: (q.to(torch.int32), kv, bt, L, {}), "q must be float32"),
    (
        "kv last dim",
        lambda q, kv, bt, L: (q, kv[..., :70], bt, L, {}),
        "kv_cache must be last dim 80",
    ),
    ("kv rank", lambda q, kv, bt, L: (q, kv[0], bt, L, {}), "kv_cache must be [num_blocks"),
    (
        "kv heads",
        lambda q, kv, bt, L: (q, kv[:, :, None].expand(-1, -1, 2, -1), bt, L, {}),
        "one latent head",
    ),
    (
        "kv dtype",
        lambda q, kv, bt, L: (q, kv.to(torch.int8), bt, L, {}),
        "kv_cache must be float32",
    ),
    ("table dtype", lambda q, kv, bt, L: (q, kv, bt.long(), L, {}), "block_table must be int32"),
    ("table batch", lambda q, kv, bt, L: (q, kv, bt[:1], L, {}), "block_table must be 2-D [2"),
    ("lens dtype", lambda q, kv, bt, L: (q, kv, bt, L.long(), {}), "cache_seqlens must be int32"),
    ("lens shape", lambda q, kv, bt, L: (q, kv, bt, L[:1], {}), "cache_seqlens must be 1-D [2]"),
    (
        "lens negative",
        lambda q, kv, bt, L: (q, kv, bt, L - 6, {}),
        "cache_seqlens must be non-negative",
    ),
    ("lens capacity", lambda q, kv, bt, L: (q, kv, bt, L + 1000, {}), "block table's capacity"),
    (
        "block id high",
        lambda q, kv, bt, L: (q, kv, torch.where(bt >= 0, bt + 100, bt), L, {}),
        "block ids in [0, ",
    ),
    (
        "block id -1",
        lambda q, kv, bt, L: (q, kv, torch.full_like(bt, -1), L, {}),
        "out-of-range ids",
    ),
    ("device", lambda q, kv, bt, L: (q, kv.to("meta"), bt, L, {}), "on q's device cpu"),
    ("head_dim_v", lambda q, kv, bt, L: (q, kv, bt, L, {"head_dim_v": 80}), "head_dim_v must be"),
    (
        "scale",
        lambda q, kv, bt, L: (q, kv, bt, L, {"softmax_scale": -1.0}),
        "softmax_scale must be",
    ),
    (
        "scale nan",
        lambda q, kv, bt, L: (q, kv, bt, L, {"softmax_scale": math.nan}),
        "softmax_scale must be",
    ),
    (
        "fp8 no scale",
        lambda q, kv, bt, L: (q, kv.nan_to_num().to(torch.float8_e4m3fn), bt, L, {}),
        "kv_scale must be the per-tensor scale",
    ),
    (
        "scale non-fp8",
        lambda q, kv, bt, L: (q, kv, bt, L, {"kv_scale": 2.0}),
        "kv_scale must be None",
    ),
    (
        "not a tensor",
        lambda q, kv, bt, L: (q, kv, bt.tolist(), L, {}),
        "block_table must be a torch.Tensor",
    ),
]


@pytest.mark.parametrize(("case", "mutate", "message"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_named(case, mutate, message):
    q, kv, bt, lens, kw = mutate(*_good())
    with pytest.raises(ValueError) as info:
        _call(q, kv, bt, lens, **kw)
    assert message in str(info.value), str(info.value)
    assert str(info.value).startswith("mla_decode: ")


def test_impl_rejects_wrong_head_count():
    from rocm_mla.backends import backend_class

    impl = backend_class("torch")(num_heads=8, head_dim_v=64, rope_dim=16)
    q, kv, bt, lens = _good()
    with pytest.raises(ValueError, match=r"q must be \[B, S_q, 8, 80\]"):
        impl.forward(q, kv, bt, lens)
