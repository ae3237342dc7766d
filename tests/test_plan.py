"""The plan/execute split: ``plan_decode`` once per step, ``mla_decode(..., plan=)`` per layer.

Planned and one-shot calls must give identical results on every backend, a plan must serve
every layer of a step, and a planned call must read nothing back from the device.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.overrides import TorchFunctionMode

import rocm_mla
from rocm_mla.backends import aiter as aiter_backend
from rocm_mla.inputs import DEBUG_ENV_VAR
from tests import aiter_interface_model
from tests.reference import make_paged_problem

#: Tensor methods that copy device values to the host (a sync on a GPU).
HOST_READS = {"item", "tolist", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy"}


class HostReadCounter(TorchFunctionMode):
    """Records every tensor method call that reads values back to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.paused = False  # inside a kernel stand-in (a kernel reads device memory itself)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS and not self.paused:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def _plan(lens, q, kv, **kwargs):
    return rocm_mla.plan_decode(
        lens,
        q_len=q.shape[1],
        num_heads=q.shape[2],
        kv_dtype=kv.dtype,
        q_dtype=q.dtype,
        **kwargs,
    )


@pytest.fixture
def aiter_model(monkeypatch):
    """The aiter backend routed to the interface model on a pretend MI300X (as test_aiter)."""
    aiter_interface_model.use_in_backend(monkeypatch)
    monkeypatch.setattr(aiter_backend, "_torch_build", lambda: "rocm")
    monkeypatch.setattr(aiter_backend, "_gpu_arch", lambda: "gfx942")
    monkeypatch.setattr(aiter_backend.AiterMLAImpl, "capabilities", _cpu_aiter_capabilities())


def _cpu_aiter_capabilities():
    caps = aiter_backend.AiterMLAImpl.capabilities
    return type(caps)(
        platforms=("cpu",),
        q_dtypes=(torch.float32, torch.bfloat16),
        kv_dtypes=(torch.float32, *caps.kv_dtypes),
    )


@pytest.mark.parametrize(
    ("backend", "heads", "q_len", "block", "lengths"),
    [
        ("torch", 16, 1, 16, [200, 17, 0, 1]),
        ("torch", 4, 3, 1, [5, 40]),
        ("torch", 128, 2, 64, [130, 64]),
        ("triton", 16, 1, 16, [70, 3, 0]),
        ("triton", 4, 2, 16, [33, 18]),
        ("aiter", 16, 1, 16, [90, 12, 1]),
        ("aiter", 8, 2, 16, [40, 7]),
    ],
)
def test_planned_call_equals_one_shot(request, backend, heads, q_len, block, lengths):
    if backend == "triton":
        pytest.importorskip("triton")
        from rocm_mla.backends.triton import TritonMLAImpl

        if TritonMLAImpl.unavailable_reason():
            pytest.skip(TritonMLAImpl.unavailable_reason())
    if backend == "aiter":
        request.getfixturevalue("aiter_model")
    q, kv, bt, lens = make_paged_problem(
        lengths, num_heads=heads, q_len=q_len, block_size=block, seed=len(lengths)
    )
    one_shot = rocm_mla.mla_decode(q, kv, bt, lens, backend=backend)
    plan = _plan(lens, q, kv, backend=backend, block_table=bt, kv_cache=kv)
    assert plan.backend == backend
    planned = rocm_mla.mla_decode(q, kv, bt, lens, plan=plan)
    for a, b in zip(one_shot, planned, strict=True):
        assert torch.equal(a, b)


def test_one_plan_serves_every_layer_of_a_step():
    lengths = [150, 31, 64]
    plan = rocm_mla.plan_decode(lengths, q_len=1, num_heads=16, kv_dtype=torch.float32)
    assert (plan.min_seqlen, plan.max_seqlen, plan.total_seqlen) == (31, 150, 245)
    for layer in range(3):  # each layer has its own cache and queries, the same lengths
        q, kv, bt, lens = make_paged_problem(lengths, seed=100 + layer)
        ref = rocm_mla.mla_decode(q, kv, bt, lens, backend="torch")
        got = rocm_mla.mla_decode(q, kv, bt, lens, plan=plan)
        torch.testing.assert_close(got[0], ref[0], atol=0, rtol=0)
        torch.testing.assert_close(got[1], ref[1], atol=0, rtol=0)


def test_planned_call_reads_nothing_back(monkeypatch):
    monkeypatch.delenv(DEBUG_ENV_VAR, raising=False)
    q, kv, bt, lens = make_paged_problem([300, 5, 77], num_heads=16, block_size=16, seed=3)
    plan = rocm_mla.plan_decode(
        [300, 5, 77], q_len=1, num_heads=16, kv_dtype=kv.dtype, backend="torch"
    )
    with HostReadCounter() as decoding:
        rocm_mla.mla_decode(q, kv, bt, lens, plan=plan)
    assert decoding.reads == [], f"planned mla_decode read tensors back: {decoding.reads}"
    with HostReadCounter() as one_shot:
        rocm_mla.mla_decode(q, kv, bt, lens, backend="torch")
    assert one_shot.reads, "the counter must see the one-shot call's value checks"


