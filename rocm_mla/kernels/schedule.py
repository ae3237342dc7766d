"""The balanced decode schedule: which keys each resident stage-1 program walks.

A decode step's work is ``units``: one per (request, row group), ``u = b * G + g``, each
``n_u`` pieces of ``PIECE_KEYS`` keys (its length rounded up; clamped to the block table's
capacity, past which stage 1 reads nothing). They are packed into the resident slots
(compute units x programs per CU, ``plan.plan_launch``) as lists of *segments* (a unit's
key range), FlashMLA- and AITER-persistent-style: every slot gets about the same cost, so a
long request is cut across many slots while short ones share one. Stage 1 runs one program
per segment, in an order that makes the GPU's own dispatch run that packing ("Launch
order" below).

Cost model (the one the planner packs by and ``rocm-mla bench schedule`` reports): a
segment of ``t`` pieces costs ``t * PIECE_KEYS + SPLIT_OVERHEAD_TOKENS`` (its prologue, its
partial and the merge reading it back; ``plan.SPLIT_OVERHEAD_TOKENS``), a masked piece as
much as a full one.

Packing: the units in order fill slot after slot greedily under a budget ``C``: a unit
goes whole into the open slot if it fits, else fills what is left of it and continues in
fresh slots; a slot closes when not even one piece and its overhead fit. ``C`` is the
smallest cost, in keys, from the lower bound ``SPLIT_OVERHEAD_TOKENS + PIECE_KEYS x
ceil(total pieces / S)`` up, for which the packing uses at most ``S`` slots,
found by ``SEARCH_LANES``-wide searches: each pass tries that many budgets side by side and
narrows to the gap below the first that fits, until the budgets are one key apart. The
device planner (``_plan_schedule_kernel``) runs exactly these integer steps with the
budgets as vector lanes; the host planner (``host_schedule``) runs them in Python. Both
write the same tables.

Tables (int32, fixed capacity for a batch ``B``, groups ``G`` and slots ``S``, so that one
captured graph replays any lengths):

- ``slot_segments [S + 1]``: slot ``s`` walks segments ``[slot_segments[s], slot_segments[s+1])``;
- ``segments [B * G + S, 4]``: ``(unit, first key, end key, partial)``, the partial index
  ``-1`` when the segment is its unit's only one (it writes the final output directly);
- ``unit_parts [B * G, 2]``: ``(first partial, count)`` of a unit cut into ``count > 1``
  segments (the merge reads them), ``(-1, 1)`` otherwise;
- ``split_units [S]``: the cut units in order, then ``-1`` (the merge's grid);
- ``launch_order [X * (B * G + ceil(S / X))]``: the segment stage-1 program ``p`` walks, or
  ``-1`` (a program with nothing to do).

Launch order. Stage 1 runs one program per segment, not a loop over a slot's list (a
persistent loop spills: ``mla_decode_kernel._mla_decode_stage1``). The hardware hands out
programs in id order, each to a slot as one frees (list scheduling). Programs ordered by
their segments' planned start time (ties by slot) then run the packing itself: when a
segment's turn comes, every segment before it started no later than planned (induction),
so at most ``S - 1`` of them still run at its planned start (the plan never has more
overlapping it) and a slot is free by then; with the model's costs nothing ends later than
planned, and where real costs differ, whichever slot frees first takes the next segment.
On AMD the slots are ``X`` pools, the XCDs (workgroup ``p`` goes to XCD ``p % X``): plan
slot ``s`` belongs to pool ``s * X // S`` (neighbouring slots, hence neighbouring units, on
one L2), each pool's segments are sorted by start, and pool ``x``'s ``k``-th sits at
position ``k * X + x``; a pool with fewer segments leaves ``-1`` programs at its end. With
one pool (NVIDIA, the interpreter) the order is one sorted list. ``X`` is the config's
``num_xcds``.

A slot boundary cuts at most one unit, so at most ``S - 1`` units are cut, into at most
``2 * (S - 1)`` partials (``partial_capacity``), and at most ``B * G + S - 1`` segments exist.

When the result may be reused: a schedule holds for the lengths it was built from (host)
or, built on the device, for the lengths in ``cache_seqlens`` when the planner ran; the
plan's shapes (B, G, S, the page and table capacity) are fixed, the tables are rewritten by
every planner run (once per decode step, before the first MLA layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rocm_mla.kernels.plan import SPLIT_OVERHEAD_TOKENS

#: Keys per piece: cuts fall on multiples of it. A multiple of every tuned BLOCK_N (16, 32,
#: 64: ``tuned_configs``), so each piece starts a tile and, with pages of 64 or more keys, a
#: page (stage 1's one-block-id-per-tile walk); the cost model's smallest program.
PIECE_KEYS = 64
#: Keys a schedule plans at most (whole pieces below 2^31, so every key offset is an int32).
MAX_KEYS = (2**31 - 1) // PIECE_KEYS * PIECE_KEYS
#: The budget search's width: budgets tried side by side per pass (the device planner's lanes).
SEARCH_LANES = 64
#: The overhead in whole keys (the cost model is integer, so host and device agree exactly).
OVERHEAD_KEYS = round(SPLIT_OVERHEAD_TOKENS)
#: Segments per program of the launch-order kernel (and per step of its rank count).
ORDER_BLOCK = 64
#: The device planner's sort key of a segment: ``pool << POOL_SHIFT | start * S + slot``
#: (``start * S + slot`` stays below 2^59: starts are below the budget, at most the step's
#: keys plus an overhead per unit; 16 pools at most).
POOL_SHIFT = 59
MAX_POOLS = 16


def partial_capacity(num_slots: int) -> int:
    """Partials a schedule over ``num_slots`` slots may use (each slot boundary cuts at most
    one unit, adding one piece to it, and a cut unit has one more piece than cuts)."""
    return max(1, 2 * (num_slots - 1))


def segment_capacity(num_units: int, num_slots: int) -> int:
    return num_units + num_slots


def _check_pools(num_pools: int) -> None:
    if (
        isinstance(num_pools, bool)
        or not isinstance(num_pools, int)
        or not 1 <= num_pools <= MAX_POOLS
    ):
        raise ValueError(
            f"schedule: num_pools must be an int in [1, {MAX_POOLS}], got {num_pools!r}"
        )


def launch_capacity(num_units: int, num_slots: int, num_pools: int) -> int:
    """Stage-1 programs a device-planned schedule launches: every pool's segments (at most
    every unit plus one per slot boundary in the pool) at ``num_pools`` positions apart."""
    return num_pools * (num_units + -(-num_slots // num_pools))


def pool_of(slot: int, num_slots: int, num_pools: int) -> int:
    """The pool (XCD) of plan slot ``slot``: contiguous ranges of slots."""
    return slot * num_pools // num_slots


def launch_order(starts: Sequence[tuple[int, int]], num_slots: int, num_pools: int) -> list[int]:
    """The segment each stage-1 program walks (or -1), from each segment's planned
    ``(start, slot)``, exactly as the device planner writes it (module docstring)."""
    pools: list[list[tuple[int, int, int]]] = [[] for _ in range(num_pools)]
    for index, (start, slot) in enumerate(starts):
        pools[pool_of(slot, num_slots, num_pools)].append((start, slot, index))
    depth = max(len(pool) for pool in pools)
    order = [-1] * (num_pools * depth)
    for x, pool in enumerate(pools):
        for k, (_, _, index) in enumerate(sorted(pool)):
            order[k * num_pools + x] = index
    return order


@dataclass(frozen=True)
class ScheduleTables:
    """A schedule's tables (see the module docstring) and the grid they were made for."""

    slot_segments: torch.Tensor  #: [S + 1] int32
    segments: torch.Tensor  #: [B * G + S, 4] int32
    unit_parts: torch.Tensor  #: [B * G, 2] int32
    split_units: torch.Tensor  #: [S] int32: the units cut into several segments, then -1
    launch_order: torch.Tensor  #: [launch_capacity] int32: program -> segment, or -1
    num_slots: int  #: S: the resident slots the packing balances over
    num_groups: int  #: G
    num_pools: int = 1  #: X: slot pools the hardware fills apart (AMD's XCDs)
    #: Known on the host (``host_schedule``): the slots that hold a segment, the partials
    #: used and the stage-1 programs to launch; None for tables the device planner fills
    #: (then the capacities hold).
    used_slots: int | None = None
    num_partials: int | None = None
    num_programs: int | None = None


