"""The balanced schedule (rocm_mla/kernels/schedule/): its invariants, the launch order that makes
list scheduling run the packing, and the device planner (run under the Triton interpreter)
writing exactly the host planner's tables."""

from __future__ import annotations

import random
import sys

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from rocm_mla.kernels import schedule as sch
from rocm_mla.kernels.plan import choose_num_kv_splits
from rocm_mla.kernels.schedule import cost, device
from rocm_mla.kernels.target import triton_target

BIG = 1 << 30

#: The bench's mixes, shrunk: lengths that cross pieces, pages and slots.
MIXES = {
    "uniform": [4096] * 4,
    "one long, many short": [8192] + [256] * 7,
    "zeros": [0, 0, 640, 0, 100, 0, 2048, 0],
    "one request": [3000],
    "lengths 0 and 1": [0, 1],
    "boundaries": [63, 64, 65, 127, 128, 129],
}


def _segments(tables: sch.ScheduleTables) -> list[tuple[int, int, int, int, int]]:
    """(slot, unit, first key, end key, partial) in launch order."""
    bounds = tables.slot_segments.tolist()
    rows = tables.segments.tolist()
    return [(s, *rows[i]) for s in range(tables.num_slots) for i in range(bounds[s], bounds[s + 1])]


def _check_launch_order(tables: sch.ScheduleTables, load: list[int]) -> None:
    """Every segment at one position, of its slot's pool, a pool's segments in planned start
    order; list scheduling in that order ends no later than the plan (``schedule``)."""
    pools, slots = tables.num_pools, tables.num_slots
    bounds = tables.slot_segments.tolist()
    rows = tables.segments.tolist()
    count = bounds[-1]
    order = tables.launch_order.tolist()
    assert len(order) == sch.launch_capacity(tables.unit_parts.shape[0], slots, pools)
    programs = tables.num_programs
    assert programs is not None and programs % pools == 0
    assert all(i == -1 for i in order[programs:])
    placed = [(p, i) for p, i in enumerate(order[:programs]) if i >= 0]
    assert sorted(i for _, i in placed) == list(range(count))
    slot_of, start_of = {}, {}
    for s in range(slots):
        t = 0
        for i in range(bounds[s], bounds[s + 1]):
            slot_of[i], start_of[i] = s, t
            t += rows[i][2] - rows[i][1] + sch.OVERHEAD_KEYS
    used = tables.used_slots
    assert used == max(slot_of.values()) + 1 and used <= slots
    for x in range(pools):
        mine = [i for p, i in placed if p % pools == x]
        assert all(sch.pool_of(slot_of[i], slots, pools, used) == x for i in mine)
        keys = [(start_of[i], slot_of[i]) for i in mine]
        assert keys == sorted(keys)
        # Nothing but empty programs after a pool's last segment.
        positions = [p for p, i in placed if p % pools == x]
        assert positions == list(range(x, x + pools * len(positions), pools))
    entries = sch.schedule_entries(tables)
    assert [e.program for e in entries] == [p for p, _ in placed]
    ran = sch.list_scheduled_loads(entries, slots, pools, sch.OVERHEAD_KEYS)
    # No segment starts later than planned (an idle slot may take one earlier).
    assert max(ran) <= max(load) and sum(ran) == sum(load)


