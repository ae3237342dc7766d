"""Offline autotune of the Triton MLA decode's stage-1 launch configs, on the GPU at hand.

For each (head bucket, S_q bucket, KV kind) of ``rocm_mla/kernels/tuned_configs.py`` it times one
representative decode (``--batch`` requests of ``--context`` keys, block 64, shuffled block
table) with every config of a sweep, each on its planned path (the resident slots from
``plan_launch`` for that config and the balanced schedule of the lengths over them, both
outside the timed region), and keeps the fastest. Configs that fail to compile or run (out
of shared memory, registers) are recorded and skipped; every config is first checked
against the torch backend on a small problem whose requests the schedule cuts (one piece per
slot), so a fast wrong config, or a wrong merge, can never win.

Writes a JSON table in the format of the package's own (``rocm_mla/kernels/configs/``,
read by ``tuned_configs.read_table_file``): set ``ROCM_MLA_TRITON_CONFIGS=<file>`` to use it,
or merge its entries into the target's file there; every timing is kept for the record. Run on
a GPU:

    python -m benchmarks.autotune_triton [--heads 16 128] [--q-lens 1 2] [--kv bf16 fp8]
        [--batch 64] [--context 8192] [--quick] [--out FILE]

The stored ``config`` is the table entry as swept (64 rows); the buckets' smaller row
counts shrink it at launch as ``plan_launch`` does.

Without the target's GPU, ``--compiled KEY`` chooses on compiled evidence instead of time
(``rocm-mla bench static``'s compile and gates, for a registry key, under ``--triton``). The
shapes asked for are grouped by the table key that answers them (``--heads 12 16`` both read
the 16-head bucket), and every candidate of a key is compiled at each of its shapes as bench
static compiles a case (B 8, 32 and 128 of a 32K context) and gated. The entry is the
candidate passing every gate at the most shapes, then the one with the least issued/useful
matrix work, the most resident programs per CU, the largest BLOCK_N, the fewest registers
(a memory-bound decode hides latency with resident programs and long tiles; none of this is
timed, and the sources say so). A shape the entry fails is refused by the row group it
would run in (the entry's ``refuse``, ``tuned_configs.read_table_file``), with each
candidate's failing gates as the reason, unless a shape it passes runs the same group:

    python -m benchmarks.autotune_triton --compiled gfx1250 --triton 3.9.0 --focused \
        --heads 12 16 24 48 64 96 128 --q-lens 1 2 4 8 [--jobs 2] [--out FILE]

Timing: ``triton.testing.do_bench`` (median of a fixed time budget, L2 flushed between
runs). Compiles dominate: the defaults (8 buckets, up to 33 configs each) should take tens
of minutes on one H200 (not yet run); ``--quick`` (64 rows, 8 warps) a few minutes.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import re
import sys
from pathlib import Path

import torch

from benchmarks import common

HEAD_DIM, HEAD_DIM_V, BLOCK_SIZE = 576, 512, 64


def sweep(target, kv_kind: str, quick: bool) -> list:
    """Candidate configs for a target and KV kind (hip knobs only on hip).

    The space is kept to what can matter on each target (every config is a compile of a
    minute or less): AMD keeps 16/32-key tiles (64 KB of LDS on MI300X) and 1-2 stages;
    NVIDIA sweeps 32/64-key tiles and 2-3 stages. fp8 sweeps fp8 ``Q K^T`` with and
    without fp8 ``P V``. ``quick``: 64 rows and 8 warps only.
    """
    from rocm_mla.kernels.tuned_configs import LaunchConfig

    if target.backend == "hip":
        space = {"block_n": (16, 32), "num_stages": (1, 2)}
        extra = {
            "waves_per_eu": 1,
            "matrix_instr_nonkdim": 16,
            "num_xcds": target.spec.xcds,
            "kpack": target.spec.kpack,
        }
    else:
        space = {"block_n": (32, 64), "num_stages": (2, 3)}
        extra = {}
    fp8 = kv_kind == "fp8"
    rows = (64,) if quick else (32, 64)
    warps = (8,) if quick else (4, 8)
    chunks = (1,) if fp8 else (1, 2)
    modes = ((True, True), (True, False)) if fp8 else ((False, False),)
    configs = []
    for block_h, block_n, num_warps, num_stages, dv_chunks, (fp8_qk, fp8_pv) in itertools.product(
        rows, space["block_n"], warps, space["num_stages"], chunks, modes
    ):
        configs.append(
            LaunchConfig(
                block_h=block_h,
                block_n=block_n,
                num_warps=num_warps,
                num_stages=num_stages,
                dv_chunks=dv_chunks,
                fp8_qk=fp8_qk,
                fp8_pv=fp8_pv,
                **extra,
            )
        )
    return configs


def focused(target, heads: int, q_len: int, kv_kind: str) -> list:
    """The few candidates worth timing for one of issue 37's weak sm90 shapes (the 64-row
    groups of H128 and of verify windows, fp8 caches, H16): the 64-row group at 64- and
    32-key tiles, 32-row groups (mma.sync, or keys as M for fp8) at 64 and 32 keys, for a
    16-row problem its group at 64 and 32 keys with 4 or 8 warps, and for fp8 the old fp8
    P.V (V transposed byte by byte) beside the fp16 one. All but the 64 x 64 tile compile
    without spills on Triton 3.8 and 3.9 at these shapes (``rocm-mla bench static``); that
    one spills 36-40 B on 3.8 and none on 3.9. Other targets get ``sweep``'s space."""
    from dataclasses import replace

    from rocm_mla.kernels.tuned_configs import LaunchConfig

    if target.backend != "cuda":
        return _amd_focused(target, heads, q_len, kv_kind)
    fp8 = kv_kind == "fp8"
    fp8_dots = {"fp8_qk": True} if fp8 else {}
    shrunk = {"shrunk_prefetch_ids": True, "shrunk_keys_as_m": True if fp8 else None}
    configs = [
        LaunchConfig(block_h=64, block_n=n, num_warps=8, num_stages=s, **fp8_dots, **shrunk)
        for n, s in ((64, 2), (32, 3))
    ]
    sizes = [(32, 64, 8, 3), (32, 32, 8, 3)]
    if heads * q_len <= 16:  # one 16-row group
        sizes = [(16, 64, 8, 3), (16, 32, 8, 3), (16, 64, 8, 2), (16, 64, 4, 3), (16, 32, 4, 4)]
    configs += [
        LaunchConfig(
            block_h=h,
            block_n=n,
            num_warps=w,
            num_stages=s,
            prefetch_ids=True,
            keys_as_m=fp8,
            **fp8_dots,
        )
        for h, n, w, s in sizes
    ]
    if fp8:
        configs.append(replace(configs[0], fp8_pv=True))
    return configs


