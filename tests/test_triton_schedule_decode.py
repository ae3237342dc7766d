"""The Triton decode on the balanced schedule (``rocm_mla/kernels/schedule/``) against torch.

Each length mix of the schedule issue, shrunk to interpreter size (page 16, pieces of 64
keys, D = 64 + 16), decoded twice: on the host planner's tables and on the device planner's
(``mla_decode(num_slots=S)``), over 1, 3 and 12 slots, with H 4 (the tuned interpreter config:
one group of 16 rows, 64-key tiles across pages) and H 20 (16-row groups of 16-key tiles, the
last group padded), S_q 1 and 2 (a causal verify window). Both outputs are compared with the
torch backend, and the planners' tables with each other.

Then a graph-style replay: one ``DecodePlan`` made for ``graph_max_seqlen``, its schedule
rewritten in place on the device for two different length mixes (the tables keep their
addresses, as a captured graph needs), each decoded through the plan and compared with torch.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import rocm_mla
from rocm_mla.backends.triton import SLOTS_ENV, TritonMLAImpl
from rocm_mla.inputs import prepare_decode
from rocm_mla.kernels import mla_decode as kernel
from rocm_mla.kernels import mla_decode_args as mda
from rocm_mla.kernels import schedule as sch
from rocm_mla.kernels.tuned_configs import LaunchConfig
from tests.reference import assert_same_attention, make_paged_problem
from tests.schedule_helpers import cut_requests, device_tables, host_tables, num_groups

if TritonMLAImpl.unavailable_reason() is not None:
    pytest.skip(TritonMLAImpl.unavailable_reason(), allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
HEAD_DIM_V, ROPE_DIM, PAGE = 64, 16, 16
#: H 20 runs 16-row groups of 16-key tiles: 20 rows (S_q 1) in two groups, 40 (S_q 2) in
#: three, the last one padded either way.
SMALL_TILES = LaunchConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)

#: The issue's length mixes, shrunk.
MIXES = {
    "uniform": [150, 150, 150],
    "one long, several short": [700, 20, 5, 33],
    "zero-length requests": [0, 150, 0, 70, 0],
    "batch of 1": [300],
    "0, 1, page and tile boundaries": [0, 1, 16, 17, 64, 65],
    "all shorter than a piece": [63, 1, 40, 12],
}


def problem(lengths, *, heads, q_len, dtype, seed=0):
    q, kv, bt, lens = make_paged_problem(
        lengths,
        num_heads=heads,
        q_len=q_len,
        block_size=PAGE,
        head_dim=HEAD_DIM_V + ROPE_DIM,
        dtype=dtype,
        seed=seed,
    )
    return q.to(DEVICE), kv.to(DEVICE), bt.to(DEVICE), lens.to(DEVICE)


def reference(q, kv, bt, lens):
    return rocm_mla.mla_decode(q, kv, bt, lens, head_dim_v=HEAD_DIM_V, backend="torch")


def assert_same_tables(host: sch.ScheduleTables, device: sch.ScheduleTables) -> None:
    """Equal tables: every entry stage 1 and the merge read (segments past the count are
    never read, and the device planner leaves them as they were)."""
    assert (host.num_slots, host.num_groups) == (device.num_slots, device.num_groups)
    for name in ("slot_segments", "unit_parts", "split_units", "launch_order"):
        assert torch.equal(getattr(host, name).cpu(), getattr(device, name).cpu()), name
    count = int(host.slot_segments[-1])
    assert torch.equal(host.segments[:count].cpu(), device.segments[:count].cpu()), "segments"


@pytest.mark.parametrize("guard", ["branch", "loop", "mask"])
@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("mix", ["one long, several short", "zero-length requests"])
def test_pooled_launch_order_with_empty_programs_matches_torch(mix, q_len, guard, monkeypatch):
    """AMD's order (4 pools, as XCDs): programs with nothing to do sit between real ones,
    on host and device tables alike, and every row still comes out right, with either form
    form of stage 1's guard for them (``mla_decode_args.no_op_guard``)."""
    monkeypatch.setattr(mda, "no_op_guard", lambda target, **shape: guard)
    lengths = MIXES[mix]
    q, kv, bt, lens = problem(lengths, heads=4, q_len=q_len, dtype=torch.float32, seed=3)
    ref_out, ref_lse = reference(q, kv, bt, lens)
    p = prepare_decode(
        q, kv, bt, lens, head_dim_v=HEAD_DIM_V, softmax_scale=None, causal=True, kv_scale=None
    )
    capacity = bt.shape[1] * PAGE
    tables = dict(groups=1, slots=7, capacity_keys=capacity, pools=4)
    host = host_tables(lengths, device=DEVICE, **tables)
    device = device_tables(lens, **tables)
    assert_same_tables(host, device)
    order = host.launch_order[: host.num_programs].tolist()
    assert -1 in order and host.num_programs % 4 == 0
    args = (p.q, p.kv_cache, p.block_table, p.cache_seqlens)
    kwargs = dict(head_dim_v=HEAD_DIM_V, softmax_scale=p.softmax_scale)
    for schedule in (host, device):
        out, lse = kernel.mla_decode(*args, schedule=schedule, **kwargs)
        assert_same_attention(out, lse, ref_out, ref_lse, TOL[torch.float32])


