"""Single-process prefill/decode over the paged caches, for tests and quick checks.

The engine owns real batching, scheduling and multi-process stages; this is the smallest loop
that exercises the same model entry points (one unsplit stage, contiguous cache blocks).
"""

from __future__ import annotations

import torch

from rocm_mla.models.kimi_k3.metadata import ForwardMetadata
from rocm_mla.models.kimi_k3.model import KimiK3ForCausalLM


@torch.no_grad()
def greedy_generate(
    model: KimiK3ForCausalLM,
    prompts: list[list[int]],
    max_new_tokens: int,
    block_size: int = 16,
) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy continuation of each prompt: one batched prefill, then batched decode steps.

    Returns:
        ``(new tokens per prompt, prefill logits [sum(len(prompts)), vocab])``.
    """
    if not (model.is_first and model.is_last):
        raise ValueError("model: greedy_generate needs an unsplit model (pp_size == 1)")
    device = next(model.parameters()).device
    total = max(len(p) for p in prompts) + max_new_tokens
    max_blocks = -(-total // block_size)
    caches = model.make_caches(len(prompts) * max_blocks, block_size, len(prompts))
    lens = [len(p) for p in prompts]
    meta = ForwardMetadata.contiguous([0] * len(prompts), lens, block_size, max_blocks, device)
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=device)
    prefill_logits = model(meta, caches, input_ids=ids)
    last_rows = torch.tensor(lens, device=device).cumsum(0) - 1
    next_ids = prefill_logits[last_rows].argmax(-1)
    out = [[int(t)] for t in next_ids]
    for step in range(1, max_new_tokens):
        ctx = [n + step - 1 for n in lens]
        meta = ForwardMetadata.contiguous(ctx, [1] * len(prompts), block_size, max_blocks, device)
        next_ids = model(meta, caches, input_ids=next_ids).argmax(-1)
        for row, t in zip(out, next_ids.tolist(), strict=True):
            row.append(t)
    return out, prefill_logits
