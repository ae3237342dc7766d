"""End to end on CPU: this package's engine vs transformers ``generate``, same weights, greedy.

The ``KimiK3Config.small()`` Kimi-Linear config (hidden 1024, 8 layers, MLA at 1-based 4 and
8, KDA 8 x 128, MLA 8 heads, kv_lora 512, rope 64, 16 experts top-2, vocab 32000). One
random checkpoint is written by transformers' ``save_pretrained`` and read by both sides.
Each measurement runs in a fresh spawned process so its peak RSS is its own.

Two workloads:

* batch ``--batch`` x prompt ``--prompt-len``, ``--new-tokens`` new: total time ratio
  (target >= 3x) and decode tokens/s ratio (target >= 1.5x);
* batch 1 x context ``--long-context``, ``--long-new-tokens`` new: decode tokens/s ratio,
  where the absorbed latent cache should pay off (target >= 2x).

Decode time is total minus prefill: for transformers the time of the first logits-processor
call (after the prefill forward) to the end; for the engine, ``generate(..., 1)`` timed
separately (after an untimed one of the same size) and subtracted. Both sides get one short
untimed warm-up generate first.

    python -m benchmarks.e2e                       # the full run (slow: minutes)
    python -m benchmarks.e2e --prompt-len 256 --new-tokens 16 --long-context 2048
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import RESULTS_DIR, environment, synchronize, write_results

TARGETS = {"total_ratio": 3.0, "decode_ratio": 1.5, "long_decode_ratio": 2.0}


def hf_config():
    """transformers' KimiLinearConfig equal to ``KimiK3Config.small()``."""
    import transformers

    return transformers.KimiLinearConfig(
        vocab_size=32000,
        hidden_size=1024,
        num_hidden_layers=8,
        intermediate_size=4096,
        hidden_act="silu",
        num_attention_heads=8,
        num_key_value_heads=8,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        moe_intermediate_size=512,
        num_local_experts=16,
        num_experts_per_tok=2,
        n_shared_experts=1,
        routed_scaling_factor=2.446,
        first_k_dense_replace=1,
        linear_attn_config={
            "head_dim": 128,
            "num_heads": 8,
            "short_conv_kernel_size": 4,
            "full_attn_layers": [4, 8],
            "kda_layers": [1, 2, 3, 5, 6, 7],
        },
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,
    )


def write_checkpoint(path: Path, seed: int = 0) -> int:
    """Random unit-scale weights saved by transformers; returns the parameter count."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.KimiLinearForCausalLM(hf_config()).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                continue  # keep the decay init: random decays make a meaningless model
            randn = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * randn)
            elif "embed_tokens" in name:
                p.copy_(randn)
            else:
                p.copy_(randn * p.shape[-1] ** -0.5)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def run_transformers(
    path: str, prompts: torch.Tensor, new_tokens: int, device: str = "cpu", dtype: str = "float32"
) -> dict:
    import transformers

    model = transformers.KimiLinearForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    prompts = prompts.to(device)
    stamps: list[float] = []

    class Clock(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            synchronize()  # on a GPU the stamp must follow the work, not its launch
            stamps.append(time.perf_counter())
            return scores

    with torch.no_grad():  # untimed warm-up (first-call allocations), as for the engine
        model.generate(prompts[:, :8], attention_mask=torch.ones_like(prompts[:, :8]),
                       max_new_tokens=2, do_sample=False)  # fmt: skip
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            logits_processor=transformers.LogitsProcessorList([Clock()]),
        )
    end = time.perf_counter()
    batch = prompts.shape[0]
    return {
        "total_s": end - start,
        "prefill_s": stamps[0] - start,
        "decode_tok_s": batch * (new_tokens - 1) / (end - stamps[0]),
        "peak_rss_gib": _peak_rss_gib(),
        "tokens": out[:, prompts.shape[1] :].tolist(),
    }


def run_engine(
    path: str,
    prompts: torch.Tensor,
    new_tokens: int,
    device: str = "cpu",
    dtype: str = "float32",
    backend: str = "torch",
) -> dict:
    from rocm_mla.engine import LLM

    ids = prompts.tolist()
    num_blocks = len(ids) * -(-(prompts.shape[1] + new_tokens) // 16)
    with LLM(path, dtype=dtype, backend=backend, num_blocks=num_blocks,
             max_num_seqs=len(ids), device=device) as llm:  # fmt: skip
        llm.generate([p[:8] for p in ids], 2)  # untimed warm-up (first-call allocations)
        # The first prefill at full size pays for page faults and allocator growth; timing
        # it would overstate prefill and leave a decode time of total - prefill near zero
        # (or below). Time the second one.
        llm.generate(ids, 1)
        start = time.perf_counter()
        llm.generate(ids, 1)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        tokens = llm.generate(ids, new_tokens)
        total = time.perf_counter() - start
    return {
        "total_s": total,
        "prefill_s": prefill,
        "decode_tok_s": len(ids) * (new_tokens - 1) / (total - prefill),
        "peak_rss_gib": _peak_rss_gib(),
        "tokens": tokens,
    }


def _child(fn_name: str, args: tuple, results) -> None:
    results.put(globals()[fn_name](*args))


def in_fresh_process(fn_name: str, *args) -> dict:
    """``fn(*args)`` in a spawned process, so that its peak RSS is its own."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_child, args=(fn_name, args, results))
    proc.start()
    value = results.get()
    proc.join()
    return value


