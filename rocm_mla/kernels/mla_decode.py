"""Balanced split-KV absorbed-MLA decode in Triton: the host launcher ``mla_decode``.

The code is split by what it is, imports running one way (each file imports only from those
before it):

- ``mla_decode_kernel.py``: the ``@triton.jit`` code (stage 1), with the long account of the
  kernel;
- ``mla_decode_args.py``: what stage 1 is called with (tuned config, row groups, dot dtypes,
  q, partials, the launch's arguments);
- ``occupancy.py``: ``programs_per_cu``, the only code touching Triton's compiler internals;
- ``schedule/``: the balanced schedule (which slot walks which keys): its cost model, the
  host and device planners, views;
- ``plan.py``: the config and resident slots of a decode shape (``plan_launch``), and the
  old uniform split count (``choose_num_kv_splits``, charged with the schedule's cost model);
- ``mla_decode.py`` (this file): ``mla_decode``, and the public names re-exported.

``tests/test_layering.py`` (``KERNEL_ORDER``) checks the order.

Stage 2, the LSE merge of the cut units' partials, is ``merge_states.py``.
"""

from __future__ import annotations

import torch
import triton

from rocm_mla.kernels.merge_states import launch_merge_pieces
from rocm_mla.kernels.mla_decode_args import (
    _dot_types,
    default_config,
    group_config,
    partial_buffers,
    stage1_arguments,
    stage1_q,
    table_entry,
    target_key,
)
from rocm_mla.kernels.mla_decode_kernel import _mla_decode_stage1
from rocm_mla.kernels.occupancy import programs_per_cu
from rocm_mla.kernels.plan import choose_num_kv_splits, plan_launch
from rocm_mla.kernels.schedule import (
    ScheduleTables,
    device_schedule,
    empty_tables,
    partial_capacity,
)
from rocm_mla.kernels.target import triton_target
from rocm_mla.kernels.tuned_configs import LaunchConfig
from rocm_mla.platform import same_device

