"""vLLM 0.33 MLA attention backend whose decode runs rocm_mla (``ROCM_MLA_BACKEND`` picks).

Only decode changes: prefill (``forward_mha``), the KV-cache writer, the metadata builder and
the DCP query gather / LSE combine are vLLM's own (``MLACommonImpl``,
``MLACommonMetadataBuilder``, ``MLAAttention.forward_impl``). ``forward_mqa`` hands the
decode rows to a rocm_mla impl, so the package's CP contract holds however the vLLM impl was
built: ``MLAAttention`` or a model layer calling ``get_impl_cls()(...)`` itself.

Importing this module imports vLLM; only the plugin's registry entry names it.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.config.cache import CacheDType
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.v1.attention.backend import AttentionLayer, AttentionType, MultipleOf
from vllm.v1.kv_cache_interface import is_quantized_kv_cache

from rocm_mla.backends import (
    BACKEND_NAMES,
    MLADecodeImpl,
    backend_class,
    requested_backend,
    select_backend,
)
from rocm_mla.contract import normalize_cp
from rocm_mla.inputs import FP8_DTYPES, Q_DTYPES, prepare_decode

BACKEND_NAME = "ROCM_MLA"

#: vLLM KV-cache dtype names this backend reads, and the cache tensor dtype each arrives as
#: (``MLAAttention`` views fp8 caches as the platform's fp8 type; "auto" = model dtype).
_KV_CACHE_DTYPES: dict[str, tuple[torch.dtype, ...]] = {
    "auto": Q_DTYPES,
    "float16": (torch.float16,),
    "bfloat16": (torch.bfloat16,),
    "fp8": FP8_DTYPES,
    "fp8_e4m3": FP8_DTYPES,
}


def _explicit_decoder() -> type[MLADecodeImpl] | None:
    """The rocm_mla impl class ``ROCM_MLA_BACKEND`` names, or None for auto.

    Auto can always fall back to the torch backend, so it restricts nothing statically.
    """
    name = requested_backend()
    return None if name == "auto" else backend_class(name)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class RocmMLAMetadataBuilder(MLACommonMetadataBuilder[MLACommonMetadata]):
    """vLLM's MLA metadata, with uniform multi-token decode rows (speculative verify).

    No CUDA-graph support (the builder default, NEVER): rocm_mla validates lengths and block
    ids on the host before every kernel, which a captured graph cannot do.
    """

    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.UNIFORM


class RocmMLABackend(MLACommonBackend):
    """The rocm-mla MLA backend, registered as ``CUSTOM`` (and, drop-in, as the ROCm MLA
    members) by :func:`rocm_mla.integrations.vllm.plugin.register`.

    Static limits come from the rocm_mla backend ``ROCM_MLA_BACKEND`` names (auto has none
    beyond these: it falls back to torch).
    """

    supported_dtypes: ClassVar[list[torch.dtype]] = list(Q_DTYPES)
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = list(_KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[RocmMLAImpl]:
        return RocmMLAImpl

    @staticmethod
    def get_builder_cls() -> type[RocmMLAMetadataBuilder]:
        return RocmMLAMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        # kv_lora_rank + rope width; rocm_mla needs a rope part, so NoPE (512) is out.
        return [320, 576]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        try:
            decoder = _explicit_decoder()
        except ValueError:
            # A bad ROCM_MLA_BACKEND is reported by validate_configuration, which calls this.
            return [MultipleOf(1)]
        if decoder is None or decoder.capabilities.block_sizes is None:
            return [MultipleOf(1)]
        return list(decoder.capabilities.block_sizes)

    @classmethod
    def validate_configuration(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: CacheDType | None,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        use_per_head_quant_scales: bool,
        device_capability,
        attn_type: str,
        has_sliding_window: bool = False,
        use_non_causal: bool = False,
        use_batch_invariant: bool = False,
        use_kv_connector: bool = False,
        use_pcp: bool = False,
        use_adaptive_verification: bool = False,
        use_dcp: bool = False,
        use_rswa: bool = False,
    ) -> list[str]:
        """vLLM's generic reasons plus the selected rocm_mla backend's own, so that vLLM
        falls back to another backend (auto) or refuses with them (explicit), never
        crashes in the first forward."""
        reasons = super().validate_configuration(
            head_size,
            dtype,
            kv_cache_dtype,
            block_size,
            use_mla,
            has_sink,
            use_sparse,
            use_mm_prefix,
            use_per_head_quant_scales,
            device_capability,
            attn_type,
            has_sliding_window=has_sliding_window,
            use_non_causal=use_non_causal,
            use_batch_invariant=use_batch_invariant,
            use_kv_connector=use_kv_connector,
            use_pcp=use_pcp,
            use_adaptive_verification=use_adaptive_verification,
            use_dcp=use_dcp,
            use_rswa=use_rswa,
        )
        try:
            decoder = _explicit_decoder()
        except ValueError as exc:
            return [*reasons, str(exc)]
        if decoder is None:
            return reasons
        prefix = f"ROCM_MLA_BACKEND={decoder.name}:"
        unavailable = decoder.unavailable_reason()
        if unavailable is not None:
            return [*reasons, f"{prefix} {unavailable}"]
        caps = decoder.capabilities
        if dtype not in caps.q_dtypes:
            reasons.append(
                f"{prefix} dtype {_dtype_name(dtype)} not supported "
                f"(supported: {', '.join(map(_dtype_name, caps.q_dtypes))})"
            )
        if kv_cache_dtype in (None, "auto"):
            cache_dtypes = (dtype,)
        else:
            cache_dtypes = _KV_CACHE_DTYPES.get(kv_cache_dtype, ())
        if cache_dtypes and not set(cache_dtypes) & set(caps.kv_dtypes):
            reasons.append(
                f"{prefix} kv_cache_dtype {kv_cache_dtype} not supported "
                f"(supported: {', '.join(map(_dtype_name, caps.kv_dtypes))})"
            )
        if (
            block_size is not None
            and caps.block_sizes is not None
            and block_size not in caps.block_sizes
        ):
            reasons.append(
                f"{prefix} block size {block_size} not supported (supported: {caps.block_sizes})"
            )
        return reasons


class RocmMLAImpl(MLACommonImpl[MLACommonMetadata]):
    """``MLACommonImpl`` whose decode is rocm_mla's, under the package's CP contract.

    ``__init__`` runs ``rocm_mla.normalize_cp`` on the pair vLLM set up (``__new__`` reads the
    DCP group, ``MLACommonImpl.__init__`` the parallel config), so an impl built directly by a
    model layer never carries the -1 sentinel. Each ``forward_mqa`` hands the current pair to
    a rocm_mla impl, whose ``run()`` re-checks it: a layer may legitimately reassign the pair
    after construction (Kimi-K3 sets (1, 0) when it owns the DCP combine), and one that
    assigns an illegal pair gets an error naming it instead of a kernel fault.
    """

    can_return_lse_for_decode: bool = True
    supports_dcp: bool = True
    # MLAAttentionImpl claims PCP; rocm_mla's decode has not been validated under it.
    supports_pcp: bool = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None,
        attn_type: str,
        kv_sharing_target_layer_name: str | None,
        **mla_args,
    ) -> None:
        super().__init__(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            alibi_slopes,
            sliding_window,
            kv_cache_dtype,
            logits_soft_cap,
            attn_type,
            kv_sharing_target_layer_name,
            **mla_args,
        )
        unsupported = {
            "alibi_slopes": alibi_slopes,
            "sliding_window": sliding_window,
            "logits_soft_cap": logits_soft_cap,
        }
        given = [name for name, value in unsupported.items() if value]
        if given:
            raise NotImplementedError(f"{BACKEND_NAME} MLA does not support {', '.join(given)}")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(
                f"{BACKEND_NAME} MLA supports decoder self-attention only, got {attn_type!r}"
            )
        self.dcp_world_size, self.dcp_rank = normalize_cp(self.dcp_world_size, self.dcp_rank)
        self.need_to_return_lse_for_decode = (
            self.dcp_world_size > 1 and self.can_return_lse_for_decode
        )
        # rocm_mla dequantizes an fp8 cache inside its kernels from an unquantized query.
        self.supports_quant_query_input = False

        self.rocm_mla_backend = requested_backend()
        names = BACKEND_NAMES if self.rocm_mla_backend == "auto" else (self.rocm_mla_backend,)
        # Under DCP the layer all-gathers the query on the head dim before forward_mqa.
        kernel_heads = num_heads * self.dcp_world_size
        self._decoders: dict[str, MLADecodeImpl] = {
            name: backend_class(name)(
                num_heads=kernel_heads,
                head_dim_v=self.kv_lora_rank,
                rope_dim=self.qk_rope_head_dim,
                softmax_scale=self.scale,
                dcp_world_size=self.dcp_world_size,
                dcp_rank=self.dcp_rank,
            )
            for name in names
        }
        allowed = backend_class(names[0]).capabilities.num_heads
        if len(names) == 1 and allowed is not None and kernel_heads not in allowed:
            raise ValueError(
                f"ROCM_MLA_BACKEND={names[0]} cannot decode {kernel_heads} query heads "
                f"({num_heads} per rank x DCP {self.dcp_world_size}); supported: {allowed}. "
                "Set ROCM_MLA_BACKEND to another backend or to auto"
            )

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: MLACommonMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Absorbed-MLA decode of the batch's decode rows.

        Args:
            q: ``[T, H, kv_lora_rank + rope]``, or the pair ``(ql_nope [T, H, kv_lora_rank],
                q_pe [T, H, rope])``; ``T = num_decodes * q_len`` rows, request-major, and
                under DCP ``H`` is the gathered head count.
            kv_c_and_k_pe_cache: ``[num_blocks, block_size, kv_lora_rank + rope]`` (this
                rank's shard under DCP); fp8 caches arrive viewed as the platform fp8 type.
            attn_metadata: vLLM's MLA metadata; ``decode.block_table [num_decodes, max_blocks]``
                and ``decode.seq_lens [num_decodes]`` (rank-local lengths under DCP, from
                the model runner).
            layer: the attention layer; ``layer._k_scale`` dequantizes an fp8 cache.

        Returns:
            ``(out [T, H, kv_lora_rank] in q's dtype, lse [T, H] float32)``, natural-log LSE;
            rows with no visible key give out 0 and lse -inf (empty DCP shards included).
        """
        decode = attn_metadata.decode
        if decode is None:
            raise ValueError(f"{BACKEND_NAME} forward_mqa: attn_metadata.decode is None")
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        num_decodes = decode.seq_lens.shape[0]
        rows, num_heads, head_dim = q.shape
        if num_decodes == 0 or rows % num_decodes:
            raise ValueError(
                f"{BACKEND_NAME} forward_mqa: {rows} query rows do not split evenly over "
                f"{num_decodes} decode requests (uniform decode blocks only)"
            )
        q_len = rows // num_decodes
        if q_len > 1 and attn_metadata.causal and self.dcp_world_size > 1:
            # Row i of a causal window has global length L - (q_len - 1) + i; its rank-local
            # length is not local(L) minus an offset, and vLLM 0.33 hands us only local(L).
            raise NotImplementedError(
                f"{BACKEND_NAME}: causal multi-token decode (q_len={q_len}) under DCP "
                f"{self.dcp_world_size} needs per-row local lengths from the model runner"
            )
        kv_scale = layer._k_scale if is_quantized_kv_cache(self.kv_cache_dtype) else None
        problem = prepare_decode(
            q.reshape(num_decodes, q_len, num_heads, head_dim),
            kv_c_and_k_pe_cache,
            decode.block_table,
            decode.seq_lens,
            head_dim_v=self.kv_lora_rank,
            softmax_scale=self.scale,
            causal=attn_metadata.causal,
            kv_scale=kv_scale,
        )
        decoder = self._decoders[select_backend(self.rocm_mla_backend, problem).name]
        decoder.dcp_world_size, decoder.dcp_rank = self.dcp_world_size, self.dcp_rank
        out, lse = decoder.run(problem)
        return out.reshape(rows, num_heads, self.kv_lora_rank), lse.reshape(rows, num_heads)


__all__ = ["BACKEND_NAME", "RocmMLABackend", "RocmMLAImpl", "RocmMLAMetadataBuilder"]
