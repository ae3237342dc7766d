"""The fused paged MLA decode for the CPU (C++, built on first use).

One pass over each request's keys through its block table: every KV row (576 wide for MLA) is
converted to fp32 once per task and used by all of the task's heads, scores and then the
weighted V sum, with an online softmax in fp32. No gathered copy of the cache exists.

Tasks are (request, query row, head group, key chunk), run on torch's threads: each thread
pulls the next task, largest first, until none is left. Heads are grouped only when there are
fewer query rows than threads (``_head_group``). Keys are cut so that every task reads about
the same number: the chunk is the batch's total work (keys read, summed over rows and head
groups) over ``threads * TASKS_PER_THREAD``, at least ``MIN_CHUNK_KEYS``, rounded up to the
kernel's 8-key step (rows that fault on their length count as no work and are not cut). A
row that sees no more keys than that is one task and writes its out and lse directly; a
longer one is cut at multiples of the chunk from key 0, each chunk keeps its own max,
denominator and unnormalized V sum, and after the parallel loop the row's chunks are merged
exactly as the online softmax would have continued (sums rescaled to the largest max, then
divided by the denominator). So one 32K-key request among 1K-key ones no longer runs on one
thread while the others idle. The result depends on the cut only by fp32 rounding; for a
given thread count it is deterministic.

Semantics are those of the torch backend: causal verify windows (row i sees
``L - S_q + 1 + i`` keys), out in q's dtype, lse float32 natural log, rows without keys
0 / -inf. A row is one (query position, head): a non-finite element of its query, or an
overflowing score, makes that row NaN (out and lse), a non-finite visible cache element every
head of the positions that see it. Bounds: a row that may see a key whose block-table
column is at or past ``max_blocks``, or whose block id lies outside ``[0, num_blocks)``, or
(with ``max_seqlen``, a plan's bound) a length above it, is NaN and the cause is ORed into
``fault_flag`` (``FAULT_*`` of ``rocm_mla.inputs``); such keys are never read. A cut row
follows the same rules: every chunk checks the bounds of the whole row before reading (so a
faulting row reads nothing), and a head one chunk poisoned is NaN in the merged row.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import time
import warnings
from functools import lru_cache
from pathlib import Path

import torch

from rocm_mla.inputs import FP8_DTYPES

_SOURCE = Path(__file__).with_name("cpu_decode.cpp")

#: Tasks per thread the key chunks aim at. The tail, after the other threads are done, is at
#: most one task: a quarter of a thread's share, less as tasks are pulled largest first.
TASKS_PER_THREAD = 4
#: No key chunk is cut shorter than this. A cut chunk costs a fixed amount on top of its keys
#: (the query and bounds checks of its row, a partial of group x (Dv + 2) floats to write and
#: merge): one 8192-key request on one thread (bf16, 2-core EPYC) took 1-2% longer in 256-key
#: chunks than uncut, 5% in 64-key and 25% in 16-key ones. And a batch of short requests
#: (none over 256 keys) is never cut at all.
MIN_CHUNK_KEYS = 256


#: Seconds a process waits for another process's build of the kernel before giving up (the
#: torch path then runs, with one warning); ``ROCM_MLA_CPU_BUILD_WAIT_S`` overrides.
BUILD_WAIT_S = 600.0
WAIT_ENV = "ROCM_MLA_CPU_BUILD_WAIT_S"
#: A waiter says on stderr that it waits once it has waited this long for a holder that is
#: building (one that only loads a built kernel makes no one print).
WAIT_NOTICE_S = 1.0
#: Present in the build directory while its lock holder compiles.
_BUILDING = "rocm-mla-building"


class CpuKernelBuildTimeout(TimeoutError):
    """Another process held the CPU kernel's build lock for longer than the wait bound."""


