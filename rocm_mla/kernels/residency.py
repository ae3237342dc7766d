"""Resident programs per SM / CU from a compiled kernel's resources: pure host arithmetic.

A kernel's occupancy is the smallest of what its registers, its shared memory / LDS and its
warp (wave) count allow, each rounded the way the hardware allocates. The limits and where
each comes from are the targets' residency rules in the registry (``rocm_mla.targets``:
``NvidiaResidency``, ``AmdResidency``); this module only computes with them:

- NVIDIA: a thread's registers are rounded up to the warp's allocation unit; shared memory
  per block adds the runtime's reserve and is rounded to its unit; resident warps and blocks
  per SM are capped.
- AMD: a wave that uses AGPRs occupies its arch VGPRs rounded up to the AGPR offset
  alignment, then its AGPRs; the total is allocated in VGPR granules, and waves per SIMD =
  the register file per lane // that total, at most the SIMD's cap (and, on gfx9, the SGPR
  table's). A workgroup of W waves spreads its waves over the CU's SIMDs, so a CU holds
  ``simds * waves_per_simd // W`` workgroups by registers (assuming the dispatcher balances
  waves over the SIMDs, as it does for the power-of-two W Triton launches); LDS is allocated
  in its granule and a workgroup may take all of a CU's.

A kernel that does not fit even once (smem above the per-block limit) gets 0: it cannot launch.
Inputs that no compiler emits (more registers than a thread can address, negative sizes) are
errors.
"""

from __future__ import annotations

from rocm_mla.targets import TARGETS, AmdResidency, NvidiaResidency

__all__ = ["RESIDENCY_TARGETS", "resident_programs"]

#: The registry keys ``resident_programs`` knows: the targets with residency rules.
RESIDENCY_TARGETS = tuple(key for key, spec in TARGETS.items() if spec.residency is not None)


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def _check_count(name: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"resident_programs: {name} must be an int, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"resident_programs: {name} must be {bound}, got {value}")
    return value


def _nvidia(limits: NvidiaResidency, num_warps: int, regs_per_thread: int, smem_bytes: int) -> int:
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
    limits: AmdResidency,
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
    if sgprs_per_wave is not None and limits.sgpr_waves is not None:
        by_sgprs = next(w for most, w in limits.sgpr_waves if sgprs_per_wave <= most)
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
        target_key: a registry key with residency rules (``RESIDENCY_TARGETS``).
        num_warps: warps (NVIDIA) or waves (AMD) per program, the launch's ``num_warps``.
        regs_per_thread: registers per thread as the compiler reports them: ptxas's "Used N
            registers" on sm90; on AMD the arch VGPRs only (the amdgcn ``; NumVgprs:``
            comment; ``.vgpr_count`` in the metadata already adds the AGPRs on gfx90a+).
        smem_bytes: shared memory / LDS per program (``kernel.metadata.shared``).
        agprs_per_thread: AMD accumulation VGPRs (``; NumAgprs:``, ``.agpr_count``); 0 on
            NVIDIA and on AMD targets without AGPRs.
        sgprs_per_wave: AMD SGPRs (``.sgpr_count``), or None to leave them out.

    Returns:
        The resident count; 0 when one program's shared memory / LDS exceeds what a program
        may take.
    """
    spec = TARGETS.get(target_key)
    limits = None if spec is None else spec.residency
    if limits is None:
        raise ValueError(
            f"resident_programs: target_key must be one of {RESIDENCY_TARGETS}, got {target_key!r}"
        )
    _check_count("smem_bytes", smem_bytes, 0)
    if isinstance(limits, NvidiaResidency):
        if agprs_per_thread or sgprs_per_wave is not None:
            raise ValueError(
                "resident_programs: agprs_per_thread and sgprs_per_wave are AMD counts; "
                f"target {target_key!r} got {agprs_per_thread} and {sgprs_per_wave}"
            )
        return _nvidia(limits, num_warps, regs_per_thread, smem_bytes)
    if agprs_per_thread and not limits.agprs:
        raise ValueError(
            f"resident_programs: target {target_key!r} has no AGPRs, got agprs_per_thread "
            f"{agprs_per_thread}"
        )
    return _amd(limits, num_warps, regs_per_thread, agprs_per_thread, sgprs_per_wave, smem_bytes)
