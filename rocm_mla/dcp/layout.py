"""DCP, runner side: where each token lives, the rank-local lengths and slots, the step plan.

With DCP size ``N`` and interleave ``I``, token position ``p`` lives on rank ``(p // I) % N``
(``I`` consecutive tokens per rank, round robin). Each rank stores its tokens as a dense prefix
of its own paged cache, so its shard is an ordinary paged cache of ``local(L)`` tokens. The
model runner is the single producer of the rank-local lengths and of the token -> local-slot
mapping (contract 2 of docs/architecture.md); the local-length formula is written once, in
``local_seq_lens``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rocm_mla.api import plan_decode
from rocm_mla.inputs import DecodePlan

#: Quoted by every error raised when the layer does not get what the runner owes it.
RUNNER_CONTRACT = (
    "the model runner is the single producer of dcp_local_seq_lens (fill DecodeMetadata with "
    "rocm_mla.dcp.verify_local_seq_lens or DecodeMetadata.build when building decode metadata); "
    "the attention layer never derives it, because a layer-side fallback would hide a runner "
    "regression"
)


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


def check_block_size(block_size: int, dcp_interleave: int) -> None:
    """The cache geometry DCP needs: ``block_size`` a multiple of ``dcp_interleave``."""
    if block_size % dcp_interleave:
        raise ValueError(
            f"block_size: {block_size} must be a multiple of dcp_interleave={dcp_interleave} "
            "(an interleave run of tokens must not straddle two cache blocks)"
        )


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
    check_block_size(block_size, interleave)
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

    def shard_lengths(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The lengths of the kernel call over this rank's shard: ``(cache_seqlens [B],
        row_seqlens [B, S_q] or None)``, int32.

        With DCP each request is as long as its window's last row's local length (the
        largest) and every row of a window of several keeps its own bound
        (``mla_decode(row_seqlens=)``); a single query's bound is its request's length, so
        it takes none (the kernel's plain walk). Without DCP, the global lengths and no row
        bounds (causality says them).
        """
        if self.dcp_local_seq_lens is None:
            return self.seq_lens, None
        rows = self.dcp_local_seq_lens.to(torch.int32).contiguous()
        return rows[:, -1].contiguous(), rows if rows.shape[1] > 1 else None


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
    ``q_len`` causal queries. With DCP it is for the call ``dcp_mla_decode`` makes: ``B``
    windows of ``q_len`` rows over this rank's shard, each row with its own local bound
    (``verify_local_seq_lens``, ``row_bounds``), each request as long as its last row's, over
    ``num_heads`` gathered heads.
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
        # The layer reads only the output; an AITER release without an LSE may serve it.
        return plan_decode(seq_lens, q_len=q_len, causal=True, return_lse=False, **common)
    local = verify_local_seq_lens(seq_lens, q_len, dcp_world_size, dcp_rank, dcp_interleave)
    return plan_decode(local[:, -1], q_len=q_len, causal=True, row_bounds=q_len > 1, **common)
