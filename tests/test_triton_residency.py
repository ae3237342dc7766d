"""The slot count from the compiled kernel's residency (issue 20: real occupancy, whole waves).

``programs_per_cu`` compiles the planned stage 1 for sm90 / gfx942 / gfx950 (no GPU needed)
and reads its registers and shared memory / LDS through ``kernels.residency``; the grid is
then one program per resident slot, ``num_cus x programs_per_cu`` (exactly one wave), and the
balanced schedule spreads the step's keys over those slots.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

from rocm_mla.kernels import mla_decode as kernel
from rocm_mla.kernels import mla_decode_args, occupancy
from rocm_mla.kernels import schedule as sch
from rocm_mla.kernels.residency import resident_programs
from rocm_mla.kernels.target import TritonTarget
from rocm_mla.kernels.tuned_configs import LaunchConfig

SM90 = TritonTarget("cuda", "sm90", 132)
GFX942 = TritonTarget("hip", "gfx942", 304)
GFX950 = TritonTarget("hip", "gfx950", 256)
FP8 = {"sm90": torch.float8_e4m3fn, "gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}
CONFIG = LaunchConfig(block_h=16, block_n=32, num_warps=4, num_stages=2)


def test_programs_per_cu_is_what_the_compiled_resources_allow(monkeypatch):
    """Whatever the compiler reports decides the count, through the residency model."""
    asked = []

    def fake(config, backend, arch, **shape):
        asked.append((config, backend, arch, shape))
        return {"regs_per_thread": regs, "smem_bytes": smem}

    monkeypatch.setattr(occupancy, "_compiled_stage1_resources", fake)
    for regs, smem in [(64, 20 << 10), (128, 40 << 10), (255, 100 << 10)]:
        got = occupancy.programs_per_cu(
            CONFIG, SM90, kv_dtype=torch.bfloat16, num_heads=12, q_len=2, cache_bytes=1 << 32
        )
        want = resident_programs("sm90", num_warps=4, regs_per_thread=regs, smem_bytes=smem)
        assert got == want
    assert len(asked) == 3  # one compile per call here: the real one is cached
    config, backend, arch, shape = asked[-1]
    assert (config, backend, arch) == (CONFIG, "cuda", "sm90")
    assert shape["num_heads"] == 12 and shape["q_len"] == 2 and shape["large_cache"]


def test_the_interpreter_holds_one_program_and_compiles_nothing(monkeypatch):
    def no_compile(*args, **kwargs):
        raise AssertionError("compiled for the interpreter")

    monkeypatch.setattr(occupancy, "_compiled_stage1_resources", no_compile)
    interpreter = TritonTarget("interpreter", None, 1)
    assert occupancy.programs_per_cu(CONFIG, interpreter, kv_dtype=torch.float32) == 1


def slot_loads(tables: sch.ScheduleTables) -> list[int]:
    """Each slot's cost in the schedule's model: its segments' keys plus an overhead each."""
    bounds = tables.slot_segments.tolist()
    segments = tables.segments.tolist()
    return [
        sum(segments[i][2] - segments[i][1] + sch.OVERHEAD_KEYS for i in range(lo, hi))
        for lo, hi in itertools.pairwise(bounds)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("target", [SM90, GFX942, GFX950], ids=lambda t: t.arch)
def test_planned_schedules_fill_the_one_wave_at_8_requests_of_32k_and_more(target):
    """At B >= 8 x 32K the stage-1 grid is one program per resident slot (exactly one wave
    of ``num_cus x programs_per_cu``) and the schedule keeps every slot busy: the mean
    slot's cost is >= 0.9 of the busiest one's (the step's time), idle slots counting 0."""
    for heads, q_len, kv_dtype in [
        (16, 1, torch.bfloat16),
        (128, 1, torch.bfloat16),
        (12, 1, torch.bfloat16),
        (16, 1, FP8[target.arch]),
        (16, 4, torch.bfloat16),
    ]:
        for batch in (8, 32, 128):
            cache_bytes = batch * 32768 * 576 * kv_dtype.itemsize
            config, slots = kernel.plan_launch(
                q_len=q_len,
                num_heads=heads,
                kv_dtype=kv_dtype,
                target=target,
                cache_bytes=cache_bytes,
            )
            assert slots == target.num_cus * kernel.programs_per_cu(
                config,
                target,
                kv_dtype=kv_dtype,
                num_heads=heads,
                q_len=q_len,
                cache_bytes=cache_bytes,
            )
            groups = -(-(heads * q_len) // config.block_h)
            tables = sch.host_schedule(
                [32768] * batch, num_groups=groups, num_slots=slots, capacity_keys=32768
            )
            loads = slot_loads(tables)
            assert len(loads) == slots
            fill = sum(loads) / len(loads) / max(loads)
            assert fill >= 0.9, (target.arch, heads, q_len, kv_dtype, batch, slots, fill)


@pytest.mark.slow
def test_compiled_residency_of_the_tuned_configs():
    """Facts of the compiled code (Triton 3.9): the 64-row sm90 bf16 config takes 225 KB of
    shared memory (one per SM); the gfx942 16-row config, with the next tile prefetched into
    registers, takes 199 VGPRs and no AGPRs of a lane's 512 (two per CU, as without the
    prefetch); its 64-row config for H128 takes 256 VGPRs + 34 AGPRs (one per CU)."""
    big = mla_decode_args.group_config(kernel.default_config(SM90, num_heads=128), 128)
    assert kernel.programs_per_cu(big, SM90, kv_dtype=torch.bfloat16, num_heads=128) == 1
    small = mla_decode_args.group_config(kernel.default_config(GFX942, num_heads=16), 16)
    assert kernel.programs_per_cu(small, GFX942, kv_dtype=torch.bfloat16, num_heads=16) == 2
    rows = mla_decode_args.group_config(kernel.default_config(GFX942, num_heads=128), 128)
    assert rows.block_h == 64
    assert kernel.programs_per_cu(rows, GFX942, kv_dtype=torch.bfloat16, num_heads=128) == 1
    unpipelined = replace(small, num_stages=1, prefetch_ids=False)
    assert kernel.programs_per_cu(unpipelined, GFX942, kv_dtype=torch.bfloat16, num_heads=16) == 2
