"""The compile-level gate of the Triton MLA decode (issues 20, 37): what the compiled code does
on the case targets (``CASE_TARGETS``), measured without a GPU, under any Triton from 3.4 to 3.9.

For every case (a decode shape Kimi-K3 runs at, or H16 / H128) and batch (8, 32, 128 requests
of a 32K context, page 64), the real host launcher ``mla_decode`` runs on ``meta`` tensors with
a stand-in ``TritonTarget`` for each GPU and with every ``@triton.jit`` function of the kernel
modules swapped for a recorder. Each recorded launch is specialized by Triton's own binder for
that target (an int 1 becomes a constexpr, ints and pointers divisible by 16 get divisibility
hints, HIP buffer ops only for tensors whose storage is under 2 GiB), compiled once per distinct
specialization with the planner's own compile (``occupancy.compile_for``, two processes), and
read back by ``benchmarks/isa.py``'s readers:

- sm90: ``cuobjdump -res-usage`` (registers of the built cubin), Triton's ptxas log (spill bytes),
  the SASS of the main loop (the body of the innermost backward branch that holds the most
  matrix instructions), the TTGIR (shared buffers, async copies, register round trips).
- AMD: the amdgcn text (``NumVgprs``, ``NumAgprs`` where the target has AGPRs, SGPRs, spill
  counts, LLVM's occupancy, the main loop's blocks by LLVM's loop comments; MFMA on CDNA3/4,
  WMMA on gfx1250) and the TTGIR.

In both, the main loop's shared-memory loads and stores are counted by opcode and width
(sm90 ``LDS``/``STS``/``LDSM``/``STSM`` with their suffixes, AMD ``ds_read``/``ds_write``/
``ds_load``/``ds_store`` with their types), with the bytes they move per iteration over the
bytes of the KV tile the iteration loads.

"Main loop" is the KV walk: in every reader, the innermost loop (one holding no other loop
with matrix ops) with the most of them, since stage 1's loop over its slot's segments
encloses the walk (and the iterations the pipeliner peels off it).

From those: resident programs per SM/CU (``rocm_mla.kernels.residency``), matrix MACs issued
per KV tile against the useful ones, how the balanced schedule fills the grid, KV tile loads
per request, the tensor-issue ceiling as a share of HBM peak, and the gates of issue 20 per
case and target. Output: JSON (every gate's verdict with its evidence), PNG and a markdown
table under ``benchmarks/results/``.

The decode runs a balanced persistent schedule (``rocm_mla.kernels.schedule``): ``plan_launch``
gives the config and the slots ``S = units x programs_per_cu``, and ``mla_decode(config=,
num_slots=S)`` launches three kernels, all recorded and compiled: the planner
(``_plan_schedule_kernel``, one program), stage 1 (one program per slot, grid ``S``) and the
merge of the cut units' partials (``_merge_pieces_kernel``). The schedule itself is data (the
lengths are meta tensors here), so its figures come from ``host_schedule`` on the case's
lengths (every request ``context`` keys), which writes the device planner's tables. The
gates, as measured now:

- ``compiles``: the case plans and every kernel it launches compiles. A plan the planner
  refuses by name (a ``ValueError``, e.g. a Triton below the target's floor) is not
  applicable; any other failure fails, and the case's other gates are not computed.
- ``no_spills``: no spill in any of the three kernels (the planner included).
- ``issued_over_useful``, ``kv_loads_overlap``, ``guard_without_round_trip``: stage 1's KV
  loop, unchanged.
- ``fp8_matrix_op``: with an fp8 cache the loop's Q.K^T runs fp8 matrix ops and no matrix op
  is bf16 (P.V runs fp16 on V converted as loaded; before issue 37 it ran fp8, which needs
  V transposed byte by byte).
- ``whole_waves``: the grid is exactly one wave (``S`` programs, ``S / units`` the compiled
  residency: waves 1.0), and at B >= 8 the schedule keeps that wave busy: the mean slot's
  cost (its segments' keys plus an overhead each, the schedule's cost model) is at least
  ``MIN_WAVE_FILL`` of the busiest slot's, idle slots counting 0, or its makespan is within
  one piece (``PIECE_KEYS``) of the least the cost model allows those units
  (``benchmarks.schedule``'s bound (c), whose gate allows that piece too): a fill below the
  gate's there is the pieces' granularity (a DCP-8 share of 8 x 32K at H96 on sm90: 120 of
  132 slots, fill 0.898, 1024 keys against the least 960). (Under the uniform split it was
  the grid's fill of whole waves.)
- ``planner_uses_compiled_residency``: ``plan_launch``'s slots per CU equal the compiled
  stage 1's residency, and the grid is those slots.
- ``kv_tile_loads_h128``: KV tile loads per request, read off the schedule: the keys its
  segments walk over its keys (rounded up to pieces), i.e. one load per row group. A cut
  adds a segment (a prologue and a partial, in the cost model) but no load, since a unit's
  segments walk disjoint whole tiles (pieces are multiples of every BLOCK_N); the segments
  per unit are reported beside it.
- ``narrow_shared`` (issue 37): no shared-memory access narrower than
  ``MIN_SHARED_ACCESS_BITS`` in stage 1's KV loop: on sm90 none of 8 or 16 bits a thread
  (``LDS.U8``, ``STS.U16``, ...), on AMD none of 8 (``ds_read_u8``, ``ds_write_b8``); AMD's
  16-bit accesses are reported (bf16's V is read with ``ds_read_u16``; no AMD measurement yet
  says what they cost). On the H200 the fp8 builds that trip it ran at 0.20-0.95x our bf16
  speed (ncu: byte-wise V transposes through shared memory, 29-way bank conflicts).
- ``window_kv_bytes`` (issue 40): a verify window's KV bytes per step (the keys its schedule
  walks, at the cache's width) over its single-query twin's (same heads, lengths and DCP,
  ``S_q`` 1), per row group, within ``MAX_WINDOW_KV_PER_GROUP``. A DCP window is one pass
  with per-row bounds, so each row group loads each tile once, as a query does; folded into
  ``S_q`` one-row requests it cost ``S_q``. The total ratio is reported: it is the row
  groups' (``S_q x H`` rows in tiles of ``block_h``), DCP or not.

    python -m benchmarks.kernel_static [--cases all|reduced | --case NAME ...]
        [--targets sm90,gfx942,gfx950] [--triton VERSION|DIR] [--loops DIR] [--fail-on GATES]

``--triton`` runs the whole command under another Triton: a folder holding an unpacked wheel
(``pip install --no-deps --target DIR triton==3.8.0``), or a version found as
``$ROCM_MLA_TRITONS/<version>`` or ``~/.cache/rocm-mla/triton-<version>`` (where ``make
compile-check`` installs it); the results' file names carry the Triton version. Triton 3.4
links AMD code with an external ``ld.lld`` (``TRITON_HIP_LLD_PATH``; ``hip_linker`` finds one
from ``apt-get install lld``, LLVM 17 or newer for gfx942). ``--loops`` writes stage 1's KV
loop of each case (B 32) as text the readers read back (``tests/data/narrow_shared``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import io
import itertools
import json
import math
import multiprocessing
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from benchmarks import common, isa

#: Latent row width (576 = 512 V columns + 64 rope) and V width of Kimi-K3 / DeepSeek MLA.
HEAD_DIM, HEAD_DIM_V = 576, 512
CONTEXT, PAGE_SIZE = 32768, 64
BATCHES = (8, 32, 128)

#: Gate thresholds of issue 20, item 2.
MAX_ISSUED_OVER_USEFUL = 1.15
COMPUTE_BOUND_ROWS = 64  #: rows (H x S_q) per request from which issued/useful is gated
MIN_WAVE_FILL = 0.9
MIN_GATED_BATCH = 8
MAX_TILE_LOADS_H128 = 2
#: Issue 40: a verify window's KV bytes per step over the single query's (same heads, same
#: lengths), per row group. Folding a DCP window into S_q one-row requests made it S_q; one
#: pass with per-row bounds loads each KV tile once per row group of the window.
MAX_WINDOW_KV_PER_GROUP = 1.1
#: Issue 37, item 3: the narrowest shared-memory access, in bits a thread / lane, the KV loop
#: may make. The H200 (ncu) saw 29-way bank conflicts from sm90's fp8 V moved byte by byte
#: (128 STS.U8 or LDS.U8 an iteration), and gfx942's fp8 builds read 256 ds_read_u8 an
#: iteration: a byte is never allowed. sm90 also refuses 16 bits (LDS.U16, STS.U16). On AMD
#: the bf16 builds read V with ds_read_u16 (128 an iteration on gfx942) and no AMD hardware
#: has measured what that costs: 16 bits are reported there, not refused.
MIN_SHARED_ACCESS_BITS = {"cuda": 32, "hip": 16}
#: The module whose launches are stage 1 (the split-KV decode), and the schedule planner's.
STAGE1_MODULE = "rocm_mla.kernels.mla_decode_kernel"
PLANNER_MODULE = "rocm_mla.kernels.schedule.device"


@dataclass(frozen=True)
class GpuTarget:
    """A compile target and the datasheet figures its ceilings are computed from (its default
    product's in the registry, ``rocm_mla.targets``)."""

    key: str  #: registry key (tuned-table / residency key)
    backend: str  #: "cuda" or "hip"
    arch: str  #: TritonTarget arch
    units: int  #: SMs / CUs
    device: str
    hbm_bytes_per_s: float | None  #: None: unknown (no roofline ceiling)
    #: dense matrix peaks, FLOP/s, by operand kind ("16bit", "fp8"); None: unknown
    matrix_flops: dict | None = field(hash=False, compare=False)
    fp8_dtype: torch.dtype = torch.float8_e4m3fn

    @classmethod
    def of(cls, key: str) -> GpuTarget:
        """The registry's record of ``key`` as a compile target, with its default product; a
        target with no known product is planned over ``STAND_IN_UNITS`` and has no
        datasheet ceilings."""
        from rocm_mla.targets import TARGETS as REGISTRY

        spec = REGISTRY[key]
        product = spec.product
        if product is None:
            return cls(key, spec.backend, spec.archs[0], STAND_IN_UNITS, "unknown", None, None,
                       spec.fp8_dtype)  # fmt: skip
        return cls(
            key,
            spec.backend,
            spec.archs[0],
            product.units,
            product.name,
            product.hbm_bytes_per_s,
            product.matrix_flops,
            spec.fp8_dtype,
        )

    def triton_target(self):
        from rocm_mla.kernels.target import TritonTarget

        return TritonTarget(self.backend, self.arch, self.units)


#: The case list of targets: the registry keys bench static compiles for by default (``--targets``
#: picks a subset). tests/test_targets.py allows arch names in code only in the registry and
#: in case lists like this one.
CASE_TARGETS = ("sm90", "gfx942", "gfx950", "gfx1250")
#: CUs a target with no known product is planned over (the registry's unknown CU count): a
#: stand-in, MI355X's 256, so that the schedule's gates (waves, fill) have a grid to judge;
#: its figures are about that count, not the product's.
STAND_IN_UNITS = 256
TARGETS = {key: GpuTarget.of(key) for key in CASE_TARGETS}


@dataclass(frozen=True)
class Case:
    """One decode shape: ``heads`` query heads per rank, a verify window of ``q_len``.

    With ``dcp > 1`` the heads are DCP-gathered (``12 x dcp``) and the rank holds 1/dcp of
    the context; ``dcp_mla_decode`` decodes each window in one pass over the shard, every
    row with its own local bound (``row_seqlens``), so that is the kernel call made here.
    """

    name: str
    heads: int
    q_len: int
    kv: str  #: "bf16" or "fp8"
    dcp: int = 1

    @property
    def context(self) -> int:
        """Keys of the longest rank-local cache (DCP rank 0 holds the most)."""
        from rocm_mla.dcp.layout import local_seq_lens

        return int(local_seq_lens(torch.tensor([CONTEXT]), self.dcp, 0)[0])

    @property
    def rows(self) -> int:
        """Query rows (S_q x H) one kernel request holds."""
        return self.q_len * self.heads


def _cases() -> tuple[Case, ...]:
    cases = []
    for kv in ("bf16", "fp8"):
        for heads, label in ((12, "TP8"), (24, "TP4"), (96, "TP1")):
            for q_len in (1, 2, 4, 8):
                cases.append(Case(f"K3 {label} H{heads} Sq{q_len} {kv}", heads, q_len, kv))
        for dcp in (2, 4, 8):
            for q_len in (1, 2, 4, 8):
                cases.append(
                    Case(f"K3 12xDCP{dcp} H{12 * dcp} Sq{q_len} {kv}", 12 * dcp, q_len, kv, dcp)
                )
        for heads in (16, 128):
            cases.append(Case(f"H{heads} Sq1 {kv}", heads, 1, kv))
        cases.append(Case(f"H128 Sq2 {kv}", 128, 2, kv))
    return tuple(cases)


CASES = _cases()
#: A few cases for the slow test: both head regimes, a verify window, fp8 (96 rows: sm90's
#: three 32-row groups with keys as M), and a DCP window with its single query (per-row
#: bounds; the window KV gate).
REDUCED_CASES = tuple(
    c
    for c in CASES
    if c.name
    in (
        "H16 Sq1 bf16",
        "H128 Sq1 bf16",
        "K3 TP8 H12 Sq2 fp8",
        "K3 TP1 H96 Sq1 fp8",
        "K3 12xDCP2 H24 Sq1 bf16",
        "K3 12xDCP2 H24 Sq4 bf16",
    )
)


# ---- recording the launches the host code makes ------------------------------------------


@dataclass
class Launch:
    kernel: str  #: the @triton.jit function's name
    module: str
    grid: tuple
    args: tuple
    kwargs: dict


class _Recorder:
    def __init__(self, fn, launches: list[Launch]) -> None:
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            grid_ = grid(kwargs) if callable(grid) else tuple(grid)
            self.launches.append(
                Launch(self.fn.__name__, self.fn.__module__, grid_, args, dict(kwargs))
            )

        return launch


def _kernel_modules() -> list:
    import rocm_mla.kernels.mla_decode  # noqa: F401  (loads the kernel modules it uses)

    return [m for name, m in list(sys.modules.items()) if name.startswith("rocm_mla.kernels.")]


@contextlib.contextmanager
def _recording(target) -> Iterator[list[Launch]]:
    """Every ``@triton.jit`` function of the kernel modules records its launches instead of
    running, and ``triton_target()`` answers ``target``; all restored on exit (the compiler
    resolves the kernels' helpers through the same module globals)."""
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []
    saved = []
    for module in _kernel_modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                saved.append((module, name, value))
                setattr(module, name, _Recorder(value, launches))
            elif name == "triton_target":
                saved.append((module, name, value))
                setattr(module, name, lambda: target)
    try:
        yield launches
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def _jit_function(launch: Launch):
    return getattr(sys.modules[launch.module], launch.kernel)


@functools.cache
def schedule_facts(
    requests: int, context: int, groups: int, slots: int, capacity: int, pools: int = 1
) -> dict:
    """The balanced schedule of ``requests`` requests of ``context`` keys over ``slots``
    slots in ``pools`` pools (``host_schedule``: the device planner's tables), as the gates
    read it."""
    from rocm_mla.kernels import schedule as sch

    tables = sch.host_schedule(
        [context] * requests,
        num_groups=groups,
        num_slots=slots,
        capacity_keys=capacity,
        num_pools=pools,
    )
    bounds = tables.slot_segments.tolist()
    segments = tables.segments[: bounds[-1]].tolist()
    loads = [
        sum(end - first + sch.OVERHEAD_KEYS for _, first, end, _ in segments[lo:hi])
        for lo, hi in itertools.pairwise(bounds)
    ]
    per_unit: dict[int, int] = {}
    walked = [0] * requests
    for unit, first, end, _ in segments:
        per_unit[unit] = per_unit.get(unit, 0) + 1
        walked[unit // groups] += end - first
    planned = sch.pieces_of(context, capacity) * sch.PIECE_KEYS
    # The first wave (as many programs as each pool has slots) holds every used slot's first
    # segment, each on a slot of its own (idle slots take later segments early): what the
    # launch order promises.
    order = tables.launch_order.tolist()
    first_wave = [
        order[k * pools + x]
        for x in range(pools)
        for k in range(sum(sch.pool_of(s, slots, pools) == x for s in range(slots)))
        if k * pools + x < len(order)
    ]
    firsts = {bounds[s] for s in range(slots) if bounds[s + 1] > bounds[s]}
    entries = sch.schedule_entries(tables)
    ran = sch.list_scheduled_loads(entries, slots, pools, sch.OVERHEAD_KEYS)
    # The least makespan the cost model allows these units at all (``benchmarks.schedule``'s
    # bound (c)): a slot fill below the gate's at that makespan is the pieces' granularity,
    # not imbalance.
    from benchmarks.schedule import lower_bound_c, lower_bounds

    lengths = [min(context, capacity)] * requests
    _, lb_b = lower_bounds(lengths, groups, slots)
    least = lower_bound_c(lengths, groups, slots, lb_b, max(loads))
    return {
        "used_slots": tables.used_slots,
        "partials": tables.num_partials,
        "cut_units": sum(u >= 0 for u in tables.split_units.tolist()),
        "max_segments_per_unit": max(per_unit.values()),
        "slot_fill": round(sum(loads) / len(loads) / max(loads), 3) if max(loads) else 0.0,
        "kv_tile_loads_per_request": max(walked) / planned if planned else 0.0,
        "kv_keys_walked": sum(walked),
        "programs": tables.num_programs,
        "first_wave_holds_the_slots_first_segments": firsts <= set(first_wave),
        "list_scheduled_within_plan": max(ran) <= max(loads),
        "makespan": max(loads),
        "least_makespan": least,
    }


def record_case(case: Case, target: GpuTarget, batch: int, config=None) -> dict:
    """Plan and "launch" one decode step of ``case`` at ``batch`` requests on ``target``, with
    the tuned table's config or ``config`` (a ``LaunchConfig``, as autotune's candidates)."""
    from rocm_mla.kernels import mla_decode as md
    from rocm_mla.kernels import schedule as sch

    tt = target.triton_target()
    requests = batch
    kv_dtype = torch.bfloat16 if case.kv == "bf16" else target.fp8_dtype
    pages = -(-case.context // PAGE_SIZE)
    meta = {"device": "meta"}
    q = torch.empty(requests, case.q_len, case.heads, HEAD_DIM, dtype=torch.bfloat16, **meta)
    kv_cache = torch.empty(requests * pages, PAGE_SIZE, HEAD_DIM, dtype=kv_dtype, **meta)
    block_table = torch.empty(requests, pages, dtype=torch.int32, **meta)
    seqlens = torch.empty(requests, dtype=torch.int32, **meta)
    # Under DCP each row of a window has its own bound on the shard (a single query's is
    # its request's length: no bounds); the kernel alone reads them, so a meta tensor
    # stands for them as for the lengths.
    row_seqlens = (
        torch.empty(requests * case.q_len, dtype=torch.int32, **meta)
        if case.dcp > 1 and case.q_len > 1
        else None
    )
    config, slots = md.plan_launch(
        q_len=case.q_len,
        num_heads=case.heads,
        kv_dtype=kv_dtype,
        target=tt,
        config=config,
        q_dtype=torch.bfloat16,
        head_dim=HEAD_DIM,
        head_dim_v=HEAD_DIM_V,
        page_size=PAGE_SIZE,
        cache_bytes=kv_cache.untyped_storage().nbytes(),
    )
    num_groups = -(-case.rows // config.block_h)
    with _recording(tt) as launches:
        md.mla_decode(
            q,
            kv_cache,
            block_table,
            seqlens,
            head_dim_v=HEAD_DIM_V,
            softmax_scale=HEAD_DIM**-0.5,
            kv_scale=None if case.kv == "bf16" else 1.0,
            config=config,
            num_slots=slots,
            row_seqlens=row_seqlens,
        )
    # Outside the recording: programs_per_cu compiles the real kernel for this shape.
    planner_residency = md.programs_per_cu(
        config,
        tt,
        kv_dtype=kv_dtype,
        num_heads=case.heads,
        q_len=case.q_len,
        cache_bytes=kv_cache.untyped_storage().nbytes(),
    )
    return {
        "batch": batch,
        "requests": requests,
        "config": config.to_dict(),
        "slots": slots,
        "num_groups": num_groups,
        "planner_programs_per_cu": planner_residency,
        "plan_slots_per_cu": slots / target.units,
        "schedule": schedule_facts(
            requests, case.context, num_groups, slots, pages * PAGE_SIZE, config.num_xcds
        ),
        "launch_capacity": sch.launch_capacity(requests * num_groups, slots, config.num_xcds),
        "kv_cache_bytes": kv_cache.untyped_storage().nbytes(),
        "launches": launches,
    }


def specialize(launch: Launch, target: GpuTarget) -> dict:
    """The compile request the runtime would make for ``launch`` on ``target``: Triton's own
    binder and argument packing, with the target's backend."""
    from triton import knobs
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    from rocm_mla.kernels.occupancy import gpu_target

    fn = _jit_function(launch)
    backend = make_backend(gpu_target(target.triton_target()))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    # The options JITFunction.run adds before binding, as far as this Triton has them.
    kwargs = dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    for option in ("instrumentation_mode", "fpsan_homomorphic_casts"):
        if hasattr(knobs.compilation, option):
            kwargs[option] = getattr(knobs.compilation, option)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = _pack_args(
        fn, backend, kwargs, bound, specialization, options
    )
    request = {
        "kernel": launch.kernel,
        "module": launch.module,
        "target": target.key,
        "signature": signature,
        "constexprs": constexprs,
        "attrs": attrs,
        "options": options.__dict__,
    }
    request["key"] = _compile_key(request)
    return request


def _pack_args(fn, backend, kwargs: dict, bound: dict, specialization: list, options) -> tuple:
    """``(options, signature, constexprs, attrs)`` of a bound launch, as ``JITFunction.run``
    hands them to the compiler. Triton 3.5 on has ``JITFunction._pack_args``; Triton 3.4 does
    the same steps inline in ``run``, which this repeats (its attributes are every
    specialization's second entry, constexprs included, as 3.5's ``_pack_args`` has them)."""
    if hasattr(fn, "_pack_args"):
        return fn._pack_args(backend, kwargs, bound, specialization, options)
    from triton._utils import find_paths_if, get_iterable_path

    options = backend.parse_options(kwargs)
    names = [p.name for p in fn.params]
    kinds = [x[0] for x in specialization]
    unknown = [k for k in kwargs if k not in options.__dict__ and k not in names]
    if unknown:
        raise KeyError(f"kernel_static: {fn.__name__} got unrecognised options {unknown}")
    constexprs = find_paths_if(kinds, lambda _, kind: kind == "constexpr")
    constexprs = {path: get_iterable_path(list(bound.values()), path) for path in constexprs}
    attr_values = [x[1] for x in specialization]
    attrs = find_paths_if(attr_values, lambda _, x: isinstance(x, str))
    attrs = {k: backend.parse_attr(get_iterable_path(attr_values, k)) for k in attrs}
    return options, dict(zip(names, kinds, strict=True)), constexprs, attrs


def _compile_key(request: dict) -> str:
    import hashlib

    text = repr(
        (
            request["kernel"],
            request["target"],
            sorted(request["signature"].items()),
            sorted((k, repr(v)) for k, v in request["constexprs"].items()),
            sorted((k, repr(v)) for k, v in request["attrs"].items()),
            sorted((k, repr(v)) for k, v in request["options"].items()),
        )
    )
    return (
        f"{request['target']}-{request['kernel']}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    )


# ---- compiling and reading the code -------------------------------------------------------


def build(request: dict) -> tuple:
    """``(compiled kernel, Triton's own ptxas log or "", seconds)`` of one compile request."""
    from triton import knobs
    from triton.compiler import ASTSource

    import rocm_mla.kernels.mla_decode  # noqa: F401
    from rocm_mla.kernels.occupancy import compile_for

    target = TARGETS[request["target"]]
    fn = getattr(sys.modules[request["module"]], request["kernel"])
    # Triton prints its own ptxas run's log (registers, spills) with this knob (3.5 on): one
    # ptxas run.
    if hasattr(knobs.nvidia, "dump_ptxas_log"):
        knobs.nvidia.dump_ptxas_log = True
    log = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(log):
        kernel = compile_for(
            ASTSource(fn, request["signature"], request["constexprs"], request["attrs"]),
            target.triton_target(),
            request["options"],
        )
    return kernel, log.getvalue(), time.perf_counter() - start


@contextlib.contextmanager
def compiler_stderr() -> Iterator[list[str]]:
    """Catch what is written to this process's stderr below Python (MLIR writes a failed
    pass's diagnostics, and the whole module, there); on exit the list holds its error and
    note lines."""
    caught_lines: list[str] = []
    with tempfile.TemporaryFile(mode="w+") as caught:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(caught.fileno(), 2)
        try:
            yield caught_lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            caught_lines += [
                line.rstrip() for line in caught if re.search(r"\b(error|note): ", line)
            ]


def describe_failure(error: BaseException, diagnostics: list[str]) -> str:
    """A failed compile in a few lines. A failure inside a called ``@triton.jit`` function is
    a chain of compile errors, one per call site: the innermost one quotes the failing line,
    and its cause says what failed there; an MLIR pass failure is in the diagnostics."""
    chain = [error]
    while chain[-1].__cause__ is not None:
        chain.append(chain[-1].__cause__)
    located = [e for e in chain if type(e).__name__ == "CompilationError"] or [error]
    text = f"{type(located[-1]).__name__}: {located[-1]}".strip()
    if chain[-1] is not located[-1] and str(chain[-1]) not in text:
        text += f"\n{type(chain[-1]).__name__}: {chain[-1]}"
    return "\n".join(text.splitlines()[-40:] + diagnostics[:6])


def try_build(request: dict) -> dict:
    """Compile one request; ``error`` is None or what failed (``describe_failure``)."""
    outcome = {k: request[k] for k in ("key", "kernel", "target")}
    with compiler_stderr() as diagnostics:
        try:
            _, _, seconds = build(request)
            error = None
        except Exception as failure:  # a failed compile is the finding, reported per request
            error = failure
    if error is not None:
        return outcome | {"error": describe_failure(error, diagnostics), "compile_s": None}
    return outcome | {"error": None, "compile_s": round(seconds, 2)}


def compile_or_fail(request: dict) -> dict:
    """``compile_and_read``, or the request's key, kernel, target and ``error`` when it does
    not compile."""
    with compiler_stderr() as diagnostics:
        try:
            return compile_and_read(request)
        except Exception as failure:  # reported per case and target: the gate "compiles"
            error = failure
    outcome = {k: request[k] for k in ("key", "kernel", "target")}
    return outcome | {"error": describe_failure(error, diagnostics)}


def compile_and_read(request: dict) -> dict:
    """Compile one request (in a worker process) and read resources and the main loop."""
    target = TARGETS[request["target"]]
    kernel, ptxas_log, compile_s = build(request)
    num_warps = request["options"]["num_warps"]
    info = {
        "key": request["key"],
        "kernel": request["kernel"],
        "num_warps": num_warps,
        "num_stages": request["options"]["num_stages"],
        "shared_bytes": int(kernel.metadata.shared),
        "compile_s": round(compile_s, 2),
    }
    if target.backend == "cuda":
        fp_fusion = request["options"]["enable_fp_fusion"]
        info.update(
            isa.read_cuda(
                kernel.asm["ptx"],
                kernel.asm["cubin"],
                ptxas_log,
                fp_fusion,
                request.get("excerpt", False),
                capability=int(target.arch.removeprefix("sm")),
            )
        )
    else:
        agprs = target.triton_target().spec.residency.agprs
        info.update(
            isa.read_amdgcn(kernel.asm["amdgcn"], request.get("excerpt", False), agprs=agprs)
        )
    info["ttgir"] = isa.read_ttgir(kernel.asm["ttgir"])
    return info


# ---- what the KV loop does with its tiles ---------------------------------------------------


def _round_trips(ops: list[tuple], tile_shaped) -> tuple[list[str], set[str]]:
    """``(the ops that write back to shared memory a tile read from it, the values read from
    it)``: ``tile_shaped`` says which tensor types are tiles; followed through every op but
    the dots."""
    from_smem: set[str] = set()
    found = []
    dot_ops = ("tt.dot", "ttng.warp_group_dot", "tt.dot_scaled")
    for result, op, operands, types in ops:
        fed = any(o in from_smem for o in operands)
        if op == "ttg.local_load" and tile_shaped(types):
            from_smem.add(result)
        elif fed and op in ("ttg.local_alloc", "ttg.local_store"):
            found.append(op)
        elif fed and result is not None and op not in dot_ops and tile_shaped(types):
            from_smem.add(result)
    return found, from_smem


#: TTGIR ops that move a tensor between layouts without changing its values.
_LAYOUT_ONLY_OPS = ("ttg.convert_layout", "amdg.in_thread_transpose")


def _kv_facts(ttgir: dict, block_n: int) -> dict:
    """What the KV loop does with tiles that have ``block_n`` keys: buffers, async copies, round
    trips (a tile read from shared memory into registers that goes back to shared memory)."""
    kv_allocs = [a for a in ttgir["multi_buffer_allocs"] if len(a) == 3 and block_n in a[1:]]
    ops = ttgir.get("loop_ops", [])

    def kv_shaped(types: str) -> bool:
        dims = isa.tensor_shape(types.split("->")[-1])
        return dims is not None and len(dims) == 2 and block_n in dims

    in_loop_allocs = [
        op for op in ops if op[1] == "ttg.local_alloc" and op[2] and kv_shaped(op[3].split("->")[0])
    ]
    # A tile the AMD stream pipeliner prefetches into registers reaches its LDS buffer
    # through layout changes (a conversion, an in-thread transpose): follow them back to
    # the load.
    loaded_as: dict[str, str] = {}
    for result, op, operands, _ in ops:
        if op in ("tt.load", "amdg.buffer_load"):
            loaded_as[result] = result
        elif op in _LAYOUT_ONLY_OPS and operands and operands[0] in loaded_as:
            loaded_as[result] = loaded_as[operands[0]]
    stored = {loaded_as.get(o, o) for op in ops if op[1] == "ttg.local_store" for o in op[2][:1]}
    # Loaded in one trip, used in the next: carried in registers through the loop's yield.
    yielded = {loaded_as[o] for op in ops if op[1] == "scf.yield" for o in op[2] if o in loaded_as}
    register_loads = [
        (op[0], isa.tensor_shape(op[3]))
        for op in ops
        if op[1] in ("tt.load", "amdg.buffer_load") and kv_shaped(op[3])
    ]
    synchronous = [r for r, _ in register_loads if r not in stored and r not in yielded]

    def slots(dims) -> int:
        matching = [a[0] for a in kv_allocs if tuple(a[1:]) in (tuple(dims), tuple(dims[::-1]))]
        return max(matching, default=1)

    # LDS buffers per KV part: a multi-buffered alloc outside the loop holds N; a tile loaded
    # in the loop that is not stored into such an alloc (kept in registers or stored into a
    # one-tile alloc) has 1. The tile's figure is its worst part's.
    parts = [a[0] for a in kv_allocs] + [1 for r, _ in register_loads if r not in stored]
    buffers = min(parts) if parts else 1 if in_loop_allocs else 0
    # Pipeline stages per KV part: its LDS slots, plus one where the tile is loaded into
    # registers a trip ahead of its use (stored into the buffer at the end of the trip, or
    # carried through the yield); a part loaded and used in the same trip has 1.
    fed = {tuple(sorted(d)) for r, d in register_loads if r in stored}
    stage_parts = [a[0] for a in kv_allocs if tuple(sorted(a[1:])) not in fed]
    for r, dims in register_loads:
        ahead = r in stored or r in yielded
        stage_parts.append((slots(dims) if r in stored else 1) + (1 if ahead else 0))
    stages = min(stage_parts) if stage_parts else 1 if in_loop_allocs else 0
    async_ops = [
        op[1]
        for op in ops
        if op[1]
        in (
            "ttg.async_copy_global_to_local",
            "ttng.async_tma_copy_global_to_local",
            "amdg.buffer_load_to_local",
        )
    ]
    waits = [re.search(r"num = (\d+)", op[3]) for op in ops if op[1] == "ttg.async_wait"]

    def two_d(types: str) -> bool:
        dims = isa.tensor_shape(types.split("->")[-1])
        return dims is not None and len(dims) == 2

    def guarded(loop_ops, from_smem) -> bool:
        # The non-finite guard: a comparison (or |x|) of a tile read from shared memory.
        return any(
            op in ("math.absf", "arith.cmpf") and any(o in from_smem for o in operands)
            for _, op, operands, _ in loop_ops
        )

    # The KV walk's tiles, and any 2-D tile of the other loops with dots (a verify window's
    # tail tiles have BLOCK_W keys). A round trip in a loop that guards a shared tile is the
    # guard's; one without (sm90's fp8 V, transposed for the K-major operand) is not.
    round_trips, from_smem = _round_trips(ops, kv_shaped)
    guard = guarded(ops, from_smem)
    guard_trips = len(round_trips) if guard else 0
    for other in ttgir.get("other_loop_ops", []):
        trips, other_smem = _round_trips(other, two_d)
        round_trips += trips
        if guarded(other, other_smem):
            guard, guard_trips = True, guard_trips + len(trips)
    return {
        "kv_buffers": buffers,
        "kv_stages": stages,
        "kv_allocs": kv_allocs,
        "synchronous_kv_loads_in_loop": len(synchronous),
        "async_copies_in_loop": len(async_ops),
        "async_wait_nums": [int(w.group(1)) for w in waits if w],
        "kv_round_trips": round_trips,
        "guard_on_smem_tile": guard,
        "guard_round_trips": guard_trips,
    }


# ---- the analysis of one case on one target -----------------------------------------------


def _matrix_work(info: dict, target: GpuTarget) -> dict:
    """MACs issued per KV tile by one program, and their kinds, from the loop's counts."""
    macs, by_kind = 0, {"16bit": 0, "fp8": 0}
    for op, count in info["loop"].get("matrix", {}).items():
        m, n, k, kind = isa.matrix_shape(op, target.backend)
        # wgmma is one instruction per warpgroup (4 warps); mma.sync / MFMA run per warp/wave.
        issuers = info["num_warps"] / 4 if "GMMA" in op else info["num_warps"]
        work = count * m * n * k * issuers
        macs += work
        by_kind[kind] += work
    return {"issued_macs": macs, "issued_macs_by_kind": by_kind}


def analyze(case: Case, target: GpuTarget, plans: list[dict] | dict, kernels: dict) -> dict:
    """Per-batch figures and the gates for ``case`` on ``target``; a plan that failed or was
    refused (a dict), or a kernel that did not compile, fails the gate ``compiles`` (a refusal
    by name, a ``ValueError`` of the planner, makes it not applicable) and stops there."""
    from rocm_mla.kernels.residency import resident_programs

    if isinstance(plans, dict):
        evidence = {"planning": plans["error"], "batch": plans["batch"]}
        return {
            "per_batch": [],
            "gates": {"compiles": _gate(not plans["refused"], False, evidence)},
        }
    broken = {
        k: kernels[k]["error"]
        for plan in plans
        for k in plan["keys"]
        if kernels[k].get("error") is not None
    }
    if broken:
        return {"per_batch": [], "gates": {"compiles": _gate(True, False, {"kernels": broken})}}
    per_batch = []
    for plan in plans:
        config = plan["config"]
        info = kernels[plan["stage1"]]
        others = [kernels[k] for k in plan["keys"] if k != plan["stage1"]]
        resident = resident_programs(
            target.key,
            num_warps=info["num_warps"],
            regs_per_thread=info["regs_per_thread"],
            smem_bytes=info["shared_bytes"],
            **(
                {
                    "agprs_per_thread": info["agprs_per_thread"],
                    "sgprs_per_wave": info["sgprs_per_wave"],
                }
                if target.backend == "hip"
                else {}
            ),
        )
        programs = math.prod(plan["grid"])
        # Programs over resident slots: the device-planned grid is the launch capacity
        # (most of it -1 programs when the step is small), so this is not a wave count.
        waves = programs / (max(resident, 1) * target.units)
        schedule = plan["schedule"]
        work = _matrix_work(info, target)
        useful_rows = case.rows / plan["num_groups"]
        useful = useful_rows * config["block_n"] * (HEAD_DIM + HEAD_DIM_V)
        replication = work["issued_macs"] / (
            config["block_h"] * config["block_n"] * (HEAD_DIM + HEAD_DIM_V)
        )
        kv_bytes = 1 if case.kv == "fp8" else 2
        tile_bytes = config["block_n"] * HEAD_DIM * kv_bytes
        tensor_seconds = (
            plan["num_groups"]
            * sum(
                2 * macs / target.matrix_flops[kind]
                for kind, macs in work["issued_macs_by_kind"].items()
            )
            if target.matrix_flops and target.hbm_bytes_per_s
            else None
        )
        ceiling = tile_bytes / tensor_seconds / target.hbm_bytes_per_s if tensor_seconds else None
        per_batch.append(
            {
                "batch": plan["batch"],
                "requests": plan["requests"],
                "config": config,
                "slots": plan["slots"],
                "launch_capacity": plan["launch_capacity"],
                "num_groups": plan["num_groups"],
                "stage1": info["key"],
                "other_kernels": [k["key"] for k in others],
                "grid": plan["grid"],
                "resident_per_unit": resident,
                "planner_programs_per_cu": plan["planner_programs_per_cu"],
                "plan_slots_per_cu": plan["plan_slots_per_cu"],
                "waves": round(waves, 3),
                "schedule": schedule,
                "slot_fill": schedule["slot_fill"],
                "kv_tile_loads_per_request": schedule["kv_tile_loads_per_request"],
                "kv_bytes_per_step": schedule["kv_keys_walked"] * HEAD_DIM * kv_bytes,
                "kv_cache_bytes": plan["kv_cache_bytes"],
                "issued_macs_per_tile": work["issued_macs"],
                "useful_macs_per_tile": useful,
                "issued_over_useful": round(work["issued_macs"] / useful, 3) if useful else None,
                "replication": round(replication, 3),
                "row_padding": round(plan["num_groups"] * config["block_h"] / case.rows, 3),
                "tensor_issue_ceiling_pct_hbm": round(100 * min(ceiling, 1.0), 1)
                if ceiling
                else None,
                "kv": _kv_facts(info["ttgir"], config["block_n"]),
                "shared": shared_facts(info["loop"], target.backend, info["num_warps"], tile_bytes),
            }
        )
    return {"per_batch": per_batch, "gates": gates(case, target, per_batch, kernels)}


def shared_facts(loop: dict, backend: str, num_warps: int, kv_tile_bytes: int) -> dict:
    """The KV loop's shared-memory accesses (``loop["shared"]``, by opcode) by width, the
    narrow ones (8 and 16 bits a thread / lane), and the bytes they move per iteration over
    the KV tile's bytes (``kv_tile_bytes``, what one iteration loads from HBM): loads and
    stores the program issues, not the copies into shared memory (cp.async, TMA, buffer
    loads to LDS) nor what the matrix instructions read from it."""
    threads = num_warps * (32 if backend == "cuda" else 64)
    by_width: dict[int, int] = {}
    moved = 0
    for op, count in loop.get("shared", {}).items():
        bits, accesses = isa.shared_access(op, backend)
        by_width[bits] = by_width.get(bits, 0) + count * accesses
        moved += count * accesses * bits // 8 * threads
    return {
        "by_opcode": loop.get("shared", {}),
        "by_width_bits": dict(sorted(by_width.items())),
        "byte_wide": by_width.get(8, 0),
        "half_wide": by_width.get(16, 0),
        "bytes_per_iteration": moved,
        "kv_tile_bytes": kv_tile_bytes,
        "shared_bytes_per_kv_byte": round(moved / kv_tile_bytes, 3),
    }


def wide_enough(shared: dict, backend: str) -> bool:
    """The narrow-shared gate on a loop's ``shared_facts``: no access under
    ``MIN_SHARED_ACCESS_BITS`` of the backend (widths are strings once in JSON)."""
    narrowest = MIN_SHARED_ACCESS_BITS[backend]
    return min((int(bits) for bits in shared["by_width_bits"]), default=narrowest) >= narrowest


def _gate(applies: bool, passed: bool, evidence: dict) -> dict:
    return {"applies": applies, "pass": passed if applies else None, "evidence": evidence}


def gates(case: Case, target: GpuTarget, per_batch: list[dict], kernels: dict) -> dict:
    """Issue 20's gates for one case on one target: verdict and evidence each."""
    from rocm_mla.kernels import schedule as sch

    used = sorted(
        {b["stage1"] for b in per_batch} | {k for b in per_batch for k in b["other_kernels"]}
    )

    def spills(info: dict) -> int:
        if target.backend == "cuda":
            return info["spill_store_bytes"] + info["spill_load_bytes"]
        # SGPR spills go to VGPR lanes (v_writelane), not memory: reported, not gated.
        return info["vgpr_spill_count"] + info["scratch_bytes"]

    result = {"compiles": _gate(True, True, {"kernels": used})}
    spill_evidence = {key: spills(kernels[key]) for key in used}
    evidence = {"spills_by_kernel": spill_evidence}
    if target.backend == "hip":
        evidence["sgpr_spills_to_vgpr_lanes"] = {
            key: kernels[key]["sgpr_spill_count"] for key in used
        }
    result["no_spills"] = _gate(True, not any(spill_evidence.values()), evidence)
    ratios = {b["batch"]: b["issued_over_useful"] for b in per_batch}
    result["issued_over_useful"] = _gate(
        case.rows >= COMPUTE_BOUND_ROWS,
        all(r is not None and r <= MAX_ISSUED_OVER_USEFUL for r in ratios.values()),
        {
            "limit": MAX_ISSUED_OVER_USEFUL,
            "rows_per_request": case.rows,
            "by_batch": {
                b["batch"]: {
                    "issued_over_useful": b["issued_over_useful"],
                    "replication": b["replication"],
                    "row_padding": b["row_padding"],
                }
                for b in per_batch
            },
        },
    )
    kinds = {
        key: sorted(kernels[key]["loop"].get("matrix", {}))
        for key in {b["stage1"] for b in per_batch}
    }
    # An fp8 cache: Q.K^T runs fp8 matrix ops on the tile as stored, P.V fp16 ones on V
    # converted as loaded (an fp8 P.V needs V transposed byte by byte: the narrow gate); a
    # bf16 op means the tile was upcast to q's type, the fp8 cache's bytes bought nothing.
    result["fp8_matrix_op"] = _gate(
        case.kv == "fp8",
        all(
            any(isa.matrix_shape(op, target.backend)[3] == "fp8" for op in ops)
            and not any("BF16" in op.upper() for op in ops)
            for ops in kinds.values()
        ),
        {"rule": "fp8 Q.K^T, no bf16 matrix op (P.V fp16)", "loop_matrix_ops": kinds},
    )
    kv = {b["batch"]: b["kv"] for b in per_batch}
    if target.backend == "cuda":
        overlapped = all(
            f["async_copies_in_loop"] > 0 and f["kv_buffers"] >= 2 for f in kv.values()
        )
        rule = "asynchronous copies into >= 2 KV buffers"
    else:
        overlapped = all(f["kv_stages"] >= 2 for f in kv.values())
        rule = (
            ">= 2 KV stages: each part of the tile loaded at least one trip ahead of its use "
            "(into registers carried to the next trip, or into >= 2 LDS slots directly)"
        )
    result["kv_loads_overlap"] = _gate(
        True,
        overlapped,
        {
            "rule": rule,
            "by_batch": {
                batch: {
                    k: f[k]
                    for k in ("kv_buffers", "kv_stages", "async_copies_in_loop", "async_wait_nums")
                }
                for batch, f in kv.items()
            },
        },
    )
    gated = [b for b in per_batch if b["batch"] >= MIN_GATED_BATCH]
    result["whole_waves"] = _gate(
        bool(gated),
        all(
            b["schedule"]["first_wave_holds_the_slots_first_segments"]
            and b["schedule"]["list_scheduled_within_plan"]
            and (
                b["slot_fill"] >= MIN_WAVE_FILL
                or b["schedule"]["makespan"] <= b["schedule"]["least_makespan"] + sch.PIECE_KEYS
            )
            for b in gated
        ),
        {
            "rule": "the first wave of the launch order holds every used slot's first segment, "
            "list scheduling in launch order ends within the plan's makespan, and the mean "
            "slot's cost is >= min_fill of the busiest slot's (idle slots count 0) or the "
            "makespan is within one piece of the least the cost model allows "
            "(benchmarks.schedule's bound (c) and its lb_c tolerance)",
            "min_fill": MIN_WAVE_FILL,
            "by_batch": {
                b["batch"]: {
                    "grid": b["grid"],
                    "resident_per_unit": b["resident_per_unit"],
                    "programs": b["schedule"]["programs"],
                    "first_wave_holds_the_slots_first_segments": b["schedule"][
                        "first_wave_holds_the_slots_first_segments"
                    ],
                    "list_scheduled_within_plan": b["schedule"]["list_scheduled_within_plan"],
                    "slot_fill": b["slot_fill"],
                    "used_slots": b["schedule"]["used_slots"],
                    "makespan": b["schedule"]["makespan"],
                    "least_makespan": b["schedule"]["least_makespan"],
                }
                for b in gated
            },
        },
    )
    result["planner_uses_compiled_residency"] = _gate(
        True,
        all(
            b["planner_programs_per_cu"] == b["resident_per_unit"] == b["plan_slots_per_cu"]
            and math.prod(b["grid"]) == b["launch_capacity"]
            for b in per_batch
        ),
        {
            "by_batch": {
                b["batch"]: {
                    "planner_programs_per_cu": b["planner_programs_per_cu"],
                    "plan_slots_per_cu": b["plan_slots_per_cu"],
                    "compiled_resident": b["resident_per_unit"],
                    "slots": b["slots"],
                    "grid": b["grid"],
                }
                for b in per_batch
            }
        },
    )
    # "At H128": the plain-decode H128 case (a verify window multiplies the rows).
    result["kv_tile_loads_h128"] = _gate(
        case.heads == 128 and case.rows == 128,
        all(b["kv_tile_loads_per_request"] <= MAX_TILE_LOADS_H128 for b in per_batch),
        {
            "limit": MAX_TILE_LOADS_H128,
            "rule": "keys the schedule's segments walk per key of a request (one per row "
            "group: a unit's segments walk disjoint whole tiles)",
            "by_batch": {
                b["batch"]: {
                    "kv_tile_loads_per_request": b["kv_tile_loads_per_request"],
                    "row_groups": b["num_groups"],
                    "max_segments_per_unit": b["schedule"]["max_segments_per_unit"],
                }
                for b in per_batch
            },
        },
    )
    narrowest = MIN_SHARED_ACCESS_BITS[target.backend]
    result["narrow_shared"] = _gate(
        True,
        all(
            kernels[b["stage1"]]["loop"]["found"] and wide_enough(b["shared"], target.backend)
            for b in per_batch
        ),
        {
            "rule": f"no shared-memory load or store under {narrowest} bits a thread in the KV "
            "loop (NVIDIA: none of 8 or 16 bits; AMD: none of 8, those of 16 reported)",
            "min_bits": narrowest,
            "by_batch": {b["batch"]: b["shared"] for b in per_batch},
        },
    )
    result["guard_without_round_trip"] = _gate(
        True,
        not any(f["guard_round_trips"] for f in kv.values()),
        {
            "note": "the non-finite guard must not take a KV tile from shared memory / LDS "
            "into registers and write it back for a dot; every round trip is listed (NVIDIA's "
            "fp8 V makes one to be transposed for the K-major fp8 operand)",
            "by_batch": {
                batch: {
                    "round_trips": f["kv_round_trips"],
                    "guard_on_smem_tile": f["guard_on_smem_tile"],
                    "guard_round_trips": f["guard_round_trips"],
                }
                for batch, f in kv.items()
            },
        },
    )
    return result


def window_kv_gates(results: list[dict]) -> None:
    """Add the gate ``window_kv_bytes`` to every verify-window case (``q_len > 1``) whose
    single-query twin (same heads, KV and DCP; ``q_len`` 1) ran on the same target: at each
    batch, the KV bytes its schedule walks per step over the twin's, per row group, must
    stay within ``MAX_WINDOW_KV_PER_GROUP``.

    Per row group because a window of more rows than one group holds (``block_h``) is more
    groups, each walking the keys, at any ``S_q``, with or without DCP: the total ratio is
    reported beside it, with the S_q a window folded into one-row requests would cost."""

    def twin_key(case: dict) -> tuple:
        return case["heads"], case["kv"], case["dcp"]

    singles = {
        (twin_key(r["case"]), r["target"]): r
        for r in results
        if r["case"]["q_len"] == 1 and r["per_batch"]
    }
    for r in results:
        twin = singles.get((twin_key(r["case"]), r["target"]))
        if r["case"]["q_len"] == 1 or twin is None or not r["per_batch"]:
            continue
        by_batch = {}
        for window, single in zip(r["per_batch"], twin["per_batch"], strict=True):
            total = window["kv_bytes_per_step"] / single["kv_bytes_per_step"]
            groups = window["num_groups"] / single["num_groups"]
            by_batch[window["batch"]] = {
                "kv_bytes_per_step": window["kv_bytes_per_step"],
                "single_query_kv_bytes_per_step": single["kv_bytes_per_step"],
                "ratio": round(total, 3),
                "row_groups": window["num_groups"],
                "single_query_row_groups": single["num_groups"],
                "ratio_per_row_group": round(total / groups, 3),
                "folded_ratio": r["case"]["q_len"],
            }
        r["gates"]["window_kv_bytes"] = _gate(
            True,
            all(b["ratio_per_row_group"] <= MAX_WINDOW_KV_PER_GROUP for b in by_batch.values()),
            {
                "limit": MAX_WINDOW_KV_PER_GROUP,
                "rule": "KV bytes the schedule walks per step over the single query's, per "
                "row group (folded: S_q requests of one row, S_q times the bytes)",
                "twin": twin["case"]["name"],
                "by_batch": by_batch,
            },
        )


# ---- the run --------------------------------------------------------------------------------


def record_target(
    cases: tuple[Case, ...],
    target: GpuTarget,
    configs: dict | None = None,
    batches: tuple[int, ...] = BATCHES,
) -> tuple[dict, dict]:
    """Every case's planned launches on ``target`` at each of ``batches``: ``(plans by (case,
    target), compile requests by key)``; ``configs`` forces a case's config (by case name).
    The planner's residency compiles dominate; they are cached per process, and the cases of
    one target share most of them."""
    plans: dict[tuple[str, str], list[dict] | dict] = {}
    requests: dict[str, dict] = {}
    for case in cases:
        for batch in batches:
            # Planning compiles stage 1 (its residency): a Triton that cannot build the
            # config, or a planner that refuses this Triton by name, ends the case here.
            with compiler_stderr() as diagnostics:
                try:
                    plan = record_case(case, target, batch, (configs or {}).get(case.name))
                    failure = None
                except Exception as error:  # reported as the case's "compiles" gate
                    failure = error
            if failure is not None:
                plans[(case.name, target.key)] = {
                    "batch": batch,
                    "refused": isinstance(failure, ValueError),
                    "error": describe_failure(failure, diagnostics),
                }
                break
            launches = plan.pop("launches")
            keys = []
            for launch in launches:
                request = specialize(launch, target)
                requests.setdefault(request["key"], request)
                keys.append(request["key"])
            # Stage 1 is what the decode module itself launches, the planner's two kernels
            # (the packing, the launch order) the schedule module's; the merge lives elsewhere.
            for module, expected in ((STAGE1_MODULE, 1), (PLANNER_MODULE, 2)):
                count = sum(x.module == module for x in launches)
                if count != expected:
                    raise RuntimeError(
                        f"kernel_static: {case.name} on {target.key} at B {batch} launched "
                        f"{count} kernels from {module}, expected {expected}: {launches}"
                    )
            stage1 = next(i for i, x in enumerate(launches) if x.module == STAGE1_MODULE)
            plan["grid"] = list(launches[stage1].grid)
            plan["stage1"] = keys[stage1]
            plan["planner"] = [
                k for k, x in zip(keys, launches, strict=True) if x.module == PLANNER_MODULE
            ]
            plan["keys"] = keys
            plans.setdefault((case.name, target.key), []).append(plan)
    return plans, requests


def pooled(fn, requests: list[dict], pool=None) -> Iterator[dict]:
    """``fn(request)`` for every compile request, in ``pool``'s processes (None: here), as
    they finish. sm90 stage-1 builds take longest (ptxas): they start first, so no worker
    idles at the end."""
    ordered = sorted(requests, key=lambda r: (TARGETS[r["target"]].backend != "cuda", r["kernel"]))
    if pool is None:
        yield from (fn(request) for request in ordered)
        return
    futures = [pool.submit(fn, request) for request in ordered]
    yield from (future.result() for future in concurrent.futures.as_completed(futures))


def spawn_pool(workers: int):
    """A pool of ``workers`` compile processes, or None for one (compile here). Spawned, not
    forked: the parent holds torch and Triton state a fork would copy."""
    if workers <= 1:
        return None
    context = multiprocessing.get_context("spawn")
    return concurrent.futures.ProcessPoolExecutor(workers, mp_context=context)


def run(
    cases: tuple[Case, ...],
    targets: list[GpuTarget],
    workers: int = 2,
    loops_dir: Path | None = None,
    configs: dict | None = None,
    batches: tuple[int, ...] = BATCHES,
) -> dict:
    """Record, compile and gate ``cases`` on ``targets`` at ``batches``; with ``loops_dir``,
    write there the KV loop of each case's stage 1 at B 32 on each target
    (``write_loop_excerpts``); ``configs`` forces a case's config (``{case name:
    LaunchConfig}``, autotune's candidates)."""
    start = time.perf_counter()
    plans: dict[tuple[str, str], list[dict]] = {}
    requests: dict[str, dict] = {}
    pool = spawn_pool(workers)
    if pool is not None:
        # One target per worker, each planning its cases with its own residency cache; with
        # more workers than targets, a target's cases are split among them.
        parts = max(1, workers // len(targets))
        chunks = [cases[i::parts] for i in range(parts)]
        futures = [
            pool.submit(record_target, chunk, t, configs, batches)
            for t in targets
            for chunk in chunks
        ]
        recorded = [f.result() for f in futures]
    else:
        recorded = [record_target(cases, target, configs, batches) for target in targets]
    for target_plans, target_requests in recorded:
        plans.update(target_plans)
        for key, request in target_requests.items():
            requests.setdefault(key, request)
    record_s = time.perf_counter() - start
    if loops_dir is not None:
        for plan in plans.values():
            for b in plan if isinstance(plan, list) else []:
                if b["batch"] == 32:
                    requests[b["stage1"]]["excerpt"] = True
    kernels: dict[str, dict] = {}
    for i, info in enumerate(pooled(compile_or_fail, list(requests.values()), pool)):
        kernels[info["key"]] = info
        common.progress(i, len(requests), info["key"])
    if pool is not None:
        pool.shutdown()
    compile_s = time.perf_counter() - start - record_s
    results = []
    for case in cases:
        for target in targets:
            entry = analyze(case, target, plans[(case.name, target.key)], kernels)
            results.append(
                {"case": asdict(case) | {"name": case.name}, "target": target.key, **entry}
            )
    window_kv_gates(results)
    if loops_dir is not None:
        write_loop_excerpts(loops_dir, plans, kernels)
    for info in kernels.values():
        info.get("loop", {}).pop("excerpt", None)
        info.get("ttgir", {}).pop("loop_ops", None)
        info.get("ttgir", {}).pop("other_loop_ops", None)
    failed = {
        gate for r in results for gate, verdict in r["gates"].items() if verdict["pass"] is False
    }
    return {
        "benchmark": "kernel-static",
        "environment": common.environment(),
        "targets": {t.key: asdict(t) | {"fp8_dtype": str(t.fp8_dtype)} for t in targets},
        "context": CONTEXT,
        "page_size": PAGE_SIZE,
        "batches": list(batches),
        "thresholds": {
            "max_issued_over_useful": MAX_ISSUED_OVER_USEFUL,
            "compute_bound_rows": COMPUTE_BOUND_ROWS,
            "min_wave_fill": MIN_WAVE_FILL,
            "min_gated_batch": MIN_GATED_BATCH,
            "max_tile_loads_h128": MAX_TILE_LOADS_H128,
            "max_window_kv_per_group": MAX_WINDOW_KV_PER_GROUP,
            "min_shared_access_bits": MIN_SHARED_ACCESS_BITS,
        },
        "wall_s": {
            "record_and_specialize": round(record_s, 1),
            "compile_and_read": round(compile_s, 1),
            "total": round(time.perf_counter() - start, 1),
        },
        "distinct_compiles": len(kernels),
        "all_gates_pass": not failed,
        "failed_gates": sorted(failed),
        "results": results,
        "kernels": kernels,
    }


def _source_commit() -> str:
    """The commit of the kernels compiled (``-dirty`` with uncommitted kernel changes)."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short=7", "HEAD") or "unknown"
    return commit + ("-dirty" if git("status", "--porcelain", "rocm_mla/kernels") else "")


def write_loop_excerpts(folder: Path, plans: dict, kernels: dict) -> list[Path]:
    """Each case's stage-1 KV loop at B 32 on each target, as the readers find it
    (``read_sass_loop`` / ``read_amdgcn_loop`` read it back to the same counts), in
    ``<target>-<case>.txt`` under ``folder`` with a header saying what was compiled, by which
    Triton, and the command."""
    import triton

    folder.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.kernel_static " + shlex.join(sys.argv[1:])
    written = []
    for (case_name, target_key), plan in plans.items():
        b = next((b for b in plan if b["batch"] == 32), None) if isinstance(plan, list) else None
        info = kernels[b["stage1"]] if b is not None else {}
        if "excerpt" not in info.get("loop", {}):
            continue
        c = b["config"]
        kind = "SASS" if TARGETS[target_key].backend == "cuda" else "amdgcn"
        path = folder / f"{target_key}-{re.sub(r'[^A-Za-z0-9]+', '-', case_name).strip('-')}.txt"
        path.write_text(
            f"# {target_key} {kind}: the KV loop of _mla_decode_stage1, {case_name} at B 32 "
            f"({c['block_h']}x{c['block_n']}, {c['num_warps']} warps, {c['num_stages']} "
            f"stages), Triton {triton.__version__}\n"
            f"# kernels at {_source_commit()}; written by: {command}\n"
            + info["loop"]["excerpt"]
            + "\n"
        )
        written.append(path)
    return written


def failures(payload: dict) -> list[str]:
    """``case / target: gate`` for every failed gate."""
    return [
        f"{r['case']['name']} / {r['target']}: {gate}"
        for r in payload["results"]
        for gate, verdict in r["gates"].items()
        if verdict["pass"] is False
    ]


def _gate_names(results: list[dict]) -> list[str]:
    """The gates in their order: a case that did not compile has only ``compiles``."""
    return list(dict.fromkeys(name for r in results for name in r["gates"]))


def _first_line(text: str) -> str:
    """A failure's one line for a table: the MLIR pass that failed, else MLIR's first error,
    else the exception's last line."""
    lines = [line for line in text.splitlines() if line.strip()]
    passes = re.findall(r"Pipeline failed while executing \[`(\w+)`", text)
    errors = [line.split("error: ", 1)[1] for line in lines if "error: " in line]
    if passes:
        return f"MLIR pass {passes[0]} fails"
    return (errors or lines[-1:] or ["?"])[0].strip().replace("|", "/")[:140]


def markdown(payload: dict) -> str:
    gate_names = _gate_names(payload["results"])
    short = {
        "no_spills": "spill",
        "issued_over_useful": "iss/use",
        "fp8_matrix_op": "fp8op",
        "kv_loads_overlap": "overlap",
        "whole_waves": "waves",
        "planner_uses_compiled_residency": "plan-res",
        "kv_tile_loads_h128": "loads",
        "guard_without_round_trip": "guard-rt",
        "narrow_shared": "narrow",
        "window_kv_bytes": "win-KV",
    }
    lines = [
        f"# Compile-level gate (issues 20, 37), Triton {payload['environment']['triton']}, "
        f"{payload['environment']['date']}",
        "",
        f"Context {payload['context']}, page {payload['page_size']}; figures at B 32 unless "
        f"noted; slot fill (mean / busiest slot's cost in the schedule, the grid being one "
        f"wave of slots) at B {'/'.join(map(str, payload['batches']))}. smem 8/16-bit: the KV "
        "loop's shared-memory loads and stores of 8 and of 16 bits a thread, per iteration; "
        "B per KV B: the bytes all its shared loads and stores move per byte of the KV tile. "
        f"Wall time {payload['wall_s']['total']} s, {payload['distinct_compiles']} distinct "
        "compiles. Gates: P pass, F fail, - not applicable.",
        "",
        "| case | target | config (H x N, T: keys as M; warps/stages, slots) | "
        "regs(+agprs) / spill | smem KB | "
        "loop matrix ops | iss/use | KV bufs, async | res/unit | fill B8/32/128 | loads | "
        "ceil % HBM | smem 8/16-bit, B per KV B | "
        + " | ".join(short.get(g, g) for g in gate_names)
        + " |",
        "|" + "---|" * (13 + len(gate_names)),
    ]
    kernels = payload["kernels"]
    for r in payload["results"]:
        verdicts = [
            "-" if v is None or v["pass"] is None else "P" if v["pass"] else "**F**"
            for v in (r["gates"].get(g) for g in gate_names)
        ]
        if not r["per_batch"]:
            evidence = r["gates"]["compiles"]["evidence"]
            if "planning" in evidence:
                refused = not r["gates"]["compiles"]["applies"]
                what = f"{'refused' if refused else 'planning fails'}: "
                what += _first_line(evidence["planning"])
            else:
                kernel, error = next(iter(evidence["kernels"].items()))
                what = f"{kernels[kernel]['kernel']} does not compile: {_first_line(error)}"
            lines.append(
                f"| {r['case']['name']} | {r['target']} | {what} |"
                + " - |" * 10
                + " "
                + " | ".join(verdicts)
                + " |"
            )
            continue
        by_batch = {b["batch"]: b for b in r["per_batch"]}
        b = by_batch.get(32, r["per_batch"][0])
        info = kernels[b["stage1"]]
        c = b["config"]
        if "spill_store_bytes" in info:
            spilled = f"{info['spill_store_bytes']},{info['spill_load_bytes']}"
            regs = f"{info['regs_per_thread']} / {spilled}"
        else:
            regs = (
                f"{info['regs_per_thread']}+{info['agprs_per_thread']} / "
                f"{info['vgpr_spill_count']} (sgpr {info['sgpr_spill_count']})"
            )
        other_spills = r["gates"]["no_spills"]["evidence"]["spills_by_kernel"]
        stage1_keys = {x["stage1"] for x in r["per_batch"]}
        other_spills = {k: v for k, v in other_spills.items() if k not in stage1_keys and v}
        if other_spills:
            regs += f" (planner/merge spill {max(other_spills.values())})"
        ops = ", ".join(f"{op} x{n}" for op, n in info["loop"].get("matrix", {}).items()) or "none"
        waves = "/".join(str(by_batch[x]["slot_fill"]) for x in payload["batches"] if x in by_batch)
        lines.append(
            f"| {r['case']['name']} | {r['target']} | {c['block_h']}x{c['block_n']}"
            f"{'T' if c.get('keys_as_m') else ''}, "
            f"{c['num_warps']}/{c['num_stages']}, {b['slots']} | {regs} | "
            f"{info['shared_bytes'] / 1024:.1f} | {ops} | {b['issued_over_useful']} | "
            f"{b['kv']['kv_buffers']}, {b['kv']['async_copies_in_loop']} | "
            f"{b['resident_per_unit']} | "
            f"{waves} | {b['kv_tile_loads_per_request']} | {b['tensor_issue_ceiling_pct_hbm']} | "
            f"{b['shared']['byte_wide']}/{b['shared']['half_wide']}, "
            f"{b['shared']['shared_bytes_per_kv_byte']} | " + " | ".join(verdicts) + " |"
        )
    windows = [r for r in payload["results"] if "window_kv_bytes" in r["gates"]]
    if windows:
        lines += [
            "",
            "Verify windows: KV bytes per step over the single query's (same heads, lengths "
            "and DCP), at B 32: in total, per row group (the gate), and folded into one-row "
            "requests (S_q).",
            "",
            "| case | target | row groups (S_q 1) | total | per row group | folded |",
            "|---|---|---|---|---|---|",
        ]
        for r in windows:
            # Keys are strings once the payload went through JSON.
            evidence = r["gates"]["window_kv_bytes"]["evidence"]["by_batch"]
            by_batch = {int(batch): figures for batch, figures in evidence.items()}
            w = by_batch.get(32, by_batch[min(by_batch)])
            lines.append(
                f"| {r['case']['name']} | {r['target']} | {w['row_groups']} "
                f"({w['single_query_row_groups']}) | {w['ratio']} | {w['ratio_per_row_group']} "
                f"| {w['folded_ratio']} |"
            )
    lines += ["", f"All gates pass: {payload['all_gates_pass']}."]
    if payload["failed_gates"]:
        lines.append(f"Gates failed somewhere: {', '.join(payload['failed_gates'])}.")
    return "\n".join(lines) + "\n"


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = payload["results"]
    targets = list(payload["targets"])
    gate_names = _gate_names(results)
    cases = list(dict.fromkeys(r["case"]["name"] for r in results))
    grid = [[0.5] * (len(targets) * len(gate_names)) for _ in cases]
    ceilings = {t: [0.0] * len(cases) for t in targets}
    for r in results:
        row, t = cases.index(r["case"]["name"]), targets.index(r["target"])
        for g, name in enumerate(gate_names):
            verdict = r["gates"].get(name)
            grid[row][t * len(gate_names) + g] = (
                0.5
                if verdict is None or verdict["pass"] is None
                else 1.0
                if verdict["pass"]
                else 0.0
            )
        b = next((b for b in r["per_batch"] if b["batch"] == 32), None) or next(
            iter(r["per_batch"]), None
        )
        if b is not None:
            ceilings[r["target"]][row] = b["tensor_issue_ceiling_pct_hbm"] or 0.0
    fig, (ax1, ax2) = plt.subplots(
        1, 2, figsize=(18, 0.28 * len(cases) + 3), gridspec_kw={"width_ratios": [3, 2]}
    )
    ax1.imshow(grid, aspect="auto", cmap="RdYlGn", vmin=0, vmax=1)
    ax1.set_yticks(range(len(cases)), cases, fontsize=7)
    ax1.set_xticks(
        range(len(targets) * len(gate_names)),
        [f"{t}:{g}" for t in targets for g in gate_names],
        rotation=90,
        fontsize=6,
    )
    ax1.set_title("gates (green pass, red fail, yellow n/a)")
    height = 0.8 / len(targets)
    for i, t in enumerate(targets):
        offset = (i - (len(targets) - 1) / 2) * height
        ax2.barh([y + offset for y in range(len(cases))], ceilings[t], height, label=t)
    ax2.set_yticks(range(len(cases)), cases, fontsize=7)
    ax2.set_ylim(len(cases) - 0.5, -0.5)
    ax2.set_xlabel("tensor-issue ceiling, % of HBM peak (B 32)")
    ax2.set_xlim(0, 100)
    ax2.legend(fontsize=8)
    fig.suptitle(
        f"Triton MLA decode, compile-level gate (Triton {payload['environment']['triton']}, "
        f"ctx {payload['context']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def triton_folder(spec: str) -> Path:
    """The folder of an unpacked Triton wheel (``pip install --no-deps --target DIR
    triton==VERSION``) for ``--triton``: ``spec`` itself when it is one, else for a version
    ``$ROCM_MLA_TRITONS/<version>`` or ``make compile-check``'s cache,
    ``~/.cache/rocm-mla/triton-<version>``."""
    given = Path(spec).expanduser()
    if (given / "triton" / "__init__.py").is_file():
        return given.resolve()
    if not re.fullmatch(r"\d+\.\d+\.\d+\S*", spec):
        raise SystemExit(
            f"--triton: expected a version (3.8.0) or a folder with triton/ in it, got {spec!r}"
        )
    cache = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "rocm-mla"
    folders = (
        [Path(os.environ["ROCM_MLA_TRITONS"]) / spec] if "ROCM_MLA_TRITONS" in os.environ else []
    )
    folders.append(cache / f"triton-{spec}")
    for folder in folders:
        if (folder / "triton" / "__init__.py").is_file():
            return folder.resolve()
    raise SystemExit(
        f"--triton {spec}: no Triton in {', '.join(map(str, folders))}; install it with "
        f"`pip install --no-deps --target {folders[-1]} triton=={spec}` (or `make "
        f"compile-check TRITON={spec}`), or pass that folder"
    )


def use_triton(
    folder: Path, argv: list[str], version: str | None, module: str = "benchmarks.kernel_static"
) -> None:
    """Run this command (``python -m module argv``) again with the Triton in ``folder`` first
    on ``PYTHONPATH`` (its compile workers inherit it), unless that is the Triton this process
    imports already."""
    import importlib.util

    found = importlib.util.find_spec("triton")
    if found is None or not Path(found.origin).resolve().is_relative_to(folder):
        root = Path(__file__).resolve().parents[1]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(folder), str(root), env.get("PYTHONPATH", "")) if p
        )
        os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)
    import triton

    if version is not None and triton.__version__ != version:
        raise SystemExit(f"--triton {version}: {folder} holds Triton {triton.__version__}")


def hip_linker() -> str | None:
    """An ``ld.lld`` for Triton 3.4, which links AMD code with ROCm's linker
    (``TRITON_HIP_LLD_PATH``, else /opt/rocm/llvm/bin or /usr/bin): the one on ``PATH``, else
    the newest LLVM's (``apt-get install lld``, LLVM 17 or newer for gfx942). 3.5 on bring
    their own."""
    import glob
    import shutil

    found = shutil.which("ld.lld")
    if found:
        return found

    def llvm_version(path: str) -> int:
        return int(re.search(r"llvm-(\d+)", path).group(1))

    candidates = sorted(glob.glob("/usr/lib/llvm-*/bin/ld.lld"), key=llvm_version)
    return candidates[-1] if candidates else None


def use_hip_linker() -> None:
    """``TRITON_HIP_LLD_PATH`` set to ``hip_linker()`` unless it is set or there is none (the
    compile processes started after this inherit it)."""
    found = hip_linker()
    if "TRITON_HIP_LLD_PATH" not in os.environ and found is not None:
        os.environ["TRITON_HIP_LLD_PATH"] = found


def default_targets() -> tuple[list[str], list[str]]:
    """``(the case targets whose Triton floor, the registry's, the imported Triton meets, a
    line for each left out)``: below its floor the planner refuses every case of a target
    (naming it in ``--targets`` compiles it anyway, each case refused with the reason)."""
    from rocm_mla.kernels.target import SUPPORTED_TRITON, triton_version

    here = triton_version()
    names, left_out = [], []
    for key, target in TARGETS.items():
        floor = SUPPORTED_TRITON.floor(target.triton_target())
        if here is None or here >= floor:
            names.append(key)
        else:
            left_out.append(
                f"bench static: {key} left out, its Triton floor is "
                f"{'.'.join(map(str, floor))} and this Triton is {'.'.join(map(str, here))}"
            )
    return names, left_out


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.kernel_static", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--cases", choices=("all", "reduced"), default="all")
    parser.add_argument(
        "--case",
        action="append",
        metavar="NAME",
        help="only this case (repeatable; e.g. 'H128 Sq1 fp8'), instead of --cases",
    )
    parser.add_argument(
        "--targets",
        help=f"comma-separated subset of {','.join(TARGETS)} (default: those whose Triton floor "
        "the Triton compiling meets)",
    )
    parser.add_argument(
        "--triton",
        metavar="VERSION|DIR",
        help="compile with this Triton: a folder holding an unpacked wheel, or a version found "
        "in $ROCM_MLA_TRITONS/<version> or ~/.cache/rocm-mla/triton-<version>",
    )
    parser.add_argument("--workers", type=int, default=2, help="compile processes")
    parser.add_argument("--out", type=Path, help="results folder (default: benchmarks/results)")
    parser.add_argument(
        "--loops", type=Path, metavar="DIR", help="also write each stage-1 KV loop (B 32) there"
    )
    parser.add_argument(
        "--fail-on",
        metavar="GATES",
        help="exit with status 1 when one of these gates (comma-separated, or 'all') fails in "
        "some case, e.g. 'compiles' (make compile-check)",
    )
    parser.add_argument(
        "--render", type=Path, help="only rewrite the .md and .png of this JSON (no compiling)"
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.render is not None:
        payload = json.loads(args.render.read_text())
        args.render.with_suffix(".md").write_text(markdown(payload))
        plot(payload, args.render.with_suffix(".png"))
        return args.render
    names = [t for t in (args.targets or ",".join(TARGETS)).split(",") if t]
    unknown = [t for t in names if t not in TARGETS]
    if unknown or not names:
        parser.error(f"--targets: expected a subset of {','.join(TARGETS)}, got {args.targets!r}")
    if args.workers < 1:
        parser.error(f"--workers: expected >= 1, got {args.workers}")
    if args.case:
        by_name = {c.name: c for c in CASES}
        missing = [name for name in args.case if name not in by_name]
        if missing:
            parser.error(f"--case: unknown {missing}; the cases are {sorted(by_name)}")
        cases = tuple(by_name[name] for name in args.case)
    else:
        cases = CASES if args.cases == "all" else REDUCED_CASES
    if args.triton is not None:
        is_version = re.fullmatch(r"\d+\.\d+\.\d+\S*", args.triton) is not None
        use_triton(triton_folder(args.triton), argv, args.triton if is_version else None)
    use_hip_linker()
    import triton

    defaults, left_out = default_targets()
    if args.targets is None:
        names = defaults
        for line in left_out:
            print(line, file=sys.stderr)
    payload = run(cases, [TARGETS[t] for t in names], workers=args.workers, loops_dir=args.loops)
    # Named by the Triton and, unless every case ran on the default targets, the selection.
    selection = "-cases" if args.case else "-reduced" if args.cases == "reduced" else ""
    if names != defaults:
        selection += "-" + "-".join(names)
    stem = f"kernel-static{selection}-triton-{triton.__version__}"
    path = common.write_results(stem, payload, args.out)
    path.with_suffix(".md").write_text(markdown(payload))
    plot(payload, path.with_suffix(".png"))
    print(markdown(payload))
    print(f"wrote {path} (+ .md, .png) in {payload['wall_s']['total']} s")
    if args.fail_on:
        watched = set(args.fail_on.split(","))
        failed = [
            line
            for line in failures(payload)
            if "all" in watched or line.rsplit(": ", 1)[1] in watched
        ]
        if failed:
            print(f"gates failed ({args.fail_on}):\n" + "\n".join(failed), file=sys.stderr)
            raise SystemExit(1)
    return path


if __name__ == "__main__":
    main()
