"""``rocm-mla``: info | demo | make-tiny | bench."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from rocm_mla.api import mla_decode
from rocm_mla.backends import (
    BACKEND_NAMES,
    ENV_VAR,
    backend_class,
    requested_backend,
    select_backend,
)
from rocm_mla.inputs import prepare_decode
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
        "aiter": package_version("amd-aiter") or package_version("aiter"),
        "backends": backends,
        "selected": requested_backend(),
        "env": {k: os.environ[k] for k in ENV_VARS if k in os.environ},
    }


def cmd_info(args: argparse.Namespace) -> int:
    info = info_dict()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
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
    print(f"triton:   {info['triton'] or 'not installed'}")
    print(f"aiter:    {info['aiter'] or 'not installed'}")
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
    print("env:      " + (", ".join(f"{k}={v}" for k, v in info["env"].items()) or "(none set)"))
    return 0


def _dense_reference(q, kv_cache, block_table, lens, head_dim_v):
    """float64 attention over each request's gathered rows (the demo's independent check)."""
    batch, _, _, dim = q.shape
    rows = kv_cache[block_table.long()].reshape(batch, -1, dim).double()
    pos = torch.arange(rows.shape[1])
    scores = torch.einsum("bhd,bnd->bhn", q[:, 0].double(), rows) * dim**-0.5
    scores = scores.masked_fill(pos[None, None, :] >= lens[:, None, None], float("-inf"))
    out = torch.einsum("bhn,bnd->bhd", torch.softmax(scores, -1), rows[..., :head_dim_v])
    return out[:, None]


def cmd_demo(args: argparse.Namespace) -> int:
    gen = torch.Generator().manual_seed(0)
    batch, heads, block, dim, dv = args.batch, args.heads, 16, 576, 512
    lens = torch.randint(1, args.context + 1, (batch,), generator=gen, dtype=torch.int32)
    blocks_per_req = -(-args.context // block)
    num_blocks = batch * blocks_per_req
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kv = torch.randn(num_blocks, block, dim, generator=gen)
    table = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per_req).to(torch.int32)
    q = torch.randn(batch, 1, heads, dim, generator=gen)
    inputs = [t.to(device) for t in (q, kv, table, lens)]
    problem = prepare_decode(*inputs, head_dim_v=dv, softmax_scale=None, causal=True, kv_scale=None)
    chosen = select_backend(args.backend, problem).name
    print(
        f"decode demo on {current_platform()}: backend {requested_backend(args.backend)} "
        f"-> {chosen}"
    )
    print(
        f"  q {tuple(q.shape)}, paged kv_cache {tuple(kv.shape)} (block {block}), "
        f"block_table {tuple(table.shape)} shuffled, cache_seqlens {lens.tolist()}"
    )

    out, lse = mla_decode(*inputs, backend=args.backend)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.repeats):
        out, lse = mla_decode(*inputs, backend=args.backend)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / args.repeats
    ref = _dense_reference(q, kv, table, lens, dv)
    err = (out.cpu().double() - ref).abs().max().item()
    print(f"  out {tuple(out.shape)} {out.dtype}, lse {tuple(lse.shape)} {lse.dtype}")
    print(f"  time per decode: {elapsed * 1e3:.2f} ms (mean of {args.repeats})")
    print(f"  max |out - float64 dense reference|: {err:.2e}")
    if not err < 1e-4:
        print("  FAILED: error above 1e-4", file=sys.stderr)
        return 1
    return 0


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from rocm_mla.models.kimi_k3 import make_tiny

    print(make_tiny(args.arch, args.out, seed=args.seed))
    return 0


BENCHMARKS = {
    "cpu": "benchmarks.cpu_decode",
    "kernel": "benchmarks.kernel_roofline",
    "dcp": "benchmarks.dcp_scaling",
}


def cmd_bench(args: argparse.Namespace) -> int:
    # The benchmarks ship with the source tree, not the wheel: run from a checkout.
    root = Path(__file__).resolve().parents[1]
    if not (root / "benchmarks" / "common.py").exists():
        print(
            f"rocm-mla bench: no benchmarks/ next to the package ({root}); run it from a "
            "source checkout of rocm-mla",
            file=sys.stderr,
        )
        return 2
    sys.path.insert(0, str(root))
    module = importlib.import_module(BENCHMARKS[args.which])
    module.main(args.rest)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rocm-mla", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="platform, versions, backends and why any cannot run")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("demo", help="decode a random paged latent cache and check it")
    p.add_argument("--backend", default=None, help="auto|aiter|triton|torch (default: env/auto)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "make-tiny", help="write a random tiny Kimi checkpoint (config + safetensors)"
    )
    p.add_argument("--arch", choices=["kimi_k3", "kimi_linear"], required=True)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_make_tiny)

    p = sub.add_parser("bench", help="run a benchmark (JSON + PNG under benchmarks/results)")
    p.add_argument("which", choices=sorted(BENCHMARKS))
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"rocm-mla {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