@pytest.mark.parametrize(("heads", "q_len"), [(4, 1), (4, 2), (20, 1), (20, 2)])
@pytest.mark.parametrize("slots", [1, 3, 12])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_host_and_device_schedules_match_torch(mix, slots, heads, q_len):
    lengths = MIXES[mix]
    dtype = torch.float32 if heads == 4 else torch.float16
    config = None if heads == 4 else SMALL_TILES
    q, kv, bt, lens = problem(lengths, heads=heads, q_len=q_len, dtype=dtype, seed=len(mix))
    ref_out, ref_lse = reference(q, kv, bt, lens)
    p = prepare_decode(
        q, kv, bt, lens, head_dim_v=HEAD_DIM_V, softmax_scale=None, causal=True, kv_scale=None
    )
    groups = num_groups(heads=heads, q_len=q_len, kv_dtype=dtype, config=config)
    capacity = bt.shape[1] * PAGE
    host = host_tables(lengths, groups=groups, slots=slots, capacity_keys=capacity, device=DEVICE)
    device = device_tables(lens, groups=groups, slots=slots, capacity_keys=capacity)
    assert_same_tables(host, device)
    if mix == "one long, several short" and slots > 1:
        # The long request is cut across slots: its partials go through stage 2.
        assert 0 in cut_requests(lengths, groups=groups, slots=slots, capacity_keys=capacity)
    if slots == 1 or mix == "all shorter than a piece":
        assert host.num_partials == 0  # every unit whole: stage 1 writes every row
    args = (p.q, p.kv_cache, p.block_table, p.cache_seqlens)
    kwargs = dict(head_dim_v=HEAD_DIM_V, softmax_scale=p.softmax_scale, config=config)
    on_host = kernel.mla_decode(*args, schedule=host, **kwargs)
    on_device = kernel.mla_decode(*args, num_slots=slots, **kwargs)
    runs = [on_host, on_device]
    # The host planner's own choice, whole units where they cost less (more units than slots).
    whole = host_tables(
        lengths, groups=groups, slots=slots, capacity_keys=capacity, device=DEVICE, whole_units=True
    )
    if not torch.equal(whole.slot_segments, host.slot_segments) or not torch.equal(
        whole.segments, host.segments
    ):
        assert whole.num_partials == 0 and len(lengths) * groups > slots
        runs.append(kernel.mla_decode(*args, schedule=whole, **kwargs))
    for out, lse in runs:
        assert_same_attention(out, lse, ref_out, ref_lse, TOL[dtype])


def test_the_mixes_cut_units_across_slots():
    """The parametrization above exercises stage 2: at 12 slots every mix with a unit of
    two pieces cuts one (at 3, the overhead a cut adds outweighs what it balances for most)."""
    cut = {
        (mix, slots)
        for mix, lengths in MIXES.items()
        for slots in (3, 12)
        if cut_requests(lengths, groups=1, slots=slots, capacity_keys=1 << 20)
    }
    assert {mix for mix, _ in cut} == set(MIXES) - {"all shorter than a piece"}, cut


# ---- graph-style replay: one plan, its tables rewritten in place per step ------------------


