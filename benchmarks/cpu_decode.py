"""CPU decode benchmark of the torch backend: bandwidth efficiency against copy bandwidth.

efficiency = (KV bytes read / decode time) / (copy bandwidth measured in the same run), for
batch 8, heads 16, context 8192 (the foundation issue's shape), fp32 and bf16 caches.

Copy bandwidth is bytes copied per second (source bytes / time; STREAM's "Copy" counts the
write too and is twice this). On a 2-core CPU this decode is compute-bound, not memory-bound:
each 576-wide latent row costs 2 * H * (576 + 512) FLOPs, i.e. 15 FLOP/B in fp32 and 30 FLOP/B
in bf16 at H = 16. So the run also measures the GEMM throughput of the same shapes and reports
the compute-roofline bound on the efficiency next to the achieved one.
"""

from __future__ import annotations

import argparse
import math

import torch

from benchmarks import common
from rocm_mla import mla_decode


def make_inputs(batch: int, heads: int, context: int, block_size: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    blocks_per_req = context // block_size
    num_blocks = batch * blocks_per_req
    kv = torch.randn(num_blocks, block_size, 576, generator=gen).to(dtype)
    block_table = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per_req)
    q = torch.randn(batch, 1, heads, 576, generator=gen).to(dtype)
    lens = torch.full((batch,), context, dtype=torch.int32)
    return q, kv, block_table.to(torch.int32).contiguous(), lens


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
    }


def plot(payload: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["results"]
    names = [r["dtype"] for r in rows]
    x = range(len(rows))
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
    print(f"wrote {path} and {path.with_suffix('.png').name}")
    if any(math.isnan(r["efficiency"]) for r in payload["results"]):
        raise SystemExit("benchmark produced NaN")
    return payload


if __name__ == "__main__":
    main()
