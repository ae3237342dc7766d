"""The host planner: a schedule's tables from host lengths (``host_schedule``; exact grid and
partial count, and whole units besides: the package docstring, "Whole units"), and the
uniform split of earlier releases as tables (``uniform_schedule``).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from rocm_mla.kernels.schedule.cost import (
    OVERHEAD_KEYS,
    OVERHEAD_PIECES,
    PIECE_KEYS,
    balanced_cost,
    lane_search,
    list_schedule,
    merge_cost,
    pieces_of,
    pool_of,
    uniform_cost,
)
from rocm_mla.kernels.schedule.tables import (
    ScheduleTables,
    check_pools,
    launch_capacity,
    segment_capacity,
)


def launch_order(
    starts: Sequence[tuple[int, int]], num_slots: int, num_pools: int, used_slots: int
) -> list[int]:
    """The segment each stage-1 program walks (or -1), from each segment's planned
    ``(start, slot)``, exactly as the device planner writes it (the package docstring)."""
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


def choose_packing(
    pieces: Sequence[int],
    num_groups: int,
    num_slots: int,
    *,
    whole_units: bool = False,
    num_pools: int = 1,
) -> Packing:
    """The packing of units of ``pieces`` (per request, ``num_groups`` units each) over
    ``num_slots`` slots that the model charges least (the package docstring): the balanced
    width with every unit in the slots, or the uniform split where it fits one wave and
    costs less. Both costs bound what the tables cost in the model, the uniform one being
    exactly what the old split of that count costs in one wave, so the schedule built never
    costs more than any such split. With ``whole_units`` (the host planner; the package
    docstring, "Whole units"), more units than slots may run uncut instead, when that costs
    less in the model (``views.model_cost``, over ``num_pools`` pools) than the balanced packing's
    tables."""
    units = num_groups * len(pieces)
    line = num_groups * sum(OVERHEAD_PIECES + n for n in pieces)
    longest = max(pieces)
    low = max(1, -(-line // num_slots))
    width, cost = lane_search(lambda w: balanced_cost(w, longest), low, max(low, longest))
    packing = Packing(width, 0, width * PIECE_KEYS + OVERHEAD_KEYS, cost)
    if units <= num_slots:
        splits, uniform = lane_search(lambda s: uniform_cost(s, longest), 1, num_slots // units)
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
    programs = ((p, (rows[i][3] - rows[i][2]) * PIECE_KEYS) for p, i in enumerate(order) if i >= 0)
    loads = list_schedule(programs, num_slots, num_pools, OVERHEAD_KEYS)
    return max(loads) + merge_cost(max(row[5] for row in rows))


def _whole_unit_places(
    pieces: Sequence[int], num_groups: int, num_slots: int
) -> list[tuple[int, int]]:
    """Each unit's ``(slot, end)`` when units run whole in unit order, each on the slot that
    frees first (ties: the lowest): list scheduling, as the hardware runs one program per
    unit in that order (the old split's single-split launch)."""
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
    device planner never does (the package docstring, "Whole units")."""
    _, tables = host_plan(
        lengths,
        num_groups=num_groups,
        num_slots=num_slots,
        capacity_keys=capacity_keys,
        num_pools=num_pools,
        device=device,
        whole_units=whole_units,
    )
    return tables


def host_plan(
    lengths: Sequence[int],
    *,
    num_groups: int,
    num_slots: int,
    capacity_keys: int,
    num_pools: int = 1,
    device: torch.device | str = "cpu",
    whole_units: bool = True,
) -> tuple[Packing, ScheduleTables]:
    """``host_schedule``'s tables and the packing they were built from (``choose_packing``'s:
    its budget, its bound on the step's cost), planned once."""
    check_pools(num_pools)
    pieces = [pieces_of(int(length), capacity_keys) for length in lengths]
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
    return packing, ScheduleTables(
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
        n = pieces_of(int(length), capacity_keys)
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
