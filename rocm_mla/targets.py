"""The target registry: every fact the package uses about a GPU (or the interpreter), one
record per target, and the one place an arch name (``gfx942``, ``sm90``...) is spelled in code.

A record (``TargetSpec``) holds the target's key and arch names, its wave size and default
unit (CU / SM) count, the register, LDS / shared-memory and residency rules the planner
computes occupancy with (``kernels.residency``), the fp8 flavour it computes and whether it
has fp8 dots, the oldest Triton the decode supports on it, which tuned table it reads
(``rocm_mla/kernels/configs/<table>.json``), AMD compile knobs the tables' entries assume
(XCD pools, kpack), what AITER's MLA decode does there, and the datasheet figures of its
products (bandwidth and dense matrix peaks, for the rooflines). Kernels, backends, planners
and benchmarks read it; ``tests/test_targets.py`` fails on an arch name spelled anywhere else
in the package's or the benchmarks' code.

Targets without a record of their own resolve to their backend's family record
(``target_spec``): another NVIDIA GPU to ``fallback`` (the pre-tuning CUDA table, fp8 from
Ada on), another AMD GPU to ``hip`` (gfx942's table without XCD remap or kpack, CDNA3's
residency: what the package assumed before there was a registry).

A new target is one record here (its facts, each with where it came from, unknowns left
``None`` and said so) and its table file under ``rocm_mla/kernels/configs/``; see
docs/architecture.md, "Targets".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

Version = tuple[int, int, int]


@dataclass(frozen=True)
class NvidiaResidency:
    """An SM's resources and how they are allocated (``kernels.residency`` computes with it)."""

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
class AmdResidency:
    """A CU's resources and how they are allocated (``kernels.residency`` computes with it)."""

    simds_per_cu: int
    vgprs_per_simd_lane: int  #: the register file per lane; arch VGPRs + AGPRs share it
    max_vgprs_per_wave: int  #: of each kind (arch, acc)
    vgpr_granule: int
    max_waves_per_simd: int
    lds_per_cu: int
    lds_granule: int
    max_waves_per_workgroup: int
    max_sgprs_per_wave: int
    #: Whether the target has accumulation VGPRs (AGPRs, gfx90a and later CDNA): then the
    #: compiler reports them apart (``; NumAgprs:``) and a wave's arch VGPRs are rounded up
    #: to ``agpr_offset_align`` before its AGPRs start.
    agprs: bool
    agpr_offset_align: int | None
    #: Waves per SIMD by SGPR count, ``((most SGPRs, waves), ...)`` from the fewest up (gfx9's
    #: shared SGPR file), or None where SGPRs do not limit the waves (gfx10 and later).
    sgpr_waves: tuple[tuple[int, int], ...] | None


@dataclass(frozen=True)
class Product:
    """A product built on a target, and its datasheet figures (dense, no sparsity)."""

    name: str  #: matched as a substring of the device name torch reports
    units: int | None  #: CUs / SMs
    hbm_bytes_per_s: float | None
    #: Dense matrix peaks in FLOP/s by operand kind ("16bit", "fp8"); None where unknown.
    matrix_flops: dict[str, float] | None = field(default=None, hash=False, compare=False)


@dataclass(frozen=True)
class AiterGap:
    """A shape AITER's MLA decode gets wrong on a target: refused by the AITER backend."""

    kv: str  #: "bf16" or "fp8"
    kernel_heads: int  #: the head count the kernel runs (after padding)
    q_len: int
    why: str


