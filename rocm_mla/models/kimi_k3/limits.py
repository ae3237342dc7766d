"""What a checkpoint may make us do, checked before we do it: which files it may open, and
whether the memory its config implies can exist on this machine.

A config that would need terabytes, or an index that points at ``/etc/passwd``, fails here
with the value and the limit named, instead of deep inside an allocation or a parse.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # config.py imports this module for checkpoint_file
    from rocm_mla.models.kimi_k3.config import KimiK3Config

_GIB = 1024**3


class UnsafeCheckpointPath(ValueError):
    """A checkpoint file name that points outside the model directory."""


def checkpoint_file(root: str | Path, name: str) -> Path:
    """``root / name``, refused unless it resolves inside ``root`` (symlinks followed).

    ``name`` must be a relative path without ``..``. A Hugging Face cache snapshot
    (``.../snapshots/<rev>/``) may also link into its repository's ``blobs/``: that is how
    the hub stores every file.
    """
    root = Path(root)
    if not isinstance(name, str) or not name or "\0" in name:
        raise UnsafeCheckpointPath(f"{root}: checkpoint file name {name!r} is not a file name")
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts:
        raise UnsafeCheckpointPath(
            f"{root}: checkpoint file {name!r} must be a relative path inside the model "
            "directory (no absolute paths, no '..'); refusing to open it"
        )
    base = root.resolve()
    allowed = [base]
    if base.parent.name == "snapshots":
        allowed.append(base.parent.parent / "blobs")
    target = (root / relative).resolve()
    if not any(target == a or target.is_relative_to(a) for a in allowed):
        raise UnsafeCheckpointPath(
            f"{root / relative}: resolves to {target}, outside the model directory {base}; "
            "refusing to open it (copy the file into the directory instead of linking it)"
        )
    return root / relative


def parameter_count_lower_bound(config: KimiK3Config) -> int:
    """Parameters the model has at least: embeddings, LM head, MLPs/experts and the main
    attention projections (norms and small projections left out)."""
    h, v = config.hidden_size, config.vocab_size
    count = v * h * (1 if config.tie_word_embeddings else 2)
    for layer in range(config.num_hidden_layers):
        if config.is_moe(layer):
            width = config.routed_expert_hidden_size or h
            count += config.num_experts * 3 * width * config.moe_intermediate_size
        else:
            count += 3 * h * config.intermediate_size
        if config.is_mla(layer):
            count += h * config.kv_cache_dim + config.num_attention_heads * config.v_head_dim * h
        else:
            count += 4 * h * config.kda_num_heads * config.kda_head_dim
    return count


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
    """Raise ``ValueError`` when the parameters and caches of ``ranks_here`` ranks (each a
    ``1 / (pp * tp)`` share of the model) cannot fit the free memory of ``device``.

    Lower bounds throughout (``param_itemsize`` None counts 1 byte a parameter), so a refusal
    is certain, never a guess.
    """
    device = torch.device(device)
    available = available_bytes(device)
    if available is None:
        return
    pool = ranks_here if device.type == "cpu" else 1
    where = "host RAM" if device.type == "cpu" else f"{device} (free)"
    params = parameter_count_lower_bound(config) * (param_itemsize or 1) * pool // (pp * tp)
    mla_layers = sum(config.is_mla(i) for i in range(config.num_hidden_layers))
    kda_layers = config.num_hidden_layers - mla_layers
    # The latent cache is replicated on every TP rank; KDA state is split by heads.
    kv = num_blocks * block_size * config.kv_cache_dim * kv_itemsize * mla_layers * pool // pp
    state = max_num_seqs * config.kda_num_heads * config.kda_head_dim**2 * 4 * kda_layers
    state = state * pool // (pp * tp)
    per = f"{pool} rank(s) of pp={pp} x tp={tp}"
    if params > available:
        raise ValueError(
            f"model: the config needs at least {params / _GIB:.1f} GiB for the parameters of "
            f"{per}, but {where} has {available / _GIB:.1f} GiB; use more GPUs/ranks, a "
            "smaller dtype, or a smaller model"
        )
    if params + kv + state > available:
        per_block = kv / max(1, num_blocks)
        fit = int((available - params - state) // per_block) if per_block else 0
        raise ValueError(
            f"num_blocks: {num_blocks} blocks of {block_size} tokens need "
            f"{kv / _GIB:.1f} GiB of KV cache on top of {params / _GIB:.1f} GiB of parameters "
            f"for {per}, but {where} has {available / _GIB:.1f} GiB; at most about "
            f"{max(fit, 0)} blocks fit"
        )
