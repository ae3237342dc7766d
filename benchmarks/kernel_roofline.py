"""Kernel roofline: our MLA decode backends beside peer kernels, as % of bandwidth and compute peak.

Ours: every available backend of the registry (``triton``, ``torch``, ``aiter``). The Triton
one is timed on its planned path: ``plan_launch`` (config from the tuned table, resident
slots from the occupancy) and the balanced schedule of the case's lengths (``host_schedule``,
the device planner's tables; an engine plans once per step for all layers) are made once per
case outside the timed region, and the timed call passes both, so it launches stage 1 and
the merge of the cut units with no host sync. Peers, in the same run on identical inputs
when they import:

- ``vllm-triton``: vLLM's ``decode_attention_fwd``, called as its ``TritonMLAImpl.forward_mqa``
  does (its split count, fp32 ``attn_logits`` scratch, fp8 through ``k_scale``/``v_scale``,
  S_q > 1 flattened to one row per position).
- ``flashmla``: ``flash_mla_with_kvcache`` + ``get_mla_metadata`` from a
  ``flash_mla_interface`` module: ``--flash-mla PATH`` / ``ROCM_MLA_FLASH_MLA`` (a file or
  folder), else ``flash_mla`` or vLLM's bundled ``vllm.third_party.flashmla``; bf16 cache,
  block 64 (its fp8 cache format is not a per-tensor-scaled e4m3 cache).
- ``aiter``: AITER's ``mla_decode_fwd`` on ROCm, through our ``aiter`` backend.

Timing is kernel-only: inputs are validated and planned outside; median over repeats after
warmup, caches flushed before every timed call. The roofline numbers:

    bytes  = sum(len) * D * kv_bytes + B * S_q * H * (D * q_bytes + Dv * out_bytes)
    FLOPs  = S_q * sum(len) * H * 2 * (D + Dv)           (QK^T over D, PV over Dv)
    % peak bandwidth = bytes / time / peak bandwidth
    % peak compute   = FLOPs / time / dense peak (bf16, or fp8 for an fp8 cache)
    % roofline       = max(bytes / bandwidth, FLOPs / compute) / time

and ``vs_best_peer`` = best peer time / this time (> 1: faster than every peer).

Presets: ``--gpu`` runs the issue-17 cases (H200 table; a few minutes on one GPU);
``--grid full`` is the wide grid; ``tiny`` (the CPU default) keeps a 2-core CPU to a
minute; the Triton interpreter is only timed with ``--interpreter``, on one tiny case per
dtype. Writes ``benchmarks/results/kernel-roofline-<device>-<date>.json`` and a PNG.
Run: ``python -m benchmarks.kernel_roofline [--gpu | --grid full|tiny] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import inspect
import itertools
import math
import os
import sys
from pathlib import Path

import torch

from benchmarks import common

HEAD_DIM, HEAD_DIM_V = 576, 512
PEERS = ("vllm-triton", "flashmla")

#: Dense peak FLOP/s (bf16, fp8) by a substring of the device name (datasheets).
PEAK_COMPUTE = {
    "MI300X": (1307e12, 2615e12),
    "MI325X": (1307e12, 2615e12),
    "MI355X": (2517e12, 5033e12),
    "H100": (989e12, 1979e12),
    "H200": (989e12, 1979e12),
}


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    context: int
    heads: int
    q_len: int
    kv_kind: str  #: "bf16", "fp8"
    lengths: str = "uniform"  #: "uniform" (all = context), "mixed" (mean = context)

    def label(self) -> str:
        text = f"B{self.batch} ctx{self.context // 1024}K H{self.heads}"
        if self.context < 1024:
            text = f"B{self.batch} ctx{self.context} H{self.heads}"
        if self.q_len > 1:
            text += f" S_q{self.q_len}"
        if self.kv_kind != "bf16":
            text += f" {self.kv_kind}"
        return text + ("" if self.lengths == "uniform" else f" {self.lengths}")


def grid(batches, contexts, heads, q_lens, kv_kinds, lengths) -> list[Case]:
    return [
        Case(b, c, h, s, k, n)
        for b, c, n, k, h, s in itertools.product(
            batches, contexts, lengths, kv_kinds, heads, q_lens
        )
    ]


PRESETS = {
    # The issue-17 H200 table, its sweep cases, and bf16/fp8 pairs at H16 for the fp8 speedup.
    "gpu": [
        Case(128, 32768, 16, 1, "bf16"),
        Case(32, 16384, 16, 1, "bf16"),
        Case(8, 32768, 16, 1, "bf16"),
        Case(128, 8192, 16, 1, "bf16"),
        Case(128, 32768, 128, 1, "bf16"),
        Case(32, 16384, 128, 1, "bf16"),
        Case(128, 8192, 128, 1, "bf16"),
        Case(64, 8192, 128, 2, "bf16"),
        Case(64, 8192, 128, 1, "bf16"),
        Case(64, 8192, 128, 1, "fp8"),
        Case(128, 16384, 16, 1, "bf16"),
        Case(128, 16384, 16, 1, "fp8"),
        Case(128, 32768, 16, 1, "fp8"),
    ],
    "full": grid(
        (1, 8, 32, 128),
        (1024, 4096, 16384, 32768),
        (16, 128),
        (1, 2, 4),
        ("bf16", "fp8"),
        ("uniform", "mixed"),
    ),
    # A 2-core CPU decodes B=128 x 32K in minutes per call; this keeps the run to a minute.
    "tiny": grid((1, 4), (1024, 4096), (16,), (1, 2), ("bf16", "fp8"), ("uniform", "mixed")),
    # The Triton interpreter runs each program in Python: one small case per dtype.
    "interpreter": grid((1,), (256,), (16,), (1,), ("bf16", "fp8"), ("uniform",)),
}


def lengths_for(kind: str, batch: int, context: int, gen: torch.Generator) -> torch.Tensor:
    """[B] int32: all ``context`` (uniform), or ~N(context, context/2) clipped to [1, 2 context]."""
    if kind == "uniform":
        return torch.full((batch,), context, dtype=torch.int32)
    lens = torch.normal(float(context), context / 2, (batch,), generator=gen)
    return lens.round().clamp(1, 2 * context).to(torch.int32)


def fp8_dtype() -> torch.dtype:
    """The platform's fp8 flavour: e4m3fnuz on MI300X (gfx942), e4m3fn elsewhere."""
    from rocm_mla.platform import current_platform

    return torch.float8_e4m3fnuz if current_platform().arch == "gfx942" else torch.float8_e4m3fn


