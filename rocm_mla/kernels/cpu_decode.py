"""The fused paged MLA decode for the CPU (C++, built on first use).

One pass over each request's keys through its block table: every KV row (576 wide for MLA) is
converted to fp32 once per task and used by all of the task's heads, scores and then the
weighted V sum, with an online softmax in fp32. No gathered copy of the cache exists.

Tasks are (request, head group, key chunk), run on torch's threads: each thread pulls the
next task, largest first, until none is left. A task scores every key it loads against all
query rows of the request's window (a verify window, a DCP window with per-row bounds, or a
window of its own length among packed ones), each row masked by its own KV bound: the keys
are read once per request, not once per row. Heads are grouped only when there are fewer
requests than threads (``_head_group``). Keys are cut so that every task reads about the same
number: the chunk is the batch's total work (keys read, the furthest row's bound of each
window, summed over windows and head groups) over ``threads * TASKS_PER_THREAD``, at least
``MIN_CHUNK_KEYS``, rounded up to the kernel's 8-key step (rows that fault on their bound
count as no work and are not cut). A window that reads no more keys than that is one task
and writes its out and lse directly; a longer one is cut at multiples of the chunk from key
0, each chunk keeps its own max, denominator and unnormalized V sum per row and head (a row
whose bound ends before the chunk has none there), and after the parallel loop the chunks
are merged exactly as the online softmax would have continued (sums rescaled to the largest
max, then divided by the denominator). So one 32K-key request among 1K-key ones no longer
runs on one thread while the others idle. The result depends on the cut only by fp32
rounding; for a given thread count it is deterministic.

Semantics are those of the torch backend: causal verify windows (row i of a window of ``q``
rows sees ``L - q + 1 + i`` keys), or each row's own bound (``row_seqlens``, which replaces
causality), packed windows of different lengths (``query_start_loc``), out in q's dtype, lse
float32 natural log, rows without keys 0 / -inf. A row is one (query position, head): a
non-finite element of its query, or an overflowing score, makes that row NaN (out and lse),
a non-finite visible cache element every head of the positions that see it (a key past a
row's bound never touches that row). Bounds: a row whose given bound lies outside
``[0, L]``, or that may see a key whose block-table column is at or past ``max_blocks``, or
whose block id lies outside ``[0, num_blocks)``, or (with ``max_seqlen``, a plan's bound) a
length above it, is NaN and the cause is ORed into ``fault_flag`` (``FAULT_*`` of
``rocm_mla.inputs``); such keys are never read. Window starts are clamped into q's rows (the
host checks them unless a plan vouches for them), and a row no window covers is NaN. A cut
window follows the same rules: every chunk checks the bounds of all its rows before reading
(so a faulting row reads nothing), and a head one chunk poisoned is NaN in the merged row.

ISA: the kernel is built with ``-march=native`` (``$ROCM_MLA_CPU_MARCH`` names another
target, e.g. ``x86-64-v3`` for AVX2 or ``x86-64-v4`` for AVX-512; each march builds into its
own directory). The source picks its vector width and register blocking from what that
target enables (``isa()`` reports it): 16 floats on AVX-512, 8 on AVX2, 4 on SSE and NEON.
A march whose code this CPU cannot run is refused before it is loaded (``unrunnable``);
``compile_check`` compiles the source for any march without loading it.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import time
import warnings
from functools import cache, lru_cache
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
#: The ``-march`` the kernel is built for when set; else ``native`` (this CPU's own ISA).
MARCH_ENV = "ROCM_MLA_CPU_MARCH"
NATIVE = "native"

#: The compiler's feature macros a march can define, and the CPU flag (``/proc/cpuinfo``)
#: each needs: what ``unrunnable`` checks. Features outside this table are not checked.
_FEATURE_FLAGS = {
    "__SSE3__": "pni",
    "__SSSE3__": "ssse3",
    "__SSE4_1__": "sse4_1",
    "__SSE4_2__": "sse4_2",
    "__POPCNT__": "popcnt",
    "__AVX__": "avx",
    "__AVX2__": "avx2",
    "__FMA__": "fma",
    "__F16C__": "f16c",
    "__BMI__": "bmi1",
    "__BMI2__": "bmi2",
    "__LZCNT__": "abm",
    "__MOVBE__": "movbe",
    "__AVX512F__": "avx512f",
    "__AVX512BW__": "avx512bw",
    "__AVX512CD__": "avx512cd",
    "__AVX512DQ__": "avx512dq",
    "__AVX512VL__": "avx512vl",
    "__AVX512VNNI__": "avx512_vnni",
    "__AVX512BF16__": "avx512_bf16",
    "__AVX512FP16__": "avx512_fp16",
    "__AVXVNNI__": "avx_vnni",
    "__AMX_TILE__": "amx_tile",
    "__AMX_BF16__": "amx_bf16",
    "__ARM_FEATURE_SVE": "sve",
    "__ARM_FEATURE_SVE2": "sve2",
    "__ARM_FEATURE_DOTPROD": "asimddp",
    "__ARM_FEATURE_BF16_VECTOR_ARITHMETIC": "bf16",
    "__ARM_FEATURE_FP16_VECTOR_ARITHMETIC": "asimdhp",
}


class CpuKernelBuildTimeout(TimeoutError):
    """Another process held the CPU kernel's build lock for longer than the wait bound."""


