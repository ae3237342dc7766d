"""Host views of a schedule's tables: its segments as entries in launch order
(``schedule_entries``, ``ScheduleEntry``), the step's view for users and tools (``Schedule``,
what ``rocm_mla.plan_schedule`` returns), and what the tables cost in the model
(``model_cost``, ``list_scheduled_loads``: ``cost``'s list scheduling of the entries).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rocm_mla.kernels.schedule.cost import OVERHEAD_KEYS, PIECE_KEYS, list_schedule, merge_cost
from rocm_mla.kernels.schedule.tables import ScheduleTables


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
    num_pools: int = 1  #: slot pools filled apart (AMD: XCDs; ``cost.pool_of``)
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
    programs = ((entry.program, entry.end_key - entry.first_key) for entry in entries)
    return list_schedule(programs, num_slots, num_pools, overhead)


def model_cost(tables: ScheduleTables, num_slots: int | None = None) -> int:
    """What running ``tables`` costs in the model (``cost``), in keys: stage 1
    list-scheduled in launch order onto ``num_slots`` slots (by default the tables'; program
    ``p`` to the earliest-free slot of pool ``p % X``), then the merge of the unit with the
    most partials. ``rocm-mla bench schedule`` ranks every schedule by it."""
    slots = tables.num_slots if num_slots is None else num_slots
    loads = list_scheduled_loads(schedule_entries(tables), slots, tables.num_pools, OVERHEAD_KEYS)
    chain = max(count for _, count in tables.unit_parts.tolist())
    return max(loads) + merge_cost(chain)