def build_cache(lens: torch.Tensor, kind: str, block_size: int, device: str, seed: int):
    """A shuffled paged cache holding ``lens`` tokens per request: (kv, block_table, kv_scale)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-int(n) // block_size) for n in lens]
    max_blocks, num_blocks = max(max(blocks), 1), max(sum(blocks), 1)
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(blocks), max_blocks, dtype=torch.int32)
    cursor = 0
    for b, n in enumerate(blocks):
        table[b, :n] = perm[cursor : cursor + n].to(torch.int32)
        cursor += n
    kv = torch.randn(num_blocks, block_size, HEAD_DIM, dtype=torch.bfloat16, device=device)
    scale = None
    if kind == "fp8":
        scale = 0.05
        kv = (kv / scale).to(fp8_dtype())
    return kv, table.to(device), scale


class CacheFlush:
    """Evicts the kernel's inputs from every cache level before a timed call.

    GPUs: rewrite a buffer larger than L2 + MI300X's 256 MB Infinity Cache. CPUs: a buffer
    larger than the last-level cache.
    """

    def __init__(self, device: str) -> None:
        nbytes = (512 << 20) if device != "cpu" else (64 << 20)
        self.buffer = torch.empty(nbytes // 4, dtype=torch.float32, device=device)

    def __call__(self) -> None:
        self.buffer.zero_()


def kernel_time(fn, flush: CacheFlush, *, device: str, warmup: int, repeats: int) -> float:
    """Median seconds of ``fn()``: GPU events around the call only, or wall time on CPU."""
    if device == "cpu":
        return common.median_time(fn, repeats=repeats, warmup=warmup, before=flush)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def roofline(lens: torch.Tensor, heads: int, q_len: int, kv: torch.Tensor, q_dtype) -> dict:
    total_len = int(lens.sum())
    queries = lens.shape[0] * q_len
    q_bytes = torch.empty((), dtype=q_dtype).element_size()
    nbytes = (
        total_len * HEAD_DIM * kv.element_size()
        + queries * heads * HEAD_DIM * q_bytes
        + queries * heads * HEAD_DIM_V * q_bytes
    )
    flops = q_len * total_len * heads * 2 * (HEAD_DIM + HEAD_DIM_V)
    return {"bytes": nbytes, "flops": flops, "sum_len": total_len}


def peak_compute(name: str) -> tuple[float, float] | None:
    """Dense (bf16, fp8) FLOP/s of a known GPU, else None."""
    for key, peaks in PEAK_COMPUTE.items():
        if key.lower() in name.lower():
            return peaks
    return None


# ---- ours ------------------------------------------------------------------------------------


def planned_triton(problem, lens_host: torch.Tensor):
    """Our Triton decode on its planned path: (call, plan description)."""
    from rocm_mla.kernels import mla_decode as kernel
    from rocm_mla.kernels.schedule import host_schedule
    from rocm_mla.kernels.target import triton_target

    target = triton_target()
    q_len, heads = problem.q.shape[1], problem.q.shape[2]
    kv = problem.kv_cache
    config, slots = kernel.plan_launch(
        q_len=q_len,
        num_heads=heads,
        kv_dtype=kv.dtype,
        target=target,
        q_dtype=problem.q.dtype,
        head_dim=problem.q.shape[3],
        head_dim_v=problem.head_dim_v,
        page_size=kv.shape[1],
        cache_bytes=kv.numel() * kv.element_size(),
    )
    schedule = host_schedule(
        [int(v) for v in lens_host.tolist()],
        num_groups=-(-(q_len * heads) // config.block_h),
        num_slots=slots,
        capacity_keys=problem.block_table.shape[1] * kv.shape[1],
        num_pools=config.num_xcds,
        device=problem.q.device,
    )
    entry = kernel.table_entry(target, num_heads=heads, q_len=q_len, kv_dtype=kv.dtype)

    def call():
        return kernel.mla_decode(
            problem.q,
            problem.kv_cache,
            problem.block_table,
            problem.cache_seqlens,
            head_dim_v=problem.head_dim_v,
            softmax_scale=problem.softmax_scale,
            causal=problem.causal,
            kv_scale=problem.kv_scale,
            config=config,
            schedule=schedule,
        )

    return call, {
        "config": config.to_dict(),
        "num_slots": slots,
        "used_slots": schedule.used_slots,
        "num_partials": schedule.num_partials,
        "source": entry.source,
    }


def registry_backends(requested: list[str] | None, interpreter: bool) -> dict[str, type]:
    from rocm_mla.backends import available_backends, backend_class

    chosen = {}
    for name, reason in available_backends().items():
        if requested and name not in requested:
            continue
        if reason is not None:
            print(f"skip backend {name}: {reason}", file=sys.stderr)
            continue
        cls = backend_class(name)
        if cls.target() and cls.target().startswith("interpreter") and not interpreter:
            print(f"skip backend {name}: {cls.target()} (pass --interpreter)", file=sys.stderr)
            continue
        chosen[name] = cls
    return chosen


# ---- peers -----------------------------------------------------------------------------------


def vllm_decode_attention():
    """vLLM's Triton MLA decode entry point, or the reason it is not importable."""
    for module in (
        "vllm.v1.attention.ops.triton_decode_attention",
        "vllm.attention.ops.triton_decode_attention",
    ):
        try:
            return importlib.import_module(module).decode_attention_fwd, None
        except Exception as exc:  # any import failure means "not here"
            reason = f"{module}: {type(exc).__name__}: {exc}"
    return None, reason


