"""MXFP4 routed-expert weights in the compressed-tensors ``mxfp4-pack-quantized`` format.

Format (OCP Microscaling spec v1.0, element type FP4 E2M1, block size 32; compressed-tensors
packing), for a weight ``W [N, K]`` (out x in):

- ``weight_packed`` uint8 ``[N, K / 2]``: two 4-bit E2M1 codes per byte, the element with the
  even input index in the **low** nibble (``byte = code[2j] | code[2j + 1] << 4``, as
  compressed-tensors' ``pack_fp4_to_uint8`` writes it). A code is ``sign << 3 | magnitude``
  with magnitudes ``[0, 0.5, 1, 1.5, 2, 3, 4, 6]``.
- ``weight_scale`` uint8 ``[N, K / 32]``: one E8M0 scale per 32 consecutive input values,
  value ``2 ** (s - 127)``; ``s = 255`` is NaN.
- ``W[n, k] = E2M1(code[n, k]) * 2 ** (scale[n, k // 32] - 127)``.

The quantizer follows the spec's conversion: the shared exponent is
``floor(log2(amax)) - 2`` (2 = E2M1's largest exponent), elements are divided by the scale
and rounded to the nearest E2M1 value (ties to even code), saturating at 6.

Routed experts stay packed in memory (0.53 bytes per weight instead of 2 for bf16) and are
dequantized one expert at a time, only for the experts a batch routes to, right before their
GEMM. H200 (Hopper) and MI300X (gfx942) have no FP4 matrix instructions, so on GPU the
dequantized tile goes through the ordinary bf16 GEMM; the memory saving is what FP4 buys there.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

FORMAT = "mxfp4-pack-quantized"
GROUP_SIZE = 32
E8M0_BIAS = 127
E8M0_NAN = 255
# E2M1's largest exponent (6 = 1.5 * 2**2): the spec's shared exponent is
# floor(log2(amax)) minus this.
E2M1_EMAX = 2
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# code -> value, codes 8..15 are the negatives (-0.0 for code 8).
E2M1_VALUES = torch.tensor([*E2M1_MAGNITUDES, *(-m for m in E2M1_MAGNITUDES)])
# Midpoint between magnitude codes i and i + 1, and whether a tie rounds up (to i + 1): round
# half to even code, the spec's roundTiesToEven on the mantissa bit.
_MIDPOINTS = tuple(
    (0.5 * (a + b), (i + 1) % 2 == 0)
    for i, (a, b) in enumerate(itertools.pairwise(E2M1_MAGNITUDES))
)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round ``x`` (already divided by its scale) to E2M1 codes ``[...]`` uint8.

    Nearest magnitude, ties to the even code, saturating at 6; the sign bit follows
    ``signbit`` (so -0.0 is code 8).
    """
    a = x.abs().to(torch.float64)
    idx = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for midpoint, tie_up in _MIDPOINTS:
        idx += (a > midpoint).to(torch.uint8)
        if tie_up:
            idx += (a == midpoint).to(torch.uint8)
    return idx | (torch.signbit(x).to(torch.uint8) << 3)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """``codes [N, K]`` uint8 in 0..15 -> ``[N, K / 2]`` bytes, even index in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"codes: the last dim must be even to pack, got {codes.shape[-1]}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """``packed [N, K / 2]`` uint8 -> codes ``[N, K]`` uint8 (inverse of ``pack_e2m1``)."""
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1)
    return codes.flatten(-2)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``weight [N, K]`` to ``(weight_packed [N, K/2] uint8, weight_scale [N, K/32]
    uint8)``; ``K`` must be a multiple of 32.
    """
    if weight.dim() != 2 or weight.shape[1] % GROUP_SIZE:
        raise ValueError(
            f"weight: expected [N, K] with K a multiple of {GROUP_SIZE}, got {list(weight.shape)}"
        )
    n, k = weight.shape
    groups = weight.detach().to(torch.float64).view(n, k // GROUP_SIZE, GROUP_SIZE)
    amax = groups.abs().amax(-1)
    if not torch.isfinite(amax).all():
        raise ValueError("weight: has inf/NaN entries, which MXFP4 cannot encode")
    # An all-zero group gets the smallest scale; its codes are all zero anyway.
    exponent = torch.where(
        amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0**-200))) - E2M1_EMAX, -E8M0_BIAS
    )
    biased = (exponent + E8M0_BIAS).clamp(0, E8M0_NAN - 1)
    scaled = groups * torch.exp2(-(biased - E8M0_BIAS))[..., None]
    codes = e2m1_codes(scaled).view(n, k)
    return pack_e2m1(codes), biased.to(torch.uint8)