def _cpu_info() -> str:
    """The CPU model and flags: the build uses -march=native."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = platform.processor()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    return "\n".join(lines)


def _compiler() -> str:
    """The C++ compiler cpp_extension runs (``$CXX``, else ``c++``): its path and version."""
    name = os.environ.get("CXX", "c++")
    path = shutil.which(name) or name
    try:
        version = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=30
        ).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError):
        version = []
    return f"{os.path.realpath(path)} {' '.join(version)}"


def build_key() -> str:
    """What makes two builds incompatible: torch (version, build, install location: each
    venv's torch has its own include paths), the Python ABI, the compiler, the CPU. Two
    venvs with the same torch version thus build into two directories instead of
    invalidating each other's build in one."""
    parts = (
        torch.__version__,
        str(torch.version.git_version),
        os.path.realpath(os.path.dirname(torch.__file__)),
        str(sysconfig.get_config_var("SOABI") or sys.implementation.cache_tag),
        _compiler(),
        _cpu_info(),
    )
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _build_dir(key: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(base) / "rocm-mla" / "cpu-decode" / f"torch-{torch.__version__}-{key}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _wait_bound() -> float:
    text = os.environ.get(WAIT_ENV)
    if text is None:
        return BUILD_WAIT_S
    try:
        bound = float(text)
    except ValueError:
        bound = -1.0
    if not bound >= 0:
        raise ValueError(f"{WAIT_ENV} must be a number of seconds >= 0, got {text!r}")
    return bound


def _say(text: str) -> None:
    print(f"rocm-mla: {text}", file=sys.stderr, flush=True)


def _locked(build_dir: Path, build):
    """Run ``build`` holding an exclusive ``flock`` on the build directory: the OS releases
    it when its holder dies, however it dies. Holding it, no live process builds here, so a
    ``lock`` baton that cpp_extension left behind (a build killed mid-compile; its next
    ``load`` would wait on it forever) is removed first."""
    bound = _wait_bound()
    with open(build_dir / "rocm-mla-build.lock", "a+") as lock:
        start, told = time.monotonic(), False
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - start
                if waited >= bound:
                    raise CpuKernelBuildTimeout(
                        f"another process held the CPU decode kernel's build lock in "
                        f"{build_dir} for over {bound:g} s ({WAIT_ENV})"
                    ) from None
                if not told and waited >= WAIT_NOTICE_S and (build_dir / _BUILDING).exists():
                    _say(
                        f"waiting for another process's build of the CPU decode kernel in "
                        f"{build_dir} (at most {bound:g} s, {WAIT_ENV})"
                    )
                    told = True
                time.sleep(0.05)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            (build_dir / _BUILDING).unlink(missing_ok=True)
            return build()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@lru_cache(maxsize=1)
def _load() -> tuple[object | None, str | None]:
    """(module, None) or (None, why it cannot be built). Built once per process; a failure
    warns once, and CPU calls then run the torch path."""
    try:
        from torch.utils import cpp_extension

        key = build_key()
        build_dir = _build_dir(key)
        name = f"rocm_mla_cpu_decode_{key}"
        # No -std: torch's own flags name the standard its headers need (C++17 up to torch
        # 2.13, C++20 from 2.14, whose headers fail to compile under an explicit c++17).
        flags = ["-O3", "-march=native"]
        openmp = torch.backends.openmp.is_available()
        if openmp:
            flags.append("-fopenmp")

        def build():
            built = [p.stat().st_mtime for p in build_dir.glob(f"{name}*.so")]
            fresh = bool(built) and max(built) >= _SOURCE.stat().st_mtime
            start = time.monotonic()
            if not fresh:
                (build_dir / _BUILDING).write_text(f"{os.getpid()}\n")
                _say(f"building the CPU decode kernel (first use, about a minute) in {build_dir}")
            try:
                module = cpp_extension.load(
                    name=name,
                    sources=[str(_SOURCE)],
                    extra_cflags=flags,
                    extra_ldflags=["-fopenmp"] if openmp else [],
                    build_directory=str(build_dir),
                    verbose=False,
                )
            finally:
                (build_dir / _BUILDING).unlink(missing_ok=True)
            took = time.monotonic() - start
            if not fresh or took > 5:
                _say(f"built the CPU decode kernel in {took:.1f} s")
            return module

        module = _locked(build_dir, build)
    except Exception as error:  # a missing compiler or ninja, a build error, the wait bound
        lines = str(error).splitlines() or [""]
        # A build error's text starts with the compile command: its first error says why.
        detail = next((line for line in lines if "error:" in line), lines[0])
        text = " ".join(detail.split())
        reason = f"the CPU decode kernel did not build: {type(error).__name__}: {text[:300]}"
        warnings.warn(f"{reason}; CPU decodes run the torch path", RuntimeWarning, stacklevel=2)
        return None, reason
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
    _chunk_keys: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, S_q, H, head_dim_v] in q's dtype and lse [B, S_q, H] float32.

    ``kv_cache`` is ``[num_blocks, block_size, D]`` (q is ``[B, S_q, H, D]``);
    ``max_seqlen`` is a plan's bound on the lengths (longer rows are NaN and fault);
    ``fault_flag`` an int32 ``[1]`` CPU tensor. ``_chunk_keys`` (tests and benchmarks):
    keys per chunk instead of the rule above (rounded up to 8), 0 to cut no row.
    """
    out, lse, _ = decode_with_chunk(
        q,
        kv_cache,
        block_table,
        cache_seqlens,
        head_dim_v=head_dim_v,
        softmax_scale=softmax_scale,
        causal=causal,
        kv_scale=kv_scale,
        max_seqlen=max_seqlen,
        fault_flag=fault_flag,
        chunk_keys=_chunk_keys,
    )
    return out, lse


def decode_with_chunk(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    head_dim_v: int,
    softmax_scale: float,
    causal: bool,
    kv_scale: float | None,
    max_seqlen: int | None,
    fault_flag: torch.Tensor | None,
    chunk_keys: int | None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``decode``, and the keys per chunk it used (0 when rows were not to be cut)."""
    _check(q, kv_cache, block_table, cache_seqlens, head_dim_v, fault_flag)
    if chunk_keys is not None and (not isinstance(chunk_keys, int) or chunk_keys < 0):
        raise ValueError(f"cpu_decode: _chunk_keys must be None or an int >= 0, got {chunk_keys}")
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
    chunk = module.decode(
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
        -1 if chunk_keys is None else chunk_keys,
        MIN_CHUNK_KEYS,
        TASKS_PER_THREAD,
    )
    return (out if q.dtype == torch.float32 else out.to(q.dtype)), lse, chunk


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