def vllm_num_kv_splits(max_len: int, device) -> int:
    """vLLM's own split count for this batch (0.33: a power of two of max_len / 512, at most
    2 per SM); 4, the fixed count of older releases, when it has no such function."""
    try:
        module = importlib.import_module("vllm.v1.attention.backends.mla.triton_mla")
        choose = module._compute_num_kv_splits
    except Exception:  # an older layout: the fixed count it used
        return 4
    return choose(max_len, torch.cuda.get_device_properties(device).multi_processor_count)


def vllm_call(fn, problem, lens_host: torch.Tensor):
    """``decode_attention_fwd`` set up as vLLM 0.33's ``TritonMLAImpl.forward_mqa`` sets it up.

    S_q > 1 is flattened as it does: one row per (request, position), the block table
    repeated, and row ``t`` of a window of ``S_q`` seeing ``len - S_q + 1 + t`` keys. That
    per-call metadata is built once here, outside the timed call.
    """
    q = problem.q
    if q.dtype not in (torch.float16, torch.bfloat16):
        return None, f"vLLM's Triton MLA takes fp16/bf16 q, got {q.dtype}"
    batch, q_len, heads, dim = q.shape
    rows = q.reshape(batch * q_len, heads, dim)
    table, lens = problem.block_table, problem.cache_seqlens
    if q_len > 1:
        table = table.repeat_interleave(q_len, dim=0)
        offsets = torch.arange(1 - q_len, 1, device=lens.device, dtype=lens.dtype)
        lens = (lens.unsqueeze(1) + offsets).flatten().clamp(min=0)
    splits = vllm_num_kv_splits(int(lens_host.max()), q.device)
    kv4 = problem.kv_cache.unsqueeze(2)  # [blocks, page, 1, D]
    o = torch.zeros(batch * q_len, heads, HEAD_DIM_V, dtype=q.dtype, device=q.device)
    lse = torch.zeros(batch * q_len, heads, dtype=q.dtype, device=q.device)
    logits = torch.empty(
        batch * q_len, heads, splits, HEAD_DIM_V + 1, dtype=torch.float32, device=q.device
    )
    params = inspect.signature(fn).parameters
    kwargs = {"is_mla": True} if "is_mla" in params else {}
    if problem.kv_scale is not None:
        if "k_scale" not in params:
            return None, "this vLLM's decode_attention_fwd has no fp8 k_scale"
        scale = torch.tensor(problem.kv_scale, dtype=torch.float32, device=q.device)
        kwargs["k_scale"] = scale
        if "v_scale" in params:
            kwargs["v_scale"] = scale
    head = (rows, kv4, kv4[..., :HEAD_DIM_V], o) + ((lse,) if "lse" in params else ())
    tail = (table, lens, logits, splits, problem.softmax_scale, kv4.shape[1])

    def call():
        fn(*head, *tail, **kwargs)
        return o, lse

    return call, None


