"""Decode context parallelism (DCP): the KV cache of every request is sharded by token.

With DCP size ``N`` and interleave ``I``, token position ``p`` lives on rank ``(p // I) % N``
(``I`` consecutive tokens per rank, round robin). Each rank stores its tokens as a dense prefix
of its own paged cache, so its shard is an ordinary paged cache of ``local(L)`` tokens.

Two sides, one contract (DESIGN.md contract 2):

* **Runner side** (``local_seq_lens``, ``owner_rank``, ``slot_mapping``,
  ``verify_local_seq_lens``, ``DecodeMetadata.build``): the model runner is the single producer
  of the rank-local lengths and of the token -> local-slot mapping. The local-length formula is
  written once, in ``local_seq_lens``.
* **Layer side** (``dcp_mla_decode``): gathers the query heads of the DCP group, decodes every
  gathered head over this rank's shard with the runner's local lengths, and combines the
  partials by their LSEs. When the group has more than one rank and the runner's lengths are
  missing it raises; it never derives them (upstream removed exactly such a fallback because
  it hid runner regressions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rocm_mla.api import mla_decode, plan_decode
from rocm_mla.backends.base import MLADecodeImpl
from rocm_mla.backends.torch_ref import lse_merge_weights
from rocm_mla.inputs import DecodePlan

__all__ = [
    "RUNNER_CONTRACT",
    "DecodeMetadata",
    "combine_partials",
    "dcp_mla_decode",
    "gather_query_heads",
    "local_seq_lens",
    "owner_rank",
    "plan_step_decode",
    "slot_mapping",
    "verify_local_seq_lens",
]

#: Quoted by every error raised when the layer does not get what the runner owes it.
RUNNER_CONTRACT = (
    "the model runner is the single producer of dcp_local_seq_lens (fill DecodeMetadata with "
    "rocm_mla.dcp.verify_local_seq_lens or DecodeMetadata.build when building decode metadata); "
    "the attention layer never derives it, because a layer-side fallback would hide a runner "
    "regression"
)

# torch 2.13 renamed the tensor collectives; ROCm images may ship an older torch with only
# the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _check_layout(world_size: int, rank: int | None, interleave: int) -> None:
    for name, value, low in (("world_size", world_size, 1), ("interleave", interleave, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"DCP {name} must be an int >= {low}, got {value!r}")
    if rank is not None and (
        isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size
    ):
        raise ValueError(f"DCP rank must be None or an int in [0, {world_size}), got {rank!r}")


def _check_int_tensor(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype == torch.bool:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be an integer tensor, got {got}")


# ---- runner side --------------------------------------------------------------------------


def local_seq_lens(
    seq_lens: torch.Tensor, world_size: int, rank: int | None, interleave: int = 1
) -> torch.Tensor:
    """Tokens of each length-``L`` sequence that DCP rank ``rank`` holds.

    ``local(L) = (L // I // N) * I + clamp(L - (L // I // N) * I * N - r * I, 0, I)``: full
    rounds of ``I`` tokens per rank, plus this rank's part of the last, partial round. Summed
    over ranks it equals ``L``; a rank with ``L <= r * I`` is empty.

    Args:
        seq_lens: integer tensor of any shape ``[...]``, global lengths (>= 0).
        world_size: DCP size ``N`` (>= 1).
        rank: DCP rank ``r`` in ``[0, N)``, or None for every rank.
        interleave: ``I`` (>= 1), consecutive tokens per rank per round.

    Returns:
        ``[...]`` (``[..., N]`` when ``rank`` is None), in ``seq_lens``' dtype and device.
    """
    _check_layout(world_size, rank, interleave)
    _check_int_tensor("seq_lens", seq_lens)
    lens = seq_lens.to(torch.int64)
    if rank is None:
        lens = lens[..., None]
        ranks = torch.arange(world_size, device=lens.device)
    else:
        ranks = torch.tensor(rank, device=lens.device)
    full = (lens // interleave // world_size) * interleave
    tail = (lens - full * world_size - ranks * interleave).clamp(0, interleave)
    return (full + tail).to(seq_lens.dtype)


def verify_local_seq_lens(
    seq_lens: torch.Tensor,
    q_len: int,
    world_size: int,
    rank: int | None,
    interleave: int = 1,
) -> torch.Tensor:
    """Rank-local lengths of every query row of a causal window of ``q_len`` new tokens.

    Row ``i`` of the window sees global positions ``[0, L - q_len + i]``, i.e. a global length
    of ``L - (q_len - 1) + i`` (clamped at 0), so its local length is ``local()`` of that. It
    is not ``local(L)`` minus an offset: the tokens a row may not see lie on whichever ranks
    own them.

    Args:
        seq_lens: ``[B]`` integer global lengths, the window's ``q_len`` tokens included.
        q_len: window length ``S_q`` (>= 1; 1 is plain decode).
        world_size, rank, interleave: as ``local_seq_lens``.

    Returns:
        ``[B, q_len]`` (``[B, q_len, N]`` when ``rank`` is None) in ``seq_lens``' dtype: what
        ``DecodeMetadata.dcp_local_seq_lens`` holds.
    """
    if isinstance(q_len, bool) or not isinstance(q_len, int) or q_len < 1:
        raise ValueError(f"q_len must be an int >= 1, got {q_len!r}")
    _check_int_tensor("seq_lens", seq_lens)
    if seq_lens.dim() != 1:
        raise ValueError(f"seq_lens must be 1-D [B], got shape {tuple(seq_lens.shape)}")
    offsets = torch.arange(q_len, device=seq_lens.device) - (q_len - 1)
    row_lens = (seq_lens.to(torch.int64)[:, None] + offsets[None, :]).clamp(min=0)
    return local_seq_lens(row_lens.to(seq_lens.dtype), world_size, rank, interleave)


def owner_rank(positions: torch.Tensor, world_size: int, interleave: int = 1) -> torch.Tensor:
    """DCP rank that stores each token position: ``(p // I) % N``, same shape and dtype."""
    _check_layout(world_size, None, interleave)
    _check_int_tensor("positions", positions)
    return (positions // interleave) % world_size


def slot_mapping(
    positions: torch.Tensor,
    req_indices: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    world_size: int,
    rank: int,
    interleave: int = 1,
) -> torch.Tensor:
    """Where each new token goes in this rank's paged cache: a flat slot, or -1 if not owned.

    Block-table column ``j`` is a *virtual* block of ``block_size * N`` global positions; each
    rank keeps its ``block_size`` of them in its own physical block ``block_table[req, j]``.
    A token owned by this rank at global position ``p`` therefore lands at local position
    ``(p // (I * N)) * I + p % I``, which enumerates the rank's tokens densely: its shard is an
    ordinary paged cache of ``local_seq_lens(L)`` tokens read through the same block table.

    Args:
        positions: ``[T]`` integer global positions of the tokens to write.
        req_indices: ``[T]`` integer row of ``block_table`` each token belongs to.
        block_table: ``[num_reqs, max_blocks]`` integer physical block ids in this rank's cache.
        block_size: tokens per physical block; must be a multiple of ``interleave``, so that
            an interleave run never straddles two blocks.
        world_size, rank, interleave: this rank's DCP layout.

    Returns:
        ``[T]`` int64 flat slots ``block_id * block_size + offset`` into the cache viewed as
        ``[num_blocks * block_size, D]``; -1 for tokens another rank owns (the cache writer
        skips them).
    """
    _check_layout(world_size, rank, interleave)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if block_size % interleave:
        raise ValueError(
            f"block_size {block_size} must be a multiple of the DCP interleave {interleave}: "
            "an interleave run of tokens must not straddle two cache blocks"
        )
    for name, t in (("positions", positions), ("req_indices", req_indices)):
        _check_int_tensor(name, t)
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D [T], got shape {tuple(t.shape)}")
    _check_int_tensor("block_table", block_table)
    if positions.shape != req_indices.shape:
        raise ValueError(
            f"positions and req_indices must have the same shape [T], got "
            f"{tuple(positions.shape)} and {tuple(req_indices.shape)}"
        )
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be 2-D, got shape {tuple(block_table.shape)}")
    pos = positions.to(torch.int64)
    req = req_indices.to(torch.int64)
    virtual_block = block_size * world_size
    column = pos // virtual_block
    if positions.numel() and (int(pos.min()) < 0 or int(column.max()) >= block_table.shape[1]):
        raise ValueError(
            f"positions must lie in [0, {block_table.shape[1] * virtual_block}) "
            f"(block_table's {block_table.shape[1]} virtual blocks of {block_size} x "
            f"{world_size} tokens), got [{int(pos.min())}, {int(pos.max())}]"
        )
    offset = pos % virtual_block
    local_offset = (offset // (interleave * world_size)) * interleave + offset % interleave
    block_ids = block_table.to(torch.int64)[req, column]
    slots = block_ids * block_size + local_offset
    owned = owner_rank(pos, world_size, interleave) == rank
    return torch.where(owned, slots, -1)


@dataclass(frozen=True)
class DecodeMetadata:
    """What the model runner hands the attention layer for one decode step on one rank.

    Attributes:
        block_table: ``[B, max_blocks]`` int32 block ids into this rank's cache (virtual
            blocks, see ``slot_mapping``).
        seq_lens: ``[B]`` int32 global lengths, the ``S_q`` new tokens included.
        dcp_local_seq_lens: ``[B, S_q]`` int32 rank-local length of every query row
            (``verify_local_seq_lens``); None only when DCP is off (world size 1).
        dcp_world_size, dcp_rank, dcp_interleave: the layout the runner sharded with.
    """

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    dcp_local_seq_lens: torch.Tensor | None = None
    dcp_world_size: int = 1
    dcp_rank: int = 0
    dcp_interleave: int = 1

    @classmethod
    def build(
        cls,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        q_len: int,
        dcp_world_size: int = 1,
        dcp_rank: int = 0,
        dcp_interleave: int = 1,
    ) -> DecodeMetadata:
        """The runner's constructor: fills ``dcp_local_seq_lens`` when DCP is on."""
        local = (
            verify_local_seq_lens(seq_lens, q_len, dcp_world_size, dcp_rank, dcp_interleave)
            if dcp_world_size > 1
            else None
        )
        return cls(block_table, seq_lens, local, dcp_world_size, dcp_rank, dcp_interleave)


def plan_step_decode(
    seq_lens: torch.Tensor,
    q_len: int,
    *,
    num_heads: int,
    head_dim_v: int,
    rope_dim: int,
    kv_dtype: torch.dtype,
    q_dtype: torch.dtype,
    device: torch.device | str,
    backend: str | None = None,
    dcp_world_size: int = 1,
    dcp_rank: int = 0,
    dcp_interleave: int = 1,
) -> DecodePlan:
    """The runner's one ``plan_decode`` per decode step, for the kernel call each MLA layer
    makes (directly, or inside ``dcp_mla_decode``).

    ``seq_lens`` ``[B]`` are the global lengths on the host (the runner's own numbers), so
    planning reads nothing from the device. Without DCP the plan is for ``B`` requests of
    ``q_len`` causal queries. With DCP it is for the call ``dcp_mla_decode`` makes: the window
    folded into ``B * q_len`` single-query, non-causal requests whose lengths are this rank's
    local lengths (``verify_local_seq_lens``), over ``num_heads`` gathered heads.
    """
    if seq_lens.device.type != "cpu":
        raise ValueError(
            f"plan_step_decode: seq_lens must be the runner's host copy (on the CPU), got a "
            f"tensor on {seq_lens.device}"
        )
    common = {
        "num_heads": num_heads,
        "head_dim_v": head_dim_v,
        "rope_dim": rope_dim,
        "kv_dtype": kv_dtype,
        "q_dtype": q_dtype,
        "device": device,
        "backend": backend,
    }
    if dcp_world_size == 1:
        return plan_decode(seq_lens, q_len=q_len, causal=True, **common)
    local = verify_local_seq_lens(seq_lens, q_len, dcp_world_size, dcp_rank, dcp_interleave)
    return plan_decode(local.reshape(-1), q_len=1, causal=False, **common)


# ---- layer side ---------------------------------------------------------------------------


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
    metadata: DecodeMetadata, batch: int, q_len: int, world: int, rank: int
) -> torch.Tensor | None:
    """The local lengths to decode with, ``[B, S_q]``; None when DCP is off."""
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
    metadata: DecodeMetadata,
    group: dist.ProcessGroup | None,
    backend: str | MLADecodeImpl | None = None,
    return_lse: bool = False,
    *,
    replicated_heads: bool = False,
    head_dim_v: int | None = None,
    softmax_scale: float | None = None,
    kv_scale: float | torch.Tensor | None = None,
    plan: DecodePlan | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """MLA decode over a token-sharded KV cache; every rank gets the exact attention.

    Steps: all-gather the query on the head dim (TP ranks hold different heads), decode all
    gathered heads over this rank's shard with the runner's per-row local lengths, then
    ``combine_partials`` (all-gather LSE, rescale, reduce-scatter back to this rank's heads).
    With ``replicated_heads`` every rank already holds all heads: no gather, and the combine
    all-reduces.

    Query rows of a verify window (``S_q > 1``) have different local lengths, which a causal
    kernel call cannot express (its rows' lengths differ by exactly 1 per row). So the window
    is folded into the batch: row ``i`` of request ``b`` becomes request ``b * S_q + i`` with
    ``S_q = 1``, ``causal=False`` and its own local length, and the block table row is repeated
    for it. One kernel call, exact for any lengths; the kernel then reads the shard once per
    row, which is what ``S_q`` (<= 4 in practice) costs.

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
            gathered heads, the window folded into the batch (``B * S_q`` requests of one
            query, ``causal=False``) and the rank-local lengths (``DecodeMetadata.plan_kernel``
            builds it). None: the call plans itself.

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

    q = q_local if replicated_heads else gather_query_heads(q_local, group)
    block_table = metadata.block_table
    if local is None:
        lens, causal = metadata.seq_lens, True
    else:
        q = q.reshape(batch * q_len, 1, *q.shape[2:])
        if q_len > 1:
            block_table = block_table.repeat_interleave(q_len, dim=0)
        lens, causal = local.reshape(-1).to(torch.int32), False

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
            q, kv_cache, block_table, lens, causal=causal, kv_scale=kv_scale, plan=plan
        )
    else:
        out, lse = mla_decode(
            q,
            kv_cache,
            block_table,
            lens,
            head_dim_v=512 if head_dim_v is None else head_dim_v,
            softmax_scale=softmax_scale,
            causal=causal,
            kv_scale=kv_scale,
            backend=backend,
            plan=plan,
        )
    out = out.reshape(batch, q_len, *out.shape[2:])
    lse = lse.reshape(batch, q_len, lse.shape[2])
    out, lse = combine_partials(out, lse, group, scatter_heads=not replicated_heads)
    return (out, lse) if return_lse else out
