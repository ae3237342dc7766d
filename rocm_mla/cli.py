"""``rocm-mla``: info | demo | generate | make-tiny | bench."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from rocm_mla.backends import (
    BACKEND_NAMES,
    ENV_VAR,
    backend_class,
    requested_backend,
)
from rocm_mla.backends.aiter import FP8_BY_ARCH, AiterMLAImpl, installed_report
from rocm_mla.inputs import DecodeSpec
from rocm_mla.integrations.common import example_decode_line
from rocm_mla.kernels.target import SUPPORTED_TRITON
from rocm_mla.platform import current_platform, package_version, torch_build

#: Environment variables that change what this package does.
ENV_VARS = (
    ENV_VAR,
    "ROCM_MLA_DISABLE",
    "TRITON_INTERPRET",
    "HIP_VISIBLE_DEVICES",
    "CUDA_VISIBLE_DEVICES",
    "VLLM_ROCM_USE_AITER",
)


def info_dict() -> dict:
    plat = current_platform()
    backends = {}
    for name in BACKEND_NAMES:
        cls = backend_class(name)
        reason = cls.unavailable_reason()
        backends[name] = {
            "available": reason is None,
            "reason": reason,
            "target": cls.target() if reason is None else None,
            "auto_skip": cls.auto_skip_reason() if reason is None else None,
        }
    return {
        "rocm_mla": package_version("rocm-mla"),
        "platform": {"kind": plat.kind, "arch": plat.arch, "device": plat.device_name},
        "torch": {
            "version": torch.__version__,
            "build": torch_build(),
            "hip": torch.version.hip,
            "cuda": torch.version.cuda,
        },
        "triton": package_version("triton") or package_version("pytorch-triton-rocm"),
        "triton_supported": str(SUPPORTED_TRITON),
        "aiter": {
            "version": package_version("amd-aiter") or package_version("aiter"),
            **installed_report(),
        },
        "backends": backends,
        "selected": requested_backend(),
        "decode": example_decode_line(torch.device("cpu" if plat.kind == "cpu" else "cuda")),
        "env": {k: os.environ[k] for k in ENV_VARS if k in os.environ},
    }


#: ``rocm-mla info --require-aiter``'s shape syntax: cache kind, query heads, S_q, and
#: ``:lse`` for a call that reads the LSE (DCP).
_AITER_SHAPE = re.compile(r"(bf16|fp8):([1-9][0-9]*):([1-9][0-9]*)(:lse)?")


def aiter_verdicts(shapes: str) -> list[tuple[str, list[str]]]:
    """``(shape, reasons)`` for each comma-separated ``kind:heads:q_len[:lse]`` of
    ``shapes`` (``bf16:128:1``, ``fp8:16:4``, ``bf16:128:1:lse``): the reasons the AITER
    backend would refuse that decode on this machine (empty: it serves it). An fp8 cache is
    AITER's fp8 for the GPU's arch."""
    arch = current_platform().arch
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    verdicts = []
    for shape in shapes.split(","):
        found = _AITER_SHAPE.fullmatch(shape.strip())
        if found is None:
            raise ValueError(
                f"--require-aiter: expected shapes like bf16:128:1, fp8:16:4 or "
                f"bf16:128:1:lse (cache, heads, q_len, LSE), got {shape.strip()!r}"
            )
        kind, heads, q_len, lse = found.groups()
        fp8 = FP8_BY_ARCH.get(arch or "", torch.float8_e4m3fnuz)
        spec = DecodeSpec(
            device=device,
            q_dtype=torch.bfloat16,
            kv_dtype=fp8 if kind == "fp8" else torch.bfloat16,
            num_heads=int(heads),
            q_len=int(q_len),
            head_dim=576,
            head_dim_v=512,
            lse=lse is not None,
        )
        verdicts.append((shape.strip(), AiterMLAImpl.unsupported_reasons(spec)))
    return verdicts


def cmd_info(args: argparse.Namespace) -> int:
    info = info_dict()
    verdicts = [] if args.require_aiter is None else aiter_verdicts(args.require_aiter)
    refused = [shape for shape, reasons in verdicts if reasons]
    if args.json:
        info["require_aiter"] = dict(verdicts) if verdicts else None
        print(json.dumps(info, indent=2))
        return 1 if refused else 0
    plat = info["platform"]
    where = (
        plat["kind"]
        if plat["kind"] == "cpu"
        else f"{plat['kind']} {plat['arch']} ({plat['device']})"
    )
    print(f"rocm-mla {info['rocm_mla']}")
    print(f"platform: {where}")
    t = info["torch"]
    build = t["build"] + (f" {t['hip'] or t['cuda']}" if t["build"] != "cpu" else "")
    print(f"torch:    {t['version']} ({build})")
    print(f"triton:   {info['triton'] or 'not installed'} (supported: {info['triton_supported']})")
    aiter = info["aiter"]
    print(f"aiter:    {aiter['version'] or 'not installed'}")
    if aiter["features"] is not None:
        has = [name for name, present in aiter["features"].items() if present]
        lacks = [name for name, present in aiter["features"].items() if not present]
        print(f"          {aiter['summary']}")
        print(f"          has: {', '.join(has) or 'none'}; lacks: {', '.join(lacks) or 'none'}")
    print("backends:")
    for name, b in info["backends"].items():
        if b["available"]:
            line = f"available on {b['target']}" if b["target"] else "available"
            if b["auto_skip"]:
                line += f" (auto skips it: {b['auto_skip']})"
        else:
            line = f"unavailable: {b['reason']}"
        print(f"  {name:<7} {line}")
    print(f"selected: {info['selected']} (from {ENV_VAR}, default auto)")
    print(f"decode:   {info['decode']}")
    print("env:      " + (", ".join(f"{k}={v}" for k, v in info["env"].items()) or "(none set)"))
    for shape, reasons in verdicts:
        verdict = f"refuses it: {'; '.join(reasons)}" if reasons else "serves it"
        print(f"aiter {shape}: {verdict}")
    if refused:
        print(
            f"rocm-mla info: the aiter backend would refuse {', '.join(refused)} (--require-aiter)",
            file=sys.stderr,
        )
        return 1
    return 0


#: One id of ``--prompt-ids``: ASCII digits with an optional sign. Python's ``int`` would also
#: read ``1_0`` as 10 and other scripts' digits; an empty entry (``1,,2``) is a typo too.
_ID = re.compile(r"[+-]?[0-9]+")


def _parse_ids(text: str) -> list[int]:
    entries = [t.strip() for t in text.split(",")]
    if not all(_ID.fullmatch(t) for t in entries):
        raise ValueError(
            "--prompt-ids: expected comma-separated integers (one id between every two "
            f"commas), got {text!r}"
        )
    return [int(t) for t in entries]


def _tokenizer(model_dir: str):
    """A tokenizer stored in the checkpoint directory, loaded offline, or None if there is none.

    Raises ``ValueError`` naming ``--model`` and the files when they are there but broken, so
    that it fails before the engine loads, not after the generation.
    """
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model")
    present = [n for n in names if (Path(model_dir) / n).exists()]
    if not present:
        return None
    from transformers import AutoTokenizer
    from transformers.utils import logging

    # transformers also reads config.json here and warns about model fields the tokenizer
    # does not use; the only message that matters is ours.
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(
            model_dir, local_files_only=True, trust_remote_code=False
        )
    except Exception as err:  # transformers fails in a different way for each file kind
        raise ValueError(
            f"--model: the tokenizer files in {model_dir} ({', '.join(present)}) cannot be "
            f"loaded: {_first_line(err)}"
        ) from None
    finally:
        logging.set_verbosity(verbosity)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


def _engine_kwargs(args: argparse.Namespace, *names: str) -> dict:
    """``LLM`` keyword arguments from the parsed flags. Flags left unset are not passed, so
    the defaults live in one place (``EngineOptions``, which ``LLM``'s signature reads)."""
    kwargs = dict(
        device=args.device,
        pp=args.pp,
        tp=args.tp,
        dcp=args.dcp,
        backend=args.backend,
        dtype=args.dtype,
    )
    for name in ("dcp_interleave", "block_size", *names):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    return kwargs


def _check_model_dir(model: str):
    """The config of ``--model``; ``ValueError`` naming ``--model`` unless it is a directory
    with a valid config."""
    from rocm_mla.models.kimi_k3 import KimiK3Config

    path = Path(model)
    if not path.is_dir():
        raise ValueError(f"--model: {model} is not a directory (expected a checkpoint directory)")
    if not (path / "config.json").is_file():
        raise ValueError(f"--model: {model} has no config.json (is it a checkpoint directory?)")
    try:
        return KimiK3Config.from_pretrained(path)
    except ValueError as err:  # names config.json and the key
        raise ValueError(f"--model: {err}") from None


def cmd_generate(args: argparse.Namespace) -> int:
    from rocm_mla.engine import LLM
    from rocm_mla.engine.llm import check_generate_args

    config = _check_model_dir(args.model)
    prompts, _ = check_generate_args(
        config,
        [_parse_ids(p) for p in args.prompt_ids],
        args.max_new_tokens,
        args.temperature,
        args.eos_token_id,
    )
    printing = not (args.torchrun and int(os.environ.get("RANK", "0")) != 0)
    tokenizer = _tokenizer(args.model) if printing else None
    start = time.perf_counter()
    llm = LLM(
        args.model,
        **_engine_kwargs(args, "num_blocks", "max_num_seqs"),
        enforce_eager=args.enforce_eager,
        launcher="torchrun" if args.torchrun else "spawn",
    )
    with llm:
        loaded = time.perf_counter()
        outputs = llm.generate(
            prompts,
            args.max_new_tokens,
            args.temperature,
            eos_token_id=args.eos_token_id,
            show_progress=True,
        )
        elapsed = time.perf_counter() - loaded
    if not printing:
        return 0
    texts, failure = [], None
    for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        if tokenizer is None or failure is not None:
            break
        try:
            texts.append(tokenizer.decode(prompt + out))
        except Exception as err:  # a tokenizer that loaded can still fail on some ids
            failure = f"--model: the tokenizer cannot decode prompt {i}: {_first_line(err)}"
    layout = f"pp={args.pp} tp={args.tp} dcp={args.dcp} interleave={args.dcp_interleave}"
    print(f"{args.model} ({layout}): loaded in {loaded - start:.1f} s")
    for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        print(f"[{i}] prompt {prompt} -> {out}")
        if i < len(texts):
            print(f"    text: {texts[i]!r}")
    if tokenizer is None:
        print(f"(no tokenizer files in {args.model}: ids only)")
    total = sum(len(o) for o in outputs)
    print(f"{total} new tokens in {elapsed:.2f} s: {total / elapsed:.1f} tokens/s")
    if failure is not None:
        print(f"rocm-mla generate: {failure}", file=sys.stderr)
        return 2
    return 0


#: The demo's batch: mixed lengths, down to one token (shorter than any dcp * interleave > 1).
DEMO_PROMPTS = [[5, 17, 33, 2, 9, 41, 7, 60, 12, 3, 77, 31], [100, 4, 8], [250], [9] * 21]


def _run_demo_engine(path: str, max_new: int, **kwargs) -> tuple[list[list[int]], float, float]:
    from rocm_mla.engine import LLM

    start = time.perf_counter()
    with LLM(path, **kwargs) as llm:
        loaded = time.perf_counter()
        outputs = llm.generate(DEMO_PROMPTS, max_new)
        elapsed = time.perf_counter() - loaded
    return outputs, loaded - start, elapsed


def cmd_demo(args: argparse.Namespace) -> int:
    import tempfile

    from rocm_mla.engine import LLM
    from rocm_mla.engine.llm import placement
    from rocm_mla.models.kimi_k3 import make_tiny

    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens: expected an int >= 0, got {args.max_new_tokens}")
    # Both runs on the same device, so "identical" compares the split, not two devices'
    # rounding; with fewer GPUs than ranks that device is the CPU (placement says so).
    _, device = placement(args.pp * args.tp, args.device)
    kwargs = {**_engine_kwargs(args), "device": device}
    with tempfile.TemporaryDirectory(prefix="rocm-mla-demo-") as tmp:
        path = str(make_tiny("kimi_k3", Path(tmp) / "kimi_k3-tiny"))
        # Every argument of the split run is checked before the single-process run starts.
        LLM.check(path, **kwargs)
        layout = f"pp={args.pp}, tp={args.tp}, dcp={args.dcp}" + (
            f" (interleave {args.dcp_interleave})" if args.dcp_interleave is not None else ""
        )
        print(f"tiny Kimi-K3 checkpoint (make-tiny): {path}")
        print(f"batch of {len(DEMO_PROMPTS)} prompts, lengths {[len(p) for p in DEMO_PROMPTS]}, "
              f"{args.max_new_tokens} new tokens each, greedy")  # fmt: skip
        runs = {}
        for name, run_kwargs in (
            ("single process", {**kwargs, "pp": 1, "tp": 1, "dcp": 1, "dcp_interleave": 1}),
            (f"{args.pp * args.tp} processes, {layout}", kwargs),
        ):
            outputs, load_s, gen_s = _run_demo_engine(path, args.max_new_tokens, **run_kwargs)
            total = sum(len(o) for o in outputs)
            print(f"\n{name}: started in {load_s:.1f} s, {total / gen_s:.1f} tokens/s")
            for i, out in enumerate(outputs):
                print(f"  [{i}] {out}")
            runs[name] = outputs
    single, split = runs.values()
    for i, (a, b) in enumerate(zip(single, split, strict=True)):
        if a != b:
            pos = next(
                (j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)),
            )
            print(f"\nMISMATCH: prompt {i}, new token {pos}: single process {a[pos:pos + 1]}, "
                  f"split {b[pos:pos + 1]}", file=sys.stderr)  # fmt: skip
            return 1
    print("\nidentical")
    return 0


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from rocm_mla.models.kimi_k3 import make_tiny

    print(make_tiny(args.arch, args.out, seed=args.seed, experts=args.experts))
    return 0