def flash_mla_module(path: str | None):
    """``flash_mla_interface`` (get_mla_metadata, flash_mla_with_kvcache), or the reason not."""
    path = path or os.environ.get("ROCM_MLA_FLASH_MLA")
    if path:
        file = Path(path)
        if file.is_dir():
            file = file / "flash_mla_interface.py"
        spec = importlib.util.spec_from_file_location("flash_mla_interface", file)
        if spec is None or not file.is_file():
            return None, f"--flash-mla {path}: no flash_mla_interface.py there"
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as exc:  # the peer is optional
            return None, f"{file}: {type(exc).__name__}: {exc}"
        return module, None
    reason = "not found"
    for name in ("flash_mla", "vllm.third_party.flashmla.flash_mla_interface"):
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # the peer is optional
            reason = f"{name}: {type(exc).__name__}: {exc}"
            continue
        if hasattr(module, "flash_mla_with_kvcache"):
            return module, None
    return None, reason


def flash_mla_call(module, problem):
    q, kv = problem.q, problem.kv_cache
    if problem.kv_scale is not None:
        return None, "FlashMLA's fp8 cache is its own 656-byte format, not a scaled e4m3 cache"
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        return None, "FlashMLA dense decode takes bf16 q and cache"
    if kv.shape[1] != 64:
        return None, f"FlashMLA needs block size 64, got {kv.shape[1]}"
    q_len, heads = q.shape[1], q.shape[2]
    # The old interface plans here; the new one on the first call (in the untimed warmup).
    meta, num_splits = module.get_mla_metadata(problem.cache_seqlens, q_len * heads, 1)
    kv4 = kv.unsqueeze(2)

    def call():
        return module.flash_mla_with_kvcache(
            q,
            kv4,
            problem.block_table,
            problem.cache_seqlens,
            HEAD_DIM_V,
            meta,
            num_splits,
            softmax_scale=problem.softmax_scale,
            causal=problem.causal,
        )

    return call, None


