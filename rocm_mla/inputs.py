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
#: (planned calls with ``row_seqlens``) a row's KV bound outside ``[0, its request's length]``:
#: that row is NaN.
FAULT_ROW_BOUND = 16
_FAULT_TEXT = {
    FAULT_BLOCK_ID: "a block id a row may see is outside [0, num_blocks)",
    FAULT_BEYOND_TABLE: "a length exceeds the block table's capacity (max_blocks * block_size)",
    FAULT_BEYOND_PLAN: (
        "the lengths exceed what the plan covers (its max_seqlen or total_seqlen; re-plan the step)"
    ),
    FAULT_NEGATIVE_LENGTH: "a length is negative",
    FAULT_ROW_BOUND: "a row's KV bound (row_seqlens) lies outside [0, its request's length]",
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
    #: windows of different lengths: q packed ``[T, H, D]`` with ``query_start_loc``, and
    #: ``q_len`` the longest window
    varlen: bool = False
    #: every query row's KV bound given (``row_seqlens``), not derived from ``causal``
    row_bounds: bool = False

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
        """Keys every query row of every request is sure to see (0 when rows carry their
        own bounds)."""
        if self.spec.row_bounds:
            return 0
        if self.spec.causal:
            return max(0, self.min_seqlen - (self.spec.q_len - 1))
        return self.min_seqlen


@dataclass(frozen=True)
class DecodeProblem:
    """The validated arguments of one decode call, in the layout every backend consumes.

    Two query layouts: uniform windows, ``q [B, S_q, H, D]``; or windows of different
    lengths (``varlen``), ``q [T, H, D]`` packed request after request with
    ``query_start_loc [B + 1]`` (window ``b`` is rows ``[qsl[b], qsl[b + 1])``) and ``q_len``
    the longest window. A query row is one token of a window; ``row_seqlens``, when given,
    holds the KV bound of every one, flat ``[T]`` in q's token order (``T = B * S_q`` for
    uniform windows).
    """

    q: torch.Tensor  #: [B, S_q, H, D], or [T, H, D] with query_start_loc
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
    #: [B + 1] int32 window starts in q's tokens (varlen), else None
    query_start_loc: torch.Tensor | None = None
    #: the longest window (varlen; uniform windows read it from q's shape)
    max_q_len: int | None = None
    #: [T] int32 contiguous, the keys of its request's cache each query row sees, or None:
    #: then ``L - S_q + 1 + i`` for row ``i`` of a causal window of ``S_q``, else ``L``
    row_seqlens: torch.Tensor | None = None

    @property
    def varlen(self) -> bool:
        return self.query_start_loc is not None

    @property
    def batch(self) -> int:
        return self.query_start_loc.shape[0] - 1 if self.varlen else self.q.shape[0]

    @property
    def q_len(self) -> int:
        """The longest window (every window's length with uniform windows)."""
        return self.max_q_len if self.varlen else self.q.shape[1]

    @property
    def num_tokens(self) -> int:
        """``T``, query rows over all windows."""
        return self.q.shape[0] if self.varlen else self.q.shape[0] * self.q.shape[1]

    @property
    def num_heads(self) -> int:
        return self.q.shape[-2]

    @property
    def head_dim(self) -> int:
        return self.q.shape[-1]

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
            varlen=self.varlen,
            row_bounds=self.row_seqlens is not None,
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
    query_start_loc: torch.Tensor | None = None,
    max_q_len: int | None = None,
    row_seqlens: torch.Tensor | None = None,
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
        query_start_loc=query_start_loc,
        max_q_len=max_q_len,
        row_seqlens=row_seqlens,
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
    query_start_loc: torch.Tensor | None = None,
    max_q_len: int | None = None,
    row_seqlens: torch.Tensor | None = None,
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

    if query_start_loc is None:
        if max_q_len is not None:
            raise _fail("max_q_len", "None without query_start_loc (uniform windows)", max_q_len)
        if q.dim() != 4:
            raise _fail("q", "4-D [batch, q_len, num_heads, head_dim]", _describe(q))
        batch, q_len, num_heads, head_dim = q.shape
        tokens = batch * q_len
    else:
        batch, q_len = _check_windows(q, query_start_loc, max_q_len)
        tokens, num_heads, head_dim = q.shape
    if q.dtype not in Q_DTYPES:
        raise _fail("q", "float32, float16 or bfloat16", _describe(q))
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

    if row_seqlens is not None:
        expected = "[T]" if query_start_loc is not None else f"[{batch}, {q_len}]"
        shape = (tokens,) if query_start_loc is not None else (batch, q_len)
        if not isinstance(row_seqlens, torch.Tensor):
            raise _fail("row_seqlens", f"an int32 tensor {expected} or None", type(row_seqlens))
        if tuple(row_seqlens.shape) != shape or row_seqlens.dtype != torch.int32:
            raise _fail(
                "row_seqlens",
                f"int32 {expected} = {list(shape)}, one KV bound per query row",
                _describe(row_seqlens),
            )
        if not same_device(row_seqlens.device, q.device):
            raise _fail("row_seqlens", f"on q's device {q.device}", row_seqlens.device)
        row_seqlens = row_seqlens.reshape(tokens).contiguous()

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
        query_start_loc=query_start_loc,
        max_q_len=max_q_len,
        row_seqlens=row_seqlens,
    )


