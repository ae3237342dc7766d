"""The torch backend's bounds: planned calls exact over the plan's range, never a read outside
the cache or the table, the rows that may see a key they must not read NaN with the cause in
``fault_flag``, and non-finite keys NaN in every head.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import rocm_mla
from rocm_mla.backends import torch_ref
from rocm_mla.backends.torch_ref import TorchMLAImpl
from rocm_mla.inputs import (
    DEBUG_ENV_VAR,
    FAULT_BEYOND_PLAN,
    FAULT_BEYOND_TABLE,
    FAULT_BLOCK_ID,
    FAULT_NEGATIVE_LENGTH,
    prepare_decode,
)
from tests.reference import dense_mla_decode, make_paged_problem
from tests.test_plan import HostReadCounter

HEAD_DIM, DV = 80, 64
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


@pytest.fixture(autouse=True, params=["cpp", "fused", "bmm"])
def attend(request, monkeypatch):
    """Every test on each compute path: the fused C++ CPU kernel, the torch ops' fused
    attention it replaces when it builds, and the batched GEMMs a GPU runs (forced here on
    the CPU)."""
    # The debug checks would refuse these calls before the backend runs; the point here is
    # what the backend itself does with them.
    monkeypatch.delenv(DEBUG_ENV_VAR, raising=False)
    if request.param == "cpp":
        if torch_ref.cpu_kernel_unavailable() is not None:
            pytest.skip(torch_ref.cpu_kernel_unavailable())
    else:
        monkeypatch.setattr(torch_ref, "cpu_kernel_unavailable", lambda: "forced off")
    if request.param == "bmm":
        monkeypatch.setattr(torch_ref, "_attend_fused", torch_ref._attend_bmm)
    return request.param


def _problem(lengths, *, q_len=1, heads=4, block=16, seed=0):
    return make_paged_problem(
        lengths, num_heads=heads, q_len=q_len, block_size=block, head_dim=HEAD_DIM, seed=seed
    )


def _plan(q, kv, *, lengths=None, graph_max_seqlen=None):
    """A torch plan for ``lengths``, or a graph plan for any lengths up to the bound."""
    return rocm_mla.plan_decode(
        torch.zeros(q.shape[0], dtype=torch.int32) if lengths is None else lengths,
        q_len=q.shape[1],
        num_heads=q.shape[2],
        kv_dtype=kv.dtype,
        head_dim_v=DV,
        rope_dim=HEAD_DIM - DV,
        graph_max_seqlen=graph_max_seqlen,
        backend="torch",
    )


def _planned(q, kv, bt, lens, plan, flag=None):
    """A planned call that reads nothing back (checked), with ``fault_flag`` set."""
    problem = prepare_decode(
        q,
        kv,
        bt,
        lens,
        head_dim_v=DV,
        softmax_scale=None,
        causal=True,
        kv_scale=None,
        check_values=False,
    )
    problem = dataclasses.replace(problem, fault_flag=flag)
    impl = TorchMLAImpl(num_heads=q.shape[2], head_dim_v=DV, rope_dim=HEAD_DIM - DV)
    with HostReadCounter() as counter:
        out, lse = impl.run(problem, plan)
    assert counter.reads == [], f"planned call read tensors back: {counter.reads}"
    return out, lse


def _assert_rows(out, lse, ref_out, ref_lse, nan_rows):
    """``nan_rows``: (b, i) pairs that must be NaN in every head; every other row exact."""
    expect_nan = torch.zeros(out.shape[:2], dtype=torch.bool)
    for b, i in nan_rows:
        expect_nan[b, i] = True
    assert torch.isnan(out[expect_nan]).all() and torch.isnan(lse[expect_nan]).all()
    good = ~expect_nan
    assert not torch.isnan(out[good]).any() and not torch.isnan(lse[good]).any()
    torch.testing.assert_close(out[good].double(), ref_out[good], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[good].double(), ref_lse[good], atol=1e-5, rtol=1e-5)


def _dense(q, kv, bt, lens):
    return dense_mla_decode(q, kv, bt, lens, head_dim_v=DV)


@pytest.mark.parametrize(
    ("plan_kw", "lengths"),
    [
        ({"lengths": [16, 16]}, [13, 6]),  # below the plan's min_seqlen
        ({"lengths": [2, 40]}, [13, 6]),
        ({"lengths": [40, 40]}, [0, 40]),
        ({"graph_max_seqlen": 64}, [13, 6]),
        ({"graph_max_seqlen": 64}, [64, 1]),
    ],
)
@pytest.mark.parametrize("q_len", [1, 3])
def test_planned_call_is_exact_for_every_length_the_plan_covers(plan_kw, lengths, q_len):
    q, kv, bt, lens = _problem(lengths, q_len=q_len, seed=sum(lengths))
    bt = torch.nn.functional.pad(bt, (0, 4 - bt.shape[1]), value=-1)  # capacity 64
    plan = _plan(q, kv, **plan_kw)
    flag = torch.zeros(1, dtype=torch.int32)
    out, lse = _planned(q, kv, bt, lens, plan, flag)
    _assert_rows(out, lse, *_dense(q, kv, bt, lens), nan_rows=[])
    assert int(flag) == 0


@pytest.mark.parametrize(
    "plan_kw", [{"lengths": [2, 2]}, {"graph_max_seqlen": 4}, {"lengths": [2, 12]}]
)
def test_lengths_above_the_plan_are_nan_and_flagged(plan_kw):
    """The issue's case: plans for [2, 2], graph_max_seqlen=4, a call with [13, 6]."""
    q, kv, bt, lens = _problem([13, 6], q_len=1, seed=1)
    plan = _plan(q, kv, **plan_kw)
    flag = torch.zeros(1, dtype=torch.int32)
    out, lse = _planned(q, kv, bt, lens, plan, flag)
    beyond = [(b, 0) for b, n in enumerate([13, 6]) if n > plan.max_seqlen]
    _assert_rows(out, lse, *_dense(q, kv, bt, lens), nan_rows=beyond)
    assert int(flag) == FAULT_BEYOND_PLAN


