"""Stage-1 occupancy: how many programs one compute unit holds (``programs_per_cu``).

The only module that touches Triton's compiler internals (``triton.compiler``,
``triton.backends``, ``triton.runtime``): on sm90, gfx942 and gfx950 it compiles stage 1 for
the target, as ``mla_decode`` would launch it, and reads the registers and shared memory
through ``residency``; other targets get an estimate from the config's footprint, and so do
those three where the installed Triton's internals are not the ones this compile calls (said
once on stderr). A config that the compiler rejects raises ``Stage1CompileError``: the
planner (``plan.plan_launch``) then takes another.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
import triton

from rocm_mla.kernels.mla_decode_args import (
    _FP8_MAX,
    _dot_types,
    group_config,
    partial_buffers,
    stage1_arguments,
    target_key,
)
from rocm_mla.kernels.mla_decode_kernel import _mla_decode_stage1
from rocm_mla.kernels.residency import RESIDENCY_TARGETS, resident_programs
from rocm_mla.kernels.target import TritonTarget, say_once
from rocm_mla.kernels.tuned_configs import LaunchConfig
from rocm_mla.platform import triton_interpreting

__all__ = ["Stage1CompileError", "programs_per_cu"]


#: Per compute unit of a target with no residency model: (shared memory bytes, register file
#: bytes, resident warps), an A100-like floor.
_FALLBACK_CU = (164 << 10, 256 << 10, 64)


class Stage1CompileError(RuntimeError):
    """The installed Triton cannot compile stage 1 with a config for a target: its message
    names the compiler's error and the file holding the compiler's whole output."""


def programs_per_cu(
    config: LaunchConfig,
    target: TritonTarget | None,
    *,
    kv_dtype: torch.dtype,
    head_dim: int = 576,
    head_dim_v: int = 512,
    num_heads: int | None = None,
    q_len: int = 1,
    q_dtype: torch.dtype = torch.bfloat16,
    page_size: int = 64,
    cache_bytes: int = 0,
) -> int:
    """Stage-1 programs one compute unit holds at once: the compiled kernel's occupancy.

    On sm90, gfx942 and gfx950 (``residency.RESIDENCY_TARGETS``) the config's stage 1 is
    compiled once for ``target`` with the arguments ``mla_decode`` would pass for this shape
    (a GPU is not needed: Triton compiles for a target it does not run on) and its
    registers, shared memory / LDS and warps give the count (``residency``); cached per
    (target, config, shape). ``num_heads`` defaults to ``config.block_h`` (one row group);
    ``page_size`` and ``cache_bytes`` (the KV cache's size: HIP uses buffer loads only below
    2 GiB) only refine the specialization. The interpreter runs one program at a time: 1. Other
    targets get an estimate from the config's footprint (``_estimated_programs_per_cu``).

    Raises ``Stage1CompileError`` when the compiler rejects ``config`` for ``target`` (cached
    like a success: a config is compiled once per shape either way). Where the installed
    Triton lacks what the compile calls (3.4 has no ``JITFunction._pack_args``), the estimate
    stands in for the compiled count and stderr says so once.
    """
    if target is None or target.backend == "interpreter":
        return 1
    key = target_key(target)
    if key not in RESIDENCY_TARGETS:
        return _estimated_programs_per_cu(
            config, target, kv_dtype=kv_dtype, head_dim=head_dim, head_dim_v=head_dim_v
        )
    built = _compiled_stage1_resources(
        config,
        target.backend,
        target.arch,
        kv_dtype=kv_dtype,
        q_dtype=q_dtype,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        num_heads=config.block_h if num_heads is None else num_heads,
        q_len=q_len,
        page_size=page_size,
        large_cache=cache_bytes >= 1 << 31,
    )
    if "internals_differ" in built:
        say_once(
            "internals_differ",
            f"rocm_mla: Triton {triton.__version__} lacks what the planner's residency compile "
            f"calls ({built['internals_differ']}); stage-1 slots come from the estimated "
            "residency instead (the schedule may fill fewer or more slots than the GPU holds)",
        )
        return _estimated_programs_per_cu(
            config, target, kv_dtype=kv_dtype, head_dim=head_dim, head_dim_v=head_dim_v
        )
    if "compile_error" in built:
        raise Stage1CompileError(
            f"Triton {triton.__version__} cannot compile stage 1 for {target}: "
            f"{built['compile_error']}"
        )
    return max(1, resident_programs(key, num_warps=config.num_warps, **built))


@functools.lru_cache(maxsize=256)
def _compiled_stage1_resources(config: LaunchConfig, backend: str, arch: str, **shape) -> dict:
    """Compile stage 1 for (backend, arch) as ``mla_decode`` would launch it and read its
    registers and shared memory (``residency.resident_programs`` keywords), or say why not:
    ``{"compile_error": ...}`` (the compiler rejected it) or ``{"internals_differ": ...}``
    (this Triton lacks what the compile calls).

    Under ``TRITON_INTERPRET=1`` the ``@triton.jit`` functions of this process are
    interpreter objects that cannot be compiled, so a child process without it compiles.
    """
    if not triton_interpreting():
        return _compile_stage1_resources(config, backend, arch, **shape)
    request = {
        "config": config.to_dict(),
        "backend": backend,
        "arch": arch,
        **{
            k: str(v).removeprefix("torch.") if k.endswith("dtype") else v for k, v in shape.items()
        },
    }
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_CHILD, json.dumps(request)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"programs_per_cu: compiling stage 1 for {backend} {arch} failed: {done.stderr[-2000:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


_COMPILE_CHILD = """
import json, sys
import torch
from rocm_mla.kernels import occupancy as occ
request = json.loads(sys.argv[1])
config = occ.LaunchConfig.from_dict(request.pop("config"))
backend, arch = request.pop("backend"), request.pop("arch")
for key in ("kv_dtype", "q_dtype"):
    request[key] = getattr(torch, request[key])