def compare(
    path: str,
    batch: int,
    length: int,
    new_tokens: int,
    seed: int,
    device: str = "cpu",
    dtype: str = "float32",
    backend: str = "torch",
) -> dict:
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(2, 32000, (batch, length), generator=gen)
    ours = in_fresh_process("run_engine", path, prompts, new_tokens, device, dtype, backend)
    hf = in_fresh_process("run_transformers", path, prompts, new_tokens, device, dtype)
    same = sum(a == b for a, b in zip(ours.pop("tokens"), hf.pop("tokens"), strict=True))
    return {
        "batch": batch,
        "prompt_len": length,
        "new_tokens": new_tokens,
        "device": device,
        "dtype": dtype,
        "engine": ours,
        "transformers": hf,
        "identical_sequences": f"{same}/{batch}",
        "total_ratio": hf["total_s"] / ours["total_s"],
        "decode_ratio": ours["decode_tok_s"] / hf["decode_tok_s"],
    }


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = payload["runs"]
    labels = [f"B{r['batch']} ctx {r['prompt_len']}" for r in runs]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    x = range(len(runs))
    for ax, key, title in (
        (axes[0], "decode_tok_s", "decode tokens/s"),
        (axes[1], "total_s", "total time (s)"),
    ):
        ax.bar([i - 0.2 for i in x], [r["engine"][key] for r in runs], 0.4, label="rocm-mla")
        ax.bar([i + 0.2 for i in x], [r["transformers"][key] for r in runs], 0.4,
               label="transformers")  # fmt: skip
        ax.set_xticks(list(x), labels)
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"Kimi-Linear small ({payload['params_m']:.0f}M params), CPU, greedy")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.e2e", description=__doc__)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--long-context", type=int, default=16384, help="0 skips the long run")
    parser.add_argument("--long-new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rocm-mla-e2e-") as tmp:
        params = write_checkpoint(Path(tmp), args.seed)
        print(f"Kimi-Linear small: {params / 1e6:.1f}M parameters")
        runs = [compare(tmp, args.batch, args.prompt_len, args.new_tokens, args.seed)]
        if args.long_context:
            runs.append(compare(tmp, 1, args.long_context, args.long_new_tokens, args.seed))
    payload = {
        "benchmark": "e2e",
        "environment": environment(),
        "config": "KimiK3Config.small() (Kimi-Linear), float32, greedy",
        "params_m": params / 1e6,
        "targets": TARGETS,
        "runs": runs,
    }
    for r in runs:
        print(
            f"batch {r['batch']} x {r['prompt_len']} + {r['new_tokens']}: total "
            f"{r['engine']['total_s']:.1f} s vs {r['transformers']['total_s']:.1f} s "
            f"({r['total_ratio']:.2f}x), decode {r['engine']['decode_tok_s']:.1f} vs "
            f"{r['transformers']['decode_tok_s']:.1f} tok/s ({r['decode_ratio']:.2f}x), peak RSS "
            f"{r['engine']['peak_rss_gib']:.2f} vs {r['transformers']['peak_rss_gib']:.2f} GiB, "
            f"identical sequences {r['identical_sequences']}"
        )
    json_path = write_results("e2e", payload)
    plot(payload, json_path.with_suffix(".png"))
    print(f"wrote {json_path} and {json_path.with_suffix('.png').name} in {RESULTS_DIR}")
    return payload


if __name__ == "__main__":
    main()
