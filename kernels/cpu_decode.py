"""The fused paged MLA decode for the CPU (C++, built on first use).

One pass over each request's keys through its block table: every KV row (576 wide for MLA) is
converted to fp32 once per task and used by all of the task's heads, scores and then the
weighted V sum, with an online softmax in fp32. Tasks are (request, query row, head group),
run with ``at::parallel_for`` (torch's thread count). No gathered copy of the cache exists.

Semantics are those of the torch backend: causal verify windows (row i sees
``L - S_q + 1 + i`` keys), out in q's dtype, lse float32 natural log, rows without keys
0 / -inf. A row whose query or any visible cache element is not finite comes out NaN (out and
lse, every head). Bounds: a row that may see a key whose block-table column is at or past
``max_blocks``, or whose block id lies outside ``[0, num_blocks)``, or (with ``max_seqlen``,
a plan's bound) a length above it, is NaN and the cause is ORed into ``fault_flag``
(``FAULT_*`` of ``rocm_mla.inputs``); such keys are never read.
"""

from __future__ import annotations

import hashlib
import os
import platform
from functools import lru_cache
from pathlib import Path

import torch

from rocm_mla.inputs import FP8_DTYPES

_SOURCE = Path(__file__).with_name("cpu_decode.cpp")


def _cpu_tag() -> str:
    """The build uses -march=native, so a cache dir shared between machines keeps one build
    per CPU model and flag set."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = platform.processor()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:12]


def _build_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(base) / "rocm-mla" / "cpu-decode" / f"torch-{torch.__version__}-{_cpu_tag()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@lru_cache(maxsize=1)
def _load() -> tuple[object | None, str | None]:
    """(module, None) or (None, why it cannot be built). Built once per process."""
    try:
        from torch.utils import cpp_extension

        flags = ["-O3", "-march=native", "-std=c++17"]
        openmp = torch.backends.openmp.is_available()
        if openmp:
            flags.append("-fopenmp")
        module = cpp_extension.load(
            name=f"rocm_mla_cpu_decode_{_cpu_tag()}",
            sources=[str(_SOURCE)],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"] if openmp else [],
            build_directory=str(_build_dir()),
            verbose=False,
        )
    except Exception as error:  # a missing compiler or ninja, or a build error
        text = " ".join(str(error).split())
        return None, f"the CPU decode kernel did not build: {type(error).__name__}: {text[:300]}"
    return module, None


def available() -> str | None:
    """None when the kernel is built (building it on first call), else the reason it is not."""
    return _load()[1]


@lru_cache(maxsize=4)
def _fp8_table(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).to(torch.float32)


def _head_group(rows: int, num_heads: int) -> int:
    """Heads per task: all of them unless too few (request, row) tasks exist to keep every
    thread busy; each extra group re-reads the keys, so split no further than that."""
    threads = torch.get_num_threads()
    if rows >= threads:
        return num_heads
    splits = min(num_heads, -(-threads // rows))
    return -(-num_heads // splits)


@torch.no_grad()
def decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    head_dim_v: int,
    softmax_scale: float,
    causal: bool,
    kv_scale: float | None = None,
    max_seqlen: int | None = None,
    fault_flag: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, S_q, H, head_dim_v] in q's dtype and lse [B, S_q, H] float32.

    ``kv_cache`` is ``[num_blocks, block_size, D]`` (q is ``[B, S_q, H, D]``);
    ``max_seqlen`` is a plan's bound on the lengths (longer rows are NaN and fault);
    ``fault_flag`` an int32 ``[1]`` CPU tensor.
    """
    _check(q, kv_cache, block_table, cache_seqlens, head_dim_v, fault_flag)
    module, why = _load()
    if module is None:
        raise RuntimeError(why)
    batch, q_len, num_heads, _ = q.shape
    k_scale = 1.0 if kv_scale is None else float(kv_scale)
    # Scaled up front as the reference does, so that a score that overflows is inf.
    qs = (q.to(torch.float32) * (softmax_scale * k_scale)).contiguous()
    kv, table = kv_cache, None
    if kv_cache.dtype in FP8_DTYPES:
        kv, table = kv_cache.view(torch.uint8), _fp8_table(kv_cache.dtype)
    if kv.stride(2) != 1:
        kv = kv.contiguous()
    out = torch.empty(batch, q_len, num_heads, head_dim_v, dtype=torch.float32)
    lse = torch.empty(batch, q_len, num_heads, dtype=torch.float32)
    module.decode(
        qs,
        kv,
        block_table.to(torch.int32).contiguous(),
        cache_seqlens.to(torch.int32).contiguous(),
        out,
        lse,
        fault_flag,
        table,
        -1 if max_seqlen is None else int(max_seqlen),
        _head_group(batch * q_len, num_heads),
        bool(causal),
        k_scale,
    )
    return (out if q.dtype == torch.float32 else out.to(q.dtype)), lse


def _check(q, kv_cache, block_table, cache_seqlens, head_dim_v, fault_flag) -> None:
    def fail(name: str, expected: str, got: object) -> None:
        raise ValueError(f"cpu_decode: {name} must be {expected}, got {got}")

    for name, t in (("q", q), ("kv_cache", kv_cache), ("block_table", block_table)):
        if t.device.type != "cpu":
            fail(name, "on the CPU", t.device)
    if q.dim() != 4:
        fail("q", "[B, S_q, H, D]", list(q.shape))
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        fail("q", "float32, float16 or bfloat16", q.dtype)
    if kv_cache.dim() != 3 or kv_cache.shape[2] != q.shape[3]:
        fail("kv_cache", f"[num_blocks, block_size, {q.shape[3]}]", list(kv_cache.shape))
    if kv_cache.dtype not in (torch.float32, torch.float16, torch.bfloat16, *FP8_DTYPES):
        fail("kv_cache", "float32, float16, bfloat16 or fp8 e4m3", kv_cache.dtype)
    if block_table.dim() != 2 or block_table.shape[0] != q.shape[0]:
        fail("block_table", f"[{q.shape[0]}, max_blocks]", list(block_table.shape))
    if block_table.dtype != torch.int32:
        fail("block_table", "int32", block_table.dtype)
    if cache_seqlens.shape != (q.shape[0],) or cache_seqlens.dtype != torch.int32:
        got = f"{cache_seqlens.dtype} {list(cache_seqlens.shape)}"
        fail("cache_seqlens", f"int32 [{q.shape[0]}]", got)
    if not 0 < head_dim_v <= q.shape[3]:
        fail("head_dim_v", f"in [1, {q.shape[3]}]", head_dim_v)
    if fault_flag is not None:
        flag = fault_flag
        if flag.dtype != torch.int32 or flag.shape != (1,) or flag.device.type != "cpu":
            got = f"{flag.dtype} {list(flag.shape)} on {flag.device}"
            fail("fault_flag", "an int32 [1] CPU tensor", got)
