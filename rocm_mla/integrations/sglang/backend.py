"""SGLang 0.5.23 MLA attention backend whose decode runs rocm_mla (``ROCM_MLA_BACKEND`` picks).

Decode (``ForwardMode.DECODE``) and linear speculative verify windows (``TARGET_VERIFY`` with
``topk == 1``: a causal window of ``draft_token_num`` rows per request) go through
``rocm_mla.plan_decode`` / ``rocm_mla.mla_decode``. Everything else is delegated to an SGLang
backend built for the same runner: extend/prefill, tree verify (``topk > 1``, a custom mask),
draft extend, the DeepSeek MHA paths and any backend-specific helper the model asks for.
Which one: the backend the drop-in replaced (``aiter`` or ``triton`` on ROCm, the CUDA MLA
backends, ``torch_native`` / ``intel_amx`` on CPU), or, selected by name, the platform's
(:func:`platform_prefill_backend`: ``aiter`` on ROCm when it imports, else ``triton``;
``triton`` on CUDA; ``torch_native`` on CPU).

Once per step, in ``init_forward_metadata_out_graph``, SGLang's ``req_to_token`` rows of the
batch are turned into our block table (``req_to_token[req, ::page_size] // page_size``: SGLang
pages are aligned runs of ``page_size`` token slots) and the step is planned; each layer's
decode then views the pool's ``[slots, 1, D]`` buffer as ``[pages, page_size, D]`` (no copy)
and launches with the plan. With graph state (``init_cuda_graph_state``) the table and lengths
are copied into persistent buffers out of graph, one plan per (batch, q_len) is made for the
pool's context length and re-planned on the device each step (``replan_decode``), so the
captured decode reads no host value and replays balanced by the step's own lengths.

Decode context parallelism (``--dcp-size N``): SGLang stripes each request's KV over the DCP
ranks by token, ``p`` on rank ``p % N`` (its allocator pages ``page_size * N`` KV ids, and an
id's owner is ``id % N``, its row on that rank ``id // N``). That is rocm_mla's DCP layout with
interleave 1: each rank holds a dense prefix of its tokens, read through a block table of
``req_to_token[req, ::page_size * N] // (page_size * N)``. SGLang's DeepSeek layer gathers
the query heads of the DCP group before the backend and merges the partials by LSE after it,
so here only the rank-local part runs: the step's rank-local lengths come from the global ones
in one place (``rocm_mla.dcp.DecodeMetadata.build``, i.e. ``verify_local_seq_lens``), every
gathered head is decoded over this rank's shard, and the decode returns ``(out, lse)`` with the
LSE in the base SGLang's merge assumes for this backend's name
(``is_mla_dcp_lse_base_on_e``). A layout that is not this one (allocator pages not widened by
``N``; a translating, write-resolving or replicated pool) is refused at start-up by name.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.model_executor.forward_context import get_attn_backend
from sglang.srt.runtime_context import get_parallel

from rocm_mla.api import mla_decode, plan_decode, replan_decode
from rocm_mla.backends import requested_backend
from rocm_mla.backends.base import device_kind
from rocm_mla.dcp import DecodeMetadata, verify_local_seq_lens
from rocm_mla.inputs import FP8_DTYPES, DecodePlan
from rocm_mla.integrations.common import CallLog, announce, startup_refusal
from rocm_mla.platform import resolve_device

BACKEND_NAME = "rocm_mla"
logger = logging.getLogger("sglang.srt.plugins.rocm_mla")

#: Test hook: a directory where every process appends one line per decode this backend runs
#: (``<pid>.log``: ``decode <rocm_mla backend> <rows> <q_len> <sglang mode>``) and per call
#: it delegates (``delegate <sglang backend> <sglang mode>``), so a test can prove which
#: kernel ran. Unset in normal use: no file is touched.
CALL_LOG_ENV = "ROCM_MLA_SGLANG_CALL_LOG"


def platform_prefill_backend(runner) -> str:
    """The SGLang backend extend is delegated to under ``--attention-backend rocm_mla``."""
    if torch.device(runner.device).type == "cpu":
        return "torch_native"
    if torch.version.hip:
        try:
            import aiter  # noqa: F401 (the import is the probe)
        except ImportError:
            return "triton"
        return "aiter"
    return "triton"


def prefill_name_of(forward_batch) -> str:
    """The name of the SGLang backend our extend goes to, for the current forward (the
    DeepSeek forward-method handler of that backend decides the model's path)."""
    backend = get_attn_backend()
    backend = getattr(backend, "primary", backend)  # two-batch overlap wraps its children
    return getattr(backend, "rocm_mla_prefill_name", "triton")


def sglang_dcp_layout(runner) -> tuple[int, int]:
    """``(size, rank)`` of SGLang's decode context parallelism for ``runner``; ``(1, 0)``
    without it.

    Under DCP the only layout rocm_mla reads is SGLang's striped one: the allocator hands out
    pages of ``page_size * size`` KV ids, aligned with the request's positions, an id's owner
    is ``id % size`` and its row there ``id // size`` (the pool's ``set_mla_kv_buffer``
    applies that rule to the write ids it gets), and ``req_to_token`` holds those ids
    untranslated. Then position ``p`` is on rank ``p % size`` at local position
    ``p // size``: rocm_mla's layout with interleave 1.

    Raises:
        RuntimeError: DCP is on and the runner's layout is another one; the message names
            what differs.
    """
    parallel = get_parallel()
    size = parallel.attn_dcp_size
    if size in (None, -1, 0, 1):
        return 1, 0
    pool = runner.token_to_kv_pool
    allocator_page = runner.token_to_kv_pool_allocator.page_size
    problems = []
    if allocator_page != runner.page_size * size:
        problems.append(
            f"the allocator's pages hold {allocator_page} KV ids, not page_size x dcp = "
            f"{runner.page_size} x {size} (SGLang's striped pages, whose id % {size} is the "
            "owner of the position)"
        )
    if runner.kv_index_translator.is_translating:
        problems.append(
            "req_to_token holds virtual KV ids that a page table maps (a unified or "
            "fused-draft pool), not the striped ids themselves"
        )
    if pool.write_loc_is_dcp_resolved:
        problems.append(f"{type(pool).__name__} takes write ids already resolved to its rows")
    if pool.dcp_replicated:
        problems.append(f"{type(pool).__name__} is replicated on every DCP rank, not striped")
    if problems:
        raise RuntimeError(
            f"rocm-mla: SGLang decode context parallelism (dcp {size}) in a layout rocm_mla "
            f"cannot read: {'; '.join(problems)}. rocm_mla reads SGLang's striped layout only "
            f"(token p on rank p % {size}). Run with dcp 1, or without ROCM_MLA_BACKEND / "
            f"--attention-backend {BACKEND_NAME}"
        )
    return size, parallel.attn_dcp_rank


@dataclass
class _StepMetadata:
    """What every MLA layer of one step decodes with: the kernel call's table, lengths and
    plan, and under DCP the runner-side metadata they were made from."""

    plan: DecodePlan
    block_table: torch.Tensor  #: ``[B, max_pages]`` int32 page ids
    #: ``[B]`` int32 lengths, the step's new tokens included: global, or under DCP each
    #: request's rank-local one (its window's last row's)
    cache_seqlens: torch.Tensor
    #: under DCP ``[B, q_len]`` int32, each query row's rank-local KV bound; else None
    row_seqlens: torch.Tensor | None
    requests: int
    q_len: int
    dcp: DecodeMetadata | None


class RocmMLAAttnBackend(AttentionBackend):
    """SGLang ``AttentionBackend`` for absorbed MLA: our decode, ``prefill_backend`` for the
    rest (every attribute this class does not define is the prefill backend's).

    Args:
        runner: SGLang's ``ModelRunner`` (``token_to_kv_pool`` an MLA pool,
            ``req_to_token_pool``, ``model_config``, ``device``, ``kv_cache_dtype``).
        name: the SGLang backend name this object is built for (``rocm_mla``, or the
            drop-in's slot): SGLang's DeepSeek layer picks the base of the DCP LSE by it.
        prefill_backend: the SGLang backend built for the same runner that runs extend.
        prefill_name: its registry name (``aiter``, ``triton``, ``torch_native``...).

    Raises:
        RuntimeError: the named ``ROCM_MLA_BACKEND`` cannot run here (its reasons and the
            backends that can), or the runner uses decode context parallelism in a layout
            other than SGLang's striped one (``sglang_dcp_layout``).
        ValueError: ``ROCM_MLA_BACKEND`` names no backend, or the KV pool is not an MLA pool
            this backend can page through.
    """

    def __init__(
        self, runner, *, name: str, prefill_backend: AttentionBackend, prefill_name: str
    ) -> None:
        super().__init__()
        self.prefill_backend = prefill_backend
        self.rocm_mla_prefill_name = prefill_name
        self.rocm_mla_backend = requested_backend()
        pool = runner.token_to_kv_pool
        self.kv_dtype = runner.kv_cache_dtype
        refusal = startup_refusal(
            self.rocm_mla_backend,
            device_kind=device_kind(torch.device(runner.device)),
            kv_dtypes=(self.kv_dtype,),
        )
        if refusal is not None:
            raise RuntimeError(refusal)
        for attr in ("kv_lora_rank", "qk_rope_head_dim"):
            if not hasattr(pool, attr):
                raise ValueError(
                    f"rocm-mla: the KV pool {type(pool).__name__} is not an MLA pool "
                    f"(no {attr}); {BACKEND_NAME} serves MLA models only"
                )
        self.dcp_size, self.dcp_rank = sglang_dcp_layout(runner)
        #: Our natural-log LSE times this is the LSE SGLang's DCP merge reads.
        self.lse_scale = 1.0
        if self.dcp_size > 1:
            # SGLang's DeepSeek layer merges the ranks' partials taking the LSE in natural log
            # for some backend names and in base 2 for the rest (imported here: the DeepSeek
            # model stack is already loaded whenever SGLang serves DCP).
            from sglang.srt.models.deepseek_common.attention_forward_methods.forward_mla import (
                is_mla_dcp_lse_base_on_e,
            )

            if not is_mla_dcp_lse_base_on_e(name):
                self.lse_scale = math.log2(math.e)
        self.head_dim_v = pool.kv_lora_rank
        self.rope_dim = pool.qk_rope_head_dim
        self.page_size = runner.page_size
        # KV ids per block-table entry: a page, which under DCP strides page_size * dcp ids
        # of req_to_token (page_size on each rank).
        self.table_stride = self.page_size * self.dcp_size
        # Resolved once ("cuda" -> the current GPU): the graph buffers, the plans and the
        # step's tensors then all name the same device.
        self.device = resolve_device(runner.device)
        self.q_dtype = runner.dtype
        # Under DCP the layer hands over the query heads of the whole DCP group, gathered.
        local_heads = runner.model_config.get_num_attention_heads(get_parallel().attn_tp_size)
        self.num_heads = local_heads * self.dcp_size
        self.token_to_kv_pool = pool
        self.req_to_token = runner.req_to_token_pool.req_to_token
        # Pages are read as a view of the pool's slots: they must tile it.
        slots = self.token_to_kv_pool.get_key_buffer(self._first_layer()).shape[0]
        if slots % self.page_size:
            raise ValueError(
                f"rocm-mla: the KV pool's {slots} slots are not a whole number of "
                f"{self.page_size}-token pages"
            )
        self.max_pages = -(-self.req_to_token.shape[1] // self.table_stride)
        self.forward_metadata: _StepMetadata | None = None
        self._graph_block_table: torch.Tensor | None = None
        self._graph_seqlens: torch.Tensor | None = None
        self._graph_row_seqlens: torch.Tensor | None = None
        self._graph_plans: dict[tuple[int, int], DecodePlan] = {}
        self._log = CallLog(CALL_LOG_ENV)
        if self.dcp_size > 1:
            logger.info(
                "rocm-mla: SGLang DCP rank %d of %d: token p on rank p %% %d, this rank "
                "decodes %d gathered heads over its shard and returns a base-%s LSE",
                self.dcp_rank,
                self.dcp_size,
                self.dcp_size,
                self.num_heads,
                "e" if self.lse_scale == 1.0 else "2",
            )

    def _first_layer(self) -> int:
        return getattr(self.token_to_kv_pool, "start_layer", 0) or 0

    def __getattr__(self, name: str):
        # Only reached for names this object lacks: the prefill backend's helpers
        # (chunked-prefix packing, verify buffers...) that SGLang's models call on "the"
        # backend. Private names are not forwarded, so a typo here stays an error.
        if name.startswith("_") or name == "prefill_backend":
            raise AttributeError(name)
        return getattr(self.prefill_backend, name)

    # -- which forwards are ours ------------------------------------------------------------

    @staticmethod
    def _decode_q_len(forward_batch) -> int | None:
        """Query rows per request when this batch decodes through rocm_mla, else None."""
        mode = forward_batch.forward_mode
        if mode.is_decode():
            return 1
        if mode.is_target_verify():
            spec = forward_batch.spec_info
            # A linear draft (topk 1) is a causal window; a tree needs its custom mask.
            if spec is not None and getattr(spec, "topk", None) == 1:
                return int(spec.draft_token_num)
        return None

    # -- metadata ---------------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch) -> None:
        if self._decode_q_len(forward_batch) is None:
            self.forward_metadata = None
            self.prefill_backend.init_forward_metadata(forward_batch)
            return
        self.init_forward_metadata_out_graph(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """The step's block table, lengths and plan (host work; outside any graph)."""
        q_len = self._decode_q_len(forward_batch)
        if q_len is None:
            self.forward_metadata = None
            self.prefill_backend.init_forward_metadata_out_graph(forward_batch, in_capture)
            return
        batch = forward_batch.batch_size
        rows = forward_batch.req_pool_indices[:batch]
        stride = self.table_stride
        block_table = (self.req_to_token[rows, ::stride] // stride).to(torch.int32)
        # TARGET_VERIFY's seq_lens count the cached prefix only; the window's rows are
        # already written at out_cache_loc when the layer decodes.
        extra = 0 if forward_batch.forward_mode.is_decode() else q_len
        seqlens = forward_batch.seq_lens[:batch].to(torch.int32) + extra
        host = forward_batch.seq_lens_cpu
        host_lens = None if host is None else host[:batch].to(torch.int32) + extra
        dcp, row_seqlens = None, None
        if self.dcp_size > 1:
            # The rank-local lengths are made here only: from SGLang's global lengths and its
            # layout, by rocm_mla's formula (the device copy decodes, the host copy plans).
            dcp = DecodeMetadata.build(block_table, seqlens, q_len, self.dcp_size, self.dcp_rank)
            seqlens, row_seqlens = dcp.shard_lengths()
            if host_lens is not None:
                host_lens = verify_local_seq_lens(host_lens, q_len, self.dcp_size, self.dcp_rank)
                host_lens = host_lens[:, -1]
        graph = self._graph_seqlens is not None and batch <= self._graph_seqlens.shape[0]
        key = (batch, q_len)
        if graph and (in_capture or key in self._graph_plans):
            self._graph_block_table[:batch].copy_(block_table)
            self._graph_seqlens[:batch].copy_(seqlens)
            block_table = self._graph_block_table[:batch]
            seqlens = self._graph_seqlens[:batch]
            if row_seqlens is not None:
                rows = self._graph_row_seqlens[: batch * q_len].view(batch, q_len)
                row_seqlens = rows.copy_(row_seqlens)
            plan = self._graph_plans.get(key)
            if plan is None:
                # Any replayed step of this shape: lengths up to the pool's context length.
                plan = self._plan(seqlens, q_len, bound=self.max_pages * self.page_size)
                self._graph_plans[key] = plan
            replan_decode(plan, seqlens)
        else:
            plan = self._plan(seqlens if host_lens is None else host_lens, q_len)
        announce(plan, logger)
        self.forward_metadata = _StepMetadata(
            plan, block_table, seqlens, row_seqlens, batch, q_len, dcp
        )

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        # Ours is all out of graph; the delegate may record its own.
        if self._decode_q_len(forward_batch) is None:
            self.prefill_backend.init_forward_metadata_in_graph(forward_batch)

    def _plan(self, lengths, q_len: int, bound: int | None = None) -> DecodePlan:
        """The step's plan for ``lengths``, those of the kernel call (under DCP the rank-local
        ones, with every row's own bound)."""
        return plan_decode(
            lengths,
            q_len=q_len,
            num_heads=self.num_heads,
            head_dim_v=self.head_dim_v,
            rope_dim=self.rope_dim,
            kv_dtype=self.kv_dtype,
            q_dtype=self.q_dtype,
            # A single query's bound is its request's length (DecodeMetadata.shard_lengths).
            row_bounds=self.dcp_size > 1 and q_len > 1,
            # Only SGLang's DCP merge reads the decode's LSE.
            return_lse=self.dcp_size > 1,
            device=self.device,
            graph_max_seqlen=bound,
            backend=self.rocm_mla_backend,
        )

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self._graph_block_table = torch.zeros(
            (max_bs, self.max_pages), dtype=torch.int32, device=self.device
        )
        self._graph_seqlens = torch.zeros((max_bs,), dtype=torch.int32, device=self.device)
        # Under DCP every query row's bound (a window's rows: at most max_num_tokens).
        rows = max(max_bs, max_num_tokens) if self.dcp_size > 1 else 0
        self._graph_row_seqlens = torch.zeros((rows,), dtype=torch.int32, device=self.device)
        self._graph_plans = {}
        if type(self.prefill_backend).init_cuda_graph_state is not (
            AttentionBackend.init_cuda_graph_state
        ):
            self.prefill_backend.init_cuda_graph_state(max_bs, max_num_tokens)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def on_after_cuda_graph_warmup(self) -> None:
        self.prefill_backend.on_after_cuda_graph_warmup()

    # -- forwards ---------------------------------------------------------------------------

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if self.forward_metadata is None:
            self._log("delegate", self.rocm_mla_prefill_name, forward_batch.forward_mode.name)
            return self.prefill_backend.forward_extend(
                q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs
            )
        return self._decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def _decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer,
        forward_batch,
        save_kv_cache: bool,
        q_rope: torch.Tensor | None = None,
        k_rope: torch.Tensor | None = None,
        **unsupported,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Absorbed-MLA decode of the step's rows, launched from the step's plan.

        Args:
            q: ``[T, H * D]`` (or ``[T, H, D]``); with ``q_rope`` its first
                ``kv_lora_rank`` columns per head only. ``T = B * q_len``, request-major.
                Under DCP ``H`` is the DCP group's heads, gathered by SGLang's layer.
            k, v: the new rows ``[T, 1, D]`` and ``[T, 1, kv_lora_rank]`` (or, with
                ``k_rope``, ``k`` is ``[T, 1, kv_lora_rank]``), written to the pool at
                ``out_cache_loc`` when ``save_kv_cache``.
            layer: the ``RadixAttention`` (``scaling``, ``layer_id``, ``k_scale`` for fp8).

        Returns:
            ``[T, H * kv_lora_rank]`` in q's dtype. Under DCP ``(out, lse)``: this rank's
            partial over its shard and its ``[T, H]`` float32 LSE, in the base SGLang's
            merge takes for this backend's name (a row with no key on this rank: out 0,
            LSE -inf); SGLang's layer merges the ranks' partials.
        """
        if unsupported:
            raise NotImplementedError(
                f"{BACKEND_NAME} decode does not support {', '.join(sorted(unsupported))}"
            )
        meta = self.forward_metadata
        if meta is None:
            raise ValueError(
                f"{BACKEND_NAME}: decode without step metadata; call init_forward_metadata "
                f"(or its out-of-graph half) for this {forward_batch.forward_mode.name} batch"
            )
        if layer.tp_q_head_num != self.num_heads:
            gathered = (
                f" (under DCP {self.dcp_size}, the heads gathered over the DCP group: "
                "SGLang's attn_mqa_for_dcp_decode)"
                if self.dcp_size > 1
                else ""
            )
            raise ValueError(
                f"{BACKEND_NAME}: layer {layer.layer_id} has {layer.tp_q_head_num} query heads "
                f"per rank, the step was planned for {self.num_heads}{gathered}"
            )
        if save_kv_cache and k is not None:
            if layer.k_scale is not None:
                k = k / layer.k_scale
                k_rope = None if k_rope is None else k_rope / layer.k_scale
            where = KVWriteLoc.for_batch(forward_batch)
            if k_rope is None and self.dcp_size > 1:
                # Under DCP only the split write keeps this rank's tokens of the striped
                # write ids (SGLang's MLA pool refuses the whole-row one).
                k, k_rope = k[..., : self.head_dim_v], k[..., self.head_dim_v :]
            if k_rope is not None:
                self.token_to_kv_pool.set_mla_kv_buffer(layer, where, k, k_rope)
            else:
                self.token_to_kv_pool.set_kv_buffer(layer, where, k, v)
        heads, width = self.num_heads, self.head_dim_v + self.rope_dim
        q = q.reshape(-1, heads, q.shape[-1] // heads if q.dim() == 2 else q.shape[-1])
        if q_rope is not None:
            q = torch.cat([q, q_rope.reshape(q.shape[0], heads, -1)], dim=-1)
        rows = q.shape[0]
        if rows != meta.requests * meta.q_len or q.shape[-1] != width:
            raise ValueError(
                f"{BACKEND_NAME}: q has {rows} rows of {q.shape[-1]} per head, expected "
                f"{meta.requests} requests x q_len {meta.q_len} rows of {width}"
            )
        cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        pages = cache.view(-1, self.page_size, width)
        fp8 = pages.dtype in FP8_DTYPES
        kv_scale = (layer.k_scale_float if layer.k_scale is not None else 1.0) if fp8 else None
        if self._log.path is not None:
            self._log(
                "decode", meta.plan.backend, rows, meta.q_len, forward_batch.forward_mode.name
            )
        out, lse = mla_decode(
            q.view(-1, meta.q_len, heads, width),
            pages,
            meta.block_table,
            meta.cache_seqlens,
            head_dim_v=self.head_dim_v,
            softmax_scale=layer.scaling,
            kv_scale=kv_scale,
            plan=meta.plan,
            row_seqlens=meta.row_seqlens,
        )
        out = out.reshape(rows, heads * self.head_dim_v)
        if meta.dcp is None:
            return out
        return out, lse.reshape(rows, heads) * self.lse_scale


__all__ = [
    "BACKEND_NAME",
    "CALL_LOG_ENV",
    "RocmMLAAttnBackend",
    "platform_prefill_backend",
    "prefill_name_of",
    "sglang_dcp_layout",
]
