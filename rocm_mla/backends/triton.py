"""Triton MLA decode backend: HIP (MI300X first), CUDA, and the CPU interpreter.

One kernel source (``rocm_mla.kernels.mla_decode_kernel``, launched by
``rocm_mla.kernels.mla_decode``) serves every target. On a machine with no GPU it runs under
``TRITON_INTERPRET=1``: correct but slow, so it is for tests only and ``auto`` never picks it.
Nothing here imports triton or queries a GPU driver until a backend question is actually asked.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from rocm_mla.backends.base import Capabilities, MLADecodeImpl
from rocm_mla.inputs import Q_DTYPES, DecodePlan, DecodeProblem, DecodeSpec

_NOT_INSTALLED = (
    "triton is not installed (CPU/CUDA: pip install 'rocm-mla[triton]'; ROCm images ship "
    "their own Triton, never install the PyPI wheel over it)"
)
_BASE_KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _target():
    """The Triton target (``TritonTarget``), or None; never raises on a CPU-only machine."""
    if importlib.util.find_spec("triton") is None:
        return None
    from rocm_mla.kernels.target import triton_target

    return triton_target()


@functools.cache
def _capabilities() -> Capabilities:
    target = _target()
    if target is None:
        return Capabilities(platforms=(), q_dtypes=Q_DTYPES, kv_dtypes=_BASE_KV_DTYPES)
    if target.backend == "interpreter":
        # The interpreter converts both fp8 flavours in software.
        fp8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
        platforms = ("cpu",)
    elif target.backend == "hip":
        # MI300X (gfx942) computes the fnuz flavour of e4m3; gfx950 and later the OCP one.
        fp8 = (torch.float8_e4m3fnuz,) if target.arch == "gfx942" else (torch.float8_e4m3fn,)
        platforms = ("hip",)
    else:
        # Triton converts e4m3fn on NVIDIA from sm89 (Ada/Hopper) on.
        fp8 = (torch.float8_e4m3fn,) if int(target.arch.removeprefix("sm")) >= 89 else ()
        platforms = ("cuda",)
    return Capabilities(platforms=platforms, q_dtypes=Q_DTYPES, kv_dtypes=(*_BASE_KV_DTYPES, *fp8))


class _LazyCapabilities:
    """Resolves ``TritonMLAImpl.capabilities`` on first access, not at import.

    Which platforms and fp8 flavours the backend supports depends on the Triton target, and
    finding it out queries the GPU driver; doing that when the registry merely imports this
    module would initialize the GPU in processes that may still fork workers.
    """

    def __get__(self, instance, owner) -> Capabilities:
        return _capabilities()


class TritonMLAImpl(MLADecodeImpl):
    """Split-KV Triton MLA decode.

    Args (beyond ``MLADecodeImpl``'s):
        num_kv_splits: force the number of KV splits per request (>= 1); None chooses it
            per call from the lengths and the compute-unit count
            (``rocm_mla.kernels.plan.choose_num_kv_splits``).
    """

    name = "triton"
    capabilities = _LazyCapabilities()

    def __init__(self, *args, num_kv_splits: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if num_kv_splits is not None and (
            isinstance(num_kv_splits, bool)
            or not isinstance(num_kv_splits, int)
            or num_kv_splits < 1
        ):
            raise ValueError(
                f"triton: num_kv_splits must be an int >= 1 or None, got {num_kv_splits!r}"
            )
        self.num_kv_splits = num_kv_splits

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return _NOT_INSTALLED
        if _target() is None:
            from rocm_mla.kernels.target import triton_target_unavailable_reason

            return triton_target_unavailable_reason()
        return None

    @classmethod
    def target(cls) -> str | None:
        target = _target()
        return None if target is None else str(target)

    @classmethod
    def auto_skip_reason(cls) -> str | None:
        target = _target()
        if target is not None and target.backend == "interpreter":
            return "the Triton interpreter is for testing only (slow); ask for it by name"
        return None

    @classmethod
    def plan_launch(
        cls, spec: DecodeSpec, *, batch: int, max_seqlen: int, total_seqlen: int
    ) -> object:
        """Stage-1 block shapes and split count (``kernels.plan.plan_launch``)."""
        from rocm_mla.kernels.plan import plan_launch

        return plan_launch(
            batch=batch,
            q_len=spec.q_len,
            num_heads=spec.num_heads,
            kv_dtype=spec.kv_dtype,
            max_len=max_seqlen,
            total_len=total_seqlen,
            q_dtype=spec.q_dtype,
            head_dim=spec.head_dim,
            head_dim_v=spec.head_dim_v,
            page_size=spec.block_size,
        )

    def _decode(
        self, problem: DecodeProblem, plan: DecodePlan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from rocm_mla.kernels import mla_decode

        config, num_kv_splits = plan.launch
        return mla_decode.mla_decode(
            problem.q,
            problem.kv_cache,
            problem.block_table,
            problem.cache_seqlens,
            head_dim_v=problem.head_dim_v,
            softmax_scale=problem.softmax_scale,
            causal=problem.causal,
            kv_scale=problem.kv_scale,
            num_kv_splits=num_kv_splits if self.num_kv_splits is None else self.num_kv_splits,
            config=config,
            fault_flag=problem.fault_flag,
        )
