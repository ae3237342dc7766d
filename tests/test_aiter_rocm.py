"""The real AITER kernel on gfx942/gfx950 against the torch (and Triton) backends.

Marked ``rocm``: skipped without a ROCm torch and an AMD GPU, and skipped with the
backend's own reason when AITER is not importable or the arch is not gfx942/gfx950. Shapes:
the foundation grid (tests/test_torch_backend.py) plus heads 16/128 and padded counts,
each in bf16 and fp8. A grid shape the backend declares unsupported (a known AITER bug or
an S_q without a kernel) must say so, and is then checked to fall back under ``auto``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rocm_mla.backends import backend_class, select_backend
from rocm_mla.backends.aiter import (
    FP8_BY_ARCH,
    AiterMLAImpl,
    _aiter_mla,
    _gpu_arch,
    installed_release,
    quantize_per_tensor,
)
from rocm_mla.inputs import prepare_decode
from tests.reference import assert_same_attention, make_paged_problem
from tests.test_torch_backend import GRID

pytestmark = pytest.mark.rocm

# The foundation grid's geometry (lengths, heads, S_q, block size), plus heads 16/128 and
# counts that need padding, at decode (S_q 1) and MTP (S_q 2, 4) shapes.
SHAPES = [(lengths, heads, q_len, block) for lengths, heads, q_len, block, _ in GRID] + [
    ([1024, 513, 64, 1], 16, 1, 1),
    ([1024, 513, 64, 1], 128, 1, 1),
    ([300, 17, 0, 2048], 16, 2, 16),
    ([300, 17, 0, 2048], 128, 4, 64),
    ([77, 4096], 8, 1, 16),
    ([77, 4096], 20, 2, 16),
    ([5, 9000], 128, 8, 1),
]
KINDS = ["bf16", "fp8"]


@pytest.fixture(scope="module", autouse=True)
def aiter_usable():
    reason = AiterMLAImpl.unavailable_reason()
    if reason is not None:
        pytest.skip(f"aiter backend unavailable: {reason}")


def make_case(lengths, heads, q_len, block, kind):
    q, kv, bt, lens = make_paged_problem(
        lengths, num_heads=heads, q_len=q_len, block_size=block, seed=heads + q_len
    )
    q, kv = q.to(torch.bfloat16), kv.to(torch.bfloat16)
    kv_scale = None
    if kind == "fp8":
        kv_fp8, scale = quantize_per_tensor(torch.nan_to_num(kv), FP8_BY_ARCH[_gpu_arch()])
        # Keep the NaN in never-used slots: the kernel must not read them.
        kv = torch.where(torch.isnan(kv), kv, kv_fp8.to(torch.bfloat16)).to(kv_fp8.dtype)
        kv_scale = float(scale)
    dev = torch.device("cuda")
    return q.to(dev), kv.to(dev), bt.to(dev), lens.to(dev), kv_scale


def cos_diff(x, y):
    x, y = x.double(), y.double()
    return 1 - 2 * (x * y).sum().item() / max((x * x + y * y).sum().item(), 1e-12)


def check_close(out, lse, ref_out, ref_lse, kind):
    """``lse`` None: a call without the LSE, whose empty rows the reference's mark."""
    # Compared in fp32: the fp8 references run on a dequantized fp32 q, so their out is fp32.
    tol = 2e-2 if kind == "bf16" else 1.5e-1
    assert_same_attention(
        out.float(), ref_lse if lse is None else lse, ref_out.float(), ref_lse, tol
    )
    # AITER's own bars (op_tests/test_mla.py): cosine diff 1e-5 bf16, 3e-2 fp8 (P goes
    # through fp8 inside the a8w8 kernel).
    visible = ~torch.isinf(ref_lse)
    if visible.any():
        assert cos_diff(out[visible], ref_out[visible]) < (1e-5 if kind == "bf16" else 3e-2)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("lengths", "heads", "q_len", "block"), SHAPES)
def test_aiter_matches_torch_and_triton(lengths, heads, q_len, block, kind):
    q, kv, bt, lens, kv_scale = make_case(lengths, heads, q_len, block, kind)
    problem = prepare_decode(
        q, kv, bt, lens, head_dim_v=512, softmax_scale=None, causal=True, kv_scale=kv_scale
    )
    without_lse = dataclasses.replace(problem, lse=False)
    reasons = AiterMLAImpl.unsupported_reasons(without_lse)
    if reasons:
        assert select_backend("auto", without_lse) is not AiterMLAImpl
        pytest.skip(f"aiter declares this shape unsupported: {'; '.join(reasons)}")
    # The installed release may return no LSE for this call (then it says so, naming itself).
    if AiterMLAImpl.unsupported_reasons(problem):
        assert select_backend("auto", problem) is not AiterMLAImpl
        problem = without_lse
    out, lse = AiterMLAImpl(heads).run(problem)
    assert out.dtype == torch.bfloat16 and (lse is None) is (not problem.lse)
    assert lse is None or lse.dtype == torch.float32
    assert out.shape == (len(lengths), q_len, heads, 512)

    # References see the q AITER saw: for fp8, the per-tensor quantized q.
    ref_q = q
    if kind == "fp8":
        q_fp8, q_scale = quantize_per_tensor(q, kv.dtype)
        ref_q = q_fp8.to(torch.float32) * q_scale
    ref_problem = prepare_decode(
        ref_q, kv, bt, lens, head_dim_v=512, softmax_scale=None, causal=True, kv_scale=kv_scale
    )
    ref_out, ref_lse = backend_class("torch")(heads).run(ref_problem)
    check_close(out, lse, ref_out, ref_lse, kind)

    triton = backend_class("triton")
    if not triton.unsupported_reasons(ref_problem):
        tri_out, tri_lse = triton(heads).run(ref_problem)
        check_close(out, lse, tri_out, tri_lse, kind)


def test_target_names_arch_and_release():
    target = AiterMLAImpl.target()
    release = installed_release(_aiter_mla)
    assert target == f"hip {_gpu_arch()} ({release.summary()})"
    assert release.name in target
