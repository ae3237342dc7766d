"""The device planner: a schedule's tables from lengths on the device, with no host read
(graph-safe): ``device_schedule`` runs two launches whatever the batch,
``_plan_schedule_kernel`` (one program whose every step is a vector over up to ``PLAN_BLOCK``
units, slots or segments: prefix sums, closed forms and binary searches, no loop over
requests) and ``_launch_order_kernel`` (each segment's rank, parallel over segments). It takes
the host planner's integer steps, so it writes ``host_schedule(..., whole_units=False)``'s
tables.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rocm_mla.kernels.schedule.cost import (
    MAX_KEYS,
    MERGE_KEYS,
    OVERHEAD_KEYS,
    OVERHEAD_PIECES,
    PIECE_KEYS,
    SEARCH_LANES,
    SEARCH_PASSES,
    lane_search_lanes,
    load_pieces,
)
from rocm_mla.kernels.schedule.tables import (
    POOL_SHIFT,
    ScheduleTables,
    check_pools,
    launch_capacity,
    segment_capacity,
)

#: Units, slots or segments per vector step of the device planner (a batch of 128 requests
#: of two row groups takes one step), and its warps: at 4, ptxas spills the sm90 build (16
#: bytes at 80 registers); at 8 with 512-wide steps Triton 3.8's sm90 build of a batch not
#: a multiple of 16 spills 4 bytes (80 registers); 256-wide steps spill in no build.
PLAN_BLOCK = 256
PLAN_WARPS = 8
#: Segments per program of the launch-order kernel (and per step of its rank count).
ORDER_BLOCK = 64


@triton.jit
def _last_at_most(sorted_ptr, count, value, mask, steps):
    """Per lane, the last index ``j < count`` with ``sorted[j] <= value`` (``sorted``
    increasing, ``sorted[0] <= value``): ``steps`` >= log2(count) halvings."""
    low = tl.zeros_like(value)
    high = tl.zeros_like(value) + count
    for _ in range(0, steps):
        mid = (low + high) // 2
        open_ = high - low > 1
        at = tl.load(sorted_ptr + mid, mask=mask & open_, other=0)
        up = at <= value
        low = tl.where(open_ & up, mid, low)
        high = tl.where(open_ & ~up, mid, high)
    return low


@triton.jit
def _split_chunk_of(n, splits):
    """``host._split_chunk`` of every lane."""
    return (n + tl.minimum(splits, tl.maximum(n, 1)) - 1) // tl.minimum(splits, tl.maximum(n, 1))


@triton.jit
def _first_slot(line, pieces, width, LINE_OVERHEAD: tl.constexpr):
    """The slot of a unit's first segment: of its first piece, or for an empty unit of the
    end of its prologue."""
    first = line + LINE_OVERHEAD
    return tl.where(pieces == 0, (first - 1) // width, first // width)


@triton.jit
def _plan_schedule_kernel(
    seqlens_ptr,  # [B] int32
    slot_segments_ptr,  # [S + 1] int32
    segments_ptr,  # [B * G + S, 4] int32
    unit_parts_ptr,  # [B * G, 2] int32
    split_units_ptr,  # [S] int32
    keys_ptr,  # [B * G + S] int64: each segment's launch sort key (POOL_SHIFT)
    line_ptr,  # [B * G] int64 scratch: each unit's place on the line
    first_ptr,  # [B * G] int64 scratch: each unit's first segment
    head_ptr,  # [S] int64 scratch: each used slot's first piece on the line
    launch_order_ptr,  # [launch capacity] int32: cleared to -1 here (_launch_order_kernel)
    batch,
    num_groups,
    num_slots,
    num_pools,
    capacity_keys,
    launch_programs,
    search_steps,  # halvings of a binary search over the units (> log2(B * G))
    OVERHEAD: tl.constexpr,
    LINE_OVERHEAD: tl.constexpr,
    MERGE: tl.constexpr,
    POOL_SHIFT: tl.constexpr,
    PIECE: tl.constexpr,
    LANES: tl.constexpr,
    PASSES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``host_schedule`` on the device, one program (the package docstring): the step's totals,
    the packing's choice, then per unit, per slot and per segment a vector step over
    ``BLOCK`` of them at a time, each reading only what an earlier step wrote (a barrier
    between them)."""
    capacity_keys = tl.cast(capacity_keys, tl.int64)
    offs = tl.arange(0, BLOCK)
    units = batch * num_groups

    # The line's length and the longest unit.
    line_total = tl.zeros([BLOCK], tl.int64)
    longest = tl.zeros([BLOCK], tl.int64)
    for b0 in range(0, batch, BLOCK):
        b = b0 + offs
        n = load_pieces(seqlens_ptr, b, b < batch, capacity_keys, PIECE)
        line_total += tl.where(b < batch, LINE_OVERHEAD + n, 0)
        longest = tl.maximum(longest, n)
    line_total = tl.sum(line_total, axis=0) * num_groups
    longest = tl.max(longest, axis=0)

    # The packing (host.choose_packing).
    low = tl.maximum(1, (line_total + num_slots - 1) // num_slots)
    width, cost = lane_search_lanes(
        low, tl.maximum(low, longest), longest, False, OVERHEAD, MERGE, PIECE, LANES, PASSES
    )
    splits = width * 0
    if units <= num_slots:
        most = tl.cast(num_slots // units, tl.int64)
        best, uniform_cost = lane_search_lanes(
            most * 0 + 1, most, longest, True, OVERHEAD, MERGE, PIECE, LANES, PASSES
        )
        if uniform_cost < cost:
            splits = best
    uniform = splits > 0
    # Neither candidate's divisions may see a zero (the other one's is).
    width = tl.where(uniform, 1, width)
    splits = tl.where(uniform, splits, 1)

    # Per unit: its place on the line, its segments, the first one and its partials (prefix
    # sums over the units before it).
    line_carry = line_total * 0
    seg_carry = line_total * 0
    part_carry = line_total * 0
    cut_carry = line_total * 0
    for u0 in range(0, units, BLOCK):
        u = u0 + offs
        valid = u < units
        n = load_pieces(seqlens_ptr, u // num_groups, valid, capacity_keys, PIECE)
        size = tl.where(valid, LINE_OVERHEAD + n, 0)
        line = line_carry + tl.cumsum(size, axis=0) - size
        if uniform:
            chunk = tl.maximum(_split_chunk_of(n, splits), 1)
            count = tl.where(valid, tl.maximum((n + chunk - 1) // chunk, 1), 0)
        else:
            low_slot = _first_slot(line, n, width, LINE_OVERHEAD)
            high_slot = tl.where(n == 0, low_slot, (line + LINE_OVERHEAD + n - 1) // width)
            count = tl.where(valid, high_slot - low_slot + 1, 0)
        cut = count > 1
        parts = tl.where(cut, count, 0)
        part_first = part_carry + tl.cumsum(parts, axis=0) - parts
        cuts = cut.to(tl.int64)
        cut_index = cut_carry + tl.cumsum(cuts, axis=0) - cuts
        tl.store(line_ptr + u, line, mask=valid)
        tl.store(first_ptr + u, seg_carry + tl.cumsum(count, axis=0) - count, mask=valid)
        tl.store(unit_parts_ptr + u * 2, tl.where(cut, part_first, -1).to(tl.int32), mask=valid)
        tl.store(unit_parts_ptr + u * 2 + 1, tl.where(cut, count, 1).to(tl.int32), mask=valid)
        tl.store(split_units_ptr + cut_index, u.to(tl.int32), mask=valid & cut)
        line_carry += tl.sum(size, axis=0)
        seg_carry += tl.sum(count, axis=0)
        part_carry += tl.sum(parts, axis=0)
        cut_carry += tl.sum(cuts, axis=0)
    segments = seg_carry
    used = tl.where(uniform, segments, (line_total - 1) // width + 1)
    for s0 in range(0, num_slots, BLOCK):
        s = s0 + offs
        tl.store(split_units_ptr + s, -1, mask=(s >= cut_carry) & (s < num_slots))
    tl.debug_barrier()

    # Per slot: its first segment (a slot inside a prologue wider than the slots has none:
    # the next one's), and where on the line its first piece lies.
    for s0 in range(0, num_slots + 1, BLOCK):
        s = (s0 + offs).to(tl.int64)
        live = s < used
        if uniform:
            first_segment = s
        else:
            at = s * width
            w = _last_at_most(line_ptr, units, at, live, search_steps)
            line = tl.load(line_ptr + w, mask=live, other=0)
            n = load_pieces(seqlens_ptr, w // num_groups, live, capacity_keys, PIECE)
            first_segment = tl.load(first_ptr + w, mask=live, other=0)
            first_segment += tl.maximum(s - _first_slot(line, n, width, LINE_OVERHEAD), 0)
            tl.store(head_ptr + s, tl.maximum(at, line + LINE_OVERHEAD), mask=live)
        tl.store(
            slot_segments_ptr + s,
            tl.where(live, first_segment, segments).to(tl.int32),
            mask=s <= num_slots,
        )
    tl.debug_barrier()

    # Per segment: its keys and partial, and its launch key (planned start, slot, pool).
    for i0 in range(0, segments, BLOCK):
        i = (i0 + offs).to(tl.int64)
        valid = i < segments
        unit = _last_at_most(first_ptr, units, i, valid, search_steps)
        line = tl.load(line_ptr + unit, mask=valid, other=0)
        k = i - tl.load(first_ptr + unit, mask=valid, other=0)
        n = load_pieces(seqlens_ptr, unit // num_groups, valid, capacity_keys, PIECE)
        count = tl.load(unit_parts_ptr + unit * 2 + 1, mask=valid, other=1)
        part_first = tl.load(unit_parts_ptr + unit * 2, mask=valid, other=-1)
        part = tl.where(count > 1, part_first + k, -1)
        if uniform:
            chunk = _split_chunk_of(n, splits)
            first_piece = k * chunk
            end_piece = tl.minimum(first_piece + chunk, n)
            slot = i
            start = i * 0
        else:
            slot = _first_slot(line, n, width, LINE_OVERHEAD) + k
            piece0 = line + LINE_OVERHEAD  # the unit's first piece on the line
            first_piece = tl.maximum(slot * width - piece0, 0)
            end_piece = tl.minimum((slot + 1) * width - piece0, n)
            # Start = the slot's earlier segments' cost: the line between the slot's first
            # piece and this one, plus what each segment's overhead exceeds its line share.
            head = tl.load(head_ptr + slot, mask=valid, other=0)
            before = i - tl.load(slot_segments_ptr + slot, mask=valid, other=0)
            start = PIECE * (piece0 + first_piece - head)
            start += (OVERHEAD - LINE_OVERHEAD * PIECE) * before
        row = segments_ptr + i * 4
        tl.store(row, unit.to(tl.int32), mask=valid)
        tl.store(row + 1, (first_piece * PIECE).to(tl.int32), mask=valid)
        tl.store(row + 2, (end_piece * PIECE).to(tl.int32), mask=valid)
        tl.store(row + 3, part.to(tl.int32), mask=valid)
        pool = slot * num_slots // used * num_pools // num_slots
        tl.store(keys_ptr + i, (pool << POOL_SHIFT) + start * num_slots + slot, mask=valid)
    for p0 in range(0, launch_programs, BLOCK):
        p = p0 + offs
        tl.store(launch_order_ptr + p, -1, mask=p < launch_programs)


@triton.jit
def _launch_order_kernel(
    slot_segments_ptr,  # [S + 1] int32: its last entry counts the segments
    starts_ptr,  # [B * G + S] int64: pool << POOL_SHIFT | planned start x S + slot
    launch_order_ptr,  # [launch capacity] int32, all -1
    num_slots,
    num_pools,
    POOL_SHIFT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``launch_order`` on the device: each segment's position is its rank by planned
    start among its pool's segments (the keys are unique: a slot's segments each cost at
    least the overhead), times the pool count, plus its pool. The rank within the pool is
    the keys below it less the keys of lower pools (no division on the device)."""
    count = tl.load(slot_segments_ptr + num_slots)
    if tl.program_id(0) * BLOCK < count:
        mine = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        valid = mine < count
        key = tl.load(starts_ptr + mine, mask=valid, other=0)
        pool = key >> POOL_SHIFT
        floor = pool << POOL_SHIFT
        rank = tl.zeros([BLOCK], tl.int32)
        for j0 in range(0, count, BLOCK):
            other = j0 + tl.arange(0, BLOCK)
            other_key = tl.load(starts_ptr + other, mask=other < count, other=0)
            real = (other < count)[None, :]
            below = real & (other_key[None, :] < key[:, None])
            lower_pool = real & (other_key[None, :] < floor[:, None])
            rank += tl.sum(below.to(tl.int32) - lower_pool.to(tl.int32), axis=1)
        tl.store(launch_order_ptr + rank * num_pools + pool.to(tl.int32), mine, mask=valid)


#: ``_plan_schedule_kernel``'s constexprs: the model's and the search's (``cost``), the sort
#: key's shift and the vector step.
PLANNER_CONSTEXPRS = {
    "OVERHEAD": OVERHEAD_KEYS,
    "LINE_OVERHEAD": OVERHEAD_PIECES,
    "MERGE": MERGE_KEYS,
    "POOL_SHIFT": POOL_SHIFT,
    "PIECE": PIECE_KEYS,
    "LANES": SEARCH_LANES,
    "PASSES": SEARCH_PASSES,
    "BLOCK": PLAN_BLOCK,
}


def device_schedule(
    cache_seqlens: torch.Tensor,
    tables: ScheduleTables,
    *,
    capacity_keys: int,
) -> None:
    """Rewrite ``tables`` on the device from ``cache_seqlens`` (no host read; graph-safe):
    two launches whatever the batch (this module's docstring)."""
    batch = cache_seqlens.shape[0]
    units = batch * tables.num_groups
    segments = tables.segments.shape[0]
    # One scratch buffer, each part 16-byte aligned (Triton specializes pointers on it).
    sizes = [segments, units, units, tables.num_slots]
    ends = [0]
    for size in sizes:
        ends.append(ends[-1] + -(-size // 2) * 2)
    scratch = torch.empty(ends[-1], dtype=torch.int64, device=tables.segments.device)
    keys, line, first, head = (scratch[a : a + n] for a, n in zip(ends, sizes, strict=False))
    _plan_schedule_kernel[(1,)](
        cache_seqlens,
        tables.slot_segments,
        tables.segments,
        tables.unit_parts,
        tables.split_units,
        keys,
        line,
        first,
        head,
        tables.launch_order,
        batch,
        tables.num_groups,
        tables.num_slots,
        tables.num_pools,
        min(capacity_keys, MAX_KEYS),
        tables.launch_order.shape[0],
        max(1, units.bit_length()),
        **PLANNER_CONSTEXPRS,
        num_warps=PLAN_WARPS,
    )
    _launch_order_kernel[(triton.cdiv(segments, ORDER_BLOCK),)](
        tables.slot_segments,
        keys,
        tables.launch_order,
        tables.num_slots,
        tables.num_pools,
        POOL_SHIFT=POOL_SHIFT,
        BLOCK=ORDER_BLOCK,
        num_warps=4,
    )


def empty_tables(
    batch: int,
    num_groups: int,
    num_slots: int,
    device: torch.device | str,
    num_pools: int = 1,
) -> ScheduleTables:
    """Tables of the right capacity for ``device_schedule`` to fill (left uninitialized: the
    planner writes every entry anything reads)."""
    check_pools(num_pools)
    units = batch * num_groups
    return ScheduleTables(
        slot_segments=torch.empty(num_slots + 1, dtype=torch.int32, device=device),
        segments=torch.empty(
            segment_capacity(units, num_slots), 4, dtype=torch.int32, device=device
        ),
        unit_parts=torch.empty(units, 2, dtype=torch.int32, device=device),
        split_units=torch.empty(num_slots, dtype=torch.int32, device=device),
        launch_order=torch.empty(
            launch_capacity(units, num_slots, num_pools), dtype=torch.int32, device=device
        ),
        num_slots=num_slots,
        num_groups=num_groups,
        num_pools=num_pools,
    )
