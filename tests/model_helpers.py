"""Model-level test helpers: a contiguous cache layout and a single-process greedy loop.

The engine's runner is the only producer of step metadata in the package (contract 2 of
docs/architecture.md); these stand-ins exist for tests that drive the model directly.
"""

from __future__ import annotations

import torch

from rocm_mla.models.kimi_k3.metadata import ForwardMetadata
from rocm_mla.models.kimi_k3.model import KimiK3ForCausalLM


def contiguous_metadata(
    context_lens: list[int],
    num_new: list[int],
    block_size: int,
    max_blocks: int,
    device: torch.device | str = "cpu",
) -> ForwardMetadata:
    """Layout for tests and single-process use: request ``b`` owns cache blocks
    ``[b * max_blocks, (b + 1) * max_blocks)`` and KDA state slot ``b``."""
    positions, slots = [], []
    for b, (ctx, n) in enumerate(zip(context_lens, num_new, strict=True)):
        if ctx + n > max_blocks * block_size:
            raise ValueError(
                f"max_blocks: request {b} needs {ctx + n} tokens, more than "
                f"max_blocks * block_size = {max_blocks * block_size}"
            )
        for pos in range(ctx, ctx + n):
            positions.append(pos)
            slots.append((b * max_blocks + pos // block_size) * block_size + pos % block_size)
    starts = [0]
    for n in num_new:
        starts.append(starts[-1] + n)
    batch = len(num_new)
    table = torch.arange(batch * max_blocks, dtype=torch.int32).view(batch, max_blocks)
    return ForwardMetadata(
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(
            [c + n for c, n in zip(context_lens, num_new, strict=True)],
            dtype=torch.int32,
            device=device,
        ),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=table.to(device),
        state_slots=torch.arange(batch, dtype=torch.int64, device=device),
        num_new=list(num_new),
        context_lens=list(context_lens),
        write_rows=torch.arange(len(slots), dtype=torch.int64, device=device),
        fresh=torch.tensor([c == 0 for c in context_lens], device=device),
    )


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
    meta = contiguous_metadata([0] * len(prompts), lens, block_size, max_blocks, device)
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=device)
    prefill_logits = model(meta, caches, input_ids=ids)
    last_rows = torch.tensor(lens, device=device).cumsum(0) - 1
    next_ids = prefill_logits[last_rows].argmax(-1)
    out = [[int(t)] for t in next_ids]
    for step in range(1, max_new_tokens):
        ctx = [n + step - 1 for n in lens]
        meta = contiguous_metadata(ctx, [1] * len(prompts), block_size, max_blocks, device)
        next_ids = model(meta, caches, input_ids=next_ids).argmax(-1)
        for row, t in zip(out, next_ids.tolist(), strict=True):
            row.append(t)
    return out, prefill_logits