def _amd_focused(target, heads: int, q_len: int, kv_kind: str) -> list:
    """The few AMD candidates worth compiling for a shape, around the CDNA tables' shapes: from
    64 rows on (compute-bound) a 64-row group with each of 4 waves owning 16 rows and V in two
    halves, under 64 rows a 16-row group on 4 or 8 waves; 16-, 32- or 64-key tiles (32 is a
    wave32 WMMA's K for 16-bit P.V), two stages (three once), one or two waves per EU (the
    registers LLVM may give a wave). fp8 runs Q.K^T in fp8 (P.V in fp16). The target's XCD
    remap and kpack (the registry's), 16-wide matrix ops.

    From 64 rows on, three more for the row counts a 64-row group pads (96 rows run as three
    32-row groups, ``group_config``): 32-row groups of 2 waves, each owning 16 rows; a 64-row
    group that shrinks to 32 rows on all 4 waves with keys as the dots' M (so no wave repeats
    another's Q.K^T), never below 32; and a 64-row group that never shrinks (a bucket's
    smaller head counts then run one padded group)."""
    from dataclasses import replace

    from rocm_mla.kernels.tuned_configs import LaunchConfig

    knobs = {
        "num_xcds": target.spec.xcds,
        "kpack": target.spec.kpack,
        "matrix_instr_nonkdim": 16,
        "prefetch_ids": True,
        "fp8_qk": kv_kind == "fp8",
    }
    if heads * q_len >= 64:
        configs = [
            LaunchConfig(
                block_h=64, block_n=n, num_warps=4, num_stages=s, dv_chunks=2, rows_per_warp=16,
                **knobs, waves_per_eu=w,
            )
            for n, s, w in ((32, 2, 1), (32, 2, 2), (16, 2, 2), (64, 2, 2), (32, 3, 2))
        ]  # fmt: skip
        whole = replace(configs[0], rows_per_warp=None)
        return [
            *configs,
            replace(configs[0], block_h=32, num_warps=2),
            replace(whole, shrunk_keys_as_m=True, min_block_h=32),
            replace(whole, min_block_h=64),
        ]
    return [
        LaunchConfig(block_h=16, block_n=n, num_warps=w, num_stages=2, **knobs, waves_per_eu=e)
        for n, w, e in ((32, 4, 1), (32, 4, 2), (16, 4, 2), (64, 4, 2), (32, 8, 2))
    ]


