"""Triton MLA decode backend (HIP, CUDA, and the CPU interpreter)."""

from __future__ import annotations

from rocm_mla.backends.base import Capabilities, MLADecodeImpl
from rocm_mla.inputs import KV_DTYPES, Q_DTYPES


class TritonMLAImpl(MLADecodeImpl):
    name = "triton"
    capabilities = Capabilities(platforms=(), q_dtypes=Q_DTYPES, kv_dtypes=KV_DTYPES)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return "not implemented yet (the Triton kernel issue)"
