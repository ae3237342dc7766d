"""The aiter backend on CPU: metadata, padding, scales and LSE through a model of AITER's
interface (ROCm/aiter's current one), and every reason it cannot run.

The kernel itself needs gfx942/gfx950 (tests/test_aiter_rocm.py). Here the backend's one
kernel lookup, ``_aiter_mla``, is pointed at ``tests/aiter_interface_model.py`` and the
backend must then agree with the torch backend at fp32 precision. Other releases' interfaces
(amd-aiter 0.1.7.post2.dev18 from PyPI among them): tests/test_aiter_releases.py.
"""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch

import rocm_mla
from rocm_mla.backends import aiter as aiter_backend
from rocm_mla.backends import select_backend
from rocm_mla.backends.aiter import (
    AiterMLAImpl,
    build_decode_metadata,
    kernel_heads,
    quantize_per_tensor,
)
from rocm_mla.backends.torch_ref import TorchMLAImpl
from rocm_mla.inputs import prepare_decode
from tests import aiter_interface_model
from tests.reference import assert_same_attention, make_paged_problem


def problem_of(q, kv, bt, lens, *, causal=True, kv_scale=None, softmax_scale=None):
    return prepare_decode(
        q,
        kv,
        bt,
        lens,
        head_dim_v=512,
        softmax_scale=softmax_scale,
        causal=causal,
        kv_scale=kv_scale,
    )


@pytest.fixture
def interface_model(monkeypatch):
    """Route the backend's kernel lookup to the interface model (test-only), as the release
    it models."""
    aiter_interface_model.use_in_backend(monkeypatch)


@pytest.fixture
def rocm_machine(monkeypatch, interface_model):
    """Pretend to be a ROCm torch on an MI300X with AITER importable."""
    monkeypatch.setattr(aiter_backend, "_torch_build", lambda: "rocm")
    monkeypatch.setattr(aiter_backend, "_gpu_arch", lambda: "gfx942")


# ---- metadata -------------------------------------------------------------------------


