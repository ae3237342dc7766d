"""Validation of ``mla_decode`` arguments, and the plan that lets a step skip most of it.

Every check names the argument, what was expected and what came. Two kinds:

- shape checks (``check_decode_args``): ranks, sizes, dtypes, devices. Pure host metadata,
  no tensor is read; every call does them.
- value checks (``check_decode_values``): lengths against the block table's capacity, block
  ids in range. They are reduced on the tensors' device into one small tensor and read back
  once (one host sync on a GPU), which also gives the lengths' range a one-shot call plans
  from (``DecodeProblem.seqlen_range``). The one-shot ``mla_decode`` does them on every
  call; a planned call (``plan=``) relies on ``plan_decode`` having done them once for the
  step, and repeats them only under ``ROCM_MLA_DEBUG=1``. A planned call given bad values
  anyway still reads nothing outside the cache: every backend poisons the rows that may see
  such a key and reports it through ``fault_flag`` (``FAULT_*`` below).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rocm_mla.platform import resolve_device, same_device

#: ``ROCM_MLA_DEBUG=1``: planned calls repeat the value checks and every call checks that the
#: inputs a row can see are finite (naming the first non-finite one). Off by default: both
#: read tensors back to the host.
DEBUG_ENV_VAR = "ROCM_MLA_DEBUG"

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
Q_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16, *FP8_DTYPES)

#: Bits a backend ORs into a call's ``fault_flag`` (int32 ``[1]`` on q's device) when a row may
#: see a key it must not read. The key is never read; the rows that may see it come out NaN.
#: A visible key's block id is outside ``[0, num_blocks)``:
FAULT_BLOCK_ID = 1
#: A visible key lies beyond the block table's capacity (``max_blocks * block_size``):
FAULT_BEYOND_TABLE = 2
#: (planned torch / AITER) lengths beyond the plan (``max_seqlen``, or AITER's ``total_seqlen``):
FAULT_BEYOND_PLAN = 4
#: (planned calls) a negative length: every row of that request is NaN.
FAULT_NEGATIVE_LENGTH = 8
_FAULT_TEXT = {
    FAULT_BLOCK_ID: "a block id a row may see is outside [0, num_blocks)",
    FAULT_BEYOND_TABLE: "a length exceeds the block table's capacity (max_blocks * block_size)",
    FAULT_BEYOND_PLAN: (
        "the lengths exceed what the plan covers (its max_seqlen or total_seqlen; re-plan the step)"
    ),
    FAULT_NEGATIVE_LENGTH: "a length is negative",
}


class KVBoundsError(ValueError):
    """A decode call was asked to read outside its KV cache or block table (see ``FAULT_*``)."""


def raise_on_fault(fault_flag: torch.Tensor, where: str) -> None:
    """Raise ``KVBoundsError`` naming every fault bit set in ``fault_flag``; no-op when 0.

    Reads the flag back to the host (one sync): call it where the caller syncs anyway.
    """
    bits = int(fault_flag.reshape(-1)[0])
    if bits:
        causes = "; ".join(text for bit, text in _FAULT_TEXT.items() if bits & bit)
        raise KVBoundsError(
            f"{where}: the decode skipped keys outside the KV cache ({causes}); the affected "
            f"rows are NaN. Fix the block table / lengths the scheduler passed "
            f"(ROCM_MLA_DEBUG=1 names the request)"
        )


def debug_checks_enabled() -> bool:
    """Whether ``ROCM_MLA_DEBUG`` asks for the value and finiteness checks on every call."""
    return os.environ.get(DEBUG_ENV_VAR, "").strip().lower() not in ("", "0", "false", "no")


@dataclass(frozen=True)
class DecodeSpec:
    """What backend selection needs to know about a decode call: shapes and types, no values.

    Built from a ``DecodeProblem`` (``problem.spec``) or by ``plan_decode`` before any tensor
    of the step exists. ``device`` is stored resolved (``platform.resolve_device``: ``"cuda"``
    becomes ``cuda:<current>``), as torch would place the step's tensors, so a plan made for
    ``"cuda"`` matches tensors on the GPU that was current when it was made.
    """

    device: torch.device
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    num_heads: int
    q_len: int
    head_dim: int  #: D = head_dim_v + rope width
    head_dim_v: int
    causal: bool = True
    block_size: int | None = None  #: None: not known yet (checked at the call)
    #: whether the paged cache has a page-size-1 view without a copy (None: not known yet)
    kv_pages_even: bool | None = None
    #: whether the caller reads the LSE (DCP's combine, ``merge_states``); with False
    #: (``return_lse=False`` of ``plan_decode`` / ``mla_decode``) the call returns ``lse``
    #: None, and a backend that has no LSE (an AITER release without one) may serve it.
    lse: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", resolve_device(self.device))


@dataclass(frozen=True)
class DecodePlan:
    """One decode step's decisions, made once by ``rocm_mla.plan_decode`` and shared by every
    MLA layer of the step.

    The plan holds for any call whose shapes and dtypes match it and whose ``cache_seqlens``
    lie in ``[min_seqlen, max_seqlen]`` and sum to at most ``total_seqlen``; ``launch`` is
    the backend's own data (the Triton split count and block shapes, AITER's token count).
    Using a plan reads no tensor.
    """

    backend: str
    spec: DecodeSpec
    batch: int
    min_seqlen: int
    max_seqlen: int
    total_seqlen: int  #: sum of the lengths (an upper bound under ``graph_max_seqlen``)
    #: the lengths are bounds, not values (a plan for CUDA/HIP graph capture and replay)
    bounds_only: bool = False
    launch: Any = field(default=None, compare=False)

    @property
    def min_visible(self) -> int:
        """Keys every query row of every request is sure to see (0 when not causal-known)."""
        if self.spec.causal:
            return max(0, self.min_seqlen - (self.spec.q_len - 1))
        return self.min_seqlen


@dataclass(frozen=True)
class DecodeProblem:
    """The validated arguments of one decode call, in the layout every backend consumes."""

    q: torch.Tensor  #: [B, S_q, H, D]
    kv_cache: torch.Tensor  #: [num_blocks, block_size, D] (a view; 4-D caches are squeezed)
    block_table: torch.Tensor  #: [B, max_blocks] int32
    cache_seqlens: torch.Tensor  #: [B] int32
    head_dim_v: int
    softmax_scale: float
    causal: bool
    kv_scale: float | None  #: per-tensor dequant scale of an fp8 cache, else None
    #: int32 ``[1]`` on q's device that the backend ORs ``FAULT_*`` bits into, or None
    fault_flag: torch.Tensor | None = None
    #: ``(min, max, sum)`` of ``cache_seqlens`` as the value checks read them (a one-shot
    #: call plans from it without reading again); None when they did not run
    seqlen_range: tuple[int, int, int] | None = None
    #: whether the caller reads the LSE (``DecodeSpec.lse``)
    lse: bool = True

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def q_len(self) -> int:
        return self.q.shape[1]

    @property
    def num_heads(self) -> int:
        return self.q.shape[2]

    @property
    def head_dim(self) -> int:
        return self.q.shape[3]

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.shape[0]

    @property
    def block_size(self) -> int:
        return self.kv_cache.shape[1]

    @functools.cached_property
    def spec(self) -> DecodeSpec:
        """The call's ``DecodeSpec``; made once per problem (selection and planning ask for
        it several times)."""
        kv = self.kv_cache
        even = kv.shape[0] == 1 or kv.stride(0) == kv.shape[1] * kv.stride(1)
        return DecodeSpec(
            device=self.q.device,
            q_dtype=self.q.dtype,
            kv_dtype=kv.dtype,
            num_heads=self.num_heads,
            q_len=self.q_len,
            head_dim=self.head_dim,
            head_dim_v=self.head_dim_v,
            causal=self.causal,
            block_size=self.block_size,
            kv_pages_even=even,
            lse=self.lse,
        )


def _fail(arg: str, expected: str, got: object) -> ValueError:
    return ValueError(f"mla_decode: {arg} must be {expected}, got {got}")


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}"


def prepare_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    head_dim_v: int,
    softmax_scale: float | None,
    causal: bool,
    kv_scale: float | torch.Tensor | None,
    check_values: bool = True,
    fault_flag: torch.Tensor | None = None,
) -> DecodeProblem:
    """Check every argument of ``mla_decode`` and return the normalized problem.

    ``check_values=False`` does the shape checks only and reads no tensor (a ``kv_scale``
    tensor is then refused: turning it into the float the kernels take would read it).
    """
    problem = check_decode_args(
        q,
        kv_cache,
        block_table,
        cache_seqlens,
        head_dim_v=head_dim_v,
        softmax_scale=softmax_scale,
        causal=causal,
        kv_scale=kv_scale,
        read_scale=check_values,
        fault_flag=fault_flag,
    )
    if check_values:
        problem = dataclasses.replace(problem, seqlen_range=check_decode_values(problem))
    if debug_checks_enabled():
        if not check_values:
            check_decode_values(problem)
        check_finite(problem)
    return problem


def check_decode_args(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    head_dim_v: int,
    softmax_scale: float | None,
    causal: bool,
    kv_scale: float | torch.Tensor | None,
    read_scale: bool = True,
    fault_flag: torch.Tensor | None = None,
) -> DecodeProblem:
    """The shape/dtype/device checks of ``mla_decode``: host metadata only, no tensor read
    (except a ``kv_scale`` tensor when ``read_scale``)."""
    for name, t in (
        ("q", q),
        ("kv_cache", kv_cache),
        ("block_table", block_table),
        ("cache_seqlens", cache_seqlens),
    ):
        if not isinstance(t, torch.Tensor):
            raise _fail(name, "a torch.Tensor", type(t).__name__)

    if q.dim() != 4:
        raise _fail("q", "4-D [batch, q_len, num_heads, head_dim]", _describe(q))
    if q.dtype not in Q_DTYPES:
        raise _fail("q", "float32, float16 or bfloat16", _describe(q))
    batch, q_len, num_heads, head_dim = q.shape
    if batch < 1 or q_len < 1 or num_heads < 1:
        raise _fail("q", "non-empty in batch, q_len and num_heads", _describe(q))
    if (
        isinstance(head_dim_v, bool)
        or not isinstance(head_dim_v, int)
        or not 0 < head_dim_v < head_dim
    ):
        raise _fail(
            "head_dim_v", f"an int in (0, {head_dim}) (q's head_dim holds V plus rope)", head_dim_v
        )

    if kv_cache.dim() == 4:
        if kv_cache.shape[2] != 1:
            raise _fail(
                "kv_cache",
                "[num_blocks, block_size, D] or [num_blocks, block_size, 1, D] (one latent head)",
                _describe(kv_cache),
            )
        kv_cache = kv_cache.squeeze(2)
    if kv_cache.dim() != 3:
        raise _fail(
            "kv_cache",
            "[num_blocks, block_size, D] or [num_blocks, block_size, 1, D]",
            _describe(kv_cache),
        )
    if kv_cache.shape[2] != head_dim:
        raise _fail("kv_cache", f"last dim {head_dim} (q's head_dim)", _describe(kv_cache))
    if kv_cache.shape[0] < 1 or kv_cache.shape[1] < 1:
        raise _fail("kv_cache", "at least one block of at least one token", _describe(kv_cache))
    if kv_cache.dtype not in KV_DTYPES:
        raise _fail(
            "kv_cache", "float32, float16, bfloat16 or fp8 (e4m3fn/e4m3fnuz)", kv_cache.dtype
        )
    if kv_cache.stride(-1) != 1:
        raise _fail("kv_cache", "contiguous in its last dim", f"stride {kv_cache.stride()}")

    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise _fail("block_table", f"2-D [{batch}, max_blocks]", _describe(block_table))
    if block_table.dtype != torch.int32:
        raise _fail("block_table", "int32", block_table.dtype)
    if cache_seqlens.dim() != 1 or cache_seqlens.shape[0] != batch:
        raise _fail("cache_seqlens", f"1-D [{batch}]", _describe(cache_seqlens))
    if cache_seqlens.dtype != torch.int32:
        raise _fail("cache_seqlens", "int32", cache_seqlens.dtype)
    for name, t in (
        ("kv_cache", kv_cache),
        ("block_table", block_table),
        ("cache_seqlens", cache_seqlens),
    ):
        if not same_device(t.device, q.device):
            raise _fail(name, f"on q's device {q.device}", t.device)

    if softmax_scale is None:
        softmax_scale = head_dim**-0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise _fail("softmax_scale", "a positive finite float or None", repr(softmax_scale))
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise _fail("softmax_scale", "a positive finite float or None", softmax_scale)

    if kv_cache.dtype in FP8_DTYPES:
        if kv_scale is None:
            raise _fail("kv_scale", f"the per-tensor scale of the {kv_cache.dtype} cache", None)
        if isinstance(kv_scale, torch.Tensor):
            if not kv_scale.dtype.is_floating_point:
                raise _fail("kv_scale", "a floating-point scalar tensor", _describe(kv_scale))
            if kv_scale.numel() != 1:
                raise _fail("kv_scale", "a scalar (per-tensor scale)", _describe(kv_scale))
            if not read_scale:
                raise _fail(
                    "kv_scale",
                    "a Python float with plan= (reading a tensor scale is a host sync; "
                    "read it once when the cache is set up)",
                    _describe(kv_scale),
                )
            kv_scale = float(kv_scale.item())
        elif isinstance(kv_scale, bool) or not isinstance(kv_scale, (int, float)):
            raise _fail(
                "kv_scale",
                "a positive finite number (or a floating-point scalar tensor)",
                repr(kv_scale),
            )
        kv_scale = float(kv_scale)
        if not (math.isfinite(kv_scale) and kv_scale > 0):
            raise _fail("kv_scale", "a positive finite scale", kv_scale)
    elif kv_scale is not None:
        raise _fail(
            "kv_scale", f"None for a {kv_cache.dtype} cache (only fp8 caches scale)", kv_scale
        )

    if fault_flag is not None:
        if not isinstance(fault_flag, torch.Tensor):
            raise _fail("fault_flag", "an int32 tensor [1] or None", type(fault_flag).__name__)
        if fault_flag.dtype != torch.int32 or tuple(fault_flag.shape) != (1,):
            raise _fail("fault_flag", "an int32 tensor of shape [1]", _describe(fault_flag))
        if not same_device(fault_flag.device, q.device):
            raise _fail("fault_flag", f"on q's device {q.device}", fault_flag.device)

    return DecodeProblem(
        q=q,
        kv_cache=kv_cache,
        block_table=block_table,
        cache_seqlens=cache_seqlens,
        head_dim_v=head_dim_v,
        softmax_scale=float(softmax_scale),
        causal=bool(causal),
        kv_scale=kv_scale if kv_cache.dtype in FP8_DTYPES else None,
        fault_flag=fault_flag,
    )


def planned_lengths(where: str, cache_seqlens: object) -> torch.Tensor | list[int]:
    """The ``cache_seqlens`` a planner takes, checked for type: a 1-D integer tensor ``[B]``
    (returned as is, not read) or a sequence of Python ints (returned as a list).

    A bool is not a length (``True`` would plan one token), nor is a float (it would be cut to
    an int) or a complex value; ``ValueError`` naming ``where`` and what came.
    """
    expected = "ints: a 1-D integer tensor [B] or a list of Python ints (a bool is not a length)"
    if isinstance(cache_seqlens, torch.Tensor):
        dtype = cache_seqlens.dtype
        not_int = dtype.is_floating_point or dtype.is_complex or dtype == torch.bool
        if not_int or cache_seqlens.dim() != 1:
            got = f"{tuple(cache_seqlens.shape)} {dtype}"
            raise ValueError(f"{where}: cache_seqlens must be {expected}, got {got}")
        return cache_seqlens
    if isinstance(cache_seqlens, (str, bytes)) or not isinstance(cache_seqlens, Sequence):
        raise ValueError(f"{where}: cache_seqlens must be {expected}, got {cache_seqlens!r}")
    values = list(cache_seqlens)
    if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise ValueError(f"{where}: cache_seqlens must be {expected}, got {values!r}")
    return values


def check_decode_values(problem: DecodeProblem) -> tuple[int, int, int]:
    """Lengths within the block table's capacity and used block ids in range; returns the
    lengths' ``(min, max, sum)``. One host read (``check_seqlens_and_blocks``)."""
    return check_seqlens_and_blocks(
        problem.cache_seqlens,
        problem.block_table,
        block_size=problem.block_size,
        num_blocks=problem.num_blocks,
    )


