"""Kimi-K3 / Kimi-Linear causal LM, built for one pipeline stage and one tensor-parallel rank.

Only this stage's layers exist (``pp_layer_range``); the first stage embeds, the last applies
the final norm and LM head. Between stages travels a ``StageIO``: with Attention Residuals the
open block's running sum and the bank of completed blocks ``[T, n_blocks, D]``; otherwise the
last sublayer output and the residual stream (vLLM's fused-add form). Caches (paged latent KV
for MLA layers, conv/recurrent state slots for KDA layers) are owned by the caller and passed
in; each stage holds only its own layers' caches.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from torch import nn

from rocm_mla.models.kimi_k3.attn_res import attn_res_mix, closes_block
from rocm_mla.models.kimi_k3.config import KimiK3Config
from rocm_mla.models.kimi_k3.kda import KimiDeltaAttention
from rocm_mla.models.kimi_k3.metadata import ForwardMetadata
from rocm_mla.models.kimi_k3.mla import MultiHeadLatentAttention
from rocm_mla.models.kimi_k3.moe import DenseMLP, MoE
from rocm_mla.models.kimi_k3.ops import (
    AllReduce,
    ParallelLMHead,
    RMSNorm,
    VocabParallelEmbedding,
    as_all_gather,
    as_all_reduce,
)


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Layers ``[start, end)`` of pipeline stage ``pp_rank`` (contract 3 of docs/architecture.md).

    ``num_layers // pp_size`` each; the remainder adds one layer each to the second-to-last,
    third-to-last, ... stage (never the last, which also carries the LM head). 93 layers over
    4 stages -> 23, 23, 24, 23.
    """
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank: expected 0 <= pp_rank < pp_size={pp_size}, got {pp_rank}")
    if pp_size > num_layers:
        raise ValueError(f"pp_size: {pp_size} stages for {num_layers} layers leaves a stage empty")
    sizes = [num_layers // pp_size] * pp_size
    for i in range(num_layers % pp_size):
        sizes[-2 - i] += 1
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


@dataclass
class StageIO:
    """What one pipeline stage hands the next.

    ``hidden [T, D]``: with AttnRes the open block's running sum ``p``; else the last sublayer
    output. ``residual``: with AttnRes the completed-block bank ``[T, n_blocks, D]`` (block 0 =
    the embedding); else the residual stream ``[T, D]``, or None before the first layer.
    """

    hidden: torch.Tensor
    residual: torch.Tensor | None


@dataclass
class StageCaches:
    """This stage's caches, keyed by global layer index.

    ``kv[L]``: ``[num_blocks, block_size, kv_lora_rank + rope]`` latent rows of MLA layer L.
    ``conv[L]``: ``[num_slots, 3P, K-1]`` and ``recurrent[L]``: ``[num_slots, H, dk, dv]`` fp32
    per-sequence state of KDA layer L (rows indexed by ``ForwardMetadata.state_slots``).
    """

    kv: dict[int, torch.Tensor] = field(default_factory=dict)
    conv: dict[int, torch.Tensor] = field(default_factory=dict)
    recurrent: dict[int, torch.Tensor] = field(default_factory=dict)


class DecoderLayer(nn.Module):
    """One layer: MLA or KDA attention, dense MLP or MoE, and K3's AttnRes mixing points."""

    def __init__(
        self,
        config: KimiK3Config,
        layer: int,
        tp_size: int,
        all_reduce: AllReduce | None,
        backend: str | None,
        dcp_group: torch.distributed.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.layer = layer
        self.is_mla = config.is_mla(layer)
        if self.is_mla:
            self.self_attn = MultiHeadLatentAttention(
                config, tp_size, all_reduce, backend, dcp_group
            )
        else:
            self.self_attn = KimiDeltaAttention(config, tp_size, all_reduce)
        if config.is_moe(layer):
            self.block_sparse_moe = MoE(config, tp_size, all_reduce)
        else:
            self.mlp = DenseMLP(config, tp_size, all_reduce)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.block_size = config.attn_res_block_size
        if self.block_size is not None:
            self.self_attention_res_norm = RMSNorm(d, eps)
            self.self_attention_res_proj = nn.Linear(d, 1, bias=False)
            self.mlp_res_norm = RMSNorm(d, eps)
            self.mlp_res_proj = nn.Linear(d, 1, bias=False)
        self.eps = eps

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        block = self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp
        return block(self.post_attention_layernorm(x))

    def attention(
        self, x: torch.Tensor, meta: ForwardMetadata, caches: StageCaches
    ) -> torch.Tensor:
        """``x [T, D]`` normalized -> ``[T, D]``, reading and updating this layer's caches."""
        if self.is_mla:
            return self.self_attn(x, meta, caches.kv[self.layer])
        conv_cache, rec_cache = caches.conv[self.layer], caches.recurrent[self.layer]
        slots = meta.state_slots
        conv, rec = conv_cache[slots], rec_cache[slots]
        # A request with no context starts from zero state, whatever its slot held before.
        fresh = meta.fresh
        conv = conv.masked_fill(fresh[:, None, None], 0)
        rec = rec.masked_fill(fresh[:, None, None, None], 0)
        num_new = meta.num_new
        if len(set(num_new)) == 1:
            out, conv, rec = self.self_attn(x.view(len(num_new), num_new[0], -1), conv, rec)
            out = out.flatten(0, 1)
        else:
            starts = meta.query_starts
            parts, convs, recs = [], [], []
            for b, (s, e) in enumerate(itertools.pairwise(starts)):
                o, c, r = self.self_attn(x[s:e][None], conv[b : b + 1], rec[b : b + 1])
                parts.append(o[0])
                convs.append(c)
                recs.append(r)
            out, conv, rec = torch.cat(parts), torch.cat(convs), torch.cat(recs)
        conv_cache[slots] = conv.to(conv_cache.dtype)
        rec_cache[slots] = rec.to(rec_cache.dtype)
        return out

    def forward(self, io: StageIO, meta: ForwardMetadata, caches: StageCaches) -> StageIO:
        """One layer on ``StageIO``.

        Without AttnRes (vLLM's fused-add form): ``residual += hidden``; ``residual +=
        attn(norm(residual))``; ``hidden = ffn(norm(residual))``. With AttnRes (layer L,
        block size B): the attention input mixes ``bank + [p]``; at ``L % B == 0`` p is
        appended to the bank and the new block starts from the attention output; the FFN
        input mixes ``bank + [p]`` again and its output is added to p.
        """
        if self.block_size is None:
            residual = io.hidden if io.residual is None else io.hidden + io.residual
            residual = residual + self.attention(self.input_layernorm(residual), meta, caches)
            return StageIO(self.ffn(residual), residual)
        p, bank = io.hidden, io.residual
        x = p if bank.shape[1] == 0 else self.mix(bank, p, "self_attention_res")
        closing = closes_block(self.layer, self.block_size)
        if closing:
            bank = torch.cat([bank, p[:, None, :]], dim=1)
        a = self.attention(self.input_layernorm(x), meta, caches)
        p = a if closing else p + a
        p = p + self.ffn(self.mix(bank, p, "mlp_res"))
        return StageIO(p, bank)

    def mix(self, bank: torch.Tensor, p: torch.Tensor, name: str) -> torch.Tensor:
        norm, proj = getattr(self, f"{name}_norm"), getattr(self, f"{name}_proj")
        return attn_res_mix(bank, p, norm.weight, proj.weight, self.eps)


class KimiLinearModel(nn.Module):
    """Embeddings (first stage), this stage's layers, final norm and AttnRes output mix (last)."""

    def __init__(
        self,
        config: KimiK3Config,
        layer_range: tuple[int, int],
        first: bool,
        last: bool,
        tp_size: int,
        all_reduce: AllReduce | None,
        backend: str | None,
        dcp_group: torch.distributed.ProcessGroup | None = None,
        tp_rank: int = 0,
    ) -> None:
        super().__init__()
        d = config.hidden_size
        if first:
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size, d, tp_rank, tp_size, all_reduce
            )
        self.layers = nn.ModuleDict(
            {
                str(i): DecoderLayer(config, i, tp_size, all_reduce, backend, dcp_group)
                for i in range(*layer_range)
            }
        )
        if last:
            self.norm = RMSNorm(d, config.rms_norm_eps)
            if config.attn_res_block_size is not None:
                self.output_attn_res_norm = RMSNorm(d, config.rms_norm_eps)
                self.output_attn_res_proj = nn.Linear(d, 1, bias=False)


class KimiK3ForCausalLM(nn.Module):
    """The text LM (serves Kimi-K3 and Kimi-Linear configs) for one PP stage / TP rank.

    Args:
        config: the text config.
        pp_rank, pp_size: this pipeline stage.
        tp_rank, tp_size: this tensor-parallel rank (heads, intermediate dims and the
            vocabulary of the embedding and LM head sharded).
        all_reduce: a callable summing a tensor over the TP group, or the TP
            ``torch.distributed`` process group itself; required when ``tp_size > 1``. The LM
            head's logit all-gather uses the group directly, or is built on the callable.

    With ``tie_word_embeddings`` the LM head shares the embedding's weight (on a single
    stage the same parameter; across PP stages the last stage loads its copy from the
    embedding tensor). Logits are multiplied by ``config.logit_scale``.
        backend: MLA decode backend name for ``rocm_mla.mla_decode`` (None = auto).
        dcp_group: the decode-context-parallel group (a subgroup of the TP group) whose ranks
            each cache a token shard; None (or a group of one) for no DCP.
    """

    def __init__(
        self,
        config: KimiK3Config,
        *,
        pp_rank: int = 0,
        pp_size: int = 1,
        tp_rank: int = 0,
        tp_size: int = 1,
        all_reduce: AllReduce | torch.distributed.ProcessGroup | None = None,
        backend: str | None = None,
        dcp_group: torch.distributed.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        all_gather = as_all_gather(all_reduce, tp_rank, tp_size) if tp_size > 1 else None
        all_reduce = as_all_reduce(all_reduce)
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank: expected 0 <= tp_rank < tp_size={tp_size}, got {tp_rank}")
        if tp_size > 1 and all_reduce is None:
            raise ValueError("all_reduce: tp_size > 1 needs a callable that sums over the TP group")
        config.check_tp(tp_size)
        self.config = config
        self.pp_rank, self.pp_size, self.tp_rank, self.tp_size = pp_rank, pp_size, tp_rank, tp_size
        self.layer_range = pp_layer_range(config.num_hidden_layers, pp_rank, pp_size)
        self.is_first, self.is_last = pp_rank == 0, pp_rank == pp_size - 1
        self.model = KimiLinearModel(
            config,
            self.layer_range,
            self.is_first,
            self.is_last,
            tp_size,
            all_reduce,
            backend,
            dcp_group,
            tp_rank,
        )
        if self.is_last:
            self.lm_head = ParallelLMHead(
                config.vocab_size, config.hidden_size, tp_rank, tp_size, all_gather,
                config.logit_scale,
            )  # fmt: skip
        self.tie_weights()

    def tie_weights(self) -> None:
        """With ``tie_word_embeddings`` on a stage that has both, make the LM head's weight the
        embedding's parameter (again: ``Module.to_empty`` replaces parameters one by one)."""
        if self.config.tie_word_embeddings and self.is_first and self.is_last:
            self.lm_head.weight = self.model.embed_tokens.weight

    def absorb_weights(self) -> None:
        """Precompute every MLA layer's decode weights; call after loading weights."""
        for layer in self.model.layers.values():
            if layer.is_mla:
                layer.self_attn.absorb_weights()

    def make_caches(
        self,
        num_blocks: int,
        block_size: int,
        num_state_slots: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> StageCaches:
        """Zeroed caches for this stage's layers (KDA recurrent state always fp32).

        ``dtype`` (default: the parameters') is the conv state's and, unless ``kv_dtype``
        says otherwise (e.g. an fp8 latent cache), the latent KV cache's.
        """
        ref = next(self.parameters())
        dtype = dtype or ref.dtype
        kv_dtype = kv_dtype or dtype
        device = device or ref.device
        caches = StageCaches()
        for i, layer in self.model.layers.items():
            if layer.is_mla:
                width = self.config.kv_cache_dim
                caches.kv[int(i)] = torch.zeros(
                    num_blocks, block_size, width, dtype=kv_dtype, device=device
                )
            else:
                conv_shape, rec_shape = layer.self_attn.state_shapes()
                caches.conv[int(i)] = torch.zeros(
                    num_state_slots, *conv_shape, dtype=dtype, device=device
                )
                caches.recurrent[int(i)] = torch.zeros(
                    num_state_slots, *rec_shape, dtype=torch.float32, device=device
                )
        return caches

    def forward(
        self,
        meta: ForwardMetadata,
        caches: StageCaches,
        input_ids: torch.Tensor | None = None,
        intermediate: StageIO | None = None,
        logits_rows: torch.Tensor | None = None,
    ) -> torch.Tensor | StageIO:
        """Run this stage on ``T`` packed tokens.

        Args:
            meta: the step's layout (positions, cache slots, block tables, state slots).
            caches: this stage's caches (``make_caches``).
            input_ids: ``[T]`` int64 token ids (first stage only).
            intermediate: the previous stage's ``StageIO`` (every other stage).
            logits_rows: ``[R]`` indices of the tokens whose logits are wanted (last stage;
                None: all). Generation needs only each request's last token, and the LM head
                over every prompt token would be the most expensive GEMM of a prefill.

        Returns:
            logits ``[T, vocab]`` (or ``[R, vocab]``) on the last stage, else the
            ``StageIO`` for the next stage.
        """
        if self.is_first:
            if input_ids is None or intermediate is not None:
                raise ValueError("input_ids: the first stage takes input_ids and no intermediate")
            h = self.model.embed_tokens(input_ids)
            if self.config.attn_res_block_size is None:
                io = StageIO(h, None)
            else:
                io = StageIO(h, h.new_zeros(h.shape[0], 0, h.shape[1]))
        else:
            if intermediate is None or input_ids is not None:
                raise ValueError(
                    f"intermediate: stage {self.pp_rank} takes the previous stage's StageIO "
                    "and no input_ids"
                )
            io = intermediate
        for layer in self.model.layers.values():
            io = layer(io, meta, caches)
        if not self.is_last:
            return io
        if self.config.attn_res_block_size is None:
            h = io.hidden if io.residual is None else io.hidden + io.residual
        else:
            m = self.model
            h = attn_res_mix(
                io.residual, io.hidden, m.output_attn_res_norm.weight,
                m.output_attn_res_proj.weight, self.config.rms_norm_eps,
            )  # fmt: skip
        if logits_rows is not None:
            h = h[logits_rows]
        return self.lm_head(self.model.norm(h))
