"""The schedule's cost model (``rocm_mla/kernels/schedule/cost.py``): every ``@triton.jit``
twin computes what its host function does. The model is integer (keys and pieces, int64 on
the device), so the twins are compared exactly, on grids of inputs that hold the edge cases
(empty and one-piece units, a width or split count of 1, the widest key range a schedule
plans); without a GPU they run under the Triton interpreter."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

pytest.importorskip("triton")

import triton
import triton.language as tl

from rocm_mla.kernels.schedule import cost, device
from rocm_mla.kernels.schedule.cost import lane_search_lanes, load_pieces, packing_cost
from rocm_mla.kernels.target import triton_target

if triton_target() is None:
    pytest.skip("no Triton target (GPU or TRITON_INTERPRET=1)", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 64
#: The model's constants as the device planner gets them.
MODEL = {"OVERHEAD": cost.OVERHEAD_KEYS, "MERGE": cost.MERGE_KEYS, "PIECE": cost.PIECE_KEYS}
#: The most pieces a unit has (``MAX_KEYS``), and a width far past any step's line.
MAX_PIECES = cost.MAX_KEYS // cost.PIECE_KEYS
WIDE = 1 << 40


@triton.jit
def _pieces_kernel(
    seqlens_ptr, out_ptr, n, capacity_keys, PIECE: tl.constexpr, BLOCK: tl.constexpr
):
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    # As _plan_schedule_kernel passes it.
    capacity_keys = tl.cast(capacity_keys, tl.int64)
    tl.store(out_ptr + b, load_pieces(seqlens_ptr, b, b < n, capacity_keys, PIECE), mask=b < n)


@triton.jit
def _cost_kernel(
    candidates_ptr,
    longest_ptr,
    out_ptr,
    n,
    UNIFORM: tl.constexpr,
    OVERHEAD: tl.constexpr,
    MERGE: tl.constexpr,
    PIECE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    candidate = tl.load(candidates_ptr + i, mask=i < n, other=1)
    longest = tl.load(longest_ptr + i, mask=i < n, other=0)
    out = packing_cost(candidate, longest, UNIFORM, OVERHEAD, MERGE, PIECE)
    tl.store(out_ptr + i, out, mask=i < n)


@triton.jit
def _search_kernel(
    low_ptr,
    high_ptr,
    longest_ptr,
    best_ptr,
    cost_ptr,
    UNIFORM: tl.constexpr,
    OVERHEAD: tl.constexpr,
    MERGE: tl.constexpr,
    PIECE: tl.constexpr,
    LANES: tl.constexpr,
    PASSES: tl.constexpr,
):
    i = tl.program_id(0)
    best, best_cost = lane_search_lanes(
        tl.load(low_ptr + i),
        tl.load(high_ptr + i),
        tl.load(longest_ptr + i),
        UNIFORM,
        OVERHEAD,
        MERGE,
        PIECE,
        LANES,
        PASSES,
    )
    tl.store(best_ptr + i, best)
    tl.store(cost_ptr + i, best_cost)


def _int64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


def test_the_device_planner_runs_this_model():
    """The constants ``_plan_schedule_kernel`` gets are the ones the host charges."""
    assert {k: device.PLANNER_CONSTEXPRS[k] for k in MODEL} == MODEL
    assert device.PLANNER_CONSTEXPRS["LINE_OVERHEAD"] == cost.OVERHEAD_PIECES
    assert device.PLANNER_CONSTEXPRS["LANES"] == cost.SEARCH_LANES
    assert device.PLANNER_CONSTEXPRS["PASSES"] == cost.SEARCH_PASSES


@pytest.mark.parametrize("capacity", [64, 640, 1000, cost.MAX_KEYS, 1 << 40])
def test_load_pieces_is_pieces_of(capacity):
    """Lengths around every piece and capacity boundary, negative ones and the int32 ends;
    the device gets the capacity clamped to ``MAX_KEYS``, as ``device_schedule`` passes it."""
    near = [0, 1, 63, 64, 65, 127, 128, 129, 4096, capacity - 1, capacity, capacity + 1]
    lengths = sorted(
        {v for v in [-(2**31), -65, -1, *near, cost.MAX_KEYS, 2**31 - 1] if -(2**31) <= v < 2**31}
    )
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    out = torch.full((len(lengths),), -1, dtype=torch.int64, device=DEVICE)
    grid = (triton.cdiv(len(lengths), BLOCK),)
    clamped = min(capacity, cost.MAX_KEYS)
    _pieces_kernel[grid](seqlens, out, len(lengths), clamped, PIECE=cost.PIECE_KEYS, BLOCK=BLOCK)
    assert out.tolist() == [cost.pieces_of(v, capacity) for v in lengths]


def _cost_cases(uniform: bool) -> list[tuple[int, int]]:
    """(candidate, longest): small ones exhaustively, then the large and the extreme."""
    longest = [0, 1, 2, 3, 4, 5, 63, 64, 65, 1000, MAX_PIECES - 1, MAX_PIECES]
    small = list(itertools.product(range(1, 40), range(0, 40)))
    if uniform:
        # A split count is at most the slots over the units.
        counts = [1, 2, 3, 7, 8, 64, 127, 128, 607, 608, 1 << 16]
    else:
        counts = [1, 2, 3, 4, 63, 64, 65, 4096, MAX_PIECES - 1, MAX_PIECES, WIDE]
    rng = random.Random(41)
    drawn = [(rng.randint(1, 1 << 20), rng.randint(0, 1 << 20)) for _ in range(500)]
    return small + list(itertools.product(counts, longest)) + drawn


@pytest.mark.parametrize("uniform", [False, True], ids=["balanced", "uniform"])
def test_packing_cost_is_the_host_cost(uniform):
    cases = _cost_cases(uniform)
    candidates, longest = zip(*cases, strict=True)
    out = torch.full((len(cases),), -1, dtype=torch.int64, device=DEVICE)
    _cost_kernel[(triton.cdiv(len(cases), BLOCK),)](
        _int64(candidates), _int64(longest), out, len(cases), UNIFORM=uniform, **MODEL, BLOCK=BLOCK
    )
    host = cost.uniform_cost if uniform else cost.balanced_cost
    expected = [host(c, n) for c, n in cases]
    got = out.tolist()
    mismatched = [(c, g, e) for c, g, e in zip(cases, got, expected, strict=True) if g != e]
    assert not mismatched, f"(candidate, longest), device, host: {mismatched[:10]}"


def _search_cases(uniform: bool) -> list[tuple[int, int, int]]:
    """(low, high, longest) as ``choose_packing`` searches them: the balanced width from the
    line's share of the slots up to the longest unit, the split count from 1 up to the slots
    over the units."""
    rng = random.Random(7)
    cases = []
    longest = [0, 1, 2, 3, 64, 65, 100, 512, 4096, 1 << 20, MAX_PIECES]
    if uniform:
        for n, most in itertools.product(longest, [1, 2, 3, 63, 64, 65, 304, 608, 1 << 12]):
            cases.append((1, most, n))
        cases += [(1, rng.randint(1, 2000), rng.randint(0, 1 << 16)) for _ in range(20)]
    else:
        for n, low in itertools.product(longest, [1, 2, 3, 64, 65, 1000, 1 << 20, WIDE]):
            cases.append((low, max(low, n), n))
        for _ in range(20):
            n = rng.randint(0, 1 << 16)
            low = rng.randint(1, n + 1)
            cases.append((low, max(low, n), n))
    return cases


@pytest.mark.parametrize("uniform", [False, True], ids=["balanced", "uniform"])
def test_lane_search_lanes_is_the_host_search(uniform):
    cases = _search_cases(uniform)
    low, high, longest = (_int64(column) for column in zip(*cases, strict=True))
    best = torch.full((len(cases),), -1, dtype=torch.int64, device=DEVICE)
    best_cost = torch.full((len(cases),), -1, dtype=torch.int64, device=DEVICE)
    _search_kernel[(len(cases),)](
        low,
        high,
        longest,
        best,
        best_cost,
        UNIFORM=uniform,
        **MODEL,
        LANES=cost.SEARCH_LANES,
        PASSES=cost.SEARCH_PASSES,
    )
    host = cost.uniform_cost if uniform else cost.balanced_cost
    expected = [cost.lane_search(lambda c, n=n: host(c, n), a, b) for a, b, n in cases]
    got = list(zip(best.tolist(), best_cost.tolist(), strict=True))
    mismatched = [(case, g, e) for case, g, e in zip(cases, got, expected, strict=True) if g != e]
    assert not mismatched, f"(low, high, longest), device, host: {mismatched[:10]}"
