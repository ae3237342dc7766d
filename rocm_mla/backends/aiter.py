"""AITER backend: ``aiter.mla.mla_decode_fwd`` on MI300X (gfx942) and MI355X (gfx950).

AITER's MLA decode is prebuilt assembly. Its contract, and how this impl meets it:

- page size 1: the paged cache is viewed as ``[num_blocks * block_size, 1, 1, D]`` (one
  token per page, no copy) and the block table is expanded into per-token ``kv_indices``
  (``block_id * block_size + offset``); ``kv_last_page_lens`` is then all ones. bf16 decode
  with ``page_size > 1`` silently returned wrong output (aiter#2996/#3095), so we never ask.
- heads: the non-persistent kernels exist for 16 and 128 query heads with both bf16 and
  fp8 inputs (``csrc/py_itfs_cu/asm_mla.cu``), so other counts are zero-padded up to the
  next of those and sliced back out of ``o`` and the LSE.
- releases: the installed ``mla_decode_fwd`` is read once (``installed_release``: its
  parameters, whether its split reduce writes an LSE, the amd-aiter version) and the call
  is built for it. Everything after ``max_seqlen_q`` is passed by keyword: releases before
  0.1.11 (amd-aiter 0.1.7.post2.dev18, the one on PyPI, among them) have no
  ``page_size``/``nhead_kv`` and read both from the 4-D ``kv_buffer`` view, and there
  ``sm_scale`` sits where ``page_size`` sits now. What a release cannot serve is an
  unsupported reason at selection (``release_reasons``), never an error at the first call.
- output: the kernel writes the result into ``o``; the first value it returns is the fp32
  split-KV scratch (``[total_q, splits, H, Dv]``), not the output.
- LSE (``AiterRelease.lse_reason``): the natural-log LSE of the scaled scores,
  ``[total_q, H]`` fp32, this package's convention. Without ``page_size`` a call is
  non-persistent, and there AITER's LSE came late: before 0.1.13 its split reduce wrote none
  (the second value returned is an unwritten buffer, aiter#1420; ``return_lse``, from 0.1.9,
  changed only the persistent path); 0.1.13-0.1.18 write it in the reduce (aiter#2729) but
  ``return_lse=True`` fails the stage-1 kernel lookup for 16 and 128 heads (no LSE kernel
  outside persistent mode; aiter#4308, first in 0.1.19). From 0.1.19 on the reduce writes it,
  but a launch of one split per request skips the reduce (the fp8 and 4-query early return,
  the copy-out of other one-split launches) and leaves it unwritten, and AITER's split
  heuristic picks one split when the batch fills the GPU. Only bf16 with 16 kernel heads and
  S_q 1 always reduces; for the other bf16 calls that need the LSE the plan picks the split
  count itself (``lse_split_count``: AITER's own heuristic without the one-split choice) and
  passes it as ``num_kv_splits``. fp8 cannot be forced: AITER caps an fp8 launch's splits
  by the context length, down to one for short ones, so fp8 with the LSE is refused.
  (aiter#3267's description names an ``nhead > 16`` LSE fix in ``mla_decode_fwd``, but the
  change merged as 48943d8ff5 touches no MLA code; as of ROCm/aiter e4048607a5, 2026-08-22,
  the one-split LSE is unwritten.)
- empty rows: a request with no visible keys comes back as ``0/0`` (NaN) from the split
  reduce, so rows with no visible key are set to out 0 / lse -inf here, as
  ``rocm_mla.mla_decode`` promises.
- bounds: a planned call's block ids and lengths are not checked on the host, so the
  metadata is built to be safe for any values (``build_decode_metadata``): AITER is never
  handed a row outside the cache or more ``kv_indices`` than the plan allocated, and the
  rows that may see a bad key come out NaN with ``FAULT_*`` bits in the call's
  ``fault_flag`` (``aiter_faults``), all on the device.
- fp8: a8w8 only (fp8 q with fp8 KV, per-tensor ``q_scale``/``kv_scale``); q is quantized
  here to the cache's fp8 type, which must be AITER's for the arch (e4m3fnuz on gfx942,
  e4m3fn on gfx950).

Known kernel bugs and untested shapes are unsupported reasons, never silent wrong numbers,
so ``auto`` falls back to Triton for them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from rocm_mla import platform
from rocm_mla.backends.base import Capabilities, MLADecodeImpl
from rocm_mla.inputs import (
    FAULT_BEYOND_PLAN,
    FAULT_BEYOND_TABLE,
    FAULT_BLOCK_ID,
    FAULT_NEGATIVE_LENGTH,
    FP8_DTYPES,
    DecodePlan,
    DecodeProblem,
    DecodeSpec,
    visible_lengths,
)
from rocm_mla.platform import parse_release

SUPPORTED_ARCHS = ("gfx942", "gfx950")
#: AITER's fp8 type per arch (``aiter.utility.dtypes.defaultDtypes``).
FP8_BY_ARCH = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}
#: Head counts with a non-persistent decode kernel for both bf16 and fp8 (asm_mla.cu).
#: 32 and 64 have bf16-only kernels; padding them to 128 keeps one code path per dtype.
KERNEL_HEADS = (16, 128)
#: Longest verify window (S_q) per cache type: asm_mla.cu rejects fp8 windows over 4 and
#: has bf16 kernels up to 8.
MAX_Q_LEN_BF16 = 8
MAX_Q_LEN_FP8 = 4
#: ``mla_decode_fwd``'s leading parameters, passed by position in every release.
POSITIONAL = (
    "q",
    "kv_buffer",
    "o",
    "qo_indptr",
    "kv_indptr",
    "kv_indices",
    "kv_last_page_lens",
    "max_seqlen_q",
)
#: The first amd-aiter release whose non-persistent decode can return the LSE: the split
#: reduce writes it (aiter#2729, 0.1.13) and ``return_lse=True`` no longer fails the
#: stage-1 kernel lookup (aiter#4308, fd90c7fffa).
LSE_RELEASE = (0, 1, 19)


@dataclass(frozen=True)
class AiterRelease:
    """What an AITER release's ``aiter.mla.mla_decode_fwd`` takes and gives, as this backend
    calls it (non-persistent, page size 1)."""

    #: amd-aiter's version ("0.1.7.post2.dev18"); None when no such distribution is installed
    #: (a source tree on the path)
    version: str | None
    #: ``mla_decode_fwd``'s parameter names, in order
    parameters: tuple[str, ...]
    #: whether its non-persistent split reduce (``_fwd_kernel_stage2_asm``) has a final-LSE
    #: output (aiter#2729)
    reduce_writes_lse: bool

    @property
    def name(self) -> str:
        return f"amd-aiter {self.version}" if self.version else "aiter (version unknown)"

    @property
    def page_keywords(self) -> bool:
        """``page_size``/``nhead_kv`` are keywords (else read from the 4-D ``kv_buffer``)."""
        return {"page_size", "nhead_kv"} <= set(self.parameters)

    @property
    def return_lse(self) -> bool:
        return "return_lse" in self.parameters

    @property
    def fp8_scales(self) -> bool:
        """It takes ``q_scale`` and ``kv_scale``: fp8 q over an fp8 cache (a8w8)."""
        return {"q_scale", "kv_scale"} <= set(self.parameters)

    @property
    def lse_lookup_fixed(self) -> bool:
        """Its version is ``LSE_RELEASE`` or newer (a pre-release of it does not count)."""
        release = parse_release(self.version)
        return release is not None and release.at_least(LSE_RELEASE)

    def signature_reason(self) -> str | None:
        """Why this backend cannot call this ``mla_decode_fwd`` at all, or None."""
        lead = self.parameters[: len(POSITIONAL)]
        if lead != POSITIONAL or "sm_scale" not in self.parameters:
            return (
                f"{self.name}: aiter.mla.mla_decode_fwd{_signature(self.parameters)} is not "
                f"the interface this backend calls ({', '.join(POSITIONAL)}, then sm_scale "
                "by keyword); use the triton backend, or an amd-aiter this release of "
                "rocm-mla knows"
            )
        return None

    def lse_reason(self, spec: DecodeSpec) -> str | None:
        """Why this release cannot return a correct LSE for ``spec``, or None."""
        if not (self.return_lse and self.reduce_writes_lse):
            keyword = (
                "its return_lse changes only the persistent path"
                if self.return_lse
                else "it has no return_lse keyword"
            )
            return (
                f"the call needs the LSE (DCP, merge_states) and {self.name} returns none "
                f"from its non-persistent decode ({keyword}, and its split reduce writes "
                f"none: aiter#1420); amd-aiter {_dotted(LSE_RELEASE)} or newer returns it "
                "for bf16 caches"
            )
        if not self.lse_lookup_fixed:
            return (
                f"the call needs the LSE and {self.name}'s mla_decode_fwd(return_lse=True) "
                "fails its kernel lookup for 16 and 128 heads outside persistent mode "
                f"(aiter#4308, first in amd-aiter {_dotted(LSE_RELEASE)})"
            )
        if spec.kv_dtype in FP8_DTYPES:
            return (
                f"the call needs the LSE and {self.name} writes it only in its split reduce, "
                "which a one-split launch skips; an fp8 launch's split count is capped by "
                "the context length (one split for short ones), so it cannot be forced"
            )
        return None

    def features(self) -> dict[str, bool]:
        """What of the interface this backend uses the release has (``rocm-mla info``)."""
        return {
            "page_size/nhead_kv keywords": self.page_keywords,
            "fp8 q_scale/kv_scale": self.fp8_scales,
            "return_lse keyword": self.return_lse,
            "split reduce writes the LSE (aiter#2729)": self.reduce_writes_lse,
            f"LSE kernel lookup fixed (aiter#4308, {_dotted(LSE_RELEASE)})": (
                self.lse_lookup_fixed
            ),
        }

    def summary(self) -> str:
        """One line: what this release serves through this backend, and what it does not."""
        reason = self.signature_reason()
        if reason is not None:
            return reason
        cannot = []
        if not self.fp8_scales:
            cannot.append("fp8 caches (no q_scale/kv_scale)")
        if not (self.return_lse and self.reduce_writes_lse and self.lse_lookup_fixed):
            cannot.append("the LSE (DCP, merge_states)")
        else:
            cannot.append("the LSE of an fp8 cache")
        kinds = "bf16 and fp8" if self.fp8_scales else "bf16"
        return (
            f"{self.name}: decodes {kinds} caches, {KERNEL_HEADS[0]} or {KERNEL_HEADS[-1]} "
            f"kernel heads (fewer padded up); not {'; not '.join(cannot)}"
        )


#: AITER's split heuristic (``get_meta_param`` in ``aiter/mla.py``, every release): the split
#: count ``i`` in ``1..MAX_SPLITS`` that maximizes the CU occupancy of ``B * i`` workgroups
#: times ``avg_keys / (avg_keys + SPLIT_OVERHEAD_KEYS * i)``.
MAX_SPLITS = 16
SPLIT_OVERHEAD_KEYS = 84.1


def always_reduces(spec: DecodeSpec) -> bool:
    """Whether AITER's non-persistent decode runs its split reduce (which writes the LSE)
    whatever the split count: bf16, 16 kernel heads, one query per request."""
    return spec.kv_dtype not in FP8_DTYPES and spec.num_heads <= KERNEL_HEADS[0] and spec.q_len == 1


def lse_split_count(batch: int, total_keys: int, compute_units: int) -> int:
    """The split count of a launch that must return the LSE: AITER's own heuristic with the
    one-split choice left out (a one-split launch skips the reduce that writes the LSE)."""
    average = total_keys / batch

    def score(splits: int) -> float:
        groups = batch * splits
        slots = -(-groups // compute_units) * compute_units
        return groups / slots * average / (average + SPLIT_OVERHEAD_KEYS * splits)

    return max(range(2, MAX_SPLITS + 1), key=score)


@dataclass(frozen=True)
class AiterLaunch:
    """A plan's AITER decision (``DecodePlan.launch``): the split count the call passes, for
    a call that needs the LSE and would not reduce at one split; None lets AITER choose."""

    num_kv_splits: int | None


def _dotted(numbers: tuple[int, ...]) -> str:
    return ".".join(map(str, numbers))


def _signature(parameters: tuple[str, ...]) -> str:
    return f"({', '.join(parameters)})"


def _aiter_mla() -> ModuleType:
    """``aiter.mla``, imported on first use; the one place the kernel module is looked up.

    Raises ImportError (or whatever importing AITER raises) when it cannot be imported.
    """
    return importlib.import_module("aiter.mla")


@functools.cache
def _import_failure(load: Callable[[], ModuleType]) -> str | None:
    """Why ``load`` (``_aiter_mla``) cannot import AITER's kernel module, or None. Asked once
    per loader: Python caches no failed import, and searching the path again took 0.17 ms,
    paid by every auto-selected one-shot call and plan on a ROCm machine without AITER."""
    try:
        load()
    except Exception as exc:  # a broken install fails in many ways; report it, all alike
        return (
            f"aiter not importable ({type(exc).__name__}: {exc}); install AMD's amd-aiter "
            "or build ROCm/aiter from source (`pip install aiter` is an unrelated package)"
        )
    return None


def _aiter_version() -> str | None:
    # "aiter" on PyPI is an unrelated package, so only AMD's distribution name counts.
    return platform.package_version("amd-aiter")


@functools.cache
def installed_release(load: Callable[[], ModuleType]) -> AiterRelease:
    """The release ``load`` (``_aiter_mla``) imports, read once per loader: the parameters of
    its ``mla_decode_fwd`` and of its non-persistent split reduce (a Triton kernel keeps its
    Python function in ``.fn``). Call it only once ``_import_failure(load)`` is None."""
    module = load()
    parameters = tuple(inspect.signature(module.mla_decode_fwd).parameters)
    reduce = getattr(module, "_fwd_kernel_stage2_asm", None)
    reduce = getattr(reduce, "fn", reduce)
    reduce_parameters = inspect.signature(reduce).parameters if callable(reduce) else {}
    return AiterRelease(
        version=_aiter_version(),
        parameters=parameters,
        reduce_writes_lse="Final_lse" in reduce_parameters,
    )


def _torch_build() -> str:
    return platform.torch_build()


def _compute_units(device: torch.device) -> int:
    """Compute units of the GPU at ``device`` (AITER's ``get_cu_num`` for its heuristic)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def _gpu_arch() -> str | None:
    """The gfx arch of the current GPU ("gfx942"), or None with no HIP GPU visible."""
    current = platform.current_platform()
    return current.arch if current.kind == "hip" else None


def installed_report() -> dict[str, object]:
    """The AITER release this backend would call, for ``rocm-mla info``: its ``summary`` and
    ``features`` where it imports (a ROCm torch on gfx942/gfx950), else both None."""
    if (
        _torch_build() != "rocm"
        or _gpu_arch() not in SUPPORTED_ARCHS
        or _import_failure(_aiter_mla) is not None
    ):
        return {"summary": None, "features": None}
    release = installed_release(_aiter_mla)
    return {"summary": release.summary(), "features": release.features()}


def kernel_heads(num_heads: int) -> int:
    """The head count the kernel runs for ``num_heads`` query heads (they are padded to it)."""
    for heads in KERNEL_HEADS:
        if num_heads <= heads:
            return heads
    raise ValueError(
        f"aiter: num_heads must be at most {KERNEL_HEADS[-1]}, got {num_heads} "
        "(use the triton or torch backend)"
    )


@dataclass(frozen=True)
class AiterDecodeMetadata:
    """The CSR metadata ``mla_decode_fwd`` reads, for page size 1. All int32 on q's device."""

    qo_indptr: torch.Tensor  #: [B + 1]; request b's queries are rows [b * S_q, (b + 1) * S_q)
    kv_indptr: torch.Tensor  #: [B + 1]; request b's tokens are kv_indices[kv_indptr[b]:...]
    kv_indices: torch.Tensor  #: [sum(cache_seqlens)] rows of the flattened cache
    kv_last_page_lens: torch.Tensor  #: [B] all ones (each page holds one token)
    max_seqlen_q: int  #: S_q (every request has the same number of queries)


def build_decode_metadata(
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_size: int,
    q_len: int,
    total_tokens: int | None = None,
    *,
    num_blocks: int,
) -> AiterDecodeMetadata:
    """Expand a paged block table into AITER's page-size-1 metadata, safe for any values.

    Args:
        block_table: ``[B, max_blocks]`` int; entry ``j`` of request ``b`` holds its tokens
            ``[j * block_size, (j + 1) * block_size)``. Entries past a request's last
            block are never read.
        cache_seqlens: ``[B]`` int tokens per request.
        block_size: tokens per block of the paged cache.
        q_len: ``S_q``, queries per request.
        total_tokens: ``sum(cache_seqlens)`` or any upper bound of it, known on the host (a
            ``DecodePlan``'s ``total_seqlen``); None reads the sum (one host sync).
        num_blocks: blocks in the cache (``kv_cache.shape[0]``).

    Token ``t`` of request ``b`` becomes row ``block_table[b, t // block_size] * block_size
    + t % block_size`` of the ``[num_blocks * block_size, 1, 1, D]`` view. Vectorized on the
    tensors' device with a fixed output size, so a plan's bound makes it sync-free; entries
    past the real total are in bounds and never read (``kv_indptr`` ends before them).

    A planned call's values are not checked on the host, so the kernel is handed only what
    it can read safely (``aiter_faults`` then poisons the rows this changes): a negative
    length is 0 keys; a token whose block id is outside ``[0, num_blocks)`` or whose column
    is past the table reads a stand-in block inside the cache (it keeps its place, so every
    row's causal window stays right); and ``kv_indptr`` stops at ``total_tokens``, the size
    of ``kv_indices``, so requests past the plan's token budget are cut short.
    """
    device = block_table.device
    batch, max_blocks = block_table.shape
    if max_blocks == 0:
        # Nothing is readable; one column of bad ids keeps the gathers below well-formed.
        block_table = block_table.new_full((batch, 1), -1)
    lens = cache_seqlens.to(torch.int64).clamp(min=0)
    kv_indptr = torch.zeros(batch + 1, dtype=torch.int64, device=device)
    torch.cumsum(lens, dim=0, out=kv_indptr[1:])
    if total_tokens is None:
        total = int(kv_indptr[-1])
    else:
        total = total_tokens
        kv_indptr.clamp_(max=total)
    # A bad block id reads its request's first block instead: keys the request's rows see
    # anyway, so a causally masked stand-in is finite and its 0 weight cannot turn into
    # 0 * NaN for a row that is meant to stay exact (a free block may hold anything). Block
    # 0 when the first id is bad too: every row with a key is poisoned then. Done on the
    # [B, max_blocks] table, so the per-token work is what it was without the check.
    bad = (block_table < 0) | (block_table >= num_blocks)
    stand_in = torch.where(bad[:, :1], 0, block_table[:, :1])
    safe_table = torch.where(bad, stand_in, block_table)
    token = torch.arange(total, device=device)
    # Which request each flat token belongs to; tokens past the real total land on the last
    # request at positions it does not have (never read). A column past the table reads
    # the last column's block: in the cache, and those rows are poisoned.
    request = torch.searchsorted(kv_indptr[1:], token, right=True).clamp_(max=batch - 1)
    position = token - kv_indptr[request]
    column = (position // block_size).clamp_(max=block_table.shape[1] - 1)
    blocks = safe_table[request, column].to(torch.int64)
    kv_indices = blocks * block_size + position % block_size
    return AiterDecodeMetadata(
        qo_indptr=torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=device),
        kv_indptr=kv_indptr.to(torch.int32),
        kv_indices=kv_indices.to(torch.int32),
        kv_last_page_lens=torch.ones(batch, dtype=torch.int32, device=device),
        max_seqlen_q=q_len,
    )


def aiter_faults(
    problem: DecodeProblem, kv_indptr: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows ``build_decode_metadata``'s safe metadata cannot answer exactly, and why.

    Returns ``(poison [B, S_q] bool, bits [1] int32)``: a row with a visible key is poisoned
    when one of its visible keys has a block id outside ``[0, num_blocks)``
    (``FAULT_BLOCK_ID``) or lies past the table (``FAULT_BEYOND_TABLE``), or when its request
    was cut short by the plan's token budget (``FAULT_BEYOND_PLAN``; the kernel's causal
    window then no longer lines up, so the whole request). All on the device, no sync; a
    few [B]-sized ops, since every MLA layer of a step pays them.
    """
    p = problem
    visible = visible_lengths(p)  # [B, S_q]
    most = visible[:, -1]  # the last row of a window sees the most keys
    capacity = p.block_table.shape[1] * p.block_size
    # Keys before the first bad column are readable (argmax picks the first True). The True
    # padded past the last column makes "no bad id" read as first_bad = capacity, where the
    # table's own limit takes over.
    bad = (p.block_table < 0) | (p.block_table >= p.num_blocks)  # [B, max_blocks]
    bad = torch.nn.functional.pad(bad, (0, 1), value=True)
    first_bad = bad.to(torch.int8).argmax(dim=1) * p.block_size  # [B]
    given = kv_indptr[1:] - kv_indptr[:-1]
    cut = given < p.cache_seqlens.clamp(min=0)  # [B]
    # Rows of a cut request see nothing exactly; the others see first_bad good keys.
    good = torch.where(cut, 0, first_bad)
    negative = p.cache_seqlens < 0  # [B]: a broken contract, not "no keys"
    seen = torch.stack(
        [
            (most > first_bad) & (first_bad < capacity),
            most > capacity,
            cut & (most > 0),
            negative,
        ]
    ).any(dim=1)  # [4]
    bits = (
        seen[0] * FAULT_BLOCK_ID
        + seen[1] * FAULT_BEYOND_TABLE
        + seen[2] * FAULT_BEYOND_PLAN
        + seen[3] * FAULT_NEGATIVE_LENGTH
    ).to(torch.int32)
    return (visible > good[:, None]) | negative[:, None], bits.reshape(1)


def guard_window_keys(
    problem: DecodeProblem, meta: AiterDecodeMetadata, kv_view: torch.Tensor
) -> tuple[AiterDecodeMetadata, torch.Tensor]:
    """A verify window's own keys (positions ``L - S_q + 1 ..``, seen by the later rows of
    the window only) must not reach the earlier rows: the kernel weighs a causally masked key
    0, and 0 x a non-finite V element is NaN. So a window key holding a non-finite element
    is handed to the kernel as a finite stand-in (the request's first key, which every row
    with a key sees: were it not finite, every such row is NaN anyway), and the rows that do
    see it are poisoned here. Returns ``(metadata, poison [B, S_q])``; on the device, a
    gather of ``B x (S_q - 1)`` cache rows, no sync."""
    p = problem
    batch, q_len = p.batch, p.q_len
    none = torch.zeros(batch, q_len, dtype=torch.bool, device=p.q.device)
    if q_len == 1 or not p.causal or meta.kv_indices.numel() == 0:
        return meta, none
    indptr = meta.kv_indptr.to(torch.int64)
    given = indptr[1:] - indptr[:-1]  # [B] keys the kernel walks
    offsets = torch.arange(1 - q_len, 0, device=p.q.device)  # the window's S_q - 1 keys
    position = given[:, None] + offsets  # [B, S_q - 1]
    real = position >= 0
    token = (indptr[:-1, None] + position.clamp(min=0)).clamp_(max=meta.kv_indices.numel() - 1)
    rows = kv_view[meta.kv_indices.to(torch.int64)[token], 0, 0]  # [B, S_q - 1, D]
    broken = real & ~torch.isfinite(rows.to(torch.float32)).all(dim=-1)
    # Point the broken tokens at the stand-in (scatter_add of 0/1: duplicates are harmless).
    replace = torch.zeros(meta.kv_indices.numel(), dtype=torch.int32, device=p.q.device)
    replace.scatter_add_(0, token.flatten(), broken.flatten().to(torch.int32))
    first = meta.kv_indices.to(torch.int64)[indptr[:-1].clamp(max=meta.kv_indices.numel() - 1)]
    owner = torch.searchsorted(
        indptr[1:], torch.arange(replace.numel(), device=p.q.device), right=True
    )
    stand_in = first[owner.clamp_(max=batch - 1)].to(meta.kv_indices.dtype)
    kv_indices = torch.where(replace > 0, stand_in, meta.kv_indices)
    # The first broken window key of each request; rows whose window reaches it see it.
    earliest = torch.where(broken, position, torch.iinfo(torch.int64).max).amin(dim=1)  # [B]
    poison = visible_lengths(p) > earliest[:, None]
    return dataclasses.replace(meta, kv_indices=kv_indices), poison


def quantize_per_tensor(
    x: torch.Tensor, fp8_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as ``fp8_dtype`` with one fp32 scale: ``x ~= x_fp8.float() * scale``.

    Returns ``(x_fp8, scale [1] float32)``; both stay on ``x``'s device (no host sync).
    """
    fp8_max = torch.finfo(fp8_dtype).max
    amax = x.detach().abs().amax().to(torch.float32)
    # An all-zero x would give scale 0 and 0/0 below; any positive scale encodes it exactly.
    scale = torch.where(amax > 0, amax / fp8_max, 1.0).reshape(1)
    x_fp8 = (x.to(torch.float32) / scale).clamp_(-fp8_max, fp8_max).to(fp8_dtype)
    return x_fp8, scale