def expected_indices(block_table, lengths, block_size):
    """Per-token flat rows, written the slow way."""
    rows = []
    for b, length in enumerate(lengths):
        for t in range(length):
            rows.append(int(block_table[b, t // block_size]) * block_size + t % block_size)
    return rows


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("q_len", [1, 2, 3, 4])
def test_metadata_expands_shuffled_block_table(block_size, q_len):
    lengths = [0, 1, 130, block_size, 2 * block_size + 1, 0, 7]
    _, kv, bt, lens = make_paged_problem(
        lengths, num_heads=1, q_len=q_len, block_size=block_size, head_dim=8, seed=block_size
    )
    meta = build_decode_metadata(bt, lens, block_size, q_len, num_blocks=kv.shape[0])
    for t in (meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_lens):
        assert t.dtype == torch.int32 and t.device == bt.device
    assert meta.max_seqlen_q == q_len
    assert meta.qo_indptr.tolist() == [b * q_len for b in range(len(lengths) + 1)]
    assert meta.kv_indptr.tolist() == [sum(lengths[:b]) for b in range(len(lengths) + 1)]
    assert meta.kv_last_page_lens.tolist() == [1] * len(lengths)
    assert meta.kv_indices.tolist() == expected_indices(bt, lengths, block_size)
    # The flat rows address exactly each request's tokens, in order, and never a NaN slot.
    flat = kv.flatten(0, 1)[meta.kv_indices.long()]
    assert not torch.isnan(flat).any()
    for b, length in enumerate(lengths):
        start = sum(lengths[:b])
        for t in range(length):
            assert torch.equal(flat[start + t], kv[bt[b, t // block_size], t % block_size])


def test_metadata_all_empty():
    bt = torch.tensor([[3], [1]], dtype=torch.int32)
    meta = build_decode_metadata(bt, torch.zeros(2, dtype=torch.int32), 16, 1, num_blocks=4)
    assert meta.kv_indices.numel() == 0 and meta.kv_indptr.tolist() == [0, 0, 0]


@pytest.mark.parametrize(
    ("heads", "padded"), [(1, 16), (8, 16), (16, 16), (17, 128), (20, 128), (128, 128)]
)
def test_kernel_heads(heads, padded):
    assert kernel_heads(heads) == padded


def test_kernel_heads_rejects_more_than_128():
    with pytest.raises(ValueError, match="at most 128"):
        kernel_heads(129)


# ---- the backend through the interface model equals the torch backend -----------------

# lengths, heads, S_q, block size. Lengths below S_q make causally empty rows; 0 makes an
# empty request; the last case is all empty.
MODEL_GRID = [
    ([5, 0, 33], 1, 1, 16),
    ([1, 17, 64], 8, 2, 1),
    ([70, 3, 1, 0], 16, 4, 64),
    ([40, 2], 20, 2, 16),
    ([129, 1], 128, 1, 16),
    ([0, 0], 16, 1, 16),
]


def check_equal_to_torch(problem, out, lse):
    """``out`` (and ``lse``, unless the call went without) equal the torch backend's."""
    ref_out, ref_lse = TorchMLAImpl(problem.num_heads).run(dataclasses.replace(problem, lse=True))
    if problem.lse:
        assert_same_attention(out, lse, ref_out, ref_lse, 1e-5)
        return
    assert lse is None
    # The out rule without a kernel LSE: the torch LSE marks the empty rows.
    assert_same_attention(out, ref_lse, ref_out, ref_lse, 1e-5)


def run_as_the_release_allows(impl, problem):
    """``impl.run(problem)`` with the LSE where the modeled release returns a correct one
    for this call; elsewhere the call asking for it is refused by name first."""
    release = aiter_backend.installed_release(aiter_backend._aiter_mla)
    if release.lse_reason(problem.spec) is not None:
        with pytest.raises(ValueError, match=f"amd-aiter {release.version}"):
            impl.run(problem)
        problem = dataclasses.replace(problem, lse=False)
    return problem, *impl.run(problem)


@pytest.mark.parametrize(("lengths", "heads", "q_len", "block"), MODEL_GRID)
def test_through_interface_model_equals_torch(interface_model, lengths, heads, q_len, block):
    q, kv, bt, lens = make_paged_problem(
        lengths, num_heads=heads, q_len=q_len, block_size=block, seed=heads
    )
    problem, out, lse = run_as_the_release_allows(AiterMLAImpl(heads), problem_of(q, kv, bt, lens))
    check_equal_to_torch(problem, out, lse)
    # Without the LSE every shape of the grid runs.
    problem = dataclasses.replace(problem, lse=False)
    check_equal_to_torch(problem, *AiterMLAImpl(heads).run(problem))


def test_custom_scale_and_4d_cache(interface_model):
    q, kv, bt, lens = make_paged_problem([9, 26], num_heads=16, q_len=2, four_d=True, seed=3)
    problem = problem_of(q, kv, bt, lens, softmax_scale=0.07)
    problem, out, lse = run_as_the_release_allows(AiterMLAImpl(16, softmax_scale=0.07), problem)
    check_equal_to_torch(problem, out, lse)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
@pytest.mark.parametrize("heads", [8, 16])
def test_fp8_scales_reach_the_kernel(interface_model, fp8, heads):
    q, kv, bt, lens = make_paged_problem([23, 1, 50], num_heads=heads, q_len=2, seed=5)
    kv_fp8 = (kv * 4.0).to(fp8)
    problem = problem_of(q, kv_fp8, bt, lens, kv_scale=0.25)
    problem, out, lse = run_as_the_release_allows(AiterMLAImpl(heads), problem)
    # The backend quantizes q per tensor; the torch backend on that same dequantized q and
    # the same fp8 cache isolates the scale plumbing from the quantization error.
    q_fp8, q_scale = quantize_per_tensor(q, fp8)
    q_deq = q_fp8.to(torch.float32) * q_scale
    assert (q_deq - q).abs().max() > 1e-4  # q really went through fp8
    reference = problem_of(q_deq, kv_fp8, bt, lens, kv_scale=0.25)
    check_equal_to_torch(dataclasses.replace(reference, lse=problem.lse), out, lse)


def test_quantize_per_tensor_round_trip():
    x = torch.randn(4, 16, 576) * 3
    x_fp8, scale = quantize_per_tensor(x, torch.float8_e4m3fnuz)
    assert x_fp8.dtype == torch.float8_e4m3fnuz and scale.shape == (1,)
    assert x_fp8.float().abs().max() == torch.finfo(torch.float8_e4m3fnuz).max
    # e4m3 keeps 3 mantissa bits (relative error <= 1/16) above its subnormals.
    torch.testing.assert_close(x_fp8.float() * scale, x, atol=float(scale) * 2**-9, rtol=1 / 16)
    zeros, zero_scale = quantize_per_tensor(torch.zeros(3), torch.float8_e4m3fn)
    assert (zeros.float() == 0).all() and float(zero_scale) > 0


def test_no_fallback_when_the_kernel_module_is_missing(monkeypatch):
    def missing():
        raise ModuleNotFoundError("No module named 'aiter'")

    monkeypatch.setattr(aiter_backend, "_aiter_mla", missing)
    q, kv, bt, lens = make_paged_problem([4], num_heads=16)
    with pytest.raises(ModuleNotFoundError):
        AiterMLAImpl(16).run(problem_of(q, kv, bt, lens))


def test_cp_contract_is_inherited(interface_model):
    impl = AiterMLAImpl(16, dcp_world_size=-1, dcp_rank=-1)
    assert (impl.dcp_world_size, impl.dcp_rank) == (1, 0)
    impl.dcp_world_size = -1
    q, kv, bt, lens = make_paged_problem([4], num_heads=16)
    with pytest.raises(ValueError):
        impl.run(problem_of(q, kv, bt, lens))


def test_package_never_imports_the_interface_model():
    package = pathlib.Path(rocm_mla.__file__).parent
    for path in package.rglob("*.py"):
        assert "interface_model" not in path.read_text(), path


# ---- reasons --------------------------------------------------------------------------


def bf16_problem(lengths=(20, 3), heads=16, q_len=1, kv_dtype=torch.bfloat16, lse=True, **kw):
    q, kv, bt, lens = make_paged_problem(
        list(lengths), num_heads=heads, q_len=q_len, dtype=torch.bfloat16, seed=1
    )
    kv_scale = None
    if kv_dtype != torch.bfloat16:
        kv, kv_scale = kv.to(kv_dtype), 1.0
    return dataclasses.replace(problem_of(q, kv, bt, lens, kv_scale=kv_scale, **kw), lse=lse)


CPU_TENSORS = "tensors on cpu, supported: hip"


def test_supported_shape_has_only_the_cpu_reason(rocm_machine):
    assert AiterMLAImpl.unavailable_reason() is None
    version = aiter_interface_model.CURRENT.version
    assert AiterMLAImpl.target() == (
        f"hip gfx942 (amd-aiter {version}: decodes bf16 and fp8 caches, 16 or 128 kernel "
        "heads (fewer padded up); not the LSE of an fp8 cache)"
    )
    for problem in (
        bf16_problem(),
        bf16_problem(heads=128, q_len=4),
        bf16_problem(heads=20, q_len=2),
        bf16_problem(heads=128, q_len=8),
        bf16_problem(q_len=4, kv_dtype=torch.float8_e4m3fnuz, lse=False),
    ):
        assert AiterMLAImpl.unsupported_reasons(problem) == [CPU_TENSORS]
    # fp8 with the LSE: AITER caps fp8 splits by the context length, down to the one-split
    # launch that writes no LSE.
    assert AiterMLAImpl.unsupported_reasons(
        bf16_problem(q_len=4, kv_dtype=torch.float8_e4m3fnuz)
    ) == [
        CPU_TENSORS,
        f"the call needs the LSE and amd-aiter {version} writes it only in its split reduce, "
        "which a one-split launch skips; an fp8 launch's split count is capped by the "
        "context length (one split for short ones), so it cannot be forced",
    ]


def with_dtypes(problem, q_dtype=None, kv_dtype=None):
    return problem_of(
        problem.q.to(q_dtype or problem.q.dtype),
        problem.kv_cache.to(kv_dtype or problem.kv_cache.dtype),
        problem.block_table,
        problem.cache_seqlens,
    )


@pytest.mark.parametrize(
    ("arch", "make", "reason"),
    [
        ("gfx942", lambda: bf16_problem(heads=129), "129 heads, supported: at most 128"),
        (
            "gfx942",
            lambda: with_dtypes(bf16_problem(), q_dtype=torch.float16),
            "q dtype torch.float16",
        ),
        (
            "gfx942",
            lambda: with_dtypes(bf16_problem(), q_dtype=torch.float32),
            "q dtype torch.float32",
        ),
        (
            "gfx942",
            lambda: with_dtypes(bf16_problem(), kv_dtype=torch.float16),
            "kv_cache dtype torch.float16",
        ),
        (
            "gfx942",
            lambda: bf16_problem(kv_dtype=torch.float8_e4m3fn),
            "AITER's fp8 there is torch.float8_e4m3fnuz",
        ),
        (
            "gfx950",
            lambda: bf16_problem(kv_dtype=torch.float8_e4m3fnuz),
            "AITER's fp8 there is torch.float8_e4m3fn",
        ),
        ("gfx942", lambda: bf16_problem(q_len=3), "q_len 3 is not a power of 2"),
        (
            "gfx942",
            lambda: bf16_problem(q_len=8, kv_dtype=torch.float8_e4m3fnuz),
            "q_len 8, supported: up to 4 with a fp8 cache",
        ),
        ("gfx950", lambda: bf16_problem(q_len=16), "q_len 16, supported: up to 8"),
        ("gfx942", lambda: bf16_problem(q_len=8), "aiter#5679"),
        ("gfx942", lambda: bf16_problem(heads=5, q_len=8), "aiter#5679"),
        ("gfx942", lambda: bf16_problem(q_len=2, causal=False), "non-causal q_len > 1"),
    ],
)
def test_unsupported_shape_reasons(monkeypatch, rocm_machine, arch, make, reason):
    monkeypatch.setattr(aiter_backend, "_gpu_arch", lambda: arch)
    reasons = AiterMLAImpl.unsupported_reasons(make())
    assert reasons[0] == CPU_TENSORS
    assert any(reason in r for r in reasons[1:]), reasons


def test_known_gfx942_bug_is_arch_specific(monkeypatch, rocm_machine):
    monkeypatch.setattr(aiter_backend, "_gpu_arch", lambda: "gfx950")
    assert AiterMLAImpl.unsupported_reasons(bf16_problem(q_len=8, lse=False)) == [CPU_TENSORS]


def test_unevenly_strided_cache_is_a_reason(rocm_machine):
    q, kv, bt, lens = make_paged_problem([5, 9], num_heads=16, block_size=4, dtype=torch.bfloat16)
    padded = torch.zeros(kv.shape[0], 5, kv.shape[2], dtype=kv.dtype)
    padded[:, :4] = kv
    strided = padded[:, :4]  # blocks 5 rows apart but 4 rows long: no flat token view
    reasons = AiterMLAImpl.unsupported_reasons(problem_of(q, strided, bt, lens))
    assert any("not evenly strided" in r for r in reasons), reasons


@pytest.mark.parametrize(
    ("build", "arch", "importable", "reason"),
    [
        ("cpu", None, True, "torch is not a ROCm build"),
        ("cuda", "sm90", True, "torch is not a ROCm build"),
        ("rocm", None, True, "no AMD GPU visible"),
        ("rocm", "gfx90a", True, "arch gfx90a is not gfx942/gfx950"),
        ("rocm", "gfx942", False, "aiter not importable (ModuleNotFoundError: No module named"),
    ],
)
def test_unavailable_reasons(monkeypatch, build, arch, importable, reason):
    def load():
        if not importable:
            raise ModuleNotFoundError("No module named 'aiter'")
        return aiter_interface_model

    monkeypatch.setattr(aiter_backend, "_torch_build", lambda: build)
    monkeypatch.setattr(aiter_backend, "_gpu_arch", lambda: arch)
    monkeypatch.setattr(aiter_backend, "_aiter_mla", load)
    assert reason in AiterMLAImpl.unavailable_reason()
    assert AiterMLAImpl.target() is None
    assert AiterMLAImpl.unsupported_reasons(bf16_problem()) == [AiterMLAImpl.unavailable_reason()]


def test_env_selects_aiter_here_and_fails_with_the_reason(monkeypatch):
    q, kv, bt, lens = make_paged_problem([6], num_heads=16, dtype=torch.bfloat16)
    assert "torch is not a ROCm build" in AiterMLAImpl.unavailable_reason()
    monkeypatch.setenv("ROCM_MLA_BACKEND", "aiter")
    with pytest.raises(ValueError, match="'aiter' cannot run this call: torch is not a ROCm build"):
        rocm_mla.mla_decode(q, kv, bt, lens)
    monkeypatch.setenv("ROCM_MLA_BACKEND", "auto")
    assert select_backend(None, problem_of(q, kv, bt, lens)) is not AiterMLAImpl


def test_auto_skips_aiter_for_an_unsupported_shape(rocm_machine, monkeypatch):
    monkeypatch.setenv("ROCM_MLA_BACKEND", "auto")
    assert select_backend(None, bf16_problem(q_len=3)) is not AiterMLAImpl


# ---- windows of different lengths; per-row bounds ----------------------------------------


def test_packed_windows_run_front_padded(interface_model):
    """Windows of 1-4 rows in one call: each runs as the last rows of a 4-row window, where
    AITER's causal alignment gives every row its own keys; equal to the torch backend."""
    from tests.reference import dense_varlen_mla_decode

    sizes, lengths = [4, 1, 2, 4, 1], [40, 9, 130, 3, 0]
    q4, kv, bt, lens = make_paged_problem(lengths, num_heads=16, q_len=4, block_size=16, seed=4)
    q = torch.cat([q4[b, :n] for b, n in enumerate(sizes)])
    qsl = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
    problem = prepare_decode(
        q,
        kv,
        bt,
        lens,
        head_dim_v=512,
        softmax_scale=None,
        causal=True,
        kv_scale=None,
        query_start_loc=qsl,
        max_q_len=4,
    )
    problem, out, lse = run_as_the_release_allows(AiterMLAImpl(16), problem)
    ref_out, ref_lse = dense_varlen_mla_decode(q, qsl, kv, bt, lens)
    assert out.shape == (q.shape[0], 16, 512)
    ref_lse = ref_lse.float()
    if problem.lse:
        assert_same_attention(out, lse, ref_out.float(), ref_lse, 1e-5)
    else:
        assert lse is None
        assert_same_attention(out, ref_lse, ref_out.float(), ref_lse, 1e-5)


def test_per_row_bounds_are_refused_by_name(rocm_machine):
    """A DCP verify window's rows see this rank's keys in steps of 0 or 1: mla_decode_fwd
    has no bound per row, so the call is refused at selection and auto takes another."""
    q, kv, bt, lens = make_paged_problem([20, 9], num_heads=16, q_len=2, dtype=torch.bfloat16)
    rows = torch.tensor([[19, 20], [9, 9]], dtype=torch.int32)
    problem = prepare_decode(
        q,
        kv,
        bt,
        lens,
        head_dim_v=512,
        softmax_scale=None,
        causal=True,
        kv_scale=None,
        row_seqlens=rows,
    )
    reasons = AiterMLAImpl.unsupported_reasons(problem)
    assert "a KV bound per query row (row_seqlens)" in "; ".join(reasons)
    with pytest.raises(ValueError, match=r"'aiter' cannot run .*a KV bound per query row"):
        rocm_mla.mla_decode(q, kv, bt, lens, row_seqlens=rows, backend="aiter")