@dataclass(frozen=True)
class TargetSpec:
    """What the package knows about one target (see the module docstring)."""

    key: str  #: the registry key
    backend: str  #: "cuda", "hip" or "interpreter"
    #: The arch names (``TritonTarget.arch``, ``Platform.arch``) this record is for; empty for
    #: a family record, which stands for every arch of its backend without one.
    archs: tuple[str, ...]
    name: str  #: what it is, for people
    wave_size: int | None  #: threads per warp / lanes per wave
    residency: NvidiaResidency | AmdResidency | None
    #: The fp8 cache types the Triton decode takes here, the target's own flavour first
    #: (the one its fp8 hardware computes; the interpreter converts both in software).
    fp8_dtypes: tuple[torch.dtype, ...]
    #: Whether Triton issues fp8 matrix ops here (else fp8 operands are upcast to 16 bits).
    fp8_dots: bool
    triton_floor: Version  #: the oldest Triton release the decode supports here
    #: The tuned table it reads (``kernels/configs/<table>.json``): its own key, or the key of
    #: the target whose table it borrows (then without that target's XCD remap and kpack).
    table: str
    #: Workgroup dispatch pools (AMD XCDs: workgroup ``p`` runs on XCD ``p % xcds``).
    xcds: int = 1
    #: AMD ``kpack`` the table's entries were compiled with (Triton's MFMA operand packing;
    #: deprecated from gfx950 on, where Triton forces 1), or None.
    kpack: int | None = None
    #: Products on this target, the default (bench static's, the schedule bench's) first.
    products: tuple[Product, ...] = ()
    aiter_mla: bool = False  #: AITER ships MLA decode kernels for it
    aiter_gaps: tuple[AiterGap, ...] = ()

    @property
    def fp8_dtype(self) -> torch.dtype | None:
        """The target's own fp8 flavour (an fp8 cache's type here), or None without fp8."""
        return self.fp8_dtypes[0] if self.fp8_dtypes else None

    @property
    def product(self) -> Product | None:
        """The default product (the first), or None for a family record."""
        return self.products[0] if self.products else None

    @property
    def units(self) -> int | None:
        """The default product's CU / SM count."""
        return None if self.product is None else self.product.units


# ---- residency rules ------------------------------------------------------------------------