# ---- the run ---------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict:
    from rocm_mla.inputs import prepare_decode

    device = "cuda" if torch.cuda.is_available() else "cpu"
    preset = "gpu" if args.gpu else (args.grid or ("full" if device != "cpu" else "tiny"))
    # The --gpu preset compares kernels: the torch reference would only add minutes.
    requested = args.backends or (["triton", "aiter"] if args.gpu else None)
    ours = registry_backends(requested, args.interpreter)
    peers = {}
    if device != "cpu" and not args.no_peers:
        fn, reason = vllm_decode_attention()
        peers["vllm-triton"] = (fn, reason)
        module, reason = flash_mla_module(args.flash_mla)
        peers["flashmla"] = (module, reason)
        for name, (impl, why) in peers.items():
            if impl is None:
                print(f"skip peer {name}: {why}", file=sys.stderr)
    if not ours and not any(impl for impl, _ in peers.values()):
        raise SystemExit("kernel_roofline: no backend to run")

    name = common.device_name()
    peak_bw, peak_bw_source = common.peak_bandwidth(), "datasheet"
    if peak_bw is None:
        peak_bw, peak_bw_source = common.copy_bandwidth(device=device), "copy bandwidth, this run"
    peaks = peak_compute(name)
    warmup, repeats = (3, 10) if device != "cpu" else (1, 3)
    flush = CacheFlush(device)

    interp = {n for n, cls in ours.items() if (cls.target() or "").startswith("interpreter")}
    cases = PRESETS[preset]
    interp_cases = PRESETS["interpreter"]
    total = sum(len(interp_cases if n in interp else cases) for n in ours) + len(cases) * len(peers)
    if device == "cpu" and preset != "full":
        print(
            f"kernel_roofline: the {preset} preset; GPUs run --gpu or --grid full", file=sys.stderr
        )

    results, done = [], 0
    gen = torch.Generator().manual_seed(0)
    all_cases = list(dict.fromkeys(cases + (interp_cases if interp else [])))
    for index, case in enumerate(all_cases):
        runners = [n for n in ours if case in (interp_cases if n in interp else cases)]
        runners += [p for p in peers if case in cases]
        if not runners:
            continue
        lens_host = lengths_for(case.lengths, case.batch, case.context, gen)
        kv, table, kv_scale = build_cache(lens_host, case.kv_kind, args.block_size, device, index)
        lens = lens_host.to(device)
        q = torch.randn(
            case.batch, case.q_len, case.heads, HEAD_DIM, dtype=torch.bfloat16, device=device
        )
        problem = prepare_decode(
            q,
            kv,
            table,
            lens,
            head_dim_v=HEAD_DIM_V,
            softmax_scale=None,
            causal=True,
            kv_scale=kv_scale,
        )
        cost = roofline(lens_host, case.heads, case.q_len, kv, q.dtype)
        for runner in runners:
            common.progress(done, total, f"{runner} {case.label()}")
            done += 1
            row = {
                "backend": runner,
                "peer": runner in PEERS or runner == "aiter",
                "case": case.label(),
                **dataclasses.asdict(case),
                "kv_dtype": str(kv.dtype).removeprefix("torch."),
                "block_size": args.block_size,
            }
            extra = {}
            if runner in PEERS:
                impl, _ = peers[runner]
                if impl is None:
                    continue
                if runner == "vllm-triton":
                    call, reason = vllm_call(impl, problem, lens_host)
                else:
                    call, reason = flash_mla_call(impl, problem)
            else:
                cls = ours[runner]
                row["target"] = cls.target()
                reasons = cls.unsupported_reasons(problem)
                call, reason = None, "; ".join(reasons) if reasons else None
                if not reasons and runner == "triton":
                    call, extra = planned_triton(problem, lens_host)
                elif not reasons:
                    impl = cls(
                        num_heads=case.heads,
                        head_dim_v=HEAD_DIM_V,
                        rope_dim=HEAD_DIM - HEAD_DIM_V,
                        softmax_scale=problem.softmax_scale,
                    )
                    # Planned once outside the timed loop, as a model's decode step would.
                    plan = cls.plan_problem(problem)
                    call = lambda impl=impl, problem=problem, plan=plan: impl.run(  # noqa: E731
                        problem, plan
                    )
            if call is None:
                results.append({**row, "skipped": reason})
                continue
            try:
                seconds = kernel_time(call, flush, device=device, warmup=warmup, repeats=repeats)
            except Exception as exc:
                if runner not in PEERS:
                    raise
                # A peer that breaks on this case must not end the run; ours must.
                results.append({**row, "skipped": f"failed: {type(exc).__name__}: {exc}"})
                continue
            results.append({**row, **extra, **cost, **metrics(cost, seconds, case, peak_bw, peaks)})
        del kv, table, problem, q
    add_peer_ratios(results)
    return {
        "benchmark": "kernel-roofline",
        "environment": common.environment(),
        "device_kind": device,
        "preset": preset,
        "cases": {n: [dataclasses.asdict(c) for c in cs] for n, cs in PRESETS.items()},
        "peak_bandwidth_bytes_per_s": peak_bw,
        "peak_bandwidth_source": peak_bw_source,
        "peak_compute_flop_per_s": None if peaks is None else {"bf16": peaks[0], "fp8": peaks[1]},
        "warmup": warmup,
        "repeats": repeats,
        "formula": "bytes = sum(len)*576*kv_bytes + B*S_q*H*(576*q_bytes + 512*out_bytes); "
        "flops = S_q*sum(len)*H*2*(576+512); pct_bw = bytes/time/peak_bw; "
        "pct_compute = flops/time/dense peak (fp8 peak for an fp8 cache); "
        "pct_roofline = max(bytes/peak_bw, flops/peak)/time; "
        "vs_best_peer = best peer time / time",
        "results": results,
    }