@pytest.mark.parametrize("slots", ["target", 8])
def test_a_graph_plan_replays_other_lengths_after_rescheduling_in_place(monkeypatch, slots):
    """``plan_decode(graph_max_seqlen=...)`` for 4 requests on the Triton backend, then two
    different length mixes: before each, ``reschedule`` / ``replan_decode`` rewrite the
    plan's tables on the device (same tensors, same addresses: what a captured graph reads)
    with the device planner's packing of these lengths, and the planned call through the
    plan equals torch (and, lengths changed without a replan, does not: the kernel walks
    the plan's tables). ``slots`` 8 (``ROCM_MLA_TRITON_SLOTS``) stands in for a GPU's slots
    (the interpreter has one), so the mixes' long requests are cut and merged."""
    if slots == "target":
        monkeypatch.delenv(SLOTS_ENV, raising=False)
    else:
        monkeypatch.setenv(SLOTS_ENV, str(slots))
    heads, q_len, dtype, max_len = 4, 2, torch.float32, 400
    # One cache and table for every step, room for max_len keys per request.
    q, kv, bt, _ = problem([max_len] * 4, heads=heads, q_len=q_len, dtype=dtype, seed=11)
    plan = rocm_mla.plan_decode(
        [max_len] * 4,
        q_len=q_len,
        num_heads=heads,
        head_dim_v=HEAD_DIM_V,
        rope_dim=ROPE_DIM,
        kv_dtype=dtype,
        device=DEVICE,
        block_table=bt,
        kv_cache=kv,
        graph_max_seqlen=max_len,
        backend="triton",
    )
    launch = plan.launch
    tables = launch.schedule
    num_slots = launch.num_slots
    if slots != "target":
        assert num_slots == slots
    names = ("slot_segments", "segments", "unit_parts", "split_units")
    addresses = [getattr(tables, name).data_ptr() for name in names]
    capacity = bt.shape[1] * PAGE
    groups = num_groups(heads=heads, q_len=q_len, kv_dtype=dtype, config=launch.config)
    assert tables.num_groups == groups and launch.capacity_keys == capacity
    steps = [
        ([400, 3, 0, 129], TritonMLAImpl.reschedule),
        ([64, 65, 250, 1], rocm_mla.replan_decode),
    ]
    cuts = set()
    for lengths, rewrite in steps:
        lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
        rewrite(plan, lens)
        now = plan.launch.schedule
        assert [getattr(now, name).data_ptr() for name in names] == addresses
        # The device planner's packing of these lengths (the rows it wrote; rows past the
        # last segment may hold an earlier step's).
        want = host_tables(lengths, groups=groups, slots=num_slots, capacity_keys=capacity)
        used = int(want.slot_segments[-1])
        assert torch.equal(now.slot_segments.cpu(), want.slot_segments)
        assert torch.equal(now.segments[:used].cpu(), want.segments[:used])
        assert torch.equal(now.unit_parts.cpu(), want.unit_parts)
        assert torch.equal(now.split_units.cpu(), want.split_units)
        cuts |= {(tuple(lengths), u) for u in want.split_units.tolist() if u >= 0}
        out, lse = rocm_mla.mla_decode(q, kv, bt, lens, head_dim_v=HEAD_DIM_V, plan=plan)
        ref_out, ref_lse = reference(q, kv, bt, lens)
        assert_same_attention(out, lse, ref_out, ref_lse, TOL[dtype])
    if num_slots > 1:
        assert {lengths for lengths, _ in cuts} == {tuple(lengths) for lengths, _ in steps}
    # The plan's tables are what the kernel walks: request 0 grown to 400 keys without a
    # replan still walks the last step's 64 (its other requests unchanged, exact).
    lens = torch.tensor([400, 65, 250, 1], dtype=torch.int32, device=DEVICE)
    out, lse = rocm_mla.mla_decode(q, kv, bt, lens, head_dim_v=HEAD_DIM_V, plan=plan)
    ref_out, ref_lse = reference(q, kv, bt, lens)
    assert_same_attention(out[1:], lse[1:], ref_out[1:], ref_lse[1:], TOL[dtype])
    assert not torch.allclose(lse[0].cpu(), ref_lse[0].cpu(), atol=1e-3)
