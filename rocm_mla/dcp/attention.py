"""DCP, layer side: ``dcp_mla_decode`` over this rank's token shard of the cache.

Gathers the query heads of the DCP group, decodes every gathered head over this rank's shard
with the runner's local lengths (``rocm_mla.dcp.layout``), and combines the partials by their
LSEs. When the group has more than one rank and the runner's lengths are missing it raises;
it never derives them (upstream removed exactly such a fallback because it hid runner
regressions).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rocm_mla.api import mla_decode
from rocm_mla.backends.base import MLADecodeImpl
from rocm_mla.dcp.layout import RUNNER_CONTRACT, DecodeMetadata
from rocm_mla.inputs import DecodePlan
from rocm_mla.merge import lse_merge_weights

# torch 2.13 renamed the tensor collectives; ROCm images may ship an older torch with only
# the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _group_size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(size, rank) of ``group``; None means no DCP group, i.e. a single rank."""
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def gather_query_heads(q_local: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather ``[B, S_q, H_loc, D]`` on the head dim -> ``[B, S_q, N * H_loc, D]``.

    Rank-major: heads ``[r * H_loc, (r + 1) * H_loc)`` are rank ``r``'s, the order in which
    ``combine_partials`` scatters them back.
    """
    world, _ = _group_size_rank(group)
    if world == 1:
        return q_local
    batch, q_len, heads, dim = q_local.shape
    # The collectives concatenate ranks along dim 0 of a flat buffer (gloo checks the shape).
    gathered = q_local.new_empty(world * batch, q_len, heads, dim)
    _all_gather_single(gathered, q_local.contiguous(), group=group)
    gathered = gathered.view(world, batch, q_len, heads, dim)
    return gathered.permute(1, 2, 0, 3, 4).reshape(batch, q_len, world * heads, dim)


def combine_partials(
    out: torch.Tensor,
    lse: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    scatter_heads: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine this rank's partial attention with the other DCP ranks' into the exact result.

    Every rank attended over its own token shard. All-gather the LSEs, rescale this rank's
    partial by ``exp(lse_r - logsumexp_n lse_n)`` (an empty shard's weight is exactly 0 and
    its output is never read, so no NaN can enter), then sum the partials across the group:
    a reduce-scatter on the head dim when the heads were gathered from head-sharded ranks
    (``scatter_heads=True``), an all-reduce when every rank holds all heads.

    Args:
        out: ``[B, S_q, Hq, Dv]`` this rank's partial (``Hq = N * H_loc`` when scattering).
        lse: ``[B, S_q, Hq]`` float32 natural-log denominators of ``out`` (-inf if empty).
        group: the DCP process group (None: a single rank, nothing to combine).
        scatter_heads: reduce-scatter back to this rank's ``H_loc`` heads (rank-major).

    Returns:
        ``(out, lse)``: ``[B, S_q, H, Dv]`` in ``out``'s dtype and ``[B, S_q, H]`` float32,
        ``H = H_loc`` when scattering, else ``Hq``. Rows empty on every rank: out 0, lse -inf.
    """
    world, rank = _group_size_rank(group)
    if world == 1:
        return out, lse
    heads = out.shape[2]
    if scatter_heads and heads % world:
        raise ValueError(
            f"combine_partials: {heads} gathered heads do not split evenly over {world} ranks"
        )
    lses = torch.empty(world * lse.shape[0], *lse.shape[1:], device=lse.device)
    _all_gather_single(lses, lse.to(torch.float32).contiguous(), group=group)
    weights, total_lse = lse_merge_weights(lses.view(world, *lse.shape))
    weight = weights[rank][..., None]
    # Reduced in fp32: the sum of N rescaled partials keeps the precision of the exact merge.
    scaled = torch.where(weight != 0, out.to(torch.float32) * weight, 0.0)
    if not scatter_heads:
        dist.all_reduce(scaled, group=group)
        return scaled.to(out.dtype), total_lse
    batch, q_len, _, dv = out.shape
    local_heads = heads // world
    chunks = scaled.view(batch, q_len, world, local_heads, dv).permute(2, 0, 1, 3, 4)
    mine = scaled.new_empty(batch, q_len, local_heads, dv)
    _reduce_scatter_single(mine, chunks.reshape(world * batch, *mine.shape[1:]), group=group)
    head_slice = slice(rank * local_heads, (rank + 1) * local_heads)
    return mine.to(out.dtype), total_lse[:, :, head_slice].contiguous()


def _check_metadata(
    metadata: DecodeMetadata | None, batch: int, q_len: int, world: int, rank: int
) -> torch.Tensor | None:
    """The local lengths to decode with, ``[B, S_q]``; None when DCP is off.

    The one place that enforces the runner contract on the layer side: every caller (the
    model's MLA layer included) comes through ``dcp_mla_decode``.
    """
    if metadata is None:
        raise ValueError(
            f"dcp_mla_decode: no DecodeMetadata (ForwardMetadata.dcp is None) with a DCP group "
            f"of {world} ranks; {RUNNER_CONTRACT}"
        )
    if (metadata.dcp_world_size, metadata.dcp_rank) != (world, rank):
        raise ValueError(
            f"dcp_mla_decode: metadata was built for DCP rank {metadata.dcp_rank} of "
            f"{metadata.dcp_world_size} but the group is rank {rank} of {world}; the runner "
            "and the layer must use the same DCP group"
        )
    local = metadata.dcp_local_seq_lens
    if world == 1 and local is None:
        return None
    if local is None:
        raise ValueError(
            f"dcp_mla_decode: metadata.dcp_local_seq_lens is missing with a DCP group of "
            f"{world} ranks; {RUNNER_CONTRACT}"
        )
    if not isinstance(local, torch.Tensor) or tuple(local.shape) != (batch, q_len):
        got = tuple(local.shape) if isinstance(local, torch.Tensor) else type(local).__name__
        raise ValueError(
            f"dcp_mla_decode: metadata.dcp_local_seq_lens must be [B, S_q] = [{batch}, {q_len}] "
            f"(one local length per query row), got {got}; {RUNNER_CONTRACT}"
        )
    return local


def dcp_mla_decode(
    q_local: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: DecodeMetadata | None,
    group: dist.ProcessGroup | None,
    backend: str | MLADecodeImpl | None = None,
    return_lse: bool = False,
    *,
    replicated_heads: bool = False,
    head_dim_v: int | None = None,
    softmax_scale: float | None = None,
    kv_scale: float | torch.Tensor | None = None,
    plan: DecodePlan | None = None,
    fault_flag: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """MLA decode over a token-sharded KV cache; every rank gets the exact attention.

    Steps: all-gather the query on the head dim (TP ranks hold different heads), decode all
    gathered heads over this rank's shard with the runner's per-row local lengths, then
    ``combine_partials`` (all-gather LSE, rescale, reduce-scatter back to this rank's heads).
    With ``replicated_heads`` every rank already holds all heads: no gather, and the combine
    all-reduces.

    Query rows of a verify window (``S_q > 1``) have different local lengths: row ``i`` sees
    the rank's share of global positions up to ``L - S_q + i``, which grows by 0 or 1 per
    row, not by exactly 1 as a causal window's would. The kernel takes them as they are
    (``mla_decode(row_seqlens=)``): one call over the window, every row sharing each KV tile
    of the shard and masking by its own bound, so a window reads the shard as often as one
    query does.

    Args:
        q_local: ``[B, S_q, H_loc, D]`` this rank's query heads (all ``H`` heads when
            ``replicated_heads``).
        kv_cache: this rank's shard, ``[num_blocks, block_size, D]`` (or 4-D with a 1 head
            dim), filled through ``slot_mapping``.
        metadata: the runner's ``DecodeMetadata`` for this rank.
        group: the DCP process group (``ParallelState.dcp_group``); None for no DCP.
        backend: a backend name (as ``mla_decode``), or an impl instance built for the
            gathered head count. The kernel is CP-unaware whatever its ``dcp_world_size``
            says (an impl built with the -1 sentinel normalizes to (1, 0)): this layer owns
            the gather and the combine. With an impl, its ``head_dim_v`` and
            ``softmax_scale`` apply; the arguments here must agree or be left None.
        return_lse: also return the combined lse.
        replicated_heads: every rank holds all heads (combine by all-reduce).
        head_dim_v: V width; None means 512 for a backend name, the impl's for an impl.
        softmax_scale, kv_scale: as ``mla_decode``.
        plan: the runner's ``plan_decode`` for this step's kernel call as made here: the
            gathered heads, the rank-local lengths of the requests (their last rows'), and
            under DCP per-row bounds for windows (``row_bounds=True`` where ``S_q > 1``;
            ``dcp.plan_step_decode`` builds it). None: the call plans itself.
        fault_flag: as ``mla_decode``: this rank's kernel call ORs its ``FAULT_*`` bits
            into it (a NaN row then reaches every rank through the combine).

    Returns:
        ``out [B, S_q, H_loc, head_dim_v]`` in q's dtype (``H`` heads when
        ``replicated_heads``); with ``return_lse`` also ``lse [B, S_q, H_loc]`` float32.

    Raises:
        ValueError: the group has more than one rank and ``metadata.dcp_local_seq_lens`` is
            missing or not ``[B, S_q]`` (the runner contract), the metadata's DCP rank/size
            disagrees with the group, or a decode argument is malformed.
    """
    if not isinstance(q_local, torch.Tensor) or q_local.dim() != 4:
        got = tuple(q_local.shape) if isinstance(q_local, torch.Tensor) else type(q_local)
        raise ValueError(f"dcp_mla_decode: q_local must be [B, S_q, H_loc, D], got {got}")
    world, rank = _group_size_rank(group)
    batch, q_len = q_local.shape[:2]
    local = _check_metadata(metadata, batch, q_len, world, rank)
    if plan is not None and not plan.spec.lse and (world > 1 or return_lse):
        raise ValueError(
            "dcp_mla_decode: the plan was made without the LSE (return_lse=False), which "
            f"combining {world} ranks' partials{' and return_lse' if return_lse else ''} "
            "need; plan the step with return_lse=True (plan_step_decode does for dcp > 1)"
        )

    q = q_local if replicated_heads else gather_query_heads(q_local, group)
    block_table = metadata.block_table
    lens, rows = (metadata.seq_lens, None) if local is None else metadata.shard_lengths()

    if isinstance(backend, MLADecodeImpl):
        if head_dim_v not in (None, backend.head_dim_v) or softmax_scale not in (
            None,
            backend.softmax_scale,
        ):
            raise ValueError(
                f"dcp_mla_decode: head_dim_v={head_dim_v}, softmax_scale={softmax_scale} "
                f"disagree with the impl's ({backend.head_dim_v}, {backend.softmax_scale})"
            )
        out, lse = backend.forward(
            q,
            kv_cache,
            block_table,
            lens,
            kv_scale=kv_scale,
            plan=plan,
            fault_flag=fault_flag,
            row_seqlens=rows,
        )
    else:
        out, lse = mla_decode(
            q,
            kv_cache,
            block_table,
            lens,
            head_dim_v=512 if head_dim_v is None else head_dim_v,
            softmax_scale=softmax_scale,
            kv_scale=kv_scale,
            backend=backend,
            plan=plan,
            fault_flag=fault_flag,
            row_seqlens=rows,
        )
    out, lse = combine_partials(out, lse, group, scatter_heads=not replicated_heads)
    return (out, lse) if return_lse else out
