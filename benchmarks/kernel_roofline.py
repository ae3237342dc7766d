"""Kernel roofline: every available MLA decode backend over a shape grid, as % of peak bandwidth.

For each case the time is kernel-only (inputs validated and split counts planned outside
the timed region), median over repeats after warmup, with the caches flushed before every
timed call. The roofline numbers follow DESIGN.md "Measuring":

    bytes  = sum(len) * D * kv_bytes + B * S_q * H * (D * q_bytes + Dv * out_bytes)
    FLOPs  = S_q * sum(len) * H * 2 * (D + Dv)           (QK^T over D, PV over Dv)
    % peak = bytes / time / peak bandwidth

Peak bandwidth is the datasheet figure of a known GPU (``benchmarks.common``); on a CPU it
is the copy bandwidth measured in the same run. On a CPU the default grid is tiny (the
full one would take hours), and the Triton interpreter is only timed when asked for
(``--interpreter``), on an even smaller grid: it measures Python, not a kernel.

Writes ``benchmarks/results/kernel-roofline-<device>-<date>.json`` and a PNG next to it.
Run: ``python -m benchmarks.kernel_roofline [--grid full|tiny] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import sys
from pathlib import Path

import torch

from benchmarks import common

HEAD_DIM, HEAD_DIM_V = 576, 512


@dataclasses.dataclass(frozen=True)
class Grid:
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    heads: tuple[int, ...]
    q_lens: tuple[int, ...]
    kv_kinds: tuple[str, ...]  #: "bf16", "fp8"
    length_kinds: tuple[str, ...]  #: "uniform" (all = context), "mixed" (mean = context)

    def size(self) -> int:
        return math.prod(len(getattr(self, f.name)) for f in dataclasses.fields(self))


GRIDS = {
    # The grid, for GPUs.
    "full": Grid(
        batches=(1, 8, 32, 128),
        contexts=(1024, 4096, 16384, 32768),
        heads=(16, 128),
        q_lens=(1, 2, 4),
        kv_kinds=("bf16", "fp8"),
        length_kinds=("uniform", "mixed"),
    ),
    # A 2-core CPU decodes B=128 x 32K in minutes per call; this keeps the run to a minute.
    "tiny": Grid(
        batches=(1, 4),
        contexts=(1024, 4096),
        heads=(16,),
        q_lens=(1, 2),
        kv_kinds=("bf16", "fp8"),
        length_kinds=("uniform", "mixed"),
    ),
    # The Triton interpreter runs each program in Python: one small case per dtype.
    "interpreter": Grid(
        batches=(1,),
        contexts=(256,),
        heads=(16,),
        q_lens=(1,),
        kv_kinds=("bf16", "fp8"),
        length_kinds=("uniform",),
    ),
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


def make_impl(name: str, cls, problem, *, num_kv_splits: int | None):
    kwargs = {
        "num_heads": problem.num_heads,
        "head_dim_v": HEAD_DIM_V,
        "rope_dim": HEAD_DIM - HEAD_DIM_V,
        "softmax_scale": problem.softmax_scale,
    }
    if name == "triton":
        kwargs["num_kv_splits"] = num_kv_splits
    return cls(**kwargs)


def planned_splits(name: str, problem) -> int | None:
    """Triton's split count, planned once per case like per-step decode metadata."""
    if name != "triton":
        return None
    from rocm_mla.kernels.mla_decode import plan_num_kv_splits

    return plan_num_kv_splits(problem.cache_seqlens, problem.q_len, problem.num_heads)


def backends_to_run(requested: list[str] | None, interpreter: bool) -> dict[str, type]:
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
    if not chosen:
        raise SystemExit("kernel_roofline: no backend to run")
    return chosen


