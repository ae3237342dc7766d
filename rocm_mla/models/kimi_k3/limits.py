"""Whether the memory a config implies can exist on this machine, checked before any of it
is allocated.

A config that would need terabytes fails here with the value and the limit named, instead
of deep inside an allocation. The weight count is exact (``stage_parameter_bytes`` is tested
against the bytes tiny models allocate), so nothing the model creates is left out of it.
"""

from __future__ import annotations

import os

import torch

from rocm_mla.models.kimi_k3.config import KimiK3Config
from rocm_mla.models.kimi_k3.model import pp_layer_range
from rocm_mla.models.kimi_k3.mxfp4 import GROUP_SIZE

_GIB = 1024**3
_FP32 = 4


def stage_parameter_bytes(
    config: KimiK3Config,
    *,
    pp_rank: int = 0,
    pp_size: int = 1,
    tp_size: int = 1,
    itemsize: int | None = None,
) -> int:
    """Bytes that one TP rank of pipeline stage ``pp_rank`` allocates for its weights: every
    parameter ``KimiK3ForCausalLM`` creates, plus the absorbed MLA decode weights.

    ``itemsize`` is the model dtype's; the router and KDA decay parameters are fp32 and MXFP4
    experts uint8 whatever it is. None (the checkpoint's dtype, unknown before reading it)
    counts one byte for each model-dtype value, a lower bound.
    """
    w = itemsize or 1
    d, tp = config.hidden_size, tp_size
    start, end = pp_layer_range(config.num_hidden_layers, pp_rank, pp_size)
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    rows = -(-config.vocab_size // tp)  # vocab-parallel: ceil(V / tp) rows per rank
    total = rows * d * w if first else 0
    if last:
        tied = config.tie_word_embeddings and first  # one shared tensor on a single stage
        total += (0 if tied else rows * d * w) + d * w
        if config.attn_res_block_size is not None:
            total += 2 * d * w
    for layer in range(start, end):
        total += 2 * d * w  # input / post-attention norms
        if config.attn_res_block_size is not None:
            total += 4 * d * w
        attention = _mla_bytes if config.is_mla(layer) else _kda_bytes
        total += attention(config, tp, w)
        if config.is_moe(layer):
            total += _moe_bytes(config, tp, w)
        else:
            total += 3 * d * (config.intermediate_size // tp) * w
    return total


def _mla_bytes(config: KimiK3Config, tp: int, w: int) -> int:
    d, h = config.hidden_size, config.num_attention_heads // tp
    r, rope, dv = config.kv_lora_rank, config.qk_rope_head_dim, config.v_head_dim
    q_out = h * config.qk_head_dim
    ql = config.q_lora_rank
    q = d * q_out if ql is None else d * ql + ql + ql * q_out
    kv_b = r * h * (config.qk_nope_head_dim + dv)
    gate = d * h * dv if config.mla_use_output_gate else 0
    # kv_b_proj counts twice: absorb_weights() keeps W_UK^T and W_UV as separate copies.
    return (q + d * (r + rope) + r + 2 * kv_b + gate + h * dv * d) * w


def _kda_bytes(config: KimiK3Config, tp: int, w: int) -> int:
    d, dk, h = config.hidden_size, config.kda_head_dim, config.kda_num_heads // tp
    p = h * dk
    gate = d * p if config.kda_full_rank_gate else d * dk + dk * p
    weights = 3 * d * p + 3 * p * config.kda_conv_size + d * dk + dk * p + d * h + gate
    return (weights + dk + p * d) * w + (h + p) * _FP32  # A_log, dt_bias: fp32


def _moe_bytes(config: KimiK3Config, tp: int, w: int) -> int:
    d, e = config.hidden_size, config.num_experts
    expert_in = config.routed_expert_hidden_size or d
    local = config.moe_intermediate_size // tp
    total = (e * d + e) * _FP32  # router weight and correction bias
    if config.routed_expert_quant == "mxfp4":
        # Packed e2m1 codes (2 a byte) and one e8m0 scale a group, for w1, w3 [local, in]
        # and w2 [in, local].
        per = 2 * (local * (expert_in // 2 + expert_in // GROUP_SIZE))
        per += expert_in * (local // 2 + local // GROUP_SIZE)
        total += e * per
    else:
        total += e * 3 * expert_in * local * w
    if config.num_shared_experts:
        shared = config.moe_intermediate_size * config.num_shared_experts // tp
        total += 3 * d * shared * w
    latent = config.routed_expert_hidden_size
    if latent is not None:
        total += (2 * d * latent + (latent if config.latent_moe_use_norm else 0)) * w
    return total


def available_bytes(device: str | torch.device) -> int | None:
    """Free memory where ``device``'s tensors live (host RAM for CPU); None when unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return None
        return torch.cuda.mem_get_info(device.index or 0)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(
    config: KimiK3Config,
    *,
    device: str | torch.device,
    pp: int = 1,
    tp: int = 1,
    ranks_here: int = 1,
    param_itemsize: int | None = None,
    num_blocks: int = 0,
    block_size: int = 0,
    kv_itemsize: int = 1,
    max_num_seqs: int = 0,
) -> None:
    """Raise ``ValueError`` when the weights and caches of ``ranks_here`` ranks of a
    ``pp x tp`` layout cannot fit the free memory of ``device`` (host RAM for CPU ranks, all
    of which share it; one rank per GPU).

    Lower bounds throughout (the smallest stage when not every rank is here; ``param_itemsize``
    None counts 1 byte a model-dtype value), so a refusal is certain, never a guess. The
    message names what to change: the model, ``num_blocks`` or ``max_num_seqs``.
    """
    device = torch.device(device)
    available = available_bytes(device)
    if available is None:
        return
    world = pp * tp
    pool = min(ranks_here, world) if device.type == "cpu" else 1
    where = "host RAM" if device.type == "cpu" else f"{device} (free)"
    stages = [
        stage_parameter_bytes(config, pp_rank=s, pp_size=pp, tp_size=tp, itemsize=param_itemsize)
        for s in range(pp)
    ]
    params = tp * sum(stages) if pool == world else pool * min(stages)
    mla_layers = sum(config.is_mla(i) for i in range(config.num_hidden_layers))
    kda_layers = config.num_hidden_layers - mla_layers
    # The latent cache is replicated on every TP rank; KDA state is split by heads.
    kv = num_blocks * block_size * config.kv_cache_dim * kv_itemsize * mla_layers * pool // pp
    kda_width = config.kda_num_heads * config.kda_head_dim
    per_seq = kda_width * config.kda_head_dim * _FP32  # recurrent state, fp32
    per_seq += 3 * kda_width * (config.kda_conv_size - 1) * (param_itemsize or 1)  # conv
    state = max_num_seqs * per_seq * kda_layers * pool // world
    per = f"{pool} rank(s) of pp={pp} x tp={tp}"
    if params > available:
        raise ValueError(
            f"model: the config needs at least {params / _GIB:.1f} GiB for the weights of "
            f"{per}, but {where} has {available / _GIB:.1f} GiB; use more GPUs/ranks, a "
            "smaller dtype, or a smaller model"
        )
    if params + state > available:
        fit = (available - params) * max_num_seqs // state
        raise ValueError(
            f"max_num_seqs: {max_num_seqs} sequences need {state / _GIB:.1f} GiB of KDA state "
            f"on top of {params / _GIB:.1f} GiB of weights for {per}, but {where} has "
            f"{available / _GIB:.1f} GiB; at most about {fit} sequences fit"
        )
    if params + state + kv > available:
        fit = (available - params - state) * num_blocks // kv
        raise ValueError(
            f"num_blocks: {num_blocks} blocks of {block_size} tokens need "
            f"{kv / _GIB:.1f} GiB of KV cache on top of {(params + state) / _GIB:.1f} GiB of "
            f"weights and KDA state for {per}, but {where} has {available / _GIB:.1f} GiB; at "
            f"most about {fit} blocks fit"
        )