def test_planned_aiter_call_reads_nothing(aiter_model, monkeypatch):
    monkeypatch.delenv(DEBUG_ENV_VAR, raising=False)
    q, kv, bt, lens = make_paged_problem([64, 9], num_heads=16, block_size=16, seed=4)
    plan = _plan([64, 9], q, kv, backend="aiter")
    counter = HostReadCounter()
    kernel = aiter_interface_model.mla_decode_fwd

    def paused_kernel(*args, **kwargs):
        counter.paused = True
        try:
            return kernel(*args, **kwargs)
        finally:
            counter.paused = False

    monkeypatch.setattr(aiter_interface_model, "mla_decode_fwd", paused_kernel)
    with counter:
        out, _ = rocm_mla.mla_decode(q, kv, bt, lens, plan=plan)
    assert counter.reads == [], f"planned aiter call read tensors back: {counter.reads}"
    ref, _ = rocm_mla.mla_decode(q, kv, bt, lens, backend="torch")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_graph_plan_covers_any_lengths_up_to_its_bound():
    plan = rocm_mla.plan_decode(
        torch.zeros(2, dtype=torch.int32),
        q_len=1,
        num_heads=16,
        kv_dtype=torch.float32,
        graph_max_seqlen=256,
        backend="torch",
    )
    assert plan.bounds_only and (plan.min_seqlen, plan.max_seqlen) == (0, 256)
    for lengths in ([256, 1], [0, 100], [17, 255]):
        q, kv, bt, lens = make_paged_problem(lengths, seed=sum(lengths))
        bt = torch.nn.functional.pad(bt, (0, 16 - bt.shape[1]), value=0)  # capacity 256
        ref = rocm_mla.mla_decode(q, kv, bt, lens, backend="torch")
        got = rocm_mla.mla_decode(q, kv, bt, lens, plan=plan)
        torch.testing.assert_close(got[0], ref[0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got[1], ref[1], atol=1e-6, rtol=1e-5)


def test_call_that_does_not_match_its_plan_is_refused():
    q, kv, bt, lens = make_paged_problem([20, 30], num_heads=16, seed=5)
    plan = _plan(lens, q, kv, backend="torch")
    with pytest.raises(ValueError, match=r"does not match its plan.*num_heads: plan 16, call 8"):
        rocm_mla.mla_decode(q[:, :, :8], kv, bt, lens, plan=plan)
    with pytest.raises(ValueError, match="batch: plan 2, call 1"):
        rocm_mla.mla_decode(q[:1], kv, bt[:1], lens[:1], plan=plan)
    with pytest.raises(ValueError, match="kv_cache dtype"):
        rocm_mla.mla_decode(q.half(), kv.half(), bt, lens, plan=plan)
    with pytest.raises(ValueError, match="plan must be a DecodePlan"):
        rocm_mla.mla_decode(q, kv, bt, lens, plan="torch")


def test_planned_call_keeps_shape_errors_and_debug_mode_adds_value_checks(monkeypatch):
    q, kv, bt, lens = make_paged_problem([20, 30], num_heads=16, seed=6)
    plan = _plan(lens, q, kv, backend="torch")
    with pytest.raises(ValueError, match="mla_decode: block_table must be int32"):
        rocm_mla.mla_decode(q, kv, bt.long(), lens, plan=plan)
    bad = bt.clone()
    bad[0, 0] = 10_000
    monkeypatch.setenv(DEBUG_ENV_VAR, "1")
    with pytest.raises(ValueError, match="block ids in"):
        rocm_mla.mla_decode(q, kv, bad, lens, plan=plan)
    shorter = torch.tensor([5, 30], dtype=torch.int32)  # the plan was made for [20, 30]
    with pytest.raises(ValueError, match="outside the plan's"):
        rocm_mla.mla_decode(q, kv, bt, shorter, plan=plan)


def test_plan_decode_checks_values_once():
    _, kv, bt, lens = make_paged_problem([20, 30], num_heads=16, seed=7)
    with pytest.raises(ValueError, match="cache_seqlens must be non-negative"):
        rocm_mla.plan_decode([-1, 3], q_len=1, num_heads=16, kv_dtype=torch.float32)
    with pytest.raises(ValueError, match="at most the block table's capacity"):
        rocm_mla.plan_decode(
            [20, 10_000], q_len=1, num_heads=16, kv_dtype=kv.dtype, block_table=bt, kv_cache=kv
        )
    bad = bt.clone()
    bad[1, 0] = -5
    with pytest.raises(ValueError, match="block ids in"):
        rocm_mla.plan_decode(
            lens, q_len=1, num_heads=16, kv_dtype=kv.dtype, block_table=bad, kv_cache=kv
        )
    for kwargs, match in (
        ({"q_len": 0}, "q_len must be an int >= 1"),
        ({"num_heads": True}, "num_heads must be an int >= 1"),
        ({"kv_dtype": torch.int8}, "kv_dtype must be"),
        ({"cache_seqlens": [1.5]}, "cache_seqlens must be ints"),
        ({"cache_seqlens": []}, "at least one request"),
        ({"backend": "cuda-magic"}, "unknown MLA backend"),
    ):
        args = {"cache_seqlens": [3], "q_len": 1, "num_heads": 16, "kv_dtype": torch.float32}
        args.update(kwargs)
        with pytest.raises(ValueError, match=match):
            rocm_mla.plan_decode(args.pop("cache_seqlens"), **args)


def test_debug_mode_names_the_first_non_finite_input(monkeypatch):
    q, kv, bt, lens = make_paged_problem([20, 30], num_heads=4, seed=8)
    monkeypatch.setenv(DEBUG_ENV_VAR, "1")
    rocm_mla.mla_decode(q, kv, bt, lens, backend="torch")  # NaN only in unused slots: fine
    q_bad = q.clone()
    q_bad[1, 0, 2, 7] = math.inf
    with pytest.raises(ValueError, match=r"q\[1, 0, 2, 7\] is not finite"):
        rocm_mla.mla_decode(q_bad, kv, bt, lens, backend="torch")
    kv_bad = kv.clone()
    kv_bad[int(bt[0, 1]), 2, 5] = math.nan  # request 0, token 16 + 2
    with pytest.raises(ValueError, match="request 0, token 18"):
        rocm_mla.mla_decode(q, kv_bad, bt, lens, backend="torch")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_non_finite_inputs_propagate_as_nan(backend):
    if backend == "triton":
        pytest.importorskip("triton")
        from rocm_mla.backends.triton import TritonMLAImpl

        if TritonMLAImpl.unavailable_reason():
            pytest.skip(TritonMLAImpl.unavailable_reason())
    q, kv, bt, lens = make_paged_problem([40, 25, 0], num_heads=4, seed=9)
    cases = {}
    q_nan = q.clone()
    q_nan[0, 0, 1, 3] = math.nan
    cases["nan in q"] = (q_nan, kv, {}, [(0, 1)])
    q_inf = q.clone()
    q_inf[1, 0, 2, 0] = math.inf
    cases["inf in q"] = (q_inf, kv, {}, [(1, 2)])
    kv_nan = kv.clone()
    kv_nan[int(bt[1, 1]), 3, 100] = math.nan  # request 1, token 19 < 25: every head sees it
    cases["nan in a visible cache row"] = (q, kv_nan, {}, [(1, h) for h in range(4)])
    cases["overflowing scale"] = (q, kv, {"softmax_scale": 1e38}, [(0, 0), (1, 0)])
    for name, (qq, kk, kwargs, rows) in cases.items():
        out, lse = rocm_mla.mla_decode(qq, kk, bt, lens, backend=backend, **kwargs)
        for b, h in rows:
            assert torch.isnan(lse[b, 0, h]), f"{name}: lse[{b}, 0, {h}] = {lse[b, 0, h]}"
            assert torch.isnan(out[b, 0, h]).any(), f"{name}: out[{b}, 0, {h}] has no NaN"
        assert (lse[2] == -math.inf).all() and (out[2] == 0).all(), f"{name}: empty row"
    # A verify window (S_q = 2): a NaN in the last key reaches only the query that sees it.
    q2, kv2, bt2, lens2 = make_paged_problem([40, 25], num_heads=4, q_len=2, seed=10)
    ref_out, ref_lse = rocm_mla.mla_decode(q2, kv2, bt2, lens2, backend="torch")
    kv2[int(bt2[0, 2]), 7, 3] = math.nan  # request 0, token 39: seen by query 1 only
    out, lse = rocm_mla.mla_decode(q2, kv2, bt2, lens2, backend=backend)
    assert torch.isnan(lse[0, 1]).all() and torch.isnan(out[0, 1]).all()
    torch.testing.assert_close(out[0, 0], ref_out[0, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[0, 0], ref_lse[0, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1], ref_out[1], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu("triton")
def test_planned_triton_call_does_not_sync_on_gpu():
    q, kv, bt, lens = make_paged_problem([4096, 1000, 64, 2048], num_heads=16, seed=10)
    q, kv, bt, lens = (t.cuda() for t in (q, kv.nan_to_num(), bt.clamp(min=0), lens))
    q, kv = q.bfloat16(), kv.bfloat16()
    plan = _plan([4096, 1000, 64, 2048], q, kv, device="cuda")
    rocm_mla.mla_decode(q, kv, bt, lens, plan=plan)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, _ = rocm_mla.mla_decode(q, kv, bt, lens, plan=plan)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref, _ = rocm_mla.mla_decode(q, kv, bt, lens, backend="torch")
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
