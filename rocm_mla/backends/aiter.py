"""AITER MLA decode backend (MI300X/MI355X, aiter.mla.mla_decode_fwd)."""

from __future__ import annotations

from rocm_mla.backends.base import Capabilities, MLADecodeImpl
from rocm_mla.inputs import KV_DTYPES, Q_DTYPES


class AiterMLAImpl(MLADecodeImpl):
    name = "aiter"
    capabilities = Capabilities(platforms=(), q_dtypes=Q_DTYPES, kv_dtypes=KV_DTYPES)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return "not implemented yet (the AITER backend issue)"
