"""The public kernel entry points. A user learns the package from this file (and the data
flow of one call from docs/architecture.md, "One mla_decode call").

Shapes (DeepSeek/Kimi absorbed MLA): ``D = head_dim_v + rope_dim`` = 512 + 64 = 576; the KV
cache holds one latent row of ``D`` values per token, its first ``head_dim_v`` columns are V.

Two ways to call the decode, FlashMLA-style:

- one-shot: ``mla_decode(q, kv_cache, block_table, cache_seqlens)`` checks everything, picks
  the backend and plans the launch on every call (reads the lengths: a host sync on a GPU);
- planned: ``plan = plan_decode(cache_seqlens, q_len=..., num_heads=..., kv_dtype=...)`` once
  per decode step, then ``mla_decode(..., plan=plan)`` in every MLA layer of the step. The
  planned call checks shapes, dtypes and devices only and reads nothing back from the device,
  so it can be captured in a CUDA/HIP graph. ``ROCM_MLA_DEBUG=1`` turns the value checks back
  on for planned calls and adds a check that every input a row sees is finite.

Out of bounds: no call, planned or one-shot, reads outside ``kv_cache`` or the block
table. A planned call trusts the step's plan, so a bad block id or length there turns the
rows that may see it into NaN and, when ``fault_flag=`` is given, sets a bit in that device
tensor for the caller to read at its own sync (``raise_on_fault`` -> ``KVBoundsError``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from rocm_mla.backends import available_backends, backend_class, select_backend
from rocm_mla.inputs import (
    FAULT_BEYOND_PLAN,
    FAULT_BEYOND_TABLE,
    FAULT_BLOCK_ID,
    FAULT_NEGATIVE_LENGTH,
    FAULT_ROW_BOUND,
    FP8_DTYPES,
    KV_DTYPES,
    Q_DTYPES,
    DecodePlan,
    DecodeSpec,
    KVBoundsError,
    check_seqlens_and_blocks,
    planned_lengths,
    prepare_decode,
    raise_on_fault,
)
from rocm_mla.merge import check_merge_args, torch_merge_states
from rocm_mla.platform import resolve_device, same_device

__all__ = [
    "FAULT_BEYOND_PLAN",
    "FAULT_BEYOND_TABLE",
    "FAULT_BLOCK_ID",
    "FAULT_NEGATIVE_LENGTH",
    "FAULT_ROW_BOUND",
    "DecodePlan",
    "KVBoundsError",
    "available_backends",
    "merge_states",
    "mla_decode",
    "plan_decode",
    "plan_schedule",
    "raise_on_fault",
    "replan_decode",
]


def plan_decode(
    cache_seqlens: torch.Tensor | Sequence[int],
    *,
    q_len: int,
    num_heads: int,
    head_dim_v: int = 512,
    kv_dtype: torch.dtype,
    rope_dim: int = 64,
    q_dtype: torch.dtype | None = None,
    causal: bool = True,
    device: torch.device | str | None = None,
    block_table: torch.Tensor | None = None,
    kv_cache: torch.Tensor | None = None,
    graph_max_seqlen: int | None = None,
    backend: str | None = None,
    return_lse: bool = True,
    varlen: bool = False,
    row_bounds: bool = False,
) -> DecodePlan:
    """Plan one decode step: made once, passed as ``plan=`` to every MLA layer's decode.

    Resolves the backend (``backend`` / ``$ROCM_MLA_BACKEND`` / auto), checks the lengths
    (and, when given, that they fit ``block_table`` and its block ids fit ``kv_cache``) and
    computes the launch decisions (Triton split count and block shapes, AITER's token count).
    At most one host sync, here: none when ``cache_seqlens`` is on the CPU (a list or a CPU
    tensor, as an engine's scheduler has them).

    Args:
        cache_seqlens: ``[B]`` tokens in the cache per request, the ``S_q`` new ones included
            (as ``mla_decode``); a list of ints or an int tensor on any device.
        q_len: ``S_q``, queries per request (with ``varlen``, the longest window a call of
            this plan may bring). num_heads: query heads the kernel sees.
        head_dim_v, rope_dim: V width (512) and rope width (64); ``D`` is their sum.
        kv_dtype: the cache's dtype (fp8 e4m3fn/e4m3fnuz included).
        q_dtype: q's dtype; None means ``kv_dtype`` for a 16/32-bit cache, bfloat16 for fp8.
        causal: as ``mla_decode``.
        device: where q and the cache live (``"cuda"``: the current GPU, stored resolved in
            ``plan.spec.device``); None: ``cache_seqlens``' device for a tensor, else
            ``kv_cache``'s, else the current GPU when there is one, else the CPU. A
            ``cache_seqlens`` tensor on a GPU, ``block_table`` and ``kv_cache`` must be on it.
        block_table, kv_cache: optional; when given, the value checks of ``mla_decode`` run
            here once (lengths within the table's capacity, used block ids in range).
        graph_max_seqlen: plan for *any* lengths up to this bound instead of the values of
            ``cache_seqlens`` (only its length ``B`` is used), for a decode captured once in a
            CUDA/HIP graph and replayed on later steps.
        backend: as ``mla_decode``.
        return_lse: False when the step's calls do not read the LSE (no DCP combine, no
            ``merge_states``): they then return ``(out, None)``, and a backend that cannot
            produce an LSE (an AITER release without one) may serve them.
        varlen: the calls pack windows of different lengths (``mla_decode``'s
            ``query_start_loc``).
        row_bounds: the calls give every query row's KV bound (``mla_decode``'s
            ``row_seqlens``).

    Returns:
        A ``DecodePlan`` valid for calls with these shapes and dtypes whose lengths lie in
        ``[plan.min_seqlen, plan.max_seqlen]`` and sum to at most ``plan.total_seqlen``
        (checked only under ``ROCM_MLA_DEBUG=1``; otherwise the rows a plan does not cover
        come out NaN, see ``mla_decode``'s ``fault_flag``).

    Raises:
        ValueError: a malformed argument, or no backend (or not the named one) can run it.
    """
    for name, value, low in (("q_len", q_len, 1), ("num_heads", num_heads, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"plan_decode: {name} must be an int >= {low}, got {value!r}")
    for name, value in (("varlen", varlen), ("row_bounds", row_bounds)):
        if not isinstance(value, bool):
            raise ValueError(f"plan_decode: {name} must be a bool, got {value!r}")
    for name, value in (("head_dim_v", head_dim_v), ("rope_dim", rope_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"plan_decode: {name} must be an int >= 0, got {value!r}")
    if not isinstance(return_lse, bool):
        raise ValueError(f"plan_decode: return_lse must be True or False, got {return_lse!r}")
    if kv_dtype not in KV_DTYPES:
        raise ValueError(
            f"plan_decode: kv_dtype must be float32, float16, bfloat16 or fp8 "
            f"(e4m3fn/e4m3fnuz), got {kv_dtype!r}"
        )
    if q_dtype is None:
        q_dtype = torch.bfloat16 if kv_dtype in FP8_DTYPES else kv_dtype
    if q_dtype not in Q_DTYPES:
        raise ValueError(
            f"plan_decode: q_dtype must be float32, float16 or bfloat16, got {q_dtype!r}"
        )

    lens = planned_lengths("plan_decode", cache_seqlens)
    if isinstance(lens, torch.Tensor):
        lens_device = lens.device
    else:
        lens_device = None
        lens = torch.tensor(lens, dtype=torch.int64)
    batch = lens.shape[0]
    if batch < 1:
        raise ValueError("plan_decode: cache_seqlens must hold at least one request, got []")
    if device is None:
        if lens_device is not None:
            device = lens_device
        elif kv_cache is not None:
            device = kv_cache.device
        else:
            device = "cuda" if torch.cuda.is_available() else "cpu"
    device = resolve_device(device)
    # Host lengths may plan for any device; device lengths, a block table and a cache are read
    # (or scheduled from) where they are, which must be the plan's device.
    placed = [("block_table", block_table), ("kv_cache", kv_cache)]
    if lens_device is not None and lens_device.type != "cpu":
        placed.append(("cache_seqlens", lens))
    for name, t in placed:
        if t is not None and not same_device(t.device, device):
            raise ValueError(
                f"plan_decode: {name} must be on the plan's device {device}, got a tensor "
                f"on {t.device}"
            )

    if graph_max_seqlen is not None:
        if (
            isinstance(graph_max_seqlen, bool)
            or not isinstance(graph_max_seqlen, int)
            or (graph_max_seqlen < 0)
        ):
            raise ValueError(
                f"plan_decode: graph_max_seqlen must be an int >= 0, got {graph_max_seqlen!r}"
            )
        low, high, total = 0, graph_max_seqlen, batch * graph_max_seqlen
    else:
        low, high, total = check_seqlens_and_blocks(
            lens,
            block_table,
            block_size=None if kv_cache is None else kv_cache.shape[1],
            num_blocks=None if kv_cache is None else kv_cache.shape[0],
        )
    capacity = (
        None
        if block_table is None or kv_cache is None
        else block_table.shape[1] * kv_cache.shape[1]
    )

    spec = DecodeSpec(
        device=device,
        q_dtype=q_dtype,
        kv_dtype=kv_dtype,
        num_heads=num_heads,
        q_len=q_len,
        head_dim=head_dim_v + rope_dim,
        head_dim_v=head_dim_v,
        causal=bool(causal),
        block_size=None if kv_cache is None else kv_cache.shape[1],
        lse=return_lse,
        varlen=varlen,
        row_bounds=row_bounds,
    )
    impl_cls = select_backend(backend, spec)
    return impl_cls.make_plan(
        spec,
        batch=batch,
        min_seqlen=low,
        max_seqlen=high,
        total_seqlen=total,
        bounds_only=graph_max_seqlen is not None,
        lengths=lens,
        capacity_keys=capacity,
        cache_bytes=None if kv_cache is None else kv_cache.numel() * kv_cache.element_size(),
    )


def replan_decode(plan: DecodePlan, cache_seqlens: torch.Tensor) -> DecodePlan:
    """Re-plan ``plan`` for this step's lengths, in place and on the device (no host read).

    A plan made with ``graph_max_seqlen`` holds its launch for any lengths up to the bound;
    the Triton backend's balanced schedule (which programs walk which keys) is data in the
    plan's device tables. Call this once per step, before the step's first decode (and
    outside a captured graph, or inside it before the layers): the tables keep their
    addresses, so a graph captured with the plan replays with the balance of these lengths.
    Backends with nothing to re-plan return the plan unchanged.

    Args:
        plan: a ``DecodePlan`` from ``plan_decode``.
        cache_seqlens: ``[plan.batch]`` int32 on the plan's device, this step's lengths.

    Returns:
        ``plan`` itself.
    """
    if not isinstance(plan, DecodePlan):
        raise ValueError(f"replan_decode: plan must be a DecodePlan, got {type(plan).__name__}")
    if (
        not isinstance(cache_seqlens, torch.Tensor)
        or tuple(cache_seqlens.shape) != (plan.batch,)
        or cache_seqlens.dtype != torch.int32
        or not same_device(cache_seqlens.device, plan.spec.device)
    ):
        got = (
            f"{tuple(cache_seqlens.shape)} {cache_seqlens.dtype} on {cache_seqlens.device}"
            if isinstance(cache_seqlens, torch.Tensor)
            else type(cache_seqlens).__name__
        )
        raise ValueError(
            f"replan_decode: cache_seqlens must be an int32 tensor [{plan.batch}] on "
            f"{plan.spec.device}, got {got}"
        )
    backend_class(plan.backend).reschedule(plan, cache_seqlens)
    return plan


def plan_schedule(
    cache_seqlens: torch.Tensor | Sequence[int],
    *,
    q_len: int,
    num_heads: int,
    kv_dtype: torch.dtype,
    target=None,
    q_dtype: torch.dtype | None = None,
    head_dim_v: int = 512,
    rope_dim: int = 64,
    page_size: int = 64,
    max_blocks: int | None = None,
):
    """The balanced decomposition the Triton kernel runs for these lengths, on the host.

    For users, tools and tests: which program walks which keys of which request, without a
    GPU. The same packing ``plan_decode`` builds (``rocm_mla.kernels.schedule``).

    Args:
        cache_seqlens: ``[B]`` lengths (a list of ints or a tensor, read on the host).
        q_len, num_heads, kv_dtype, q_dtype, head_dim_v, rope_dim: as ``plan_decode``.
        target: a ``rocm_mla.kernels.target.TritonTarget``, including one for a GPU this
            machine lacks (e.g. ``TritonTarget("hip", "gfx942", 304)``: its stage 1 is
            compiled for that target to read its residency); None: this machine's.
        page_size: the KV cache's block size (the kernel specializes on it).
        max_blocks: the block table's width; None plans every length whole.

    Returns:
        A ``Schedule``: ``entries`` (one per segment in launch order: program, request, row
        group, first key, end key, partial slot, and the slot the plan runs it on),
        ``programs_per_cu``, ``num_cus``, ``num_slots``, ``num_programs`` (the stage-1
        grid), ``num_pools`` (XCDs filled apart), ``slot_loads`` in its cost model, and the
        budget no slot exceeds.
    """
    from rocm_mla.kernels import schedule as sch
    from rocm_mla.kernels.plan import plan_launch
    from rocm_mla.kernels.target import triton_target

    lengths = planned_lengths("plan_schedule", cache_seqlens)
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.tolist()
    if not lengths:
        raise ValueError("plan_schedule: cache_seqlens must hold at least one request, got []")
    if q_dtype is None:
        q_dtype = torch.bfloat16 if kv_dtype in FP8_DTYPES else kv_dtype
    target = triton_target() if target is None else target
    if target is None:
        raise ValueError("plan_schedule: no Triton target on this machine; pass target=")
    head_dim = head_dim_v + rope_dim
    config, slots = plan_launch(
        q_len=q_len,
        num_heads=num_heads,
        kv_dtype=kv_dtype,
        target=target,
        q_dtype=q_dtype,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        page_size=page_size,
        cache_bytes=sum(max(v, 0) for v in lengths) * head_dim * kv_dtype.itemsize,
    )
    groups = -(-(q_len * num_heads) // config.block_h)
    capacity = sch.MAX_KEYS if max_blocks is None else max_blocks * page_size
    packing, tables = sch.host_plan(
        lengths,
        num_groups=groups,
        num_slots=slots,
        capacity_keys=capacity,
        num_pools=config.num_xcds,
    )
    return sch.Schedule(
        entries=sch.schedule_entries(tables),
        num_cus=target.num_cus,
        programs_per_cu=slots // target.num_cus,
        num_slots=slots,
        num_groups=groups,
        block_h=config.block_h,
        budget_keys=packing.budget,
        num_programs=tables.num_programs,
        num_pools=tables.num_pools,
    )


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    head_dim_v: int = 512,
    softmax_scale: float | None = None,
    causal: bool = True,
    kv_scale: float | torch.Tensor | None = None,
    backend: str | None = None,
    plan: DecodePlan | None = None,
    fault_flag: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    max_q_len: int | None = None,
    row_seqlens: torch.Tensor | None = None,
    return_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Absorbed-MLA decode attention over a paged latent KV cache (FlashMLA-shaped).

    Args:
        q: ``[B, S_q, H, D]`` float32/float16/bfloat16. Per head, the absorbed query
            (``q_nope @ W_UK`` in the first ``head_dim_v`` columns, ``q_pe`` after). ``S_q``
            > 1 is a causal verify window (speculative decoding). With ``query_start_loc``,
            windows of different lengths packed as ``[T, H, D]``.
        kv_cache: ``[num_blocks, block_size, D]`` or ``[num_blocks, block_size, 1, D]``;
            float32/float16/bfloat16, or fp8 (e4m3fn / e4m3fnuz) with ``kv_scale``.
        block_table: ``[B, max_blocks]`` int32; entry ``j`` of request ``b`` is the cache
            block holding its tokens ``[j * block_size, (j + 1) * block_size)``. Any order;
            entries past a request's last block are ignored.
        cache_seqlens: ``[B]`` int32 tokens in the cache per request, the ``S_q`` new ones
            included; ``0 <= cache_seqlens <= max_blocks * block_size``.
        head_dim_v: V width (kv_lora_rank, 512); ``D - head_dim_v`` is the rope width.
        softmax_scale: defaults to ``D ** -0.5``.
        causal: query ``i`` of a window of ``S_q`` sees keys ``[0, cache_seqlens - S_q + i]``;
            when False every query sees all ``cache_seqlens`` keys. With ``row_seqlens`` the
            rows' bounds are given, and causal says they must not decrease along a window.
        kv_scale: per-tensor dequant scale of an fp8 cache (required for fp8, else None; a
            Python float with ``plan``).
        backend: "auto", "aiter", "triton" or "torch"; None reads ``$ROCM_MLA_BACKEND``
            (default auto: aiter on gfx942/gfx950 when it can run the call, else Triton on
            a GPU, else torch). Ignored with ``plan`` (the plan resolved it).
        plan: a ``DecodePlan`` from ``plan_decode`` for this step: then only shapes, dtypes
            and devices are checked (against the plan too) and nothing is read back from the
            device; the lengths must lie in the plan's range (and sum to at most its
            ``total_seqlen``).
        fault_flag: optional ``[1]`` int32 tensor on q's device. The call ORs ``FAULT_*``
            bits into it on the device (no host sync) when a row may see a key outside the
            cache: ``FAULT_BLOCK_ID`` (a visible key's block id outside ``[0, num_blocks)``),
            ``FAULT_BEYOND_TABLE`` (a visible key past ``max_blocks * block_size``),
            ``FAULT_BEYOND_PLAN`` (torch, planned: a length above ``plan.max_seqlen``),
            ``FAULT_NEGATIVE_LENGTH`` (a negative length: its request's rows are NaN). It is
            never cleared here: zero it once per step and read it where the step syncs
            anyway (``raise_on_fault(flag, where)`` raises ``KVBoundsError``). Whether or not
            a flag is given, such a key is never read and the rows that may see it come out
            NaN (out and lse); other rows are exact. A one-shot call checks the values first
            and raises instead. ``FAULT_ROW_BOUND``: a ``row_seqlens`` entry outside
            ``[0, cache_seqlens]`` of its request (that row is NaN).
        query_start_loc: ``[B + 1]`` int32 on q's device, or None. Windows of different
            lengths (n-gram / MTP / draft verification, as vLLM and FlashInfer pack them):
            ``q [T, H, D]`` holds window ``b`` in rows ``[qsl[b], qsl[b + 1])``, each of 1 to
            ``max_q_len`` rows, ``qsl[0] = 0`` and ``qsl[B] = T``; out and lse come packed
            the same way. Every row of a window shares each KV tile the kernel loads.
        max_q_len: the longest window with ``query_start_loc`` (a host int; with ``plan``
            it defaults to the plan's ``q_len``).
        row_seqlens: int32 on q's device, ``[B, S_q]`` (``[T]`` with ``query_start_loc``),
            or None: the KV bound of every query row, the keys ``[0, row_seqlens)`` of its
            request's cache it sees, each in ``[0, cache_seqlens]``. Decode context
            parallelism needs it: row ``i`` of a causal window sees global positions up to
            ``L - S_q + i``, of which this rank holds a count that is not ``local(L) - S_q +
            1 + i`` (``rocm_mla.dcp.verify_local_seq_lens``). All rows of a window still
            share each KV tile load and mask by their own bound.
        return_lse: False when the caller does not read the LSE: the call returns
            ``(out, None)``, and a backend that has no LSE (an AITER release without one) may
            serve it. Ignored with ``plan`` (``plan_decode``'s ``return_lse`` holds).

    Returns:
        ``(out, lse)``: ``out [B, S_q, H, head_dim_v]`` in q's dtype; ``lse [B, S_q, H]``
        float32 (``[T, H, head_dim_v]`` and ``[T, H]`` with ``query_start_loc``), natural
        log of the softmax denominator (scores already scaled). A row with
        no visible key has ``out = 0`` and ``lse = -inf``. A NaN or Inf in an input a row
        sees (q, a visible cache row, an overflowing scale) gives that row out NaN and lse
        NaN, never a silent zero. ``lse`` is None without ``return_lse`` (the plan's, for
        a planned call).

    Raises:
        ValueError: a malformed argument (which one, what was expected, what came), an
            unknown backend name, or a named backend that cannot run this call (its reasons).
            ``ROCM_MLA_DEBUG=1``: a planned call whose lengths lie outside the plan's range,
            or whose block ids / lengths leave the cache or table.
    """
    if plan is not None and not isinstance(plan, DecodePlan):
        raise ValueError(
            "mla_decode: plan must be a DecodePlan from rocm_mla.plan_decode, got "
            f"{type(plan).__name__}"
        )
    if query_start_loc is not None and max_q_len is None and plan is not None:
        max_q_len = plan.spec.q_len
    problem = prepare_decode(
        q,
        kv_cache,
        block_table,
        cache_seqlens,
        head_dim_v=head_dim_v,
        softmax_scale=softmax_scale,
        causal=causal,
        kv_scale=kv_scale,
        check_values=plan is None,
        fault_flag=fault_flag,
        query_start_loc=query_start_loc,
        max_q_len=max_q_len,
        row_seqlens=row_seqlens,
    )
    if plan is None:
        if not isinstance(return_lse, bool):
            raise ValueError(f"mla_decode: return_lse must be True or False, got {return_lse!r}")
        problem = dataclasses.replace(problem, lse=return_lse)
    impl_cls = select_backend(backend, problem) if plan is None else backend_class(plan.backend)
    impl = impl_cls(
        num_heads=problem.num_heads,
        head_dim_v=head_dim_v,
        rope_dim=problem.head_dim - head_dim_v,
        softmax_scale=problem.softmax_scale,
    )
    return impl.run(problem, plan)


def merge_states(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of N partial attentions over disjoint key sets (split-KV, DCP shards).

    Args:
        outs: ``[N, ...rows, Dv]`` float32/float16/bfloat16 partial outputs, each normalized
            over its own keys; ``Dv >= 1``.
        lses: ``[N, ...rows]`` float32/float16/bfloat16, their natural-log softmax
            denominators, on ``outs``' device.

    Returns:
        ``(out [...rows, Dv] in outs' dtype, lse [...rows] float32)``, equal to attending over
        the union of the key sets; the same on the CPU (torch) and on a GPU (Triton):

        - a partial with lse -inf saw no key and contributes nothing (its out may be NaN);
        - a NaN or +inf lse, or a NaN in the out of a partial that has weight, is a broken
          partial: the whole row comes out NaN (every column and the lse), never a silent
          drop that would pass for an empty shard;
        - a row where every partial is empty, and every row when ``N = 0``, gives out 0 and
          lse -inf: the merge of no keys is ``mla_decode``'s empty row.

    Raises:
        ValueError: naming ``outs`` or ``lses``: not a tensor (a list of partials must be
            ``torch.stack``-ed first), not a float dtype, mismatched shapes, ``Dv = 0``, or
            different devices.
    """
    check_merge_args(outs, lses)
    if outs.device.type == "cpu":
        return torch_merge_states(outs, lses)
    # On a GPU the Triton kernel does the same arithmetic in one launch instead of ~10.
    from rocm_mla.kernels.merge_states import merge_states as triton_merge_states

    return triton_merge_states(outs, lses)
