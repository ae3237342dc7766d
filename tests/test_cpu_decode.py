"""The fused C++ CPU decode (rocm_mla.kernels.cpu_decode) against the float64 reference, and
its NaN, empty-row and bounds rules (those of the torch backend and the fault contract)."""

from __future__ import annotations

import math

import pytest
import torch

import rocm_mla
from rocm_mla.backends import torch_ref
from rocm_mla.inputs import FAULT_BEYOND_PLAN, FAULT_BEYOND_TABLE, FAULT_BLOCK_ID
from rocm_mla.kernels import cpu_decode
from tests.reference import dense_mla_decode, make_paged_problem

pytestmark = pytest.mark.skipif(
    cpu_decode.available() is not None, reason=str(cpu_decode.available())
)

D, DV = 576, 512
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
#: fp32 compute over at most a few hundred keys
TOL_FP32 = 2e-5


def _flag() -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32)


def _run(q, kv, bt, lens, *, causal=True, scale=None, kv_scale=None, max_seqlen=None, flag=None):
    return cpu_decode.decode(
        q,
        kv,
        bt,
        lens,
        head_dim_v=DV,
        softmax_scale=D**-0.5 if scale is None else scale,
        causal=causal,
        kv_scale=kv_scale,
        max_seqlen=max_seqlen,
        fault_flag=flag,
    )


def _dense(q, kv, bt, lens, *, causal=True, scale=None, kv_scale=None):
    return dense_mla_decode(
        q,
        kv.to(torch.float32) if kv.dtype.itemsize == 1 else kv,
        bt,
        lens,
        head_dim_v=DV,
        softmax_scale=scale,
        causal=causal,
        kv_scale=kv_scale,
    )


def _assert_close(out, lse, ref_out, ref_lse, tol, rows=None):
    """Rows ``rows`` (a bool [B, S_q], default all) equal the reference: same empty rows (out 0,
    lse -inf), no NaN, values to ``tol``."""
    rows = torch.ones(out.shape[:2], dtype=torch.bool) if rows is None else rows
    out, lse, ref_out, ref_lse = out[rows], lse[rows], ref_out[rows], ref_lse[rows]
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty)
    assert (lse[empty] == -math.inf).all() and (out[empty] == 0).all()
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse[~empty].double(), ref_lse[~empty], atol=tol, rtol=tol)


def _nan_heads(out, lse):
    """[B, S_q, H] bool: the (query position, head) rows NaN in out and lse; asserts none is
    partly NaN (a row is one position and head: README's NaN rule)."""
    nan = torch.isnan(lse)
    assert torch.equal(nan, torch.isnan(out).all(-1)), "a row is NaN in part of its values"
    assert torch.equal(nan, torch.isnan(out).any(-1)), "a row is NaN in part of its values"
    return nan


def _nan_rows(out, lse):
    """[B, S_q] bool: rows NaN in every head (out and lse); asserts no row is partly NaN."""
    row_nan = torch.isnan(lse).all(-1) & torch.isnan(out).flatten(2).all(-1)
    row_any = torch.isnan(lse).any(-1) | torch.isnan(out).flatten(2).any(-1)
    assert torch.equal(row_nan, row_any), "a row is NaN in some heads only"
    return row_nan


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("q_len", [1, 3, 8])
@pytest.mark.parametrize(("heads", "block"), [(1, 1), (4, 16), (16, 64), (128, 16)])
def test_matches_dense(heads, block, q_len, causal):
    lengths = [37, 5, 0, 130] if heads < 128 else [19, 70]
    q, kv, bt, lens = make_paged_problem(
        lengths, num_heads=heads, q_len=q_len, block_size=block, head_dim=D, seed=heads + q_len
    )
    out, lse = _run(q, kv, bt, lens, causal=causal)
    ref_out, ref_lse = _dense(q, kv, bt, lens, causal=causal)
    assert out.dtype == torch.float32 and out.shape == (len(lengths), q_len, heads, DV)
    _assert_close(out, lse, ref_out, ref_lse, TOL_FP32)