def dequantize_mxfp4(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``packed [N, K/2]`` + ``scale [N, K/32]`` (uint8) -> ``W [N, K]`` in ``dtype``.

    Exact in fp32 and bf16 (an E2M1 value times a power of two); fp16 may flush or overflow
    for scales outside its range, as any fp16 cast would.
    """
    n, half = packed.shape
    k = 2 * half
    if scale.shape != (n, k // GROUP_SIZE):
        raise ValueError(
            f"weight_scale: expected shape {[n, k // GROUP_SIZE]} for weight_packed "
            f"{[n, half]}, got {list(scale.shape)}"
        )
    values = E2M1_VALUES.to(packed.device)[unpack_e2m1(packed).long()]
    factor = torch.exp2(scale.float() - E8M0_BIAS)
    factor = factor.masked_fill(scale == E8M0_NAN, float("nan"))
    w = values.view(n, k // GROUP_SIZE, GROUP_SIZE) * factor[..., None]
    return w.view(n, k).to(dtype)


class MXFP4Linear(nn.Module):
    """A bias-free linear layer whose weight stays MXFP4-packed; checkpoint names
    ``weight_packed [out, in/2]`` and ``weight_scale [out, in/32]`` (both uint8).

    Each call dequantizes the weight into the activation dtype for one GEMM and drops it,
    so only the experts a batch uses ever exist unpacked, one at a time.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        if in_features % GROUP_SIZE:
            raise ValueError(
                f"in_features: MXFP4 needs a multiple of {GROUP_SIZE} per rank, got {in_features}"
            )
        self.in_features, self.out_features = in_features, out_features
        self.weight_packed = nn.Parameter(
            torch.zeros(out_features, in_features // 2, dtype=torch.uint8), requires_grad=False
        )
        self.weight_scale = nn.Parameter(
            torch.zeros(out_features, in_features // GROUP_SIZE, dtype=torch.uint8),
            requires_grad=False,
        )

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The unpacked ``[out, in]`` weight in ``dtype``."""
        return dequantize_mxfp4(self.weight_packed, self.weight_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, in]`` -> ``[T, out]``."""
        return F.linear(x, self.dequantized_weight(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mxfp4"


# ---------------------------------------------------------------------------- config.json
def parse_quantization_config(block: Any) -> str | None:
    """Read a config.json ``quantization_config``; return ``"mxfp4"`` or None (absent).

    Only weight-only compressed-tensors MXFP4 (4-bit float, group 32) is supported; anything
    else raises ``ValueError`` naming the field, so a checkpoint is never read as the wrong
    format.
    """
    if block is None:
        return None
    if not isinstance(block, dict):
        raise ValueError(f"quantization_config: expected a dict, got {type(block).__name__}")
    method = block.get("quant_method")
    if method != "compressed-tensors":
        raise ValueError(
            f"quantization_config.quant_method: expected 'compressed-tensors' (MXFP4 routed "
            f"experts), got {method!r}"
        )
    groups = block.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("quantization_config.config_groups: expected a non-empty dict")
    top_format = block.get("format")
    for gname, group in groups.items():
        where = f"quantization_config.config_groups.{gname}"
        if not isinstance(group, dict):
            raise ValueError(f"{where}: expected a dict, got {type(group).__name__}")
        fmt = group.get("format", top_format)
        if fmt != FORMAT:
            raise ValueError(f"{where}.format: expected {FORMAT!r}, got {fmt!r}")
        weights = group.get("weights")
        if not isinstance(weights, dict):
            raise ValueError(f"{where}.weights: expected a dict, got {weights!r}")
        for key, want in (("num_bits", 4), ("type", "float"), ("group_size", GROUP_SIZE)):
            if weights.get(key) != want:
                got = weights.get(key)
                raise ValueError(f"{where}.weights.{key}: expected {want!r}, got {got!r}")
        if weights.get("strategy", "group") not in ("group", "tensor_group"):
            raise ValueError(
                f"{where}.weights.strategy: expected 'group', got {weights.get('strategy')!r}"
            )
        if group.get("input_activations") is not None:
            raise ValueError(
                f"{where}.input_activations: only weight-only MXFP4 is supported, got "
                f"{group['input_activations']!r}"
            )
    return "mxfp4"


def quantization_config_block() -> dict[str, Any]:
    """The ``quantization_config`` a K3 MXFP4 checkpoint carries: routed experts only."""
    return {
        "quant_method": "compressed-tensors",
        "format": FORMAT,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "format": FORMAT,
                "targets": [r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"],
                "weights": {
                    "num_bits": 4,
                    "type": "float",
                    "strategy": "group",
                    "group_size": GROUP_SIZE,
                    "symmetric": True,
                    "dynamic": False,
                },
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
    }
