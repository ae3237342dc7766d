"""The one-shot call's host cost (issue 37, item 6): one host read, and nothing planned twice.

``mla_decode`` without a plan must refuse bad lengths and block ids before any work, so it
reads the device once: every value check and the lengths' range the call plans from are
reduced into one small tensor and read back together. What does not depend on values is
made once: the call's ``DecodeSpec`` once per call, the Triton launch plan (config, slots,
residency) once per shape. On a GPU, ``test_one_shot_triton_call_syncs_once_on_gpu`` counts
the syncs torch itself reports.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import rocm_mla
from rocm_mla import inputs
from rocm_mla.backends import backend_class
from rocm_mla.inputs import DEBUG_ENV_VAR
from tests.reference import make_paged_problem
from tests.test_plan import HostReadCounter, _cpu_aiter_capabilities

#: aten ops whose result size or value reaches the host (a sync on a GPU).
SYNCING_OPS = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::masked_select",
    "aten::_unique2",
    "aten::unique_consecutive",
    "aten::unique_dim",
}


class SyncCounter:
    """Host reads by tensor method (``HostReadCounter``) and syncing aten ops, outside the
    backend's ``_decode`` (the kernel: the planned call runs the same one, and
    ``test_plan.test_planned_call_reads_nothing_back`` checks it reads nothing)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
        self.methods = HostReadCounter()
        self.ops: list[str] = []
        counter = self
        cls = backend_class(backend)
        decode = cls._decode

        def paused(impl, problem, plan):
            counter.methods.paused = True
            try:
                return decode(impl, problem, plan)
            finally:
                counter.methods.paused = False

        monkeypatch.setattr(cls, "_decode", paused)

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.name() in SYNCING_OPS and not counter.methods.paused:
                    counter.ops.append(func.name())
                return func(*args, **(kwargs or {}))

        self._ops = Ops()

    def __enter__(self) -> SyncCounter:
        self.methods.__enter__()
        self._ops.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ops.__exit__(*exc)
        self.methods.__exit__(*exc)

    @property
    def reads(self) -> list[str]:
        return self.methods.reads + self.ops


@pytest.fixture
def aiter_model(monkeypatch):
    from rocm_mla.backends import aiter as aiter_backend
    from tests import aiter_interface_model

    aiter_interface_model.use_in_backend(monkeypatch)
    monkeypatch.setattr(aiter_backend, "_torch_build", lambda: "rocm")
    monkeypatch.setattr(aiter_backend, "_gpu_arch", lambda: "gfx942")
    monkeypatch.setattr(aiter_backend.AiterMLAImpl, "capabilities", _cpu_aiter_capabilities())


def _problem(lengths=(300, 5, 77, 64), heads=16, seed=3):
    q, kv, bt, lens = make_paged_problem(
        list(lengths), num_heads=heads, block_size=16, seed=seed, nan_fill=False
    )
    return q, kv, bt.clamp(min=0), lens


@pytest.mark.parametrize("backend", ["torch", "aiter"])
def test_one_shot_call_reads_the_device_once(request, monkeypatch, backend):
    monkeypatch.delenv(DEBUG_ENV_VAR, raising=False)
    if backend == "aiter":
        request.getfixturevalue("aiter_model")
    q, kv, bt, lens = _problem()
    want = rocm_mla.mla_decode(q, kv, bt, lens, backend=backend)
    with SyncCounter(monkeypatch, backend) as counted:
        got = rocm_mla.mla_decode(q, kv, bt, lens, backend=backend)
    assert counted.reads == ["tolist"], f"one-shot host reads: {counted.reads}"
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)
    plan = rocm_mla.plan_decode(
        lens, q_len=1, num_heads=16, kv_dtype=kv.dtype, backend=backend, block_table=bt,
        kv_cache=kv,
    )  # fmt: skip
    with SyncCounter(monkeypatch, backend) as planned:
        rocm_mla.mla_decode(q, kv, bt, lens, plan=plan)
    assert planned.reads == []


def test_plan_decode_reads_the_device_once(monkeypatch):
    _, kv, bt, lens = _problem()
    with SyncCounter(monkeypatch, "torch") as counted:
        plan = rocm_mla.plan_decode(
            lens, q_len=1, num_heads=16, kv_dtype=kv.dtype, backend="torch", block_table=bt,
            kv_cache=kv,
        )  # fmt: skip
    assert counted.reads == ["tolist"]
    assert (plan.min_seqlen, plan.max_seqlen, plan.total_seqlen) == (5, 300, 446)


def test_one_shot_makes_its_spec_once(monkeypatch):
    made = []
    post_init = inputs.DecodeSpec.__post_init__

    def counting(spec):
        made.append(spec)
        post_init(spec)

    monkeypatch.setattr(inputs.DecodeSpec, "__post_init__", counting)
    q, kv, bt, lens = _problem()
    rocm_mla.mla_decode(q, kv, bt, lens)  # auto: asks every backend, then plans
    assert len(made) == 1


