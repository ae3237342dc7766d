"""What the balanced schedule does with a test's lengths: the row groups a call runs with,
and how many units (request, row group) the planner cuts across slots, so that a test which
means to exercise the partials and their merge can assert that it does.

``mla_decode`` with ``num_slots=S`` runs the device planner; ``tests/test_schedule.py``
shows it writes the host planner's tables without whole units (``whole_units=False``), so
the host planner answers here for both, by default without them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton

from rocm_mla.kernels import mla_decode_args
from rocm_mla.kernels import schedule as sch
from rocm_mla.kernels.target import triton_target
from rocm_mla.kernels.tuned_configs import LaunchConfig


def group_config(
    *, heads: int, q_len: int, kv_dtype: torch.dtype, config: LaunchConfig | None = None
) -> LaunchConfig:
    """The stage-1 config ``mla_decode`` runs (the tuned one when ``config`` is None)."""
    if config is None:
        config = mla_decode_args.default_config(
            triton_target(), num_heads=heads, q_len=q_len, kv_dtype=kv_dtype
        )
    return mla_decode_args.group_config(config, q_len * heads)


def num_groups(
    *, heads: int, q_len: int, kv_dtype: torch.dtype, config: LaunchConfig | None = None
) -> int:
    block_h = group_config(heads=heads, q_len=q_len, kv_dtype=kv_dtype, config=config).block_h
    return triton.cdiv(q_len * heads, block_h)


def host_tables(
    lengths: Sequence[int] | torch.Tensor,
    *,
    groups: int,
    slots: int,
    capacity_keys: int,
    device: torch.device | str = "cpu",
    pools: int = 1,
    whole_units: bool = False,
) -> sch.ScheduleTables:
    if isinstance(lengths, torch.Tensor):
        lengths = [int(v) for v in lengths.cpu().tolist()]
    return sch.host_schedule(
        list(lengths),
        num_groups=groups,
        num_slots=slots,
        capacity_keys=capacity_keys,
        num_pools=pools,
        device=device,
        whole_units=whole_units,
    )


def cut_units(tables: sch.ScheduleTables) -> list[int]:
    """The units the schedule cuts into several segments (merged by stage 2)."""
    return [u for u in tables.split_units.cpu().tolist() if u >= 0]


def cut_requests(
    lengths: Sequence[int] | torch.Tensor, *, groups: int, slots: int, capacity_keys: int
) -> set[int]:
    """The requests with at least one unit cut across slots at ``slots`` slots."""
    tables = host_tables(lengths, groups=groups, slots=slots, capacity_keys=capacity_keys)
    cut = cut_units(tables)
    assert (tables.num_partials > 0) == bool(cut)
    return {u // groups for u in cut}


def piece_slots(lengths: Sequence[int] | torch.Tensor, *, groups: int, capacity_keys: int) -> int:
    """Slots enough for every unit to take one per piece of the longest: the uniform split
    then cuts every unit of two pieces or more into single pieces (``assert_cuts_long_requests``
    checks that the planner does)."""
    if isinstance(lengths, torch.Tensor):
        lengths = [int(v) for v in lengths.cpu().tolist()]
    longest = max(sch.pieces_of(int(n), capacity_keys) for n in lengths)
    return groups * len(lengths) * max(1, longest)


def assert_cuts_long_requests(
    lengths: Sequence[int] | torch.Tensor, *, groups: int, slots: int, capacity_keys: int
) -> set[int]:
    """The requests cut at ``slots`` slots are exactly those of more than one piece (at
    least one); returns them."""
    if isinstance(lengths, torch.Tensor):
        lengths = [int(v) for v in lengths.cpu().tolist()]
    long = {b for b, n in enumerate(lengths) if sch.pieces_of(int(n), capacity_keys) > 1}
    got = cut_requests(lengths, groups=groups, slots=slots, capacity_keys=capacity_keys)
    assert long, f"no request of {lengths} spans two pieces: nothing to cut"
    assert got == long, f"{slots} slots cut requests {got}, expected {long}"
    return got


def device_tables(
    cache_seqlens: torch.Tensor, *, groups: int, slots: int, capacity_keys: int, pools: int = 1
) -> sch.ScheduleTables:
    """The device planner's tables for ``cache_seqlens`` (on its device)."""
    tables = sch.empty_tables(cache_seqlens.shape[0], groups, slots, cache_seqlens.device, pools)
    sch.device_schedule(cache_seqlens.to(torch.int32), tables, capacity_keys=capacity_keys)
    return tables
