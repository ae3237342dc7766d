"""One NaN rule on every path (README): a row is one (query position, head), and a non-finite
value poisons exactly the rows that see it. A non-finite element of one head's query is seen
by that head's row alone; a non-finite cache element by every head of the query positions
whose window holds that key; an overflowing score by its own head.

The same cases on the fused CPU kernel, the chunked torch path, Triton (interpreter) and
AITER's wrapper (through ``tests/aiter_interface_model.py`` on a pretend MI300X)."""

from __future__ import annotations

import math

import pytest
import torch

import rocm_mla
from rocm_mla.backends import torch_ref
from rocm_mla.kernels import cpu_decode
from tests.reference import make_paged_problem
from tests.test_faults import aiter_model  # noqa: F401  (fixture)

BACKENDS = ["torch-fused", "torch-chunked", "triton", "aiter"]


@pytest.fixture
def backend(request, monkeypatch):
    name = request.param
    if name == "torch-fused":
        if cpu_decode.available() is not None:
            pytest.skip(cpu_decode.available())
    elif name == "torch-chunked":
        monkeypatch.setattr(torch_ref, "cpu_kernel_unavailable", lambda: "forced by the test")
    elif name == "triton":
        pytest.importorskip("triton")
        from rocm_mla.backends.triton import TritonMLAImpl

        if TritonMLAImpl.unavailable_reason():
            pytest.skip(TritonMLAImpl.unavailable_reason())
    else:
        request.getfixturevalue("aiter_model")
    return {"torch-fused": "torch", "torch-chunked": "torch"}.get(name, name)


def _cases():
    """(name, q, kv, block table, lengths, kwargs, the NaN rows as a [B, S_q, H] mask)."""
    heads = 16  # aiter's head count; two query positions (a causal verify window)
    q, kv, bt, lens = make_paged_problem([40, 25, 0], num_heads=heads, q_len=2, seed=9)
    none = torch.zeros(3, 2, heads, dtype=torch.bool)
    cases = []
    q_nan = q.clone()
    q_nan[0, 1, 5, 3] = math.nan  # request 0, position 1, head 5 only
    cases.append(("nan in one head of q", q_nan, kv, {}, [(0, 1, 5)]))
    q_inf = q.clone()
    q_inf[1, 0, 2, 500] = math.inf  # a rope element of head 2
    cases.append(("inf in one head of q", q_inf, kv, {}, [(1, 0, 2)]))
    kv_nan = kv.clone()
    kv_nan[int(bt[1, 1]), 3, 100] = math.nan  # request 1, token 19: both positions see it
    cases.append(
        (
            "nan in a visible cache row",
            q,
            kv_nan,
            {},
            [(1, i, h) for i in (0, 1) for h in range(heads)],
        )
    )
    kv_last = kv.clone()
    kv_last[int(bt[0, 2]), 7, 3] = math.nan  # request 0, token 39: position 1 alone sees it
    cases.append(
        ("nan in the window's last key", q, kv_last, {}, [(0, 1, h) for h in range(heads)])
    )
    q_big = q.clone()
    q_big[0, 0, 7] = 3e38  # head 7's products with the keys overflow: scores not finite
    cases.append(("one head's scores overflow", q_big, kv, {}, [(0, 0, 7)]))
    for name, qq, kk, kwargs, rows in cases:
        mask = none.clone()
        for row in rows:
            mask[row] = True
        yield name, qq, kk, bt, lens, kwargs, mask


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_a_non_finite_value_poisons_exactly_the_rows_that_see_it(backend):
    for name, q, kv, bt, lens, kwargs, nan_rows in _cases():
        if backend == "aiter" and "overflow" in name:
            # The interface model scores in float64, where these products do not overflow
            # (AITER's kernel accumulates in fp32); the other cases hold there.
            continue
        out, lse = rocm_mla.mla_decode(q, kv, bt, lens, head_dim_v=512, backend=backend, **kwargs)
        got = torch.isnan(lse)
        assert torch.equal(got, nan_rows), f"{name}: NaN lse rows {got.nonzero().tolist()}"
        assert torch.equal(torch.isnan(out).all(-1), nan_rows), f"{name}: out rows"
        # Every other row is finite, and the request without keys is empty.
        assert torch.isfinite(out[~nan_rows]).all(), name
        assert (lse[2] == -math.inf).all() and (out[2] == 0).all(), f"{name}: empty request"


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_a_planned_negative_length_is_a_fault_not_an_empty_request(backend, monkeypatch):
    """A planned call does not check lengths on the host: a negative one makes every row of
    its request NaN and sets ``FAULT_NEGATIVE_LENGTH``; the other requests are exact. Under
    ``ROCM_MLA_DEBUG=1`` the call raises instead."""
    from rocm_mla.inputs import DEBUG_ENV_VAR, FAULT_NEGATIVE_LENGTH, KVBoundsError

    q, kv, bt, _ = make_paged_problem([20, 9, 7], num_heads=16, q_len=2, seed=4)
    plan = rocm_mla.plan_decode(
        [20, 9, 7], q_len=2, num_heads=16, kv_dtype=kv.dtype, q_dtype=q.dtype, backend=backend
    )
    good = torch.tensor([20, 9, 7], dtype=torch.int32)
    ref_out, ref_lse = rocm_mla.mla_decode(q, kv, bt, good, head_dim_v=512, plan=plan)
    lens = torch.tensor([20, -3, 7], dtype=torch.int32)
    flag = torch.zeros(1, dtype=torch.int32)
    out, lse = rocm_mla.mla_decode(q, kv, bt, lens, head_dim_v=512, plan=plan, fault_flag=flag)
    assert int(flag) == FAULT_NEGATIVE_LENGTH
    assert torch.isnan(lse[1]).all() and torch.isnan(out[1]).all()
    for b in (0, 2):
        torch.testing.assert_close(out[b], ref_out[b], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[b], ref_lse[b], atol=1e-5, rtol=1e-5)
    assert rocm_mla.inputs._FAULT_TEXT[FAULT_NEGATIVE_LENGTH] == "a length is negative"
    with pytest.raises(KVBoundsError, match="a length is negative"):
        rocm_mla.raise_on_fault(flag, "step 3")
    monkeypatch.setenv(DEBUG_ENV_VAR, "1")
    with pytest.raises(
        ValueError, match=r"cache_seqlens must be non-negative, got a minimum of -3"
    ):
        rocm_mla.mla_decode(q, kv, bt, lens, head_dim_v=512, plan=plan)