def _check_windows(
    q: torch.Tensor, query_start_loc: torch.Tensor, max_q_len: int | None
) -> tuple[int, int]:
    """Shapes of packed windows of different lengths: ``(B, max_q_len)``."""
    if q.dim() != 3:
        raise _fail(
            "q", "3-D [T, num_heads, head_dim] (windows packed) with query_start_loc", _describe(q)
        )
    if not isinstance(query_start_loc, torch.Tensor):
        raise _fail("query_start_loc", "an int32 tensor [B + 1] or None", type(query_start_loc))
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] < 2:
        raise _fail("query_start_loc", "1-D [B + 1] with B >= 1", _describe(query_start_loc))
    if query_start_loc.dtype != torch.int32:
        raise _fail("query_start_loc", "int32", query_start_loc.dtype)
    if not same_device(query_start_loc.device, q.device):
        raise _fail("query_start_loc", f"on q's device {q.device}", query_start_loc.device)
    if isinstance(max_q_len, bool) or not isinstance(max_q_len, int) or max_q_len < 1:
        raise _fail(
            "max_q_len", "the longest window, an int >= 1, with query_start_loc", repr(max_q_len)
        )
    return query_start_loc.shape[0] - 1, max_q_len


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
    """Lengths within the block table's capacity, used block ids in range, and the windows'
    starts and row bounds well formed; returns the lengths' ``(min, max, sum)``. One host
    read (``check_seqlens_and_blocks``)."""
    windows = None
    if problem.varlen or problem.row_seqlens is not None:
        windows = Windows(
            num_tokens=problem.num_tokens,
            q_len=problem.q_len,
            causal=problem.causal,
            query_start_loc=problem.query_start_loc,
            row_seqlens=problem.row_seqlens,
        )
    return check_seqlens_and_blocks(
        problem.cache_seqlens,
        problem.block_table,
        block_size=problem.block_size,
        num_blocks=problem.num_blocks,
        windows=windows,
    )


@dataclass(frozen=True)
class Windows:
    """The query windows of a call, for their value checks (``check_seqlens_and_blocks``)."""

    num_tokens: int  #: T, query rows in all
    q_len: int  #: the longest window (every window's length when not varlen)
    causal: bool
    query_start_loc: torch.Tensor | None  #: [B + 1] int32, or None: uniform windows
    row_seqlens: torch.Tensor | None  #: [T] int32, or None

    def token_requests(self, device: torch.device) -> torch.Tensor:
        """``[T]`` int64: the request of each query row."""
        tokens = torch.arange(self.num_tokens, device=device)
        if self.query_start_loc is None:
            return tokens // self.q_len
        starts = self.query_start_loc.to(device=device, dtype=torch.int64)[1:]
        return torch.searchsorted(starts, tokens, right=True)

    def value_parts(self, lens: torch.Tensor) -> list[torch.Tensor]:
        """What the checks read, reduced on ``lens``' device: window starts (first, last,
        windows outside ``[1, q_len]`` and the first of them), then row bounds (outside
        ``[0, L]``, the first and its value, decreasing in a causal window, the first)."""
        device = lens.device
        parts = []
        if self.query_start_loc is not None:
            qsl = self.query_start_loc.to(device=device, dtype=torch.int64)
            sizes = qsl[1:] - qsl[:-1]
            bad = (sizes < 1) | (sizes > self.q_len)
            parts += [qsl[0], qsl[-1], bad.sum(), bad.to(torch.uint8).argmax()]
        if self.row_seqlens is not None:
            rows = self.row_seqlens.to(device=device, dtype=torch.int64)
            requests = self.token_requests(device).clamp(0, lens.shape[0] - 1)
            outside = (rows < 0) | (rows > lens[requests])
            first = outside.to(torch.uint8).argmax()
            parts += [outside.sum(), first, rows[first]]
            if self.causal and self.num_tokens > 1:
                same_window = requests[1:] == requests[:-1]
                decreasing = same_window & (rows[1:] < rows[:-1])
                parts += [decreasing.sum(), decreasing.to(torch.uint8).argmax() + 1]
            else:
                parts += [torch.zeros((), dtype=torch.int64, device=device)] * 2
        return parts

    def raise_on(self, values: list[int]) -> None:
        """Raise for the first failed check in ``values`` (``value_parts``, read back)."""
        if self.query_start_loc is not None:
            first, last, bad, which = values[:4]
            values = values[4:]
            if first != 0 or last != self.num_tokens:
                raise _fail(
                    "query_start_loc",
                    f"window starts from 0 to T = {self.num_tokens} (q's rows)",
                    f"{first} to {last}",
                )
            if bad:
                raise _fail(
                    "query_start_loc",
                    f"windows of 1 to max_q_len = {self.q_len} rows",
                    f"{bad} windows outside that, first request {which}",
                )
        if self.row_seqlens is not None:
            outside, first, value, decreasing, where = values
            if outside:
                raise _fail(
                    "row_seqlens",
                    "KV bounds in [0, cache_seqlens] of each row's request (a row cannot "
                    "see keys its request does not have)",
                    f"{outside} rows outside, first row {first} with {value}",
                )
            if decreasing:
                raise _fail(
                    "row_seqlens",
                    "non-decreasing along each causal window (a later query sees at least "
                    "the keys an earlier one does)",
                    f"{decreasing} decreases, first at row {where}",
                )


