"""The balanced decode schedule: which keys each resident stage-1 program walks.

A decode step's work is ``units``: one per (request, row group), ``u = b * G + g``, each
``n_u`` pieces of ``PIECE_KEYS`` keys (its length rounded up; clamped to the block table's
capacity, past which stage 1 reads nothing). They are packed into the resident slots
(compute units x programs per CU, ``plan.plan_launch``) as lists of *segments* (a unit's
key range), FlashMLA- and AITER-persistent-style: every slot gets about the same cost, so a
long request is cut across many slots while short ones share one. Stage 1 runs one program
per segment, in an order that makes the GPU's own dispatch run that packing ("Launch
order" below); ``merge_states`` merges the partials of every unit cut into several.

Cost model (``cost``, calibrated on an H200; ``rocm-mla bench schedule`` reports the same):
a segment of ``t`` pieces costs ``t * PIECE_KEYS + OVERHEAD_KEYS`` keys of its slot's time, a
masked piece as much as a full one; a step costs its makespan plus ``MERGE_KEYS`` per partial
of the unit with the most (the merge of a cut unit walks its partials in one program per row).

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

Two planners write the tables: ``host.host_schedule`` from host lengths (exact grid and
partial count; whole units besides) and ``device.device_schedule`` from lengths on the device
(no host read, graph-safe): two launches whatever the batch, ``_plan_schedule_kernel`` (one
program whose every step is a vector over up to ``PLAN_BLOCK`` units, slots or segments:
prefix sums, closed forms and binary searches, no loop over requests) and
``_launch_order_kernel`` (each segment's rank, parallel over segments). Both take the same
integer steps, so they write the same tables (the host's whole-unit candidate aside).

When the result may be reused: a schedule holds for the lengths it was built from (host)
or, built on the device, for the lengths in ``cache_seqlens`` when the planner ran; the
plan's shapes (B, G, S, the page and table capacity) are fixed, the tables are rewritten by
every planner run (once per decode step, before the first MLA layer).

Modules, each importing only from those before it (``tests/test_layering.py`` checks the
order): ``cost`` (the model's constants, its costs with their device twins, the search over
them, list scheduling) <- ``tables`` (``ScheduleTables``, capacities) <- ``host`` (the host
planner, ``uniform_schedule``) and ``device`` (the device planner's kernels and their
launcher) <- ``views`` (``ScheduleEntry``, ``Schedule``, ``model_cost``). This package
re-exports their public names.
"""

from __future__ import annotations

from rocm_mla.kernels.schedule.cost import (
    MAX_KEYS,
    MERGE_KEYS,
    OVERHEAD_KEYS,
    OVERHEAD_PIECES,
    PIECE_KEYS,
    SEARCH_LANES,
    SEARCH_PASSES,
    merge_cost,
    pieces_of,
    pool_of,
)
from rocm_mla.kernels.schedule.device import (
    ORDER_BLOCK,
    PLAN_BLOCK,
    PLAN_WARPS,
    PLANNER_CONSTEXPRS,
    device_schedule,
    empty_tables,
)
from rocm_mla.kernels.schedule.host import (
    Packing,
    choose_packing,
    host_plan,
    host_schedule,
    launch_order,
    uniform_schedule,
)
from rocm_mla.kernels.schedule.tables import (
    MAX_POOLS,
    POOL_SHIFT,
    ScheduleTables,
    launch_capacity,
    partial_capacity,
    segment_capacity,
)
from rocm_mla.kernels.schedule.views import (
    Schedule,
    ScheduleEntry,
    list_scheduled_loads,
    model_cost,
    schedule_entries,
)

__all__ = [
    "MAX_KEYS",
    "MAX_POOLS",
    "MERGE_KEYS",
    "ORDER_BLOCK",
    "OVERHEAD_KEYS",
    "OVERHEAD_PIECES",
    "PIECE_KEYS",
    "PLANNER_CONSTEXPRS",
    "PLAN_BLOCK",
    "PLAN_WARPS",
    "POOL_SHIFT",
    "SEARCH_LANES",
    "SEARCH_PASSES",
    "Packing",
    "Schedule",
    "ScheduleEntry",
    "ScheduleTables",
    "choose_packing",
    "device_schedule",
    "empty_tables",
    "host_plan",
    "host_schedule",
    "launch_capacity",
    "launch_order",
    "list_scheduled_loads",
    "merge_cost",
    "model_cost",
    "partial_capacity",
    "pieces_of",
    "pool_of",
    "schedule_entries",
    "segment_capacity",
    "uniform_schedule",
]