print(json.dumps(occ._compile_stage1_resources(config, backend, arch, **request)))
"""


def _compile_stage1_resources(
    config: LaunchConfig,
    backend: str,
    arch: str,
    *,
    kv_dtype: torch.dtype,
    q_dtype: torch.dtype,
    head_dim: int,
    head_dim_v: int,
    num_heads: int,
    q_len: int,
    page_size: int,
    large_cache: bool,
) -> dict:
    here = TritonTarget(backend, arch, 1)
    config = group_config(config, q_len * num_heads)
    num_groups = triton.cdiv(q_len * num_heads, config.block_h)
    meta = {"device": "meta"}
    batch = 2  # more than one request and split: no argument specializes to 1
    pages = triton.cdiv((1 << 31) if large_cache else 1 << 20, page_size * head_dim) + 2
    dot_types = _dot_types(q_dtype, kv_dtype, here, config)
    # With fp8 Q K^T stage 1 reads q quantized (``stage1_q``).
    q = torch.empty(
        batch,
        q_len,
        num_heads,
        head_dim,
        dtype=kv_dtype if dot_types["QK_FP8"] else q_dtype,
        **meta,
    )
    q_scale = torch.empty(batch, q_len, num_heads, **meta) if dot_types["QK_FP8"] else None
    kv_cache = torch.empty(pages, page_size, head_dim, dtype=kv_dtype, **meta)
    block_table = torch.empty(batch, triton.cdiv(pages, batch), dtype=torch.int32, **meta)
    seqlens = torch.empty(batch, dtype=torch.int32, **meta)
    # A schedule's tables and buffers (their values are never read by the compiler).
    launch_order = torch.empty(2 * batch * num_groups, dtype=torch.int32, **meta)
    segments = torch.empty(2 * batch * num_groups, 4, dtype=torch.int32, **meta)
    out = torch.empty(batch, q_len, num_heads, head_dim_v, dtype=q_dtype, **meta)
    lse = torch.empty(batch, q_len, num_heads, dtype=torch.float32, **meta)
    part_out, part_lse = partial_buffers(2 * batch, config.block_h, head_dim_v, "meta")
    _, args, kwargs = stage1_arguments(
        q,
        q_scale,
        kv_cache,
        block_table,
        seqlens,
        launch_order,
        segments,
        out,
        lse,
        part_out,
        part_lse,
        None,
        head_dim_v=head_dim_v,
        softmax_scale=head_dim**-0.5,
        causal=True,
        kv_scale=None if kv_dtype not in _FP8_MAX else 1.0,
        num_groups=num_groups,
        config=config,
        target=here,
        dot_types=dot_types,
    )
    # Triton's own binder: the specialization (divisibility, constexpr 1s, HIP buffer ops)
    # is the one the runtime makes for these arguments. These are Triton's internals, not
    # its API: where a release lacks one (3.4 has no ``_pack_args``) or calls it otherwise,
    # the caller estimates instead.
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, make_backend
        from triton.runtime.jit import create_function_from_signature

        if backend == "cuda":
            gpu_target = GPUTarget("cuda", int(arch.removeprefix("sm")), 32)
        else:
            gpu_target = GPUTarget("hip", arch, 64)
        fn = _mla_decode_stage1
        compiler = make_backend(gpu_target)
        binder = create_function_from_signature(fn.signature, fn.params, compiler)
        kwargs = dict(kwargs, debug=False)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(
            compiler, kwargs, bound, specialization, options
        )
        source = ASTSource(fn, signature, constexprs, attrs)
    except (AttributeError, ImportError, TypeError) as exc:
        return {"internals_differ": f"{type(exc).__name__}: {exc}"}
    try:
        with _compiler_output() as output:
            kernel = triton.compile(source, target=gpu_target, options=options.__dict__)
    except Exception as exc:
        # Whatever the compiler raises (an MLIR pass failure is a bare RuntimeError, ptxas a
        # PTXASError, the front end a CompilationError), this config does not build here.
        launch = repr((signature, constexprs, attrs, options))
        return {"compile_error": _compile_failure(exc, output.text, launch)}
    sys.stderr.write(output.text)
    if backend == "cuda":
        return {
            "regs_per_thread": _cubin_registers(kernel.asm["cubin"]),
            "smem_bytes": int(kernel.metadata.shared),
        }
    text = kernel.asm["amdgcn"]

    def count(pattern: str) -> int:
        found = re.search(pattern, text)
        if found is None:
            raise RuntimeError(f"programs_per_cu: {pattern!r} not in the amdgcn of stage 1")
        return int(found.group(1))

    # The arch VGPRs and the AGPRs apart (".vgpr_count" is their unified total).
    return {
        "regs_per_thread": count(r"; NumVgprs: (\d+)"),
        "agprs_per_thread": count(r"; NumAgprs: (\d+)"),
        "sgprs_per_wave": count(r"\.sgpr_count:\s+(\d+)"),
        "smem_bytes": int(kernel.metadata.shared),
    }


class _Output:
    text = ""


#: One compile at a time swaps the process's stderr (threads planning at once).
_OUTPUT_LOCK = threading.Lock()


@contextlib.contextmanager
def _compiler_output() -> Iterator[_Output]:
    """What the compiler prints while compiling, held back (``.text`` once the block ends):
    file descriptor 2 and Python's stdout. A failing MLIR pass prints its whole module there
    as a reproducer (hundreds of lines) and ptxas's failure prints its PTX; the planner
    falls back in one line instead and keeps that output in a file."""
    output = _Output()
    with _OUTPUT_LOCK, tempfile.TemporaryFile() as sink:
        sys.stderr.flush()
        saved = os.dup(2)
        printed = io.StringIO()
        os.dup2(sink.fileno(), 2)
        try:
            with contextlib.redirect_stdout(printed):
                yield output
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            output.text = sink.read().decode(errors="replace") + printed.getvalue()


def _compile_failure(exc: Exception, output: str, launch: str) -> str:
    """One line for a failed compile: the exception's last line, and where the compiler's
    output went (a file, not the user's terminal). The file is named by the Triton release
    and the ``launch`` (its arguments and options), so a process that plans again rewrites
    it rather than adding one."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[-1] if lines else ''}".rstrip(": ")
    digest = hashlib.sha256(launch.encode()).hexdigest()[:12]
    log = Path(tempfile.gettempdir()) / f"rocm_mla-stage1-triton{triton.__version__}-{digest}.log"
    with tempfile.NamedTemporaryFile("w", dir=log.parent, delete=False) as part:
        part.write(f"{type(exc).__name__}: {exc}\n\n{output}")
    os.replace(part.name, log)
    return f"{text} (the compiler's output: {log})"


def _cubin_registers(cubin: bytes) -> int:
    """Registers per thread of the one kernel in ``cubin`` (the Triton wheel's cuobjdump)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run(
            [str(tool), "--dump-resource-usage", file.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    found = re.search(r"REG:(\d+)", usage)
    if found is None:
        raise RuntimeError(f"programs_per_cu: no register count in cuobjdump's output: {usage}")
    return int(found.group(1))


def _estimated_programs_per_cu(
    config: LaunchConfig,
    target: TritonTarget,
    *,
    kv_dtype: torch.dtype,
    head_dim: int,
    head_dim_v: int,
) -> int:
    """Programs per compute unit estimated from the config's footprint, for targets with no
    residency model (neither sm90 nor gfx942/gfx950) and for a Triton whose internals the
    residency compile cannot call.

    Shared memory: ``num_stages`` KV tiles (at least one: the dots read it from there).
    Registers: the fp32 accumulator, the Q tile and two ``[BLOCK_H, BLOCK_N]`` fp32 score
    tiles, plus the KV tile on AMD (MFMA operands come from VGPRs). Warps: the resident
    limit. It only has to rank split counts.
    """
    smem_cap, reg_cap, warp_cap = _FALLBACK_CU
    kv_bytes = kv_dtype.itemsize
    tile = config.block_n * head_dim * kv_bytes
    smem = max(config.num_stages, 1) * tile
    regs = config.block_h * (head_dim_v * 4 + head_dim * 2 + config.block_n * 8)
    if target.backend == "hip":
        regs += tile
    return max(1, min(smem_cap // smem, reg_cap // regs, warp_cap // config.num_warps))