def check_seqlens_and_blocks(
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    *,
    block_size: int | None,
    num_blocks: int | None,
) -> tuple[int, int, int]:
    """The value checks: ``0 <= cache_seqlens <= capacity`` and every block id a length uses
    in ``[0, num_blocks)``; parts whose inputs are None are skipped. Returns the lengths'
    ``(min, max, sum)``.

    Every check is reduced on the tensors' device (the block table's, when it is checked)
    into one small tensor, read back once: one host sync on a GPU, whatever fails.
    """
    if cache_seqlens.numel() == 0:
        return 0, 0, 0
    ids_checked = (
        block_table is not None
        and block_size is not None
        and num_blocks is not None
        and block_table.shape[1] > 0
    )
    device = block_table.device if ids_checked else cache_seqlens.device
    lens = cache_seqlens.to(device=device, dtype=torch.int64)
    lo, hi = torch.aminmax(lens)
    parts = [lo, hi, lens.sum()]
    if ids_checked:
        # A column is used when its first key lies below the length.
        firsts = torch.arange(0, block_table.shape[1] * block_size, block_size, device=device)
        out_of_range = block_table != block_table.clamp(0, num_blocks - 1)
        used_bad = (out_of_range & (firsts[None, :] < lens[:, None])).view(-1)
        # The first bad id, row-major; gathered on the device (indexing with a tensor
        # scalar would read it back).
        first = used_bad.to(torch.uint8).argmax().reshape(1)
        first_id = block_table.reshape(-1).index_select(0, first)[0]
        parts += [used_bad.sum(), first_id.to(torch.int64)]
    values = torch.stack(parts).tolist()
    lo, hi, total = values[:3]
    if lo < 0:
        raise _fail("cache_seqlens", "non-negative", f"a minimum of {lo}")
    if block_table is not None and block_size is not None:
        capacity = block_table.shape[1] * block_size
        if hi > capacity:
            raise _fail(
                "cache_seqlens",
                f"at most the block table's capacity {block_table.shape[1]} blocks x "
                f"{block_size} tokens = {capacity}",
                f"a maximum of {hi}",
            )
    if ids_checked and values[3]:
        raise _fail(
            "block_table",
            f"block ids in [0, {num_blocks}) (kv_cache's num_blocks) for every "
            "block that cache_seqlens uses",
            f"{values[3]} out-of-range ids, first {values[4]}",
        )
    return lo, hi, total