def test_only_the_window_rows_past_the_plan_are_nan():
    # Verify window of 3 over length 13, plan up to 12: rows see 11, 12, 13 keys.
    q, kv, bt, lens = _problem([13, 9], q_len=3, seed=2)
    plan = _plan(q, kv, lengths=[12, 9])
    flag = torch.zeros(1, dtype=torch.int32)
    out, lse = _planned(q, kv, bt, lens, plan, flag)
    _assert_rows(out, lse, *_dense(q, kv, bt, lens), nan_rows=[(0, 2)])
    assert int(flag) == FAULT_BEYOND_PLAN


@pytest.mark.parametrize("bad_id", [INT32_MIN, -(10**6), -1, "num_blocks", 10**6, INT32_MAX])
def test_out_of_range_block_ids_are_never_read(bad_id):
    q, kv, bt, lens = _problem([40, 30, 5], q_len=2, seed=3)
    # Cache as a view inside a larger buffer whose neighbouring blocks hold NaN: a read past
    # either end would turn an exact row into NaN (and torch's gather raises on an index
    # outside the view).
    big = torch.full((kv.shape[0] + 2, *kv.shape[1:]), math.nan)
    big[1:-1] = kv
    kv = big[1:-1]
    bad = kv.shape[0] if bad_id == "num_blocks" else bad_id
    bt[0, 1] = bad  # request 0, keys 16..31: both window rows (39, 40 keys) see them
    bt[1, 1] = bad  # request 1, keys 16..29 of 30: seen by both rows
    bt[2, 1] = bad  # past request 2's last block: never seen, no fault
    ref_bt = bt.clone()
    ref_bt[:2, 1] = 0  # the reference reads some real block instead; those rows are NaN
    plan = _plan(q, kv, lengths=[40, 30, 5])
    flag = torch.zeros(1, dtype=torch.int32)
    out, lse = _planned(q, kv, bt, lens, plan, flag)
    _assert_rows(out, lse, *_dense(q, kv, ref_bt, lens), [(0, 0), (0, 1), (1, 0), (1, 1)])
    assert int(flag) == FAULT_BLOCK_ID


def test_bad_block_seen_only_by_the_last_window_row():
    q, kv, bt, lens = _problem([17, 20], q_len=2, seed=4)
    bt[0, 1] = -7  # key 16: row 1 (17 keys) sees it, row 0 (16 keys) does not
    ref_bt = bt.clone()
    ref_bt[0, 1] = 0
    flag = torch.zeros(1, dtype=torch.int32)
    out, lse = _planned(q, kv, bt, lens, _plan(q, kv, lengths=[17, 20]), flag)
    _assert_rows(out, lse, *_dense(q, kv, ref_bt, lens), nan_rows=[(0, 1)])
    assert int(flag) == FAULT_BLOCK_ID


@pytest.mark.parametrize("length", [65, 1000, INT32_MAX])
def test_lengths_beyond_the_table_are_never_read(length):
    q, kv, bt, lens = _problem([64, 50], q_len=1, seed=5)
    bt = torch.nn.functional.pad(bt, (0, 4 - bt.shape[1]), value=0)  # capacity 64
    ref_lens = lens.clone()
    lens[0] = length
    plan = _plan(q, kv, graph_max_seqlen=INT32_MAX)
    flag = torch.zeros(1, dtype=torch.int32)
    out, lse = _planned(q, kv, bt, lens, plan, flag)
    _assert_rows(out, lse, *_dense(q, kv, bt, ref_lens), nan_rows=[(0, 0)])
    assert int(flag) == FAULT_BEYOND_TABLE