def check_seqlens_and_blocks(
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    *,
    block_size: int | None,
    num_blocks: int | None,
    windows: Windows | None = None,
) -> tuple[int, int, int]:
    """The value checks: ``0 <= cache_seqlens <= capacity``, every block id a length uses
    in ``[0, num_blocks)`` and, with ``windows``, their starts and row bounds (``Windows``);
    parts whose inputs are None are skipped. Returns the lengths' ``(min, max, sum)``.

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
    window_at = len(parts)
    if windows is not None:
        parts += [v.to(torch.int64).reshape(()) for v in windows.value_parts(lens)]
    values = torch.stack(parts).tolist()
    if windows is not None:
        windows.raise_on(values[window_at:])
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


def row_bound_faults(problem: DecodeProblem) -> torch.Tensor:
    """``[B, S_q]`` bool: rows whose given KV bound (``row_seqlens``) lies outside ``[0, L]``
    of their request (a broken contract: such a row comes out NaN, ``FAULT_ROW_BOUND``);
    all False without ``row_seqlens``. Rows past a window's end are never faults."""
    p = problem
    if p.row_seqlens is None:
        return torch.zeros(p.batch, p.q_len, dtype=torch.bool, device=p.q.device)
    tokens, in_window = _window_tokens(p)
    rows = p.row_seqlens.to(torch.int64)[tokens]
    lens = p.cache_seqlens.to(torch.int64)[:, None]
    return in_window & ((rows < 0) | (rows > lens))


def _window_tokens(p: DecodeProblem) -> tuple[torch.Tensor, torch.Tensor]:
    """``([B, S_q] int64 token of row i of window b (clamped into [0, T)), [B, S_q] whether
    the window has that row)``."""
    offs = torch.arange(p.q_len, device=p.q.device)[None, :]
    if p.varlen:
        qsl = p.query_start_loc.to(torch.int64)
        starts, sizes = qsl[:-1, None], (qsl[1:] - qsl[:-1])[:, None]
    else:
        starts = torch.arange(p.batch, device=p.q.device)[:, None] * p.q_len
        sizes = torch.full_like(starts, p.q_len)
    tokens = (starts + offs).clamp(0, max(p.num_tokens - 1, 0))
    return tokens, offs < sizes


def visible_lengths(problem: DecodeProblem) -> torch.Tensor:
    """``[B, S_q]`` int64: how many keys query row ``i`` of each window sees, ``>= 0``.

    ``row_seqlens`` where given; else ``L - q + 1 + i`` for a causal window of ``q`` rows,
    ``L`` without causality. With windows of different lengths (varlen) ``S_q`` is the
    longest and the rows past a window's end see 0 keys.
    """
    p = problem
    lens = p.cache_seqlens.to(torch.int64)[:, None]
    tokens, in_window = _window_tokens(p)
    if p.row_seqlens is not None:
        visible = p.row_seqlens.to(torch.int64)[tokens]
    elif p.causal:
        sizes = in_window.sum(dim=1, keepdim=True)
        visible = lens - sizes + 1 + torch.arange(p.q_len, device=lens.device)[None, :]
    else:
        visible = lens.expand(-1, p.q_len)
    return torch.where(in_window, visible, 0).clamp_(min=0)