def _flat_token_view(kv_cache: torch.Tensor) -> torch.Tensor | None:
    """``[num_blocks, block_size, D]`` as the ``[num_blocks * block_size, 1, 1, D]`` view the
    kernel pages through, or None when the blocks are not evenly strided (a copy would be
    needed)."""
    if kv_cache.shape[0] > 1 and kv_cache.stride(0) != kv_cache.shape[1] * kv_cache.stride(1):
        return None
    return kv_cache.flatten(0, 1)[:, None, None, :]


class AiterMLAImpl(MLADecodeImpl):
    """MLA decode through ``aiter.mla.mla_decode_fwd`` (non-persistent split-KV mode)."""

    name = "aiter"
    capabilities = Capabilities(
        platforms=("hip",),
        q_dtypes=(torch.bfloat16,),
        kv_dtypes=(torch.bfloat16, torch.float8_e4m3fnuz, torch.float8_e4m3fn),
        # Windows of different lengths run front-padded to the longest (``_padded_windows``);
        # a bound per row (DCP verify windows) is not something mla_decode_fwd takes: it
        # aligns each window's causal mask to the end of the request's keys.
        varlen=True,
    )

    @classmethod
    def unavailable_reason(cls) -> str | None:
        build = _torch_build()
        if build != "rocm":
            return f"torch is not a ROCm build (this torch {torch.__version__} is a {build} build)"
        arch = _gpu_arch()
        if arch is None:
            return "no AMD GPU visible to torch"
        if arch not in SUPPORTED_ARCHS:
            return f"arch {arch} is not {'/'.join(SUPPORTED_ARCHS)} (AITER's MLA decode kernels)"
        failure = _import_failure(_aiter_mla)
        if failure is not None:
            return failure
        return installed_release(_aiter_mla).signature_reason()

    @classmethod
    def target(cls) -> str | None:
        if cls.unavailable_reason() is not None:
            return None
        return f"hip {_gpu_arch()} ({installed_release(_aiter_mla).summary()})"

    @classmethod
    def unsupported_reasons(cls, call: DecodeSpec | DecodeProblem) -> list[str]:
        reasons = super().unsupported_reasons(call)
        if cls.unavailable_reason() is not None:
            return reasons
        spec = call.spec if isinstance(call, DecodeProblem) else call
        release = installed_release(_aiter_mla)
        return reasons + _shape_reasons(spec, _gpu_arch()) + release_reasons(spec, release)

    @classmethod
    def plan_launch(
        cls,
        spec: DecodeSpec,
        *,
        batch: int,
        max_seqlen: int,
        total_seqlen: int,
        lengths: torch.Tensor | None = None,
        bounds_only: bool = False,
        capacity_keys: int | None = None,
        cache_bytes: int | None = None,
    ) -> AiterLaunch:
        if not spec.lse or always_reduces(spec):
            return AiterLaunch(num_kv_splits=None)
        units = _compute_units(spec.device)
        return AiterLaunch(num_kv_splits=lse_split_count(batch, total_seqlen, units))

    def _decode(
        self, problem: DecodeProblem, plan: DecodePlan
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One kernel call; returns ``(out [B, S_q, H, Dv] q.dtype, lse [B, S_q, H] fp32)``
        (``[T, H, Dv]`` and ``[T, H]`` for packed windows), the LSE None for a plan without
        one."""
        if not problem.varlen:
            return self._decode_windows(problem, plan)
        padded, tokens = _padded_windows(problem, plan.spec.q_len)
        out, lse = self._decode_windows(padded, plan)
        return out[tokens], None if lse is None else lse[tokens]

    def _decode_windows(
        self, problem: DecodeProblem, plan: DecodePlan
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``_decode`` of windows of one length."""
        p = problem
        release = installed_release(_aiter_mla)
        # Selection refused these already; a caller that skipped it gets the same reasons.
        refused = release_reasons(plan.spec, release)
        if refused:
            raise ValueError(f"MLA backend 'aiter' cannot run this call: {'; '.join(refused)}")
        want_lse = plan.spec.lse
        batch, q_len, num_heads, head_dim = p.q.shape
        dv, device = p.head_dim_v, p.q.device
        total_q, heads = batch * q_len, kernel_heads(num_heads)
        kv_view = _flat_token_view(p.kv_cache)
        if kv_view is None:
            raise ValueError(_layout_reason(p.kv_cache))
        meta = build_decode_metadata(
            p.block_table,
            p.cache_seqlens,
            p.block_size,
            q_len,
            plan.total_seqlen,
            num_blocks=p.num_blocks,
        )
        poison, fault_bits = aiter_faults(p, meta.kv_indptr)
        meta, window_poison = guard_window_keys(p, meta, kv_view)
        poison = poison | window_poison
        if p.fault_flag is not None:
            p.fault_flag.bitwise_or_(fault_bits)
        # Rows with no visible key: the kernel's split reduce leaves 0/0 there.
        empty = (visible_lengths(p) == 0)[:, :, None]  # [B, S_q, 1]
        if plan.total_seqlen == 0:
            # Every row is empty (or past the plan, then poisoned). AITER sizes its splits
            # from the token count and would be asked for zero splits.
            out = torch.zeros(batch, q_len, num_heads, dv, dtype=p.q.dtype, device=device)
            lse = torch.full((batch, q_len, num_heads), -math.inf, device=device)
            return _poisoned(out, lse if want_lse else None, poison)

        q = p.q.reshape(total_q, num_heads, head_dim)
        if heads != num_heads:
            padded = torch.zeros(total_q, heads, head_dim, dtype=q.dtype, device=device)
            padded[:, :num_heads] = q
            q = padded
        q_scale = kv_scale = None
        if p.kv_cache.dtype in FP8_DTYPES:
            q, q_scale = quantize_per_tensor(q, p.kv_cache.dtype)
            kv_scale = torch.tensor([p.kv_scale], dtype=torch.float32, device=device)
        q = q.contiguous()  # the kernel addresses q as dense [total_q, H, D]
        o = torch.empty(total_q, heads, dv, dtype=p.q.dtype, device=device)

        keywords = {"sm_scale": p.softmax_scale}
        if release.page_keywords:
            keywords.update(page_size=1, nhead_kv=1)
        if q_scale is not None:
            keywords.update(q_scale=q_scale, kv_scale=kv_scale)
        if release.return_lse:
            keywords["return_lse"] = want_lse
        if plan.launch.num_kv_splits is not None:
            keywords["num_kv_splits"] = plan.launch.num_kv_splits
        _, kernel_lse = _aiter_mla().mla_decode_fwd(
            q,
            kv_view,
            o,
            meta.qo_indptr,
            meta.kv_indptr,
            meta.kv_indices,
            meta.kv_last_page_lens,
            meta.max_seqlen_q,
            **keywords,
        )

        kernel_out = o.view(batch, q_len, heads, dv)[:, :, :num_heads]
        out = kernel_out.masked_fill(empty[..., None], 0.0)
        if not want_lse:
            # Whatever a release without return_lse hands back second is not read.
            return _poisoned(out, None, poison)
        if kernel_lse is None:
            raise RuntimeError(
                f"aiter: {release.name}'s mla_decode_fwd(..., return_lse=True) returned no "
                "LSE, though its interface says it does; report it with `rocm-mla info`"
            )
        kernel_lse = kernel_lse.reshape(batch, q_len, heads)[:, :, :num_heads]
        lse = kernel_lse.to(torch.float32).masked_fill(empty, -math.inf)
        return _poisoned(out, lse, poison)


def _padded_windows(
    problem: DecodeProblem, q_len: int
) -> tuple[DecodeProblem, tuple[torch.Tensor, torch.Tensor]]:
    """Packed windows as ``q_len``-row ones, each padded at the front: ``(the uniform
    problem, (request, row) of each packed token)``.

    AITER's causal mask aligns a window's last row with the request's last key (row ``j``
    of ``S`` sees ``L - S + 1 + j`` keys), so a window of ``n`` rows placed in the last ``n``
    of ``S`` keeps each row's keys (``L - n + 1 + i``); the padding rows see fewer and are
    dropped. They cost the kernel rows, not KV reads: a window's rows share each KV load.
    """
    p = problem
    qsl = p.query_start_loc.to(torch.int64)
    sizes = qsl[1:] - qsl[:-1]  # [B]
    tokens = torch.arange(p.num_tokens, device=p.q.device)
    request = torch.searchsorted(qsl[1:], tokens, right=True)
    row = q_len - sizes[request] + tokens - qsl[request]
    q = p.q.new_zeros(p.batch, q_len, p.num_heads, p.head_dim)
    q[request, row] = p.q
    padded = dataclasses.replace(p, q=q, query_start_loc=None, max_q_len=None)
    return padded, (request, row)


def _poisoned(
    out: torch.Tensor, lse: torch.Tensor | None, poison: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``out``/``lse`` with the ``[B, S_q]`` rows of ``poison`` set to NaN in every head."""
    rows = poison[:, :, None]
    out = out.masked_fill(rows[..., None], math.nan).contiguous()
    return out, None if lse is None else lse.masked_fill(rows, math.nan).contiguous()


def release_reasons(spec: DecodeSpec, release: AiterRelease) -> list[str]:
    """What ``release`` cannot serve of ``spec``, each naming the release (empty: all of it)."""
    reasons = []
    if spec.kv_dtype in FP8_DTYPES and not release.fp8_scales:
        reasons.append(
            f"{release.name}: mla_decode_fwd takes no q_scale/kv_scale, so fp8 q over an fp8 "
            "cache cannot be scaled"
        )
    if spec.lse:
        reason = release.lse_reason(spec)
        if reason is not None:
            reasons.append(reason)
    return reasons


def _layout_reason(kv_cache: torch.Tensor) -> str:
    return (
        f"kv_cache blocks are not evenly strided (shape {tuple(kv_cache.shape)}, stride "
        f"{kv_cache.stride()}), so it has no page-size-1 view without a copy"
    )


def _shape_reasons(spec: DecodeSpec, arch: str | None) -> list[str]:
    """The limits of AITER's kernels that ``Capabilities`` cannot state as plain sets."""
    p = spec
    reasons = []
    if p.num_heads > KERNEL_HEADS[-1]:
        reasons.append(f"{p.num_heads} heads, supported: at most {KERNEL_HEADS[-1]}")
    is_fp8 = p.kv_dtype in FP8_DTYPES
    if is_fp8 and arch in FP8_BY_ARCH and p.kv_dtype != FP8_BY_ARCH[arch]:
        reasons.append(
            f"kv_cache dtype {p.kv_dtype} on {arch}: AITER's fp8 there is {FP8_BY_ARCH[arch]}"
        )
    max_q_len = MAX_Q_LEN_FP8 if is_fp8 else MAX_Q_LEN_BF16
    if p.q_len > max_q_len:
        reasons.append(
            f"q_len {p.q_len}, supported: up to {max_q_len} with a "
            f"{'fp8' if is_fp8 else 'bf16'} cache"
        )
    if p.q_len & (p.q_len - 1):
        reasons.append(
            f"q_len {p.q_len} is not a power of 2 (AITER returns wrong output, aiter#2720)"
        )
    if (
        arch == "gfx942"
        and not is_fp8
        and p.num_heads <= KERNEL_HEADS[-1]
        and kernel_heads(p.num_heads) == 16
        and p.q_len == 8
    ):
        reasons.append("bf16 with 16 kernel heads and q_len 8 on gfx942 (wrong output, aiter#5679)")
    if not p.causal and p.q_len > 1:
        # The backend runs AITER's default causal mask; older releases have no switch for it.
        reasons.append("non-causal q_len > 1 (AITER's decode masks verify windows causally)")
    if p.kv_pages_even is False:
        reasons.append(
            "kv_cache blocks are not evenly strided, so it has no page-size-1 view without a copy"
        )
    return reasons