def test_negative_lengths_are_a_fault_not_an_empty_request():
    q, kv, bt, lens = _problem([20, 7], q_len=2, seed=6)
    lens[0] = INT32_MIN
    flag = torch.zeros(1, dtype=torch.int32)
    out, lse = _planned(q, kv, bt, lens, _plan(q, kv, lengths=[20, 7]), flag)
    assert torch.isnan(out[0]).all() and torch.isnan(lse[0]).all()
    ref_out, ref_lse = _dense(q, kv, bt, lens.clamp(min=0))
    torch.testing.assert_close(out[1].double(), ref_out[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[1].double(), ref_lse[1], atol=1e-5, rtol=1e-5)
    assert int(flag) == FAULT_NEGATIVE_LENGTH


def test_fault_bits_accumulate_and_are_never_cleared():
    q, kv, bt, lens = _problem([20, 7], seed=7)
    bt[1, 0] = 10**6
    lens[0] = 10**5
    flag = torch.full((1,), FAULT_BEYOND_PLAN, dtype=torch.int32)
    _planned(q, kv, bt, lens, _plan(q, kv, graph_max_seqlen=10**6), flag)
    assert int(flag) == FAULT_BEYOND_PLAN | FAULT_BLOCK_ID | FAULT_BEYOND_TABLE


@pytest.mark.parametrize("column", [0, DV + 3], ids=["in V", "in rope"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_inf_in_a_visible_row_is_nan_in_every_head(column, sign):
    q, kv, bt, lens = _problem([30, 12], heads=4, seed=8)
    q[0, 0, :, column] = torch.tensor([2.0, -1.0, 0.5, -3.0])  # +inf and -inf scores
    kv[int(bt[0, 1]), 4, column] = sign * math.inf  # request 0, key 20
    ref_out, ref_lse = _dense(q, kv, bt, lens)
    for planned in (False, True):
        if planned:
            out, lse = _planned(q, kv, bt, lens, _plan(q, kv, lengths=[30, 12]))
        else:
            out, lse = rocm_mla.mla_decode(q, kv, bt, lens, head_dim_v=DV, backend="torch")
        assert torch.isnan(lse[0, 0]).all(), f"lse {lse[0, 0].tolist()}"
        assert torch.isnan(out[0, 0]).all(dim=-1).all()
        torch.testing.assert_close(out[1].double(), ref_out[1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[1].double(), ref_lse[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("q_dtype", "kv_dtype", "tol"),
    [
        (torch.float32, torch.float32, 1e-5),
        (torch.bfloat16, torch.bfloat16, 2e-2),
        (torch.float16, torch.float16, 2e-3),
        (torch.float32, torch.bfloat16, 1e-5),
        (torch.bfloat16, torch.float8_e4m3fn, 2e-2),
    ],
)
@pytest.mark.parametrize(("q_len", "causal"), [(1, True), (3, True), (8, True), (2, False)])
def test_every_dtype_matches_dense(q_dtype, kv_dtype, tol, q_len, causal, monkeypatch):
    # Chunks of 16 tokens: the merge across chunks runs too.
    monkeypatch.setattr(torch_ref, "CHUNK_BYTES", 1)
    monkeypatch.setattr(torch_ref, "MIN_CHUNK_TOKENS", 16)
    q, kv, bt, lens = _problem([70, 0, 1, 33], q_len=q_len, heads=5, seed=9)
    scale = None
    if kv_dtype == torch.float8_e4m3fn:
        scale = 0.05
        kv = (kv / scale).nan_to_num(nan=1e4).clamp(-400, 400).to(kv_dtype)
        deq = kv.to(torch.float32) * scale
    else:
        deq = kv.to(kv_dtype).to(torch.float32)
        kv = kv.to(kv_dtype)
    q = q.to(q_dtype)
    out, lse = rocm_mla.mla_decode(
        q, kv, bt, lens, head_dim_v=DV, causal=causal, kv_scale=scale, backend="torch"
    )
    ref_out, ref_lse = dense_mla_decode(q.float(), deq, bt, lens, head_dim_v=DV, causal=causal)
    assert out.dtype == q_dtype and lse.dtype == torch.float32
    empty = torch.isinf(ref_lse)
    assert (lse[empty] == -math.inf).all() and (out[empty] == 0).all()
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double()[~empty], ref_lse[~empty], atol=tol, rtol=tol)