BENCHMARKS = {
    "cpu": "benchmarks.cpu_decode",
    "kernel": "benchmarks.kernel_roofline",
    "dcp": "benchmarks.dcp_scaling",
    "e2e": "benchmarks.e2e",
    "gpu": "benchmarks.gpu",
    "static": "benchmarks.kernel_static",
    "schedule": "benchmarks.schedule",
}


def cmd_bench(args: argparse.Namespace) -> int:
    """Run a benchmark of the source checkout the package was installed from (editable):
    ``python -m benchmarks.<name>`` in the checkout, its exit code returned. The benchmarks
    are a layer of the source tree, not of the wheel; nothing is added to this process's
    import path."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "benchmarks" / "common.py").exists():
        print(
            f"rocm-mla bench: no benchmarks/ next to the package ({root}); the benchmarks "
            "ship with the source tree: in a checkout, `pip install -e .` and run "
            f"`rocm-mla bench {args.which}` (or `python -m {BENCHMARKS[args.which]}`) there",
            file=sys.stderr,
        )
        return 2
    done = subprocess.run([sys.executable, "-m", BENCHMARKS[args.which], *args.rest], cwd=root)
    return done.returncode


def _engine_args(p: argparse.ArgumentParser, pp: int, tp: int, dcp: int) -> None:
    p.add_argument("--pp", type=int, default=pp, help="pipeline stages")
    p.add_argument("--tp", type=int, default=tp, help="tensor-parallel ranks per stage")
    p.add_argument("--dcp", type=int, default=dcp, help="decode context parallel size (divides tp)")
    p.add_argument("--dcp-interleave", type=int, default=None, help="(default: LLM's)")
    p.add_argument("--backend", default=None, help="auto|aiter|triton|torch (default: env/auto)")
    p.add_argument("--dtype", default=None, help="float32|float16|bfloat16 (default: checkpoint)")
    p.add_argument("--block-size", type=int, default=None, help="(default: LLM's)")
    p.add_argument(
        "--device",
        default=None,
        help="cpu|cuda (default: cuda with a GPU per rank, else cpu with a notice)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rocm-mla", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="platform, versions, backends and why any cannot run")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--require-aiter",
        metavar="SHAPES",
        default=None,
        help="exit 1 unless the aiter backend serves each decode shape, comma-separated "
        "kind:heads:q_len[:lse] (bf16:128:1,fp8:16:4,bf16:128:1:lse)",
    )
    p.set_defaults(func=cmd_info)

    p = sub.add_parser(
        "demo",
        help="tiny Kimi-K3 split over pp x tp x dcp processes vs one process: identical?",
    )
    _engine_args(p, pp=2, tp=2, dcp=2)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("generate", help="greedy/sampled generation from a checkpoint directory")
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument(
        "--prompt-ids", action="append", required=True, help="comma-separated ids (repeatable)"
    )
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--eos-token-id", type=int, default=None)
    p.add_argument(
        "--num-blocks", type=int, default=None, help="KV blocks per layer per rank (default: LLM's)"
    )
    p.add_argument(
        "--max-num-seqs", type=int, default=None, help="requests in flight at once (default: LLM's)"
    )
    p.add_argument(
        "--enforce-eager", action="store_true", help="no CUDA/HIP graph capture of decode steps"
    )
    p.add_argument("--torchrun", action="store_true", help="this is one rank of a torchrun launch")
    _engine_args(p, pp=1, tp=1, dcp=1)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "make-tiny", help="write a random tiny Kimi checkpoint (config + safetensors)"
    )
    p.add_argument("--arch", choices=["kimi_k3", "kimi_linear"], required=True)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--experts",
        choices=["plain", "mxfp4"],
        default="plain",
        help="routed-expert weights: plain, or compressed-tensors MXFP4 (packed e2m1 + e8m0)",
    )
    p.set_defaults(func=cmd_make_tiny)

    p = sub.add_parser("bench", help="run a benchmark (JSON + PNG under benchmarks/results)")
    p.add_argument("which", choices=sorted(BENCHMARKS))
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    p.set_defaults(func=cmd_bench)
    return parser


#: ``LLM`` argument -> the flag that sets it, so that errors name what the user typed.
_FLAGS = {
    "model": "--model",
    "pp": "--pp",
    "tp": "--tp",
    "dcp": "--dcp",
    "dcp_interleave": "--dcp-interleave",
    "backend": "--backend",
    "dtype": "--dtype",
    "device": "--device",
    "block_size": "--block-size",
    "num_blocks": "--num-blocks",
    "max_num_seqs": "--max-num-seqs",
    "max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "eos_token_id": "--eos-token-id",
    "prompt_token_ids": "--prompt-ids",
}


def _one_line(message: str) -> str:
    """An error message as one line, its leading ``LLM`` argument replaced by the flag."""
    text = " ".join(line.strip() for line in message.splitlines() if line.strip())
    head, sep, rest = text.partition(":")
    name = head.split("[")[0]
    if sep and name in _FLAGS:
        return f"{_FLAGS[name]}{head[len(name) :]}:{rest}"
    return text


def main(argv: list[str] | None = None) -> int:
    from rocm_mla.distributed import WorkerError
    from rocm_mla.engine.cache import CacheFullError

    args = build_parser().parse_args(argv)
    prog = f"rocm-mla {args.command}"
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted (workers stopped)", file=sys.stderr)
        return 130
    except CacheFullError as exc:
        flag = _FLAGS.get(exc.knob, exc.knob)
        print(f"{prog}: {exc.detail}; raise {flag} to at least {exc.minimum}", file=sys.stderr)
    except WorkerError as exc:
        print(f"{prog}: worker failed: {exc.summary}", file=sys.stderr)
    except (ValueError, TypeError) as exc:
        print(f"{prog}: {_one_line(str(exc))}", file=sys.stderr)
    except OSError as exc:
        flag = {"make-tiny": "--out", "generate": "--model"}.get(args.command)
        what = f"{flag}: " if flag else ""
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"{prog}: {what}{where}{exc.strerror or exc}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
