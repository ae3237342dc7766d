"""Multi-head latent attention (MLA), gated and NoPE for Kimi-K3, RoPE for DeepSeek-style configs.

Each token caches one latent row ``[c (kv_lora_rank) | k_pe (rope dim)]``. A fresh prefill
runs the MHA form (decompress K/V with ``kv_b_proj``, causal attention); anything that attends
to cached tokens (decode, chunked prefill) runs the absorbed form through
``rocm_mla.mla_decode``: ``q_nope`` is folded into latent space with ``W_UK`` and the latent
output is expanded with ``W_UV``, both precomputed once by ``absorb_weights()``.
Tensor parallelism shards heads (q, kv_b, g rows; o_proj columns); the latent projections
are replicated. With a decode-context-parallel group the cache is sharded by token: each rank
writes only the tokens the runner's slot mapping gives it (-1 elsewhere) and decodes through
``rocm_mla.dcp.dcp_mla_decode`` with the runner's rank-local lengths. An fp8 cache stores the
latent rows at a fixed per-tensor scale of 1 (they are RMS-normalized, well inside e4m3's range)
and the query stays in the model dtype.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from rocm_mla.api import mla_decode
from rocm_mla.dcp import DecodeMetadata, dcp_mla_decode
from rocm_mla.inputs import FP8_DTYPES, DecodePlan
from rocm_mla.models.kimi_k3.config import KimiK3Config
from rocm_mla.models.kimi_k3.metadata import ForwardMetadata
from rocm_mla.models.kimi_k3.ops import AllReduce, RMSNorm, apply_rope, identity_reduce

#: Prefill queries attended per SDPA call (bounds the [H, chunk, n] score matrix).
PREFILL_QUERY_CHUNK = 1024


class MultiHeadLatentAttention(nn.Module):
    """One MLA layer on this TP rank's ``H / tp_size`` heads (checkpoint ``self_attn.*``)."""

    def __init__(
        self,
        config: KimiK3Config,
        tp_size: int = 1,
        all_reduce: AllReduce | None = None,
        backend: str | None = None,
        dcp_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        d = config.hidden_size
        self.num_heads = h = config.num_attention_heads // tp_size
        self.nope, self.rope, self.dv = (
            config.qk_nope_head_dim,
            config.qk_rope_head_dim,
            config.v_head_dim,
        )
        self.kv_lora_rank = config.kv_lora_rank
        qk = self.nope + self.rope
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.mla_latent_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, config.mla_latent_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, h * (self.nope + self.dv), bias=False)
        if config.mla_use_output_gate:
            self.g_proj = nn.Linear(d, h * self.dv, bias=False)
        self.o_proj = nn.Linear(h * self.dv, d, bias=False)
        self.use_gate = config.mla_use_output_gate
        self.use_rope = not config.mla_use_nope
        self.rope_theta = config.rope_theta
        self.scale = config.softmax_scale
        self.backend = backend
        self.dcp_group = dcp_group
        self.dcp_size = 1 if dcp_group is None else dist.get_world_size(dcp_group)
        self.all_reduce = all_reduce or identity_reduce
        self.w_uk_t: torch.Tensor | None = None
        self.w_uv: torch.Tensor | None = None

    @torch.no_grad()
    def absorb_weights(self) -> None:
        """Split ``kv_b_proj`` into ``W_UK^T [H, nope, R]`` and ``W_UV [H, R, dv]`` for decode.

        Call once after the weights are final (the loader does); decode refuses to run before.
        """
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.dv, self.kv_lora_rank)
        self.w_uk_t = w[:, : self.nope, :].contiguous()
        self.w_uv = w[:, self.nope :, :].transpose(1, 2).contiguous()

    def project(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [T, D]`` -> ``(q [T, H, nope + rope], latent [T, R], k_pe [T, rope])``."""
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(x.shape[0], self.num_heads, self.nope + self.rope)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)
        if self.use_rope:
            q = torch.cat(
                [q[..., : self.nope], apply_rope(q[..., self.nope :], positions, self.rope_theta)],
                -1,
            )
            k_pe = apply_rope(k_pe, positions, self.rope_theta)
        return q, latent, k_pe

    def attend_fresh(
        self, q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor
    ) -> torch.Tensor:
        """MHA form for one request with no cached context: ``[n, H, qk]`` -> ``[n, H, dv]``."""
        n = q.shape[0]
        kv = self.kv_b_proj(latent).view(n, self.num_heads, self.nope + self.dv)
        k_nope, v = kv.split([self.nope, self.dv], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None, :].expand(n, self.num_heads, self.rope)], dim=-1)
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, n, .]
        if n <= PREFILL_QUERY_CHUNK or q.device.type != "cpu":
            # On a GPU one causal call runs a fused (flash / memory-efficient) kernel that never
            # materializes the scores; chunking with explicit masks would force the math path.
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            return out.transpose(0, 1)
        # Long prompts on the CPU go in query chunks, each over the keys it can see: the CPU
        # SDPA for these head dims materializes the [H, n, n] scores, 8.6 GB at n = 16K.
        out = q.new_empty(self.num_heads, n, self.dv)
        for i0 in range(0, n, PREFILL_QUERY_CHUNK):
            i1 = min(n, i0 + PREFILL_QUERY_CHUNK)
            mask = torch.arange(i0, i1, device=q.device)[:, None] >= torch.arange(
                i1, device=q.device
            )
            out[:, i0:i1] = F.scaled_dot_product_attention(
                q[:, i0:i1], k[:, :i1], v[:, :i1], attn_mask=mask, scale=self.scale
            )
        return out.transpose(0, 1)

    def attend_cached(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        dcp: DecodeMetadata | None = None,
        plan: DecodePlan | None = None,
        fault_flag: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Absorbed form: ``q [B, S, H, qk]`` over the paged latent cache -> ``[B, S, H, dv]``.

        With a DCP group of more than one rank, ``dcp`` (the runner's metadata for this rank)
        is required: the layer never derives rank-local lengths itself. ``plan``: the runner's
        plan for this step's decode (None: each call plans for itself). ``fault_flag``: the
        runner's out-of-bounds flag, passed to the kernel call (``mla_decode``).
        """
        if self.w_uk_t is None or self.w_uv is None:
            raise RuntimeError(
                "MLA decode needs the absorbed weights: call model.absorb_weights() after the "
                "weights are loaded (the checkpoint loader does this)"
            )
        fp8 = kv_cache.dtype in FP8_DTYPES
        q_latent = torch.einsum("bshn,hnr->bshr", q[..., : self.nope], self.w_uk_t)
        mqa_q = torch.cat([q_latent, q[..., self.nope :]], dim=-1)
        mqa_q = mqa_q if fp8 else mqa_q.to(kv_cache.dtype)
        kv_scale = 1.0 if fp8 else None
        if self.dcp_size > 1:
            # dcp_mla_decode refuses missing runner metadata (RUNNER_CONTRACT).
            out = dcp_mla_decode(
                mqa_q,
                kv_cache,
                dcp,
                self.dcp_group,
                self.backend,
                head_dim_v=self.kv_lora_rank,
                softmax_scale=self.scale,
                kv_scale=kv_scale,
                plan=plan,
                fault_flag=fault_flag,
            )
        else:
            out, _ = mla_decode(
                mqa_q,
                kv_cache,
                block_tables,
                seq_lens.to(device=kv_cache.device, dtype=torch.int32),
                head_dim_v=self.kv_lora_rank,
                softmax_scale=self.scale,
                causal=True,
                backend=self.backend,
                kv_scale=kv_scale,
                plan=plan,
                fault_flag=fault_flag,
                return_lse=False,
            )
        return torch.einsum("bshr,hrv->bshv", out.to(q.dtype), self.w_uv)

    def forward(
        self, x: torch.Tensor, meta: ForwardMetadata, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        """``x [T, D]`` (normalized) -> ``[T, D]``; writes the new latent rows into ``kv_cache``.

        ``kv_cache``: ``[num_blocks, block_size, kv_lora_rank + rope]`` of this layer.
        """
        q, latent, k_pe = self.project(x, meta.positions)
        rows = kv_cache.view(-1, kv_cache.shape[-1])
        # Under DCP the runner maps tokens another rank owns to -1 and leaves them out of
        # write_rows; gathering by index (not by a boolean mask) keeps the write sync-free.
        write = meta.write_rows
        new_rows = torch.cat([latent, k_pe], dim=-1)
        rows[meta.slot_mapping.index_select(0, write)] = new_rows.index_select(0, write).to(
            rows.dtype
        )
        num_new, context = meta.num_new, meta.context_lens
        starts = meta.query_starts
        if all(c == 0 for c in context):
            out = torch.cat(
                [
                    self.attend_fresh(q[s:e], latent[s:e], k_pe[s:e])
                    for s, e in itertools.pairwise(starts)
                ]
            )
        elif len(set(num_new)) == 1:
            n = num_new[0]
            out = self.attend_cached(
                q.view(len(num_new), n, *q.shape[1:]),
                kv_cache,
                meta.block_tables,
                meta.seq_lens,
                meta.dcp,
                meta.decode_plan,
                meta.fault_flag,
            ).flatten(0, 1)
        elif self.dcp_size > 1:
            raise ValueError(
                f"MLA with a DCP group of {self.dcp_size} ranks attends cached context only for "
                f"a uniform number of new tokens per request (decode), got {num_new}; prefill "
                "whole prompts in one step"
            )
        else:
            out = torch.cat(
                [
                    self.attend_cached(
                        q[s:e][None],
                        kv_cache,
                        meta.block_tables[b : b + 1],
                        meta.seq_lens[b : b + 1],
                        fault_flag=meta.fault_flag,
                    )[0]
                    for b, (s, e) in enumerate(itertools.pairwise(starts))
                ]
            )
        if self.use_gate:
            out = out * torch.sigmoid(self.g_proj(x)).view_as(out)
        return self.all_reduce(self.o_proj(out.reshape(x.shape[0], -1)))
