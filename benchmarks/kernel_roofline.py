"""Kernel roofline: our MLA decode backends beside peer kernels, as % of bandwidth and compute peak.

Two modes.

``--gpu``: the issue-37 ratio table on one GPU (``GPU_CASES``: the shapes of the H200 table,
plus the verify windows S_q 1-8 at H16 and H128 and the fp8/bf16 pairs), one row per shape,
every column side by side in one run on identical inputs:

- ``ours``: the planned call, ``rocm_mla.mla_decode(..., plan=plan)`` with ``plan =
  plan_decode(lengths, ..., backend="triton")`` made once outside the timed region (host
  schedule of the exact lengths, as an engine plans once per step);
- ``ours_graph``: ``replan_decode(plan, lengths)`` + the planned call, captured once in a
  CUDA/HIP graph and replayed, as vLLM runs a decode step (``plan`` made with
  ``graph_max_seqlen``: the device planner balances each replay);
- ``flashmla`` / ``flashmla_graph``: ``flash_mla_with_kvcache`` (bf16 cache, page 64), eager
  and replayed from a graph;
- ``vllm`` / ``vllm_graph``: vLLM's Triton MLA ``decode_attention_fwd`` set up as its
  ``TritonMLAImpl.forward_mqa`` sets it up, eager and replayed.

Ratios, time(peer) / time(ours) (above 1: we are faster), per column: ``vs_flashmla``,
``vs_flashmla_graph``, ``vs_vllm``, ``vs_vllm_graph``; on an fp8 row ``fp8_over_bf16`` (and
``_graph``): our bf16 time of the same shape / our fp8 time. Per timed column: % of the copy
bandwidth measured in the run (bytes read + written by a 2 GiB device copy) and % of the
datasheet (4.8 TB/s on an H200). Each row records the plan it ran
(``common.triton_plan``: config, slots, residency, segments, partials, Triton version,
device) and the stage-1 kernel as launched (``common.Stage1Kernels``: registers, spills,
shared memory, the residency they give), and checks our output against FlashMLA's (else
vLLM's) and the replayed output against the planned one. ``--compare OLD.json`` prints, per
shape, whether an earlier run planned the same launch and the time ratio. A compact text
table is printed last, with the acceptance lines of issue 37 (>= 0.9x FlashMLA at H16/H128
S_q 1-8, >= 0.85x at H128 S_q 1, fp8/bf16 >= 1.6x at H16 and 1.3x at H128).
Timing: ``common.device_time`` (``triton.testing.do_bench``, L2 flushed before each call,
median). ``--budget-s`` skips the shapes left once the run has taken that long (recorded).
``--dry-run`` runs the same code on the CPU under the Triton interpreter on tiny shapes
(no graphs there: the replayed column runs eagerly, and says so), to check it without a GPU;
the interpreter truncates bf16, so a real peer kernel run there (vLLM's) fails the check.

Grid mode (``--grid full|tiny``, the default): every available backend of the registry
(``triton``, ``torch``, ``aiter``), one row per backend and case. The Triton one is timed on
its planned path: ``plan_launch`` (config from the tuned table, resident slots from the
occupancy) and the balanced schedule of the case's lengths (``host_schedule``) are made once
per case outside the timed region, and the timed call passes both, so it launches stage 1
and the merge of the cut units with no host sync. ``aiter`` is AITER's ``mla_decode_fwd`` on
ROCm, through our ``aiter`` backend.

Peers, when they load (any failure is a skip reason, never the end of the run):

- vLLM's Triton MLA: ``--vllm-triton PATH`` / ``$ROCM_MLA_VLLM_TRITON`` (a file defining
  ``decode_attention_fwd``, such as vLLM 0.33's ``vllm/v1/attention/ops/
  triton_decode_attention.py`` with its two vllm imports replaced), else
  ``vllm_triton_decode.py`` in ``$ROCM_MLA_FLASH_MLA``'s folder, else vLLM's modules
  (``vllm.v1.attention.ops`` since 0.33, ``vllm.attention.ops`` before). Its split count is
  vLLM's ``_compute_num_kv_splits`` when vLLM is installed, else 0.33's rule (the next power
  of two of max_len / 512, at most 2 per SM).
- FlashMLA: ``flash_mla_with_kvcache`` + ``get_mla_metadata`` from a
  ``flash_mla_interface`` module: ``--flash-mla PATH`` / ``$ROCM_MLA_FLASH_MLA`` (a file or
  folder), else ``flash_mla`` or vLLM's bundled ``vllm.third_party.flashmla``; bf16 cache,
  block 64 (its fp8 cache format is not a per-tensor-scaled e4m3 cache).

The roofline numbers:

    bytes  = sum(len) * D * kv_bytes + B * S_q * H * (D * q_bytes + Dv * out_bytes)
    FLOPs  = S_q * sum(len) * H * 2 * (D + Dv)           (QK^T over D, PV over Dv)
    % peak bandwidth = bytes / time / peak bandwidth
    % peak compute   = FLOPs / time / dense peak (bf16, or fp8 for an fp8 cache)
    % roofline       = max(bytes / bandwidth, FLOPs / compute) / time

and in grid mode ``vs_best_peer`` = best peer time / this time (> 1: faster than every peer).

Writes ``kernel-roofline-<device>-<date>.json`` and a PNG to ``--out`` (default
``benchmarks/results/``).
Run: ``python -m benchmarks.kernel_roofline [--gpu | --dry-run | --grid full|tiny] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import inspect
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks import common

HEAD_DIM, HEAD_DIM_V = 576, 512
PEERS = ("vllm-triton", "flashmla")


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    context: int
    heads: int
    q_len: int
    kv_kind: str  #: "bf16", "fp8"
    lengths: str = "uniform"  #: "uniform" (all = context), "mixed" (mean = context)

    def label(self) -> str:
        text = f"B{self.batch} ctx{self.context // 1024}K H{self.heads}"
        if self.context < 1024:
            text = f"B{self.batch} ctx{self.context} H{self.heads}"
        if self.q_len > 1:
            text += f" S_q{self.q_len}"
        if self.kv_kind != "bf16":
            text += f" {self.kv_kind}"
        return text + ("" if self.lengths == "uniform" else f" {self.lengths}")


def grid(batches, contexts, heads, q_lens, kv_kinds, lengths) -> list[Case]:
    return [
        Case(b, c, h, s, k, n)
        for b, c, n, k, h, s in itertools.product(
            batches, contexts, lengths, kv_kinds, heads, q_lens
        )
    ]


#: The ``--gpu`` shapes: issue 37's H200 table in its order (a run cut short by its budget loses
#: the last ones), then the verify windows its acceptance needs at S_q 1-8 (H16 at B32 ctx16K,
#: H128 at B64 ctx8K; S_q 1 and the table's S_q 4 / 2 are above).
GPU_CASES = [
    Case(128, 32768, 16, 1, "bf16"),
    Case(64, 8192, 16, 1, "bf16"),
    Case(32, 16384, 16, 1, "bf16"),
    Case(128, 4096, 16, 1, "bf16"),
    Case(8, 32768, 16, 1, "bf16"),
    Case(1, 32768, 16, 1, "bf16"),
    Case(128, 32768, 128, 1, "bf16"),
    Case(64, 8192, 128, 1, "bf16"),
    Case(32, 16384, 128, 1, "bf16"),
    Case(32, 16384, 16, 4, "bf16"),
    Case(64, 8192, 128, 2, "bf16"),
    Case(128, 16384, 16, 1, "bf16"),  # the bf16 twin of the fp8 row below
    Case(128, 16384, 16, 1, "fp8"),
    Case(64, 8192, 128, 1, "fp8"),  # its bf16 twin is B64 ctx8K H128 above
    Case(32, 16384, 16, 2, "bf16"),
    Case(32, 16384, 16, 8, "bf16"),
    Case(64, 8192, 128, 4, "bf16"),
    Case(64, 8192, 128, 8, "bf16"),
]
#: ``--dry-run``: the ``--gpu`` code on the CPU (Triton interpreter), a bf16 / fp8 pair and a
#: verify window, small enough for seconds.
DRY_RUN_CASES = [
    Case(2, 130, 16, 1, "bf16"),
    Case(2, 130, 16, 1, "fp8"),
    Case(2, 130, 16, 2, "bf16"),
]
#: Issue 37's acceptance on the ``--gpu`` table: ours / FlashMLA at S_q 1-8 (H16 and H128),
#: at H128 S_q 1, and our fp8 over our bf16 speed per head count.
TARGETS = {
    "vs_flashmla_sq1_8": 0.9,
    "vs_flashmla_h128_sq1": 0.85,
    "fp8_over_bf16": {16: 1.6, 128: 1.3},
}
#: Output agreement with the peer (max |ours - peer| / max |peer|): bf16 rounding on both
#: sides; fp8 adds our fp8 dots' rounding of q and P, which vLLM's kernel does not do.
TOL = {"bf16": 2e-2, "fp8": 1e-1}

PRESETS = {
    "gpu": GPU_CASES,
    "dry-run": DRY_RUN_CASES,
    "full": grid(
        (1, 8, 32, 128),
        (1024, 4096, 16384, 32768),
        (16, 128),
        (1, 2, 4),
        ("bf16", "fp8"),
        ("uniform", "mixed"),
    ),
    # A 2-core CPU decodes B=128 x 32K in minutes per call; this keeps the run to a minute.
    "tiny": grid((1, 4), (1024, 4096), (16,), (1, 2), ("bf16", "fp8"), ("uniform", "mixed")),
    # The Triton interpreter runs each program in Python: one small case per dtype.
    "interpreter": grid((1,), (256,), (16,), (1,), ("bf16", "fp8"), ("uniform",)),
}


def lengths_for(kind: str, batch: int, context: int, gen: torch.Generator) -> torch.Tensor:
    """[B] int32: all ``context`` (uniform), or ~N(context, context/2) clipped to [1, 2 context]."""
    if kind == "uniform":
        return torch.full((batch,), context, dtype=torch.int32)
    lens = torch.normal(float(context), context / 2, (batch,), generator=gen)
    return lens.round().clamp(1, 2 * context).to(torch.int32)


def fp8_dtype() -> torch.dtype:
    """The platform's fp8 flavour (its registry record's: e4m3fnuz on MI300X, e4m3fn
    elsewhere; the CPU takes e4m3fn)."""
    from rocm_mla.platform import current_platform
    from rocm_mla.targets import target_spec

    here = current_platform()
    if here.kind == "cpu":
        return torch.float8_e4m3fn
    return target_spec(here.kind, here.arch).fp8_dtype or torch.float8_e4m3fn


def build_cache(lens: torch.Tensor, kind: str, block_size: int, device: str, seed: int):
    """A shuffled paged cache holding ``lens`` tokens per request: (kv, block_table, kv_scale)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-int(n) // block_size) for n in lens]
    max_blocks, num_blocks = max(max(blocks), 1), max(sum(blocks), 1)
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(blocks), max_blocks, dtype=torch.int32)
    cursor = 0
    for b, n in enumerate(blocks):
        table[b, :n] = perm[cursor : cursor + n].to(torch.int32)
        cursor += n
    kv = torch.randn(num_blocks, block_size, HEAD_DIM, dtype=torch.bfloat16, device=device)
    scale = None
    if kind == "fp8":
        scale = 0.05
        kv = (kv / scale).to(fp8_dtype())
    return kv, table.to(device), scale