def _check_invariants(lengths, groups, slots, capacity, pools=1, whole_units=True):
    packing, tables = sch.host_plan(
        lengths,
        num_groups=groups,
        num_slots=slots,
        capacity_keys=capacity,
        num_pools=pools,
        whole_units=whole_units,
    )
    pieces = [sch.pieces_of(n, capacity) for n in lengths]
    segs = _segments(tables)
    assert packing == sch.choose_packing(
        pieces, groups, slots, whole_units=whole_units, num_pools=pools
    )
    budget = packing.budget
    # The model's bound the planner chose by holds for the tables it built.
    assert sch.model_cost(tables) <= packing.cost
    # Every slot within the budget; the budget at or above the tile-granular lower bound.
    load = [0] * slots
    for s, _, first, end, _ in segs:
        load[s] += end - first + sch.OVERHEAD_KEYS
    assert max(load) <= budget
    total = groups * sum(pieces)
    assert budget >= sch.OVERHEAD_KEYS + sch.PIECE_KEYS * -(-total // slots)
    # Every unit's pieces covered once, in order, by consecutive segments.
    by_unit: dict[int, list[tuple[int, int, int]]] = {}
    for _, unit, first, end, part in segs:
        by_unit.setdefault(unit, []).append((first, end, part))
    assert sorted(by_unit) == list(range(len(lengths) * groups))
    parts = tables.unit_parts.tolist()
    split = [u for u in tables.split_units.tolist() if u >= 0]
    used_parts = []
    for unit, ranges in by_unit.items():
        n = pieces[unit // groups]
        keys = [k for first, end, _ in ranges for k in range(first, end)]
        assert keys == list(range(n * sch.PIECE_KEYS))
        if len(ranges) == 1:
            assert ranges[0][2] == -1 and parts[unit] == [-1, 1]
            assert unit not in split
        else:
            first_part, count = parts[unit]
            assert count == len(ranges) and [p for *_, p in ranges] == list(
                range(first_part, first_part + count)
            )
            assert unit in split
            used_parts += [p for *_, p in ranges]
    assert sorted(used_parts) == list(range(len(used_parts)))
    assert len(used_parts) <= sch.partial_capacity(slots)
    assert len(segs) <= sch.segment_capacity(len(lengths) * groups, slots)
    assert split == sorted(split) and len(split) <= max(0, slots - 1)
    _check_launch_order(tables, load)
    return tables


def _device(lengths, groups, slots, capacity, pools=1) -> sch.ScheduleTables:
    tables = sch.empty_tables(len(lengths), groups, slots, "cpu", pools)
    # Garbage in, to show every read entry is rewritten.
    for t in (
        tables.slot_segments,
        tables.segments,
        tables.unit_parts,
        tables.split_units,
        tables.launch_order,
    ):
        t.fill_(-7)
    sch.device_schedule(torch.tensor(lengths, dtype=torch.int32), tables, capacity_keys=capacity)
    return tables


def _host_and_device(lengths, groups, slots, capacity, pools=1) -> sch.ScheduleTables:
    """The host planner's tables (invariants checked); the device planner's equal the host's
    without whole units, and cost no less in the model than the host's own."""
    host = _check_invariants(lengths, groups, slots, capacity, pools)
    line = _check_invariants(lengths, groups, slots, capacity, pools, whole_units=False)
    _assert_same(line, _device(lengths, groups, slots, capacity, pools))
    assert sch.model_cost(host) <= sch.model_cost(line)
    if sch.choose_packing(
        [sch.pieces_of(n, capacity) for n in lengths],
        groups,
        slots,
        whole_units=True,
        num_pools=pools,
    ).whole:
        assert sch.model_cost(host) < sch.model_cost(line)
        assert host.num_partials == 0 and len(lengths) * groups > slots
    else:
        _assert_same(host, line)
    return host


def _assert_same(host: sch.ScheduleTables, device: sch.ScheduleTables) -> None:
    assert torch.equal(host.slot_segments, device.slot_segments)
    used = int(host.slot_segments[-1])
    assert torch.equal(host.segments[:used], device.segments[:used])
    assert torch.equal(host.unit_parts, device.unit_parts)
    assert torch.equal(host.split_units, device.split_units)
    assert torch.equal(host.launch_order, device.launch_order)


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize(("groups", "slots", "pools"), [(1, 8, 1), (2, 5, 1), (3, 16, 8)])
def test_device_planner_equals_host(mix, groups, slots, pools):
    lengths = MIXES[mix]
    _host_and_device(lengths, groups, slots, BIG, pools)


def test_list_scheduling_in_launch_order_runs_the_plan():
    """One pool: handing the programs out in order to the earliest free slot ends within
    the plan's makespan, on a mix whose slots hold several segments of different sizes;
    the packing's own order (slot by slot) would not."""
    lengths = [3000, 64, 64, 1000, 0, 640, 64, 2000, 128, 64]
    tables = sch.host_schedule(lengths, num_groups=1, num_slots=4, capacity_keys=BIG)
    entries = sch.schedule_entries(tables)
    plan = [0] * 4
    for e in entries:
        plan[e.slot] += e.end_key - e.first_key + sch.OVERHEAD_KEYS
    ran = sch.list_scheduled_loads(entries, 4, 1, sch.OVERHEAD_KEYS)
    assert max(ran) <= max(plan)
    packing = sorted(entries, key=lambda e: (e.slot, e.first_key))
    relabelled = [
        sch.ScheduleEntry(p, e.request, e.row_group, e.first_key, e.end_key, e.partial, e.slot)
        for p, e in enumerate(packing)
    ]
    assert max(sch.list_scheduled_loads(relabelled, 4, 1, sch.OVERHEAD_KEYS)) > max(plan)


def test_long_request_is_cut_across_slots_and_short_ones_share():
    tables = _check_invariants([8192] + [256] * 7, 1, 8, BIG)
    segs = _segments(tables)
    long_slots = {s for s, unit, *_ in segs if unit == 0}
    assert len(long_slots) >= 5  # 128 pieces of 151 in all, over 8 slots
    # Each slot boundary cuts at most one unit.
    assert sum(u >= 0 for u in tables.split_units.tolist()) <= 8 - 1


def test_capacity_clamps_what_is_planned():
    """Keys past the block table's capacity are never planned (stage 1 reads none)."""
    tables = _check_invariants([100_000, 10], 1, 4, 640)
    keys = {unit: end for _, unit, _, end, _ in _segments(tables)}
    assert keys[0] == 640


def test_one_slot_takes_everything_unsplit():
    tables = _check_invariants([5000, 0, 70], 2, 1, BIG)
    assert tables.split_units.tolist() == [-1]
    assert all(part == -1 for *_, part in _segments(tables))


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(
        st.one_of(st.integers(0, 200), st.integers(0, 5000), st.sampled_from([63, 64, 65])),
        min_size=1,
        max_size=6,
    ),
    groups=st.integers(1, 3),
    slots=st.integers(1, 12),
    capacity=st.sampled_from([BIG, 256, 1000]),
    pools=st.sampled_from([1, 2, 8]),
)
@example(lengths=[0], groups=1, slots=1, capacity=BIG, pools=1)
@example(lengths=[5000, 5000], groups=3, slots=12, capacity=BIG, pools=1)
@example(lengths=[5000, 0, 0, 0], groups=1, slots=2, capacity=BIG, pools=8)
def test_fuzz_host_invariants_and_device_equality(lengths, groups, slots, capacity, pools):
    _host_and_device(lengths, groups, slots, capacity, pools)


def test_uniform_schedule_is_the_old_split():
    """The old planner's split as tables: every request in `splits` chunks, one program each."""
    tables = sch.uniform_schedule([300, 0, 64], num_groups=2, splits=3, capacity_keys=BIG)
    segs = _segments(tables)
    assert tables.num_slots == 3 * 2 * 3 and len(segs) == 18
    # Program order: group fastest, then split, then request.
    assert [(unit, first, end) for _, unit, first, end, _ in segs[:6]] == [
        (0, 0, 128),
        (1, 0, 128),
        (0, 128, 256),
        (1, 128, 256),
        (0, 256, 320),
        (1, 256, 320),
    ]
    assert tables.unit_parts.tolist()[1] == [3, 3]


@pytest.mark.parametrize("pools", [0, 17, True, 2.0])
def test_pool_counts_outside_the_sort_key_are_refused(pools):
    with pytest.raises(ValueError, match=r"num_pools must be an int in \[1, 16\]"):
        sch.host_schedule([10], num_groups=1, num_slots=4, capacity_keys=BIG, num_pools=pools)
    with pytest.raises(ValueError, match=r"num_pools must be an int in \[1, 16\]"):
        sch.empty_tables(1, 1, 4, "cpu", pools)


# ---- the calibrated model: never costlier than the old uniform split -------------------------

#: (row groups, slots, pools) of real launches: H16 / H128 on an H200 at one and two programs
#: per SM, MI300X (304 CUs in 8 XCDs) at one and two.
GPU_SHAPES = [(1, 132, 1), (2, 132, 1), (1, 264, 1), (1, 304, 8), (2, 608, 8)]


@pytest.mark.parametrize(
    "lengths", [[32768], [49152] * 4 + [512] * 12], ids=["1x32K", "4x48K+12x512"]
)
@pytest.mark.parametrize(("groups", "slots", "pools"), GPU_SHAPES)
def test_never_costlier_than_the_uniform_split_or_the_device_plan(lengths, groups, slots, pools):
    """The planner's schedule costs no more in the calibrated model than the old uniform
    split (``choose_num_kv_splits``) run on the same slots, and the device planner writes
    the same tables. On 4600785's planner one request of 32K cost 1.18-1.82 x the uniform
    split at 264 slots or more (every slot a partial, each merged in turn)."""
    batch = len(lengths)
    splits = choose_num_kv_splits(batch, groups, sum(lengths) / batch, max(lengths), slots)
    uniform = sch.uniform_schedule(lengths, num_groups=groups, splits=splits, capacity_keys=BIG)
    host = _host_and_device(lengths, groups, slots, BIG, pools)
    assert sch.model_cost(host) <= sch.model_cost(uniform, slots)


@pytest.mark.parametrize(("groups", "slots", "pools"), [*GPU_SHAPES, (2, 256, 8)])
def test_many_short_units_cost_no_more_than_the_old_whole_unit_launch(groups, slots, pools):
    """A DCP-8 rank's share of 256 requests of 256-2K keys (32-256 keys each: shorter than
    the overhead): the old split ran every unit whole (one split), and list scheduling left
    less idle than the line's cuts. The balanced tables cost up to 1.076 x that on gfx950's
    shape (256 slots, 2 groups); the host now runs the units whole there."""
    rng = random.Random(7)
    lengths = [rng.randint(256, 2048) // 8 for _ in range(256)]
    splits = choose_num_kv_splits(256, groups, sum(lengths) / 256, max(lengths), slots)
    assert splits == 1
    uniform = sch.uniform_schedule(lengths, num_groups=groups, splits=1, capacity_keys=BIG)
    host = _host_and_device(lengths, groups, slots, BIG, pools)
    assert sch.model_cost(host) <= sch.model_cost(uniform, slots)


@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 700), min_size=1, max_size=40),
    groups=st.integers(1, 3),
    slots=st.integers(1, 24),
    pools=st.sampled_from([1, 4]),
)
def test_fuzz_never_costlier_than_whole_units_in_order(lengths, groups, slots, pools):
    """Against the old split's single-split launch (every unit whole, in unit order, list-
    scheduled: what it ran with more units than slots), the host's tables cost no more."""
    host = _host_and_device(lengths, groups, slots, BIG, pools)
    whole = sch.uniform_schedule(lengths, num_groups=groups, splits=1, capacity_keys=BIG)
    assert sch.model_cost(host) <= sch.model_cost(whole, slots)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(
        st.one_of(st.integers(0, 300), st.integers(0, 40000), st.sampled_from([64, 65])),
        min_size=1,
        max_size=5,
    ),
    groups=st.integers(1, 3),
    slots=st.integers(1, 200),
    pools=st.sampled_from([1, 8]),
)
def test_fuzz_never_costlier_than_a_uniform_split_of_one_wave(lengths, groups, slots, pools):
    """The guarantee ``choose_packing`` gives: against every uniform split whose programs
    fit the slots at once (the old split wherever it ran one wave), the schedule built costs
    no more in the model."""
    units = len(lengths) * groups
    host = _check_invariants(lengths, groups, slots, BIG, pools)
    for splits in range(1, slots // units + 1):
        uniform = sch.uniform_schedule(lengths, num_groups=groups, splits=splits, capacity_keys=BIG)
        assert sch.model_cost(host) <= sch.model_cost(uniform, slots), splits


# ---- the device planner: parallel over requests ---------------------------------------------


def _planner_steps(batch: int, groups: int, monkeypatch) -> tuple[int, int]:
    """(launches, lines of the planning kernel run) of ``device_schedule`` at ``batch``
    requests, under the interpreter (a line it runs is one step over a whole vector)."""
    launches = []

    class Counted:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            launches.append(self.kernel.fn.__name__)
            return self.kernel[grid]

    for name in ("_plan_schedule_kernel", "_launch_order_kernel"):
        monkeypatch.setattr(device, name, Counted(getattr(device, name)))
    tables = sch.empty_tables(batch, groups, 132, "cpu")
    lengths = torch.tensor([1000 + 37 * b for b in range(batch)], dtype=torch.int32)
    lines = 0

    def trace(frame, event, arg):
        # The planning kernel and its helpers (the cost model's twins among them): every
        # function of the two modules but the rank kernel (parallel over segments) and the
        # host launcher.
        if frame.f_code.co_filename not in (
            device.__file__,
            cost.__file__,
        ) or frame.f_code.co_name in (
            "_launch_order_kernel",
            "device_schedule",
            "__getitem__",
        ):
            return None

        def line(frame, event, arg):
            nonlocal lines
            lines += event == "line"
            return line

        return line

    sys.settrace(trace)
    try:
        sch.device_schedule(lengths, tables, capacity_keys=1 << 20)
    finally:
        sys.settrace(None)
    monkeypatch.undo()
    return len(launches), lines


def test_device_planner_work_per_request_is_constant(monkeypatch):
    """Two launches at any batch, and the planning kernel's serial steps (vector steps over
    up to ``PLAN_BLOCK`` units, slots or segments) grow with the batch only by its binary
    searches' log2(B) halvings, within a block (units plus slots): 4600785's one-program
    planner walked the units one by one (20x the steps at 256 requests as at 8)."""
    if triton_target() is None or triton_target().backend != "interpreter":
        pytest.skip("counts the interpreter's steps")
    small = _planner_steps(8, 1, monkeypatch)
    large = _planner_steps(sch.PLAN_BLOCK // 2, 1, monkeypatch)
    assert small[0] == large[0] == 2
    assert large[1] <= 1.5 * small[1], (small, large)
    # Past a block, a vector step more a phase per block.
    assert _planner_steps(2 * sch.PLAN_BLOCK, 1, monkeypatch)[1] <= 3 * small[1]


def test_plan_schedule_shows_the_host_plan():
    """``rocm_mla.plan_schedule``: the host planner's entries, and the budget of the packing
    they were built from (planned once), which no slot's load exceeds."""
    from rocm_mla import plan_schedule
    from rocm_mla.kernels.target import TritonTarget

    lengths = [8192] + [256] * 7
    target = TritonTarget("interpreter", None, 16)  # one program per CU: 16 slots
    schedule = plan_schedule(lengths, q_len=1, num_heads=16, kv_dtype=torch.bfloat16, target=target)
    assert schedule.num_slots == 16 and schedule.num_groups == 1
    packing, tables = sch.host_plan(
        lengths, num_groups=1, num_slots=16, capacity_keys=sch.MAX_KEYS, num_pools=1
    )
    assert schedule.entries == sch.schedule_entries(tables)
    pieces = [sch.pieces_of(n, sch.MAX_KEYS) for n in lengths]
    assert schedule.budget_keys == packing.budget == sch.choose_packing(pieces, 1, 16).budget
    assert max(schedule.slot_loads) <= schedule.budget_keys
    assert sum(e.request == 0 for e in schedule.entries) > 1  # the long request is cut
