"""Decode schedule quality of the Triton MLA decode, without a GPU: how evenly each planner
spreads a decode step's keys over the resident stage-1 programs, in one stated cost model.

For sm90 (132 SMs), gfx942 (304 CUs) and gfx950 (256 CUs), every shape H in 12/16/96/128 x
S_q in 1/4/8 x KV bf16/fp8 (fp8: e4m3fnuz on gfx942, e4m3fn elsewhere; q bf16), and every
length mix (``base_mixes``, fixed and seeded, each also as a DCP-8 rank 0's share from
``rocm_mla.dcp.local_seq_lens``; H is unchanged there, DCP gathers the heads), the launch is
the one ``plan.plan_launch`` plans for the shape (KV cache bytes = the mix's keys x 576 x
itemsize, page 64): config = ``_group_config(default_config(...), S_q*H)``, ``G = ceil(S_q*H
/ block_h)`` row groups, and ``S = compute units x programs_per_cu`` resident slots,
``programs_per_cu`` being the compiled stage 1's occupancy for the target
(``kernels.occupancy``: one compile per shape, no GPU needed; the compiles dominate the run,
so rerunning after a kernel change is all it takes to refresh; ``--programs-per-cu N``
skips them).

Cost model (key-units; ``schedule.PIECE_KEYS`` = 64, ``schedule.OVERHEAD_KEYS`` = 84 =
``plan.SPLIT_OVERHEAD_TOKENS``): a program or segment walking ``k`` keys costs
``ceil(k / 64) * 64 + 84`` (a masked tile costs as much as a full one; 84 is its prologue,
partial and merge read-back). A zero-length one costs 84. Per schedule:

- balanced (ours, ``kernels.schedule.host_schedule``): one program per segment in the
  planner's launch order (``kernels.schedule``: "Launch order"), list-scheduled onto the
  earliest-free slot of the program's pool (AMD: XCD ``p % 8``, ``S / 8`` slots each; one
  pool on sm90), each costing ``(end - first) + 84`` (segments are whole 64-key pieces);
  makespan = the last finish, checked to be within the packing's own (its largest slot
  load, ``planned_makespan`` in the JSON).
- old uniform split (``plan.choose_num_kv_splits(B, G, mean, max, S)``): every request in that
  many splits, split ``i`` covering ``[i * chunk, (i + 1) * chunk)`` clipped to ``L``, with
  ``chunk = ceil(ceil(L / splits) / block_n) * block_n``; programs in the old kernel's launch
  order (program id: group fastest, then split, then request; the AMD XCD remap is ignored),
  each list-scheduled onto the earliest-free of ``S`` slots (ties: the lowest slot);
  makespan = the last finish.
- FlashMLA reference: its documented dense-decode scheduler (``get_mla_metadata``): blocks
  of 64 keys, total = sum over units of (blocks + 5), each of ``S`` parts takes a payload of
  ``ceil(total / S) + 5`` blocks in unit order, a unit whole when its remaining blocks + 5
  fit, else the part takes what fits beyond the 5 and the unit continues in the next part.
  Here it runs over our units (request x row group, as ours does) with one part per slot,
  and each part is costed as a persistent slot like ours.

Lower bounds on any schedule's makespan in this model: (a) ``max(G * sum(L) / S, 64) + 84``
(every key spread evenly over the slots, no program shorter than one tile, one overhead
each); (b) ``ceil(P / S) * 64 + 84`` with ``P`` the 64-key pieces over all units (some slot
holds that many whole pieces). Also reported, not gated: (c) the least makespan ``M`` not
ruled out by counting segments (a slot of ``k`` segments holds at most ``floor((M - 84k) /
64)`` pieces, a unit of ``n`` pieces needs ``max(1, ceil(n / floor((M - 84) / 64)))``
segments; ``_makespan_possible``): (b) charges one overhead per slot, (c) every segment's, so
rows with more units than slots or cut units show there how far the schedule is from the
best possible one. Every schedule's makespan is checked against all three (``bounds_hold``).

Gates per row (recorded, never fatal: the command prints a summary line and exits 0):
balanced <= 1.15 x (c), or within one piece (64 keys) of (c); for the uniform batch (8 x 32K
and its DCP share) also balanced / (c) <= 1.05 and balanced <= old. The bound gated is (c),
the tightest of the three, because (a) and (b) cannot be met where slots hold few pieces: a
DCP-8 share of 32 short requests leaves 4-5 pieces a slot, every cut adds an overhead (84
keys, 1.3 pieces) that (b) does not charge, and one piece more on the busiest slot is
already 1.19 x (b). (c) is a relaxation (it counts segments, it packs nothing), and a slot
takes whole pieces, so one piece over it is the allowance there. (a) and (b) stay reported,
with their own 1.15 counts.

Output: JSON (every row), markdown (tables per target) and
a PNG (per-slot loads of the worst row: old vs balanced, FlashMLA, the bounds) under
``benchmarks/results/``. On a 2-core machine the 72 compiles take about 4-10 minutes cold
(Triton's cache then makes a rerun take under a minute).

    python -m benchmarks.schedule [--targets sm90,gfx942,gfx950] [--workers 2]
        [--programs-per-cu N] [--render JSON]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import heapq
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


def dcp_name(name: str) -> str:
    return f"{name} / DCP{DCP_SIZE} rank {DCP_RANK}"


def mixes() -> dict[str, list[int]]:
    """Every mix, each followed by DCP-8 rank 0's share of it."""
    from rocm_mla.dcp.layout import local_seq_lens

    out = {}
    for name, lengths in base_mixes().items():
        out[name] = lengths
        local = local_seq_lens(
            torch.tensor(lengths, dtype=torch.int64), DCP_SIZE, DCP_RANK, DCP_INTERLEAVE
        )
        out[dcp_name(name)] = [int(x) for x in local.tolist()]
    return out


