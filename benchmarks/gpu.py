"""The GPU hot path in one command: whoever gets a GPU runs this first (under 8 minutes).

Three measurements, each side by side in one run, written as JSON + PNG under
``benchmarks/results/``:

1. **Call overhead** (Triton backend, bf16, block 64): the kernel launched from a prepared
   plan (``kernels.mla_decode.mla_decode`` with the plan's block shapes and balanced
   schedule given: stage 1 and the merge, no planner launch),
   the planned public call (``mla_decode(..., plan=)``), and the one-shot public call
   (validation, selection and planning on every call). Reported as % of the device's HBM
   peak and as ratios to kernel-only (target: planned within 1.15x at B >= 8, ctx >= 4K).
2. **Graph replay vs eager**: the planned call captured once in a ``torch.cuda.CUDAGraph``
   and replayed, against the same call launched eagerly.
3. **Engine vs transformers** on the GPU: the ``KimiK3Config.small()`` Kimi-Linear
   checkpoint of ``benchmarks.e2e`` (same random weights for both sides), greedy, batch 8 x
   1K prompt + 64 new in bf16 and fp32 (targets: decode >= 5x / >= 3x transformers' tok/s),
   and batch 1 x 16K prompt (target: prefill faster than transformers); token agreement.

    python -m benchmarks.gpu                 # everything (needs a CUDA/HIP GPU)
    python -m benchmarks.gpu --skip-e2e      # kernel and graph parts only (about a minute)
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import RESULTS_DIR, environment, peak_bandwidth, write_results

#: (batch, context, heads, q_len): the issue's cases around the 1.15x target.
OVERHEAD_CASES = [
    (8, 4096, 16, 1),
    (32, 4096, 128, 1),
    (64, 8192, 16, 1),
    (128, 16384, 16, 1),
    (32, 16384, 128, 1),
]
BLOCK_SIZE = 64


def _events_time(fn, repeats: int = 50, warmup: int = 5) -> float:
    """Median seconds of ``fn()`` by CUDA events, each call timed on its own."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def _wall_time(fn, repeats: int = 50, warmup: int = 5) -> float:
    """Median seconds of ``fn()`` by the host clock with a sync after each call: what a
    caller sees, host work (validation, planning, syncs) included."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def _problem(batch: int, context: int, heads: int, q_len: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per
    kv = torch.randn(num_blocks, BLOCK_SIZE, 576, generator=gen, device="cuda").bfloat16()
    perm = torch.randperm(num_blocks, generator=gen, device="cuda").to(torch.int32)
    table = perm.view(batch, blocks_per)
    q = torch.randn(batch, q_len, heads, 576, generator=gen, device="cuda").bfloat16()
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return q, kv, table, lens


def call_overhead() -> list[dict]:
    import rocm_mla
    from rocm_mla.kernels import mla_decode as kernel

    peak = peak_bandwidth()
    rows = []
    for batch, context, heads, q_len in OVERHEAD_CASES:
        q, kv, table, lens = _problem(batch, context, heads, q_len)
        plan = rocm_mla.plan_decode(
            [context] * batch, q_len=q_len, num_heads=heads, kv_dtype=kv.dtype, backend="triton"
        )
        launch = plan.launch
        config = launch.config

        # The plan's config and balanced schedule (built once in plan_decode, as an engine
        # plans once per step): stage 1 and the merge only.
        def kernel_only(q=q, kv=kv, table=table, lens=lens, launch=launch):
            kernel.mla_decode(
                q, kv, table, lens, head_dim_v=512, softmax_scale=576**-0.5,
                config=launch.config, schedule=launch.schedule,
            )  # fmt: skip

        def planned(q=q, kv=kv, table=table, lens=lens, plan=plan):
            rocm_mla.mla_decode(q, kv, table, lens, plan=plan)

        def one_shot(q=q, kv=kv, table=table, lens=lens):
            rocm_mla.mla_decode(q, kv, table, lens, backend="triton")

        calls = (("kernel_only", kernel_only), ("planned", planned), ("one_shot", one_shot))
        times = {name: _wall_time(fn) for name, fn in calls}
        graph_eager = _events_time(planned)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            planned()  # warm the allocator on the capture stream
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            planned()
        graph_replay = _events_time(graph.replay)
        nbytes = batch * context * 576 * 2 + q.numel() * 2 + batch * q_len * heads * 512 * 2
        row = {
            "batch": batch,
            "context": context,
            "heads": heads,
            "q_len": q_len,
            "num_slots": launch.num_slots,
            "used_slots": launch.schedule.used_slots,
            "num_partials": launch.schedule.num_partials,
            "config": repr(config),
            "bytes": nbytes,
            **{f"{k}_s": v for k, v in times.items()},
            "planned_over_kernel": times["planned"] / times["kernel_only"],
            "one_shot_over_kernel": times["one_shot"] / times["kernel_only"],
            "eager_s": graph_eager,
            "graph_replay_s": graph_replay,
            "graph_speedup": graph_eager / graph_replay,
        }
        if peak:
            for k, v in times.items():
                row[f"{k}_pct_peak"] = 100 * nbytes / v / peak
        rows.append(row)
        print(
            f"B{batch} ctx{context} H{heads}: kernel {times['kernel_only'] * 1e6:.0f} us, "
            f"planned {row['planned_over_kernel']:.2f}x, one-shot "
            f"{row['one_shot_over_kernel']:.2f}x; graph replay {row['graph_speedup']:.2f}x eager",
            flush=True,
        )
    return rows


def engine_vs_transformers(prompt_len: int, long_context: int) -> list[dict]:
    from benchmarks.e2e import compare, write_checkpoint

    runs = []
    with tempfile.TemporaryDirectory(prefix="rocm-mla-gpu-") as tmp:
        write_checkpoint(Path(tmp), 0)
        for dtype in ("bfloat16", "float32"):
            run = compare(tmp, 8, prompt_len, 64, 0, device="cuda", dtype=dtype, backend="auto")
            runs.append(run)
            print(
                f"{dtype} B8 x {prompt_len} + 64: decode {run['engine']['decode_tok_s']:.0f} vs "
                f"{run['transformers']['decode_tok_s']:.0f} tok/s ({run['decode_ratio']:.2f}x), "
                f"prefill {run['engine']['prefill_s']:.3f} vs "
                f"{run['transformers']['prefill_s']:.3f} s, identical "
                f"{run['identical_sequences']}",
                flush=True,
            )
        if long_context:
            run = compare(tmp, 1, long_context, 32, 0, device="cuda", dtype="bfloat16",
                          backend="auto")  # fmt: skip
            run["prefill_ratio"] = run["transformers"]["prefill_s"] / run["engine"]["prefill_s"]
            runs.append(run)
            print(
                f"bf16 B1 x {long_context}: prefill {run['engine']['prefill_s']:.2f} vs "
                f"{run['transformers']['prefill_s']:.2f} s ({run['prefill_ratio']:.2f}x)",
                flush=True,
            )
    return runs


def profile_long_prefill(context: int, out_path: Path) -> str:
    """torch.profiler summary of the engine's bf16 prefill of one ``context``-token prompt
    (after a warm-up prefill), written next to the JSON: where a long prefill's time goes."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.e2e import write_checkpoint
    from rocm_mla.engine import LLM

    prompt = torch.randint(2, 32000, (context,), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory(prefix="rocm-mla-prof-") as tmp:
        write_checkpoint(Path(tmp), 0)
        blocks = -(-(context + 2) // 16)
        with LLM(tmp, dtype="bfloat16", device="cuda", num_blocks=blocks, max_num_seqs=1) as llm:
            llm.generate([prompt.tolist()], 1)
            activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
            with profile(activities=activities) as prof:
                llm.generate([prompt.tolist()], 1)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
    out_path.write_text(f"engine bf16 prefill of {context} tokens\n\n{table}\n")
    return str(out_path)


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    rows = payload["call_overhead"]
    labels = [f"B{r['batch']}\nctx{r['context'] // 1024}K H{r['heads']}" for r in rows]
    x = range(len(rows))
    for offset, key in ((-0.25, "kernel_only_s"), (0.0, "planned_s"), (0.25, "one_shot_s")):
        axes[0].bar([i + offset for i in x], [r[key] * 1e6 for r in rows], 0.25,
                    label=key.removesuffix("_s"))  # fmt: skip
    axes[0].set_xticks(list(x), labels)
    axes[0].set_ylabel("us per call (median)")
    axes[0].set_title("Triton MLA decode: call overhead")
    axes[0].legend()
    runs = payload.get("engine_vs_transformers") or []
    if runs:
        names = [f"{r['dtype']}\nB{r['batch']}x{r['prompt_len']}" for r in runs]
        axes[1].bar(names, [r["decode_ratio"] for r in runs])
        axes[1].axhline(1.0, color="gray", lw=0.8)
        axes[1].set_ylabel("decode tok/s, engine / transformers")
        axes[1].set_title("engine vs transformers (GPU)")
    else:
        axes[1].set_axis_off()
    fig.suptitle(payload["environment"]["device"])
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__)
    parser.add_argument("--skip-e2e", action="store_true", help="kernel and graph parts only")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--long-context", type=int, default=16384, help="0 skips the long run")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.gpu: needs a CUDA or HIP GPU (torch sees none)", file=sys.stderr)
        raise SystemExit(2)
    payload = {
        "benchmark": "gpu",
        "environment": environment(),
        "peak_bandwidth": peak_bandwidth(),
        "targets": {
            "planned_over_kernel_max": 1.15,
            "bf16_decode_ratio": 5.0,
            "fp32_decode_ratio": 3.0,
            "long_prefill_ratio": 1.0,
        },
        "call_overhead": call_overhead(),
    }
    if not args.skip_e2e:
        payload["engine_vs_transformers"] = engine_vs_transformers(
            args.prompt_len, args.long_context
        )
    json_path = write_results("gpu", payload)
    if not args.skip_e2e and args.long_context:
        payload["prefill_profile"] = profile_long_prefill(
            args.long_context, json_path.with_name(json_path.stem + "-prefill-profile.txt")
        )
        json_path = write_results("gpu", payload)
    plot(payload, json_path.with_suffix(".png"))
    print(f"wrote {json_path} and {json_path.with_suffix('.png').name} in {RESULTS_DIR}")
    assert all(math.isfinite(r["kernel_only_s"]) for r in payload["call_overhead"])
    return payload


if __name__ == "__main__":
    main()
