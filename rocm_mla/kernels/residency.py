"""Resident programs per SM / CU from a compiled kernel's resources: pure host arithmetic.

A kernel's occupancy is the smallest of what its registers, its shared memory / LDS and its
warp (wave) count allow, each rounded the way the hardware allocates. The limits, in our words,
and where they come from:

sm90 (H100 / H200; the CUDA programming guide's compute-capability table and the occupancy
calculator's allocation rules):

- 65 536 32-bit registers per SM, at most 255 per thread. Registers go to a warp in units of
  256 (8 per thread x 32 lanes), so a thread's count is rounded up to a multiple of 8 first.
- 228 KB of shared memory per SM, at most 227 KB per block; the runtime reserves 1 KB per
  resident block on top of what the kernel asks for, and allocates in 128-byte units.
- At most 64 resident warps and 32 resident blocks per SM; at most 32 warps (1024 threads)
  per block.

gfx942 (MI300X) and gfx950 (MI355X), CDNA3 / CDNA4 (the CDNA3 ISA guide, LLVM's AMDGPU usage
notes and its resource-usage code for gfx90a and later):

- A CU has 4 SIMDs; a SIMD's register file holds 512 VGPRs per lane, shared by the arch
  VGPRs and the accumulation VGPRs (AGPRs) of its waves (the unified register file: at most
  256 of each per wave). A wave that uses AGPRs occupies its arch VGPRs rounded up to a
  multiple of 4, then its AGPRs; the total is allocated in granules of 8. Waves per SIMD =
  512 // that total, at most 8.
- SGPRs: gfx9 SIMDs hold 800; LLVM's occupancy table gives 10, 9, 8 or 7 waves for at most
  80, 88, 100 or more SGPRs, so only more than 100 cuts below the cap of 8.
- A workgroup of W waves spreads its waves over the 4 SIMDs, so a CU holds
  ``4 * waves_per_simd // W`` workgroups by registers (assuming the dispatcher balances
  waves over the SIMDs, as it does for the power-of-two W Triton launches).
- LDS per CU: 64 KB on gfx942, 160 KB on gfx950, a workgroup may take all of it; allocated in
  blocks of 128 dwords (512 B) on gfx942 and 320 dwords (1280 B) on gfx950.
- At most 16 waves (1024 work-items) per workgroup.

A kernel that does not fit even once (smem above the per-block limit) gets 0: it cannot launch.
Inputs that no compiler emits (more registers than a thread can address, negative sizes) are
errors.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RESIDENCY_TARGETS", "resident_programs"]


@dataclass(frozen=True)
class _NvidiaLimits:
    regs_per_sm: int
    reg_unit_per_warp: int  #: registers per warp are allocated in these units
    max_regs_per_thread: int
    smem_per_sm: int
    smem_per_block: int
    smem_reserved_per_block: int
    smem_unit: int
    max_warps_per_sm: int
    max_blocks_per_sm: int
    max_warps_per_block: int
    warp_size: int = 32


@dataclass(frozen=True)
class _AmdLimits:
    simds_per_cu: int
    vgprs_per_simd_lane: int  #: arch VGPRs + AGPRs share this
    max_vgprs_per_wave: int  #: of each kind (arch, acc)
    vgpr_granule: int
    agpr_offset_align: int  #: arch VGPRs are rounded to this before the AGPRs start
    max_waves_per_simd: int
    lds_per_cu: int
    lds_granule: int
    max_waves_per_workgroup: int
    max_sgprs_per_wave: int


_SM90 = _NvidiaLimits(
    regs_per_sm=65536,
    reg_unit_per_warp=256,
    max_regs_per_thread=255,
    smem_per_sm=228 << 10,
    smem_per_block=227 << 10,
    smem_reserved_per_block=1 << 10,
    smem_unit=128,
    max_warps_per_sm=64,
    max_blocks_per_sm=32,
    max_warps_per_block=32,
)


def _cdna(lds_per_cu: int, lds_granule: int) -> _AmdLimits:
    return _AmdLimits(
        simds_per_cu=4,
        vgprs_per_simd_lane=512,
        max_vgprs_per_wave=256,
        vgpr_granule=8,
        agpr_offset_align=4,
        max_waves_per_simd=8,
        lds_per_cu=lds_per_cu,
        lds_granule=lds_granule,
        max_waves_per_workgroup=16,
        max_sgprs_per_wave=112,
    )


_LIMITS: dict[str, _NvidiaLimits | _AmdLimits] = {
    "sm90": _SM90,
    "gfx942": _cdna(64 << 10, 512),
    "gfx950": _cdna(160 << 10, 1280),
}
#: The target keys ``resident_programs`` knows (``mla_decode_args.target_key`` spells them so).
RESIDENCY_TARGETS = tuple(_LIMITS)

#: gfx9 waves per SIMD by SGPR count: (most SGPRs, waves) from the fewest SGPRs up.
_GFX9_SGPR_WAVES = ((80, 10), (88, 9), (100, 8))


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def _check_count(name: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"resident_programs: {name} must be an int, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"resident_programs: {name} must be {bound}, got {value}")
    return value


def _nvidia(limits: _NvidiaLimits, num_warps: int, regs_per_thread: int, smem_bytes: int) -> int:
    _check_count("num_warps", num_warps, 1, limits.max_warps_per_block)
    _check_count("regs_per_thread", regs_per_thread, 0, limits.max_regs_per_thread)
    if smem_bytes > limits.smem_per_block:
        return 0
    regs_per_warp = _round_up(regs_per_thread * limits.warp_size, limits.reg_unit_per_warp)
    by_regs = (
        limits.regs_per_sm // (regs_per_warp * num_warps)
        if regs_per_warp
        else limits.max_blocks_per_sm
    )
    smem_per_block = _round_up(smem_bytes + limits.smem_reserved_per_block, limits.smem_unit)
    by_smem = limits.smem_per_sm // smem_per_block
    by_warps = limits.max_warps_per_sm // num_warps
    return min(by_regs, by_smem, by_warps, limits.max_blocks_per_sm)


def _amd(
    limits: _AmdLimits,
    num_warps: int,
    regs_per_thread: int,
    agprs_per_thread: int,
    sgprs_per_wave: int | None,
    smem_bytes: int,
) -> int:
    _check_count("num_warps", num_warps, 1, limits.max_waves_per_workgroup)
    _check_count("regs_per_thread", regs_per_thread, 0, limits.max_vgprs_per_wave)
    _check_count("agprs_per_thread", agprs_per_thread, 0, limits.max_vgprs_per_wave)
    if sgprs_per_wave is not None:
        _check_count("sgprs_per_wave", sgprs_per_wave, 0, limits.max_sgprs_per_wave)
    if smem_bytes > limits.lds_per_cu:
        return 0
    vgprs = regs_per_thread
    if agprs_per_thread:
        vgprs = _round_up(regs_per_thread, limits.agpr_offset_align) + agprs_per_thread
    vgprs = _round_up(max(vgprs, 1), limits.vgpr_granule)
    waves_per_simd = min(limits.max_waves_per_simd, limits.vgprs_per_simd_lane // vgprs)
    if sgprs_per_wave is not None:
        by_sgprs = next((w for most, w in _GFX9_SGPR_WAVES if sgprs_per_wave <= most), 7)
        waves_per_simd = min(waves_per_simd, by_sgprs)
    by_regs = limits.simds_per_cu * waves_per_simd // num_warps
    by_lds = (
        limits.lds_per_cu // _round_up(smem_bytes, limits.lds_granule) if smem_bytes else by_regs
    )
    return min(by_regs, by_lds)


def resident_programs(
    target_key: str,
    *,
    num_warps: int,
    regs_per_thread: int,
    smem_bytes: int,
    agprs_per_thread: int = 0,
    sgprs_per_wave: int | None = None,
) -> int:
    """Programs (CTAs / workgroups) of one kernel that an SM or CU holds at once.

    Args:
        target_key: "sm90", "gfx942" or "gfx950" (``RESIDENCY_TARGETS``).
        num_warps: warps (NVIDIA) or waves (AMD) per program, the launch's ``num_warps``.
        regs_per_thread: registers per thread as the compiler reports them: ptxas's "Used N
            registers" on sm90; on AMD the arch VGPRs only (the amdgcn ``; NumVgprs:``
            comment; ``.vgpr_count`` in the metadata already adds the AGPRs on gfx90a+).
        smem_bytes: shared memory / LDS per program (``kernel.metadata.shared``).
        agprs_per_thread: AMD accumulation VGPRs (``; NumAgprs:``, ``.agpr_count``); 0 on
            sm90.
        sgprs_per_wave: AMD SGPRs (``.sgpr_count``), or None to leave them out.

    Returns:
        The resident count; 0 when one program's shared memory / LDS exceeds what a program
        may take.
    """
    limits = _LIMITS.get(target_key)
    if limits is None:
        raise ValueError(
            f"resident_programs: target_key must be one of {RESIDENCY_TARGETS}, got {target_key!r}"
        )
    _check_count("smem_bytes", smem_bytes, 0)
    if isinstance(limits, _NvidiaLimits):
        if agprs_per_thread or sgprs_per_wave is not None:
            raise ValueError(
                "resident_programs: agprs_per_thread and sgprs_per_wave are AMD counts; "
                f"target {target_key!r} got {agprs_per_thread} and {sgprs_per_wave}"
            )
        return _nvidia(limits, num_warps, regs_per_thread, smem_bytes)
    return _amd(limits, num_warps, regs_per_thread, agprs_per_thread, sgprs_per_wave, smem_bytes)
