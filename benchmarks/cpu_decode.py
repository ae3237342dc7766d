"""CPU decode benchmark of the torch backend: bandwidth efficiency against copy bandwidth.

efficiency = (KV bytes read / decode time) / (copy bandwidth measured in the same run), for
batch 8, heads 16, context 8192 (the foundation issue's shape), fp32 and bf16 caches.

Copy bandwidth is bytes copied per second (source bytes / time; STREAM's "Copy" counts the
write too and is twice this). On a 2-core CPU this decode is compute-bound, not memory-bound:
each 576-wide latent row costs 2 * H * (576 + 512) FLOPs, i.e. 15 FLOP/B in fp32 and 30 FLOP/B
in bf16 at H = 16. So the run also measures the GEMM throughput of the same shapes and reports
the compute-roofline bound on the efficiency next to the achieved one.

Mixed batch: one long request among short ones (1 x 32K + 7 x 1K keys, same heads), the
kernel timed at 1 and at 2 threads with long rows cut into key chunks (its default) and with
no row cut (``_chunk_keys=0``). Reported: the 2-thread / 1-thread speedup of each (medians of
interleaved rounds); with chunks the threads finish together, so it should be near the thread
count, without them the thread with the long request runs alone at the end.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from benchmarks import common
from rocm_mla import mla_decode
from rocm_mla.kernels import cpu_decode


def make_inputs(batch: int, heads: int, context: int, block_size: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    blocks_per_req = context // block_size
    num_blocks = batch * blocks_per_req
    kv = torch.randn(num_blocks, block_size, 576, generator=gen).to(dtype)
    block_table = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per_req)
    q = torch.randn(batch, 1, heads, 576, generator=gen).to(dtype)
    lens = torch.full((batch,), context, dtype=torch.int32)
    return q, kv, block_table.to(torch.int32).contiguous(), lens


def make_mixed_inputs(lengths: list[int], heads: int, block_size: int, dtype: torch.dtype):
    """q [B, 1, H, 576], a paged cache holding exactly the requests' blocks (shuffled)."""
    gen = torch.Generator().manual_seed(2)
    blocks = [-(-n // block_size) for n in lengths]
    kv = torch.randn(sum(blocks), block_size, 576, generator=gen).to(dtype)
    perm = torch.randperm(sum(blocks), generator=gen).to(torch.int32)
    block_table = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
    start = 0
    for b, n in enumerate(blocks):
        block_table[b, :n] = perm[start : start + n]
        start += n
    q = torch.randn(len(lengths), 1, heads, 576, generator=gen).to(dtype)
    return q, kv, block_table, torch.tensor(lengths, dtype=torch.int32)


def run_mixed(args: argparse.Namespace) -> dict:
    """Times of the mixed batch at 1 and 2 threads, key chunks on and off. Rounds interleave
    the four settings so that a change in the machine's load hits them all alike."""
    lengths = [args.mixed_long] + [args.mixed_short] * args.mixed_count
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    modes = {"chunked": None, "unchunked": 0}
    threads_before = torch.get_num_threads()
    rows = []
    try:
        for name in args.dtypes:
            q, kv, bt, lens = make_mixed_inputs(lengths, args.heads, args.block_size, dtypes[name])

            def call(chunk, q=q, kv=kv, bt=bt, lens=lens):
                return cpu_decode.decode_with_chunk(
                    q,
                    kv,
                    bt,
                    lens,
                    head_dim_v=512,
                    softmax_scale=576**-0.5,
                    causal=True,
                    kv_scale=None,
                    max_seqlen=None,
                    fault_flag=None,
                    chunk_keys=chunk,
                )

            times = {(t, m): [] for t in (1, 2) for m in modes}
            chunk_keys = {}
            for t in (1, 2):  # warm up both thread counts, and record the chunk each one uses
                torch.set_num_threads(t)
                for m, chunk in modes.items():
                    chunk_keys[(t, m)] = call(chunk)[2]
            for r in range(args.mixed_rounds):
                common.progress(r, args.mixed_rounds, f"{name} mixed batch")
                for t in (1, 2):
                    torch.set_num_threads(t)
                    for m, chunk in modes.items():
                        start = time.perf_counter()
                        call(chunk)
                        times[(t, m)].append(time.perf_counter() - start)
            torch.set_num_threads(threads_before)
            for m in modes:
                t1 = statistics.median(times[(1, m)])
                t2 = statistics.median(times[(2, m)])
                rows.append(
                    {
                        "dtype": name,
                        "mode": m,
                        "chunk_keys_1_thread": chunk_keys[(1, m)],
                        "chunk_keys_2_threads": chunk_keys[(2, m)],
                        "time_1_thread_s": t1,
                        "time_2_threads_s": t2,
                        "speedup_2_over_1": t1 / t2,
                        "times_1_thread_s": times[(1, m)],
                        "times_2_threads_s": times[(2, m)],
                    }
                )
    finally:
        torch.set_num_threads(threads_before)
    return {
        "lengths": lengths,
        "heads": args.heads,
        "block_size": args.block_size,
        "head_dim": 576,
        "head_dim_v": 512,
        "rounds": args.mixed_rounds,
        "results": rows,
    }


def gemm_flops_per_second(heads: int, repeats: int = 9) -> float:
    """FLOP/s of the decode's GEMM shapes (QK^T and PV of 8 requests over 256 tokens), fp32:
    the compute roofline. (On the CPU the decode runs them inside the fused attention call.)"""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(8, heads, 576, generator=gen)
    kv = torch.randn(8, 256, 576, generator=gen)
    scores = torch.empty(8, heads, 256)
    out = torch.empty(8, heads, 512)

    def both():
        torch.bmm(q, kv.transpose(1, 2), out=scores)
        torch.bmm(scores, kv[:, :, :512], out=out)

    def many():
        for _ in range(20):
            both()

    flops = 20 * 8 * heads * 256 * 2 * (576 + 512)
    return flops / common.median_time(many, repeats=repeats, warmup=2)


def run(args: argparse.Namespace) -> dict:
    rows = []
    copy_bw = []
    gemm = gemm_flops_per_second(args.heads)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    for i, name in enumerate(args.dtypes):
        common.progress(i, len(args.dtypes), f"{name} decode")
        dtype = dtypes[name]
        q, kv, bt, lens = make_inputs(args.batch, args.heads, args.context, args.block_size, dtype)
        # Copy bandwidth right before each measurement, so both see the same machine state.
        bw = common.copy_bandwidth()
        copy_bw.append(bw)
        t = common.median_time(
            lambda q=q, kv=kv, bt=bt, lens=lens: mla_decode(q, kv, bt, lens, backend="torch"),
            repeats=args.repeats,
            warmup=1,
        )
        kv_bytes = args.batch * args.context * 576 * kv.element_size()
        flops = args.batch * args.context * args.heads * 2 * (576 + 512)
        # The best efficiency the measured GEMM rate allows: time >= flops / gemm rate.
        compute_bound = (kv_bytes / (flops / gemm)) / bw
        rows.append(
            {
                "dtype": name,
                "time_s": t,
                "kv_bytes": kv_bytes,
                "kv_gb_per_s": kv_bytes / t / 1e9,
                "copy_gb_per_s": bw / 1e9,
                "efficiency": kv_bytes / t / bw,
                "gflop_per_s": flops / t / 1e9,
                "gemm_gflop_per_s": gemm / 1e9,
                "compute_roofline_efficiency_bound": min(1.0, compute_bound),
                "fraction_of_compute_roofline": (flops / t) / gemm,
            }
        )
    return {
        "benchmark": "cpu_decode",
        "shape": {
            "batch": args.batch,
            "heads": args.heads,
            "context": args.context,
            "block_size": args.block_size,
            "q_len": 1,
            "head_dim": 576,
            "head_dim_v": 512,
        },
        "copy_bandwidth_definition": "source bytes copied per second (STREAM Copy / 2)",
        "environment": common.environment(),
        "results": rows,
        "mixed": run_mixed(args) if args.mixed_rounds > 0 else None,
    }


def plot(payload: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["results"]
    names = [r["dtype"] for r in rows]
    x = range(len(rows))
    mixed = payload.get("mixed")
    if mixed:
        fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    else:
        fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([i - 0.2 for i in x], [r["efficiency"] for r in rows], 0.4, label="achieved")
    ax.bar(
        [i + 0.2 for i in x],
        [r["compute_roofline_efficiency_bound"] for r in rows],
        0.4,
        label="compute-roofline bound",
    )
    ax.axhline(0.5, color="gray", ls="--", lw=1, label="target 0.5")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("KV GB/s / copy GB/s")
    s = payload["shape"]
    ax.set_title(f"torch MLA decode, B={s['batch']} H={s['heads']} ctx={s['context']}")
    ax.legend()
    if mixed:
        speedup = {(r["dtype"], r["mode"]): r["speedup_2_over_1"] for r in mixed["results"]}
        dts = [d for d in names if (d, "chunked") in speedup]
        for k, (mode, off) in enumerate((("chunked", -0.2), ("unchunked", 0.2))):
            xs = [i + off for i in range(len(dts))]
            bx.bar(xs, [speedup[(d, mode)] for d in dts], 0.4, label=mode, color=f"C{k + 2}")
        bx.axhline(2.0, color="gray", ls="--", lw=1, label="2 threads ideal")
        bx.set_xticks(list(range(len(dts))), dts)
        bx.set_ylabel("time 1 thread / time 2 threads")
        bx.set_ylim(0, 2.5)
        n_short = len(mixed["lengths"]) - 1
        bx.set_title(
            f"mixed batch 1 x {mixed['lengths'][0]} + {n_short} x {mixed['lengths'][1]} keys, "
            f"H={mixed['heads']}"
        )
        bx.legend(loc="upper right", ncols=3, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--mixed-long", type=int, default=32768)
    parser.add_argument("--mixed-short", type=int, default=1024)
    parser.add_argument("--mixed-count", type=int, default=7, help="short requests")
    parser.add_argument("--mixed-rounds", type=int, default=11, help="0: skip the mixed batch")
    parser.add_argument("--out", default=None, help="results directory")
    args = parser.parse_args(argv)
    payload = run(args)
    path = common.write_results("cpu-decode", payload, args.out)
    plot(payload, path.with_suffix(".png"))
    for r in payload["results"]:
        print(
            f"{r['dtype']}: decode {r['time_s'] * 1e3:.1f} ms, KV {r['kv_gb_per_s']:.2f} GB/s, "
            f"copy {r['copy_gb_per_s']:.2f} GB/s -> efficiency {r['efficiency']:.2f} "
            f"(compute-roofline bound {r['compute_roofline_efficiency_bound']:.2f}; "
            f"{r['gflop_per_s']:.0f} GFLOP/s = "
            f"{r['fraction_of_compute_roofline']:.0%} of the GEMM rate)"
        )
    if payload["mixed"]:
        for r in payload["mixed"]["results"]:
            print(
                f"mixed {r['dtype']} {r['mode']}: 1 thread {r['time_1_thread_s'] * 1e3:.1f} ms, "
                f"2 threads {r['time_2_threads_s'] * 1e3:.1f} ms -> "
                f"{r['speedup_2_over_1']:.2f}x (chunk at 2 threads: {r['chunk_keys_2_threads']})"
            )
    print(f"wrote {path} and {path.with_suffix('.png').name}")
    if any(math.isnan(r["efficiency"]) for r in payload["results"]):
        raise SystemExit("benchmark produced NaN")
    return payload


if __name__ == "__main__":
    main()
