"""What decodes and what cannot, in words: the start-up refusal of a named backend and the
first-decode line (``rocm-mla: decode with ...``).

No vLLM import here, so ``rocm-mla info`` prints the same facts outside a vLLM process.
"""

from __future__ import annotations

import torch

from rocm_mla.backends import BACKEND_NAMES, ENV_VAR, backend_class
from rocm_mla.backends.base import MLADecodeImpl
from rocm_mla.inputs import FP8_DTYPES, DecodePlan


def _dtype_names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def backend_cannot_run(
    decoder: type[MLADecodeImpl],
    *,
    device_kind: str | None,
    kv_dtypes: tuple[torch.dtype, ...] = (),
) -> list[str]:
    """Why ``decoder`` cannot serve here at all, from what is known before any request.

    Args:
        decoder: a rocm_mla backend class.
        device_kind: the platform kind the engine computes on ("cpu", "cuda", "hip"), or
            None when the engine has not decided one (then only the machine is checked).
        kv_dtypes: the tensor dtypes the KV cache may arrive as (any one must be supported);
            empty checks nothing.
    """
    unavailable = decoder.unavailable_reason()
    if unavailable is not None:
        return [unavailable]
    caps = decoder.capabilities
    reasons = []
    if device_kind is not None and device_kind not in caps.platforms:
        reasons.append(
            f"the engine runs on {device_kind}, this backend on "
            f"{', '.join(caps.platforms) or 'nothing here'}"
        )
    if kv_dtypes and not set(kv_dtypes) & set(caps.kv_dtypes):
        reasons.append(
            f"KV cache {_dtype_names(kv_dtypes)}, supported: {_dtype_names(caps.kv_dtypes)}"
        )
    return reasons


def startup_refusal(
    name: str, *, device_kind: str | None, kv_dtypes: tuple[torch.dtype, ...] = ()
) -> str | None:
    """The error text that stops start-up when the named backend cannot serve here, or None.

    ``name`` is a resolved backend name (``requested_backend()``); auto is never refused:
    it falls back to torch, which runs everywhere.
    """
    if name == "auto":
        return None
    reasons = backend_cannot_run(backend_class(name), device_kind=device_kind, kv_dtypes=kv_dtypes)
    if not reasons:
        return None
    usable = [
        other
        for other in BACKEND_NAMES
        if other != name
        and not backend_cannot_run(
            backend_class(other), device_kind=device_kind, kv_dtypes=kv_dtypes
        )
    ]
    return (
        f"rocm-mla: {ENV_VAR}={name} cannot run on this machine: {'; '.join(reasons)}. "
        f"Backends that can: {', '.join(usable) or 'none'} (set {ENV_VAR} to one of them, "
        "or to auto)"
    )


def describe_launch(plan: DecodePlan) -> str:
    """The backend, its target and launch parameters, e.g. ``triton (sm90, BLOCK_H 64,
    BLOCK_N 32, 4 warps, balanced over 264 slots, fp8 dots)``."""
    facts = [backend_class(plan.backend).target() or str(plan.spec.device)]
    if plan.backend == "triton":
        launch = plan.launch
        config = launch.config
        facts += [
            f"BLOCK_H {config.block_h}",
            f"BLOCK_N {config.block_n}",
            f"{config.num_warps} warps",
            launch.balanced,
        ]
        if plan.spec.kv_dtype in FP8_DTYPES:
            dots = [what for what, on in (("Q.K", config.fp8_qk), ("P.V", config.fp8_pv)) if on]
            facts.append(f"fp8 {' and '.join(dots)} dots" if dots else "dequantized fp8 cache")
    return f"{plan.backend} ({', '.join(facts)})"


def describe_plan(plan: DecodePlan) -> str:
    """One line saying what decodes a step, e.g. ``rocm-mla: decode with triton (sm90,
    BLOCK_H 64, ...) for 12 heads, q_len 1, kv bfloat16``."""
    spec = plan.spec
    return (
        f"rocm-mla: decode with {describe_launch(plan)} for {spec.num_heads} heads, "
        f"q_len {spec.q_len}, kv {_dtype_names((spec.kv_dtype,))}"
    )


#: The decode ``rocm-mla info`` plans as its example: one Kimi-K3 rank at TP 8 (96 / 8
#: heads), plain decode, 8 requests of 4K tokens, a bf16 cache.
EXAMPLE_DECODE = {"num_heads": 12, "q_len": 1, "batch": 8, "seqlen": 4096}


def example_decode_line(device: torch.device) -> str:
    """What ``ROCM_MLA_BACKEND`` (or auto) would decode :data:`EXAMPLE_DECODE` with on
    ``device``: the first-decode line a vLLM worker logs, or why no backend can."""
    from rocm_mla.api import plan_decode

    example = EXAMPLE_DECODE
    try:
        plan = plan_decode(
            [example["seqlen"]] * example["batch"],
            q_len=example["q_len"],
            num_heads=example["num_heads"],
            kv_dtype=torch.bfloat16,
            q_dtype=torch.bfloat16,
            device=device,
        )
    except ValueError as exc:
        return f"rocm-mla: no decode: {exc}"
    return f"{describe_plan(plan)} (example: {example['batch']} x {example['seqlen']} tokens)"