class CacheFlush:
    """Evicts the kernel's inputs from every cache level before a timed call.

    GPUs: rewrite a buffer larger than L2 + MI300X's 256 MB Infinity Cache. CPUs: a buffer
    larger than the last-level cache.
    """

    def __init__(self, device: str) -> None:
        nbytes = (512 << 20) if device != "cpu" else (64 << 20)
        self.buffer = torch.empty(nbytes // 4, dtype=torch.float32, device=device)

    def __call__(self) -> None:
        self.buffer.zero_()


def kernel_time(fn, flush: CacheFlush, *, device: str, warmup: int, repeats: int) -> float:
    """Median seconds of ``fn()``: GPU events around the call only, or wall time on CPU."""
    if device == "cpu":
        return common.median_time(fn, repeats=repeats, warmup=warmup, before=flush)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def roofline(lens: torch.Tensor, heads: int, q_len: int, kv: torch.Tensor, q_dtype) -> dict:
    total_len = int(lens.sum())
    queries = lens.shape[0] * q_len
    q_bytes = torch.empty((), dtype=q_dtype).element_size()
    nbytes = (
        total_len * HEAD_DIM * kv.element_size()
        + queries * heads * HEAD_DIM * q_bytes
        + queries * heads * HEAD_DIM_V * q_bytes
    )
    flops = q_len * total_len * heads * 2 * (HEAD_DIM + HEAD_DIM_V)
    return {"bytes": nbytes, "flops": flops, "sum_len": total_len}


def peak_compute(name: str) -> tuple[float, float] | None:
    """Dense (bf16, fp8) FLOP/s of a known GPU (the registry's products' datasheets), else
    None."""
    from rocm_mla.targets import find_product

    product = find_product(name)
    if product is None or product.matrix_flops is None:
        return None
    return product.matrix_flops["16bit"], product.matrix_flops["fp8"]


# ---- ours ------------------------------------------------------------------------------------


def planned_triton(problem, lens_host: torch.Tensor):
    """Our Triton decode on its planned path: (call, plan description)."""
    from rocm_mla.kernels import mla_decode as kernel
    from rocm_mla.kernels.schedule import host_schedule
    from rocm_mla.kernels.target import triton_target

    target = triton_target()
    q_len, heads = problem.q.shape[1], problem.q.shape[2]
    kv = problem.kv_cache
    config, slots = kernel.plan_launch(
        q_len=q_len,
        num_heads=heads,
        kv_dtype=kv.dtype,
        target=target,
        q_dtype=problem.q.dtype,
        head_dim=problem.q.shape[3],
        head_dim_v=problem.head_dim_v,
        page_size=kv.shape[1],
        cache_bytes=kv.numel() * kv.element_size(),
    )
    schedule = host_schedule(
        [int(v) for v in lens_host.tolist()],
        num_groups=-(-(q_len * heads) // config.block_h),
        num_slots=slots,
        capacity_keys=problem.block_table.shape[1] * kv.shape[1],
        num_pools=config.num_xcds,
        device=problem.q.device,
    )
    entry = kernel.table_entry(target, num_heads=heads, q_len=q_len, kv_dtype=kv.dtype)

    def call():
        return kernel.mla_decode(
            problem.q,
            problem.kv_cache,
            problem.block_table,
            problem.cache_seqlens,
            head_dim_v=problem.head_dim_v,
            softmax_scale=problem.softmax_scale,
            causal=problem.causal,
            kv_scale=problem.kv_scale,
            config=config,
            schedule=schedule,
        )

    return call, {
        "config": config.to_dict(),
        "num_slots": slots,
        "used_slots": schedule.used_slots,
        "num_partials": schedule.num_partials,
        "source": entry.source,
    }


def registry_backends(requested: list[str] | None, interpreter: bool) -> dict[str, type]:
    from rocm_mla.backends import available_backends, backend_class

    chosen = {}
    for name, reason in available_backends().items():
        if requested and name not in requested:
            continue
        if reason is not None:
            print(f"skip backend {name}: {reason}", file=sys.stderr)
            continue
        cls = backend_class(name)
        if cls.target() and cls.target().startswith("interpreter") and not interpreter:
            print(f"skip backend {name}: {cls.target()} (pass --interpreter)", file=sys.stderr)
            continue
        chosen[name] = cls
    return chosen


# ---- peers -----------------------------------------------------------------------------------


#: A file defining vLLM's ``decode_attention_fwd`` (see the module docstring).
VLLM_TRITON_ENV = "ROCM_MLA_VLLM_TRITON"
#: That file's name beside FlashMLA's interface in a device bundle (``$ROCM_MLA_FLASH_MLA``).
VLLM_TRITON_FILE = "vllm_triton_decode.py"


def _load_file(name: str, file: Path):
    """The module in ``file``, or the reason it does not load."""
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or not file.is_file():
        return None, f"{file}: no such file"
    module = importlib.util.module_from_spec(spec)
    # Registered first, as an import would: code that looks its module up by name
    # (dataclasses, pickling) finds it.
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the peer is optional
        del sys.modules[name]
        return None, f"{file}: {type(exc).__name__}: {exc}"
    return module, None


def vllm_decode_attention(path: str | None = None):
    """vLLM's Triton MLA ``decode_attention_fwd`` and where it came from, or None and why not.

    Looked for in order: ``path`` (``--vllm-triton``), ``$ROCM_MLA_VLLM_TRITON``,
    ``vllm_triton_decode.py`` in ``$ROCM_MLA_FLASH_MLA``'s folder (a device bundle's peers),
    then vLLM's modules. A named file that does not load is the answer (no silent fall back
    to another copy).
    """
    path = path or os.environ.get(VLLM_TRITON_ENV)
    if path:
        module, reason = _load_file("vllm_triton_decode", Path(path))
        if module is None:
            return None, reason
        if not hasattr(module, "decode_attention_fwd"):
            return None, f"{path}: defines no decode_attention_fwd"
        return module.decode_attention_fwd, path
    flash = os.environ.get("ROCM_MLA_FLASH_MLA")
    if flash:
        folder = Path(flash) if Path(flash).is_dir() else Path(flash).parent
        if (folder / VLLM_TRITON_FILE).is_file():
            return vllm_decode_attention(str(folder / VLLM_TRITON_FILE))
    reasons = []
    for module in (
        "vllm.v1.attention.ops.triton_decode_attention",
        "vllm.attention.ops.triton_decode_attention",
    ):
        try:
            return importlib.import_module(module).decode_attention_fwd, module
        except Exception as exc:  # any import failure means "not here"
            reasons.append(f"{module}: {type(exc).__name__}: {exc}")
    return None, "; ".join(reasons)


#: vLLM 0.33's split rule (``TritonMLAImpl``): the next power of two of max_len / 512 keys,
#: at most 2 per SM. Used when the kernel came from a file and vLLM is not installed.
VLLM_MIN_KEYS_PER_SPLIT = 512
VLLM_SPLITS_PER_SM = 2


def vllm_num_kv_splits(max_len: int, num_sms: int) -> tuple[int, str]:
    """vLLM's split count for this batch and where the rule came from: its own
    ``_compute_num_kv_splits`` when vLLM is installed, else 0.33's rule."""
    try:
        module = importlib.import_module("vllm.v1.attention.backends.mla.triton_mla")
        choose = module._compute_num_kv_splits
    except Exception:  # not installed, or a layout without the function: 0.33's rule
        ideal = 1 << max(0, (max(1, max_len // VLLM_MIN_KEYS_PER_SPLIT) - 1).bit_length())
        return min(ideal, VLLM_SPLITS_PER_SM * num_sms), "vLLM 0.33's rule"
    return choose(max_len, num_sms), "vllm.v1.attention.backends.mla.triton_mla"


def vllm_call(fn, problem, lens_host: torch.Tensor):
    """``decode_attention_fwd`` set up as vLLM 0.33's ``TritonMLAImpl.forward_mqa`` sets it up:
    ``(call, None, splits)``, or ``(None, reason, None)``.

    S_q > 1 is flattened as it does: one row per (request, position), the block table
    repeated, and row ``t`` of a window of ``S_q`` seeing ``len - S_q + 1 + t`` keys. That
    per-call metadata is built once here, outside the timed call. The call returns ``(out
    [B, S_q, H, Dv], lse)``.
    """
    q = problem.q
    if q.dtype not in (torch.float16, torch.bfloat16):
        return None, f"vLLM's Triton MLA takes fp16/bf16 q, got {q.dtype}", None
    batch, q_len, heads, dim = q.shape
    rows = q.reshape(batch * q_len, heads, dim)
    table, lens = problem.block_table, problem.cache_seqlens
    if q_len > 1:
        table = table.repeat_interleave(q_len, dim=0)
        offsets = torch.arange(1 - q_len, 1, device=lens.device, dtype=lens.dtype)
        lens = (lens.unsqueeze(1) + offsets).flatten().clamp(min=0)
    num_sms = (
        torch.cuda.get_device_properties(q.device).multi_processor_count
        if q.device.type == "cuda"
        else 1
    )
    splits, rule = vllm_num_kv_splits(int(lens_host.max()), num_sms)
    kv4 = problem.kv_cache.unsqueeze(2)  # [blocks, page, 1, D]
    o = torch.zeros(batch * q_len, heads, HEAD_DIM_V, dtype=q.dtype, device=q.device)
    lse = torch.zeros(batch * q_len, heads, dtype=q.dtype, device=q.device)
    logits = torch.empty(
        batch * q_len, heads, splits, HEAD_DIM_V + 1, dtype=torch.float32, device=q.device
    )
    params = inspect.signature(fn).parameters
    kwargs = {"is_mla": True} if "is_mla" in params else {}
    if problem.kv_scale is not None:
        if "k_scale" not in params:
            return None, "this vLLM's decode_attention_fwd has no fp8 k_scale", None
        scale = torch.tensor(problem.kv_scale, dtype=torch.float32, device=q.device)
        kwargs["k_scale"] = scale
        if "v_scale" in params:
            kwargs["v_scale"] = scale
    head = (rows, kv4, kv4[..., :HEAD_DIM_V], o) + ((lse,) if "lse" in params else ())
    tail = (table, lens, logits, splits, problem.softmax_scale, kv4.shape[1])

    def call():
        fn(*head, *tail, **kwargs)
        return o.view(batch, q_len, heads, HEAD_DIM_V), lse

    return call, None, {"splits": splits, "splits_rule": rule}


def flash_mla_module(path: str | None):
    """``flash_mla_interface`` (get_mla_metadata, flash_mla_with_kvcache), or the reason not."""
    path = path or os.environ.get("ROCM_MLA_FLASH_MLA")
    if path:
        file = Path(path)
        if file.is_dir():
            file = file / "flash_mla_interface.py"
        if not file.is_file():
            return None, f"--flash-mla {path}: no flash_mla_interface.py there"
        return _load_file("flash_mla_interface", file)
    reason = "not found"
    for name in ("flash_mla", "vllm.third_party.flashmla.flash_mla_interface"):
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # the peer is optional
            reason = f"{name}: {type(exc).__name__}: {exc}"
            continue
        if hasattr(module, "flash_mla_with_kvcache"):
            return module, None
    return None, reason


def flash_mla_call(module, problem):
    q, kv = problem.q, problem.kv_cache
    if problem.kv_scale is not None:
        return None, "FlashMLA's fp8 cache is its own 656-byte format, not a scaled e4m3 cache"
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        return None, "FlashMLA dense decode takes bf16 q and cache"
    if kv.shape[1] != 64:
        return None, f"FlashMLA needs block size 64, got {kv.shape[1]}"
    q_len, heads = q.shape[1], q.shape[2]
    # The old interface plans here; the new one on the first call (in the untimed warmup).
    meta, num_splits = module.get_mla_metadata(problem.cache_seqlens, q_len * heads, 1)
    kv4 = kv.unsqueeze(2)

    def call():
        return module.flash_mla_with_kvcache(
            q,
            kv4,
            problem.block_table,
            problem.cache_seqlens,
            HEAD_DIM_V,
            meta,
            num_splits,
            softmax_scale=problem.softmax_scale,
            causal=problem.causal,
        )

    return call, None


# ---- the --gpu table -------------------------------------------------------------------------

#: The timed columns of a ``--gpu`` row (module docstring).
COLUMNS = ("ours", "ours_graph", "flashmla", "flashmla_graph", "vllm", "vllm_graph")
#: time(peer column) / time(our column): the ratios of a row (> 1: ours faster).
PEER_RATIOS = {
    "vs_flashmla": ("flashmla", "ours"),
    "vs_flashmla_graph": ("flashmla_graph", "ours_graph"),
    "vs_vllm": ("vllm", "ours"),
    "vs_vllm_graph": ("vllm_graph", "ours_graph"),
}
BLOCK_SIZE = 64  #: FlashMLA's only page size


@dataclasses.dataclass
class Peers:
    """The peers of a ``--gpu`` run: each its callable (None if absent) and where it came from,
    or why not."""

    flash: object | None = None  #: a flash_mla_interface module
    flash_source: str | None = None
    vllm: object | None = None  #: vLLM's decode_attention_fwd
    vllm_source: str | None = None

    @classmethod
    def load(cls, flash_path: str | None, vllm_path: str | None) -> Peers:
        flash, flash_reason = flash_mla_module(flash_path)
        vllm, vllm_source = vllm_decode_attention(vllm_path)
        return cls(
            flash=flash,
            flash_source=flash_reason if flash is None else getattr(flash, "__file__", "module"),
            vllm=vllm,
            vllm_source=vllm_source,
        )

    def describe(self) -> dict:
        return {
            "flashmla": {"loaded": self.flash is not None, "source": self.flash_source},
            "vllm": {"loaded": self.vllm is not None, "source": self.vllm_source},
        }


def graph_replay(fn, device: str):
    """``fn`` captured once in a CUDA/HIP graph: ``(replay, output)`` (each replay rewrites the
    output). On a CPU there are no graphs: ``fn`` itself and its output, run eagerly."""
    if device == "cpu":
        return fn, fn()
    from rocm_mla.engine.graphs import cuda_graph_capture

    return cuda_graph_capture(fn)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (NaN anywhere: inf)."""
    out, ref = out.float(), ref.float()
    if torch.isnan(out).any() or torch.isnan(ref).any():
        return math.inf
    scale = float(ref.abs().max())
    diff = float((out - ref).abs().max())
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def case_inputs(case: Case, seed: int, device: str, block_size: int = BLOCK_SIZE):
    """``case``'s inputs, the same for every caller with the same seed: ``(lens_host [B]
    int32 on the CPU, lens on ``device``, q [B, S_q, H, 576] bf16, kv, block table,
    kv_scale)``."""
    gen = torch.Generator().manual_seed(seed)
    lens_host = lengths_for(case.lengths, case.batch, case.context, gen)
    kv, table, kv_scale = build_cache(lens_host, case.kv_kind, block_size, device, seed)
    q = torch.randn(
        case.batch, case.q_len, case.heads, HEAD_DIM, dtype=torch.bfloat16, device=device
    )
    return lens_host, lens_host.to(device), q, kv, table, kv_scale


def plan_kwargs(case: Case, q: torch.Tensor, kv: torch.Tensor, lens: torch.Tensor) -> dict:
    """``plan_decode``'s arguments for ``case`` but the lengths; the plan's device is the
    lengths' own (cuda:0, not cuda), as an engine passes it."""
    return {
        "q_len": case.q_len,
        "num_heads": case.heads,
        "kv_dtype": kv.dtype,
        "q_dtype": q.dtype,
        "device": lens.device,
        "backend": "triton",
    }


def prepare_decode_unchecked(q, kv, table, lens, kv_scale):
    """The ``DecodeProblem`` the peers are called with (shapes checked, values not)."""
    from rocm_mla.inputs import prepare_decode

    return prepare_decode(
        q,
        kv,
        table,
        lens,
        head_dim_v=HEAD_DIM_V,
        softmax_scale=None,
        causal=True,
        kv_scale=kv_scale,
        check_values=False,
    )


def gpu_row(
    case: Case,
    seed: int,
    *,
    device: str,
    peers: Peers,
    stage1: common.Stage1Kernels,
    warmup_ms: float,
    rep_ms: float,
    block_size: int = BLOCK_SIZE,
) -> dict:
    """One ``--gpu`` row: every column of ``case`` timed, the plans recorded, the checks."""
    import rocm_mla

    lens_host, lens, q, kv, table, kv_scale = case_inputs(case, seed, device, block_size)
    row = {
        "case": case.label(),
        **dataclasses.asdict(case),
        "kv_dtype": str(kv.dtype).removeprefix("torch."),
        "block_size": block_size,
        **roofline(lens_host, case.heads, case.q_len, kv, q.dtype),
        "times_us": dict.fromkeys(COLUMNS),
        "skipped": {},
    }
    timings = row["times_us"]

    def timed(name: str, fn) -> None:
        seconds = common.device_time(fn, device=device, warmup_ms=warmup_ms, rep_ms=rep_ms)
        timings[name] = round(seconds * 1e6, 3)

    plan_args = plan_kwargs(case, q, kv, lens)
    record_args = {"num_heads": case.heads, "q_len": case.q_len, "kv_dtype": kv.dtype}

    row.update(plan=None, graph_plan=None, graph=None)
    # Ours failing on one shape is that row's failed check, not the end of a one-call run.
    try:
        plan = rocm_mla.plan_decode(lens_host, block_table=table, kv_cache=kv, **plan_args)

        def planned():
            return rocm_mla.mla_decode(q, kv, table, lens, kv_scale=kv_scale, plan=plan)

        stage1.before()
        ours_out, _ = planned()  # compiles, outside the timing
        _sync(device)
        launched = stage1.after(shape=(case.heads, case.q_len, case.kv_kind))
        row["plan"] = {**common.triton_plan(plan.launch, **record_args), "launched": launched}
        timed("ours", planned)
    except Exception as exc:
        row["skipped"]["ours"] = f"failed: {type(exc).__name__}: {exc}"
        row["check"] = {"ok": False, "reference": None, "error": row["skipped"]["ours"]}
        return row

    # As vLLM runs a step: the plan holds for any lengths up to the table's capacity, and
    # each replay re-plans on the device before the decode.
    graph_out = None
    try:
        graph_plan = rocm_mla.plan_decode(
            lens_host, graph_max_seqlen=table.shape[1] * block_size, **plan_args
        )

        def step():
            rocm_mla.replan_decode(graph_plan, lens)
            return rocm_mla.mla_decode(q, kv, table, lens, kv_scale=kv_scale, plan=graph_plan)

        replay, (graph_out, _) = graph_replay(step, device)
        row["graph"] = "captured" if device != "cpu" else "eager: no graphs on the CPU"
        row["graph_plan"] = common.triton_plan(graph_plan.launch, **record_args)
        timed("ours_graph", replay)
    except Exception as exc:
        row["skipped"]["ours_graph"] = f"failed: {type(exc).__name__}: {exc}"

    problem = prepare_decode_unchecked(q, kv, table, lens, kv_scale)
    references = {}
    makers = {
        "flashmla": (
            peers.flash,
            peers.flash_source,
            lambda: (*flash_mla_call(peers.flash, problem), None),
        ),
        "vllm": (peers.vllm, peers.vllm_source, lambda: vllm_call(peers.vllm, problem, lens_host)),
    }
    for name, (impl, source, make) in makers.items():
        if impl is None:
            row["skipped"][name] = f"not loaded: {source}"
            continue
        out = _peer_columns(row, name, make, timed, device)
        if out is not None:
            references[name] = out

    _sync(device)
    tol = TOL[case.kv_kind]
    check = {
        "tolerance": tol,
        "graph_vs_planned": None if graph_out is None else _rel_err(graph_out, ours_out),
        "reference": next(iter(references), None),
    }
    errors = [] if check["graph_vs_planned"] is None else [check["graph_vs_planned"]]
    if check["reference"] is not None:
        check["out_rel_err"] = _rel_err(ours_out, references[check["reference"]])
        errors.append(check["out_rel_err"])
    check["ok"] = "ours_graph" not in row["skipped"] and all(e <= tol for e in errors)
    row["check"] = check
    return row


def _peer_columns(row: dict, name: str, make, timed, device: str) -> torch.Tensor | None:
    """Time a peer eagerly and replayed from a graph; any failure is that column's skip
    reason (a peer must not end the run). Returns its output for the check."""
    try:
        call, reason, info = make()
        if call is None:
            row["skipped"][name] = reason
            return None
        if info:
            row[name] = info
        out = call()[0].clone()  # compiles / plans, outside the timing
        timed(name, call)
    except Exception as exc:
        row["skipped"][name] = f"failed: {type(exc).__name__}: {exc}"
        return None
    try:
        replay, _ = graph_replay(call, device)
        timed(f"{name}_graph", replay)
    except Exception as exc:
        row["skipped"][f"{name}_graph"] = f"graph failed: {type(exc).__name__}: {exc}"
    return out


def add_gpu_ratios(rows: list[dict], copy_bw: float, datasheet_bw: float | None) -> None:
    """Per row: ``ratios`` (``PEER_RATIOS``, and ``fp8_over_bf16`` / ``_graph`` on an fp8 row
    whose bf16 twin ran) and, per timed column, ``pct_copy`` / ``pct_datasheet``."""
    twins = {
        (r["batch"], r["context"], r["heads"], r["q_len"], r["lengths"]): r
        for r in rows
        if r["kv_kind"] == "bf16"
    }
    for r in rows:
        t = r["times_us"]
        ratios = {
            key: t[peer] / t[mine] if t[peer] and t[mine] else None
            for key, (peer, mine) in PEER_RATIOS.items()
        }
        twin = twins.get((r["batch"], r["context"], r["heads"], r["q_len"], r["lengths"]))
        if r["kv_kind"] == "fp8":
            for col, key in (("ours", "fp8_over_bf16"), ("ours_graph", "fp8_over_bf16_graph")):
                theirs = twin["times_us"][col] if twin else None
                ratios[key] = theirs / t[col] if theirs and t[col] else None
        r["ratios"] = ratios
        r["pct_copy"] = {c: _percent(r["bytes"] / (v * 1e-6), copy_bw) for c, v in t.items() if v}
        r["pct_datasheet"] = None
        if datasheet_bw is not None:
            r["pct_datasheet"] = {
                c: _percent(r["bytes"] / (v * 1e-6), datasheet_bw) for c, v in t.items() if v
            }


def _percent(rate: float, peak: float) -> float:
    """``rate`` as a percentage of ``peak`` to 4 significant digits (not 2 decimals: an
    interpreter run reaches ~1e-4 % of a copy bandwidth, which must not read as 0)."""
    return float(f"{100 * rate / peak:.4g}")


def acceptance(rows: list[dict]) -> list[dict]:
    """Issue 37's targets on the table, per column (planned, replayed): the worst ratio over
    the rows each target covers and whether it holds (None: no row measured it)."""

    def verdict(what: str, target: float, mine: list[dict], keys: tuple[str, str]) -> dict:
        entry = {"what": what, "target": target, "rows": len(mine)}
        for column, key in zip(("planned", "graph"), keys, strict=True):
            values = [r["ratios"][key] for r in mine if r["ratios"].get(key) is not None]
            worst = min(values) if values else None
            entry[f"{column}_min"] = worst
            entry[f"{column}_pass"] = None if worst is None else worst >= target
        return entry

    bf16 = [r for r in rows if r["kv_kind"] == "bf16" and 1 <= r["q_len"] <= 8]
    flash = ("vs_flashmla", "vs_flashmla_graph")
    out = [
        verdict(
            "ours / FlashMLA, H16 S_q 1-8",
            TARGETS["vs_flashmla_sq1_8"],
            [r for r in bf16 if r["heads"] == 16],
            flash,
        ),
        verdict(
            "ours / FlashMLA, H128 S_q 2-8",
            TARGETS["vs_flashmla_sq1_8"],
            [r for r in bf16 if r["heads"] == 128 and r["q_len"] > 1],
            flash,
        ),
        verdict(
            "ours / FlashMLA, H128 S_q 1",
            TARGETS["vs_flashmla_h128_sq1"],
            [r for r in bf16 if r["heads"] == 128 and r["q_len"] == 1],
            flash,
        ),
    ]
    for heads, target in TARGETS["fp8_over_bf16"].items():
        mine = [r for r in rows if r["kv_kind"] == "fp8" and r["heads"] == heads]
        out.append(
            verdict(
                f"ours fp8 / ours bf16, H{heads}",
                target,
                mine,
                ("fp8_over_bf16", "fp8_over_bf16_graph"),
            )
        )
    return out


def _warm_case(fields: dict, seed: int, vllm_path: str | None, with_vllm: bool) -> str:
    """A ``precompile`` worker: ``gpu_row``'s calls of one shape (ours planned, the graph
    plan's replan + decode, vLLM's), once each, untimed, so that Triton compiles them."""
    import rocm_mla

    case = Case(**fields)
    started = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        lens_host, lens, q, kv, table, kv_scale = case_inputs(case, seed, device)
        kwargs = plan_kwargs(case, q, kv, lens)
        plan = rocm_mla.plan_decode(lens_host, **kwargs)
        rocm_mla.mla_decode(q, kv, table, lens, kv_scale=kv_scale, plan=plan)
        graph_plan = rocm_mla.plan_decode(
            lens_host, graph_max_seqlen=table.shape[1] * BLOCK_SIZE, **kwargs
        )
        rocm_mla.replan_decode(graph_plan, lens)
        rocm_mla.mla_decode(q, kv, table, lens, kv_scale=kv_scale, plan=graph_plan)
        fn, _ = vllm_decode_attention(vllm_path) if with_vllm else (None, None)
        if fn is not None:
            problem = prepare_decode_unchecked(q, kv, table, lens, kv_scale)
            call, _, _ = vllm_call(fn, problem, lens_host)
            if call is not None:
                call()
        _sync(device)
    except Exception as exc:  # the timed run compiles (and reports) what failed here
        return f"{case.label()}: {type(exc).__name__}: {str(exc)[:200]}"
    finally:
        if device != "cpu":
            torch.cuda.empty_cache()
    return f"{case.label()}: {time.perf_counter() - started:.1f} s"


def precompile(
    cases: list[Case], *, workers: int, timeout_s: float, vllm_path: str | None, with_vllm: bool
) -> dict:
    """Compile every shape's kernels in ``workers`` processes side by side before the timed
    run: Triton compiles one kernel at a time on one core, and its on-disk cache then hands
    the timed run each kernel in milliseconds. What is not done in ``timeout_s`` is left to
    the timed run. Returns ``{workers, wall_s, done: [a line per shape]}``."""
    import multiprocessing

    started = time.perf_counter()
    done = []
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers) as pool:
        pending = [
            (case, pool.apply_async(
                _warm_case, (dataclasses.asdict(case), seed, vllm_path, with_vllm)
            ))
            for seed, case in enumerate(cases)
        ]  # fmt: skip
        for case, result in pending:
            left = timeout_s - (time.perf_counter() - started)
            try:
                done.append(result.get(timeout=max(left, 0.01)))
            except multiprocessing.TimeoutError:
                done.append(f"{case.label()}: not done in {timeout_s:g} s")
        pool.terminate()
    return {"workers": workers, "wall_s": round(time.perf_counter() - started, 1), "done": done}


def run_gpu(
    cases: list[Case],
    *,
    device: str,
    peers: Peers,
    budget_s: float,
    warmup_ms: float,
    rep_ms: float,
    precompile_workers: int = 0,
    vllm_path: str | None = None,
) -> dict:
    """The ``--gpu`` table over ``cases`` (in order; those left once ``budget_s`` has passed
    are recorded as skipped), after ``precompile`` with ``precompile_workers`` (0: none)
    for at most 0.6 x ``budget_s``."""
    start = time.perf_counter()
    warmed = None
    if precompile_workers > 0:
        warmed = precompile(
            cases,
            workers=precompile_workers,
            timeout_s=0.6 * budget_s,
            vllm_path=vllm_path,
            with_vllm=peers.vllm is not None,
        )
        print(f"kernel_roofline: precompiled in {warmed['wall_s']} s", file=sys.stderr)
    copy_bw = (
        common.device_copy_bandwidth()
        if device != "cpu"
        else 2 * common.copy_bandwidth(64 << 20, device="cpu")
    )
    datasheet_bw = common.peak_bandwidth() if device != "cpu" else None
    stage1 = common.Stage1Kernels()
    rows, skipped = [], []
    for index, case in enumerate(cases):
        if time.perf_counter() - start > budget_s:
            skipped.append({"case": case.label(), "reason": f"time budget {budget_s} s"})
            continue
        common.progress(index, len(cases), case.label())
        rows.append(
            gpu_row(
                case,
                index,
                device=device,
                peers=peers,
                stage1=stage1,
                warmup_ms=warmup_ms,
                rep_ms=rep_ms,
            )
        )
        if device != "cpu":
            torch.cuda.empty_cache()
    add_gpu_ratios(rows, copy_bw, datasheet_bw)
    return {
        "benchmark": "kernel-roofline",
        "mode": "gpu" if device != "cpu" else "dry-run",
        "environment": common.environment(),
        "device_kind": device,
        "copy_bandwidth_bytes_per_s": copy_bw,
        "copy_bandwidth_definition": "bytes read + written per second by a device copy far "
        "larger than the caches (2 GiB on a GPU), median",
        "datasheet_bandwidth_bytes_per_s": datasheet_bw,
        "timing": {
            "method": "triton.testing.do_bench: events around each call, L2 flushed before "
            "each (outside the events), median"
            if device != "cpu"
            else "CPU wall time",
            "warmup_ms": warmup_ms,
            "rep_ms": rep_ms,
        },
        "peers": peers.describe(),
        "columns": list(COLUMNS),
        "ratios": "time(peer) / time(ours): "
        + ", ".join(f"{k} = {a} / {b}" for k, (a, b) in PEER_RATIOS.items())
        + "; fp8_over_bf16 = our bf16 twin / our fp8 (per column)",
        "targets": {
            k: v if not isinstance(v, dict) else {str(h): t for h, t in v.items()}
            for k, v in TARGETS.items()
        },
        "formula": "bytes = sum(len)*576*kv_bytes + B*S_q*H*(576*q_bytes + 512*out_bytes); "
        "pct_copy = bytes/time/copy bandwidth; pct_datasheet = bytes/time/datasheet",
        "precompile": warmed,
        "rows": rows,
        "skipped_cases": skipped,
        "acceptance": acceptance(rows),
        "checks_failed": [r["case"] for r in rows if r["check"].get("ok") is False],
        "wall_s": round(time.perf_counter() - start, 1),
    }


#: ``--profile-once``'s default shapes: the two ncu condemned (H128's spills, fp8's
#: byte-wide shared traffic).
PROFILE_CASES = ("B64 ctx8K H128", "B128 ctx16K H16 fp8")


def profile_once(cases: list[Case], peers: Peers, *, device: str = "cuda") -> list[str]:
    """Our planned call and FlashMLA's, twice each per shape (the first compiles), nothing
    timed: a short process for a profiler (``scripts/gpu_check.sh --ncu``). Returns a line
    per call made."""
    import rocm_mla

    done = []
    for seed, case in enumerate(cases):
        lens_host, lens, q, kv, table, kv_scale = case_inputs(case, seed, device)
        plan = rocm_mla.plan_decode(lens_host, **plan_kwargs(case, q, kv, lens))
        for _ in range(2):
            rocm_mla.mla_decode(q, kv, table, lens, kv_scale=kv_scale, plan=plan)
        record = common.triton_plan(
            plan.launch, num_heads=case.heads, q_len=case.q_len, kv_dtype=kv.dtype
        )
        done.append(f"ours {case.label()}: {common.plan_text(record)}")
        if peers.flash is not None:
            problem = prepare_decode_unchecked(q, kv, table, lens, kv_scale)
            call, reason = flash_mla_call(peers.flash, problem)
            if call is None:
                done.append(f"flashmla {case.label()}: skipped: {reason}")
            else:
                for _ in range(2):
                    call()
                done.append(f"flashmla {case.label()}")
        _sync(device)
    return done


def _fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def table_text(payload: dict) -> str:
    """The compact ``--gpu`` table (times in us; ratios > 1: ours faster), the plans, the
    acceptance lines and what was skipped."""
    head = (
        f"{'case':<24} {'ours':>8} {'graph':>8} {'FlashMLA':>8} {'/FMLA':>6} {'/FMLAg':>6} "
        f"{'/vLLM':>6} {'/vLLMg':>6} {'fp8/bf':>6} {'%copy':>6} {'%dsht':>6}  check"
    )
    lines = [head]
    for r in payload["rows"]:
        t, q = r["times_us"], r["ratios"]
        fp8 = q.get("fp8_over_bf16")
        pct_sheet = (r["pct_datasheet"] or {}).get("ours")
        c = r["check"]
        check = "ok" if c["ok"] else "FAIL"
        if c.get("out_rel_err") is not None:
            check += f" {c['out_rel_err']:.1e} vs {c['reference']}"
        lines.append(
            f"{r['case']:<24} {_fmt(t['ours']):>8} {_fmt(t['ours_graph']):>8} "
            f"{_fmt(t['flashmla']):>8} {_fmt(q['vs_flashmla'], '.2f'):>6} "
            f"{_fmt(q['vs_flashmla_graph'], '.2f'):>6} {_fmt(q['vs_vllm'], '.2f'):>6} "
            f"{_fmt(q['vs_vllm_graph'], '.2f'):>6} {_fmt(fp8, '.2f'):>6} "
            f"{_fmt(r['pct_copy'].get('ours')):>6} {_fmt(pct_sheet):>6}  {check}"
        )
    lines.append(
        "(us; ratios = peer time / our time, > 1: ours faster; 'g': graph-replayed columns; "
        "%: of ours planned, copy = "
        f"{payload['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s measured, dsht = datasheet)"
    )
    lines.append("plans (config, slots, residency assumed, segments, partials | as launched):")
    for r in payload["rows"]:
        plan = r["plan"]
        if plan is None:
            lines.append(f"  {r['case']:<24} none: {r['skipped']['ours'][:160]}")
            continue
        warn = ""
        launched = plan["launched"].get("programs_per_cu")
        if launched is not None and launched != plan["programs_per_cu"]:
            warn = f"  RESIDENCY: planned {plan['programs_per_cu']:g}/CU, launched {launched}/CU"
        lines.append(f"  {r['case']:<24} {common.plan_text(plan)}{warn}")
    for a in payload["acceptance"]:
        verdicts = [
            f"{col} min {_fmt(a[f'{col}_min'], '.2f')} "
            f"{'-' if a[f'{col}_pass'] is None else ('PASS' if a[f'{col}_pass'] else 'FAIL')}"
            for col in ("planned", "graph")
        ]
        lines.append(f"{a['what']} >= {a['target']} ({a['rows']} rows): " + ", ".join(verdicts))
    skips: dict[tuple[str, str], list[str]] = {}
    for r in payload["rows"]:
        for name, reason in r["skipped"].items():
            skips.setdefault((name, reason), []).append(r["case"])
    for (name, reason), cases in skips.items():
        where = cases[0] if len(cases) == 1 else f"{len(cases)} shapes"
        lines.append(f"skipped {name} ({where}): {reason[:200]}")
    for s in payload["skipped_cases"]:
        lines.append(f"skipped case {s['case']}: {s['reason']}")
    env = payload["environment"]["plan_inputs"]
    triton_info = env["triton"]
    device_info = env["device"] or {}
    lines.append(
        f"device {device_info.get('name', payload['environment']['device'])} "
        f"({device_info.get('multi_processor_count', '-')} CUs), triton "
        f"{triton_info['version']} at {triton_info['path']}, ptxas {triton_info['ptxas']}, "
        f"env {env['env']}"
    )
    return "\n".join(lines)


def compare_text(old: dict, new: dict) -> str:
    """Per shape in both ``--gpu`` payloads: the same plan or not, and new / old time."""
    before = {r["case"]: r for r in old.get("rows", [])}
    lines = [f"vs {old['environment']['date']} ({old['environment'].get('triton')}):"]
    for r in new["rows"]:
        o = before.get(r["case"])
        if o is None or o["plan"] is None or r["plan"] is None:
            continue
        same = o["plan"]["fingerprint"] == r["plan"]["fingerprint"]
        ratio = (
            r["times_us"]["ours"] / o["times_us"]["ours"]
            if r["times_us"]["ours"] and o["times_us"]["ours"]
            else None
        )
        text = "same plan" if same else (f"PLAN DIFFERS: was {common.plan_text(o['plan'])}")
        lines.append(f"  {r['case']:<24} time new/old {_fmt(ratio, '.2f')}  {text}")
    return "\n".join(lines)


def plot_gpu(payload: dict, path: Path) -> None:
    """Ours / FlashMLA and ours / vLLM per shape (planned and replayed), and % of the copy
    bandwidth per column."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"]
    labels = [r["case"] for r in rows] or ["(no case ran)"]
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 0.8 * len(labels) + 2), 8))
    keys = [*PEER_RATIOS, "fp8_over_bf16"]
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        xs = [j + i * width for j, r in enumerate(rows) if r["ratios"].get(key)]
        ys = [r["ratios"][key] for r in rows if r["ratios"].get(key)]
        axes[0].bar(xs, ys, width, label=key)
    axes[0].axhline(1.0, color="k", linewidth=0.8)
    axes[0].axhline(TARGETS["vs_flashmla_sq1_8"], color="gray", linewidth=0.8, linestyle="--")
    axes[0].set_ylabel("time(peer) / time(ours)")
    width = 0.8 / len(COLUMNS)
    for i, col in enumerate(COLUMNS):
        xs = [j + i * width for j, r in enumerate(rows) if col in r["pct_copy"]]
        ys = [r["pct_copy"][col] for r in rows if col in r["pct_copy"]]
        axes[1].bar(xs, ys, width, label=col)
    axes[1].set_ylabel("% of the measured copy bandwidth")
    for ax in axes:
        ax.set_xticks([j + 0.4 for j in range(len(labels))])
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_title(f"{payload['environment']['device']}: MLA decode, page {BLOCK_SIZE}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the run ---------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict:
    from rocm_mla.inputs import prepare_decode

    device = "cuda" if torch.cuda.is_available() else "cpu"
    preset = args.grid or ("full" if device != "cpu" else "tiny")
    ours = registry_backends(args.backends, args.interpreter)
    peers = {}
    if device != "cpu" and not args.no_peers:
        fn, where = vllm_decode_attention(args.vllm_triton)
        peers["vllm-triton"] = (fn, where)
        module, reason = flash_mla_module(args.flash_mla)
        peers["flashmla"] = (module, reason)
        for name, (impl, why) in peers.items():
            if impl is None:
                print(f"skip peer {name}: {why}", file=sys.stderr)
    if not ours and not any(impl for impl, _ in peers.values()):
        raise SystemExit("kernel_roofline: no backend to run")

    name = common.device_name()
    peak_bw, peak_bw_source = common.peak_bandwidth(), "datasheet"
    if peak_bw is None:
        peak_bw, peak_bw_source = common.copy_bandwidth(device=device), "copy bandwidth, this run"
    peaks = peak_compute(name)
    warmup, repeats = (3, 10) if device != "cpu" else (1, 3)
    flush = CacheFlush(device)

    interp = {n for n, cls in ours.items() if (cls.target() or "").startswith("interpreter")}
    cases = PRESETS[preset]
    interp_cases = PRESETS["interpreter"]
    total = sum(len(interp_cases if n in interp else cases) for n in ours) + len(cases) * len(peers)
    if device == "cpu" and preset != "full":
        print(
            f"kernel_roofline: the {preset} preset; GPUs run --gpu or --grid full", file=sys.stderr
        )

    results, done = [], 0
    gen = torch.Generator().manual_seed(0)
    all_cases = list(dict.fromkeys(cases + (interp_cases if interp else [])))
    for index, case in enumerate(all_cases):
        runners = [n for n in ours if case in (interp_cases if n in interp else cases)]
        runners += [p for p in peers if case in cases]
        if not runners:
            continue
        lens_host = lengths_for(case.lengths, case.batch, case.context, gen)
        kv, table, kv_scale = build_cache(lens_host, case.kv_kind, args.block_size, device, index)
        lens = lens_host.to(device)
        q = torch.randn(
            case.batch, case.q_len, case.heads, HEAD_DIM, dtype=torch.bfloat16, device=device
        )
        problem = prepare_decode(
            q,
            kv,
            table,
            lens,
            head_dim_v=HEAD_DIM_V,
            softmax_scale=None,
            causal=True,
            kv_scale=kv_scale,
        )
        cost = roofline(lens_host, case.heads, case.q_len, kv, q.dtype)
        for runner in runners:
            common.progress(done, total, f"{runner} {case.label()}")
            done += 1
            row = {
                "backend": runner,
                "peer": runner in PEERS or runner == "aiter",
                "case": case.label(),
                **dataclasses.asdict(case),
                "kv_dtype": str(kv.dtype).removeprefix("torch."),
                "block_size": args.block_size,
            }
            extra = {}
            if runner in PEERS:
                impl, _ = peers[runner]
                if impl is None:
                    continue
                if runner == "vllm-triton":
                    call, reason, extra = vllm_call(impl, problem, lens_host)
                    extra = extra or {}
                else:
                    call, reason = flash_mla_call(impl, problem)
            else:
                cls = ours[runner]
                row["target"] = cls.target()
                reasons = cls.unsupported_reasons(problem)
                call, reason = None, "; ".join(reasons) if reasons else None
                if not reasons and runner == "triton":
                    call, extra = planned_triton(problem, lens_host)
                elif not reasons:
                    impl = cls(
                        num_heads=case.heads,
                        head_dim_v=HEAD_DIM_V,
                        rope_dim=HEAD_DIM - HEAD_DIM_V,
                        softmax_scale=problem.softmax_scale,
                    )
                    # Planned once outside the timed loop, as a model's decode step would.
                    plan = cls.plan_problem(problem)
                    call = lambda impl=impl, problem=problem, plan=plan: impl.run(  # noqa: E731
                        problem, plan
                    )
            if call is None:
                results.append({**row, "skipped": reason})
                continue
            try:
                seconds = kernel_time(call, flush, device=device, warmup=warmup, repeats=repeats)
            except Exception as exc:
                if runner not in PEERS:
                    raise
                # A peer that breaks on this case must not end the run; ours must.
                results.append({**row, "skipped": f"failed: {type(exc).__name__}: {exc}"})
                continue
            results.append({**row, **extra, **cost, **metrics(cost, seconds, case, peak_bw, peaks)})
        del kv, table, problem, q
    add_peer_ratios(results)
    return {
        "benchmark": "kernel-roofline",
        "environment": common.environment(),
        "device_kind": device,
        "preset": preset,
        "cases": {n: [dataclasses.asdict(c) for c in cs] for n, cs in PRESETS.items()},
        "peak_bandwidth_bytes_per_s": peak_bw,
        "peak_bandwidth_source": peak_bw_source,
        "peak_compute_flop_per_s": None if peaks is None else {"bf16": peaks[0], "fp8": peaks[1]},
        "warmup": warmup,
        "repeats": repeats,
        "formula": "bytes = sum(len)*576*kv_bytes + B*S_q*H*(576*q_bytes + 512*out_bytes); "
        "flops = S_q*sum(len)*H*2*(576+512); pct_bw = bytes/time/peak_bw; "
        "pct_compute = flops/time/dense peak (fp8 peak for an fp8 cache); "
        "pct_roofline = max(bytes/peak_bw, flops/peak)/time; "
        "vs_best_peer = best peer time / time",
        "results": results,
    }


def metrics(cost: dict, seconds: float, case: Case, peak_bw: float, peaks) -> dict:
    out = {
        "time_us": seconds * 1e6,
        "gb_per_s": cost["bytes"] / seconds / 1e9,
        "tflop_per_s": cost["flops"] / seconds / 1e12,
        "pct_peak_bw": 100 * cost["bytes"] / seconds / peak_bw,
    }
    if peaks is not None:
        peak = peaks[1] if case.kv_kind == "fp8" else peaks[0]
        out["pct_peak_compute"] = 100 * cost["flops"] / seconds / peak
        bound = max(cost["bytes"] / peak_bw, cost["flops"] / peak)
        out["pct_roofline"] = 100 * bound / seconds
    return out


def add_peer_ratios(results: list[dict]) -> None:
    """``vs_best_peer`` on every timed row: the fastest peer's time over this row's time."""
    best = {}
    for r in results:
        if r["peer"] and "time_us" in r:
            best[r["case"]] = min(best.get(r["case"], math.inf), r["time_us"])
    for r in results:
        if "time_us" in r and r["case"] in best:
            r["vs_best_peer"] = best[r["case"]] / r["time_us"]


def plot(payload: dict, path: Path) -> None:
    """Grouped bars per case: % of peak bandwidth (top) and % of the roofline (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in payload["results"] if "time_us" in r]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    panels = [("pct_peak_bw", f"% of peak bandwidth ({payload['peak_bandwidth_source']})")]
    if any("pct_roofline" in r for r in rows):
        panels.append(("pct_roofline", "% of roofline (max of bandwidth, dense compute)"))
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(max(7, 0.9 * len(cases) + 2), 3.6 * len(panels)), squeeze=False
    )
    width = 0.8 / max(len(backends), 1)
    for ax, (key, label) in zip(axes[:, 0], panels, strict=True):
        for i, backend in enumerate(backends):
            values = {r["case"]: r.get(key) for r in rows if r["backend"] == backend}
            xs = [c + i * width for c, name in enumerate(cases) if values.get(name) is not None]
            ys = [values[name] for name in cases if values.get(name) is not None]
            ax.bar(xs, ys, width, label=backend)
        ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cases))])
        ax.set_xticklabels(cases, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0, 0].set_title(f"{payload['environment']['device']}: MLA decode, block 64")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _cases(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def main(argv: list[str] | None = None) -> Path | None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.kernel_roofline", description=__doc__.split("\n")[0]
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--gpu",
        action="store_true",
        help="issue 37's ratio table on this GPU, peers beside (about 2 minutes on an H200)",
    )
    mode.add_argument(
        "--dry-run",
        action="store_true",
        help="the --gpu code on the CPU (Triton interpreter, tiny shapes, no graphs)",
    )
    mode.add_argument(
        "--grid", choices=("full", "tiny"), help="shape grid (default: full on a GPU, tiny on CPU)"
    )
    mode.add_argument(
        "--profile-once",
        action="store_true",
        help="run our planned call and FlashMLA's twice per --cases shape, untimed, for a "
        f"profiler (default shapes: {', '.join(PROFILE_CASES)})",
    )
    parser.add_argument(
        "--cases",
        type=_cases,
        metavar="LABEL,...",
        help="--gpu / --dry-run: only these shapes, by label (e.g. 'B1 ctx32K H16')",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=150.0,
        help="--gpu: skip the shapes left once the run has taken this long (default 150)",
    )
    parser.add_argument(
        "--precompile",
        type=int,
        metavar="N",
        help="--gpu: compile every shape's kernels in N processes first (default: half the "
        "cores, at most 8; 0: none)",
    )
    parser.add_argument("--warmup-ms", type=float, default=5.0, help="--gpu: do_bench warmup")
    parser.add_argument("--rep-ms", type=float, default=25.0, help="--gpu: do_bench repetition")
    parser.add_argument(
        "--compare",
        type=Path,
        metavar="OLD.json",
        help="--gpu: print, per shape, whether an earlier run planned the same launch",
    )
    parser.add_argument(
        "--backends",
        nargs="+",
        metavar="NAME",
        help="grid mode: only these of our backends (default: all)",
    )
    parser.add_argument("--no-peers", action="store_true", help="skip vLLM / FlashMLA")
    parser.add_argument(
        "--flash-mla",
        metavar="PATH",
        help="flash_mla_interface.py (or its folder); default $ROCM_MLA_FLASH_MLA, then imports",
    )
    parser.add_argument(
        "--vllm-triton",
        metavar="FILE",
        help=f"a file defining vLLM's decode_attention_fwd; default ${VLLM_TRITON_ENV}, then "
        f"{VLLM_TRITON_FILE} beside $ROCM_MLA_FLASH_MLA, then vLLM's modules",
    )
    parser.add_argument(
        "--interpreter",
        action="store_true",
        help="grid mode: also time the Triton interpreter on CPU (tiny grid; measures Python)",
    )
    parser.add_argument("--block-size", type=int, default=64, help="grid mode: KV block size")
    parser.add_argument("--out", type=Path, help="results folder (default: benchmarks/results)")
    args = parser.parse_args(argv)
    if (args.gpu or args.profile_once) and not torch.cuda.is_available():
        parser.error(
            "--gpu and --profile-once need a GPU (torch sees none); --dry-run checks the "
            "--gpu code on the CPU"
        )
    if (args.dry_run or args.interpreter) and torch.cuda.is_available():
        parser.error("--dry-run and --interpreter are for CPU-only machines (this one has a GPU)")
    if args.dry_run or args.interpreter:
        # Must be set before triton is first imported (the registry imports it lazily).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.budget_s <= 0 or args.warmup_ms < 0 or args.rep_ms <= 0:
        parser.error("--budget-s and --rep-ms must be > 0, --warmup-ms >= 0")
    if args.precompile is not None and args.precompile < 0:
        parser.error(f"--precompile must be >= 0, got {args.precompile}")
    if args.compare is not None and not args.compare.is_file():
        parser.error(f"--compare: no such file {args.compare}")
    if args.gpu or args.dry_run or args.profile_once:
        return main_gpu(args, parser)
    if args.cases or args.compare:
        parser.error("--cases and --compare go with --gpu, --dry-run or --profile-once")

    payload = run(args)
    path = common.write_results("kernel-roofline", payload, args.out)
    plot(payload, path.with_suffix(".png"))
    for r in payload["results"]:
        if "time_us" not in r:
            print(f"{r['backend']:>12} {r['case']:<28} skipped: {r['skipped']}")
            continue
        extra = ""
        if "pct_peak_compute" in r:
            extra = f" {r['pct_peak_compute']:5.1f}% compute {r['pct_roofline']:5.1f}% roofline"
        if "vs_best_peer" in r:
            extra += f" {r['vs_best_peer']:5.2f}x best peer"
        print(
            f"{r['backend']:>12} {r['case']:<28} {r['time_us']:>10.1f} us "
            f"{r['gb_per_s']:>8.4g} GB/s {r['tflop_per_s']:>7.3g} TF/s "
            f"{r['pct_peak_bw']:5.1f}% bw{extra}"
        )
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return path