def test_a_missing_aiter_is_looked_for_once(monkeypatch):
    from rocm_mla.backends import aiter as aiter_backend

    tries = []

    def missing():
        tries.append(1)
        raise ModuleNotFoundError("No module named 'aiter'")

    monkeypatch.setattr(aiter_backend, "_torch_build", lambda: "rocm")
    monkeypatch.setattr(aiter_backend, "_gpu_arch", lambda: "gfx942")
    monkeypatch.setattr(aiter_backend, "_aiter_mla", missing)
    q, kv, bt, lens = _problem()
    for _ in range(3):  # auto asks AITER first on every call
        rocm_mla.mla_decode(q, kv, bt, lens)
    assert len(tries) == 1
    reason = aiter_backend.AiterMLAImpl.unavailable_reason()
    assert "aiter not importable (ModuleNotFoundError" in reason


def test_triton_launch_plan_is_made_once_per_shape(monkeypatch):
    pytest.importorskip("triton")
    from rocm_mla.backends import triton as triton_backend
    from rocm_mla.kernels import plan as kernel_plan

    if triton_backend.TritonMLAImpl.unavailable_reason():
        pytest.skip(triton_backend.TritonMLAImpl.unavailable_reason())
    planned = []
    plan_launch = kernel_plan.plan_launch

    def counting(**kwargs):
        planned.append(kwargs)
        return plan_launch(**kwargs)

    monkeypatch.setattr(kernel_plan, "plan_launch", counting)
    triton_backend._launch_shape.cache_clear()
    q, kv, bt, lens = _problem(lengths=(40, 7), heads=4, seed=5)
    first = rocm_mla.mla_decode(q, kv, bt, lens, backend="triton")
    # Other lengths, the same shapes and cache: nothing to plan but the schedule.
    again = rocm_mla.mla_decode(q, kv, bt, (lens - 3).clamp(min=0), backend="triton")
    assert len(planned) == 1
    info = triton_backend._launch_shape.cache_info()
    assert (info.misses, info.hits) == (1, 1)
    assert planned[0]["cache_bytes"] == kv.numel() * kv.element_size()  # the cache's size
    ref = rocm_mla.mla_decode(q, kv, bt, (lens - 3).clamp(min=0), backend="torch")
    torch.testing.assert_close(again[0], ref[0], atol=1e-4, rtol=1e-4)
    assert first[0].shape == again[0].shape


def test_bad_values_are_refused_by_name_after_one_read_and_before_any_work(monkeypatch):
    monkeypatch.delenv(DEBUG_ENV_VAR, raising=False)
    q, kv, bt, lens = _problem(lengths=(40, 7, 33))
    capacity = bt.shape[1] * kv.shape[1]
    cases = []
    cases.append(("negative", bt, torch.tensor([40, -2, 33], dtype=torch.int32),
                  r"cache_seqlens must be non-negative, got a minimum of -2"))  # fmt: skip
    cases.append(("too long", bt, torch.tensor([40, capacity + 1, 33], dtype=torch.int32),
                  rf"cache_seqlens must be at most the block table's capacity .* = {capacity}, "
                  rf"got a maximum of {capacity + 1}"))  # fmt: skip
    bad = bt.clone()
    bad[2, 0], bad[1, 0] = -5, kv.shape[0]  # row-major: request 1's id is named first
    cases.append(("bad ids", bad, lens,
                  rf"block_table must be block ids in \[0, {kv.shape[0]}\) .* got 2 "
                  rf"out-of-range ids, first {kv.shape[0]}"))  # fmt: skip
    for name, table, lengths, match in cases:
        decoded = []
        with monkeypatch.context() as m:
            m.setattr(backend_class("torch"), "_decode", lambda *a, into=decoded: into.append(a))
            with SyncCounter(m, "torch") as counted, pytest.raises(ValueError, match=match):
                rocm_mla.mla_decode(q, kv, table, lengths, backend="torch")
        assert counted.reads == ["tolist"], name
        assert decoded == [], name
    # An out-of-range id past every request's length is never read: not an error.
    unused = bt.clone()
    unused[1, -1] = -7  # request 1 holds 7 tokens, in its first block only
    rocm_mla.mla_decode(q, kv, unused, lens, backend="torch")


@pytest.mark.gpu
def test_one_shot_triton_call_syncs_once_on_gpu():
    lengths = [4096, 1000, 64, 2048, 3000, 17, 512, 900]
    q, kv, bt, lens = make_paged_problem(lengths, num_heads=16, block_size=64, seed=11)
    q, kv, bt, lens = (t.cuda() for t in (q, kv.nan_to_num(), bt.clamp(min=0), lens))
    q, kv = q.bfloat16(), kv.bfloat16()
    rocm_mla.mla_decode(q, kv, bt, lens, backend="triton")  # compile outside the count
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out, _ = rocm_mla.mla_decode(q, kv, bt, lens, backend="triton")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, syncs
    ref, _ = rocm_mla.mla_decode(q, kv, bt, lens, backend="torch")
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