def _passing(result: dict, kernels: dict) -> dict | None:
    """A candidate's evidence at one shape (B 32) when every gate of bench static passes there at
    every batch, else None."""
    verdicts = result["gates"]
    if not result["per_batch"] or any(v["pass"] is False for v in verdicts.values()):
        return None
    at = {b["batch"]: b for b in result["per_batch"]}
    b = at.get(32, result["per_batch"][0])
    info = kernels[b["stage1"]]
    return {
        "issued_over_useful": b["issued_over_useful"] or 1.0,
        "resident_per_cu": b["resident_per_unit"],
        "registers": info["regs_per_thread"] + info.get("agprs_per_thread", 0),
    }


def _failure(result: dict, kernels: dict) -> str:
    """The gates a candidate fails at one shape, with their figures (for a refusal's reason)."""
    failed = sorted(k for k, v in result["gates"].items() if v["pass"] is False)
    spills = max(
        (kernels[b["stage1"]].get("vgpr_spill_count") or 0 for b in result["per_batch"]), default=0
    )
    issued = max((b["issued_over_useful"] or 1.0 for b in result["per_batch"]), default=1.0)
    figures = {"no_spills": f"{spills} VGPRs spilled", "issued_over_useful": f"{issued:.2f}"}
    return ", ".join(f"{gate} ({figures[gate]})" if gate in figures else gate for gate in failed)


def _choose_compiled(
    results: list[tuple[object, list[tuple[tuple, dict]]]], kernels: dict
) -> tuple[object, dict, list[tuple]] | None:
    """``(config, evidence, the shapes it fails)`` compiled evidence prefers for one table key,
    of ``[(config, [(shape, bench static's result there), ...]), ...]``: every shape it fails
    refusable by its row group (``_refusals``), then the most of the key's shapes passing every
    gate; then, over those shapes, the least issued/useful (B 32), the most resident programs
    per CU, the largest BLOCK_N, the fewest registers (each at its worst shape); None when no
    candidate passes at any shape."""
    ranked = []
    for order, (config, per_shape) in enumerate(results):
        passing = {shape: _passing(result, kernels) for shape, result in per_shape}
        good = [e for e in passing.values() if e is not None]
        if not good:
            continue
        evidence = {
            "issued_over_useful": max(e["issued_over_useful"] for e in good),
            "resident_per_cu": min(e["resident_per_cu"] for e in good),
            "block_n": config.block_n,
            "registers": max(e["registers"] for e in good),
        }
        failed = [shape for shape, e in passing.items() if e is None]
        unrefusable = bool(failed) and _refusals(config, list(passing), failed, {}) is None
        key = (
            unrefusable,
            len(failed),
            round(evidence["issued_over_useful"], 2),
            -evidence["resident_per_cu"],
            -config.block_n,
            evidence["registers"],
            order,
        )
        ranked.append((key, config, evidence, failed))
    if not ranked:
        return None
    _, config, evidence, failed = min(ranked, key=lambda r: r[0])
    return config, evidence, failed