@pytest.mark.parametrize(
    ("q_dtype", "kv_dtype", "kv_scale", "tol"),
    [
        (torch.float32, torch.bfloat16, None, TOL_FP32),
        (torch.float32, torch.float16, None, TOL_FP32),
        (torch.bfloat16, torch.bfloat16, None, 1e-2),  # out rounded to bf16 (8 bits)
        (torch.float16, torch.float16, None, 2e-3),  # out rounded to fp16 (11 bits)
        (torch.float32, torch.float8_e4m3fn, 0.5, TOL_FP32),
        (torch.bfloat16, torch.float8_e4m3fnuz, 2.0, 1e-2),
    ],
)
def test_every_cache_dtype_matches_dense_of_the_stored_values(q_dtype, kv_dtype, kv_scale, tol):
    """The reference reads the cache as stored (after rounding to its dtype), so the tolerance
    covers the compute and the output rounding only."""
    q, kv, bt, lens = make_paged_problem(
        [33, 64, 1], num_heads=4, q_len=3, block_size=16, head_dim=D, nan_fill=False
    )
    q, kv = q.to(q_dtype), (kv * 0.5).to(kv_dtype)
    out, lse = _run(q, kv, bt, lens, kv_scale=kv_scale)
    ref_out, ref_lse = _dense(q, kv, bt, lens, kv_scale=kv_scale)
    assert out.dtype == q_dtype and lse.dtype == torch.float32
    _assert_close(out, lse, ref_out, ref_lse, tol)


def test_custom_softmax_scale_and_uncontiguous_cache():
    q, kv, bt, lens = make_paged_problem([40, 9], num_heads=4, head_dim=D, seed=3)
    wide = torch.zeros(kv.shape[0], kv.shape[1], 2 * D)
    wide[:, :, :D] = kv  # a cache whose rows are 2 * D apart
    out, lse = _run(q, wide[:, :, :D], bt, lens, scale=0.01)
    _assert_close(out, lse, *_dense(q, kv, bt, lens, scale=0.01), TOL_FP32)


