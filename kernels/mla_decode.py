"""Split-KV absorbed-MLA decode in Triton: one source for HIP, CUDA and the CPU interpreter.

Absorbed MLA is MQA over a latent cache: every query head scores the same ``D = Dv + rope``
wide row per token, and V is the first ``Dv`` columns of that row. The S_q query positions
of a request (a speculative-decoding verify window) also share those rows, so the kernel
folds them into the head axis: row ``r = i * H + h`` of a request is query position ``i``,
head ``h``, and a program serves ``BLOCK_H`` such rows at once (64 on Hopper, the M of one
wgmma), so each KV tile is loaded once for all of them.

Stage 1: one program per (request, row group, KV split). It walks its slice of the request's
keys in ``[BLOCK_N, D]`` tiles gathered through the block table. Each tile is loaded once
and serves both ``Q K^T`` (all ``D`` columns) and ``P V`` (its first ``Dv`` columns); with
``dv_chunks=2`` the V columns and the accumulator are two ``Dv/2`` halves, two smaller dots
that reuse one ``P``. The softmax is online, in fp32 and base 2; each split writes its
normalized fp32 output and its natural-log lse. With one split it writes the final output.

Stage 2: the exact LSE merge of the splits (``merge_states.launch_merge``).

fp8 caches carry one per-tensor dequant scale: it multiplies the softmax scale for ``Q K^T``
and the output for ``P V``, so tiles are never rescaled inside the loop. Where the hardware
has fp8 dots (sm89+, gfx942, gfx950) the tiles feed them as they are: Q is quantized per row
once per call before stage 1 (``quantize_q``; its scale joins that row's softmax scale) and
the softmax weights are quantized with a fixed power-of-two lift. Elsewhere the tiles are
upcast to Q's 16-bit type.

Non-finite input is never mistaken for "no key": a NaN or infinite score of a key a row may
see (NaN/Inf in q or in a visible cache element, an overflowing scale) makes that row's out
and lse NaN; rows with no visible key give out 0 and lse -inf. In a causal verify window
the keys from the window's first one (``L - S_q + 1``) on are seen by some rows and not
others, and ``0 x NaN`` would still reach the rows that give such a key weight 0. The walk
takes the keys every row sees with one limit for all rows, straight from the loaded tile to
the dots; the window's own keys (at most ``S_q - 1``) follow in small tail tiles whose P.V
leaves out the keys no row scores finitely (a non-finite V element makes every row's score
of its key non-finite), so the rows that do not see such a key never multiply it.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
import triton
import triton.language as tl

from rocm_mla.inputs import FAULT_BEYOND_TABLE, FAULT_BLOCK_ID
from rocm_mla.kernels.merge_states import launch_merge
from rocm_mla.kernels.quantize_q import quantize_q, to_fp8
from rocm_mla.kernels.residency import RESIDENCY_TARGETS, resident_programs
from rocm_mla.kernels.target import TritonTarget, triton_target
from rocm_mla.kernels.tuned_configs import LaunchConfig, TableEntry, lookup
from rocm_mla.platform import triton_interpreting

__all__ = [
    "LaunchConfig",
    "choose_num_kv_splits",
    "default_config",
    "mla_decode",
    "plan_launch",
    "plan_num_kv_splits",
    "programs_per_cu",
    "table_entry",
    "target_key",
]

#: Split-count heuristic (the shape of AITER's): programs should fill whole waves of compute
#: units, and every extra split costs about this many tokens of work (its prologue, the
#: partial it writes and stage 2 reading it back).
SPLIT_OVERHEAD_TOKENS = 84.0
#: Below this many keys per split the overhead dominates; never split finer. 128, not 256:
#: a DCP rank's 4K-16K share of a 32K context at B 8 then still fills 0.9 of a wave
#: (the cost model above already charges each split its overhead).
MIN_TOKENS_PER_SPLIT = 128
#: Upper bound on splits (stage 2 reads them all back per output row). Room for one 32K
#: request of 16 heads to fill two programs on each of MI300X's 304 CUs in 0.9 of a wave
#: (B8 x 32K needs 76 splits there); MIN_TOKENS_PER_SPLIT still bounds short requests.
MAX_SPLITS = 128

_FAULT_BLOCK_ID = tl.constexpr(FAULT_BLOCK_ID)
_FAULT_BEYOND_TABLE = tl.constexpr(FAULT_BEYOND_TABLE)
#: Block-table columns stage 1 checks per step of its bad-id scan.
_BLOCK_C = tl.constexpr(256)

#: Per compute unit of a target with no residency model: (shared memory bytes, register file
#: bytes, resident warps), an A100-like floor.
_FALLBACK_CU = (164 << 10, 256 << 10, 64)


def target_key(target: TritonTarget | None) -> str:
    """The ``tuned_configs.TABLES`` key of a target: sm90, gfx942, gfx950, fallback, interpreter."""
    if target is None or target.backend == "interpreter":
        return "interpreter"
    if target.backend == "cuda" and (target.arch or "").startswith("sm90"):
        return "sm90"
    if target.backend == "hip":
        # Other AMD archs take the MI300X shapes (see default_config); MI355X has its own.
        return "gfx950" if target.arch == "gfx950" else "gfx942"
    return "fallback"


def table_entry(
    target: TritonTarget | None,
    *,
    num_heads: int = 16,
    q_len: int = 1,
    kv_dtype: torch.dtype = torch.bfloat16,
) -> TableEntry:
    """The tuned-table entry (config and where it comes from) for a shape on ``target``."""
    entry = lookup(target_key(target), num_heads, q_len, kv_dtype)
    if target is not None and target.backend == "hip" and target.arch not in ("gfx942", "gfx950"):
        # No XCD remap or kpack outside the two archs they were written for.
        config = replace(entry.config, num_xcds=1, kpack=None)
        entry = TableEntry(config, f"{entry.source} (gfx942 entry, adapted for {target.arch})")
    return entry


def default_config(
    target: TritonTarget | None,
    *,
    num_heads: int = 16,
    q_len: int = 1,
    kv_dtype: torch.dtype = torch.bfloat16,
) -> LaunchConfig:
    """The tuned stage-1 config for a shape on ``target`` (``kernels/tuned_configs.py``)."""
    return table_entry(target, num_heads=num_heads, q_len=q_len, kv_dtype=kv_dtype).config


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
    """
    if target is None or target.backend == "interpreter":
        return 1
    key = target_key(target)
    if key not in RESIDENCY_TARGETS:
        return _estimated_programs_per_cu(
            config, target, kv_dtype=kv_dtype, head_dim=head_dim, head_dim_v=head_dim_v
        )
    resources = _compiled_stage1_resources(
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
    return max(1, resident_programs(key, num_warps=config.num_warps, **resources))


@functools.lru_cache(maxsize=256)
def _compiled_stage1_resources(config: LaunchConfig, backend: str, arch: str, **shape) -> dict:
    """Compile stage 1 for (backend, arch) as ``mla_decode`` would launch it and read its
    registers and shared memory (``residency.resident_programs`` keywords).

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
from rocm_mla.kernels import mla_decode as md
request = json.loads(sys.argv[1])
config = md.LaunchConfig.from_dict(request.pop("config"))
backend, arch = request.pop("backend"), request.pop("arch")
for key in ("kv_dtype", "q_dtype"):
    request[key] = getattr(torch, request[key])
print(json.dumps(md._compile_stage1_resources(config, backend, arch, **request)))
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
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    here = TritonTarget(backend, arch, 1)
    config = _group_config(config, q_len * num_heads)
    num_groups = triton.cdiv(q_len * num_heads, config.block_h)
    meta = {"device": "meta"}
    batch = 2  # more than one request and split: no argument specializes to 1
    pages = triton.cdiv((1 << 31) if large_cache else 1 << 20, page_size * head_dim) + 2
    dot_types = _dot_types(q_dtype, kv_dtype, here, config)
    # With fp8 Q K^T stage 1 reads q quantized (``_stage1_q``).
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
    part_out, part_lse, rows_padded = _partials(
        2, batch, q_len, num_heads, head_dim_v, num_groups * config.block_h, "meta"
    )
    _, args, kwargs = _stage1_arguments(
        q,
        q_scale,
        kv_cache,
        block_table,
        seqlens,
        part_out,
        part_lse,
        None,
        head_dim_v=head_dim_v,
        softmax_scale=head_dim**-0.5,
        causal=True,
        kv_scale=None if kv_dtype not in _FP8_MAX else 1.0,
        num_groups=num_groups,
        num_kv_splits=2,
        config=config,
        target=here,
        dot_types=dot_types,
        rows_padded=rows_padded,
    )
    if backend == "cuda":
        gpu_target = GPUTarget("cuda", int(arch.removeprefix("sm")), 32)
    else:
        gpu_target = GPUTarget("hip", arch, 64)
    # Triton's own binder: the specialization (divisibility, constexpr 1s, HIP buffer ops)
    # is the one the runtime makes for these arguments.
    fn = _mla_decode_stage1
    compiler = make_backend(gpu_target)
    binder = create_function_from_signature(fn.signature, fn.params, compiler)
    kwargs = dict(kwargs, debug=False)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        compiler, kwargs, bound, specialization, options
    )
    kernel = triton.compile(
        ASTSource(fn, signature, constexprs, attrs), target=gpu_target, options=options.__dict__
    )
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
    residency model (neither sm90 nor gfx942/gfx950).

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


def choose_num_kv_splits(
    batch: int, num_groups: int, mean_len: float, max_len: int, num_cus: int
) -> int:
    """Splits per request that best trade compute-unit fill against per-split overhead.

    Score of ``s`` splits = fill x efficiency, where fill = programs / (programs rounded up
    to whole waves of ``num_cus`` slots) with programs = ``batch * num_groups * s``, and
    efficiency = ``mean_len / (mean_len + SPLIT_OVERHEAD_TOKENS * s)``. Candidates run from 1
    to ``MAX_SPLITS`` while the longest request keeps ``MIN_TOKENS_PER_SPLIT`` keys per split;
    ties go to fewer splits. ``num_cus`` is the number of programs that run at once: compute
    units x ``programs_per_cu`` in ``plan_launch``.
    """
    if mean_len <= 0 or max_len <= 0:
        return 1
    best, best_score = 1, -1.0
    for splits in range(1, MAX_SPLITS + 1):
        if splits > 1 and -(-max_len // splits) < MIN_TOKENS_PER_SPLIT:
            break
        programs = batch * num_groups * splits
        fill = programs / (-(-programs // num_cus) * num_cus)
        score = fill * mean_len / (mean_len + SPLIT_OVERHEAD_TOKENS * splits)
        if score > best_score:
            best, best_score = splits, score
    return best


@triton.jit
def _remap_for_xcds(pid, num_programs, NUM_XCDS: tl.constexpr):
    """Renumber program ids so that consecutive new ids run on the same XCD.

    The hardware hands workgroup ``pid`` to XCD ``pid % NUM_XCDS``. Inverting that, XCD ``x``
    receives the contiguous new-id range ``[x * per_xcd, ...)`` (the first ``tall`` XCDs get
    ``per_xcd`` programs, the rest one fewer), so programs that read the same KV tiles (the
    row groups of one request and split, numbered consecutively) share one L2.
    """
    if NUM_XCDS == 1:
        new_pid = pid
    else:
        per_xcd = (num_programs + NUM_XCDS - 1) // NUM_XCDS
        tall = num_programs - (per_xcd - 1) * NUM_XCDS
        xcd = pid % NUM_XCDS
        local = pid // NUM_XCDS
        new_pid = tl.where(
            xcd < tall,
            xcd * per_xcd + local,
            tall * per_xcd + (xcd - tall) * (per_xcd - 1) + local,
        )
    return new_pid


@triton.jit
def _fold_scores(
    scores,
    scores_rope,
    pos,
    lo,
    row_scale,
    visible,
    running_max,
    denom,
    ROWS_DIFFER: tl.constexpr,
    ROW_SCALES: tl.constexpr,
    V_DTYPE: tl.constexpr,
    PV_FP8: tl.constexpr,
    FP8_DTYPE: tl.constexpr,
    FP8_EMULATE_MIN_EXP: tl.constexpr,
    P_SCALE: tl.constexpr,
):
    """The online-softmax step of one tile's scores: ``(running_max, denom, rescale, p,
    finite_key)``.

    Keys at or past ``visible`` are not seen (one limit per row with ``ROWS_DIFFER``, and
    none below ``lo``; else one for all). ``ROW_SCALES``: ``row_scale`` is per row (fp8 Q),
    else one scalar."""
    if ROW_SCALES:
        scores = scores * row_scale[:, None] + scores_rope * row_scale[:, None]
    else:
        scores = scores * row_scale + scores_rope * row_scale
    if ROWS_DIFFER:
        seen_key = (pos[None, :] < visible[:, None]) & (pos >= lo)[None, :]
    else:
        seen_key = (pos < visible)[None, :]
    # A NaN or infinite score of a visible key (NaN/Inf in q or the cache, an overflowing
    # scale) must not pass for "no key" or weight 0: it poisons the row's denominator,
    # hence its out and lse. A comparison, not s - s, which FMA contraction may break.
    finite = tl.abs(scores) < float("inf")
    nonfinite = tl.where(seen_key & finite, 0.0, 1.0)
    nonfinite = tl.where(seen_key, nonfinite, 0.0)
    poison = tl.where(tl.max(nonfinite, axis=1) > 0, float("nan"), 0.0)
    # Keys some row scores finitely (unused, hence compiled away, outside GUARD_V tiles).
    # A non-finite element of a key's V (its first Dv columns) makes every row's score of
    # it non-finite, q = 0 padding included; so a key no row scores finitely may drop out
    # of P.V: the rows that see it are poisoned above, the others give it weight 0.
    finite_key = tl.max(finite.to(tl.int32), axis=0) > 0
    scores = tl.where(seen_key, scores, float("-inf"))

    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    # Rows that have seen no key yet keep weight 0 without ever computing inf - inf.
    ref = tl.where(new_max == float("-inf"), 0.0, new_max)
    rescale = tl.exp2(running_max - ref)
    weights = tl.exp2(scores - ref[:, None])
    denom = denom * rescale + tl.sum(weights, axis=1) + poison
    # Weights are <= 1; P_SCALE lifts them off fp8's subnormal floor (undone in out_scale).
    if PV_FP8:
        p = to_fp8(weights * P_SCALE, FP8_DTYPE, V_DTYPE, FP8_EMULATE_MIN_EXP)
    else:
        p = weights.to(V_DTYPE)
    return new_max, denom, rescale, p, finite_key


@triton.jit
def _attend_tile(
    first,  # the tile's first key position
    lo,  # with ROWS_DIFFER: keys below it are not seen
    end,
    block_row,
    kv_ptr,
    num_blocks,
    stride_kv_block,
    stride_kv_token,
    q_nope,
    q_rope,
    q_nope_hi,
    row_scale,
    visible,
    running_max,
    denom,
    acc,
    acc_hi,
    next_block,
    HEAD_DIM_V: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DV_CHUNKS: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    K_DTYPE: tl.constexpr,
    V_DTYPE: tl.constexpr,
    PV_FP8: tl.constexpr,
    V_VIA_REGISTERS: tl.constexpr,
    FOLD_IN_BRANCH: tl.constexpr,
    KEYS_AS_M: tl.constexpr,
    FP8_DTYPE: tl.constexpr,
    FP8_EMULATE_MIN_EXP: tl.constexpr,
    P_SCALE: tl.constexpr,
    PREFETCH_IDS: tl.constexpr,
    GUARD_V: tl.constexpr,
    ROWS_DIFFER: tl.constexpr,
    ROW_SCALES: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr,
):
    """One KV tile of stage 1's walk: load it, fold it into the online softmax state.

    ``GUARD_V`` (a verify window's tail tiles, which some rows see and others do not):
    P.V reads V again without the keys no row scores finitely. Keys past ``end`` are not
    loaded, nor seen. ``visible``: the per-row key limits with ``ROWS_DIFFER`` (and ``lo``
    a lower one), else the scalar ``end``. ``TILE_IN_PAGE``: the tile lies in one page (one
    block id; ``next_block`` is then a scalar). Returns ``(running_max, denom, acc, acc_hi,
    next_block)``."""
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_dr = tl.arange(0, BLOCK_DR)
    dv_mask = offs_dv < HEAD_DIM_V
    dv_mask_hi = BLOCK_DV + offs_dv < HEAD_DIM_V
    dr_mask = offs_dr < ROPE_DIM
    pos = first + tl.arange(0, BLOCK_N)
    # pos < end <= capacity: every column read from the table is below max_blocks.
    in_range = pos < end
    if TILE_IN_PAGE:
        if PREFETCH_IDS:
            block = next_block
            ahead = first < end - BLOCK_N
            next_block = tl.load(block_row + (first + BLOCK_N) // PAGE_SIZE, mask=ahead, other=0)
        else:
            block = tl.load(block_row + first // PAGE_SIZE)
    elif PREFETCH_IDS:
        block = next_block
        # The mask compares without pos + BLOCK_N, which may wrap past 2^31 - 1 in lanes
        # it drops.
        ahead = pos < end - BLOCK_N
        next_block = tl.load(block_row + (pos + BLOCK_N) // PAGE_SIZE, mask=ahead, other=0)
    else:
        block = tl.load(block_row + pos // PAGE_SIZE, mask=in_range, other=0)
    # A bad id (as uint32 a negative one is above 2^31) is clamped to the last block for
    # the address only, so every load stays inside kv_cache; the rows that may see such
    # a key are poisoned after the loop whatever it read (first_bad). Cheaper than a
    # second load mask: one unsigned min per key; back to int32 (the result is below
    # num_blocks) so the offset math stays what it was.
    block = tl.minimum(block.to(tl.uint32, bitcast=True), num_blocks - 1)
    block = block.to(tl.int32, bitcast=True)
    if TILE_IN_PAGE:
        token = (
            kv_ptr
            + block.to(tl.int64) * stride_kv_block
            + (first % PAGE_SIZE + tl.arange(0, BLOCK_N)).to(tl.int64) * stride_kv_token
        )
    else:
        token = (
            kv_ptr
            + block.to(tl.int64) * stride_kv_block
            + (pos % PAGE_SIZE).to(tl.int64) * stride_kv_token
        )
    # Masked loads: slots past a request's length may hold NaN, and NaN * 0 is NaN, so
    # they must never enter a product, not even with a zero weight.
    key_mask = in_range[:, None]
    kv_nope = tl.load(
        token[:, None] + offs_dv[None, :], mask=key_mask & dv_mask[None, :], other=0.0
    )
    kv_rope = tl.load(
        token[:, None] + HEAD_DIM_V + offs_dr[None, :], mask=key_mask & dr_mask[None, :], other=0.0
    )
    # "ieee": fp32 tiles must not be rounded to tf32 (16-bit and fp8 inputs are exact).
    # KEYS_AS_M: keys as the dots' M, rows as N: S^T = K Q^T, and (below) O^T = V^T P^T,
    # with Q^T formed once before the walk (so its shared copy is made once, not per tile).
    # sm90's fp8 wgmma has M = 64 (per warpgroup) and N any multiple of 8: a group of 16 or
    # 32 rows then issues no padded rows. The softmax step works on S (a transpose is a
    # layout change); the accumulator is carried as O^T.
    if KEYS_AS_M:
        scores = tl.dot(kv_nope.to(K_DTYPE), q_nope, input_precision="ieee")
    else:
        scores = tl.dot(q_nope, tl.trans(kv_nope.to(K_DTYPE)), input_precision="ieee")
    if DV_CHUNKS == 2:
        kv_nope_hi = tl.load(
            token[:, None] + BLOCK_DV + offs_dv[None, :],
            mask=key_mask & dv_mask_hi[None, :],
            other=0.0,
        )
        if KEYS_AS_M:
            scores = tl.dot(kv_nope_hi.to(K_DTYPE), q_nope_hi, scores, input_precision="ieee")
        else:
            scores = tl.dot(
                q_nope_hi, tl.trans(kv_nope_hi.to(K_DTYPE)), scores, input_precision="ieee"
            )
    if KEYS_AS_M:
        scores = tl.trans(scores)
        scores_rope = tl.trans(tl.dot(kv_rope.to(K_DTYPE), q_rope, input_precision="ieee"))
    else:
        scores_rope = tl.dot(q_rope, tl.trans(kv_rope.to(K_DTYPE)), input_precision="ieee")
    # ``FOLD_IN_BRANCH`` (CUDA): the softmax step sits in a branch (always taken: the walk
    # stops at ``end``) so that no dot depends on the score dots within one block of code.
    # Triton lays the warps of a dot whose result reaches another dot along M only ([8, 1]
    # on sm90): a 64-row tile then has both warpgroups compute the whole Q.K^T. Past a
    # region boundary it sees no chain, gives Q.K^T [4, 2] (each warpgroup its 32 keys) and
    # shares P through shared memory, as FlashMLA does. The two score dots stay separate
    # (summed in the branch) for the same reason. The other branch yields no constant tile
    # (that would take 8 KB of shared memory for its P operand). AMD wants the chain: its
    # 16-row MFMAs then give each wave its own rows of both dots ([4, 1]), so P stays in
    # the wave's registers and the softmax reduces within it; past a branch a 32-key fp8
    # tile got [2, 2] (P through LDS, cross-wave reductions), which spilled on gfx950.
    if not FOLD_IN_BRANCH or first < end:
        new_max, denom, rescale, p, finite_key = _fold_scores(
            scores,
            scores_rope,
            pos,
            lo,
            row_scale,
            visible,
            running_max,
            denom,
            ROWS_DIFFER,
            ROW_SCALES,
            V_DTYPE,
            PV_FP8,
            FP8_DTYPE,
            FP8_EMULATE_MIN_EXP,
            P_SCALE,
        )
    else:
        new_max = running_max
        rescale = tl.zeros_like(running_max) + 1.0
        p = (scores * 0.0).to(V_DTYPE)
        finite_key = pos < end
    if GUARD_V:
        # V loaded again (the tail's tiles are few and in L2), without the keys no row
        # scores finitely: no 0 x NaN reaches a row that does not see such a key. No
        # round trip of the tile through registers, unlike zeroing its non-finite elements.
        v_mask = (in_range & finite_key)[:, None]
        kv_nope = tl.load(
            token[:, None] + offs_dv[None, :], mask=v_mask & dv_mask[None, :], other=0.0
        )
        if DV_CHUNKS == 2:
            kv_nope_hi = tl.load(
                token[:, None] + BLOCK_DV + offs_dv[None, :],
                mask=v_mask & dv_mask_hi[None, :],
                other=0.0,
            )
    if V_VIA_REGISTERS:
        # fp8 wgmma reads K-major operands only: V (keys x Dv, Dv contiguous) is transposed
        # through registers (with KEYS_AS_M it stays there, P.V's register A operand). A
        # no-op register op on the loaded tile (a bitcast) leaves its load a plain dot
        # operand, which Triton copies asynchronously into the pipelined shared buffers,
        # and the transpose reads it from there; with V's dot as its only other use, the
        # load itself would go to registers, synchronously.
        kv_nope = kv_nope.to(tl.int8, bitcast=True).to(V_DTYPE, bitcast=True)
        if DV_CHUNKS == 2:
            kv_nope_hi = kv_nope_hi.to(tl.int8, bitcast=True).to(V_DTYPE, bitcast=True)
    if KEYS_AS_M:
        p = tl.trans(p)
        acc = tl.dot(
            tl.trans(kv_nope.to(V_DTYPE)), p, acc * rescale[None, :], input_precision="ieee"
        )
        if DV_CHUNKS == 2:
            acc_hi = tl.dot(
                tl.trans(kv_nope_hi.to(V_DTYPE)),
                p,
                acc_hi * rescale[None, :],
                input_precision="ieee",
            )
    else:
        acc = tl.dot(p, kv_nope.to(V_DTYPE), acc * rescale[:, None], input_precision="ieee")
        if DV_CHUNKS == 2:
            acc_hi = tl.dot(
                p, kv_nope_hi.to(V_DTYPE), acc_hi * rescale[:, None], input_precision="ieee"
            )
    return new_max, denom, acc, acc_hi, next_block


@triton.jit
def _mla_decode_stage1(
    q_ptr,  # [B, S_q, H, D]; with QK_FP8 quantized per row (``quantize_q``)
    q_scale_ptr,  # [B, S_q, H] fp32 row scales of q (read only with QK_FP8)
    kv_ptr,  # [num_blocks, PAGE_SIZE, D], unit stride in D
    block_table_ptr,  # [B, max_blocks] int32
    seqlens_ptr,  # [B] int32
    out_ptr,  # [splits, B, S_q, H, Dv] (fp32 partials; ROWS_PADDED: num_groups x BLOCK_H row
    # slots per request) or [B, S_q, H, Dv] (final, 1 split)
    lse_ptr,  # [splits, B, S_q, H] fp32 or [B, S_q, H]
    fault_ptr,  # [1] int32, FAULT_* bits ORed in (read only with HAS_FAULT_FLAG)
    qk_scale,  # softmax scale x kv dequant scale x log2(e): scores in base 2
    out_scale,  # kv dequant scale / P_SCALE, applied to the output
    num_groups,
    num_splits,
    num_blocks,
    max_blocks,
    stride_q_b,
    stride_q_i,
    stride_q_h,
    stride_kv_block,
    stride_kv_token,
    stride_bt_b,
    stride_out_split,
    stride_out_b,
    stride_out_h,
    stride_lse_split,
    stride_lse_b,
    stride_lse_h,
    Q_LEN: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DV_CHUNKS: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    K_DTYPE: tl.constexpr,
    V_DTYPE: tl.constexpr,
    QK_FP8: tl.constexpr,
    PV_FP8: tl.constexpr,
    V_VIA_REGISTERS: tl.constexpr,
    FOLD_IN_BRANCH: tl.constexpr,
    KEYS_AS_M: tl.constexpr,
    REMAT_ROWS: tl.constexpr,
    FP8_DTYPE: tl.constexpr,
    FP8_EMULATE_MIN_EXP: tl.constexpr,
    P_SCALE: tl.constexpr,
    NUM_XCDS: tl.constexpr,
    HAS_FAULT_FLAG: tl.constexpr,
    PREFETCH_IDS: tl.constexpr,
    ROWS_PADDED: tl.constexpr,
):
    num_programs = tl.num_programs(0)
    pid = _remap_for_xcds(tl.program_id(0), num_programs, NUM_XCDS)
    # Row groups vary fastest: consecutive ids read the same KV slice.
    group = pid % num_groups
    split = (pid // num_groups) % num_splits
    b = pid // (num_groups * num_splits)

    seqlen = tl.load(seqlens_ptr + b)
    rows = group * BLOCK_H + tl.arange(0, BLOCK_H)
    row_valid = rows < Q_LEN * NUM_HEADS
    # Index x stride products are int64: a cache view or a batch of q can pass 2^31 elements.
    qpos = (rows // NUM_HEADS).to(tl.int64)
    head = (rows % NUM_HEADS).to(tl.int64)
    # Causal: query i of S_q sees keys [0, L - S_q + i]. A length <= 0 sees nothing; testing
    # it first keeps L - S_q + i from wrapping at L near -2^31.
    if CAUSAL:
        visible = tl.where(seqlen > 0, seqlen - (Q_LEN - 1) + (rows // NUM_HEADS), 0)
    else:
        visible = tl.zeros([BLOCK_H], tl.int32) + seqlen
    visible = tl.where(row_valid & (visible > 0), visible, 0)

    # Planned calls do not check lengths or block ids on the host, so the kernel only reads
    # keys that exist: key p lives in table column p // PAGE_SIZE, which must be below
    # max_blocks, and its block id in [0, num_blocks). A row that may see a key past the
    # table is poisoned up front; the walk stops at the table's end. int64 scalars: a
    # length near 2^31 - 1 rounded up to whole tiles would wrap in int32.
    capacity = max_blocks.to(tl.int64) * PAGE_SIZE
    beyond_table = visible.to(tl.int64) > capacity
    length = tl.minimum(tl.maximum(seqlen, 0).to(tl.int64), capacity)
    # Split s of this request covers keys [s * chunk, (s + 1) * chunk), chunk a multiple of
    # the tile; the slice stops at the furthest key any row of this group may see.
    chunk = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(tl.minimum(start + chunk, tl.max(visible, axis=0).to(tl.int64)), capacity)
    start = tl.minimum(start, end).to(tl.int32)

    offs_dv = tl.arange(0, BLOCK_DV)
    offs_dr = tl.arange(0, BLOCK_DR)
    dv_mask = offs_dv < HEAD_DIM_V
    dv_mask_hi = BLOCK_DV + offs_dv < HEAD_DIM_V
    dr_mask = offs_dr < ROPE_DIM
    q_rows = q_ptr + b.to(tl.int64) * stride_q_b + qpos * stride_q_i + head * stride_q_h
    q_nope = tl.load(
        q_rows[:, None] + offs_dv[None, :], mask=row_valid[:, None] & dv_mask[None, :], other=0.0
    )
    q_rope = tl.load(
        q_rows[:, None] + HEAD_DIM_V + offs_dr[None, :],
        mask=row_valid[:, None] & dr_mask[None, :],
        other=0.0,
    )
    if DV_CHUNKS == 2:
        q_nope_hi = tl.load(
            q_rows[:, None] + BLOCK_DV + offs_dv[None, :],
            mask=row_valid[:, None] & dv_mask_hi[None, :],
            other=0.0,
        )
    if QK_FP8:
        # Q comes quantized per row (``quantize_q``): its scale joins that row's softmax
        # scale. Loaded, not computed here, it is an operand the dots read from shared
        # memory on sm90.
        q_scale = tl.load(
            q_scale_ptr + b.to(tl.int64) * (Q_LEN * NUM_HEADS) + rows, mask=row_valid, other=1.0
        )
        row_scale = qk_scale * q_scale
    else:
        row_scale = qk_scale
    q_nope = q_nope.to(K_DTYPE)
    q_rope = q_rope.to(K_DTYPE)
    if DV_CHUNKS == 2:
        q_nope_hi = q_nope_hi.to(K_DTYPE)
    if KEYS_AS_M:
        # Q^T, the dots' N operand, formed once (_attend_tile takes it transposed).
        q_nope = tl.trans(q_nope)
        q_rope = tl.trans(q_rope)
        if DV_CHUNKS == 2:
            q_nope_hi = tl.trans(q_nope_hi)

    running_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    if KEYS_AS_M:  # carried as O^T (see _attend_tile)
        acc = tl.zeros([BLOCK_DV, BLOCK_H], tl.float32)
    else:
        acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    if DV_CHUNKS == 2:
        acc_hi = tl.zeros_like(acc)
    else:
        # Placeholders the tile step carries untouched with one V part.
        acc_hi = tl.zeros([1], tl.float32)
        q_nope_hi = tl.zeros([1], tl.float32)
    block_row = block_table_ptr + b.to(tl.int64) * stride_bt_b
    end = end.to(tl.int32)
    # Which rows may see a key whose block id is bad: the first key of [start, end) in such a
    # column, found once per page before the walk rather than once per key in it. Counted
    # in steps, written to stay clear of int32 wrap near 2^31.
    first_bad = tl.full([_BLOCK_C], 2**31 - 1, tl.int32)
    col_start = start // PAGE_SIZE
    col_end = tl.where(end > start, (end - 1) // PAGE_SIZE + 1, col_start)
    for step in range(0, tl.cdiv(col_end - col_start, _BLOCK_C)):
        cols = col_start + step * _BLOCK_C + tl.arange(0, _BLOCK_C)
        ids = tl.load(block_row + cols, mask=cols < col_end, other=0)
        bad = (cols < col_end) & (ids.to(tl.uint32, bitcast=True) >= num_blocks)
        first_bad = tl.minimum(
            first_bad, tl.where(bad, tl.maximum(cols * PAGE_SIZE, start), 2**31 - 1)
        )
    first_bad = tl.min(first_bad, axis=0)
    unreadable = (first_bad < visible) | beyond_table
    # Their denominators start as NaN (a NaN denom stays NaN through the walk): nothing
    # of this scan stays live through the loop.
    denom = tl.where(unreadable, float("nan"), denom)
    if HAS_FAULT_FLAG:
        faults = tl.where(first_bad < 2**31 - 1, _FAULT_BLOCK_ID, 0)
        beyond = tl.max(beyond_table.to(tl.int32), axis=0) > 0
        faults = faults | tl.where(beyond, _FAULT_BEYOND_TABLE, 0)
        tl.atomic_or(fault_ptr, faults, mask=faults != 0)

    # Rows of one verify window see different keys: a key only later rows see has weight 0
    # in the earlier ones, and 0 x NaN (a non-finite V element) would still reach them. Only
    # the window's own keys, from its first one (L - S_q + 1) on, are seen by some rows and
    # not others, at most S_q - 1 of them. The walk takes the keys below it, which every
    # row sees, with one limit for all rows and V straight from the loaded tile into P.V;
    # the window's keys follow in tail tiles of BLOCK_W keys (see below).
    WINDOW: tl.constexpr = CAUSAL and Q_LEN > 1
    if WINDOW:
        # Compared first, so that L - S_q + 1 cannot wrap at L near -2^31.
        window = tl.where(seqlen > Q_LEN - 1, seqlen - (Q_LEN - 1), 0)
        shared_end = tl.minimum(tl.maximum(window, start), end)
    else:
        shared_end = end
    # PREFETCH_IDS: the block ids of each tile are loaded one trip ahead (loop-carried), so
    # the KV loads of a trip depend on no load of that trip and Triton's software pipeliner
    # gives them their own LDS buffers (AMD's stays single-buffered otherwise).
    # A tile inside one page (tiles start at multiples of BLOCK_N): one block id per tile.
    TILE_IN_PAGE: tl.constexpr = PAGE_SIZE % BLOCK_N == 0
    if PREFETCH_IDS:
        if TILE_IN_PAGE:
            next_block = tl.load(block_row + start // PAGE_SIZE, mask=start < shared_end, other=0)
        else:
            next_pos = start + tl.arange(0, BLOCK_N)
            next_block = tl.load(
                block_row + next_pos // PAGE_SIZE, mask=next_pos < shared_end, other=0
            )
    else:
        next_block = tl.zeros([BLOCK_N], tl.int32)
    # One masked walk (an unmasked walk of the whole tiles plus the last one apart costs
    # AMD VGPRs in Triton 3.9 and saves sm90 none that matter).
    # The loop counts tiles, not keys: n0 + BLOCK_N would wrap past an end near 2^31 - 1.
    num_tiles = tl.where(shared_end > start, (shared_end - start - 1) // BLOCK_N + 1, 0)
    for tile in range(0, num_tiles):
        running_max, denom, acc, acc_hi, next_block = _attend_tile(
            start + tile * BLOCK_N,
            start,
            shared_end,
            block_row,
            kv_ptr,
            num_blocks,
            stride_kv_block,
            stride_kv_token,
            q_nope,
            q_rope,
            q_nope_hi,
            row_scale,
            shared_end,
            running_max,
            denom,
            acc,
            acc_hi,
            next_block,
            HEAD_DIM_V,
            ROPE_DIM,
            PAGE_SIZE,
            BLOCK_N,
            BLOCK_DV,
            DV_CHUNKS,
            BLOCK_DR,
            K_DTYPE,
            V_DTYPE,
            PV_FP8,
            V_VIA_REGISTERS,
            FOLD_IN_BRANCH,
            KEYS_AS_M,
            FP8_DTYPE,
            FP8_EMULATE_MIN_EXP,
            P_SCALE,
            PREFETCH_IDS,
            False,
            False,
            QK_FP8,
            TILE_IN_PAGE,
        )
    if WINDOW:
        # The window's keys [shared_end, end): tiles of BLOCK_W keys (at least S_q - 1 where
        # BLOCK_N allows, so mostly one), not pipelined, whose P.V leaves out the keys no
        # row scores finitely (GUARD_V). Per-row limits, and a lower
        # one: the tiles start at multiples of BLOCK_W (no lane wraps past 2^31 - 1), so
        # the first may hold keys the walk took; they are read (they exist) but not seen.
        # A tail tile lies in one page where BLOCK_W divides it (one block id).
        no_ids = tl.zeros([BLOCK_W], tl.int32)  # no ids are prefetched
        aligned = shared_end // BLOCK_W * BLOCK_W
        num_tail = tl.where(end > shared_end, (end - 1 - aligned) // BLOCK_W + 1, 0)
        for tile in tl.range(0, num_tail, num_stages=1):
            running_max, denom, acc, acc_hi, no_ids = _attend_tile(
                aligned + tile * BLOCK_W,
                shared_end,
                end,
                block_row,
                kv_ptr,
                num_blocks,
                stride_kv_block,
                stride_kv_token,
                q_nope,
                q_rope,
                q_nope_hi,
                row_scale,
                visible,
                running_max,
                denom,
                acc,
                acc_hi,
                no_ids,
                HEAD_DIM_V,
                ROPE_DIM,
                PAGE_SIZE,
                BLOCK_W,
                BLOCK_DV,
                DV_CHUNKS,
                BLOCK_DR,
                K_DTYPE,
                V_DTYPE,
                PV_FP8,
                V_VIA_REGISTERS,
                FOLD_IN_BRANCH,
                KEYS_AS_M,
                FP8_DTYPE,
                FP8_EMULATE_MIN_EXP,
                P_SCALE,
                False,
                True,
                True,
                QK_FP8,
                PAGE_SIZE % BLOCK_W == 0,
            )

    # Only denom == 0 means "no visible key"; a poisoned (NaN) denom makes out and lse NaN.
    empty = denom == 0
    safe_denom = tl.where(empty, 1.0, denom)
    norm = out_scale / safe_denom
    # running_max is in base 2: lse = ln(2) * (max + log2(denom)).
    lse = tl.where(empty, float("-inf"), (running_max + tl.log2(safe_denom)) * 0.6931471805599453)

    if REMAT_ROWS:
        # The output rows from an opaque copy of the group id (a mov the compiler cannot
        # see through), so they are recomputed here rather than the q loads' row indices
        # staying live through the walk (sm90 H128: 15 registers, spilled at 255).
        group = tl.inline_asm_elementwise(
            "mov.u32 $0, $1;", "=r,r", [group], dtype=tl.int32, is_pure=False, pack=1
        )
        rows = group * BLOCK_H + tl.arange(0, BLOCK_H)
        row_valid = rows < Q_LEN * NUM_HEADS
    out_rows = (
        out_ptr
        + split.to(tl.int64) * stride_out_split
        + b.to(tl.int64) * stride_out_b
        + rows.to(tl.int64) * stride_out_h
    )
    if KEYS_AS_M:
        acc = tl.trans(acc)
        if DV_CHUNKS == 2:
            acc_hi = tl.trans(acc_hi)
    out = tl.where(empty[:, None], 0.0, acc * norm[:, None])
    # Masks written apart from the q loads' (which CSE would merge and keep live through
    # the walk), and none where every row and column is real or, with ROWS_PADDED, has a
    # slot (partials allocated num_groups x BLOCK_H rows per request): no row mask then
    # stays live through the walk either.
    FULL_ROWS: tl.constexpr = ROWS_PADDED or Q_LEN * NUM_HEADS % BLOCK_H == 0
    if FULL_ROWS and HEAD_DIM_V == BLOCK_DV * DV_CHUNKS:
        tl.store(out_rows[:, None] + offs_dv[None, :], out)
    else:
        tl.store(
            out_rows[:, None] + offs_dv[None, :], out, mask=dv_mask[None, :] & row_valid[:, None]
        )
    if DV_CHUNKS == 2:
        out_hi = tl.where(empty[:, None], 0.0, acc_hi * norm[:, None])
        if FULL_ROWS and HEAD_DIM_V == BLOCK_DV * DV_CHUNKS:
            tl.store(out_rows[:, None] + BLOCK_DV + offs_dv[None, :], out_hi)
        else:
            tl.store(
                out_rows[:, None] + BLOCK_DV + offs_dv[None, :],
                out_hi,
                mask=dv_mask_hi[None, :] & row_valid[:, None],
            )
    lse_rows = (
        lse_ptr
        + split.to(tl.int64) * stride_lse_split
        + b.to(tl.int64) * stride_lse_b
        + rows.to(tl.int64) * stride_lse_h
    )
    if FULL_ROWS:
        tl.store(lse_rows, lse)
    else:
        tl.store(lse_rows, lse, mask=row_valid)


def _group_config(config: LaunchConfig, rows: int) -> LaunchConfig:
    """``config`` with BLOCK_H fitted to a problem of ``rows`` (S_q x H) query rows.

    Fewer rows than BLOCK_H: BLOCK_H shrinks to the next power of two (at least 16, the
    smallest M a GPU dot takes; padded rows are masked). From 64 rows on (compute-bound)
    BLOCK_H may shrink to a half or a quarter where that pads fewer rows; never below
    ``min_block_h``. With
    ``rows_per_warp`` BLOCK_H and num_warps shrink together to the BLOCK_H that pads the
    fewest rows (ties: the larger), e.g. 96 rows run as three 32-row groups of 2 waves
    rather than two 64-row groups; at least two waves. A shrunk group takes the config's
    ``shrunk_*`` options where set.
    """
    shrunk = {
        "num_stages": config.num_stages
        if config.shrunk_num_stages is None
        else config.shrunk_num_stages,
        "prefetch_ids": config.prefetch_ids
        if config.shrunk_prefetch_ids is None
        else config.shrunk_prefetch_ids,
        "keys_as_m": config.keys_as_m
        if config.shrunk_keys_as_m is None
        else config.shrunk_keys_as_m,
    }
    if config.rows_per_warp is None:
        block_h = max(config.min_block_h, min(config.block_h, triton.next_power_of_2(rows)))
        # A compute-bound request (>= 64 rows) pads the fewest rows (ties: the larger
        # BLOCK_H), e.g. 96 rows as three 32-row groups: padded rows cost issue slots there,
        # one more read of each KV tile (from L2, by the programs next to it) does not.
        if rows >= 64:
            for smaller in (block_h // 2, block_h // 4):
                if smaller >= config.min_block_h and triton.cdiv(rows, smaller) * smaller < (
                    triton.cdiv(rows, block_h) * block_h
                ):
                    block_h = smaller
        if block_h < config.block_h:
            return replace(config, block_h=block_h, **shrunk)
        return config
    best = config.block_h
    block_h = config.block_h
    # Never a single wave: a one-wave group (16 rows) of a causal verify window spills VGPRs
    # on gfx942/gfx950 in Triton 3.9 (H12 S_q 4, H24 S_q 2), and under 64 rows padding costs
    # no compute-bound issue slots.
    while block_h >= 2 * config.rows_per_warp:
        if triton.cdiv(rows, block_h) * block_h < triton.cdiv(rows, best) * best:
            best = block_h
        block_h //= 2
    if best < config.block_h:
        return replace(config, block_h=best, num_warps=best // config.rows_per_warp, **shrunk)
    return config


def plan_launch(
    *,
    batch: int,
    q_len: int,
    num_heads: int,
    kv_dtype: torch.dtype,
    max_len: int,
    total_len: int,
    target: TritonTarget | None = None,
    config: LaunchConfig | None = None,
    q_dtype: torch.dtype = torch.bfloat16,
    head_dim: int = 576,
    head_dim_v: int = 512,
    page_size: int | None = None,
) -> tuple[LaunchConfig, int]:
    """The stage-1 launch config and split count for one decode step, from host-known lengths.

    Pure host arithmetic (no tensor is read): ``rocm_mla.plan_decode`` calls it once per step
    and every layer of the step launches with the answer. ``max_len``/``total_len`` are the
    longest and summed cache lengths of the batch (an upper bound works: only speed changes).
    The config comes from the tuned table of ``target`` (``default_config``) unless given;
    the split count fills whole waves of ``num_cus x programs_per_cu`` resident programs
    (the compiled kernel's occupancy for this shape; ``page_size`` None assumes 64).
    """
    target = triton_target() if target is None else target
    if target is None:
        raise RuntimeError("plan_launch: no Triton target on this machine")
    if config is None:
        config = default_config(target, num_heads=num_heads, q_len=q_len, kv_dtype=kv_dtype)
    config = _group_config(config, q_len * num_heads)
    num_groups = triton.cdiv(q_len * num_heads, config.block_h)
    slots = target.num_cus * programs_per_cu(
        config,
        target,
        kv_dtype=kv_dtype,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        num_heads=num_heads,
        q_len=q_len,
        q_dtype=q_dtype,
        page_size=64 if page_size is None else page_size,
        cache_bytes=total_len * head_dim * kv_dtype.itemsize,
    )
    splits = choose_num_kv_splits(batch, num_groups, total_len / max(batch, 1), max_len, slots)
    return config, splits


def plan_num_kv_splits(
    cache_seqlens: torch.Tensor,
    q_len: int,
    num_heads: int,
    config: LaunchConfig | None = None,
    target: TritonTarget | None = None,
    kv_dtype: torch.dtype = torch.bfloat16,
) -> int:
    """The split count ``mla_decode`` picks when not forced (``plan_launch``).

    Reads the lengths back to the host (one sync). The answer depends only on the lengths
    and the shape, so a caller that decodes many layers per step (or a benchmark) can plan
    once and pass ``num_kv_splits`` to every call.
    """
    max_len, total_len = (
        int(v) for v in torch.stack([cache_seqlens.max(), cache_seqlens.sum()]).tolist()
    )
    _, splits = plan_launch(
        batch=cache_seqlens.shape[0],
        q_len=q_len,
        num_heads=num_heads,
        kv_dtype=kv_dtype,
        max_len=max_len,
        total_len=total_len,
        target=target,
        config=config,
    )
    return splits


_TL_DTYPES = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float8_e4m3fn: tl.float8e4nv,
    torch.float8_e4m3fnuz: tl.float8e4b8,
}
#: Largest finite value of each fp8 flavour, and the power of two the softmax weights (<= 1)
#: are multiplied by before fp8 rounding, so that small weights stay above the subnormals.
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 240.0}
_P_SCALE = {torch.float8_e4m3fn: 256.0, torch.float8_e4m3fnuz: 128.0}


def _has_fp8_dot(target: TritonTarget) -> bool:
    if target.backend == "hip":
        return target.arch in ("gfx942", "gfx950")
    digits = "".join(ch for ch in (target.arch or "")[2:] if ch.isdigit())
    return target.backend == "cuda" and int(digits or 0) >= 89  # sm89 (Ada) and later


def _dot_types(q_dtype, kv_dtype, target: TritonTarget, config: LaunchConfig) -> dict:
    """The kernel's dtype constexprs: what each dot is fed, and whether Q / P go through fp8.

    The interpreter always computes in fp32 (it multiplies bf16 bit patterns in ``tl.dot``,
    Triton issue 11584, and has no fp8 dot) but still rounds Q and P to fp8 values when the
    config asks (``_to_fp8``), so the CPU tests check the GPU's numerics and scale
    bookkeeping.
    """
    fp8 = kv_dtype in _FP8_MAX
    interpreting = target.backend == "interpreter"
    qk_fp8 = fp8 and config.fp8_qk and (interpreting or _has_fp8_dot(target))
    pv_fp8 = fp8 and config.fp8_pv and (interpreting or _has_fp8_dot(target))
    upcast = torch.float32 if interpreting or q_dtype == torch.float32 else q_dtype
    fp8_dtype = kv_dtype if fp8 else torch.float8_e4m3fn
    return {
        "K_DTYPE": _TL_DTYPES[kv_dtype if qk_fp8 and not interpreting else upcast],
        "V_DTYPE": _TL_DTYPES[kv_dtype if pv_fp8 and not interpreting else upcast],
        "QK_FP8": qk_fp8,
        "PV_FP8": pv_fp8,
        # NVIDIA: fp8 P.V takes V transposed (K-major), through registers.
        "V_VIA_REGISTERS": pv_fp8 and target.backend == "cuda",
        # See _attend_tile: the softmax step apart from the dots (CUDA) or with them (AMD).
        "FOLD_IN_BRANCH": target.backend != "hip",
        "KEYS_AS_M": config.keys_as_m,
        # NVIDIA: stage 1 recomputes its output rows after the walk (an opaque mov).
        "REMAT_ROWS": target.backend == "cuda",
        "FP8_DTYPE": _TL_DTYPES[fp8_dtype],
        # Smallest normal exponents: e4m3fn 2^-6, e4m3fnuz 2^-7.
        "FP8_EMULATE_MIN_EXP": (-6.0 if fp8_dtype == torch.float8_e4m3fn else -7.0)
        if interpreting
        else None,
        "FP8_MAX": _FP8_MAX[fp8_dtype],
        "P_SCALE": _P_SCALE[fp8_dtype] if pv_fp8 else 1.0,
    }


def _stage1_q(
    q: torch.Tensor, kv_dtype: torch.dtype, dot_types: dict, target: TritonTarget
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(the q stage 1 reads, its per-row scales or None)``: with fp8 ``Q K^T`` q quantized
    per row by ``quantize_q`` (fp8 values in fp32 under the interpreter), else q itself."""
    if not dot_types["QK_FP8"]:
        return q, None
    interpreting = target.backend == "interpreter"
    return quantize_q(
        q,
        out_dtype=torch.float32 if interpreting else kv_dtype,
        out_tl_dtype=dot_types["K_DTYPE"],
        fp8_dtype=dot_types["FP8_DTYPE"],
        emulate_min_exp=dot_types["FP8_EMULATE_MIN_EXP"],
        fp8_max=dot_types["FP8_MAX"],
    )


def _partials(
    splits: int,
    batch: int,
    q_len: int,
    num_heads: int,
    head_dim_v: int,
    group_rows: int,
    device,
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Stage 1's fp32 partials ``(out [splits, B, S_q, H, Dv], lse [splits, B, S_q, H],
    rows_padded)``: views of buffers that hold ``group_rows`` (num_groups x BLOCK_H) rows
    per request, so that the rows padding the last group have slots of their own and stage
    1 stores every row unmasked (``ROWS_PADDED``); plain buffers where no row pads."""
    out = torch.empty(splits, batch, group_rows, head_dim_v, dtype=torch.float32, device=device)
    lse = torch.empty(splits, batch, group_rows, dtype=torch.float32, device=device)
    # as_strided, not view: a view may give a size-1 dim (B = 1) any stride, and the
    # stride check in _stage1_arguments reads the strides of the real buffer.
    shape = (splits, batch, q_len, num_heads)
    lse_strides = (batch * group_rows, group_rows, num_heads, 1)
    return (
        out.as_strided((*shape, head_dim_v), (*(s * head_dim_v for s in lse_strides), 1)),
        lse.as_strided(shape, lse_strides),
        group_rows != q_len * num_heads,
    )


def _holds_padded_rows(buffer: torch.Tensor, group_rows: int) -> bool:
    """Whether ``buffer`` ([splits, B, S_q, H(, Dv)]) has, for every split and request, a
    slot of ``group_rows`` rows that no other split or request shares and that lies inside
    its storage. Strides of size-1 dims address nothing and are not read."""
    splits, batch = buffer.shape[:2]
    span = group_rows * buffer.stride(3)
    request_end = (batch - 1) * buffer.stride(1) + span
    if batch > 1 and buffer.stride(1) < span:
        return False
    if splits > 1 and buffer.stride(0) < request_end:
        return False
    end = buffer.storage_offset() + (splits - 1) * buffer.stride(0) + request_end
    return end * buffer.element_size() <= buffer.untyped_storage().nbytes()


def _stage1_arguments(
    q: torch.Tensor,
    q_scale: torch.Tensor | None,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    fault_flag: torch.Tensor | None,
    *,
    head_dim_v: int,
    softmax_scale: float,
    causal: bool,
    kv_scale: float | None,
    num_groups: int,
    num_kv_splits: int,
    config: LaunchConfig,
    target: TritonTarget,
    dot_types: dict,
    rows_padded: bool = False,
) -> tuple[tuple[int], tuple, dict]:
    """``(grid, args, kwargs)`` of the stage-1 launch: what ``mla_decode`` runs and what
    ``programs_per_cu`` compiles (on meta tensors) to read the kernel's resources. ``q`` and
    ``q_scale`` as ``_stage1_q`` gives them; ``dot_types`` from the caller's q dtype.
    ``rows_padded``: ``part_out`` / ``part_lse`` are views of ``_partials`` buffers, with a
    slot for every row of every group (the kernel then writes the padded rows too)."""
    _, q_len, num_heads, head_dim = q.shape
    rope_dim = head_dim - head_dim_v
    dequant = 1.0 if kv_scale is None else float(kv_scale)
    padded_dv = max(16, triton.next_power_of_2(head_dim_v))
    # Two V halves only when each half is still a whole dot tile.
    dv_chunks = config.dv_chunks if padded_dv >= 32 else 1
    grid = (q.shape[0] * num_groups * num_kv_splits,)
    # A causal verify window's own keys (S_q - 1) go through tail tiles of BLOCK_W keys: as
    # few as hold them, at least the K of one dot (32 for fp8 operands), at most BLOCK_N.
    fp8_dot = dot_types["QK_FP8"] or dot_types["PV_FP8"]
    block_w = min(
        config.block_n, max(32 if fp8_dot else 16, triton.next_power_of_2(max(q_len - 1, 1)))
    )
    if config.keys_as_m:
        # Keys are the dots' M: a tail tile of fewer keys than the walk's would pad them.
        block_w = config.block_n
    # Stage 1 addresses an output row (query i, head h) as row i x H + h: the buffers are
    # ours, allocated [splits, B, S_q, H(, Dv)] with S_q and H adjacent.
    for name, buffer in (("part_out", part_out), ("part_lse", part_lse)):
        if buffer.stride(2) != num_heads * buffer.stride(3):
            raise RuntimeError(
                f"_stage1_arguments: {name} must hold S_q and H adjacent (stride(2) == H x "
                f"stride(3)), got strides {buffer.stride()}"
            )
        # Padded rows are written: each request must have a slot for all of them.
        if rows_padded and not _holds_padded_rows(buffer, num_groups * config.block_h):
            raise RuntimeError(
                f"_stage1_arguments: {name} must hold {num_groups} x {config.block_h} rows "
                f"per request with rows_padded, got shape {tuple(buffer.shape)}, strides "
                f"{buffer.stride()}, storage offset {buffer.storage_offset()} in a storage "
                f"of {buffer.untyped_storage().nbytes()} bytes"
            )
    args = (
        q,
        # Without fp8 Q any pointer will do: QK_FP8=False never reads it.
        part_lse if q_scale is None else q_scale,
        kv_cache,
        block_table,
        cache_seqlens,
        part_out,
        part_lse,
        # Without a flag any pointer will do: HAS_FAULT_FLAG=False compiles the atomic away.
        part_lse if fault_flag is None else fault_flag,
        softmax_scale * dequant * math.log2(math.e),
        dequant / dot_types["P_SCALE"],
        num_groups,
        num_kv_splits,
        kv_cache.shape[0],
        block_table.shape[1],
        q.stride(0),
        q.stride(1),
        q.stride(2),
        kv_cache.stride(0),
        kv_cache.stride(1),
        block_table.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(3),
        part_lse.stride(0),
        part_lse.stride(1),
        part_lse.stride(3),
    )
    kwargs = dict(
        Q_LEN=q_len,
        NUM_HEADS=num_heads,
        HEAD_DIM_V=head_dim_v,
        ROPE_DIM=rope_dim,
        PAGE_SIZE=kv_cache.shape[1],
        CAUSAL=bool(causal),
        BLOCK_H=config.block_h,
        BLOCK_N=config.block_n,
        BLOCK_W=block_w,
        BLOCK_DV=padded_dv // dv_chunks,
        DV_CHUNKS=dv_chunks,
        BLOCK_DR=max(16, triton.next_power_of_2(rope_dim)),
        NUM_XCDS=config.num_xcds,
        HAS_FAULT_FLAG=fault_flag is not None,
        PREFETCH_IDS=config.prefetch_ids,
        ROWS_PADDED=rows_padded,
        # FP8_MAX is quantize_q's.
        **{k: v for k, v in dot_types.items() if k != "FP8_MAX"},
        **config.launch_options(target),
    )
    return grid, args, kwargs


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    head_dim_v: int,
    softmax_scale: float,
    causal: bool = True,
    kv_scale: float | None = None,
    num_kv_splits: int | None = None,
    config: LaunchConfig | None = None,
    fault_flag: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV MLA decode over shape-checked inputs (``rocm_mla.inputs.prepare_decode``).

    Lengths and block ids need not have been value-checked: nothing outside ``kv_cache``
    and ``block_table`` is ever read, whatever they hold, and every query row that may see a
    key whose table column is past ``max_blocks`` or whose block id is outside
    ``[0, num_blocks)`` comes out NaN (out and lse).

    Args:
        q: ``[B, S_q, H, D]`` float32/float16/bfloat16.
        kv_cache: ``[num_blocks, block_size, D]``, unit stride in D; float32/float16/bfloat16
            or fp8 with ``kv_scale``.
        block_table: ``[B, max_blocks]`` int32. cache_seqlens: ``[B]`` int32.
        head_dim_v: V width; ``D - head_dim_v`` is the rope width.
        softmax_scale: the score scale (already resolved, e.g. ``D ** -0.5``).
        causal: query ``i`` sees keys ``[0, L - S_q + i]``; else all ``L``.
        kv_scale: per-tensor dequant scale of an fp8 cache, else None.
        num_kv_splits: the split count (>= 1), e.g. from ``plan_launch``; None plans it per
            call with ``plan_num_kv_splits`` (one host sync to read the lengths). Given, the
            call makes no device-to-host transfer.
        config: stage-1 launch config (e.g. from ``plan_launch``); None takes the tuned
            table's entry for this target and shape (host-only).
        fault_flag: int32 ``[1]`` on q's device, or None: the kernel ORs
            ``rocm_mla.inputs.FAULT_BLOCK_ID`` / ``FAULT_BEYOND_TABLE`` into it on the device
            (no sync) when a row may see such a key; it never clears it.

    Returns:
        ``(out [B, S_q, H, Dv] in q's dtype, lse [B, S_q, H] float32)``; rows with no visible
        key get out 0 and lse -inf; rows that see a NaN/infinite score or a key that cannot
        be read get out and lse NaN.
    """
    batch, q_len, num_heads, _ = q.shape
    if kv_cache.shape[0] < 1:
        # The kernel redirects bad block ids to the last block: there must be one.
        raise ValueError(
            f"mla_decode: kv_cache must hold at least one block, got {tuple(kv_cache.shape)}"
        )
    if fault_flag is not None and (
        not isinstance(fault_flag, torch.Tensor)
        or fault_flag.dtype != torch.int32
        or tuple(fault_flag.shape) != (1,)
        or fault_flag.device != q.device
    ):
        got = (
            f"{tuple(fault_flag.shape)} {fault_flag.dtype} on {fault_flag.device}"
            if isinstance(fault_flag, torch.Tensor)
            else type(fault_flag).__name__
        )
        raise ValueError(
            f"mla_decode: fault_flag must be an int32 tensor of shape [1] on q's device "
            f"({q.device}) or None, got {got}"
        )
    # The kernel indexes q's last dim, a block-table row and the lengths with unit stride.
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    cache_seqlens = cache_seqlens.contiguous()
    target = triton_target()
    if target is None:
        raise RuntimeError(
            "mla_decode (Triton): no Triton target on this machine; set TRITON_INTERPRET=1 "
            "to run the interpreter on CPU"
        )
    if config is None:
        config = default_config(target, num_heads=num_heads, q_len=q_len, kv_dtype=kv_cache.dtype)
    config = _group_config(config, q_len * num_heads)
    rows = q_len * num_heads
    num_groups = triton.cdiv(rows, config.block_h)
    if num_kv_splits is None:
        num_kv_splits = plan_num_kv_splits(
            cache_seqlens, q_len, num_heads, config, target, kv_dtype=kv_cache.dtype
        )
    elif isinstance(num_kv_splits, bool) or not isinstance(num_kv_splits, int) or num_kv_splits < 1:
        raise ValueError(
            f"mla_decode: num_kv_splits must be an int >= 1 or None, got {num_kv_splits!r}"
        )

    out = torch.empty(batch, q_len, num_heads, head_dim_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, q_len, num_heads, dtype=torch.float32, device=q.device)
    if num_kv_splits == 1:
        part_out, part_lse = out.unsqueeze(0), lse.unsqueeze(0)
        rows_padded = False
    else:
        part_out, part_lse, rows_padded = _partials(
            num_kv_splits,
            batch,
            q_len,
            num_heads,
            head_dim_v,
            num_groups * config.block_h,
            q.device,
        )

    dot_types = _dot_types(q.dtype, kv_cache.dtype, target, config)
    q_in, q_scale = _stage1_q(q, kv_cache.dtype, dot_types, target)
    grid, args, kwargs = _stage1_arguments(
        q_in,
        q_scale,
        kv_cache,
        block_table,
        cache_seqlens,
        part_out,
        part_lse,
        fault_flag,
        head_dim_v=head_dim_v,
        softmax_scale=softmax_scale,
        causal=causal,
        kv_scale=kv_scale,
        num_groups=num_groups,
        num_kv_splits=num_kv_splits,
        config=config,
        target=target,
        dot_types=dot_types,
        rows_padded=rows_padded,
    )
    _mla_decode_stage1[grid](*args, **kwargs)
    if num_kv_splits > 1:
        launch_merge(
            part_out.view(num_kv_splits, batch, rows, head_dim_v),
            part_lse.view(num_kv_splits, batch, rows),
            out.view(batch * rows, head_dim_v),
            lse.view(batch * rows),
            target,
        )
    return out, lse