def _refusals(config, shapes: list[tuple], failed: list[tuple], why: dict) -> list[dict] | None:
    """The table entry's ``refuse`` list for the shapes ``config`` fails: each by the row group
    ``group_config`` runs them in, with ``why`` (``{shape: reason}``); None when a refused group
    would also be one a passing shape runs (the entry then refuses nothing, and bench static
    shows the failure)."""
    from rocm_mla.kernels.mla_decode_args import group_config

    def group(shape: tuple) -> int:
        return group_config(config, shape[0] * shape[1]).block_h

    passing = {group(s) for s in shapes if s not in failed}
    refused: dict[int, list[str]] = {}
    for shape in failed:
        if group(shape) in passing:
            return None
        refused.setdefault(group(shape), []).append(
            f"H{shape[0]} S_q {shape[1]}: {why.get(shape, 'fails a gate')}"
        )
    return [{"block_h": block_h, "why": "; ".join(r)} for block_h, r in sorted(refused.items())]


def compiled(args, parser) -> Path:
    """``--compiled KEY``: choose each table key's entry on compiled evidence (the module
    docstring), and write the table file."""
    import triton

    from benchmarks import kernel_static as ks
    from rocm_mla.kernels import tuned_configs as tables
    from rocm_mla.targets import TARGETS

    if args.compiled not in ks.TARGETS:
        parser.error(f"--compiled: expected one of {sorted(ks.TARGETS)}, got {args.compiled!r}")
    target = ks.TARGETS[args.compiled]
    here = target.triton_target()
    spec = TARGETS[args.compiled]
    # The shapes asked for, by the table key that answers them: a key's entry must serve each.
    keys: dict[tuple[str, str, str], list[tuple[int, int, str]]] = {}
    for heads, q_len, kv_kind in itertools.product(args.heads, args.q_lens, args.kv):
        key = (
            tables.head_bucket(heads),
            tables.q_len_bucket(q_len),
            "fp8" if kv_kind == "fp8" else "16bit",
        )
        keys.setdefault(key, []).append((heads, q_len, kv_kind))
    cases, configs, candidates = [], {}, {}
    for key, shapes in keys.items():
        heads, q_len, kv_kind = shapes[-1]
        kv_dtype = torch.bfloat16 if kv_kind == "bf16" else spec.fp8_dtype
        tried = [tables.lookup(spec.table, heads, q_len, kv_dtype).config]
        for h, q, kv in shapes:
            space = focused(here, h, q, kv) if args.focused else sweep(here, kv, args.quick)
            tried += [c for c in space if c not in tried]
        for i, config in enumerate(tried):
            runs = []
            for shape in shapes:
                h, q, kv = shape
                case = ks.Case(f"H{h} Sq{q} {kv} candidate {i}", h, q, kv)
                cases.append(case)
                configs[case.name] = config
                runs.append((shape, case))
            candidates.setdefault(key, []).append((config, runs))
    ks.use_hip_linker()
    payload = ks.run(tuple(cases), [target], workers=args.jobs, configs=configs)
    kernels = payload["kernels"]
    by_name = {r["case"]["name"]: r for r in payload["results"]}
    today = datetime.date.today().isoformat()
    entries, report = [], []
    smallest_q = {}
    for h, s, kind in keys:
        smallest_q[h, kind] = min(smallest_q.get((h, kind), s), s, key=int)
    for key, tried in candidates.items():
        shapes = keys[key]
        results = [
            (config, [(shape, by_name[case.name]) for shape, case in runs])
            for config, runs in tried
        ]
        report.append(
            {
                "key": list(key),
                "shapes": [list(s) for s in shapes],
                "candidates": [
                    {
                        "config": config.to_dict(),
                        "per_shape": [
                            {
                                "shape": list(shape),
                                "failed": _failure(result, kernels),
                                "resident_per_cu": [
                                    b["resident_per_unit"] for b in result["per_batch"]
                                ],
                                "issued_over_useful": [
                                    b["issued_over_useful"] for b in result["per_batch"]
                                ],
                            }
                            for shape, result in per_shape
                        ],
                    }
                    for config, per_shape in results
                ],
            }
        )
        chosen = _choose_compiled(results, kernels)
        if chosen is None:
            print(f"autotune: no candidate of {key} passes every gate at any of {shapes}",
                  file=sys.stderr)  # fmt: skip
            continue
        config, evidence, failed = chosen
        named = ", ".join(f"H{h} S_q {q}" for h, q, _ in shapes)
        source = (
            f"unmeasured: autotune --compiled on Triton {triton.__version__} ({today}, no "
            f"{args.compiled} GPU) over {named}: of {len(tried)} candidates, the most shapes "
            "passing every bench-static gate (B 8, 32 and 128 of 32K keys), then the least "
            "issued/useful, most resident programs per CU, largest BLOCK_N, fewest registers: "
            f"issued/useful {evidence['issued_over_useful']}, {evidence['resident_per_cu']} "
            f"programs/CU, {evidence['registers']} VGPRs, no spills"
        )
        entry = {
            "heads": key[0],
            # A head bucket's smallest S_q bucket swept answers its every other one.
            "q_len": "*" if key[1] == smallest_q[key[0], key[2]] else key[1],
            "kv": key[2],
            "config": config.to_dict(),
            "source": source,
        }
        if failed:
            by_shape = dict(results[[c for c, _ in results].index(config)][1])
            passed_elsewhere = {
                shape: sum(_passing(dict(r)[shape], kernels) is not None for _, r in results)
                for shape in failed
            }
            why = {
                shape: f"this config fails {_failure(by_shape[shape], kernels)}; "
                f"{passed_elsewhere[shape]} of the {len(tried)} candidates pass there"
                + ("" if passed_elsewhere[shape] else " (every other fails a gate too)")
                for shape in failed
            }
            refuse = _refusals(config, shapes, failed, why)
            if refuse:
                entry["refuse"] = refuse
            print(f"autotune: {key} fails at {failed}; refused: {refuse}", file=sys.stderr)
        entries.append(entry)
        print(f"{key}: {config}", file=sys.stderr)
    # A table answers every lookup: a head bucket not swept takes its KV kind's choice for the
    # fewest heads swept, and any other kind (fp32, a test dtype) the 16-bit one; neither was
    # compiled for those shapes, so neither refuses any.
    wildcards = []
    for kind in ("16bit", "fp8", "*"):
        of_kind = [e for e in entries if e["kv"] == (kind if kind != "*" else "16bit")]
        if of_kind:
            first = {k: v for k, v in of_kind[0].items() if k != "refuse"}
            wildcards.append(
                {
                    **first,
                    "heads": "*",
                    "q_len": "*",
                    "kv": kind,
                    "source": f"unmeasured: the {first['heads']}-head bucket's "
                    f"{first['kv']} choice of autotune --compiled, for the shapes and kinds "
                    "with no entry of their own (not compiled for them)",
                }
            )
    entries += wildcards
    out = args.out or (
        common.RESULTS_DIR / f"triton-tuned-{args.compiled}-compiled-triton-"
        f"{triton.__version__}-{today}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "target": spec.table,
                "device": f"none (compiled for {args.compiled})",
                "environment": common.environment(),
                "entries": entries,
                "sweeps": report,
            },
            indent=2,
        )
        + "\n"
    )
    tables.load_table_file(out)  # the file must load as a table
    print(f"wrote {out}")
    return out