def main_gpu(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Path | None:
    """``--gpu`` / ``--dry-run``: the table, its JSON + PNG, the text table last; exit 1 when
    a check failed (after writing). ``--profile-once``: the calls alone, nothing written."""
    cases = PRESETS["dry-run" if args.dry_run else "gpu"]
    if args.profile_once and not args.cases:
        args.cases = list(PROFILE_CASES)
    if args.cases:
        known = {c.label(): c for c in cases}
        unknown = [c for c in args.cases if c not in known]
        if unknown:
            parser.error(f"--cases: unknown {unknown}; expected some of {list(known)}")
        cases = [known[c] for c in args.cases]
    old = None if args.compare is None else json.loads(args.compare.read_text())
    peers = Peers() if args.no_peers else Peers.load(args.flash_mla, args.vllm_triton)
    if args.no_peers:
        peers.flash_source = peers.vllm_source = "--no-peers"
    for name, entry in peers.describe().items():
        if not entry["loaded"]:
            print(f"kernel_roofline: peer {name} skipped: {entry['source']}", file=sys.stderr)
    if args.profile_once:
        for line in profile_once(cases, peers):
            print(line)
        return None
    workers = args.precompile
    if workers is None:
        workers = min(8, (os.cpu_count() or 2) // 2) if args.gpu and len(cases) > 1 else 0
    payload = run_gpu(
        cases,
        device="cuda" if args.gpu else "cpu",
        peers=peers,
        budget_s=args.budget_s,
        warmup_ms=args.warmup_ms,
        rep_ms=args.rep_ms,
        precompile_workers=workers,
        vllm_path=args.vllm_triton,
    )
    path = common.write_results("kernel-roofline", payload, args.out)
    plot_gpu(payload, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png').name} in {payload['wall_s']} s")
    if old is not None:
        print(compare_text(old, payload))
    print(table_text(payload))
    if payload["checks_failed"]:
        print(f"kernel_roofline: output check FAILED at {payload['checks_failed']}")
        raise SystemExit(1)
    return path


if __name__ == "__main__":
    main()