# ---- the cost model and the three schedules -------------------------------------------------


def _overhead() -> int:
    from rocm_mla.kernels.schedule import OVERHEAD_KEYS

    return OVERHEAD_KEYS


def _piece() -> int:
    from rocm_mla.kernels.schedule import PIECE_KEYS

    return PIECE_KEYS


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def cost(keys: int) -> int:
    """A program / segment walking ``keys`` keys: whole 64-key tiles plus the overhead."""
    piece = _piece()
    return -(-max(keys, 0) // piece) * piece + _overhead()


def lower_bounds(lengths: list[int], num_groups: int, num_slots: int) -> tuple[float, int]:
    """(a) and (b) of the module docstring."""
    piece, overhead = _piece(), _overhead()
    keys = num_groups * sum(max(n, 0) for n in lengths)
    pieces = num_groups * sum(-(-max(n, 0) // piece) for n in lengths)
    lb_a = max(keys / num_slots, piece) + overhead
    lb_b = -(-pieces // num_slots) * piece + overhead
    return lb_a, lb_b


def _makespan_possible(lengths: list[int], num_groups: int, num_slots: int, span: int) -> bool:
    """False when no schedule in the cost model has makespan <= ``span`` (a relaxation: True
    does not promise one). A slot of ``k`` segments holds at most ``c_k = floor((span -
    84k) / 64)`` pieces, a segment at most ``t = c_1``, so unit ``u`` needs ``m_u >=
    max(1, ceil(n_u / t))`` segments; the ``K = sum m_u`` segments over ``S`` slots hold at
    most ``S * f(max(K / S, 1))`` pieces, ``f`` the upper concave envelope of ``c_k``."""
    piece, overhead = _piece(), _overhead()
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


def balanced_loads(lengths: list[int], num_groups: int, num_slots: int, num_pools: int) -> dict:
    """Per-slot finish times of ``host_schedule``'s launch order, list-scheduled per pool
    (``loads``), the packing's own slot loads (``planned``), and what they cut."""
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
    overhead = _overhead()
    loads = []
    covered = [0] * (len(lengths) * num_groups)
    for s in range(num_slots):
        load = 0
        for unit, first, end, _ in segments[bounds[s] : bounds[s + 1]]:
            load += end - first + overhead
            covered[unit] += end - first
        loads.append(load)
    piece = _piece()
    for u, keys in enumerate(covered):
        want = -(-max(lengths[u // num_groups], 0) // piece) * piece
        if keys != want:
            raise RuntimeError(f"balanced schedule covers {keys} keys of unit {u}, not {want}")
    split = [u for u in tables.split_units.tolist() if u >= 0]
    ran = list_scheduled_loads(schedule_entries(tables), num_slots, num_pools, overhead)
    if max(ran) > max(loads):
        raise RuntimeError(f"launch order ran {max(ran)} past the plan's {max(loads)}")
    return {"loads": ran, "planned": loads, "split_units": len(split)}


def old_programs(lengths: list[int], num_groups: int, splits: int, block_n: int) -> list[int]:
    """Keys of each program of the old uniform-split launch, in program-id order."""
    keys = []
    for length in lengths:
        length = max(length, 0)
        chunk = _cdiv(_cdiv(length, splits), block_n) * block_n
        for split in range(splits):
            start = min(split * chunk, length)
            end = min(start + chunk, length)
            keys += [end - start] * num_groups
    return keys


def old_loads(
    lengths: list[int], num_groups: int, num_slots: int, splits: int, block_n: int
) -> list[int]:
    """List scheduling of the old launch in program-id order onto ``num_slots`` slots
    (earliest free first; no idle gaps, so a slot's load is its finish time)."""
    free = [(0, s) for s in range(num_slots)]
    loads = [0] * num_slots
    for keys in old_programs(lengths, num_groups, splits, block_n):
        finish, slot = heapq.heappop(free)
        loads[slot] = finish + cost(keys)
        heapq.heappush(free, (loads[slot], slot))
    return loads


def flashmla_loads(lengths: list[int], num_groups: int, num_parts: int) -> list[int]:
    """FlashMLA's dense-decode part schedule over our units, costed per part (docstring)."""
    blocks = [-(-max(n, 0) // FLASHMLA_BLOCK) for n in lengths for _ in range(num_groups)]
    total = sum(b + FLASHMLA_OVERHEAD_BLOCKS for b in blocks)
    payload = -(-total // num_parts) + FLASHMLA_OVERHEAD_BLOCKS
    overhead = _overhead()
    loads = []
    unit, done = 0, 0  # the unit being walked and its blocks already given out
    for _ in range(num_parts):
        left, load = payload, 0
        while unit < len(blocks):
            remaining = blocks[unit] - done
            if left >= remaining + FLASHMLA_OVERHEAD_BLOCKS:
                load += remaining * FLASHMLA_BLOCK + overhead
                left -= remaining + FLASHMLA_OVERHEAD_BLOCKS
                unit, done = unit + 1, 0
                continue
            if left > FLASHMLA_OVERHEAD_BLOCKS:
                take = left - FLASHMLA_OVERHEAD_BLOCKS
                load += take * FLASHMLA_BLOCK + overhead
                done += take
            break
        loads.append(load)
    if unit < len(blocks):
        raise RuntimeError(f"FlashMLA schedule left units {unit}.. of {len(blocks)} unassigned")
    return loads


# ---- rows ---------------------------------------------------------------------------------


def _plan(target: Target, heads: int, q_len: int, kind: str, lengths: list[int], ppc):
    """(config, G, programs per CU, S, old splits) for one shape and mix: the config and
    slots ``plan.plan_launch`` plans (it compiles stage 1 once per shape for the occupancy),
    or with ``ppc`` given its config and ``num_cus * ppc`` slots without compiling."""
    import triton

    from rocm_mla.kernels import plan
    from rocm_mla.kernels.mla_decode_args import _group_config, default_config

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
        config = _group_config(
            default_config(tt, num_heads=heads, q_len=q_len, kv_dtype=kv), q_len * heads
        )
        slots = target.num_cus * ppc
    groups = triton.cdiv(q_len * heads, config.block_h)
    splits = plan.choose_num_kv_splits(batch, groups, total / max(batch, 1), longest, slots)
    return config, groups, ppc, slots, splits


def measure(target: Target, heads: int, q_len: int, kind: str, mix: str, lengths, ppc=None):
    """One row: the three schedules' makespans, the bounds, ratios and gates."""
    config, groups, ppc, slots, splits = _plan(target, heads, q_len, kind, lengths, ppc)
    lb_a, lb_b = lower_bounds(lengths, groups, slots)
    balanced = balanced_loads(lengths, groups, slots, config.num_xcds)
    makespans = {
        "old": max(old_loads(lengths, groups, slots, splits, config.block_n)),
        "balanced": max(balanced["loads"]),
        "flashmla": max(flashmla_loads(lengths, groups, slots)),
    }
    lb_c = lower_bound_c(lengths, groups, slots, lb_b, makespans["balanced"])
    # Every schedule is one of the model's, so no bound may exceed its makespan.
    bounds_hold = lb_c is not None and all(
        m >= max(lb_a, lb_b) and _makespan_possible(lengths, groups, slots, m)
        for m in makespans.values()
    )
    lb_c = lb_b if lb_c is None else lb_c
    ratios = {
        name: {
            "lb_a": round(m / lb_a, 4),
            "lb_b": round(m / lb_b, 4),
            "lb_c": round(m / lb_c, 4),
        }
        for name, m in makespans.items()
    }
    uniform = mix in (UNIFORM_MIX, dcp_name(UNIFORM_MIX))
    gates = {
        "lb_c": makespans["balanced"] <= max(MAX_RATIO * lb_c, lb_c + _piece()),
        "lb_b": ratios["balanced"]["lb_b"] <= MAX_RATIO,
        "lb_a": ratios["balanced"]["lb_a"] <= MAX_RATIO,
        "uniform_lb_c": ratios["balanced"]["lb_c"] <= MAX_RATIO_UNIFORM if uniform else None,
        "uniform_not_worse_than_old": makespans["balanced"] <= makespans["old"]
        if uniform
        else None,
    }
    gates["pass"] = gates["lb_c"] and gates["uniform_lb_c"] is not False
    gates["pass"] = gates["pass"] and gates["uniform_not_worse_than_old"] is not False
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
        "bounds_hold": bounds_hold,
        "makespan": makespans,
        "ratio": ratios,
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
            "program_cost": "ceil(keys / 64) * 64 + 84 key-units (a masked tile costs a full one)",
            "piece_keys": _piece(),
            "overhead_keys": _overhead(),
            "balanced": "persistent: slot load = sum over its segments of (end - first) + 84; "
            "makespan = max slot load",
            "old": "choose_num_kv_splits(B, G, mean, max, S) splits per request, programs in "
            "program-id order (group fastest, then split, then request) list-scheduled onto "
            "the earliest-free of S slots; makespan = last finish",
            "flashmla": "get_mla_metadata's dense scheduler over our units (request x group), "
            f"S parts, blocks of {FLASHMLA_BLOCK} keys, payload ceil(sum(blocks + "
            f"{FLASHMLA_OVERHEAD_BLOCKS}) / S) + {FLASHMLA_OVERHEAD_BLOCKS} blocks per part; "
            "each part costed as a persistent slot",
            "lb_a": "max(G * sum(L) / S, 64) + 84",
            "lb_b": "ceil(G * sum(ceil(L / 64)) / S) * 64 + 84",
            "lb_c": "least M with S * f(max(K / S, 1)) >= pieces, K = sum over units of "
            "max(1, ceil(n / t)), t = floor((M - 84) / 64), f the upper concave envelope of "
            "floor((M - 84 k) / 64) over k segments per slot (the gated bound)",
        },
        "gates": {
            "lb_c": f"balanced <= max({MAX_RATIO} x LB(c), LB(c) + {_piece()})",
            "max_ratio_lb_b": MAX_RATIO,
            "max_ratio_uniform": MAX_RATIO_UNIFORM,
            "uniform_mixes": [UNIFORM_MIX, dcp_name(UNIFORM_MIX)],
            "uniform_not_worse_than_old": True,
        },
        "targets": {
            t.key: {"backend": t.backend, "arch": t.arch, "num_cus": t.num_cus} for t in targets
        },
        "programs_per_cu_override": programs_per_cu,
        "page_size": PAGE_SIZE,
        "dcp": {"size": DCP_SIZE, "rank": DCP_RANK, "interleave": DCP_INTERLEAVE},
        "seed": SEED,
        "mixes": mix_lengths,
        "rows": rows,
    }
    payload["summary"] = summarize(payload)
    payload["wall_s"] = round(time.perf_counter() - start, 1)
    payload["job_s"] = job_s
    return payload


# ---- summary, markdown, plot ----------------------------------------------------------------


def _shape_name(row: dict) -> str:
    return f"H{row['H']} S_q{row['S_q']} {row['dtype']}"


def worst_row(rows: list[dict]) -> dict:
    return max(rows, key=lambda r: (r["ratio"]["balanced"]["lb_b"], r["ratio"]["old"]["lb_b"]))


def summarize(payload: dict) -> dict:
    rows = payload["rows"]
    out = {
        "rows": len(rows),
        "pass": sum(r["gates"]["pass"] for r in rows),
        "fail": sum(not r["gates"]["pass"] for r in rows),
        "bounds_violated": sum(not r["bounds_hold"] for r in rows),
        "balanced_at_lb_c": sum(r["makespan"]["balanced"] == r["lb_c"] for r in rows),
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
        fail_c = [r for r in mine if not r["gates"]["lb_c"]]
        fail_b = [r for r in mine if not r["gates"]["lb_b"]]
        fail_a = [r for r in mine if not r["gates"]["lb_a"]]
        out["by_target"][key] = {
            "rows": len(mine),
            "pass": sum(r["gates"]["pass"] for r in mine),
            "worst": worst,
            "worst_row": {k: worst_row(mine)[k] for k in ("H", "S_q", "dtype", "mix")},
            "fail_lb_c": len(fail_c),
            "fail_lb_c_mixes": sorted({r["mix"] for r in fail_c}),
            "fail_lb_b": len(fail_b),
            "fail_lb_b_mixes": sorted({r["mix"] for r in fail_b}),
            "fail_lb_a": len(fail_a),
            "fail_lb_a_mixes": sorted({r["mix"] for r in fail_a}),
            "over_lb_c": sum(r["ratio"]["balanced"]["lb_c"] > MAX_RATIO for r in mine),
            "balanced_at_lb_c": sum(r["makespan"]["balanced"] == r["lb_c"] for r in mine),
            "fail_uniform": sum(
                r["gates"]["uniform_lb_c"] is False
                or r["gates"]["uniform_not_worse_than_old"] is False
                for r in mine
            ),
        }
    return out


def summary_line(payload: dict) -> str:
    s = payload["summary"]
    parts = [
        f"{key}: worst balanced/LB(b) {t['worst']['balanced_lb_b']}, /LB(a) "
        f"{t['worst']['balanced_lb_a']}, old/LB(b) {t['worst']['old_lb_b']}, "
        f"{t['fail_lb_b']} over {MAX_RATIO} x (b) and {t['fail_lb_a']} over {MAX_RATIO} x (a), "
        f"worst balanced/LB(c) {t['worst']['balanced_lb_c']}, {t['fail_lb_c']} fail the "
        f"LB(c) gate, balanced = LB(c) in "
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
    lines = [
        f"# Decode schedule quality (no GPU), Triton {env['triton']}, {env['date']}",
        "",
        "Cost model: a program or segment walking k keys costs ceil(k/64)*64 + 84 key-units; "
        "makespan = the most loaded slot (balanced, FlashMLA: persistent; old: list-scheduled "
        "in launch order). LB(b) = ceil(64-key pieces / S) * 64 + 84, LB(a) = "
        "max(G * keys / S, 64) + 84, LB(c) = the least makespan segment counting allows "
        "(every segment pays 84). Gate: balanced <= max("
        f"{MAX_RATIO} x LB(c), LB(c) + {_piece()} keys); the uniform batch also balanced/LB(c) "
        f"<= {MAX_RATIO_UNIFORM} and balanced <= old. "
        f"Wall time {payload['wall_s']} s"
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
            f"{len({_shape_name(r) for r in mine})} shapes (its shape in brackets):",
            "",
            "| mix | B | balanced/LB(b) | balanced/LB(a) | balanced/LB(c) | old/LB(b) | "
            "FlashMLA/LB(b) | fail (gated: c) | over 1.15 x (b) | over 1.15 x (a) |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for mix in dict.fromkeys(r["mix"] for r in mine):
            of_mix = [r for r in mine if r["mix"] == mix]
            worst = worst_row(of_mix)
            lines.append(
                f"| {mix} | {worst['B']} | {worst['ratio']['balanced']['lb_b']} "
                f"[{_shape_name(worst)}] | "
                f"{max(r['ratio']['balanced']['lb_a'] for r in of_mix)} | "
                f"{max(r['ratio']['balanced']['lb_c'] for r in of_mix)} | "
                f"{max(r['ratio']['old']['lb_b'] for r in of_mix)} | "
                f"{max(r['ratio']['flashmla']['lb_b'] for r in of_mix)} | "
                f"{sum(not r['gates']['lb_c'] for r in of_mix)} | "
                f"{sum(not r['gates']['lb_b'] for r in of_mix)} | "
                f"{sum(not r['gates']['lb_a'] for r in of_mix)} |"
            )
        lines += [
            "",
            "By shape, worst over the mixes:",
            "",
            "| shape | block_h x block_n | G | programs/CU | S | balanced/LB(b) [mix] | "
            "balanced/LB(c) | old/LB(b) | FlashMLA/LB(b) | rows failing |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for shape in dict.fromkeys(_shape_name(r) for r in mine):
            of_shape = [r for r in mine if _shape_name(r) == shape]
            worst = worst_row(of_shape)
            slots = sorted({r["S"] for r in of_shape})
            lines.append(
                f"| {shape} | {worst['block_h']} x {worst['block_n']} | {worst['G']} | "
                f"{'/'.join(str(r) for r in sorted({r['programs_per_cu'] for r in of_shape}))} | "
                f"{'/'.join(map(str, slots))} | {worst['ratio']['balanced']['lb_b']} "
                f"[{worst['mix']}] | {max(r['ratio']['balanced']['lb_c'] for r in of_shape)} | "
                f"{max(r['ratio']['old']['lb_b'] for r in of_shape)} | "
                f"{max(r['ratio']['flashmla']['lb_b'] for r in of_shape)} | "
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
    series = {
        f"old uniform split ({row['old_splits']} splits)": old_loads(
            lengths, groups, slots, row["old_splits"], row["block_n"]
        ),
        "balanced (ours)": balanced_loads(lengths, groups, slots, row.get("pools", 1))["loads"],
        "FlashMLA reference": flashmla_loads(lengths, groups, slots),
    }
    fig, axes = plt.subplots(1, 2, figsize=(15, 5), sharey=True)
    for ax, ordered in zip(axes, (False, True), strict=True):
        for (name, loads), style in zip(series.items(), ("-", "-", ":"), strict=True):
            ys = sorted(loads, reverse=True) if ordered else loads
            ax.step(range(slots), ys, style, where="mid", label=f"{name}: max {max(loads)}")
        ax.axhline(row["lb_b"], color="k", linestyle="--", label=f"LB(b) {row['lb_b']}")
        ax.axhline(row["lb_a"], color="gray", linestyle="-.", label=f"LB(a) {row['lb_a']}")
        if row.get("lb_c", row["lb_b"]) != row["lb_b"]:
            ax.axhline(row["lb_c"], color="tab:red", linestyle=":", label=f"LB(c) {row['lb_c']}")
        ax.set_xlabel("slot, sorted by load" if ordered else "slot (launch order)")
        ax.set_ylim(bottom=0)
    axes[0].set_ylabel("load, key-units (ceil(k/64)*64 + 84 per program/segment)")
    axes[1].legend(fontsize=8)
    fig.suptitle(
        f"Worst row for the balanced schedule: {row['target']} {_shape_name(row)}, "
        f"{row['mix']} (B {row['B']}, G {groups}, S {slots}); balanced/LB(b) "
        f"{row['ratio']['balanced']['lb_b']}, old/LB(b) {row['ratio']['old']['lb_b']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    args = parser.parse_args(argv)
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