def make_problem(batch, context, heads, q_len, kv_kind, device, seed=0):
    from benchmarks.kernel_roofline import build_cache
    from rocm_mla.inputs import prepare_decode

    lens = torch.full((batch,), context, dtype=torch.int32)
    kv, table, scale = build_cache(lens, kv_kind, BLOCK_SIZE, device, seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(
        batch, q_len, heads, HEAD_DIM, dtype=torch.bfloat16, device=device, generator=gen
    )
    return prepare_decode(
        q,
        kv,
        table,
        lens.to(device),
        head_dim_v=HEAD_DIM_V,
        softmax_scale=None,
        causal=True,
        kv_scale=scale,
    )


def planned_schedule(problem, config, slots: int | None = None):
    """The balanced schedule of ``problem``'s lengths for ``config`` over ``slots`` (None:
    one piece per slot, so that every request of more than one piece is cut)."""
    from rocm_mla.kernels import schedule as sch

    lengths = [int(v) for v in problem.cache_seqlens.tolist()]
    groups = -(-(problem.q.shape[1] * problem.q.shape[2]) // config.block_h)
    capacity = problem.block_table.shape[1] * problem.kv_cache.shape[1]
    if slots is None:
        slots = groups * sum(max(1, sch.pieces_of(n, capacity)) for n in lengths)
    return sch.host_schedule(
        lengths,
        num_groups=groups,
        num_slots=slots,
        capacity_keys=capacity,
        num_pools=config.num_xcds,
        device=problem.q.device,
    )


def decode_call(problem, config, schedule):
    from rocm_mla.kernels import mla_decode as kernel

    def call():
        return kernel.mla_decode(
            problem.q,
            problem.kv_cache,
            problem.block_table,
            problem.cache_seqlens,
            head_dim_v=HEAD_DIM_V,
            softmax_scale=problem.softmax_scale,
            kv_scale=problem.kv_scale,
            config=config,
            schedule=schedule,
        )

    return call


def is_correct(config, check, reference) -> str | None:
    """None when ``config`` reproduces the torch backend on the small check problem, its
    requests cut across slots (stage 1's partials and the merge checked too)."""
    schedule = planned_schedule(check, config)
    assert schedule.num_partials > 0
    out, lse = decode_call(check, config, schedule)()
    ref_out, ref_lse = reference
    # fp8 dots round Q and P to fp8: a few percent, as the fp8 tests model it.
    tol = 0.15 if (config.fp8_qk or config.fp8_pv) and check.kv_scale is not None else 3e-2
    if not torch.isfinite(out).all():
        return "non-finite output"
    err = (out.float() - ref_out.float()).abs().max().item()
    lse_err = (lse - ref_lse).abs().max().item()
    if err > tol or lse_err > tol:
        return f"wrong result: max |out error| {err:.3g}, |lse error| {lse_err:.3g} > {tol}"
    return None


def _warm_one(job: tuple) -> str | None:
    """Compile one candidate's kernels (Triton's disk cache keeps them) by running its
    correctness check and one timed-shape call, in a worker process; the error, if any."""
    config_dict, heads, q_len, kv_kind, batch, context = job
    from rocm_mla.kernels.tuned_configs import LaunchConfig

    config = LaunchConfig.from_dict(config_dict)
    try:
        from rocm_mla.backends.torch_ref import torch_mla_decode
        from rocm_mla.kernels import mla_decode as kernel
        from rocm_mla.kernels.target import triton_target

        problem = make_problem(batch, context, heads, q_len, kv_kind, "cuda")
        check = make_problem(3, 700, heads, q_len, kv_kind, "cuda", seed=1)
        planned, slots = kernel.plan_launch(
            q_len=q_len,
            num_heads=heads,
            kv_dtype=problem.kv_cache.dtype,
            target=triton_target(),
            config=config,
            q_dtype=problem.q.dtype,
            head_dim=HEAD_DIM,
            head_dim_v=HEAD_DIM_V,
            page_size=BLOCK_SIZE,
            cache_bytes=problem.kv_cache.numel() * problem.kv_cache.element_size(),
        )
        wrong = is_correct(planned, check, torch_mla_decode(check))
        decode_call(problem, planned, planned_schedule(problem, planned, slots))()
        torch.cuda.synchronize()
        return wrong
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


def warm(candidates, heads, q_len, kv_kind, args) -> None:
    """Compile every candidate in ``args.jobs`` processes at once (the device machine's
    cores), so that the timing loop below finds each kernel compiled."""
    import multiprocessing

    if args.jobs <= 1:
        return
    jobs = [(c.to_dict(), heads, q_len, kv_kind, args.batch, args.context) for c in candidates]
    with multiprocessing.get_context("spawn").Pool(min(args.jobs, len(jobs))) as pool:
        for config, error in zip(candidates, pool.map(_warm_one, jobs), strict=True):
            if error is not None:
                print(f"autotune: {config}: {error}", file=sys.stderr)


def tune_bucket(target, heads, q_len, kv_kind, args) -> dict:
    import triton

    from rocm_mla.backends.torch_ref import torch_mla_decode
    from rocm_mla.kernels import mla_decode as kernel

    device = "cuda"
    problem = make_problem(args.batch, args.context, heads, q_len, kv_kind, device)
    check = make_problem(3, 700, heads, q_len, kv_kind, device, seed=1)
    reference = torch_mla_decode(check)
    current = kernel.default_config(
        target, num_heads=heads, q_len=q_len, kv_dtype=problem.kv_cache.dtype
    )
    space = (
        focused(target, heads, q_len, kv_kind)
        if args.focused
        else sweep(target, kv_kind, args.quick)
    )
    candidates = [current] + [c for c in space if c != current]
    warm(candidates, heads, q_len, kv_kind, args)
    timings, best, tried = [], None, set()
    for i, config in enumerate(candidates):
        common.progress(i, len(candidates), f"H{heads} S_q{q_len} {kv_kind} {config}")
        kv = problem.kv_cache
        planned, slots = kernel.plan_launch(
            q_len=q_len,
            num_heads=heads,
            kv_dtype=kv.dtype,
            target=target,
            config=config,
            q_dtype=problem.q.dtype,
            head_dim=HEAD_DIM,
            head_dim_v=HEAD_DIM_V,
            page_size=BLOCK_SIZE,
            cache_bytes=kv.numel() * kv.element_size(),
        )
        if planned in tried:  # BLOCK_H shrunk to the rows: the same kernel as before
            continue
        tried.add(planned)
        record = {"config": config.to_dict(), "num_slots": slots}
        try:
            wrong = is_correct(planned, check, reference)
            if wrong is None:
                schedule = planned_schedule(problem, planned, slots)
                ms = triton.testing.do_bench(
                    decode_call(problem, planned, schedule), rep=args.rep_ms, return_mode="median"
                )
        except Exception as exc:  # a config past the shared memory or register budget
            record["failed"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            timings.append(record)
            continue
        if wrong is not None:
            record["failed"] = wrong
            timings.append(record)
            continue
        record["time_us"] = ms * 1e3
        timings.append(record)
        if best is None or record["time_us"] < best["time_us"]:
            best = record
    if best is None:
        raise SystemExit(f"autotune: no config ran for H{heads} S_q{q_len} {kv_kind}")
    baseline = timings[0].get("time_us")
    return {"best": best, "baseline_us": baseline, "timings": timings}


def _parse_shape(text: str, parser: argparse.ArgumentParser) -> tuple[int, int, str, int, int]:
    parts = text.split(",")
    if len(parts) != 5 or parts[2] not in ("bf16", "fp8"):
        parser.error(
            f"--shape must be H,S_Q,bf16|fp8,B,CTX (e.g. 128,1,bf16,64,8192), got {text!r}"
        )
    try:
        heads, q_len, batch, context = (int(parts[i]) for i in (0, 1, 3, 4))
    except ValueError:
        parser.error(f"--shape: H, S_Q, B and CTX must be integers, got {text!r}")
    if min(heads, q_len, batch, context) < 1:
        parser.error(f"--shape: H, S_Q, B and CTX must be >= 1, got {text!r}")
    return heads, q_len, parts[2], batch, context


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.autotune_triton", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--q-lens", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--kv", nargs="+", choices=("bf16", "fp8"), default=["bf16", "fp8"])
    parser.add_argument("--batch", type=int, default=64, help="requests per timed decode")
    parser.add_argument("--context", type=int, default=8192, help="keys per request")
    parser.add_argument("--rep-ms", type=int, default=100, help="do_bench time budget per config")
    parser.add_argument("--quick", action="store_true", help="a small sweep around 64 rows")
    parser.add_argument(
        "--focused",
        action="store_true",
        help="the few candidates worth trying per shape (focused(): issue 37's for NVIDIA's weak "
        "shapes, the CDNA tables' neighbourhood on AMD) instead of the sweep",
    )
    parser.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="H,S_Q,KV,B,CTX",
        help="tune these shapes (e.g. 128,1,bf16,64,8192) instead of --heads x --q-lens x --kv",
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="processes that compile the candidates first"
    )
    parser.add_argument("--out", type=Path, help="output JSON (default: benchmarks/results/...)")
    parser.add_argument(
        "--compiled",
        metavar="KEY",
        help="no GPU: choose on compiled evidence for this registry key (bench static's compile "
        "and gates) instead of timing",
    )
    parser.add_argument(
        "--triton",
        metavar="VERSION|DIR",
        help="with --compiled: compile with this Triton (as rocm-mla bench static --triton)",
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.compiled is not None:
        if args.triton is not None:
            from benchmarks import kernel_static as ks

            is_version = re.fullmatch(r"\d+\.\d+\.\d+\S*", args.triton) is not None
            folder = ks.triton_folder(args.triton)
            version = args.triton if is_version else None
            ks.use_triton(folder, argv, version, module="benchmarks.autotune_triton")
        return compiled(args, parser)
    if not torch.cuda.is_available():
        parser.error("autotune needs a GPU (torch sees none)")

    import triton

    from rocm_mla.kernels import mla_decode as kernel
    from rocm_mla.kernels import tuned_configs as tables
    from rocm_mla.kernels.target import triton_target

    target = triton_target()
    key = kernel.target_key(target)
    device = common.device_name()
    entries, report = [], []
    shapes = [
        (heads, q_len, kv_kind, args.batch, args.context)
        for heads, q_len, kv_kind in itertools.product(args.heads, args.q_lens, args.kv)
    ]
    if args.shape:
        shapes = [_parse_shape(text, parser) for text in args.shape]
    out = args.out or (
        common.RESULTS_DIR / f"triton-tuned-{key}-{common.device_slug()}-"
        f"{datetime.date.today().isoformat()}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    for heads, q_len, kv_kind, batch, context in shapes:
        args.batch, args.context = batch, context
        result = tune_bucket(target, heads, q_len, kv_kind, args)
        best = result["best"]
        speedup = (result["baseline_us"] or float("nan")) / best["time_us"]
        source = (
            f"measured: autotune on {device}, {datetime.date.today().isoformat()}, "
            f"Triton {triton.__version__}, B{batch} ctx{context}, {best['time_us']:.1f} us "
            f"({speedup:.2f}x the previous entry)"
        )
        entries.append(
            {
                "heads": tables.head_bucket(heads),
                "q_len": tables.q_len_bucket(q_len),
                "kv": "fp8" if kv_kind == "fp8" else "16bit",
                "config": best["config"],
                "source": source,
            }
        )
        report.append(
            {"heads": heads, "q_len": q_len, "kv": kv_kind, "batch": batch, "context": context}
            | result
        )
        print(f"H{heads} S_q{q_len} {kv_kind}: {source}", file=sys.stderr)
        # Written after every shape: a run stopped at its time limit keeps what it measured.
        payload = {
            "target": key,
            "device": device,
            "environment": common.environment(),
            "entries": entries,
            "sweeps": report,
        }
        out.write_text(json.dumps(payload, indent=2) + "\n")
        tables.load_table_file(out)  # the file must load as a table
    print(f"wrote {out}; use it with ROCM_MLA_TRITON_CONFIGS={out}")
    return out


if __name__ == "__main__":
    main()