def _pieces(length: int, capacity_keys: int) -> int:
    return -(-min(max(length, 0), capacity_keys, MAX_KEYS) // PIECE_KEYS)


def _slots_used(pieces: Sequence[int], num_groups: int, budget: int, limit: int) -> int:
    """Slots the greedy packing under ``budget`` fills (stops counting past ``limit``)."""
    fresh = (budget - OVERHEAD_KEYS) // PIECE_KEYS  # pieces a fresh slot holds
    slot, used = 0, 0
    for n in pieces:
        for _ in range(num_groups):
            if n == 0:
                if used > 0 and used + OVERHEAD_KEYS > budget:
                    slot, used = slot + 1, 0
                used += OVERHEAD_KEYS
                continue
            room = (budget - used - OVERHEAD_KEYS) // PIECE_KEYS
            if room >= n:
                used += OVERHEAD_KEYS + n * PIECE_KEYS
                continue
            rest = n - max(room, 0)
            opened = -(-rest // fresh)
            slot += opened
            used = OVERHEAD_KEYS + (rest - (opened - 1) * fresh) * PIECE_KEYS
            if slot >= limit:
                return slot + 1
    return slot + 1


def search_budget(pieces: Sequence[int], num_groups: int, num_slots: int) -> int:
    """The packing budget (keys of cost per slot): see the module docstring."""
    total = num_groups * sum(pieces)
    units = num_groups * len(pieces)
    # Some slot holds ceil(total / S) pieces and one overhead: no smaller budget fits.
    low = OVERHEAD_KEYS + PIECE_KEYS * max(1, -(-total // num_slots))
    # One slot holding everything always fits.
    high = max(low, OVERHEAD_KEYS * units + PIECE_KEYS * total)
    while True:
        step = max(1, -(-(high - low) // (SEARCH_LANES - 1)))
        previous = low - 1
        for lane in range(SEARCH_LANES):
            budget = min(low + lane * step, high)
            if _slots_used(pieces, num_groups, budget, num_slots) <= num_slots:
                break
            previous = budget
        if lane == 0 or step == 1:
            return budget
        low, high = previous + 1, budget


def host_schedule(
    lengths: Sequence[int],
    *,
    num_groups: int,
    num_slots: int,
    capacity_keys: int,
    num_pools: int = 1,
    device: torch.device | str = "cpu",
) -> ScheduleTables:
    """The schedule of ``lengths`` (host ints), as the device planner would build it."""
    _check_pools(num_pools)
    pieces = [_pieces(int(length), capacity_keys) for length in lengths]
    batch = len(pieces)
    units = batch * num_groups
    budget = search_budget(pieces, num_groups, num_slots)
    fresh = (budget - OVERHEAD_KEYS) // PIECE_KEYS
    slot_segments = [0] * (num_slots + 1)
    segments: list[tuple[int, int, int, int]] = []
    unit_parts = [(-1, 1)] * units
    split_units = [-1] * num_slots
    starts: list[tuple[int, int]] = []  # each segment's planned (start, slot)
    slot, used, partials, cut = 0, 0, 0, 0
    for u in range(units):
        n = pieces[u // num_groups]
        if n == 0:
            if used > 0 and used + OVERHEAD_KEYS > budget:
                slot, used = slot + 1, 0
                slot_segments[slot] = len(segments)
            segments.append((u, 0, 0, -1))
            starts.append((used, slot))
            used += OVERHEAD_KEYS
            continue
        room = (budget - used - OVERHEAD_KEYS) // PIECE_KEYS
        count = 1 if room >= n else int(room >= 1) + -(-(n - max(room, 0)) // fresh)
        if count > 1:
            unit_parts[u] = (partials, count)
            split_units[cut] = u
            cut += 1
        done = 0
        for piece in range(count):
            room = (budget - used - OVERHEAD_KEYS) // PIECE_KEYS
            if room < 1:
                slot, used = slot + 1, 0
                slot_segments[slot] = len(segments)
                room = fresh
            take = min(n - done, room)
            part = partials + piece if count > 1 else -1
            segments.append((u, done * PIECE_KEYS, (done + take) * PIECE_KEYS, part))
            starts.append((used, slot))
            used += OVERHEAD_KEYS + take * PIECE_KEYS
            done += take
        if count > 1:
            partials += count
    for s in range(slot + 1, num_slots + 1):
        slot_segments[s] = len(segments)
    seg_table = torch.zeros(segment_capacity(units, num_slots), 4, dtype=torch.int32)
    seg_table[: len(segments)] = torch.tensor(segments, dtype=torch.int32).view(-1, 4)
    order = launch_order(starts, num_slots, num_pools)
    # Capacity-sized like the device planner's, so the device may rewrite these tables.
    order_table = torch.full((launch_capacity(units, num_slots, num_pools),), -1, dtype=torch.int32)
    order_table[: len(order)] = torch.tensor(order, dtype=torch.int32)
    return ScheduleTables(
        slot_segments=torch.tensor(slot_segments, dtype=torch.int32, device=device),
        segments=seg_table.to(device),
        unit_parts=torch.tensor(unit_parts, dtype=torch.int32, device=device).view(units, 2),
        split_units=torch.tensor(split_units, dtype=torch.int32, device=device),
        launch_order=order_table.to(device),
        num_slots=num_slots,
        num_groups=num_groups,
        num_pools=num_pools,
        used_slots=slot + 1,
        num_partials=partials,
        num_programs=len(order),
    )


def uniform_schedule(
    lengths: Sequence[int],
    *,
    num_groups: int,
    splits: int,
    capacity_keys: int,
    device: torch.device | str = "cpu",
) -> ScheduleTables:
    """The uniform split of earlier releases as tables for the same kernel: every request
    cut into ``splits`` piece-aligned chunks of ``ceil(L / splits)`` keys, one program each
    (program id: row group fastest, then split, then request), so a GPU run can time it
    beside the balanced schedule (``plan.choose_num_kv_splits`` chose ``splits``)."""
    batch = len(lengths)
    units = batch * num_groups
    slots = units * splits
    segments = []
    unit_parts = [(-1, 1)] * units
    split_units = []
    for b, length in enumerate(lengths):
        n = _pieces(int(length), capacity_keys)
        chunk = -(-n // splits)
        for s in range(splits):
            for g in range(num_groups):
                unit = b * num_groups + g
                first, end = min(s * chunk, n), min((s + 1) * chunk, n)
                part = unit * splits + s if splits > 1 else -1
                segments.append((unit, first * PIECE_KEYS, end * PIECE_KEYS, part))
    if splits > 1:
        unit_parts = [(u * splits, splits) for u in range(units)]
        split_units = list(range(units))
    seg_table = torch.zeros(segment_capacity(units, slots), 4, dtype=torch.int32)
    seg_table[:slots] = torch.tensor(segments, dtype=torch.int32).view(-1, 4)
    return ScheduleTables(
        slot_segments=torch.arange(slots + 1, dtype=torch.int32, device=device),
        segments=seg_table.to(device),
        unit_parts=torch.tensor(unit_parts, dtype=torch.int32, device=device).view(units, 2),
        split_units=torch.tensor(
            split_units + [-1] * (slots - len(split_units)), dtype=torch.int32, device=device
        ),
        # Program p walks segment p: the old launch's program-id order.
        launch_order=torch.arange(slots, dtype=torch.int32, device=device),
        num_slots=slots,
        num_groups=num_groups,
        used_slots=slots,
        num_partials=units * splits if splits > 1 else 0,
        num_programs=slots,
    )


@triton.jit
def _pieces_of(seqlens_ptr, b, capacity_keys, PIECE: tl.constexpr):
    length = tl.load(seqlens_ptr + b).to(tl.int64)
    length = tl.minimum(tl.maximum(length, 0), capacity_keys)
    return (length + PIECE - 1) // PIECE


@triton.jit
def _slots_used_lanes(
    seqlens_ptr,
    batch,
    num_groups,
    capacity_keys,
    budget,  # [LANES] int64
    limit,
    OVERHEAD: tl.constexpr,
    PIECE: tl.constexpr,
):
    """``_slots_used`` for every lane's budget at once; saturates at ``limit`` slots (the
    host's early stop: both call a lane infeasible exactly when it needs more than limit)."""
    fresh = (budget - OVERHEAD) // PIECE
    slot = tl.zeros_like(budget)
    used = tl.zeros_like(budget)
    for b in range(0, batch):
        n = _pieces_of(seqlens_ptr, b, capacity_keys, PIECE)
        for _g in range(0, num_groups):
            if n == 0:
                full = (used > 0) & (used + OVERHEAD > budget)
                slot = tl.where(full, slot + 1, slot)
                used = tl.where(full, 0, used) + OVERHEAD
            else:
                room = (budget - used - OVERHEAD) // PIECE
                fits = room >= n
                rest = n - tl.maximum(room, 0)
                opened = (rest + fresh - 1) // fresh
                slot = tl.where(fits, slot, tl.minimum(slot + opened, limit))
                used = tl.where(
                    fits,
                    used + OVERHEAD + n * PIECE,
                    OVERHEAD + (rest - (opened - 1) * fresh) * PIECE,
                )
    return slot + 1


@triton.jit
def _plan_schedule_kernel(
    seqlens_ptr,  # [B] int32
    slot_segments_ptr,  # [S + 1] int32
    segments_ptr,  # [B * G + S, 4] int32
    unit_parts_ptr,  # [B * G, 2] int32
    split_units_ptr,  # [S] int32
    starts_ptr,  # [B * G + S] int64: each segment's sort key (POOL_SHIFT)
    launch_order_ptr,  # [launch capacity] int32: cleared to -1 here (_launch_order_kernel)
    batch,
    num_groups,
    num_slots,
    num_pools,
    capacity_keys,
    launch_programs,
    OVERHEAD: tl.constexpr,
    POOL_SHIFT: tl.constexpr,
    PIECE: tl.constexpr,
    LANES: tl.constexpr,
    MAX_PASSES: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """One program: ``host_schedule``'s integer steps on the device (module docstring)."""
    capacity_keys = tl.cast(capacity_keys, tl.int64)
    total = tl.zeros([BLOCK_B], tl.int64)
    for b0 in range(0, batch, BLOCK_B):
        offs = b0 + tl.arange(0, BLOCK_B)
        length = tl.load(seqlens_ptr + offs, mask=offs < batch, other=0).to(tl.int64)
        length = tl.minimum(tl.maximum(length, 0), capacity_keys)
        total += (length + PIECE - 1) // PIECE
    total = tl.sum(total, axis=0) * num_groups
    units = batch * num_groups
    low = OVERHEAD + PIECE * tl.maximum((total + num_slots - 1) // num_slots, 1)
    high = tl.maximum(low, OVERHEAD * tl.cast(units, tl.int64) + PIECE * total)
    lanes = tl.arange(0, LANES).to(tl.int64)
    chosen = high
    done = low < 0  # False, as a scalar the loop carries
    for _pass in range(0, MAX_PASSES):
        if not done:
            step = tl.maximum((high - low + LANES - 2) // (LANES - 1), 1)
            t = tl.minimum(low + lanes * step, high)
            used = _slots_used_lanes(
                seqlens_ptr,
                batch,
                num_groups,
                capacity_keys,
                t,
                num_slots,
                OVERHEAD,
                PIECE,
            )
            first = tl.min(tl.where(used <= num_slots, lanes, LANES), axis=0)
            t_first = tl.sum(tl.where(lanes == first, t, 0), axis=0)
            t_prev = tl.sum(tl.where(lanes == first - 1, t, 0), axis=0)
            chosen = t_first
            done = (first == 0) | (step == 1)
            low = t_prev + 1
            high = t_first
    budget = chosen
    fresh = (budget - OVERHEAD) // PIECE

    # Emit the packing under the chosen budget.
    slot = 0
    used = budget * 0
    nseg = 0
    partials = 0
    cut = 0
    tl.store(slot_segments_ptr, 0)
    for u in range(0, units):
        n = _pieces_of(seqlens_ptr, u // num_groups, capacity_keys, PIECE)
        if n == 0:
            if (used > 0) & (used + OVERHEAD > budget):
                slot += 1
                used = used * 0
                tl.store(slot_segments_ptr + slot, nseg)
            pool = (slot * num_pools // num_slots).to(tl.int64)
            tl.store(starts_ptr + nseg, (pool << POOL_SHIFT) + used * num_slots + slot)
            tl.store(segments_ptr + nseg * 4, u)
            tl.store(segments_ptr + nseg * 4 + 1, 0)
            tl.store(segments_ptr + nseg * 4 + 2, 0)
            tl.store(segments_ptr + nseg * 4 + 3, -1)
            tl.store(unit_parts_ptr + u * 2, -1)
            tl.store(unit_parts_ptr + u * 2 + 1, 1)
            nseg += 1
            used += OVERHEAD
        else:
            room = (budget - used - OVERHEAD) // PIECE
            count = tl.where(
                room >= n,
                1,
                tl.where(room >= 1, 1, 0) + (n - tl.maximum(room, 0) + fresh - 1) // fresh,
            ).to(tl.int32)
            split = count > 1
            tl.store(unit_parts_ptr + u * 2, tl.where(split, partials, -1))
            tl.store(unit_parts_ptr + u * 2 + 1, count)
            if split:
                tl.store(split_units_ptr + cut, u)
                cut += 1
            done_pieces = n * 0
            for piece in range(0, count):
                room = (budget - used - OVERHEAD) // PIECE
                if room < 1:
                    slot += 1
                    used = used * 0
                    tl.store(slot_segments_ptr + slot, nseg)
                    room = fresh
                take = tl.minimum(n - done_pieces, room)
                pool = (slot * num_pools // num_slots).to(tl.int64)
                tl.store(starts_ptr + nseg, (pool << POOL_SHIFT) + used * num_slots + slot)
                tl.store(segments_ptr + nseg * 4, u)
                tl.store(segments_ptr + nseg * 4 + 1, (done_pieces * PIECE).to(tl.int32))
                tl.store(segments_ptr + nseg * 4 + 2, ((done_pieces + take) * PIECE).to(tl.int32))
                tl.store(segments_ptr + nseg * 4 + 3, tl.where(split, partials + piece, -1))
                nseg += 1
                used += OVERHEAD + take * PIECE
                done_pieces += take
            partials += tl.where(split, count, 0)
    for s0 in range(0, num_slots + 1, BLOCK_B):
        offs = s0 + tl.arange(0, BLOCK_B)
        tl.store(slot_segments_ptr + offs, nseg, mask=(offs > slot) & (offs <= num_slots))
        tl.store(split_units_ptr + offs, -1, mask=(offs >= cut) & (offs < num_slots))
    for p0 in range(0, launch_programs, BLOCK_B):
        offs = p0 + tl.arange(0, BLOCK_B)
        tl.store(launch_order_ptr + offs, -1, mask=offs < launch_programs)


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


def device_schedule(
    cache_seqlens: torch.Tensor,
    tables: ScheduleTables,
    *,
    capacity_keys: int,
) -> None:
    """Rewrite ``tables`` on the device from ``cache_seqlens`` (no host read; graph-safe)."""
    batch = cache_seqlens.shape[0]
    starts = torch.empty(tables.segments.shape[0], dtype=torch.int64, device=tables.segments.device)
    _plan_schedule_kernel[(1,)](
        cache_seqlens,
        tables.slot_segments,
        tables.segments,
        tables.unit_parts,
        tables.split_units,
        starts,
        tables.launch_order,
        batch,
        tables.num_groups,
        tables.num_slots,
        tables.num_pools,
        min(capacity_keys, MAX_KEYS),
        tables.launch_order.shape[0],
        OVERHEAD=OVERHEAD_KEYS,
        POOL_SHIFT=POOL_SHIFT,
        PIECE=PIECE_KEYS,
        LANES=SEARCH_LANES,
        MAX_PASSES=8,
        BLOCK_B=256,
        num_warps=4,
    )
    block = ORDER_BLOCK
    _launch_order_kernel[(triton.cdiv(starts.shape[0], block),)](
        tables.slot_segments,
        starts,
        tables.launch_order,
        tables.num_slots,
        tables.num_pools,
        POOL_SHIFT=POOL_SHIFT,
        BLOCK=block,
        num_warps=4,
    )


def empty_tables(
    batch: int,
    num_groups: int,
    num_slots: int,
    device: torch.device | str,
    num_pools: int = 1,
) -> ScheduleTables:
    """Tables of the right capacity for ``device_schedule`` to fill."""
    _check_pools(num_pools)
    units = batch * num_groups
    return ScheduleTables(
        slot_segments=torch.zeros(num_slots + 1, dtype=torch.int32, device=device),
        segments=torch.zeros(
            segment_capacity(units, num_slots), 4, dtype=torch.int32, device=device
        ),
        unit_parts=torch.zeros(units, 2, dtype=torch.int32, device=device),
        split_units=torch.zeros(num_slots, dtype=torch.int32, device=device),
        launch_order=torch.full(
            (launch_capacity(units, num_slots, num_pools),), -1, dtype=torch.int32, device=device
        ),
        num_slots=num_slots,
        num_groups=num_groups,
        num_pools=num_pools,
    )


@dataclass(frozen=True)
class ScheduleEntry:
    """One segment of the schedule: what one stage-1 program walks, in launch order."""

    program: int  #: the stage-1 program id that walks it (its launch position)
    request: int
    row_group: int  #: rows [row_group * BLOCK_H, ...) of the request's S_q x H
    first_key: int
    end_key: int  #: exclusive; a multiple of PIECE_KEYS (keys past the length are not seen)
    partial: int  #: its partial slot, or -1: the unit's only segment, written directly
    slot: int  #: the resident slot the plan runs it on (after the slot's earlier segments)


@dataclass(frozen=True)
class Schedule:
    """A host view of what stage 1 runs for some lengths (``rocm_mla.plan_schedule``)."""

    entries: tuple[ScheduleEntry, ...]
    num_cus: int  #: compute units (SMs) the target has
    programs_per_cu: int  #: resident stage-1 programs per CU (the compiled kernel's)
    num_slots: int  #: num_cus x programs_per_cu: the slots the packing balances over
    num_groups: int  #: row groups per request
    block_h: int  #: rows per group
    budget_keys: int  #: the packing budget: no slot's cost exceeds it
    num_programs: int = 0  #: the stage-1 grid (programs with no entry have nothing to do)
    num_pools: int = 1  #: slot pools filled apart (AMD: XCDs; ``schedule.py``)
    piece_keys: int = PIECE_KEYS
    overhead_keys: int = OVERHEAD_KEYS

    @property
    def slot_loads(self) -> list[int]:
        """Each slot's cost in the schedule's model (keys walked + one overhead a segment)."""
        loads = [0] * self.num_slots
        for entry in self.entries:
            loads[entry.slot] += entry.end_key - entry.first_key + self.overhead_keys
        return loads

    @property
    def used_slots(self) -> int:
        return len({entry.slot for entry in self.entries})

    @property
    def balanced(self) -> str:
        """One phrase for logs: how the step is scheduled."""
        return f"balanced: {self.used_slots} of {self.num_slots} slots filled"


def schedule_entries(tables: ScheduleTables) -> tuple[ScheduleEntry, ...]:
    """The tables' segments as entries, in launch order (one host read of the tables)."""
    bounds = tables.slot_segments.tolist()
    rows = tables.segments[: bounds[-1]].tolist()
    slot_of = [
        slot for slot in range(tables.num_slots) for _ in range(bounds[slot + 1] - bounds[slot])
    ]
    groups = tables.num_groups
    programs = tables.launch_order.shape[0] if tables.num_programs is None else tables.num_programs
    entries = []
    for program, index in enumerate(tables.launch_order[:programs].tolist()):
        if index >= 0:
            unit, first, end, part = rows[index]
            entries.append(
                ScheduleEntry(
                    program, unit // groups, unit % groups, first, end, part, slot_of[index]
                )
            )
    return tuple(entries)


def list_scheduled_loads(
    entries: Sequence[ScheduleEntry], num_slots: int, num_pools: int, overhead: int
) -> list[int]:
    """Each slot's finish time when the hardware hands ``entries`` out in program order,
    program ``p`` to the earliest free slot of pool ``p % num_pools`` (the model the launch
    order is built for: equal to the plan's slot loads up to which slot is which)."""
    import heapq

    free = [
        [(0, s) for s in range(num_slots) if pool_of(s, num_slots, num_pools) == x]
        for x in range(num_pools)
    ]
    loads = [0] * num_slots
    for entry in entries:
        pool = free[entry.program % num_pools]
        finish, slot = heapq.heappop(pool)
        loads[slot] = finish + entry.end_key - entry.first_key + overhead
        heapq.heappush(pool, (loads[slot], slot))
    return loads