def run(args: argparse.Namespace) -> dict:
    from rocm_mla.inputs import prepare_decode

    device = "cuda" if torch.cuda.is_available() else "cpu"
    backends = backends_to_run(args.backends, args.interpreter)
    grid_name = args.grid or ("full" if device != "cpu" else "tiny")
    peak, peak_source = common.peak_bandwidth(), "datasheet"
    if peak is None:
        peak, peak_source = common.copy_bandwidth(device=device), "copy bandwidth, this run"
    warmup, repeats = (3, 10) if device != "cpu" else (1, 3)
    flush = CacheFlush(device)

    plan = []  # (backend, grid) pairs: the interpreter always gets its own tiny grid
    for name, cls in backends.items():
        interp = (cls.target() or "").startswith("interpreter")
        plan.append((name, cls, GRIDS["interpreter" if interp else grid_name]))
    total = sum(grid.size() for _, _, grid in plan)
    for name, _, grid in plan:
        if device == "cpu" and grid != GRIDS["full"]:
            print(
                f"kernel_roofline: {name} runs the tiny CPU grid {dataclasses.asdict(grid)}; "
                "the full grid is for GPUs (--grid full)",
                file=sys.stderr,
            )

    results, done = [], 0
    gen = torch.Generator().manual_seed(0)
    for name, cls, grid in plan:
        for batch, context, length_kind, kv_kind in itertools.product(
            grid.batches, grid.contexts, grid.length_kinds, grid.kv_kinds
        ):
            lens = lengths_for(length_kind, batch, context, gen)
            kv, table, kv_scale = build_cache(lens, kv_kind, args.block_size, device, seed=done)
            lens = lens.to(device)
            for heads, q_len in itertools.product(grid.heads, grid.q_lens):
                label = f"{name} B{batch} ctx{context} H{heads} S_q{q_len} {kv_kind} {length_kind}"
                common.progress(done, total, label)
                done += 1
                q = torch.randn(batch, q_len, heads, HEAD_DIM, dtype=torch.bfloat16, device=device)
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
                case = {
                    "backend": name,
                    "target": cls.target(),
                    "batch": batch,
                    "context": context,
                    "heads": heads,
                    "q_len": q_len,
                    "kv_dtype": str(kv.dtype).removeprefix("torch."),
                    "lengths": length_kind,
                    "block_size": args.block_size,
                }
                reasons = cls.unsupported_reasons(problem)
                if reasons:
                    results.append({**case, "skipped": "; ".join(reasons)})
                    continue
                splits = planned_splits(name, problem)
                impl = make_impl(name, cls, problem, num_kv_splits=splits)
                seconds = kernel_time(
                    lambda impl=impl, problem=problem: impl.run(problem),
                    flush,
                    device=device,
                    warmup=warmup,
                    repeats=repeats,
                )
                cost = roofline(lens, heads, q_len, kv, q.dtype)
                results.append(
                    {
                        **case,
                        **cost,
                        "num_kv_splits": splits,
                        "time_us": seconds * 1e6,
                        "gb_per_s": cost["bytes"] / seconds / 1e9,
                        "tflop_per_s": cost["flops"] / seconds / 1e12,
                        "pct_peak_bw": 100 * cost["bytes"] / seconds / peak,
                    }
                )
            del kv, table
    return {
        "benchmark": "kernel-roofline",
        "environment": common.environment(),
        "device_kind": device,
        "grid": grid_name,
        "grids": {n: dataclasses.asdict(g) for n, g in GRIDS.items()},
        "peak_bandwidth_bytes_per_s": peak,
        "peak_bandwidth_source": peak_source,
        "warmup": warmup,
        "repeats": repeats,
        "formula": "bytes = sum(len)*576*kv_bytes + B*S_q*H*(576*q_bytes + 512*out_bytes); "
        "flops = S_q*sum(len)*H*2*(576+512); pct = bytes/time/peak",
        "results": results,
    }


def plot(payload: dict, path: Path) -> None:
    """% of peak bandwidth vs context, one line per backend and head count.

    The slice plotted is the largest batch, S_q = 1, bf16 cache, uniform lengths: the
    memory-bound case the bandwidth goal is stated for.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in payload["results"] if "time_us" in r]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if rows:
        batch = max(r["batch"] for r in rows)
        sliced = [
            r
            for r in rows
            if r["batch"] == batch
            and r["q_len"] == 1
            and r["kv_dtype"] == "bfloat16"
            and r["lengths"] == "uniform"
        ]
        for key in sorted({(r["backend"], r["heads"]) for r in sliced}):
            line = sorted(
                (r["context"], r["pct_peak_bw"])
                for r in sliced
                if (r["backend"], r["heads"]) == key
            )
            ax.plot(*zip(*line, strict=True), marker="o", label=f"{key[0]} H={key[1]}")
        ax.set_title(
            f"{payload['environment']['device']}: batch {batch}, S_q 1, bf16 KV, uniform lengths"
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel(f"% of peak bandwidth ({payload['peak_bandwidth_source']})")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.kernel_roofline", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--grid", choices=("full", "tiny"), help="shape grid (default: full on a GPU, tiny on CPU)"
    )
    parser.add_argument(
        "--backends", nargs="+", metavar="NAME", help="only these backends (default: all available)"
    )
    parser.add_argument(
        "--interpreter",
        action="store_true",
        help="also time the Triton interpreter on CPU (tiny grid; slow, measures Python)",
    )
    parser.add_argument("--block-size", type=int, default=64, help="KV cache block size")
    parser.add_argument("--out", type=Path, help="results folder (default: benchmarks/results)")
    args = parser.parse_args(argv)
    if args.interpreter:
        if torch.cuda.is_available():
            parser.error("--interpreter is for CPU-only machines (this one has a GPU)")
        # Must be set before triton is first imported (the registry imports it lazily).
        os.environ.setdefault("TRITON_INTERPRET", "1")

    payload = run(args)
    path = common.write_results("kernel-roofline", payload, args.out)
    plot(payload, path.with_suffix(".png"))
    for r in payload["results"]:
        if "time_us" in r:
            print(
                f"{r['backend']:>6} B{r['batch']:<4} ctx{r['context']:<6} H{r['heads']:<4} "
                f"S_q{r['q_len']} {r['kv_dtype']:<18} {r['lengths']:<8} "
                f"{r['time_us']:>11.1f} us {r['gb_per_s']:>8.3g} GB/s "
                f"{r['tflop_per_s']:>8.3g} TF/s {r['pct_peak_bw']:>6.3g}% peak"
            )
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return path


if __name__ == "__main__":
    main()