__all__ = [
    "LaunchConfig",
    "ScheduleTables",
    "choose_num_kv_splits",
    "default_config",
    "mla_decode",
    "plan_launch",
    "programs_per_cu",
    "table_entry",
    "target_key",
]


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
    config: LaunchConfig | None = None,
    schedule: ScheduleTables | None = None,
    num_slots: int | None = None,
    fault_flag: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    max_q_len: int | None = None,
    row_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Balanced split-KV MLA decode over shape-checked inputs (``rocm_mla.inputs.prepare_decode``).

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
        config: stage-1 launch config (e.g. from ``plan_launch``); None takes the tuned
            table's entry for this target and shape (host-only).
        schedule: the step's schedule (``schedule.host_schedule`` / ``device_schedule``, for
            these lengths, this batch and this config's row groups); None builds it here on
            the device from ``cache_seqlens`` (one small planner launch, no host read).
        num_slots: with ``schedule`` None, the resident slots to balance over (>= 1); None
            takes ``plan_launch``'s (compute units x the compiled kernel's programs per CU).
            The call never transfers from the device to the host.
        fault_flag: int32 ``[1]`` on q's device, or None: the kernel ORs
            ``rocm_mla.inputs.FAULT_BLOCK_ID`` / ``FAULT_BEYOND_TABLE`` (and with
            ``row_seqlens`` ``FAULT_ROW_BOUND``) into it on the device (no sync) when a row
            may see such a key; it never clears it.
        query_start_loc: ``[B + 1]`` int32, or None: windows of different lengths packed,
            ``q [T, H, D]``, the longest ``max_q_len`` rows (as ``rocm_mla.mla_decode``).
        row_seqlens: ``[T]`` int32 contiguous, or None: each query row's KV bound.

    Returns:
        ``(out [B, S_q, H, Dv] in q's dtype, lse [B, S_q, H] float32)`` (``[T, H, Dv]`` and
        ``[T, H]`` for packed windows); rows with no visible key get out 0 and lse -inf;
        rows that see a NaN/infinite score or a key that cannot be read get out and lse NaN.
    """
    if query_start_loc is None:
        batch, q_len, num_heads, _ = q.shape
    else:
        batch, q_len, num_heads = query_start_loc.shape[0] - 1, max_q_len, q.shape[1]
    if kv_cache.shape[0] < 1:
        # The kernel redirects bad block ids to the last block: there must be one.
        raise ValueError(
            f"mla_decode: kv_cache must hold at least one block, got {tuple(kv_cache.shape)}"
        )
    if fault_flag is not None and (
        not isinstance(fault_flag, torch.Tensor)
        or fault_flag.dtype != torch.int32
        or tuple(fault_flag.shape) != (1,)
        or not same_device(fault_flag.device, q.device)
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
    config = group_config(config, q_len * num_heads)
    if schedule is None and num_slots is None:
        # The planner's config, which may differ: it is one the installed Triton compiles.
        config, num_slots = plan_launch(
            q_len=q_len,
            num_heads=num_heads,
            kv_dtype=kv_cache.dtype,
            target=target,
            config=config,
            q_dtype=q.dtype,
            head_dim=q.shape[-1],
            head_dim_v=head_dim_v,
            page_size=kv_cache.shape[1],
            cache_bytes=kv_cache.numel() * kv_cache.element_size(),
        )
    rows = q_len * num_heads
    num_groups = triton.cdiv(rows, config.block_h)
    if schedule is None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(
                f"mla_decode: num_slots must be an int >= 1 or None, got {num_slots!r}"
            )
        schedule = empty_tables(batch, num_groups, num_slots, q.device, config.num_xcds)
        device_schedule(
            cache_seqlens, schedule, capacity_keys=block_table.shape[1] * kv_cache.shape[1]
        )
    elif (
        schedule.num_groups != num_groups
        or schedule.unit_parts.shape[0] != batch * num_groups
        or not same_device(schedule.segments.device, q.device)
    ):
        raise ValueError(
            f"mla_decode: the schedule was made for {schedule.unit_parts.shape[0]} units of "
            f"{schedule.num_groups} row groups on {schedule.segments.device}; this call has "
            f"{batch} requests x {num_groups} groups of {config.block_h} rows on {q.device}"
        )

    rows_shape = (batch, q_len, num_heads) if query_start_loc is None else q.shape[:2]
    out = torch.empty(*rows_shape, head_dim_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(rows_shape, dtype=torch.float32, device=q.device)
    partials = (
        partial_capacity(schedule.num_slots)
        if schedule.num_partials is None
        else schedule.num_partials
    )
    part_out, part_lse = partial_buffers(max(partials, 1), config.block_h, head_dim_v, q.device)
    dot_types = _dot_types(q.dtype, kv_cache.dtype, target, config)
    q_in, q_scale = stage1_q(q, kv_cache.dtype, dot_types, target)
    grid, args, kwargs = stage1_arguments(
        q_in,
        q_scale,
        kv_cache,
        block_table,
        cache_seqlens,
        schedule.launch_order,
        schedule.segments,
        out,
        lse,
        part_out,
        part_lse,
        fault_flag,
        head_dim_v=head_dim_v,
        softmax_scale=softmax_scale,
        causal=causal,
        kv_scale=kv_scale,
        num_groups=num_groups,
        config=config,
        target=target,
        dot_types=dot_types,
        query_start_loc=query_start_loc,
        max_q_len=max_q_len,
        row_seqlens=row_seqlens,
    )
    # A host-made schedule knows its programs: a small step launches that few.
    if schedule.num_programs is not None:
        grid = (schedule.num_programs,)
    _mla_decode_stage1[grid](*args, **kwargs)
    if partials > 0:
        launch_merge_pieces(
            part_out,
            part_lse,
            schedule.unit_parts,
            schedule.split_units,
            out.view(batch, rows, head_dim_v) if query_start_loc is None else out,
            lse.view(batch, rows) if query_start_loc is None else lse,
            num_groups=num_groups,
            target=target,
            query_start_loc=query_start_loc,
        )
    return out, lse
