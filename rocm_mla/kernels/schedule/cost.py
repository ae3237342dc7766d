"""The schedule's cost model, in keys of stage-1 walk (one key on one slot), and the search
both planners run over it.

A decode step's work is units of ``PIECE_KEYS``-key pieces (``pieces_of``: a length rounded
up to pieces, clamped to the block table's capacity; a masked piece costs as much as a full
one). A segment (one stage-1 program) of ``t`` pieces costs ``t * PIECE_KEYS +
OVERHEAD_KEYS`` keys of its slot's time. The hardware hands the programs out in launch order,
each to the earliest-free slot of its pool (``list_schedule``; AMD: program ``p`` to XCD
``p % X``, plan slot ``s`` in pool ``pool_of(s)``). A step costs its makespan plus
``MERGE_KEYS`` per partial of the unit with the most (``merge_cost``: the merge of a cut unit
walks its partials in one program per row). Before any table is built, ``balanced_cost`` and
``uniform_cost`` bound a step's cost under a packing (the package docstring, "Packing");
``lane_search`` finds the packing of least bound.

What a device planner computes has its ``@triton.jit`` twin beside the host function:
``load_pieces`` of ``pieces_of``, ``packing_cost`` of ``balanced_cost`` and
``uniform_cost``, ``lane_search_lanes`` of ``lane_search``. The model is integer, so each
pair computes the same integers: ``tests/test_schedule_cost.py`` runs the twins (under the
Triton interpreter without a GPU) against the host functions and compares them exactly.

A change to the model goes here: the constants, and a cost's host function with its twin
(both planners then charge it); ``benchmarks/schedule.py`` refits the constants
(``--fit``) and ranks schedules by the model; the twin test shows the pair still agrees.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable

import triton
import triton.language as tl

#: Keys per piece: cuts fall on multiples of it. A multiple of every tuned BLOCK_N (16, 32,
#: 64: ``tuned_configs``), so each piece starts a tile and, with pages of 64 or more keys, a
#: page (stage 1's one-block-id-per-tile walk); the cost model's smallest program.
PIECE_KEYS = 64
#: Keys a schedule plans at most (whole pieces below 2^31, so every key offset is an int32).
MAX_KEYS = (2**31 - 1) // PIECE_KEYS * PIECE_KEYS
#: The model's two constants, in whole keys (the model is integer, so host and device agree
#: exactly), from a fit to timings on an NVIDIA H200 by ``benchmarks/schedule_gpu.py``
#: (2026-12-04, the kernels of 4600785; the merge re-derived since, below):
#: ``benchmarks/results/schedule-fit-nvidia-h200-2026-12-04.json`` holds what it timed, and
#: ``rocm-mla bench schedule --fit`` (``benchmarks/schedule.py``'s ``fit``, which imports
#: these) refits them:
#:
#:     time = c0 + c x (stage-1 makespan + merge x the most partials one unit merges)
#:
#: the makespan list-scheduled in launch order over the slots (``list_schedule``) with
#: ``OVERHEAD_KEYS`` per program or segment. Fitted by least absolute deviations over the 44
#: bf16 rows (balanced and uniform, 11 mixes x H16 / H128; c and c0 per shape): c = 0.0408
#: us/key at H16 (memory bound: 3.7 TB/s over 132 slots), 0.0617 at H128; c0 = 11.6 / 13.5
#: us; |residual| median 5.8 us, mean 12.4, worst 122 (H16 batch of 1 balanced, 193 us,
#: whose tables equal its uniform row's, 79 us: the timing's own spread, host launch time
#: leaking into one un-graphed call). The fit is flat in the overhead (112-256 keys within
#: 0.5 us of the best mean |residual|; 192 is the best, and three whole pieces, which the
#: planner's line packing charges exactly) and sharper in the merge (8; 6-10 within 0.5 us).
#: Every user charges these: both planners, ``rocm-mla bench schedule`` (its model and
#: bounds) and ``plan.choose_num_kv_splits``.
#:
#: What one more program or segment costs: its prologue (q rows, the block table scan) and
#: the fp32 partial it writes.
OVERHEAD_KEYS = 192
#: What merging one more partial of a cut unit costs: the merge runs one program per row
#: of a cut unit, so its time follows the unit with the most partials. The fit above gives
#: 8 keys (6-10) for the merge it timed (4600785's: per 4 partials, 5 loads each waiting on
#: the one before, so 0.26 us a load at H16). The merge now (``merge_states._merge_rows``)
#: waits on one load per 16 partials and moves 2 KB per partial and row: 0.26 / 16 us plus
#: 2 KB at an assumed 60 GB/s a program, 0.05 us or 1.2 keys, rounded up to 2. A derived
#: figure, not a measured one, until a GPU run times a merge of N partials and refits it.
MERGE_KEYS = 2
#: What a unit's start takes on the line: the overhead in whole pieces (rounded up, so a slot
#: never costs more than its budget).
OVERHEAD_PIECES = max(1, -(-OVERHEAD_KEYS // PIECE_KEYS))
#: The width and split searches: candidates tried side by side per pass (the device
#: planner's lanes), and passes (enough for any width below 2^31 pieces: each pass narrows
#: the range ~31-fold, and the last one steps by 1).
SEARCH_LANES = 64
SEARCH_PASSES = 8


def pieces_of(length: int, capacity_keys: int) -> int:
    """The pieces a unit of ``length`` keys walks: its keys up to ``capacity_keys`` (the
    block table's; stage 1 reads nothing past it) and ``MAX_KEYS``, rounded up to pieces; a
    negative length walks none."""
    return -(-min(max(length, 0), capacity_keys, MAX_KEYS) // PIECE_KEYS)


@triton.jit
def load_pieces(seqlens_ptr, b, mask, capacity_keys, PIECE: tl.constexpr):
    """``pieces_of`` of the lengths at ``seqlens_ptr + b`` (0 where ``mask`` is off);
    ``capacity_keys`` comes clamped to ``MAX_KEYS`` (``device_schedule``)."""
    length = tl.load(seqlens_ptr + b, mask=mask, other=0).to(tl.int64)
    length = tl.minimum(tl.maximum(length, 0), capacity_keys)
    return (length + PIECE - 1) // PIECE


def merge_cost(chain: int, merge_keys: int = MERGE_KEYS) -> int:
    """The model's cost of the merge when a unit has the most partials, ``chain`` (a unit in
    one segment merges nothing), at ``merge_keys`` a partial (another value: the fit)."""
    return merge_keys * chain if chain > 1 else 0


def chain_bound(longest: int, width: int) -> int:
    """The most segments a unit of ``longest`` pieces takes in slots ``width`` pieces wide,
    at the worst offset on the line."""
    return 1 if longest <= 1 else (longest + width - 2) // width + 1


def balanced_cost(width: int, longest: int) -> int:
    """The model's bound on a step packed on the line in slots ``width`` pieces wide, its
    longest unit ``longest`` pieces: the budget plus the longest merge."""
    return width * PIECE_KEYS + OVERHEAD_KEYS + merge_cost(chain_bound(longest, width))


def uniform_cost(splits: int, longest: int) -> int:
    """The model's cost of the uniform split into ``splits`` segments a unit, one slot each
    (one wave), its longest unit ``longest`` pieces."""
    return -(-longest // splits) * PIECE_KEYS + OVERHEAD_KEYS + merge_cost(splits)


@triton.jit
def packing_cost(
    candidate,  # [LANES] int64: widths, or split counts when UNIFORM
    longest,
    UNIFORM: tl.constexpr,
    OVERHEAD: tl.constexpr,
    MERGE: tl.constexpr,
    PIECE: tl.constexpr,
):
    """``balanced_cost`` / ``uniform_cost`` of every lane."""
    if UNIFORM:
        slot = (longest + candidate - 1) // candidate * PIECE
        chain = candidate
    else:
        slot = candidate * PIECE
        chain = tl.where(longest <= 1, 1, (longest + candidate - 2) // candidate + 1)
    return slot + OVERHEAD + tl.where(chain > 1, MERGE * chain, 0)


def lane_search(cost: Callable[[int], int], low: int, high: int) -> tuple[int, int]:
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


@triton.jit
def lane_search_lanes(
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
    """``lane_search`` of ``packing_cost`` with the candidates as vector lanes: (best, its
    cost)."""
    lanes = tl.arange(0, LANES).to(tl.int64)
    best = low
    best_cost = low * 0
    done = low < 0  # False, as a scalar the loop carries
    for _pass in tl.static_range(PASSES):
        if not done:
            step = tl.maximum((high - low + LANES - 2) // (LANES - 1), 1)
            candidate = tl.minimum(low + lanes * step, high)
            cost = packing_cost(candidate, longest, UNIFORM, OVERHEAD, MERGE, PIECE)
            best_cost = tl.min(cost, axis=0)
            # The first lane of least cost: the smallest candidate, as the host's strict <.
            first = tl.min(tl.where(cost == best_cost, lanes, LANES), axis=0)
            best = tl.sum(tl.where(lanes == first, candidate, 0), axis=0)
            done = step == 1
            low = tl.maximum(low, best - step + 1)
            high = tl.minimum(high, best + step - 1)
    return best, best_cost


def pool_of(slot: int, num_slots: int, num_pools: int, used_slots: int | None = None) -> int:
    """The pool (XCD) of plan slot ``slot`` of ``num_slots``: contiguous ranges of slots.
    A plan filling only ``used_slots`` of them spreads those over the ranges (slot ``s``
    where slot ``s * num_slots // used_slots`` would be), so it still reaches every pool and
    no pool gets more of its slots than the pool has."""
    used = num_slots if used_slots is None else used_slots
    return slot * num_slots // used * num_pools // num_slots


def list_schedule(
    programs: Iterable[tuple[int, int]],
    num_slots: int,
    num_pools: int,
    overhead: int = OVERHEAD_KEYS,
) -> list[int]:
    """Each slot's finish time when the hardware hands out ``programs``, ``(program id, keys
    it walks)`` in id order (an id with nothing to do left out), each to the earliest-free
    slot (ties: the lowest) of pool ``id % num_pools``, for ``keys + overhead``."""
    free = [
        [(0, s) for s in range(num_slots) if pool_of(s, num_slots, num_pools) == x]
        for x in range(num_pools)
    ]
    loads = [0] * num_slots
    for program, keys in programs:
        pool = free[program % num_pools]
        finish, slot = heapq.heappop(pool)
        loads[slot] = finish + keys + overhead
        heapq.heappush(pool, (loads[slot], slot))
    return loads
