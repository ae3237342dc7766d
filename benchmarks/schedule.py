"""Decode schedule quality of the Triton MLA decode, without a GPU: what each planner's
schedule of a decode step costs in the calibrated cost model, against lower bounds.

For sm90 (132 SMs), gfx942 (304 CUs) and gfx950 (256 CUs), every shape H in 12/16/96/128 x
S_q in 1/4/8 x KV bf16/fp8 (fp8: e4m3fnuz on gfx942, e4m3fn elsewhere; q bf16), and every
length mix (``base_mixes``, then ``held_out_mixes``: ones the model was not fitted on; fixed
and seeded, each also as a DCP-8 rank 0's share from ``rocm_mla.dcp.local_seq_lens``; H is
unchanged there, DCP gathers the heads), the launch is the one ``plan.plan_launch`` plans
for the shape (KV cache bytes = the mix's keys x 576 x itemsize, page 64): config =
``group_config(default_config(...), S_q*H)``, ``G = ceil(S_q*H / block_h)`` row groups, and
``S = compute units x programs_per_cu`` resident slots, ``programs_per_cu`` being the
compiled stage 1's occupancy for the target (``kernels.occupancy``: one compile per shape,
no GPU needed; the compiles dominate the run, so rerunning after a kernel change is all it
takes to refresh; ``--programs-per-cu N`` skips them).

Cost model (key-units; ``rocm_mla.kernels.schedule.cost``: ``PIECE_KEYS`` = 64,
``OVERHEAD_KEYS`` = 192, ``MERGE_KEYS`` = 2, calibrated there on an H200; ``--fit``
reproduces the fit): a program or segment walking ``k`` keys costs ``ceil(k / 64) * 64 +
OVERHEAD_KEYS`` (a masked tile costs as much as a full one); a step costs its makespan (the
last slot to finish) plus ``MERGE_KEYS`` x the most partials one unit merges
(``schedule.model_cost``). Per schedule:

- balanced (ours, ``kernels.schedule.host_schedule``): one program per segment in the
  planner's launch order (``kernels.schedule``: "Launch order"), list-scheduled onto the
  earliest-free slot of the program's pool (AMD: XCD ``p % 8``, ``S / 8`` slots each; one
  pool on sm90); makespan = the last finish, checked to be within the packing's own (its
  largest slot load, ``planned_makespan`` in the JSON).
- old uniform split (``plan.choose_num_kv_splits(B, G, mean, max, S)``, as ``schedule_gpu``
  times it: ``schedule.uniform_schedule``): every request in that many splits of
  ``ceil(L / splits)`` keys rounded up to pieces; programs in the old kernel's launch order
  (program id: group fastest, then split, then request; the AMD XCD remap is ignored), each
  list-scheduled onto the earliest-free of ``S`` slots (ties: the lowest slot); every unit
  merges ``splits`` partials.
- FlashMLA reference: its documented dense-decode scheduler (``get_mla_metadata``): blocks
  of 64 keys, total = sum over units of (blocks + 5), each of ``S`` parts takes a payload of
  ``ceil(total / S) + 5`` blocks in unit order, a unit whole when its remaining blocks + 5
  fit, else the part takes what fits beyond the 5 and the unit continues in the next part.
  Here it runs over our units (request x row group, as ours does) with one part per slot,
  each part costed as a persistent slot like ours, and a unit merges one partial per part.

Lower bounds on any schedule's makespan in this model: (a) ``max(G * sum(L) / S, 64) +
OVERHEAD_KEYS`` (every key spread evenly over the slots, no program shorter than one tile,
one overhead each); (b) ``ceil(P / S) * 64 + OVERHEAD_KEYS`` with ``P`` the 64-key pieces
over all units (some slot holds that many whole pieces); (c) the least makespan ``M`` not
ruled out by counting segments (a slot of ``k`` segments holds at most ``floor((M -
OVERHEAD_KEYS k) / 64)`` pieces, a unit of ``n`` pieces needs ``max(1, ceil(n / floor((M -
OVERHEAD_KEYS) / 64)))`` segments; ``_makespan_possible``): (b) charges one overhead per
slot, (c) every segment's. Each becomes a bound on the cost (``total_bound``): a makespan
``M`` leaves segments of at most ``t_M`` pieces, so the longest unit merges at least
``ceil(n / t_M)`` partials; the least ``M + merge`` from the bound up. Every schedule is
checked against all of them (``bounds_hold``).

Gates per row (recorded, never fatal: the command prints a summary line and exits 0):
balanced <= 1.15 x (c), or within one piece (64 keys) of (c), and balanced <= old (the old
uniform split) on every row; for the uniform batch (8 x 32K and its DCP share) also
balanced / (c) <= 1.05. The bound gated is (c), the tightest, because (a) and (b) cannot be
met where slots hold few pieces: a DCP-8 share of 32 short requests leaves 4-5 pieces a
slot, every cut adds an overhead that (b) does not charge, and one piece more on the
busiest slot is already 1.19 x (b). (c) is a relaxation (it counts segments, it packs
nothing), and a slot takes whole pieces, so one piece over it is the allowance there. (a)
and (b) stay reported, with their own 1.15 counts.

Output: JSON (every row, and the fit of ``FIT_FILE`` when it is there), markdown (tables per
target) and a PNG (per-slot loads of the worst row: old vs balanced, FlashMLA, the bounds)
under ``benchmarks/results/``. On a 2-core machine the 72 compiles take about 4-10 minutes
cold (Triton's cache then makes a rerun take under a minute).

    python -m benchmarks.schedule [--targets sm90,gfx942,gfx950] [--workers 2]
        [--programs-per-cu N] [--render JSON] [--fit [JSON]]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import math
import multiprocessing
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import common
from rocm_mla.kernels.schedule.cost import (
    MERGE_KEYS,
    OVERHEAD_KEYS,
    PIECE_KEYS,
    list_schedule,
    merge_cost,
)

MAX_RATIO = 1.15  #: balanced makespan / lower bound, every row (see the module docstring)
MAX_RATIO_UNIFORM = 1.05  #: the same for the uniform batch
HEADS = (12, 16, 96, 128)
Q_LENS = (1, 4, 8)
KV_KINDS = ("bf16", "fp8")
PAGE_SIZE, HEAD_DIM = 64, 576
DCP_SIZE, DCP_RANK, DCP_INTERLEAVE = 8, 0, 1
#: FlashMLA's scheduler constants (its block of keys and fixed per-split overhead in blocks).
FLASHMLA_BLOCK, FLASHMLA_OVERHEAD_BLOCKS = 64, 5
SEED = 20261201
MAX_LEN = 256 << 10
UNIFORM_MIX = "uniform 8x32K"


@dataclass(frozen=True)
class Target:
    key: str
    backend: str
    arch: str
    num_cus: int

    def triton_target(self):
        from rocm_mla.kernels.target import TritonTarget

        return TritonTarget(self.backend, self.arch, self.num_cus)

    def kv_dtype(self, kind: str) -> torch.dtype:
        if kind == "bf16":
            return torch.bfloat16
        return torch.float8_e4m3fnuz if self.key == "gfx942" else torch.float8_e4m3fn


TARGETS = {
    t.key: t
    for t in (
        Target("sm90", "cuda", "sm90", 132),
        Target("gfx942", "hip", "gfx942", 304),
        Target("gfx950", "hip", "gfx950", 256),
    )
}


def _lognormal(batch: int, median: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [
        min(MAX_LEN, max(1, round(rng.lognormvariate(math.log(median), 1.0)))) for _ in range(batch)
    ]


def base_mixes() -> dict[str, list[int]]:
    """The length mixes (fixed; the random ones seeded), before the DCP shares."""
    rng = random.Random(SEED + 128)
    return {
        UNIFORM_MIX: [32768] * 8,
        "1x32K + 7x1K": [32768] + [1024] * 7,
        "1x128K + 31x2K": [131072] + [2048] * 31,
        "lognormal B8 median 16K": _lognormal(8, 16384, SEED + 8),
        "lognormal B32 median 2K": _lognormal(32, 2048, SEED + 32),
        "lognormal B64 median 4K": _lognormal(64, 4096, SEED + 64),
        "B128 uniform 1K-8K": [rng.randint(1024, 8192) for _ in range(128)],
        "batch of 1 (32K)": [32768],
        "zeros in a batch": [0, 0, 4096, 0, 100, 0, 8192, 0],
    }


def held_out_mixes() -> dict[str, list[int]]:
    """Mixes the cost model was not fitted on (``schedule.cost.OVERHEAD_KEYS``: the fit timed
    ``base_mixes`` on an H200), so the rows check the planner where it was not tuned."""
    rng = random.Random(SEED + 256)
    return {
        "4x48K + 12x512": [49152] * 4 + [512] * 12,
        "2x64K + 62x1K": [65536] * 2 + [1024] * 62,
        "batch of 1 (8K)": [8192],
        "batch of 2 (128K)": [131072] * 2,
        "lognormal B16 median 8K": _lognormal(16, 8192, SEED + 16),
        "B256 uniform 256-2K": [rng.randint(256, 2048) for _ in range(256)],
    }


def dcp_name(name: str) -> str:
    return f"{name} / DCP{DCP_SIZE} rank {DCP_RANK}"


def mixes() -> dict[str, list[int]]:
    """Every mix (the base ones, then the held-out ones), each followed by DCP-8 rank 0's
    share of it."""
    from rocm_mla.dcp.layout import local_seq_lens

    out = {}
    for name, lengths in {**base_mixes(), **held_out_mixes()}.items():
        out[name] = lengths
        local = local_seq_lens(
            torch.tensor(lengths, dtype=torch.int64), DCP_SIZE, DCP_RANK, DCP_INTERLEAVE
        )
        out[dcp_name(name)] = [int(x) for x in local.tolist()]
    return out


# ---- the cost model and the three schedules -------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def lower_bounds(lengths: list[int], num_groups: int, num_slots: int) -> tuple[float, int]:
    """(a) and (b) of the module docstring."""
    piece, overhead = PIECE_KEYS, OVERHEAD_KEYS
    keys = num_groups * sum(max(n, 0) for n in lengths)
    pieces = num_groups * sum(-(-max(n, 0) // piece) for n in lengths)
    lb_a = max(keys / num_slots, piece) + overhead
    lb_b = -(-pieces // num_slots) * piece + overhead
    return lb_a, lb_b


def _makespan_possible(lengths: list[int], num_groups: int, num_slots: int, span: int) -> bool:
    """False when no schedule in the cost model has makespan <= ``span`` (a relaxation: True
    does not promise one). A slot of ``k`` segments holds at most ``c_k = floor((span -
    OVERHEAD_KEYS k) / 64)`` pieces, a segment at most ``t = c_1``, so unit ``u`` needs ``m_u >=
    max(1, ceil(n_u / t))`` segments; the ``K = sum m_u`` segments over ``S`` slots hold at
    most ``S * f(max(K / S, 1))`` pieces, ``f`` the upper concave envelope of ``c_k``."""
    piece, overhead = PIECE_KEYS, OVERHEAD_KEYS
    most = span // overhead  # segments one slot can hold at all
    t = (span - overhead) // piece
    counts = [_cdiv(max(n, 0), piece) for n in lengths]
    total = num_groups * sum(counts)
    if most < 1 or (total > 0 and t < 1):
        return False
    need = num_groups * sum(max(1, _cdiv(n, t)) if t >= 1 else 1 for n in counts)
    if need > num_slots * most:
        return False
    if need <= num_slots:
        return num_slots * t >= total
    hull: list[tuple[int, int]] = []
    for k in range(1, most + 1):
        c = (span - overhead * k) // piece
        while len(hull) >= 2:
            (x0, y0), (x1, y1) = hull[-2], hull[-1]
            if (x1 - x0) * (c - y0) - (y1 - y0) * (k - x0) < 0:
                break
            hull.pop()
        hull.append((k, c))
    if need == num_slots * most:
        return num_slots * hull[-1][1] >= total
    for (i, ci), (j, cj) in itertools.pairwise(hull):
        if j * num_slots >= need:
            # S * f(K / S) on the chord from i to j, times (j - i), in integers.
            return num_slots * ci * (j - i) + (cj - ci) * (need - num_slots * i) >= total * (j - i)
    return False


def lower_bound_c(lengths: list[int], num_groups: int, num_slots: int, lb_b: int, high: int):
    """(c): the least makespan ``_makespan_possible`` allows, searched in ``[lb_b, high]``
    (``high``: a schedule's makespan); None when even ``high`` is ruled out (a model bug)."""
    if not _makespan_possible(lengths, num_groups, num_slots, high):
        return None
    low = lb_b
    while low < high:
        mid = (low + high) // 2
        if _makespan_possible(lengths, num_groups, num_slots, mid):
            high = mid
        else:
            low = mid + 1
    return low


def total_bound(lengths: list[int], num_groups: int, stage1_bound: float, high: int) -> int:
    """A lower bound on a step's cost (stage 1's makespan plus the merge) from one on the
    makespan: a schedule of makespan ``M`` walks at most ``t = (M - OVERHEAD_KEYS) // 64``
    pieces a segment, so the longest unit merges at least ``ceil(n / t)`` partials; the
    least ``M + merge`` over ``M`` from ``stage1_bound`` up to ``high`` (a schedule's
    cost)."""
    piece, overhead = PIECE_KEYS, OVERHEAD_KEYS
    longest = max(_cdiv(max(n, 0), piece) for n in lengths)
    low = math.ceil(stage1_bound)

    def chain(span: int) -> int:
        return _cdiv(longest, (span - overhead) // piece) if longest else 0

    best = low + merge_cost(chain(low))
    # Each fewer partial is possible from the least makespan whose segments hold its share.
    for count in range(chain(low) - 1, 0, -1):
        span = overhead + _cdiv(longest, count) * piece
        if span > high:
            break
        best = min(best, span + merge_cost(count))
    return best


def balanced_loads(lengths: list[int], num_groups: int, num_slots: int, num_pools: int) -> dict:
    """Per-slot finish times of ``host_schedule``'s launch order, list-scheduled per pool
    (``loads``), the packing's own slot loads (``planned``), what they cut, the longest
    merge (``chain``) and the step's cost in the model (``cost``)."""
    from rocm_mla.kernels.schedule import host_schedule, list_scheduled_loads, schedule_entries

    tables = host_schedule(
        lengths,
        num_groups=num_groups,
        num_slots=num_slots,
        capacity_keys=1 << 30,
        num_pools=num_pools,
    )
    bounds = tables.slot_segments.tolist()
    segments = tables.segments.tolist()
    overhead = OVERHEAD_KEYS
    loads = []
    covered = [0] * (len(lengths) * num_groups)
    for s in range(num_slots):
        load = 0
        for unit, first, end, _ in segments[bounds[s] : bounds[s + 1]]:
            load += end - first + overhead
            covered[unit] += end - first
        loads.append(load)
    piece = PIECE_KEYS
    for u, keys in enumerate(covered):
        want = -(-max(lengths[u // num_groups], 0) // piece) * piece
        if keys != want:
            raise RuntimeError(f"balanced schedule covers {keys} keys of unit {u}, not {want}")
    split = [u for u in tables.split_units.tolist() if u >= 0]
    ran = list_scheduled_loads(schedule_entries(tables), num_slots, num_pools, overhead)
    if max(ran) > max(loads):
        raise RuntimeError(f"launch order ran {max(ran)} past the plan's {max(loads)}")
    chain = max(count for _, count in tables.unit_parts.tolist())
    return {
        "loads": ran,
        "planned": loads,
        "split_units": len(split),
        "chain": chain if chain > 1 else 0,
        "cost": max(ran) + merge_cost(chain),
    }


def old_loads(lengths: list[int], num_groups: int, num_slots: int, splits: int) -> list[int]:
    """The old uniform split as ``rocm-mla bench schedule-gpu`` times it
    (``schedule.uniform_schedule``: every request in ``splits`` chunks of ``ceil(L / splits)``
    keys rounded up to pieces), its programs in program-id order (group fastest, then split,
    then request; the AMD XCD remap is ignored) list-scheduled onto the earliest-free of
    ``num_slots`` slots (ties: the lowest slot)."""
    from rocm_mla.kernels.schedule import list_scheduled_loads, schedule_entries, uniform_schedule

    tables = uniform_schedule(lengths, num_groups=num_groups, splits=splits, capacity_keys=1 << 30)
    return list_scheduled_loads(schedule_entries(tables), num_slots, 1, OVERHEAD_KEYS)


def flashmla_loads(lengths: list[int], num_groups: int, num_parts: int) -> tuple[list[int], int]:
    """FlashMLA's dense-decode part schedule over our units, costed per part (docstring),
    and the most parts one unit spans (its longest merge)."""
    blocks = [-(-max(n, 0) // FLASHMLA_BLOCK) for n in lengths for _ in range(num_groups)]
    total = sum(b + FLASHMLA_OVERHEAD_BLOCKS for b in blocks)
    payload = -(-total // num_parts) + FLASHMLA_OVERHEAD_BLOCKS
    overhead = OVERHEAD_KEYS
    loads = []
    spans = [0] * len(blocks)
    unit, done = 0, 0  # the unit being walked and its blocks already given out
    for _ in range(num_parts):
        left, load = payload, 0
        while unit < len(blocks):
            remaining = blocks[unit] - done
            if left >= remaining + FLASHMLA_OVERHEAD_BLOCKS:
                load += remaining * FLASHMLA_BLOCK + overhead
                left -= remaining + FLASHMLA_OVERHEAD_BLOCKS
                spans[unit] += 1
                unit, done = unit + 1, 0
                continue
            if left > FLASHMLA_OVERHEAD_BLOCKS:
                take = left - FLASHMLA_OVERHEAD_BLOCKS
                load += take * FLASHMLA_BLOCK + overhead
                spans[unit] += 1
                done += take
            break
        loads.append(load)
    if unit < len(blocks):
        raise RuntimeError(f"FlashMLA schedule left units {unit}.. of {len(blocks)} unassigned")
    chain = max(spans)
    return loads, chain if chain > 1 else 0


# ---- rows ---------------------------------------------------------------------------------


def _plan(target: Target, heads: int, q_len: int, kind: str, lengths: list[int], ppc):
    """(config, G, programs per CU, S, old splits) for one shape and mix: the config and
    slots ``plan.plan_launch`` plans (it compiles stage 1 once per shape for the occupancy),
    or with ``ppc`` given its config and ``num_cus * ppc`` slots without compiling."""
    import triton

    from rocm_mla.kernels import plan
    from rocm_mla.kernels.mla_decode_args import default_config, group_config

    tt = target.triton_target()
    kv = target.kv_dtype(kind)
    total, longest, batch = sum(lengths), max(lengths), len(lengths)
    if ppc is None:
        config, slots = plan.plan_launch(
            q_len=q_len,
            num_heads=heads,
            kv_dtype=kv,
            target=tt,
            q_dtype=torch.bfloat16,
            head_dim=HEAD_DIM,
            page_size=PAGE_SIZE,
            cache_bytes=total * HEAD_DIM * kv.itemsize,
        )
        ppc = slots // target.num_cus
    else:
        config = group_config(
            default_config(tt, num_heads=heads, q_len=q_len, kv_dtype=kv), q_len * heads
        )
        slots = target.num_cus * ppc
    groups = triton.cdiv(q_len * heads, config.block_h)
    splits = plan.choose_num_kv_splits(batch, groups, total / max(batch, 1), longest, slots)
    return config, groups, ppc, slots, splits


def measure(target: Target, heads: int, q_len: int, kind: str, mix: str, lengths, ppc=None):
    """One row: the three schedules' makespans and costs, the bounds, ratios and gates."""
    config, groups, ppc, slots, splits = _plan(target, heads, q_len, kind, lengths, ppc)
    lb_a, lb_b = lower_bounds(lengths, groups, slots)
    balanced = balanced_loads(lengths, groups, slots, config.num_xcds)
    flash, flash_chain = flashmla_loads(lengths, groups, slots)
    makespans = {
        "old": max(old_loads(lengths, groups, slots, splits)),
        "balanced": max(balanced["loads"]),
        "flashmla": max(flash),
    }
    chains = {
        "old": splits if splits > 1 else 0,
        "balanced": balanced["chain"],
        "flashmla": flash_chain,
    }
    costs = {name: makespans[name] + merge_cost(chains[name]) for name in makespans}
    lb_c = lower_bound_c(lengths, groups, slots, lb_b, makespans["balanced"])
    # Every schedule is one of the model's, so no bound may exceed its makespan.
    bounds_hold = lb_c is not None and all(
        m >= max(lb_a, lb_b) and _makespan_possible(lengths, groups, slots, m)
        for m in makespans.values()
    )
    lb_c = lb_b if lb_c is None else lb_c
    high = max(costs.values())
    totals = {
        name: total_bound(lengths, groups, bound, high)
        for name, bound in (("lb_a", lb_a), ("lb_b", lb_b), ("lb_c", lb_c))
    }
    bounds_hold = bounds_hold and all(c >= max(totals.values()) for c in costs.values())
    ratios = {
        name: {lb: round(c / totals[lb], 4) for lb in ("lb_a", "lb_b", "lb_c")}
        for name, c in costs.items()
    }
    uniform = mix in (UNIFORM_MIX, dcp_name(UNIFORM_MIX))
    gate_c = totals["lb_c"]
    gates = {
        "lb_c": costs["balanced"] <= max(MAX_RATIO * gate_c, gate_c + PIECE_KEYS),
        "lb_b": ratios["balanced"]["lb_b"] <= MAX_RATIO,
        "lb_a": ratios["balanced"]["lb_a"] <= MAX_RATIO,
        "uniform_lb_c": ratios["balanced"]["lb_c"] <= MAX_RATIO_UNIFORM if uniform else None,
        "not_costlier_than_old": costs["balanced"] <= costs["old"],
    }
    gates["pass"] = gates["lb_c"] and gates["uniform_lb_c"] is not False
    gates["pass"] = gates["pass"] and gates["not_costlier_than_old"]
    return {
        "target": target.key,
        "H": heads,
        "S_q": q_len,
        "dtype": kind,
        "kv_dtype": str(target.kv_dtype(kind)).removeprefix("torch."),
        "block_h": config.block_h,
        "block_n": config.block_n,
        "G": groups,
        "programs_per_cu": ppc,
        "S": slots,
        "mix": mix,
        "held_out": mix.split(" / ")[0] in held_out_mixes(),
        "B": len(lengths),
        "old_splits": splits,
        "old_programs": len(lengths) * groups * splits,
        "balanced_slots_used": sum(1 for x in balanced["loads"] if x),
        "balanced_split_units": balanced["split_units"],
        "pools": config.num_xcds,
        "planned_makespan": max(balanced["planned"]),
        "lb_a": round(lb_a, 2),
        "lb_b": lb_b,
        "lb_c": lb_c,
        "lb_total": totals,
        "bounds_hold": bounds_hold,
        "makespan": makespans,
        "chain": chains,
        "cost": costs,
        "ratio": ratios,
        "balanced_over_old": round(costs["balanced"] / costs["old"], 4),
        "gates": gates,
    }


def measure_shape(target_key: str, heads: int, q_len: int, kind: str, mix_lengths, ppc=None):
    """Every mix of one shape (a worker's job: one compile, then pure arithmetic)."""
    start = time.perf_counter()
    target = TARGETS[target_key]
    rows = [
        measure(target, heads, q_len, kind, mix, lengths, ppc)
        for mix, lengths in mix_lengths.items()
    ]
    return rows, round(time.perf_counter() - start, 1)


def shapes(targets) -> list[tuple[str, int, int, str]]:
    # sm90 first: its compiles (ptxas) take longest, so no worker idles at the end.
    return [
        (t.key, h, s, kind)
        for t in sorted(targets, key=lambda t: t.key != "sm90")
        for h in HEADS
        for s in Q_LENS
        for kind in KV_KINDS
    ]


def run(
    targets: list[Target],
    *,
    workers: int = 2,
    programs_per_cu: int | None = None,
    mix_lengths: dict[str, list[int]] | None = None,
    shape_list: list[tuple[str, int, int, str]] | None = None,
) -> dict:
    """Every row; ``programs_per_cu`` set skips the compiles (every shape gets that many)."""
    start = time.perf_counter()
    mix_lengths = mixes() if mix_lengths is None else mix_lengths
    jobs = shapes(targets) if shape_list is None else shape_list
    if workers > 1 and len(jobs) > 1:
        # spawn, not fork: the parent holds torch and Triton state a fork would copy.
        context = multiprocessing.get_context("spawn")
        pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=context)
        try:
            futures = [
                pool.submit(measure_shape, *job, mix_lengths, programs_per_cu) for job in jobs
            ]
            by_job = []
            for i, future in enumerate(futures):
                by_job.append(future.result())
                common.progress(i, len(jobs), " ".join(map(str, jobs[i])))
        finally:
            # On an error, do not compile the rest before raising it.
            pool.shutdown(cancel_futures=True)
    else:
        by_job = []
        for i, job in enumerate(jobs):
            by_job.append(measure_shape(*job, mix_lengths, programs_per_cu))
            common.progress(i, len(jobs), " ".join(map(str, job)))
    rows = [row for job_rows, _ in by_job for row in job_rows]
    job_s = {
        " ".join(map(str, job)): seconds for job, (_, seconds) in zip(jobs, by_job, strict=True)
    }
    payload = {
        "benchmark": "schedule",
        "environment": common.environment(),
        "cost_model": {
            "program_cost": f"ceil(keys / 64) * 64 + {OVERHEAD_KEYS} key-units (a masked tile "
            "costs a full one)",
            "step_cost": f"stage-1 makespan + {MERGE_KEYS} x the most partials one unit "
            "merges (none when no unit is cut)",
            "piece_keys": PIECE_KEYS,
            "overhead_keys": OVERHEAD_KEYS,
            "merge_keys_per_partial": MERGE_KEYS,
            "calibration": "schedule.cost.OVERHEAD_KEYS / MERGE_KEYS "
            f"({OVERHEAD_KEYS} / {MERGE_KEYS}): the overhead is the fit of {FIT_FILE} "
            "(python -m benchmarks.schedule --fit), the merge derived from it (MERGE_KEYS's "
            "comment)",
            "balanced": "kernels.schedule.host_schedule's segments in its launch order, "
            "list-scheduled per pool; slot cost = sum over its segments of (end - first) + "
            "overhead",
            "old": "choose_num_kv_splits(B, G, mean, max, S) splits per request "
            "(schedule.uniform_schedule), programs in program-id order (group fastest, then "
            "split, then request) list-scheduled onto the earliest-free of S slots",
            "flashmla": "get_mla_metadata's dense scheduler over our units (request x group), "
            f"S parts, blocks of {FLASHMLA_BLOCK} keys, payload ceil(sum(blocks + "
            f"{FLASHMLA_OVERHEAD_BLOCKS}) / S) + {FLASHMLA_OVERHEAD_BLOCKS} blocks per part; "
            "each part costed as a persistent slot, its merge over the parts a unit spans",
            "lb_a": "max(G * sum(L) / S, 64) + overhead",
            "lb_b": "ceil(G * sum(ceil(L / 64)) / S) * 64 + overhead",
            "lb_c": "least M with S * f(max(K / S, 1)) >= pieces, K = sum over units of "
            "max(1, ceil(n / t)), t = floor((M - overhead) / 64), f the upper concave envelope "
            "of floor((M - overhead k) / 64) over k segments per slot",
            "lb_total": "for each of (a), (b), (c): the least M + merge(ceil(n_max / t_M)) over "
            "makespans M from that bound up (the bounds the costs are gated on)",
        },
        "gates": {
            "lb_c": f"balanced cost <= max({MAX_RATIO} x LB(c) total, LB(c) total + {PIECE_KEYS})",
            "max_ratio_lb_b": MAX_RATIO,
            "max_ratio_uniform": MAX_RATIO_UNIFORM,
            "uniform_mixes": [UNIFORM_MIX, dcp_name(UNIFORM_MIX)],
            "not_costlier_than_old": "every row: balanced cost <= the old uniform split's",
        },
        "targets": {
            t.key: {"backend": t.backend, "arch": t.arch, "num_cus": t.num_cus} for t in targets
        },
        "programs_per_cu_override": programs_per_cu,
        "page_size": PAGE_SIZE,
        "dcp": {"size": DCP_SIZE, "rank": DCP_RANK, "interleave": DCP_INTERLEAVE},
        "seed": SEED,
        "held_out_mixes": list(held_out_mixes()),
        "mixes": mix_lengths,
        "rows": rows,
    }
    fit_path = common.RESULTS_DIR / FIT_FILE
    if fit_path.exists():
        payload["cost_model"]["fit"] = fit(json.loads(fit_path.read_text())["rows"])
    payload["summary"] = summarize(payload)
    payload["wall_s"] = round(time.perf_counter() - start, 1)
    payload["job_s"] = job_s
    return payload


# ---- summary, markdown, plot ----------------------------------------------------------------


def _shape_name(row: dict) -> str:
    return f"H{row['H']} S_q{row['S_q']} {row['dtype']}"


def worst_row(rows: list[dict]) -> dict:
    return max(rows, key=lambda r: (r["ratio"]["balanced"]["lb_c"], r["ratio"]["old"]["lb_c"]))


def summarize(payload: dict) -> dict:
    rows = payload["rows"]
    out = {
        "rows": len(rows),
        "pass": sum(r["gates"]["pass"] for r in rows),
        "fail": sum(not r["gates"]["pass"] for r in rows),
        "bounds_violated": sum(not r["bounds_hold"] for r in rows),
        "balanced_at_lb_c": sum(r["cost"]["balanced"] == r["lb_total"]["lb_c"] for r in rows),
        "costlier_than_old": sum(not r["gates"]["not_costlier_than_old"] for r in rows),
        "held_out_rows": sum(r["held_out"] for r in rows),
        "by_target": {},
    }
    for key in payload["targets"]:
        mine = [r for r in rows if r["target"] == key]
        if not mine:
            continue
        worst = {
            f"{name}_{lb}": max(r["ratio"][name][lb] for r in mine)
            for name in ("balanced", "old", "flashmla")
            for lb in ("lb_b", "lb_a", "lb_c")
        }
        held_out = [r for r in mine if r["held_out"]]
        fail_c = [r for r in mine if not r["gates"]["lb_c"]]
        fail_b = [r for r in mine if not r["gates"]["lb_b"]]
        fail_a = [r for r in mine if not r["gates"]["lb_a"]]
        costlier = [r for r in mine if not r["gates"]["not_costlier_than_old"]]
        out["by_target"][key] = {
            "rows": len(mine),
            "pass": sum(r["gates"]["pass"] for r in mine),
            "worst": worst,
            "worst_row": {k: worst_row(mine)[k] for k in ("H", "S_q", "dtype", "mix")},
            "worst_balanced_over_old": max(r["balanced_over_old"] for r in mine),
            "geomean_balanced_over_old": round(
                math.exp(sum(math.log(r["balanced_over_old"]) for r in mine) / len(mine)), 4
            ),
            "worst_held_out_balanced_over_old": max(
                (r["balanced_over_old"] for r in held_out), default=None
            ),
            "worst_held_out_balanced_lb_c": max(
                (r["ratio"]["balanced"]["lb_c"] for r in held_out), default=None
            ),
            "costlier_than_old": len(costlier),
            "costlier_than_old_mixes": sorted({r["mix"] for r in costlier}),
            "fail_lb_c": len(fail_c),
            "fail_lb_c_mixes": sorted({r["mix"] for r in fail_c}),
            "fail_lb_b": len(fail_b),
            "fail_lb_b_mixes": sorted({r["mix"] for r in fail_b}),
            "fail_lb_a": len(fail_a),
            "fail_lb_a_mixes": sorted({r["mix"] for r in fail_a}),
            "over_lb_c": sum(r["ratio"]["balanced"]["lb_c"] > MAX_RATIO for r in mine),
            "balanced_at_lb_c": sum(r["cost"]["balanced"] == r["lb_total"]["lb_c"] for r in mine),
            "fail_uniform": sum(r["gates"]["uniform_lb_c"] is False for r in mine),
        }
    return out


def summary_line(payload: dict) -> str:
    s = payload["summary"]
    parts = [
        f"{key}: worst balanced/LB(c) {t['worst']['balanced_lb_c']} (held out "
        f"{t['worst_held_out_balanced_lb_c']}), /LB(b) {t['worst']['balanced_lb_b']}, /LB(a) "
        f"{t['worst']['balanced_lb_a']}; balanced/old worst {t['worst_balanced_over_old']} "
        f"(held out {t['worst_held_out_balanced_over_old']}), geomean "
        f"{t['geomean_balanced_over_old']}; {t['costlier_than_old']} rows costlier than old, "
        f"{t['fail_lb_c']} fail the LB(c) gate, balanced = LB(c) in "
        f"{t['balanced_at_lb_c']}/{t['rows']}"
        for key, t in s["by_target"].items()
    ]
    if s["bounds_violated"]:
        parts.append(f"BOUND VIOLATED in {s['bounds_violated']} rows (the model is wrong)")
    return (
        f"schedule: {s['pass']}/{s['rows']} rows pass the gates ({s['fail']} fail); "
        + "; ".join(parts)
    )


def markdown(payload: dict) -> str:
    env = payload["environment"]
    ppc = payload.get("programs_per_cu_override")
    model = payload["cost_model"]
    overhead, merge = model["overhead_keys"], model["merge_keys_per_partial"]
    lines = [
        f"# Decode schedule quality (no GPU), Triton {env['triton']}, {env['date']}",
        "",
        f"Cost model ({model['calibration']}): a program or segment walking k keys costs "
        f"ceil(k/64)*64 + {overhead} key-units; a step costs its makespan (the last slot to "
        "finish: list-scheduled in launch order) plus the merge, "
        f"{merge} per partial of the unit with the most. LB(a) = max(G * keys / S, 64) + "
        f"{overhead}, LB(b) = ceil(64-key pieces / S) * 64 + {overhead}, LB(c) = the least "
        "makespan segment counting allows, each with the least merge a makespan that low "
        f"forces. Gates: balanced <= max({MAX_RATIO} x LB(c), LB(c) + {PIECE_KEYS} keys) and "
        f"balanced <= old on every row; the uniform batch also balanced/LB(c) <= "
        f"{MAX_RATIO_UNIFORM}. Held-out mixes (not in the fit): "
        f"{', '.join(payload['held_out_mixes'])}. Wall time {payload['wall_s']} s"
        + (f"; programs_per_cu forced to {ppc}" if ppc else "")
        + ".",
        "",
        summary_line(payload),
        "",
    ]
    rows = payload["rows"]
    for key, target in payload["targets"].items():
        mine = [r for r in rows if r["target"] == key]
        if not mine:
            continue
        t = payload["summary"]["by_target"][key]
        lines += [
            f"## {key} ({target['num_cus']} compute units)",
            "",
            f"{t['pass']}/{t['rows']} rows pass. By mix, worst over the "
            f"{len({_shape_name(r) for r in mine})} shapes (its shape in brackets; * held out):",
            "",
            "| mix | B | balanced/LB(c) | balanced/LB(b) | balanced/LB(a) | balanced/old | "
            "old/LB(c) | FlashMLA/LB(c) | fail (gated: c, old) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for mix in dict.fromkeys(r["mix"] for r in mine):
            of_mix = [r for r in mine if r["mix"] == mix]
            worst = worst_row(of_mix)
            lines.append(
                f"| {mix}{' *' if worst['held_out'] else ''} | {worst['B']} | "
                f"{worst['ratio']['balanced']['lb_c']} [{_shape_name(worst)}] | "
                f"{max(r['ratio']['balanced']['lb_b'] for r in of_mix)} | "
                f"{max(r['ratio']['balanced']['lb_a'] for r in of_mix)} | "
                f"{max(r['balanced_over_old'] for r in of_mix)} | "
                f"{max(r['ratio']['old']['lb_c'] for r in of_mix)} | "
                f"{max(r['ratio']['flashmla']['lb_c'] for r in of_mix)} | "
                f"{sum(not r['gates']['lb_c'] for r in of_mix)}, "
                f"{sum(not r['gates']['not_costlier_than_old'] for r in of_mix)} |"
            )
        lines += [
            "",
            "By shape, worst over the mixes:",
            "",
            "| shape | block_h x block_n | G | programs/CU | S | balanced/LB(c) [mix] | "
            "balanced/old | old/LB(c) | FlashMLA/LB(c) | rows failing |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for shape in dict.fromkeys(_shape_name(r) for r in mine):
            of_shape = [r for r in mine if _shape_name(r) == shape]
            worst = worst_row(of_shape)
            slots = sorted({r["S"] for r in of_shape})
            lines.append(
                f"| {shape} | {worst['block_h']} x {worst['block_n']} | {worst['G']} | "
                f"{'/'.join(str(r) for r in sorted({r['programs_per_cu'] for r in of_shape}))} | "
                f"{'/'.join(map(str, slots))} | {worst['ratio']['balanced']['lb_c']} "
                f"[{worst['mix']}] | {max(r['balanced_over_old'] for r in of_shape)} | "
                f"{max(r['ratio']['old']['lb_c'] for r in of_shape)} | "
                f"{max(r['ratio']['flashmla']['lb_c'] for r in of_shape)} | "
                f"{sum(not r['gates']['pass'] for r in of_shape)} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(payload: dict, path: Path) -> None:
    """Per-slot loads of the worst row: old (before) vs balanced (after), FlashMLA, bounds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    row = worst_row(payload["rows"])
    lengths = payload["mixes"][row["mix"]]
    groups, slots = row["G"], row["S"]
    merge = payload["cost_model"]["merge_keys_per_partial"]
    series = {
        f"old uniform split ({row['old_splits']} splits)": old_loads(
            lengths, groups, slots, row["old_splits"]
        ),
        "balanced (ours)": balanced_loads(lengths, groups, slots, row.get("pools", 1))["loads"],
        "FlashMLA reference": flashmla_loads(lengths, groups, slots)[0],
    }
    names = dict(zip(series, ("old", "balanced", "flashmla"), strict=True))
    fig, axes = plt.subplots(1, 2, figsize=(15, 5), sharey=True)
    for ax, ordered in zip(axes, (False, True), strict=True):
        for (name, loads), style in zip(series.items(), ("-", "-", ":"), strict=True):
            ys = sorted(loads, reverse=True) if ordered else loads
            chain = row["chain"][names[name]]
            ax.step(
                range(slots),
                ys,
                style,
                where="mid",
                label=f"{name}: max {max(loads)}, then a merge of {chain} ({chain * merge})",
            )
        ax.axhline(row["lb_b"], color="k", linestyle="--", label=f"LB(b) {row['lb_b']}")
        ax.axhline(row["lb_a"], color="gray", linestyle="-.", label=f"LB(a) {row['lb_a']}")
        if row["lb_c"] != row["lb_b"]:
            ax.axhline(row["lb_c"], color="tab:red", linestyle=":", label=f"LB(c) {row['lb_c']}")
        ax.set_xlabel("slot, sorted by load" if ordered else "slot (launch order)")
        ax.set_ylim(bottom=0)
    overhead = payload["cost_model"]["overhead_keys"]
    axes[0].set_ylabel(f"load, key-units (ceil(k/64)*64 + {overhead} per program/segment)")
    axes[1].legend(fontsize=8)
    fig.suptitle(
        f"Worst row for the balanced schedule: {row['target']} {_shape_name(row)}, "
        f"{row['mix']} (B {row['B']}, G {groups}, S {slots}); cost balanced/LB(c) "
        f"{row['ratio']['balanced']['lb_c']}, balanced/old {row['balanced_over_old']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the calibration ------------------------------------------------------------------------

#: The fit's input: every schedule ``schedule_gpu`` timed on an H200 (``--fit``).
FIT_FILE = "schedule-fit-nvidia-h200-2026-12-04.json"
#: The grids the fit searches: the overhead (keys per program) and the merge (keys per
#: partial of the longest chain).
FIT_OVERHEADS = range(0, 1025, 16)
#: The shapes fitted: the bf16 ones (the fp8 walk of 4600785 waited on shared-memory bank
#: conflicts, whatever the schedule).
FIT_SHAPES = ("H16 S_q1 bf16", "H128 S_q1 bf16")
FIT_MERGES = (0, 1, 2, 4, 6, 8, 10, 12, 16, 24, 32)


def fit(rows: list[dict]) -> dict:
    """Least-absolute-deviation fit of the cost model's two constants to timings: ``time =
    c0[shape] + c[shape] x (makespan + merge_cost(chain))`` over ``rows`` (``FIT_FILE``'s:
    each timed schedule's programs, its longest merge chain, its time), the makespan
    ``schedule.cost.list_schedule``'s with ``o`` keys per program and the merge
    ``merge_cost``'s at ``m`` keys per partial: the model ``cost.py`` defines, with ``(o,
    m)`` in place of its ``OVERHEAD_KEYS`` and ``MERGE_KEYS``, searched over
    ``FIT_OVERHEADS`` x ``FIT_MERGES``; ``c0`` and ``c`` per shape by iteratively
    reweighted least squares. Returns the best ``(o, m)`` beside ``cost.py``'s values
    (``calibrated``), the per-shape constants, every residual, and the mean |residual|
    along each axis through the best (how sharply the data pins each constant)."""
    import numpy as np

    rows = [r for r in rows if r["shape"] in FIT_SHAPES]
    shapes = sorted({r["shape"] for r in rows})
    times = np.array([r["time_us"] for r in rows])
    # Each row's makespan at each overhead (one pool: the H200 timed).
    makespans = {
        o: [max(list_schedule(enumerate(r["program_keys"]), r["slots"], 1, o)) for r in rows]
        for o in FIT_OVERHEADS
    }

    def solve(overhead: int, merge: int):
        design = np.zeros((len(rows), 2 * len(shapes)))
        for i, r in enumerate(rows):
            k = shapes.index(r["shape"])
            keys = makespans[overhead][i] + merge_cost(r["chain"], merge)
            design[i, 2 * k], design[i, 2 * k + 1] = 1.0, keys
        weight = np.ones(len(rows))
        for _ in range(50):
            root = np.sqrt(weight)
            coef = np.linalg.lstsq(design * root[:, None], times * root, rcond=None)[0]
            weight = 1 / np.maximum(np.abs(times - design @ coef), 1.0)
        return coef, times - design @ coef

    grid = {(o, m): solve(o, m) for o in FIT_OVERHEADS for m in FIT_MERGES}
    best = min(grid, key=lambda key: np.abs(grid[key][1]).sum())
    coef, residuals = grid[best]
    absolute = np.abs(residuals)
    return {
        "overhead_keys": best[0],
        "merge_keys_per_partial": best[1],
        "calibrated": {"overhead_keys": OVERHEAD_KEYS, "merge_keys_per_partial": MERGE_KEYS},
        "shapes": {
            shape: {
                "us_per_key": round(float(coef[2 * k + 1]), 5),
                "c0_us": round(float(coef[2 * k]), 2),
            }
            for k, shape in enumerate(shapes)
        },
        "abs_residual_us": {
            "median": round(float(np.median(absolute)), 1),
            "mean": round(float(absolute.mean()), 1),
            "max": round(float(absolute.max()), 1),
        },
        "mean_abs_residual_by_overhead": {
            o: round(float(np.abs(grid[o, best[1]][1]).mean()), 2) for o in FIT_OVERHEADS
        },
        "mean_abs_residual_by_merge": {
            m: round(float(np.abs(grid[best[0], m][1]).mean()), 2) for m in FIT_MERGES
        },
        "residuals": [
            {
                "mix": r["mix"],
                "shape": r["shape"],
                "schedule": r["schedule"],
                "time_us": r["time_us"],
                "residual_us": round(float(e), 1),
            }
            for r, e in zip(rows, residuals, strict=True)
        ],
    }


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.schedule", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--targets",
        default=",".join(TARGETS),
        help=f"comma-separated subset of {','.join(TARGETS)}",
    )
    parser.add_argument("--workers", type=int, default=2, help="processes (compiles dominate)")
    parser.add_argument(
        "--programs-per-cu",
        type=int,
        default=None,
        help="skip the compiles: assume this many resident programs per CU for every shape",
    )
    parser.add_argument("--out", type=Path, help="results folder (default: benchmarks/results)")
    parser.add_argument(
        "--render", type=Path, help="only rewrite the .md and .png of this JSON (no compiling)"
    )
    parser.add_argument(
        "--fit",
        type=Path,
        nargs="?",
        const=common.RESULTS_DIR / FIT_FILE,
        help=f"only fit the cost model to a schedule-fit JSON (default {FIT_FILE}) and print it",
    )
    args = parser.parse_args(argv)
    if args.fit is not None:
        result = fit(json.loads(args.fit.read_text())["rows"])
        print(json.dumps({k: v for k, v in result.items() if k != "residuals"}, indent=1))
        for r in result["residuals"]:
            print(
                f"{r['mix']:30s} {r['shape']:16s} {r['schedule']:9s} {r['time_us']:8.1f} us "
                f"residual {r['residual_us']:+7.1f}"
            )
        return args.fit
    if args.render is not None:
        payload = json.loads(args.render.read_text())
        args.render.with_suffix(".md").write_text(markdown(payload))
        plot(payload, args.render.with_suffix(".png"))
        return args.render
    names = [t for t in args.targets.split(",") if t]
    unknown = [t for t in names if t not in TARGETS]
    if unknown or not names:
        parser.error(f"--targets: expected a subset of {','.join(TARGETS)}, got {args.targets!r}")
    if args.workers < 1:
        parser.error(f"--workers: expected >= 1, got {args.workers}")
    if args.programs_per_cu is not None and args.programs_per_cu < 1:
        parser.error(f"--programs-per-cu: expected >= 1, got {args.programs_per_cu}")
    payload = run(
        [TARGETS[t] for t in names], workers=args.workers, programs_per_cu=args.programs_per_cu
    )
    path = common.write_results("schedule", payload, args.out)
    path.with_suffix(".md").write_text(markdown(payload))
    plot(payload, path.with_suffix(".png"))
    print(markdown(payload))
    print(summary_line(payload))
    print(f"wrote {path} (+ .md, .png) in {payload['wall_s']} s")
    return path


if __name__ == "__main__":
    main()
