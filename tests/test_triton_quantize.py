"""Per-row fp8 quantization of q (``rocm_mla.kernels.quantize_q``), on the interpreter or a GPU."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from rocm_mla.backends.triton import TritonMLAImpl
from rocm_mla.kernels import mla_decode_args
from rocm_mla.kernels.target import triton_target
from rocm_mla.kernels.tuned_configs import LaunchConfig

if TritonMLAImpl.unavailable_reason() is not None:
    pytest.skip(TritonMLAImpl.unavailable_reason(), allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIG = LaunchConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, fp8_qk=True)


def stage1_q(q: torch.Tensor, fp8: torch.dtype):
    target = triton_target()
    dot_types = mla_decode_args._dot_types(q.dtype, fp8, target, CONFIG)
    assert dot_types["QK_FP8"]
    return mla_decode_args.stage1_q(q, fp8, dot_types, target)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
def test_rows_are_scaled_to_the_fp8_max_and_rounded_to_3_mantissa_bits(fp8):
    if fp8 not in TritonMLAImpl.capabilities.kv_dtypes:
        pytest.skip(f"{fp8} is not this target's fp8 ({TritonMLAImpl.target()})")
    gen = torch.Generator().manual_seed(7)
    # A strided view (every other head of a wider tensor), rows of very different sizes,
    # and an all-zero row.
    wide = torch.randn(2, 3, 10, 576, generator=gen) * torch.logspace(-3, 3, 10)[:, None]
    q = wide[:, :, ::2].to(DEVICE)
    q[1, 2, 4] = 0.0
    q8, scale = stage1_q(q, fp8)
    assert q8.shape == q.shape and scale.shape == q.shape[:3] and scale.dtype == torch.float32
    fp8_max = torch.finfo(fp8).max
    amax = q.float().abs().amax(dim=-1).cpu()
    want = torch.where(amax > 0, amax / fp8_max, torch.ones_like(amax))
    torch.testing.assert_close(scale.cpu(), want, rtol=1e-6, atol=0)
    q8 = q8.float().cpu()
    assert q8.abs().amax() <= fp8_max
    # Every value is an fp8 value (3 mantissa bits above the smallest normal's exponent)...
    # (exponents from frexp, exact on any CPU; dividing by a power of two is exact, so the
    # steps are whole numbers exactly when the values are fp8 values).
    min_exp = math.log2(torch.finfo(fp8).smallest_normal)
    exp = (torch.frexp(q8)[1] - 1).float().clamp_min(min_exp)
    steps = q8 / torch.exp2(exp - 3)
    assert torch.equal(steps, steps.round())
    # ...within half an fp8 ulp of q / scale.
    err = (q8 - q.float().cpu() / scale.cpu()[..., None]).abs()
    assert (err <= torch.exp2(exp - 4) * (1 + 1e-6)).all()
    assert (q8[1, 2, 4] == 0).all()


def test_non_finite_elements_stay_non_finite():
    fp8 = torch.float8_e4m3fn
    if fp8 not in TritonMLAImpl.capabilities.kv_dtypes:
        fp8 = torch.float8_e4m3fnuz
    q = torch.randn(1, 1, 4, 576, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    q[0, 0, 1, 5] = math.nan
    q[0, 0, 2, 9] = math.inf
    q8, _ = stage1_q(q, fp8)
    q8 = q8.float().cpu()
    assert not torch.isfinite(q8[0, 0, 1, 5]) and not torch.isfinite(q8[0, 0, 2, 9])
    assert torch.isfinite(q8[0, 0, 0]).all() and torch.isfinite(q8[0, 0, 3]).all()