def metrics(cost: dict, seconds: float, case: Case, peak_bw: float, peaks) -> dict:
    out = {
        "time_us": seconds * 1e6,
        "gb_per_s": cost["bytes"] / seconds / 1e9,
        "tflop_per_s": cost["flops"] / seconds / 1e12,
        "pct_peak_bw": 100 * cost["bytes"] / seconds / peak_bw,
    }
    if peaks is not None:
        peak = peaks[1] if case.kv_kind == "fp8" else peaks[0]
        out["pct_peak_compute"] = 100 * cost["flops"] / seconds / peak
        bound = max(cost["bytes"] / peak_bw, cost["flops"] / peak)
        out["pct_roofline"] = 100 * bound / seconds
    return out


def add_peer_ratios(results: list[dict]) -> None:
    """``vs_best_peer`` on every timed row: the fastest peer's time over this row's time."""
    best = {}
    for r in results:
        if r["peer"] and "time_us" in r:
            best[r["case"]] = min(best.get(r["case"], math.inf), r["time_us"])
    for r in results:
        if "time_us" in r and r["case"] in best:
            r["vs_best_peer"] = best[r["case"]] / r["time_us"]


def plot(payload: dict, path: Path) -> None:
    """Grouped bars per case: % of peak bandwidth (top) and % of the roofline (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in payload["results"] if "time_us" in r]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    panels = [("pct_peak_bw", f"% of peak bandwidth ({payload['peak_bandwidth_source']})")]
    if any("pct_roofline" in r for r in rows):
        panels.append(("pct_roofline", "% of roofline (max of bandwidth, dense compute)"))
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(max(7, 0.9 * len(cases) + 2), 3.6 * len(panels)), squeeze=False
    )
    width = 0.8 / max(len(backends), 1)
    for ax, (key, label) in zip(axes[:, 0], panels, strict=True):
        for i, backend in enumerate(backends):
            values = {r["case"]: r.get(key) for r in rows if r["backend"] == backend}
            xs = [c + i * width for c, name in enumerate(cases) if values.get(name) is not None]
            ys = [values[name] for name in cases if values.get(name) is not None]
            ax.bar(xs, ys, width, label=backend)
        ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cases))])
        ax.set_xticklabels(cases, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0, 0].set_title(f"{payload['environment']['device']}: MLA decode, block 64")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.kernel_roofline", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--gpu", action="store_true", help="the issue-17 cases with peers (a few minutes on a GPU)"
    )
    parser.add_argument(
        "--grid", choices=("full", "tiny"), help="shape grid (default: full on a GPU, tiny on CPU)"
    )
    parser.add_argument(
        "--backends",
        nargs="+",
        metavar="NAME",
        help="only these of our backends (default: all; --gpu: triton and aiter)",
    )
    parser.add_argument("--no-peers", action="store_true", help="skip vLLM / FlashMLA")
    parser.add_argument(
        "--flash-mla",
        metavar="PATH",
        help="flash_mla_interface.py (or its folder); default $ROCM_MLA_FLASH_MLA, then imports",
    )
    parser.add_argument(
        "--interpreter",
        action="store_true",
        help="also time the Triton interpreter on CPU (tiny grid; slow, measures Python)",
    )
    parser.add_argument("--block-size", type=int, default=64, help="KV cache block size")
    parser.add_argument("--out", type=Path, help="results folder (default: benchmarks/results)")
    args = parser.parse_args(argv)
    if args.gpu and not torch.cuda.is_available():
        parser.error("--gpu needs a GPU (torch sees none); on a CPU use the default tiny grid")
    if args.gpu and args.grid:
        parser.error("--gpu and --grid are alternatives")
    if args.interpreter:
        if torch.cuda.is_available():
            parser.error("--interpreter is for CPU-only machines (this one has a GPU)")
        # Must be set before triton is first imported (the registry imports it lazily).
        os.environ.setdefault("TRITON_INTERPRET", "1")

    payload = run(args)
    path = common.write_results("kernel-roofline", payload, args.out)
    plot(payload, path.with_suffix(".png"))
    for r in payload["results"]:
        if "time_us" not in r:
            print(f"{r['backend']:>12} {r['case']:<28} skipped: {r['skipped']}")
            continue
        extra = ""
        if "pct_peak_compute" in r:
            extra = f" {r['pct_peak_compute']:5.1f}% compute {r['pct_roofline']:5.1f}% roofline"
        if "vs_best_peer" in r:
            extra += f" {r['vs_best_peer']:5.2f}x best peer"
        print(
            f"{r['backend']:>12} {r['case']:<28} {r['time_us']:>10.1f} us "
            f"{r['gb_per_s']:>8.4g} GB/s {r['tflop_per_s']:>7.3g} TF/s "
            f"{r['pct_peak_bw']:5.1f}% bw{extra}"
        )
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return path


if __name__ == "__main__":
    main()