#: Hopper (H100 / H200): the CUDA programming guide's compute-capability table (9.0) and the
#: occupancy calculator's allocation rules. 65 536 32-bit registers per SM, at most 255 per
#: thread, allocated to a warp in units of 256 (8 per thread x 32 lanes); 228 KB of shared
#: memory per SM, at most 227 KB per block, 1 KB reserved by the runtime per resident block,
#: 128-byte units; at most 64 warps and 32 blocks per SM, 32 warps per block.
_HOPPER = NvidiaResidency(
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

#: gfx9's waves per SIMD by SGPR count (LLVM's occupancy table: 10, 9, 8 or 7 waves for at
#: most 80, 88, 100 or 112 of its 800 SGPRs), from the fewest SGPRs up.
_GFX9_SGPR_WAVES = ((80, 10), (88, 9), (100, 8), (112, 7))


def _cdna(lds_per_cu: int, lds_granule: int) -> AmdResidency:
    """CDNA3 / CDNA4 (the CDNA3 ISA guide, LLVM's AMDGPUUsage and its resource-usage code for
    gfx90a and later): 4 SIMDs a CU; a SIMD's unified register file holds 512 VGPRs a lane
    for the arch VGPRs and AGPRs of its waves (at most 256 of each a wave), a wave's arch
    VGPRs rounded up to 4 before its AGPRs, the total allocated in granules of 8; at most 8
    waves a SIMD and 16 a workgroup (1024 work-items); 112 SGPRs a wave at most."""
    return AmdResidency(
        simds_per_cu=4,
        vgprs_per_simd_lane=512,
        max_vgprs_per_wave=256,
        vgpr_granule=8,
        max_waves_per_simd=8,
        lds_per_cu=lds_per_cu,
        lds_granule=lds_granule,
        max_waves_per_workgroup=16,
        max_sgprs_per_wave=112,
        agprs=True,
        agpr_offset_align=4,
        sgpr_waves=_GFX9_SGPR_WAVES,
    )


#: CDNA3: 64 KB of LDS a CU (LLVM AMDGPU.td, ``FeatureISAVersion9_4_2``:
#: ``FeatureAddressableLocalMemorySize65536``), allocated in blocks of 128 dwords (AMDGPUUsage,
#: ``GRANULATED_LDS_SIZE``: GFX7-GFX940 ``roundup(lds-size / (128 * 4))``).
_CDNA3 = _cdna(64 << 10, 512)
#: CDNA4: 160 KB (``FeatureAddressableLocalMemorySize163840``) in blocks of 320 dwords
#: (AMDGPUUsage: GFX950 ``roundup(lds-size / (320 * 4))``).
_CDNA4 = _cdna(160 << 10, 1280)

#: gfx1250, CDNA5 (Triton 3.9's ``AMDWMMALayout`` docs: "3: CDNA5: gfx1250"). LLVM AMDGPU.td,
#: ``FeatureISAVersion12_50`` (llvm-project 001c38d03e77): ``FeatureWavefrontSize32``,
#: ``FeatureCuMode``, ``Feature1024AddressableVGPRs``, ``FeatureAddressableLocalMemorySize327680``
#: and no ``FeatureMAIInsts`` (no MFMA, no AGPR file: its matrix ops are WMMA on arch VGPRs). LDS:
#: 320 KB a CU, allocated in blocks of 512 dwords (2 KB; AMDGPUUsage's GFX125* row, llvm-project
#: commit 5f38ae4, "update LDS block size for gfx1250"). LLVM's ``getEUsPerCU``: "GFX12.5 only
#: supports CU mode, which contains four SIMDs". Register file: LLVM's ``getTotalNumVGPRs`` gives
#: wave32 targets of gfx10 and later without ``Feature1_5xVGPRs`` 1024 VGPRs a lane, allocated in
#: granules of 16 (``getVGPRAllocGranule``, gfx10.3 and later, wave32), and ``getMaxWavesPerEU`` 16
#: waves a SIMD for gfx10.3 and later; Triton 3.9's gfx1250 builds report an ``; Occupancy:`` that
#: agrees (84 VGPRs: 10 waves, 1024 // 96; 502: 2; 809: 1). A wave may address all 1024
#: (``Feature1024AddressableVGPRs``). SGPRs do not limit the waves on gfx10 and later
#: (``getMaxNumSGPRs``: a fixed 106 addressable a wave, ``.sgpr_count`` adds VCC's 2). A workgroup
#: holds at most 1024 work-items (``getMaxFlatWorkGroupSize``): 32 waves of 32.
_CDNA5 = AmdResidency(
    simds_per_cu=4,
    vgprs_per_simd_lane=1024,
    max_vgprs_per_wave=1024,
    vgpr_granule=16,
    max_waves_per_simd=16,
    lds_per_cu=320 << 10,
    lds_granule=2048,
    max_waves_per_workgroup=32,
    max_sgprs_per_wave=108,
    agprs=False,
    agpr_offset_align=None,
    sgpr_waves=None,
)

# ---- the records -----------------------------------------------------------------------------

_E4M3FN, _E4M3FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz

#: The Triton floor of every target without an older one (sm90's: the decode needs 3.5.1).
DEFAULT_TRITON_FLOOR: Version = (3, 5, 1)
#: AMD's targets reach back to 3.4.0 because ROCm images carry their own Triton (SGLang's
#: ROCm 7.0 image has 3.4) and the package never installs one over it.
_ROCM_IMAGE_TRITON_FLOOR: Version = (3, 4, 0)

#: Datasheet figures: H100 SXM 989 TFLOP/s bf16, 1979 fp8, 3.35 TB/s; H200 SXM the same peaks
#: at 4.8 TB/s; MI300X 1307 / 2615, 5.3 TB/s; MI325X 1307 / 2615, 6.0 TB/s; MI355X 2517 /
#: 5033, 8 TB/s. Dense (no sparsity) peaks, so ceilings computed from them are upper bounds.
_HOPPER_FLOPS = {"16bit": 989e12, "fp8": 1979e12}
_MI300_FLOPS = {"16bit": 1307e12, "fp8": 2615e12}

TARGETS: dict[str, TargetSpec] = {
    spec.key: spec
    for spec in (
        TargetSpec(
            key="sm90",
            backend="cuda",
            archs=("sm90",),
            name="NVIDIA Hopper (H100 / H200)",
            wave_size=32,
            residency=_HOPPER,
            # Triton converts and multiplies e4m3fn on NVIDIA from sm89 (Ada) on.
            fp8_dtypes=(_E4M3FN,),
            fp8_dots=True,
            triton_floor=DEFAULT_TRITON_FLOOR,
            table="sm90",
            products=(
                Product("H200", 132, 4.8e12, _HOPPER_FLOPS),
                Product("H100", 132, 3.35e12, _HOPPER_FLOPS),
            ),
        ),
        TargetSpec(
            key="gfx942",
            backend="hip",
            archs=("gfx942",),
            name="AMD CDNA3 (MI300X / MI325X)",
            wave_size=64,
            residency=_CDNA3,
            # MI300X computes the fnuz flavour of e4m3 (AITER's ``defaultDtypes`` agrees).
            fp8_dtypes=(_E4M3FNUZ,),
            fp8_dots=True,
            triton_floor=_ROCM_IMAGE_TRITON_FLOOR,
            table="gfx942",
            xcds=8,
            kpack=2,
            products=(
                Product("MI300X", 304, 5.3e12, _MI300_FLOPS),
                Product("MI325X", 304, 6.0e12, _MI300_FLOPS),
            ),
            aiter_mla=True,
            aiter_gaps=(AiterGap("bf16", 16, 8, "wrong output, aiter#5679"),),
        ),
        TargetSpec(
            key="gfx950",
            backend="hip",
            archs=("gfx950",),
            name="AMD CDNA4 (MI355X)",
            wave_size=64,
            residency=_CDNA4,
            # CDNA4 and later compute the OCP flavour natively (Triton 3.9's HIPOptions).
            fp8_dtypes=(_E4M3FN,),
            fp8_dots=True,
            triton_floor=_ROCM_IMAGE_TRITON_FLOOR,
            table="gfx950",
            xcds=8,
            products=(Product("MI355X", 256, 8.0e12, {"16bit": 2517e12, "fp8": 5033e12}),),
            aiter_mla=True,
        ),
        TargetSpec(
            key="gfx1250",
            backend="hip",
            archs=("gfx1250",),
            name="AMD CDNA5 (gfx1250)",
            wave_size=32,
            residency=_CDNA5,
            # OCP fp8: Triton 3.9's HIPOptions ("native support for OCP fp8 variants since
            # CDNA4/RDNA4"); its gfx1250 builds issue v_wmma_*_fp8_fp8 for fp8 dots.
            fp8_dtypes=(_E4M3FN,),
            fp8_dots=True,
            # The only release checked (bench static): Triton 3.9's AMD backend compiles it.
            triton_floor=(3, 9, 0),
            table="gfx1250",
            # Unknown: LLVM's AMDGPUUsage lists gfx1250 as an APU with products "TBA", so
            # neither its XCD count (1: no remap), its CU count nor datasheet figures are
            # known; AITER ships no kernels for it.
        ),
        TargetSpec(
            key="fallback",
            backend="cuda",
            archs=(),
            name="any other NVIDIA GPU",
            wave_size=32,
            residency=None,
            # From sm89 (Ada) on; ``target_spec`` drops fp8 below it.
            fp8_dtypes=(_E4M3FN,),
            fp8_dots=True,
            triton_floor=DEFAULT_TRITON_FLOOR,
            table="fallback",
        ),
        TargetSpec(
            key="hip",
            backend="hip",
            archs=(),
            name="any other AMD GPU",
            wave_size=64,
            residency=_CDNA3,
            fp8_dtypes=(_E4M3FN,),
            fp8_dots=False,
            triton_floor=DEFAULT_TRITON_FLOOR,
            table="gfx942",
        ),
        TargetSpec(
            key="interpreter",
            backend="interpreter",
            archs=(),
            name="the Triton interpreter (CPU, slow, for testing)",
            wave_size=None,
            residency=None,
            # Both flavours converted in software; the dots round to fp8 values and compute in
            # fp32 (``mla_decode_args._dot_types``).
            fp8_dtypes=(_E4M3FN, _E4M3FNUZ),
            fp8_dots=True,
            triton_floor=DEFAULT_TRITON_FLOOR,
            table="interpreter",
        ),
    )
}

#: The lowest NVIDIA compute capability with fp8 in Triton (Ada, sm89): the ``fallback``
#: record's fp8 holds from it on.
_FIRST_FP8_SM = 89


def target_spec(backend: str | None, arch: str | None) -> TargetSpec:
    """The record of ``(backend, arch)`` (a ``TritonTarget``'s or a ``Platform``'s): the one
    naming ``arch``, else the backend's family record (``fallback`` for NVIDIA, ``hip`` for
    AMD); the interpreter, or no backend, is ``interpreter``."""
    if backend is None or backend == "interpreter":
        return TARGETS["interpreter"]
    for spec in TARGETS.values():
        if spec.backend == backend and arch in spec.archs:
            return spec
    if backend == "hip":
        return TARGETS["hip"]
    if backend != "cuda":
        raise ValueError(
            f"target_spec: backend must be 'cuda', 'hip' or 'interpreter', got {backend!r}"
        )
    digits = "".join(ch for ch in (arch or "")[2:] if ch.isdigit())
    if int(digits or 0) < _FIRST_FP8_SM:
        return dataclasses.replace(TARGETS["fallback"], fp8_dtypes=(), fp8_dots=False)
    return TARGETS["fallback"]


def tables() -> tuple[str, ...]:
    """The keys of the tuned tables: targets that read their own table."""
    return tuple(key for key, spec in TARGETS.items() if spec.table == key)


def find_product(device_name: str) -> Product | None:
    """The product whose name is in ``device_name`` (torch's, e.g. "AMD Instinct MI300X"),
    or None."""
    for spec in TARGETS.values():
        for product in spec.products:
            if product.name.lower() in device_name.lower():
                return product
    return None
