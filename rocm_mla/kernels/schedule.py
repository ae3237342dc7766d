"""The balanced decode schedule: which keys each resident stage-1 program walks.

A decode step's work is ``units``: one per (request, row group), ``u = b * G + g``, each
``n_u`` pieces of ``PIECE_KEYS`` keys (its length rounded up; clamped to the block table's
capacity, past which stage 1 reads nothing). They are packed into the resident slots
(compute units x programs per CU, ``plan.plan_launch``) as lists of *segments* (a unit's
key range), FlashMLA- and AITER-persistent-style: every slot gets about the same cost, so a
long request is cut across many slots while short ones share one. Stage 1 runs one program
per segment, in an order that makes the GPU's own dispatch run that packing ("Launch
order" below); ``merge_states`` merges the partials of every unit cut into several.

Cost model (``plan.SPLIT_OVERHEAD_TOKENS`` and ``plan.MERGE_TOKENS_PER_PARTIAL``, calibrated
on an H200 there; ``rocm-mla bench schedule`` reports the same): a segment of ``t`` pieces
costs ``t * PIECE_KEYS + OVERHEAD_KEYS`` keys of its slot's time, a masked piece as much as
a full one; a step costs its makespan plus ``MERGE_KEYS`` per partial of the unit with the
most (the merge of a cut unit walks its partials in one program per row).

Packing: the units lie end to end on a *line* of pieces, unit ``u`` at ``X_u = sum over
v < u of (OVERHEAD_PIECES + n_v)``: its prologue (``OVERHEAD_PIECES``, the overhead in whole
pieces) and then its pieces. Slot ``s`` takes the pieces that start in ``[s * W, (s + 1) *
W)`` for a width ``W``; a unit crossing a slot boundary is cut there, and its part in the
next slot pays one more overhead, which the line does not hold. So a slot costs at most
``W * PIECE_KEYS + OVERHEAD_KEYS`` (the budget), and everything about a unit (its slots,
segments and partials) follows from prefix sums over the units before it: the planner is
parallel over units, on the host and on the device alike. ``W`` is chosen by the model
(``choose_packing``): the least with all units in ``S`` slots, unless a wider one saves
more merge than it costs (one long request: fewer, longer segments); and when a uniform
split (every unit in at most ``splits`` equal segments, one slot each: one wave of programs)
is cheaper in the model, the step runs that instead, so no step costs more than the uniform
split of earlier releases wherever that ran in one wave (where it ran in several, whole
units list-scheduled can beat any cut by a merge of two: ``rocm-mla bench schedule`` shows
by how much). A slot narrower than a prologue may hold no segment (the next one starts it).

Whole units (``host_schedule`` only). With more units than slots the old split ran every
unit whole, one program each in unit order, and the hardware list-scheduled them; where the
units are short next to the overhead (a DCP rank's share of many short requests), that
leaves less idle than the line, which pays an overhead and a merge for every cut. The host
planner simulates that list scheduling (a heap over the slots: sequential, so the device
planner cannot) and runs the units whole, on the slots the simulation gave them, when that
costs less in the model (``model_cost``) than the balanced packing's tables. So a
host-planned step never costs more than the old split (its whole-unit launch), nor than the
device planner's tables for the same lengths, which equal ``host_schedule(...,
whole_units=False)``.

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
On AMD the slots are ``X`` pools, the XCDs (workgroup ``p`` goes to XCD ``p % X``): slot
``s`` belongs to pool ``s * X // S`` (neighbouring slots, hence neighbouring units, on one
L2), and a plan that fills only ``used`` slots spreads them as slots ``s * S // used``
(``pool_of``: it still reaches every XCD, and no pool gets more slots than it has),
each pool's segments are sorted by start, and pool ``x``'s ``k``-th sits at position ``k * X
+ x``; a pool with fewer segments leaves ``-1`` programs at its end. With one pool (NVIDIA,
the interpreter) the order is one sorted list. ``X`` is the config's ``num_xcds``.

A slot boundary cuts at most one unit, so at most ``S - 1`` units are cut, into at most
``2 * (S - 1)`` partials (``partial_capacity``), and at most ``B * G + S - 1`` segments exist;
the uniform split is a candidate only when its ``B * G * splits`` segments fit one per slot.

Two planners write the tables: ``host_schedule`` from host lengths (exact grid and partial
count; whole units besides) and ``device_schedule`` from lengths on the device (no host
read, graph-safe): two launches whatever the batch, ``_plan_schedule_kernel`` (one program
whose every step is a vector over up to ``PLAN_BLOCK`` units, slots or segments: prefix
sums, closed forms and binary searches, no loop over requests) and ``_launch_order_kernel``
(each segment's rank, parallel over segments). Both take the same integer steps, so they
write the same tables (the host's whole-unit candidate aside).

When the result may be reused: a schedule holds for the lengths it was built from (host)
or, built on the device, for the lengths in ``cache_seqlens`` when the planner ran; the
plan's shapes (B, G, S, the page and table capacity) are fixed, the tables are rewritten by
every planner run (once per decode step, before the first MLA layer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from rocm_mla.kernels.plan import MERGE_TOKENS_PER_PARTIAL, SPLIT_OVERHEAD_TOKENS

#: Keys per piece: cuts fall on multiples of it. A multiple of every tuned BLOCK_N (16, 32,
#: 64: ``tuned_configs``), so each piece starts a tile and, with pages of 64 or more keys, a
#: page (stage 1's one-block-id-per-tile walk); the cost model's smallest program.
PIECE_KEYS = 64
#: Keys a schedule plans at most (whole pieces below 2^31, so every key offset is an int32).
MAX_KEYS = (2**31 - 1) // PIECE_KEYS * PIECE_KEYS
#: The overhead and the merge's cost per partial in whole keys (the model is integer, so host
#: and device agree exactly).
OVERHEAD_KEYS = round(SPLIT_OVERHEAD_TOKENS)
MERGE_KEYS = round(MERGE_TOKENS_PER_PARTIAL)
#: What a unit's start takes on the line: the overhead in whole pieces (rounded up, so a slot
#: never costs more than its budget).
OVERHEAD_PIECES = max(1, -(-OVERHEAD_KEYS // PIECE_KEYS))
#: The width and split searches: candidates tried side by side per pass (the device
#: planner's lanes), and passes (enough for any width below 2^31 pieces: each pass narrows
#: the range ~31-fold, and the last one steps by 1).
SEARCH_LANES = 64
SEARCH_PASSES = 8
#: Units, slots or segments per vector step of the device planner (a batch of 128 requests
#: of two row groups takes one step), and its warps: at 4, ptxas spills the sm90 build (16
#: bytes at 80 registers); at 8 with 512-wide steps Triton 3.8's sm90 build of a batch not
#: a multiple of 16 spills 4 bytes (80 registers); 256-wide steps spill in no build.
PLAN_BLOCK = 256
PLAN_WARPS = 8
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


def pool_of(slot: int, num_slots: int, num_pools: int, used_slots: int | None = None) -> int:
    """The pool (XCD) of plan slot ``slot`` of ``num_slots``: contiguous ranges of slots.
    A plan filling only ``used_slots`` of them spreads those over the ranges (slot ``s``
    where slot ``s * num_slots // used_slots`` would be), so it still reaches every pool and
    no pool gets more of its slots than the pool has."""
    used = num_slots if used_slots is None else used_slots
    return slot * num_slots // used * num_pools // num_slots


def launch_order(
    starts: Sequence[tuple[int, int]], num_slots: int, num_pools: int, used_slots: int
) -> list[int]:
    """The segment each stage-1 program walks (or -1), from each segment's planned
    ``(start, slot)``, exactly as the device planner writes it (module docstring)."""
    pools: list[list[tuple[int, int, int]]] = [[] for _ in range(num_pools)]
    for index, (start, slot) in enumerate(starts):
        pools[pool_of(slot, num_slots, num_pools, used_slots)].append((start, slot, index))
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


@dataclass(frozen=True)
class Packing:
    """How a step is packed (``choose_packing``): the balanced line packing of slots
    ``width`` pieces wide, or (``splits`` > 0) the uniform split into ``splits`` segments a
    unit, one slot each."""

    width: int  #: the balanced packing's slot width in pieces of line; 0 for the uniform split
    splits: int  #: the uniform split's segments per unit; 0 for the balanced packing
    budget: int  #: keys: no slot's planned cost exceeds it
    cost: int  #: the model's bound on the step: the budget plus the longest merge
    #: Whole units, list-scheduled in unit order (``host_schedule`` only: width and splits 0)
    whole: bool = False
    #: The segments ``choose_packing`` built to cost the step, where it built them (whole
    #: units weighed against the line): ``host_schedule`` builds its tables from them
    rows: tuple[tuple[int, int, int, int, int, int], ...] = field(
        default=(), compare=False, repr=False
    )


def _chain_bound(longest: int, width: int) -> int:
    """The most segments a unit of ``longest`` pieces takes in slots ``width`` pieces wide,
    at the worst offset on the line."""
    return 1 if longest <= 1 else (longest + width - 2) // width + 1


def merge_cost(chain: int) -> int:
    """The model's cost of the merge when a unit has the most partials, ``chain`` (a unit in
    one segment merges nothing)."""
    return MERGE_KEYS * chain if chain > 1 else 0


def _balanced_cost(width: int, longest: int) -> int:
    return width * PIECE_KEYS + OVERHEAD_KEYS + merge_cost(_chain_bound(longest, width))


def _uniform_cost(splits: int, longest: int) -> int:
    return -(-longest // splits) * PIECE_KEYS + OVERHEAD_KEYS + merge_cost(splits)


def _lane_search(cost: Callable[[int], int], low: int, high: int) -> tuple[int, int]:
    """The candidate of least ``cost`` in ``[low, high]`` (ties: the smallest) as the device
    planner finds it: ``SEARCH_LANES`` evenly spaced candidates a pass, then the gap around
    the best, until the candidates are 1 apart."""
    for _ in range(SEARCH_PASSES):
        step = max(1, -(-(high - low) // (SEARCH_LANES - 1)))
        best, best_cost = low, cost(low)
        for lane in range(1, SEARCH_LANES):
            candidate = min(low + lane * step, high)
            if cost(candidate) < best_cost:
                best, best_cost = candidate, cost(candidate)
        if step == 1:
            break
        low, high = max(low, best - step + 1), min(high, best + step - 1)
    return best, best_cost


def choose_packing(
    pieces: Sequence[int],
    num_groups: int,
    num_slots: int,
    *,
    whole_units: bool = False,
    num_pools: int = 1,
) -> Packing:
    """The packing of units of ``pieces`` (per request, ``num_groups`` units each) over
    ``num_slots`` slots that the model charges least (module docstring): the balanced
    width with every unit in the slots, or the uniform split where it fits one wave and
    costs less. Both costs bound what the tables cost in the model, the uniform one being
    exactly what the old split of that count costs in one wave, so the schedule built never
    costs more than any such split. With ``whole_units`` (the host planner; module
    docstring, "Whole units"), more units than slots may run uncut instead, when that costs
    less in the model (``model_cost``, over ``num_pools`` pools) than the balanced packing's
    tables."""
    units = num_groups * len(pieces)
    line = num_groups * sum(OVERHEAD_PIECES + n for n in pieces)
    longest = max(pieces)
    low = max(1, -(-line // num_slots))
    width, cost = _lane_search(lambda w: _balanced_cost(w, longest), low, max(low, longest))
    packing = Packing(width, 0, width * PIECE_KEYS + OVERHEAD_KEYS, cost)
    if units <= num_slots:
        splits, uniform = _lane_search(lambda s: _uniform_cost(s, longest), 1, num_slots // units)
        if uniform < cost:
            budget = -(-longest // splits) * PIECE_KEYS + OVERHEAD_KEYS
            packing = Packing(0, splits, budget, uniform)
    elif whole_units:
        line_rows = tuple(_line_segments(pieces, num_groups, width))
        packing = Packing(width, 0, packing.budget, packing.cost, rows=line_rows)
        rows, makespan = _whole_unit_segments(pieces, num_groups, num_slots)
        whole = _model_cost(rows, num_slots, num_pools)
        if whole < _model_cost(line_rows, num_slots, num_pools):
            packing = Packing(0, 0, makespan, whole, whole=True, rows=tuple(rows))
    return packing


def _starts(rows: Sequence[tuple[int, int, int, int, int, int]]) -> list[tuple[int, int]]:
    """Each segment's planned ``(start, slot)``: its slot's segments back to back, in order."""
    load: dict[int, int] = {}
    starts = []
    for _unit, _k, a, b, slot, _count in rows:
        starts.append((load.get(slot, 0), slot))
        load[slot] = load.get(slot, 0) + OVERHEAD_KEYS + (b - a) * PIECE_KEYS
    return starts


def _model_cost(
    rows: Sequence[tuple[int, int, int, int, int, int]], num_slots: int, num_pools: int
) -> int:
    """``model_cost`` of the tables ``host_schedule`` builds from ``rows`` (segments by slot,
    as ``_line_segments`` gives them), without building them."""
    order = launch_order(_starts(rows), num_slots, num_pools, rows[-1][4] + 1)
    entries = [
        ScheduleEntry(p, 0, 0, rows[i][2] * PIECE_KEYS, rows[i][3] * PIECE_KEYS, -1, rows[i][4])
        for p, i in enumerate(order)
        if i >= 0
    ]
    loads = list_scheduled_loads(entries, num_slots, num_pools, OVERHEAD_KEYS)
    return max(loads) + merge_cost(max(row[5] for row in rows))


def _whole_unit_places(
    pieces: Sequence[int], num_groups: int, num_slots: int
) -> list[tuple[int, int]]:
    """Each unit's ``(slot, end)`` when units run whole in unit order, each on the slot that
    frees first (ties: the lowest): list scheduling, as the hardware runs one program per
    unit in that order (the old split's single-split launch)."""
    import heapq

    free = [(0, s) for s in range(num_slots)]
    places = []
    for u in range(num_groups * len(pieces)):
        start, slot = heapq.heappop(free)
        end = start + OVERHEAD_KEYS + pieces[u // num_groups] * PIECE_KEYS
        places.append((slot, end))
        heapq.heappush(free, (end, slot))
    return places


def _whole_unit_segments(
    pieces: Sequence[int], num_groups: int, num_slots: int
) -> tuple[list[tuple[int, int, int, int, int, int]], int]:
    """Whole units as ``_line_segments`` gives segments, by slot and then start, and the
    makespan of their list scheduling."""
    rows = []
    for u, (slot, end) in enumerate(_whole_unit_places(pieces, num_groups, num_slots)):
        n = pieces[u // num_groups]
        rows.append((slot, end, (u, 0, 0, n, slot, 1)))
    return [row for *_, row in sorted(rows)], max(end for _, end, _ in rows)


def search_budget(
    pieces: Sequence[int],
    num_groups: int,
    num_slots: int,
    *,
    whole_units: bool = True,
    num_pools: int = 1,
) -> int:
    """The packing budget (keys of cost per slot) ``host_schedule`` plans these units under."""
    packing = choose_packing(
        pieces, num_groups, num_slots, whole_units=whole_units, num_pools=num_pools
    )
    return packing.budget


def _line_segments(
    pieces: Sequence[int], num_groups: int, width: int
) -> list[tuple[int, int, int, int, int, int]]:
    """``(unit, k, first piece, end piece, slot, count)`` of every segment of the line
    packing ``width`` pieces wide, in unit order (the unit's ``k``-th of ``count``)."""
    out = []
    start = 0  # the unit's place on the line
    for u in range(num_groups * len(pieces)):
        n = pieces[u // num_groups]
        first = start + OVERHEAD_PIECES  # its first piece's place
        if n == 0:
            # An empty unit is its prologue: the slot where that ends.
            out.append((u, 0, 0, 0, (first - 1) // width, 1))
        else:
            low, high = first // width, (first + n - 1) // width
            for slot in range(low, high + 1):
                a = max(0, slot * width - first)
                b = min(n, (slot + 1) * width - first)
                out.append((u, slot - low, a, b, slot, high - low + 1))
        start = first + n
    return out


def _split_chunk(n: int, splits: int) -> int:
    """The chunk, in pieces, of a unit of ``n`` pieces in the uniform split: ``n`` in at most
    ``splits`` equal chunks, none empty."""
    return -(-n // min(splits, max(n, 1)))


def _split_segments(
    pieces: Sequence[int], num_groups: int, splits: int
) -> list[tuple[int, int, int, int, int, int]]:
    """The uniform split as ``_line_segments`` gives segments: every unit in at most
    ``splits`` chunks of ``ceil(n / splits)`` pieces (a shorter unit one piece a chunk, an
    empty one whole), one slot each, in unit order."""
    out = []
    for u in range(num_groups * len(pieces)):
        n = pieces[u // num_groups]
        chunk = max(1, _split_chunk(n, splits))
        count = max(1, -(-n // chunk))
        for k in range(count):
            out.append((u, k, k * chunk, min((k + 1) * chunk, n), len(out), count))
    return out


def host_schedule(
    lengths: Sequence[int],
    *,
    num_groups: int,
    num_slots: int,
    capacity_keys: int,
    num_pools: int = 1,
    device: torch.device | str = "cpu",
    whole_units: bool = True,
) -> ScheduleTables:
    """The schedule of ``lengths`` (host ints), as the device planner would build it; with
    ``whole_units`` (the default) it may also run more units than slots uncut, which the
    device planner never does (module docstring, "Whole units")."""
    _check_pools(num_pools)
    pieces = [_pieces(int(length), capacity_keys) for length in lengths]
    units = len(pieces) * num_groups
    packing = choose_packing(
        pieces, num_groups, num_slots, whole_units=whole_units, num_pools=num_pools
    )
    if packing.rows:
        rows = list(packing.rows)
    elif packing.splits:
        rows = _split_segments(pieces, num_groups, packing.splits)
    else:
        rows = _line_segments(pieces, num_groups, packing.width)
    used = rows[-1][4] + 1
    slot_segments = [0] * (num_slots + 1)
    segments: list[tuple[int, int, int, int]] = []
    unit_parts = [(-1, 1)] * units
    split_units = [-1] * num_slots
    starts: list[tuple[int, int]] = []  # each segment's planned (start, slot)
    partials, cut, slot, load = 0, 0, -1, 0
    for unit, k, a, b, s, count in rows:
        if s != slot:
            # Slots inside a prologue wider than the slots stay empty: they begin where the
            # next one does.
            slot_segments[slot + 1 : s + 1] = [len(segments)] * (s - slot)
            slot, load = s, 0
        if count > 1 and unit_parts[unit][0] < 0:
            # A unit's partials are consecutive whatever order its segments come in.
            unit_parts[unit] = (partials, count)
            split_units[cut] = unit
            partials, cut = partials + count, cut + 1
        part = unit_parts[unit][0] + k if count > 1 else -1
        segments.append((unit, a * PIECE_KEYS, b * PIECE_KEYS, part))
        starts.append((load, s))
        load += OVERHEAD_KEYS + (b - a) * PIECE_KEYS
    for s in range(used, num_slots + 1):
        slot_segments[s] = len(segments)
    seg_table = torch.zeros(segment_capacity(units, num_slots), 4, dtype=torch.int32)
    seg_table[: len(segments)] = torch.tensor(segments, dtype=torch.int32).view(-1, 4)
    order = launch_order(starts, num_slots, num_pools, used)
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
        used_slots=used,
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
def _pieces_of(seqlens_ptr, b, mask, capacity_keys, PIECE: tl.constexpr):
    length = tl.load(seqlens_ptr + b, mask=mask, other=0).to(tl.int64)
    length = tl.minimum(tl.maximum(length, 0), capacity_keys)
    return (length + PIECE - 1) // PIECE


@triton.jit
def _packing_cost(
    candidate,  # [LANES] int64: widths, or split counts when UNIFORM
    longest,
    UNIFORM: tl.constexpr,
    OVERHEAD: tl.constexpr,
    MERGE: tl.constexpr,
    PIECE: tl.constexpr,
):
    """``_balanced_cost`` / ``_uniform_cost`` of every lane."""
    if UNIFORM:
        slot = (longest + candidate - 1) // candidate * PIECE
        chain = candidate
    else:
        slot = candidate * PIECE
        chain = tl.where(longest <= 1, 1, (longest + candidate - 2) // candidate + 1)
    return slot + OVERHEAD + tl.where(chain > 1, MERGE * chain, 0)


@triton.jit
def _lane_search_lanes(
    low,
    high,
    longest,
    UNIFORM: tl.constexpr,
    OVERHEAD: tl.constexpr,
    MERGE: tl.constexpr,
    PIECE: tl.constexpr,
    LANES: tl.constexpr,
    PASSES: tl.constexpr,
):
    """The host's ``_lane_search`` with the candidates as vector lanes: (best, its cost)."""
    lanes = tl.arange(0, LANES).to(tl.int64)
    best = low
    best_cost = low * 0
    done = low < 0  # False, as a scalar the loop carries
    for _pass in tl.static_range(PASSES):
        if not done:
            step = tl.maximum((high - low + LANES - 2) // (LANES - 1), 1)
            candidate = tl.minimum(low + lanes * step, high)
            cost = _packing_cost(candidate, longest, UNIFORM, OVERHEAD, MERGE, PIECE)
            best_cost = tl.min(cost, axis=0)
            # The first lane of least cost: the smallest candidate, as the host's strict <.
            first = tl.min(tl.where(cost == best_cost, lanes, LANES), axis=0)
            best = tl.sum(tl.where(lanes == first, candidate, 0), axis=0)
            done = step == 1
            low = tl.maximum(low, best - step + 1)
            high = tl.minimum(high, best + step - 1)
    return best, best_cost


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
    """``_split_chunk`` of every lane."""
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
    """``host_schedule`` on the device, one program (module docstring): the step's totals,
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
        n = _pieces_of(seqlens_ptr, b, b < batch, capacity_keys, PIECE)
        line_total += tl.where(b < batch, LINE_OVERHEAD + n, 0)
        longest = tl.maximum(longest, n)
    line_total = tl.sum(line_total, axis=0) * num_groups
    longest = tl.max(longest, axis=0)

    # The packing (choose_packing).
    low = tl.maximum(1, (line_total + num_slots - 1) // num_slots)
    width, cost = _lane_search_lanes(
        low, tl.maximum(low, longest), longest, False, OVERHEAD, MERGE, PIECE, LANES, PASSES
    )
    splits = width * 0
    if units <= num_slots:
        most = tl.cast(num_slots // units, tl.int64)
        best, uniform_cost = _lane_search_lanes(
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
        n = _pieces_of(seqlens_ptr, u // num_groups, valid, capacity_keys, PIECE)
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
            n = _pieces_of(seqlens_ptr, w // num_groups, live, capacity_keys, PIECE)
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
        n = _pieces_of(seqlens_ptr, unit // num_groups, valid, capacity_keys, PIECE)
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


#: ``_plan_schedule_kernel``'s constexprs: the model and search constants above.
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
    two launches whatever the batch (module docstring)."""
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
    _check_pools(num_pools)
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


def model_cost(tables: ScheduleTables, num_slots: int | None = None) -> int:
    """What running ``tables`` costs in the model (module docstring), in keys: stage 1
    list-scheduled in launch order onto ``num_slots`` slots (by default the tables'; program
    ``p`` to the earliest-free slot of pool ``p % X``), then the merge of the unit with the
    most partials. ``rocm-mla bench schedule`` ranks every schedule by it."""
    slots = tables.num_slots if num_slots is None else num_slots
    loads = list_scheduled_loads(schedule_entries(tables), slots, tables.num_pools, OVERHEAD_KEYS)
    chain = max(count for _, count in tables.unit_parts.tolist())
    return max(loads) + merge_cost(chain)