@pytest.mark.parametrize("threads", [1, 2])
def test_thread_counts(threads):
    """One request, many heads: with 2 threads the heads split into groups (one task each)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, kv, bt, lens = make_paged_problem([150], num_heads=16, head_dim=D, seed=5)
        q[0, 0, 11, 3] = math.nan  # a head of the second group: its row alone is NaN
        out, lse = _run(q, kv, bt, lens)
        q2, kv2, bt2, lens2 = make_paged_problem([150, 60], num_heads=16, head_dim=D, seed=6)
        out2, lse2 = _run(q2, kv2, bt2, lens2)
    finally:
        torch.set_num_threads(before)
    nan = torch.zeros(1, 1, 16, dtype=torch.bool)
    nan[0, 0, 11] = True
    assert torch.equal(_nan_heads(out, lse), nan)
    _assert_close(out, lse, *_dense(q.nan_to_num(), kv, bt, lens), TOL_FP32, rows=~nan)
    _assert_close(out2, lse2, *_dense(q2, kv2, bt2, lens2), TOL_FP32)


def test_non_finite_query_is_nan_in_its_head_alone():
    q, kv, bt, lens = make_paged_problem([20, 20, 0], num_heads=4, q_len=2, head_dim=D)
    q[0, 1, 2, 7] = math.inf
    q[2, 0, 0, 0] = math.nan  # a row without keys stays empty
    out, lse = _run(q, kv, bt, lens)
    nan = torch.zeros(3, 2, 4, dtype=torch.bool)
    nan[0, 1, 2] = True
    assert torch.equal(_nan_heads(out, lse), nan)
    _assert_close(out, lse, *_dense(q.nan_to_num(), kv, bt, lens), TOL_FP32, rows=~nan)


@pytest.mark.parametrize(("column", "value"), [(3, math.nan), (DV + 5, math.inf), (0, -math.inf)])
def test_non_finite_visible_key_is_nan_only_in_the_rows_that_see_it(column, value):
    """A causal verify window of 3 rows over 30 keys: key 28 is seen by the last two rows only."""
    q, kv, bt, lens = make_paged_problem([30, 30], num_heads=4, q_len=3, head_dim=D, seed=2)
    kv[int(bt[0, 28 // 16]), 28 % 16, column] = value
    out, lse = _run(q, kv, bt, lens)
    nan = torch.tensor([[False, True, True], [False, False, False]])
    assert torch.equal(_nan_rows(out, lse), nan)
    clean = kv.clone()
    clean[int(bt[0, 1]), 12, column] = 0.0
    _assert_close(out, lse, *_dense(q, clean, bt, lens), TOL_FP32, rows=~nan)


def test_empty_lengths_see_no_keys_and_negative_ones_are_a_fault():
    q, kv, bt, lens = make_paged_problem([0, 2, 7], num_heads=4, q_len=3, head_dim=D)
    lens[2] = INT32_MIN
    flag = _flag()
    out, lse = _run(q, kv, bt, lens, flag=flag)
    assert int(flag) == 8  # FAULT_NEGATIVE_LENGTH
    assert torch.isnan(out[2]).all() and torch.isnan(lse[2]).all()
    _assert_close(out[:2], lse[:2], *_dense(q[:2], kv, bt[:2], lens[:2]), TOL_FP32)
    assert (lse[0] == -math.inf).all()
    assert (lse[1, 0] == -math.inf).all() and (lse[1, 2] > -math.inf).all()


@pytest.mark.parametrize("bad", ["num_blocks", -1, INT32_MIN, INT32_MAX, INT32_MIN + 1])
def test_bad_block_ids_are_never_read(bad):
    q, kv, bt, lens = make_paged_problem([40, 40, 10], num_heads=4, q_len=2, head_dim=D)
    bad_id = kv.shape[0] if bad == "num_blocks" else bad
    good = bt.clone()
    bt[0, 2] = bad_id  # keys 32..39: both rows of request 0 see them
    bt[1, 3] = bad_id  # a column no row of request 1 reaches: harmless
    bt[2, 0] = bad_id  # keys 0..9
    flag = _flag()
    out, lse = _run(q, kv, bt, lens, flag=flag)
    assert int(flag) == FAULT_BLOCK_ID
    nan = torch.tensor([[True, True], [False, False], [True, True]])
    assert torch.equal(_nan_rows(out, lse), nan)
    _assert_close(out, lse, *_dense(q, kv, good, lens), TOL_FP32, rows=~nan)


@pytest.mark.parametrize("length", [65, 1000, INT32_MAX])
def test_lengths_beyond_the_table_are_never_read(length):
    """The table holds 4 columns of 16 keys; a length past 64 names keys it does not hold."""
    q, kv, bt, lens = make_paged_problem([64, 20], num_heads=4, q_len=3, head_dim=D)
    assert bt.shape[1] == 5
    bt = bt[:, :4].contiguous()
    shifted = q.clone()
    shifted[0, 1:] = q[0, :2]
    # At length 64 every key is readable and row i + 1 sees what row i sees at length 65.
    full_out, full_lse = _run(shifted, kv, bt, lens)
    lens[0] = length
    flag = _flag()
    out, lse = _run(q, kv, bt, lens, flag=flag)
    assert int(flag) == FAULT_BEYOND_TABLE
    # Row i sees length - 2 + i keys: 63, 64 and 65 keys at length 65.
    row_nan = [length - 2 + i > 64 for i in range(3)]
    nan = torch.tensor([row_nan, [False] * 3])
    assert torch.equal(_nan_rows(out, lse), nan)
    _assert_close(
        out,
        lse,
        *_dense(q, kv, bt, lens.clamp(max=20)),
        TOL_FP32,
        rows=nan.clone().fill_(False).index_fill_(0, torch.tensor([1]), True),
    )
    if length == 65:  # its readable rows are the 64-key call's rows shifted by one
        torch.testing.assert_close(out[0, :2], full_out[0, 1:], atol=TOL_FP32, rtol=TOL_FP32)
        torch.testing.assert_close(lse[0, :2], full_lse[0, 1:], atol=TOL_FP32, rtol=TOL_FP32)


def test_lengths_above_the_plan_bound_are_nan_and_flagged():
    q, kv, bt, lens = make_paged_problem([40, 20], num_heads=4, q_len=2, head_dim=D)
    flag = _flag()
    out, lse = _run(q, kv, bt, lens, max_seqlen=39, flag=flag)
    assert int(flag) == FAULT_BEYOND_PLAN
    nan = torch.tensor([[False, True], [False, False]])  # row 0 sees 39 keys, row 1 sees 40
    assert torch.equal(_nan_rows(out, lse), nan)
    _assert_close(out, lse, *_dense(q, kv, bt, lens), TOL_FP32, rows=~nan)
    flag2 = torch.full((1,), FAULT_BLOCK_ID, dtype=torch.int32)
    _run(q, kv, bt, lens, max_seqlen=40, flag=flag2)
    assert int(flag2) == FAULT_BLOCK_ID  # nothing cleared, nothing added


@pytest.mark.parametrize(
    ("name", "mutate"),
    [
        ("block_table", lambda a: {**a, "block_table": a["block_table"].long()}),
        ("cache_seqlens", lambda a: {**a, "cache_seqlens": a["cache_seqlens"][:1]}),
        ("kv_cache", lambda a: {**a, "kv_cache": a["kv_cache"][:, :, :100]}),
        ("fault_flag", lambda a: {**a, "fault_flag": torch.zeros(1, dtype=torch.int64)}),
        ("head_dim_v", lambda a: {**a, "head_dim_v": D + 1}),
        ("_chunk_keys", lambda a: {**a, "_chunk_keys": -1}),
    ],
)
def test_bad_input_is_named(name, mutate):
    q, kv, bt, lens = make_paged_problem([5, 5], num_heads=2, head_dim=D)
    args = {
        "q": q,
        "kv_cache": kv,
        "block_table": bt,
        "cache_seqlens": lens,
        "head_dim_v": DV,
        "fault_flag": None,
    }
    args = mutate(args)
    with pytest.raises(ValueError, match=f"cpu_decode: {name} must be"):
        cpu_decode.decode(
            args.pop("q"),
            args.pop("kv_cache"),
            args.pop("block_table"),
            args.pop("cache_seqlens"),
            softmax_scale=0.1,
            causal=True,
            **args,
        )


# Key chunks: rows longer than the chunk are cut into several tasks and merged by LSE. The
# kernel never cuts below MIN_CHUNK_KEYS (256) on its own; `_chunk_keys` forces small chunks so
# that these shapes are cut into many.

#: One long request among short ones (block 16): no keys, 1 key, page boundaries (16, 64),
#: 48 = 2 chunks of 24 and 65 = one key past 64 (8 chunks of 8).
MIXED = [200, 0, 1, 16, 48, 64, 65, 7]


def _run_cut(q, kv, bt, lens, chunk, *, kv_scale=None, max_seqlen=None, flag=None):
    """(out, lse, keys per chunk the kernel used)."""
    return cpu_decode.decode_with_chunk(
        q,
        kv,
        bt,
        lens,
        head_dim_v=DV,
        softmax_scale=D**-0.5,
        causal=True,
        kv_scale=kv_scale,
        max_seqlen=max_seqlen,
        fault_flag=flag,
        chunk_keys=chunk,
    )


@pytest.mark.parametrize(
    ("kv_dtype", "kv_scale"),
    [(torch.float32, None), (torch.bfloat16, None), (torch.float8_e4m3fn, 0.5)],
)
@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize(("chunk", "used"), [(8, 8), (20, 24)])  # rounded up to the 8-key step
def test_cut_rows_match_dense_and_the_uncut_kernel(chunk, used, q_len, kv_dtype, kv_scale):
    """The 200-key request is cut into 9 or 25 chunks (its verify rows see 197..200 keys),
    the short ones at and around chunk and page boundaries; merged, every row equals the
    dense reference and the same kernel with no row cut, both to the fp32 tolerance."""
    q, kv, bt, lens = make_paged_problem(
        MIXED, num_heads=4, q_len=q_len, block_size=16, head_dim=D, seed=q_len + chunk
    )
    kv = kv.to(kv_dtype) if kv_dtype.itemsize > 1 else (kv * 0.5).to(kv_dtype)
    out, lse, got = _run_cut(q, kv, bt, lens, chunk, kv_scale=kv_scale)
    assert got == used
    _assert_close(out, lse, *_dense(q, kv, bt, lens, kv_scale=kv_scale), TOL_FP32)
    whole_out, whole_lse, none = _run_cut(q, kv, bt, lens, 0, kv_scale=kv_scale)
    assert none == 0
    empty = torch.isinf(whole_lse)
    torch.testing.assert_close(out, whole_out, atol=TOL_FP32, rtol=TOL_FP32)
    torch.testing.assert_close(lse[~empty], whole_lse[~empty], atol=TOL_FP32, rtol=TOL_FP32)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_chunk_rule_cuts_only_the_long_request(threads):
    """Without `_chunk_keys` the chunk is the total keys over threads x TASKS_PER_THREAD (at
    least MIN_CHUNK_KEYS): 1 x 2048 + 3 x 64 keys is cut into 4 (1 thread) or 8 chunks (2);
    4 x 200 keys are not cut."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, kv, bt, lens = make_paged_problem([2048, 64, 64, 64], num_heads=4, head_dim=D, seed=8)
        out, lse, chunk = _run_cut(q, kv, bt, lens, None)
        q2, kv2, bt2, lens2 = make_paged_problem([200] * 4, num_heads=4, head_dim=D, seed=9)
        out2, lse2, chunk2 = _run_cut(q2, kv2, bt2, lens2, None)
    finally:
        torch.set_num_threads(before)
    share = threads * cpu_decode.TASKS_PER_THREAD
    assert chunk == -(-2240 // share) == (560 if threads == 1 else 280)
    assert -(-2048 // chunk) == share
    assert chunk2 == cpu_decode.MIN_CHUNK_KEYS  # no row is longer: one task each
    _assert_close(out, lse, *_dense(q, kv, bt, lens), TOL_FP32)
    _assert_close(out2, lse2, *_dense(q2, kv2, bt2, lens2), TOL_FP32)


@pytest.mark.parametrize("threads", [1, 2])
def test_cut_rows_with_head_groups(threads):
    """One request on 2 threads: 16 heads in 2 groups, each cut into 13 chunks; a non-finite
    query element in one head poisons that head's merged row alone."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, kv, bt, lens = make_paged_problem([300], num_heads=16, q_len=2, head_dim=D, seed=10)
        out, lse, _ = _run_cut(q, kv, bt, lens, 24)
        bad = q.clone()
        bad[0, 1, 11, 3] = math.nan
        nan_out, nan_lse, _ = _run_cut(bad, kv, bt, lens, 24)
    finally:
        torch.set_num_threads(before)
    _assert_close(out, lse, *_dense(q, kv, bt, lens), TOL_FP32)
    nan = torch.zeros(1, 2, 16, dtype=torch.bool)
    nan[0, 1, 11] = True
    assert torch.equal(_nan_heads(nan_out, nan_lse), nan)
    torch.testing.assert_close(nan_out[~nan], out[~nan], atol=0, rtol=0)


@pytest.mark.parametrize(
    ("key", "column", "value"),
    [(5, 3, math.nan), (100, DV + 5, math.inf), (198, 0, -math.inf), (199, DV - 1, math.nan)],
)
def test_a_non_finite_key_in_one_chunk_poisons_the_merged_row(key, column, value):
    """Request 0 (200 keys, chunks of 24, rows see 197..200 keys) holds one non-finite
    element in key `key`: in its first, a middle or its last chunk. Exactly the rows that see
    the key are NaN in every head; the other rows and request 1 are unchanged."""
    q, kv, bt, lens = make_paged_problem([200, 30], num_heads=4, q_len=4, head_dim=D, seed=11)
    block, slot = int(bt[0, key // 16]), key % 16
    clean = kv.clone()
    kv[block, slot, column] = value
    out, lse, chunk = _run_cut(q, kv, bt, lens, 24)
    assert chunk == 24
    nan = torch.zeros(2, 4, dtype=torch.bool)
    nan[0] = torch.tensor([197 + i > key for i in range(4)])
    assert torch.equal(_nan_rows(out, lse), nan)
    _assert_close(out, lse, *_dense(q, clean, bt, lens), TOL_FP32, rows=~nan)


@pytest.mark.parametrize("bad", ["num_blocks", INT32_MIN, INT32_MAX])
def test_bad_block_ids_in_a_later_chunk_are_never_read(bad):
    """Column 10 (keys 160..175, the 7th and 8th chunks of 24) of request 0 names no block:
    its rows are NaN and fault, nothing is read from the bad id (INT32_MAX would be far past
    the cache); column 13 of request 1 lies past its 200 keys and is harmless."""
    q, kv, bt, lens = make_paged_problem([200, 200, 40], num_heads=4, q_len=2, head_dim=D)
    good = bt.clone()
    bad_id = kv.shape[0] if bad == "num_blocks" else bad
    bt[0, 10] = bad_id
    bt[1, 13] = bad_id
    flag = _flag()
    out, lse, _ = _run_cut(q, kv, bt, lens, 24, flag=flag)
    assert int(flag) == FAULT_BLOCK_ID
    nan = torch.tensor([[True, True], [False, False], [False, False]])
    assert torch.equal(_nan_rows(out, lse), nan)
    _assert_close(out, lse, *_dense(q, kv, good, lens), TOL_FP32, rows=~nan)


def test_cut_rows_next_to_rows_past_the_table_or_the_plan():
    """A verify window of 4 rows over 209 keys and a 13-column table (208 keys): rows 0-2
    (206-208 keys) are cut and exact, row 3 is NaN and faults BEYOND_TABLE. With a plan bound
    of 200 on 201 keys, row 3 (201 keys) is NaN and faults BEYOND_PLAN."""
    q, kv, bt, lens = make_paged_problem([208, 40], num_heads=4, q_len=4, head_dim=D, seed=12)
    bt = bt[:, :13].contiguous()
    lens[0] = 209
    flag = _flag()
    out, lse, _ = _run_cut(q, kv, bt, lens, 24, flag=flag)
    assert int(flag) == FAULT_BEYOND_TABLE
    nan = torch.tensor([[False, False, False, True], [False] * 4])
    assert torch.equal(_nan_rows(out, lse), nan)
    # Request 0's row i at 209 keys sees what its row i + 1 sees at 208; request 1 as it is.
    shifted = q.clone()
    shifted[0, 1:] = q[0, :3]
    ref_out, ref_lse = _dense(shifted, kv, bt, lens.clamp(max=208))
    _assert_close(out[:1, :3], lse[:1, :3], ref_out[:1, 1:], ref_lse[:1, 1:], TOL_FP32)
    _assert_close(out[1:], lse[1:], *_dense(q[1:], kv, bt[1:], lens[1:]), TOL_FP32)

    lens[0] = 201
    flag = _flag()
    out, lse, _ = _run_cut(q, kv, bt, lens, 24, max_seqlen=200, flag=flag)
    assert int(flag) == FAULT_BEYOND_PLAN
    assert torch.equal(_nan_rows(out, lse), nan)
    _assert_close(out, lse, *_dense(q, kv, bt, lens), TOL_FP32, rows=~nan)


def test_torch_backend_runs_the_kernel_on_the_cpu(monkeypatch):
    calls = []
    real = cpu_decode.decode

    def counting(*args, **kwargs):
        calls.append(kwargs["max_seqlen"])
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_decode, "decode", counting)
    q, kv, bt, lens = make_paged_problem([30, 12], num_heads=4, head_dim=D)
    out, _ = rocm_mla.mla_decode(q, kv, bt, lens, backend="torch")
    plan = rocm_mla.plan_decode(
        [30, 12], q_len=1, num_heads=4, kv_dtype=kv.dtype, head_dim_v=DV, backend="torch"
    )
    planned, _ = rocm_mla.mla_decode(q, kv, bt, lens, plan=plan)
    assert len(calls) == 2 and calls[1] == 30  # the one-shot call plans for itself
    # Exact on purpose: both calls run the very same kernel on the same data and threads;
    # only the length bound it is handed differs, which changes no arithmetic.
    torch.testing.assert_close(out, planned, atol=0, rtol=0)
    monkeypatch.setattr(torch_ref, "cpu_kernel_unavailable", lambda: "forced off")
    ops, _ = rocm_mla.mla_decode(q, kv, bt, lens, backend="torch")
    assert len(calls) == 2
    torch.testing.assert_close(ops, out, atol=TOL_FP32, rtol=TOL_FP32)
