"""The tables a schedule is (``ScheduleTables``; the package docstring, "Tables"), their
fixed capacities, and the pool counts they allow. ``host`` and ``device`` write them; stage 1,
the merge and ``views`` read them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


def check_pools(num_pools: int) -> None:
    """Refuse a pool count the device planner's sort key cannot hold (``POOL_SHIFT``)."""
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


@dataclass(frozen=True)
class ScheduleTables:
    """A schedule's tables (the package docstring, "Tables") and the grid they were made
    for."""

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
