"""The compile-level gate: residency arithmetic (hand-computed cases) and the static tool."""

from __future__ import annotations

import pytest

from rocm_mla.kernels.residency import RESIDENCY_TARGETS, resident_programs


class TestResidencySm90:
    def test_register_bound(self) -> None:
        # 180 regs -> 184 per thread (units of 8) -> 5888 per warp; 8 warps take 47104 of
        # 65536: one CTA. 92.5 KB smem alone would allow two.
        assert resident_programs("sm90", num_warps=8, regs_per_thread=180, smem_bytes=94720) == 1
        # 4 warps of 128 regs: 16384 per CTA -> 4 by registers; 4 KB smem -> 45 by smem;
        # 64 warps -> 16: registers bind.
        assert resident_programs("sm90", num_warps=4, regs_per_thread=128, smem_bytes=4096) == 4
        # 170 regs -> 176 -> 5632 per warp, 22528 per 4-warp CTA: 2 (unrounded 21760: 3).
        assert resident_programs("sm90", num_warps=4, regs_per_thread=170, smem_bytes=0) == 2

    def test_smem_bound_counts_the_reserved_kilobyte(self) -> None:
        # 113 KB + 1 KB reserved = 114 KB: two fit in 228 KB. One byte more rounds up to the
        # next 128 B unit and only one fits.
        assert resident_programs("sm90", num_warps=4, regs_per_thread=32, smem_bytes=113 << 10) == 2
        assert (
            resident_programs("sm90", num_warps=4, regs_per_thread=32, smem_bytes=(113 << 10) + 1)
            == 1
        )

    def test_warp_and_block_caps(self) -> None:
        # 1 warp of 8 regs, no smem: 64 warps allow 64 but blocks cap at 32.
        assert resident_programs("sm90", num_warps=1, regs_per_thread=8, smem_bytes=0) == 32
        # 16 warps of 32 regs: registers allow 4, warps allow 4.
        assert resident_programs("sm90", num_warps=16, regs_per_thread=32, smem_bytes=0) == 4

    def test_over_the_per_block_smem_limit_does_not_fit(self) -> None:
        assert (
            resident_programs("sm90", num_warps=8, regs_per_thread=128, smem_bytes=228 << 10) == 0
        )


class TestResidencyCdna:
    def test_vgpr_bound(self) -> None:
        # 232 VGPRs -> 232 (a multiple of 8): 512 // 232 = 2 waves per SIMD, 8 per CU; a
        # 4-wave workgroup -> 2. 16 KB LDS would allow 4.
        assert resident_programs("gfx942", num_warps=4, regs_per_thread=232, smem_bytes=16384) == 2
        # 8 waves of 194 (-> 200): 2 per SIMD, 8 per CU -> 1 workgroup.
        assert resident_programs("gfx942", num_warps=8, regs_per_thread=194, smem_bytes=16384) == 1
        # 102 -> 104: 4 waves per SIMD, 16 per CU -> 4 workgroups of 4 (unrounded 102: 5).
        assert resident_programs("gfx942", num_warps=4, regs_per_thread=102, smem_bytes=0) == 4

    def test_agprs_follow_the_arch_vgprs_rounded_to_four(self) -> None:
        # 129 arch -> 132, + 124 AGPRs = 256 -> 2 waves per SIMD -> 2 workgroups of 4 waves.
        assert (
            resident_programs(
                "gfx942", num_warps=4, regs_per_thread=129, agprs_per_thread=124, smem_bytes=0
            )
            == 2
        )
        # 125 arch -> 128, + 129 AGPRs = 257 -> 264: one wave per SIMD (254 unrounded would
        # have allowed two).
        assert (
            resident_programs(
                "gfx942", num_warps=4, regs_per_thread=125, agprs_per_thread=129, smem_bytes=0
            )
            == 1
        )

    def test_wave_cap_and_sgprs(self) -> None:
        # 32 VGPRs: 16 waves by registers, capped at 8 per SIMD -> 32 waves per CU -> 8
        # workgroups of 4 waves; 101 SGPRs allow only 7 per SIMD -> 7.
        assert resident_programs("gfx942", num_warps=4, regs_per_thread=32, smem_bytes=0) == 8
        assert (
            resident_programs(
                "gfx942", num_warps=4, regs_per_thread=32, sgprs_per_wave=101, smem_bytes=0
            )
            == 7
        )

    def test_lds_granules_differ_between_gfx942_and_gfx950(self) -> None:
        # 20000 B: gfx942 rounds to 20480 (40 x 512) -> 3 in 64 KB; gfx950 to 20480 (16 x
        # 1280) -> 8 in 160 KB, and registers (64 VGPRs, 1-wave groups: 32) do not bind.
        assert resident_programs("gfx942", num_warps=1, regs_per_thread=64, smem_bytes=20000) == 3
        assert resident_programs("gfx950", num_warps=1, regs_per_thread=64, smem_bytes=20000) == 8
        # 54000 B is 43 blocks of 1280 B on gfx950 (55040): 2 in 160 KB, where 512 B blocks
        # (54272) would fit 3.
        assert resident_programs("gfx950", num_warps=1, regs_per_thread=64, smem_bytes=54000) == 2
        # 66 KB fits a gfx950 CU twice but not a gfx942 CU at all.
        assert (
            resident_programs("gfx942", num_warps=4, regs_per_thread=64, smem_bytes=66 << 10) == 0
        )
        assert (
            resident_programs("gfx950", num_warps=4, regs_per_thread=64, smem_bytes=66 << 10) == 2
        )


class TestResidencyErrors:
    def test_unknown_target(self) -> None:
        with pytest.raises(ValueError, match="target_key must be one of"):
            resident_programs("sm80", num_warps=4, regs_per_thread=32, smem_bytes=0)
        assert RESIDENCY_TARGETS == ("sm90", "gfx942", "gfx950")

    @pytest.mark.parametrize(
        ("target", "kwargs", "message"),
        [
            ("sm90", {"regs_per_thread": 256}, "regs_per_thread must be in"),
            ("sm90", {"num_warps": 0}, "num_warps must be in"),
            ("sm90", {"smem_bytes": -1}, "smem_bytes must be >= 0"),
            ("sm90", {"agprs_per_thread": 8}, "AMD counts"),
            ("gfx942", {"regs_per_thread": 257}, "regs_per_thread must be in"),
            ("gfx942", {"num_warps": 32}, "num_warps must be in"),
            ("gfx950", {"agprs_per_thread": -4}, "agprs_per_thread must be in"),
        ],
    )
    def test_bad_counts_name_the_argument(self, target: str, kwargs: dict, message: str) -> None:
        args = {"num_warps": 4, "regs_per_thread": 64, "smem_bytes": 0} | kwargs
        with pytest.raises(ValueError, match=message):
            resident_programs(target, **args)

    def test_non_int_is_a_type_error(self) -> None:
        with pytest.raises(TypeError, match="num_warps must be an int"):
            resident_programs("sm90", num_warps=4.0, regs_per_thread=64, smem_bytes=0)