def _cpu_info() -> str:
    """The CPU model and flags: what a ``-march=native`` build depends on."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = platform.processor()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    return "\n".join(lines)


def cpu_model() -> str:
    """This CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    for line in _cpu_info().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _cpu_flags() -> set[str] | None:
    """This CPU's feature flags (x86 ``flags``, Arm ``Features``); None where unreadable."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in info.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return None


def march() -> str:
    """The ``-march`` CPU decodes build for: ``$ROCM_MLA_CPU_MARCH``, else ``native``."""
    text = os.environ.get(MARCH_ENV)
    if text is None:
        return NATIVE
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", text):
        raise ValueError(
            f"{MARCH_ENV} must be a -march value such as native, x86-64-v3 (AVX2) or "
            f"x86-64-v4 (AVX-512), got {text!r}; unset it to build for this CPU"
        )
    return text


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


def build_key(target: str = NATIVE) -> str:
    """What makes two builds incompatible: torch (version, build, install location: each
    venv's torch has its own include paths), the Python ABI, the compiler, the ``-march``
    (``target``) and, for ``native``, the CPU. Two venvs with the same torch version thus
    build into two directories instead of invalidating each other's build in one, and so do
    two marches."""
    parts = (
        torch.__version__,
        str(torch.version.git_version),
        os.path.realpath(os.path.dirname(torch.__file__)),
        str(sysconfig.get_config_var("SOABI") or sys.implementation.cache_tag),
        _compiler(),
        f"-march={target}",
        _cpu_info() if target == NATIVE else "",
    )
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _flags(target: str) -> list[str]:
    """The compile flags of a build for ``-march=target``."""
    # No -std: cpp_extension names the standard torch's headers need (C++20 in torch 2.13;
    # torch 2.14's headers fail to compile under an explicit c++17).
    flags = ["-O3", f"-march={target}"]
    if torch.backends.openmp.is_available():
        flags.append("-fopenmp")
    return flags


def _first_error(text: str) -> str:
    """A compiler's first ``error:`` line (its output opens with the command), on one line."""
    lines = text.splitlines() or [""]
    detail = next((line for line in lines if "error:" in line), lines[0])
    return " ".join(detail.split())


@cache
def unrunnable(target: str) -> str | None:
    """Why this CPU cannot run code built for ``-march=target`` (the features the compiler
    enables for it, ``_FEATURE_FLAGS``, that ``/proc/cpuinfo`` lacks), else None. ``native``
    always runs; where the CPU's flags cannot be read nothing is refused."""
    if target == NATIVE:
        return None
    compiler = os.environ.get("CXX", "c++")
    try:
        done = subprocess.run(
            [compiler, f"-march={target}", "-dM", "-E", "-x", "c++", os.devnull],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError) as error:
        return f"{compiler} did not run to list -march={target}'s features: {error}"
    if done.returncode != 0:
        return f"{compiler} refused -march={target}: {_first_error(done.stderr)}"
    flags = _cpu_flags()
    if flags is None:
        return None
    defined = {line.split()[1] for line in done.stdout.splitlines() if line.startswith("#define ")}
    missing = [f for macro, f in _FEATURE_FLAGS.items() if macro in defined and f not in flags]
    if not missing:
        return None
    return (
        f"this CPU ({cpu_model()}) cannot run -march={target} code: it lacks {', '.join(missing)}"
    )


def compile_check(target: str, directory: Path) -> Path:
    """Compile the kernel's source for ``-march=target`` into an object in ``directory``,
    with the build's flags, without linking or loading it: how a march this CPU cannot run
    is still checked. Returns the object's path; a compile error raises ``RuntimeError``
    naming the compiler's first error."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    includes = [*cpp_extension.include_paths("cpu"), sysconfig.get_path("include")]
    obj = Path(directory) / f"cpu_decode-{target}.o"
    command = [
        compiler,
        *(f"-isystem{path}" for path in includes),
        "-DTORCH_EXTENSION_NAME=rocm_mla_cpu_decode_check",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        "-fPIC",
        "-std=c++20",  # what cpp_extension passes in torch 2.13
        *_flags(target),
        "-c",
        str(_SOURCE),
        "-o",
        str(obj),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(
            f"the CPU decode kernel did not compile for -march={target}: "
            f"{_first_error(done.stderr)}"
        )
    return obj


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


@cache
def _load(target: str) -> tuple[object | None, str | None]:
    """(module, None) or (None, why it cannot be built or run here) for ``-march=target``.
    Built once per process and march; a failure warns once, and CPU calls then run the
    torch path."""
    why = unrunnable(target)
    if why is not None:
        reason = f"the CPU decode kernel is not loaded: {why}"
        warnings.warn(f"{reason}; CPU decodes run the torch path", RuntimeWarning, stacklevel=2)
        return None, reason
    try:
        from torch.utils import cpp_extension

        key = build_key(target)
        build_dir = _build_dir(key)
        name = f"rocm_mla_cpu_decode_{key}"
        flags = _flags(target)
        openmp = torch.backends.openmp.is_available()

        def build():
            built = [p.stat().st_mtime for p in build_dir.glob(f"{name}*.so")]
            fresh = bool(built) and max(built) >= _SOURCE.stat().st_mtime
            start = time.monotonic()
            if not fresh:
                (build_dir / _BUILDING).write_text(f"{os.getpid()}\n")
                _say(
                    f"building the CPU decode kernel for -march={target} (first use, about a "
                    f"minute) in {build_dir}"
                )
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
        text = _first_error(str(error))
        reason = f"the CPU decode kernel did not build: {type(error).__name__}: {text[:300]}"
        warnings.warn(f"{reason}; CPU decodes run the torch path", RuntimeWarning, stacklevel=2)
        return None, reason
    return module, None


def available() -> str | None:
    """None when the kernel for ``march()`` is built (building it on first call), else the
    reason it is not."""
    return _load(march())[1]


def isa() -> str:
    """What the loaded kernel (``march()``) was compiled for: its ISA and vector width, e.g.
    ``avx2 (8 floats, 16 registers)``; raises ``RuntimeError`` when it is not built."""
    module, why = _load(march())
    if module is None:
        raise RuntimeError(why)
    return module.isa()


@lru_cache(maxsize=4)
def _fp8_table(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).to(torch.float32)


def _head_group(requests: int, num_heads: int) -> int:
    """Heads per task: all of them unless too few requests exist to keep every thread busy;
    each extra group re-reads the keys, so split no further than that."""
    threads = torch.get_num_threads()
    if requests >= threads:
        return num_heads
    splits = min(num_heads, -(-threads // requests))
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
    row_seqlens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    max_q_len: int | None = None,
    _chunk_keys: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, S_q, H, head_dim_v] in q's dtype and lse [B, S_q, H] float32; with packed
    windows out [T, H, head_dim_v] and lse [T, H].

    ``kv_cache`` is ``[num_blocks, block_size, D]`` (q is ``[B, S_q, H, D]``, or ``[T, H, D]``
    with ``query_start_loc [B + 1]`` int32 and ``max_q_len`` its longest window);
    ``row_seqlens`` int32 ``[B, S_q]`` (``[T]`` packed) each row's KV bound; ``max_seqlen`` is
    a plan's bound on the lengths (longer rows are NaN and fault); ``fault_flag`` an int32
    ``[1]`` CPU tensor. ``_chunk_keys`` (tests and benchmarks): keys per chunk instead of the
    rule above (rounded up to 8), 0 to cut no window. The values (starts, bounds in
    ``[0, L]``) are the caller's to check: ``rocm_mla.mla_decode`` does before any work.
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
        row_seqlens=row_seqlens,
        query_start_loc=query_start_loc,
        max_q_len=max_q_len,
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
    row_seqlens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    max_q_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``decode``, and the keys per chunk it used (0 when windows were not to be cut)."""
    _check(q, kv_cache, block_table, cache_seqlens, head_dim_v, fault_flag)
    q_len = _check_windows(q, block_table.shape[0], row_seqlens, query_start_loc, max_q_len)
    if chunk_keys is not None and (not isinstance(chunk_keys, int) or chunk_keys < 0):
        raise ValueError(f"cpu_decode: _chunk_keys must be None or an int >= 0, got {chunk_keys}")
    module, why = _load(march())
    if module is None:
        raise RuntimeError(why)
    batch, num_heads, head_dim = block_table.shape[0], q.shape[-2], q.shape[-1]
    k_scale = 1.0 if kv_scale is None else float(kv_scale)
    kv, table = kv_cache, None
    if kv_cache.dtype in FP8_DTYPES:
        kv, table = kv_cache.view(torch.uint8), _fp8_table(kv_cache.dtype)
    if kv.stride(2) != 1:
        kv = kv.contiguous()
    # q is scaled in fp32 as the reference does (q.float() * scale), so that a score that
    # overflows is inf.
    out, lse, chunk = module.decode(
        q.reshape(-1, num_heads, head_dim).contiguous(),
        kv,
        block_table.contiguous(),
        cache_seqlens.contiguous(),
        fault_flag,
        table,
        None if query_start_loc is None else query_start_loc.contiguous(),
        None if row_seqlens is None else row_seqlens.reshape(-1).contiguous(),
        q_len,
        head_dim_v,
        softmax_scale * k_scale,
        -1 if max_seqlen is None else int(max_seqlen),
        _head_group(batch, num_heads),
        bool(causal),
        k_scale,
        -1 if chunk_keys is None else chunk_keys,
        MIN_CHUNK_KEYS,
        TASKS_PER_THREAD,
    )
    if query_start_loc is None:
        out = out.view(batch, q_len, num_heads, head_dim_v)
        lse = lse.view(batch, q_len, num_heads)
    return (out if q.dtype == torch.float32 else out.to(q.dtype)), lse, chunk


def _check(q, kv_cache, block_table, cache_seqlens, head_dim_v, fault_flag) -> None:
    def fail(name: str, expected: str, got: object) -> None:
        raise ValueError(f"cpu_decode: {name} must be {expected}, got {got}")

    for name, t in (("q", q), ("kv_cache", kv_cache), ("block_table", block_table)):
        if t.device.type != "cpu":
            fail(name, "on the CPU", t.device)
    if q.dim() not in (3, 4):
        fail("q", "[B, S_q, H, D], or [T, H, D] packed", list(q.shape))
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        fail("q", "float32, float16 or bfloat16", q.dtype)
    if kv_cache.dim() != 3 or kv_cache.shape[2] != q.shape[-1]:
        fail("kv_cache", f"[num_blocks, block_size, {q.shape[-1]}]", list(kv_cache.shape))
    if kv_cache.dtype not in (torch.float32, torch.float16, torch.bfloat16, *FP8_DTYPES):
        fail("kv_cache", "float32, float16, bfloat16 or fp8 e4m3", kv_cache.dtype)
    if block_table.dim() != 2 or (q.dim() == 4 and block_table.shape[0] != q.shape[0]):
        fail("block_table", "[B, max_blocks] (B: q's batch)", list(block_table.shape))
    if block_table.dtype != torch.int32:
        fail("block_table", "int32", block_table.dtype)
    batch = block_table.shape[0]
    if cache_seqlens.shape != (batch,) or cache_seqlens.dtype != torch.int32:
        got = f"{cache_seqlens.dtype} {list(cache_seqlens.shape)}"
        fail("cache_seqlens", f"int32 [{batch}]", got)
    if not 0 < head_dim_v <= q.shape[-1]:
        fail("head_dim_v", f"in [1, {q.shape[-1]}]", head_dim_v)
    if fault_flag is not None:
        flag = fault_flag
        if flag.dtype != torch.int32 or flag.shape != (1,) or flag.device.type != "cpu":
            got = f"{flag.dtype} {list(flag.shape)} on {flag.device}"
            fail("fault_flag", "an int32 [1] CPU tensor", got)


def _check_windows(q, batch, row_seqlens, query_start_loc, max_q_len) -> int:
    """The shapes of the windows and bounds (their values are the caller's); returns the
    longest window."""

    def fail(name: str, expected: str, got: object) -> None:
        raise ValueError(f"cpu_decode: {name} must be {expected}, got {got}")

    if query_start_loc is None:
        if q.dim() != 4:
            fail("q", "[B, S_q, H, D] without query_start_loc", list(q.shape))
        if max_q_len is not None:
            fail("max_q_len", "None without query_start_loc", max_q_len)
        q_len = q.shape[1]
    else:
        if q.dim() != 3:
            fail("q", "[T, H, D] with query_start_loc", list(q.shape))
        qsl = query_start_loc
        if qsl.dtype != torch.int32 or qsl.shape != (batch + 1,) or qsl.device.type != "cpu":
            fail(
                "query_start_loc",
                f"an int32 [{batch + 1}] CPU tensor",
                f"{qsl.dtype} {list(qsl.shape)}",
            )
        if isinstance(max_q_len, bool) or not isinstance(max_q_len, int) or max_q_len < 1:
            fail("max_q_len", "the longest window, an int >= 1, with query_start_loc", max_q_len)
        q_len = max_q_len
    tokens = q.shape[0] * (q.shape[1] if q.dim() == 4 else 1)
    if row_seqlens is not None:
        rows = row_seqlens
        if rows.dtype != torch.int32 or rows.numel() != tokens or rows.device.type != "cpu":
            got = f"{rows.dtype} {list(rows.shape)} on {rows.device}"
            fail("row_seqlens", f"an int32 CPU tensor of {tokens} rows ([B, S_q] or [T])", got)
    return q_len