def check_finite(problem: DecodeProblem) -> None:
    """``ROCM_MLA_DEBUG``: raise naming the first non-finite input a query row can see.

    Slots past a request's length may hold anything (they are never read), so only the
    cache rows below each length are checked.
    """
    p = problem
    if not bool(torch.isfinite(p.q).all()):
        index = tuple(int(i) for i in (~torch.isfinite(p.q)).nonzero()[0])
        raise ValueError(f"mla_decode ({DEBUG_ENV_VAR}): q{list(index)} is not finite")
    lens = p.cache_seqlens.to(torch.int64)
    max_len = int(lens.max()) if lens.numel() else 0
    if max_len == 0:
        return
    pos = torch.arange(max_len, device=lens.device)
    valid = pos[None, :] < lens[:, None]  # [B, max_len]
    cols = (pos // p.block_size).clamp(max=p.block_table.shape[1] - 1)
    blocks = p.block_table[:, cols].to(torch.int64)  # [B, max_len]
    rows = p.kv_cache[blocks.clamp(0, p.num_blocks - 1), (pos % p.block_size)[None, :]]
    bad = valid & ~torch.isfinite(rows.to(torch.float32)).all(dim=-1)
    if bool(bad.any()):
        b, t = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"mla_decode ({DEBUG_ENV_VAR}): kv_cache row of request {b}, token {t} (block "
            f"{int(blocks[b, t])}, offset {t % p.block_size}) is not finite"
        )


def visible_lengths(problem: DecodeProblem) -> torch.Tensor:
    """[B, S_q] int64: how many keys query row i sees (``L - S_q + 1 + i`` when causal, >= 0)."""
    lens = problem.cache_seqlens.to(torch.int64)[:, None]
    if not problem.causal:
        return lens.expand(-1, problem.q_len)
    offs = torch.arange(problem.q_len, device=lens.device) - (problem.q_len - 1)
    return (lens + offs[None, :]).clamp_(min=0)
