"""The compile-level gate: residency arithmetic (hand-computed cases) and the static tool."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import triton
import triton.language as tl

from benchmarks import isa
from benchmarks import kernel_static as ks
from rocm_mla.kernels import schedule as sch
from rocm_mla.kernels.residency import RESIDENCY_TARGETS, resident_programs
from tests.compile_helpers import run_compiler


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

    def test_gfx1250_wave32_vgprs_without_agprs(self) -> None:
        # 1024 VGPRs a lane in granules of 16, up to 16 waves a SIMD, 4 SIMDs, no AGPRs; the
        # pairs are Triton 3.9's gfx1250 builds: NumVgprs and LLVM's "; Occupancy:" (waves a
        # SIMD) of the same kernel. 84 -> 96: 10 waves; 502 -> 512: 2; 809 -> 816: 1.
        for vgprs, waves in ((84, 10), (502, 2), (809, 1), (1024, 1)):
            assert resident_programs(
                "gfx1250", num_warps=4, regs_per_thread=vgprs, smem_bytes=0
            ) == waves, vgprs  # fmt: skip
        # SGPRs do not limit gfx12 waves; 320 KB of LDS in 2 KB blocks: 33 KB -> 34 KB, 9.
        assert resident_programs(
            "gfx1250", num_warps=1, regs_per_thread=32, sgprs_per_wave=108, smem_bytes=33 << 10
        ) == 9  # fmt: skip
        with pytest.raises(ValueError, match="no AGPRs"):
            resident_programs(
                "gfx1250", num_warps=4, regs_per_thread=64, agprs_per_thread=8, smem_bytes=0
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
        # "hip": another AMD arch, modelled as CDNA3 (the registry's family record).
        assert RESIDENCY_TARGETS == ("sm90", "gfx942", "gfx950", "gfx1250", "hip")

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


# ---- the static tool: parsers (fast) -------------------------------------------------------


class TestReaders:
    def test_matrix_instruction_shapes(self) -> None:
        assert isa._sass_matrix_shape("HGMMA.64x32x16.F32.BF16") == (64, 32, 16, "16bit")
        assert isa._sass_matrix_shape("QGMMA.64x32x32.F32.E4M3.E4M3") == (64, 32, 32, "fp8")
        assert isa._sass_matrix_shape("HMMA.16816.F32.BF16") == (16, 8, 16, "16bit")
        assert isa._sass_matrix_shape("IMAD.WIDE") is None
        assert isa._amd_matrix_shape("v_mfma_f32_16x16x16_bf16") == (16, 16, 16, "16bit")
        assert isa._amd_matrix_shape("v_mfma_f32_16x16x32_fp8_fp8") == (16, 16, 32, "fp8")
        assert isa._amd_matrix_shape("v_mfma_f32_32x32x16_bf16") == (32, 32, 16, "16bit")
        assert isa._amd_matrix_shape("v_add_f32") is None
        # gfx1250's matrix ops are WMMA (wave32), read as the MFMA ones are.
        assert isa.matrix_shape("v_wmma_f32_16x16x32_bf16", "hip") == (16, 16, 32, "16bit")
        assert isa.matrix_shape("v_wmma_f32_16x16x64_fp8_fp8", "hip") == (16, 16, 64, "fp8")
        with pytest.raises(ValueError, match="not a cuda matrix op"):
            isa.matrix_shape("IMAD.WIDE", "cuda")

    def test_sass_loop_is_the_backward_branch_with_the_matrix_ops(self) -> None:
        sass = "\n".join(
            [
                "/*0000*/  MOV R1, c[0x0][0x28] ;",
                "/*0010*/  HMMA.16816.F32.BF16 R4, R8, R12, R4 ;",
                "/*0020*/  LDGSTS.E.BYPASS.128 [R2], desc[UR4][R6.64] ;",
                "/*0030*/  HMMA.16816.F32.BF16 R4, R8, R12, R4 ;",
                "/*0040*/  STL [R1], R5 ;",
                "/*0050*/  @P0 BRA 0x10 ;",
                "/*0060*/  MUFU.EX2 R3, R3 ;",
                "/*0070*/  @!P1 BRA 0x60 ;",
                "/*0080*/  EXIT ;",
            ]
        )
        loop = isa.read_sass_loop(sass)
        assert loop["matrix"] == {"HMMA.16816.F32.BF16": 2}
        assert loop["counts"]["LDGSTS"] == 1 and loop["counts"]["STL"] == 1
        assert loop["counts"]["MUFU.EX2"] == 0 and loop["instructions"] == 5

    def test_amdgcn_loop_blocks_follow_llvm_loop_comments(self) -> None:
        text = "\n".join(
            [
                "_kernel:",
                "\tv_mfma_f32_16x16x16_bf16 a[0:3], v[0:1], v[2:3], 0",
                ".LBB0_2:                                ;   in Loop: Header=BB0_3 Depth=1",
                "\tv_mfma_f32_16x16x16_bf16 v[4:7], v[0:1], v[2:3], v[4:7]",
                "\tds_read_b128 v[8:11], v12",
                ".LBB0_3:                                ; =>This Inner Loop Header: Depth=1",
                "\tbuffer_load_dwordx4 v[0:3], v13, s[0:3], 0 offen",
                "\tv_mfma_f32_16x16x16_bf16 v[4:7], v[0:1], v[2:3], v[4:7]",
                "\ts_cbranch_scc1 .LBB0_2",
                ".LBB0_4:",
                "\ts_endpgm",
            ]
        )
        loop = isa.read_amdgcn_loop(text)
        assert loop["matrix"] == {"v_mfma_f32_16x16x16_bf16": 2}
        assert loop["counts"]["buffer_load"] == 1 and loop["counts"]["ds_read"] == 1

    def test_loops_around_the_walk_are_not_the_walk(self) -> None:
        """Stage 1 loops over its slot's segments around the KV walk (and the pipeliner
        peels iterations into that loop): each reader takes the innermost loop with the
        most matrix ops, not the one around it."""
        sass = "\n".join(
            [
                "/*0000*/  MOV R1, c[0x0][0x28] ;",
                "/*0010*/  HMMA.16816.F32.BF16 R4, R8, R12, R4 ;",  # peeled: outer loop
                "/*0020*/  HMMA.16816.F32.BF16 R4, R8, R12, R4 ;",
                "/*0030*/  HMMA.16816.F32.BF16 R4, R8, R12, R4 ;",  # the walk
                "/*0040*/  LDL R5, [R1] ;",
                "/*0050*/  @P0 BRA 0x30 ;",
                "/*0060*/  HMMA.16816.F32.BF16 R4, R8, R12, R4 ;",  # peeled
                "/*0070*/  @P1 BRA 0x10 ;",
                "/*0080*/  EXIT ;",
            ]
        )
        loop = isa.read_sass_loop(sass)
        assert loop["matrix"] == {"HMMA.16816.F32.BF16": 1} and loop["counts"]["LDL"] == 1
        text = "\n".join(
            [
                "_kernel:",
                ".LBB0_3:                                ; =>This Loop Header: Depth=1",
                "                                        ;     Child Loop BB0_6 Depth 2",
                "\tv_mfma_f32_16x16x16_bf16 v[4:7], v[0:1], v[2:3], v[4:7]",
                "\tv_mfma_f32_16x16x16_bf16 v[4:7], v[0:1], v[2:3], v[4:7]",
                ".LBB0_6:                                ;   Parent Loop BB0_3 Depth=1",
                "                                        ; =>  This Inner Loop Header: Depth=2",
                "\tbuffer_load_dwordx4 v[0:3], v13, s[0:3], 0 offen",
                "\tv_mfma_f32_16x16x16_bf16 v[4:7], v[0:1], v[2:3], v[4:7]",
                "; %bb.7:                                ;   in Loop: Header=BB0_6 Depth=2",
                "\tds_read_b128 v[8:11], v12",
                "\ts_cbranch_scc1 .LBB0_6",
                "; %bb.8:                                ;   in Loop: Header=BB0_3 Depth=1",
                "\tv_mfma_f32_16x16x16_bf16 v[4:7], v[0:1], v[2:3], v[4:7]",
                "\ts_cbranch_scc1 .LBB0_3",
                "\ts_endpgm",
            ]
        )
        loop = isa.read_amdgcn_loop(text)
        assert loop["matrix"] == {"v_mfma_f32_16x16x16_bf16": 1}
        assert loop["counts"]["buffer_load"] == 1 and loop["counts"]["ds_read"] == 1
        dots = "      %d = tt.dot %q, %k, %acc : tensor<64x512xbf16, #b>"
        ttgir = "\n".join(
            [
                "    %s = scf.for %i = %a to %b step %c iter_args(%x = %y) -> (i32) {",
                dots,
                "      %r = scf.for %n = %a to %b step %c iter_args(%x = %y) -> (i32) {",
                "      %t = ttg.local_load %buf : !ttg.memdesc<64x512xbf16> -> "
                "tensor<64x512xbf16, #b>",
                dots,
                "        scf.yield %x : i32",
                "      }",
                dots,
                "      scf.yield %x : i32",
                "    }",
            ]
        )
        facts = isa.read_ttgir(ttgir)
        ops = [(result, op) for result, op, _, _ in facts["loop_ops"]]
        assert ops == [
            ("%r", "scf.for"),
            ("%t", "ttg.local_load"),
            ("%d", "tt.dot"),
            (None, "scf.yield"),
        ]
        assert facts["other_loop_ops"] == []

    def test_round_trip_is_a_shared_tile_written_back(self) -> None:
        loop = [
            "    %r = scf.for %n = %a to %b step %c iter_args(%x = %y) -> (i32) {",
            "      %t = ttg.local_load %buf : !ttg.memdesc<64x512xbf16> -> tensor<64x512xbf16, #b>",
            "      %f = math.absf %t : tensor<64x512xbf16, #b>",
            "      %g = arith.select %m, %t, %z : tensor<64x512xi1, #b>, tensor<64x512xbf16, #b>",
            "      %h = ttg.local_alloc %g : (tensor<64x512xbf16, #b>) -> !ttg.memdesc<64x512xbf16>"
            " loc(#loc1)",
            "      scf.yield %x : i32",
            "    }",
        ]
        header = [
            "  %buf = ttg.local_alloc : () -> !ttg.memdesc<2x64x512xbf16, #s, #smem, mutable>"
        ]
        facts = ks._kv_facts(isa.read_ttgir("\n".join(header + loop)), block_n=64)
        assert facts["kv_buffers"] == 2
        # A buffer the main loop does not use (another loop's) says nothing about it.
        other = "  %buf9 = ttg.local_alloc : () -> !ttg.memdesc<1x64x512xbf16, #s, #smem, mutable>"
        assert (
            ks._kv_facts(isa.read_ttgir("\n".join([*header, other, *loop])), 64)["kv_buffers"] == 2
        )
        assert facts["kv_round_trips"] == ["ttg.local_alloc"] and facts["guard_on_smem_tile"]
        assert facts["guard_round_trips"] == 1
        clean = [line for line in loop if "local_alloc" not in line]
        facts = ks._kv_facts(isa.read_ttgir("\n".join(header + clean)), block_n=64)
        assert facts["kv_round_trips"] == [] and facts["kv_buffers"] == 2
        assert facts["guard_round_trips"] == 0
        # A round trip with no guard in its loop (sm90's fp8 V, transposed) is listed but is
        # not the guard's.
        transpose = [line for line in loop if "absf" not in line]
        facts = ks._kv_facts(isa.read_ttgir("\n".join(header + transpose)), block_n=64)
        assert facts["kv_round_trips"] == ["ttg.local_alloc"] and not facts["guard_on_smem_tile"]
        assert facts["guard_round_trips"] == 0
        # The guard's round trip in a loop after the walk (a verify window's tail tiles,
        # 16 keys) counts too.
        tail = [line.replace("64x512", "16x512").replace("%r ", "%r2 ") for line in loop]
        walk = [line for line in loop if "absf" not in line and "local_alloc" not in line]
        dots = "      %d = tt.dot %q, %k, %acc : tensor<64x512xbf16, #b>"
        text = "\n".join(header + walk[:2] + [dots, dots] + walk[2:] + tail[:2] + [dots] + tail[2:])
        facts = ks._kv_facts(isa.read_ttgir(text), block_n=64)
        assert facts["kv_round_trips"] == ["ttg.local_alloc"] and facts["guard_round_trips"] == 1
        # A part of the tile loaded in the loop straight into registers has one stage, whatever
        # the other parts have; stored into the multi-buffer it is pipelined.
        load = "      %k = tt.load %p : tensor<64x64x!tt.ptr<bf16>, #b>"
        facts = ks._kv_facts(isa.read_ttgir("\n".join(header + clean[:1] + [load] + clean[1:])), 64)
        assert facts["kv_buffers"] == 1 and facts["synchronous_kv_loads_in_loop"] == 1
        store = (
            "      ttg.local_store %k, %slot : tensor<64x64xbf16, #b> -> !ttg.memdesc<64x64xbf16>"
        )
        staged = header + clean[:1] + [load, store] + clean[1:]
        assert ks._kv_facts(isa.read_ttgir("\n".join(staged)), 64)["kv_buffers"] == 2
        # AMD's stream pipeliner prefetches into registers and stores a transposed or
        # converted copy of the load: still the load's LDS stage.
        for op in ("amdg.in_thread_transpose", "ttg.convert_layout"):
            moved = f"      %kt = {op} %k : tensor<64x64xbf16, #b> -> tensor<64x64xbf16, #l>"
            stored_moved = header + clean[:1] + [load, moved, store.replace("%k,", "%kt,")]
            facts = ks._kv_facts(isa.read_ttgir("\n".join(stored_moved + clean[1:])), 64)
            assert facts["kv_buffers"] == 2 and facts["synchronous_kv_loads_in_loop"] == 0, op
            # Its own (one-slot) LDS buffer plus the register stage it lands in a trip ahead.
            assert facts["kv_stages"] == 2, op
        # Any other op in between (a value change) is not the load's stage.
        changed = "      %kt = arith.mulf %k, %k : tensor<64x64xbf16, #b>"
        stored_changed = header + clean[:1] + [load, changed, store.replace("%k,", "%kt,")]
        facts = ks._kv_facts(isa.read_ttgir("\n".join(stored_changed + clean[1:])), 64)
        assert facts["kv_buffers"] == 1 and facts["kv_stages"] == 1
        # Loaded in registers and used in the same trip: one stage. Carried through the yield
        # to the next trip (gfx950's V halves): two, though it has one LDS buffer.
        same_trip = header + clean[:1] + [load] + clean[1:]
        assert ks._kv_facts(isa.read_ttgir("\n".join(same_trip)), 64)["kv_stages"] == 1
        carried = [line.replace("scf.yield %x", "scf.yield %x, %k") for line in same_trip]
        facts = ks._kv_facts(isa.read_ttgir("\n".join(carried)), 64)
        assert facts["kv_stages"] == 2 and facts["kv_buffers"] == 1


# ---- the static tool: compiling for real (slow, subprocesses without the interpreter) ------


@triton.jit
def _probe_mla_loop(q_ptr, kv_ptr, out_ptr, num_keys, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    """A bare MLA loop (QK over 512 + 64 columns, PV over 512) whose waste is Triton's layout
    choice for the block shape, not anything in rocm_mla/kernels/: a [128, 512] fp32 accumulator in
    4 warps must spill on sm90, and 16 rows over 4 waves replicate QK on gfx942."""
    rows = tl.arange(0, BLOCK_H)
    dv = tl.arange(0, 512)
    dr = tl.arange(0, 64)
    q_nope = tl.load(q_ptr + rows[:, None] * 576 + dv[None, :])
    q_rope = tl.load(q_ptr + rows[:, None] * 576 + 512 + dr[None, :])
    acc = tl.zeros([BLOCK_H, 512], tl.float32)
    for n0 in range(0, num_keys, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        kv_nope = tl.load(kv_ptr + keys[:, None] * 576 + dv[None, :])
        kv_rope = tl.load(kv_ptr + keys[:, None] * 576 + 512 + dr[None, :])
        scores = tl.dot(q_nope, tl.trans(kv_nope))
        scores = tl.dot(q_rope, tl.trans(kv_rope), scores)
        p = tl.exp2(scores - tl.max(scores, axis=1)[:, None]).to(kv_nope.dtype)
        acc = tl.dot(p, kv_nope, acc)
    tl.store(out_ptr + rows[:, None] * 512 + dv[None, :], acc)


def probe_gates() -> dict:
    """Gates of the probe kernel: (sm90, 128 rows, 4 warps) and (gfx942, 16 rows, 4 waves)."""
    results = {}
    for target_key, heads, block_h, block_n in (("sm90", 128, 128, 64), ("gfx942", 64, 16, 16)):
        target = ks.TARGETS[target_key]
        q = torch.empty(block_h, 576, dtype=torch.bfloat16, device="meta")
        kv = torch.empty(4096, 576, dtype=torch.bfloat16, device="meta")
        out = torch.empty(block_h, 512, dtype=torch.float32, device="meta")
        kwargs = {"BLOCK_H": block_h, "BLOCK_N": block_n, "num_warps": 4, "num_stages": 1}
        launch = ks.Launch("_probe_mla_loop", __name__, (1,), (q, kv, out, 4096), kwargs)
        info = ks.compile_and_read(ks.specialize(launch, target))
        groups = heads // block_h
        slots = target.units
        plan = {
            "batch": 32,
            "requests": 32,
            "config": {"block_h": block_h, "block_n": block_n, "num_warps": 4, "num_stages": 1},
            "slots": slots,
            "num_groups": groups,
            "planner_programs_per_cu": 1,
            "plan_slots_per_cu": 1.0,
            "schedule": ks.schedule_facts(32, 4096, groups, slots, 4096),
            "kv_cache_bytes": 4096 * 576 * 2,
            "launch_capacity": 32 * groups + slots,  # schedule.launch_capacity, one pool
            "grid": [32 * groups + slots],
            "stage1": info["key"],
            "planner": info["key"],
            "keys": [info["key"]],
        }
        case = ks.Case("probe", heads, 1, "bf16")
        results[target_key] = ks.analyze(case, target, [plan], {info["key"]: info})["gates"]
    return results


@pytest.mark.slow
def test_gates_fail_on_a_spilling_and_a_replicating_kernel() -> None:
    code = (
        "import json; from tests.test_kernel_static import probe_gates; "
        "print(json.dumps(probe_gates()))"
    )
    gates = json.loads(run_compiler(code).strip().splitlines()[-1])
    assert gates["sm90"]["no_spills"]["pass"] is False, gates["sm90"]["no_spills"]
    spills = gates["sm90"]["no_spills"]["evidence"]["spills_by_kernel"]
    assert all(v > 0 for v in spills.values())
    replicated = gates["gfx942"]["issued_over_useful"]
    assert replicated["pass"] is False, replicated
    assert replicated["evidence"]["by_batch"]["32"]["replication"] > ks.MAX_ISSUED_OVER_USEFUL


@pytest.mark.slow
def test_reduced_case_list_meets_every_gate(tmp_path: Path) -> None:
    """Issue 20's acceptance on a few cases and all three targets: every gate met."""
    run_compiler(
        "from benchmarks.kernel_static import main; main(['--cases', 'reduced', "
        f"'--targets', 'sm90,gfx942,gfx950', '--out', {str(tmp_path)!r}])"
    )
    (path,) = tmp_path.glob("kernel-static-*.json")
    payload = json.loads(path.read_text())
    assert {r["target"] for r in payload["results"]} == {"sm90", "gfx942", "gfx950"}
    assert len(payload["results"]) == 3 * len(ks.REDUCED_CASES)
    failed = ks.failures(payload)
    assert not failed, "gates failed:\n" + "\n".join(sorted(failed))
    windows = [r["target"] for r in payload["results"] if "window_kv_bytes" in r["gates"]]
    assert sorted(windows) == ["gfx942", "gfx950", "sm90"]


# ---- the schedule's figures and the gates computed from them (fast) --------------------------


class TestScheduleGates:
    def test_schedule_facts(self) -> None:
        # A uniform batch that fits: 8 units of 64 pieces each, one slot each; no cut.
        fits = ks.schedule_facts(4, 4096, 2, 8, 4096)
        assert fits["cut_units"] == 0 and fits["partials"] == 0
        assert fits["max_segments_per_unit"] == 1 and fits["used_slots"] == 8
        assert fits["slot_fill"] == 1.0 and fits["kv_tile_loads_per_request"] == 2.0
        # One request over 132 slots: cut into a segment per slot, each key still walked once.
        long = ks.schedule_facts(1, 32768, 1, 132, 32768)
        assert long["max_segments_per_unit"] == long["used_slots"] >= 0.9 * 132
        assert long["kv_tile_loads_per_request"] == 1.0 and long["slot_fill"] >= 0.9
        # Two one-piece requests over 4 slots: half the slots idle, and the fill says so.
        idle = ks.schedule_facts(2, 64, 1, 4, 64)
        assert idle["used_slots"] == 2 and idle["slot_fill"] == 0.5

    #: A synthetic schedule's figures (``schedule_facts``) that meet the gates.
    SCHEDULE: ClassVar[dict] = {
        "used_slots": 304,
        "max_segments_per_unit": 5,
        "programs": 368,
        "first_wave_holds_the_slots_first_segments": True,
        "list_scheduled_within_plan": True,
        "makespan": 700,
        "least_makespan": 560,
    }

    @staticmethod
    def _gates(**batch_overrides) -> dict:
        """``gates`` of a gfx942 H128 case over one synthetic batch (stage 1 and planner
        kernels read from fake compile results)."""
        target = ks.TARGETS["gfx942"]
        kernel = {
            "vgpr_spill_count": 0,
            "scratch_bytes": 0,
            "sgpr_spill_count": 0,
            "loop": {"found": True, "matrix": {"v_mfma_f32_16x16x16_bf16": 8}},
        }
        planner = dict(kernel, vgpr_spill_count=batch_overrides.pop("planner_spills", 0))
        kv = {
            "kv_buffers": 2,
            "kv_stages": 2,
            "async_copies_in_loop": 0,
            "async_wait_nums": [],
            "kv_round_trips": [],
            "guard_on_smem_tile": False,
            "guard_round_trips": 0,
        }
        batch = {
            "batch": 32,
            "config": {"block_h": 64},
            "slots": 304,
            "launch_capacity": 672,
            "num_groups": 2,
            "stage1": "s1",
            "other_kernels": ["plan"],
            "grid": [672],
            "resident_per_unit": 1,
            "planner_programs_per_cu": 1,
            "plan_slots_per_cu": 1.0,
            "waves": 2.211,
            "schedule": dict(TestScheduleGates.SCHEDULE),
            "slot_fill": 0.99,
            "kv_tile_loads_per_request": 2.0,
            "issued_over_useful": 1.0,
            "replication": 1.0,
            "row_padding": 1.0,
            "kv": kv,
            "shared": {"by_width_bits": {"16": 128, "64": 32, "128": 2}},
        } | batch_overrides
        case = ks.Case("H128 Sq1 bf16", 128, 1, "bf16")
        return ks.gates(case, target, [batch], {"s1": kernel, "plan": planner})

    def test_the_schedule_gates_pass_and_fail_on_their_figures(self) -> None:
        good = self._gates()
        assert all(g["pass"] in (True, None) for g in good.values()), good
        assert self._gates(slot_fill=0.8)["whole_waves"]["pass"] is False
        # A low fill at the least makespan the model allows, or one piece above it, is the
        # pieces' granularity; two pieces above it is not.
        at_least = dict(self.SCHEDULE, makespan=560)
        assert self._gates(slot_fill=0.8, schedule=at_least)["whole_waves"]["pass"] is True
        piece = dict(self.SCHEDULE, makespan=560 + sch.PIECE_KEYS)
        assert self._gates(slot_fill=0.8, schedule=piece)["whole_waves"]["pass"] is True
        two = dict(self.SCHEDULE, makespan=560 + 2 * sch.PIECE_KEYS)
        assert self._gates(slot_fill=0.8, schedule=two)["whole_waves"]["pass"] is False
        for broken in ("first_wave_holds_the_slots_first_segments", "list_scheduled_within_plan"):
            bad = dict(at_least, **{broken: False})
            assert self._gates(schedule=bad)["whole_waves"]["pass"] is False
        wrong_grid = self._gates(grid=[608])
        assert wrong_grid["planner_uses_compiled_residency"]["pass"] is False
        assert (
            self._gates(plan_slots_per_cu=2.0)["planner_uses_compiled_residency"]["pass"] is False
        )
        assert self._gates(kv_tile_loads_per_request=3.0)["kv_tile_loads_h128"]["pass"] is False
        # A byte-wide shared access in the KV loop fails the narrow-shared gate on AMD; 16
        # bits (bf16's ds_read_u16) do not.
        assert good["narrow_shared"]["pass"] is True
        byte_wide = {"by_width_bits": {"8": 256, "64": 16}}
        assert self._gates(shared=byte_wide)["narrow_shared"]["pass"] is False
        # A case whose kernels compiled passes "compiles".
        assert good["compiles"]["pass"] is True
        # The planner kernel is under the spill gate too.
        spilled = self._gates(planner_spills=4)["no_spills"]
        assert spilled["pass"] is False and spilled["evidence"]["spills_by_kernel"]["plan"] == 4

    @staticmethod
    def _result(name: str, q_len: int, dcp: int, walked: dict[int, int], groups: int) -> dict:
        case = ks.Case(name, 12 * dcp, q_len, "bf16", dcp)
        per_batch = [
            {"batch": b, "kv_bytes_per_step": keys * ks.HEAD_DIM * 2, "num_groups": groups}
            for b, keys in walked.items()
        ]
        return {
            "case": asdict(case),
            "target": "gfx942",
            "per_batch": per_batch,
            "gates": {},
        }

    def test_window_kv_bytes_per_row_group(self) -> None:
        """Issue 40: a DCP window's KV bytes per step over its single query's, per row group.
        One pass with per-row bounds (a window of 4 x 24 rows in 3 groups walking 3x the
        keys) passes; a window folded into one-row requests (4x the keys, one group) fails.
        A case without a single-query twin on the target gets no gate."""
        context = 16384
        single = self._result("Sq1", 1, 2, {8: 8 * context, 32: 32 * context}, 1)
        one_pass = self._result("Sq4", 4, 2, {8: 24 * context, 32: 96 * context}, 3)
        folded = self._result("Sq4 folded", 4, 2, {8: 32 * context, 32: 128 * context}, 1)
        lonely = self._result("Sq2", 2, 4, {8: 8 * context}, 1)
        results = [single, one_pass, folded, lonely]
        ks.window_kv_gates(results)
        assert "window_kv_bytes" not in single["gates"]
        assert "window_kv_bytes" not in lonely["gates"]
        passed = one_pass["gates"]["window_kv_bytes"]
        assert passed["pass"] is True, passed
        assert passed["evidence"]["by_batch"][32] == {
            "kv_bytes_per_step": 96 * context * ks.HEAD_DIM * 2,
            "single_query_kv_bytes_per_step": 32 * context * ks.HEAD_DIM * 2,
            "ratio": 3.0,
            "row_groups": 3,
            "single_query_row_groups": 1,
            "ratio_per_row_group": 1.0,
            "folded_ratio": 4,
        }
        failed = folded["gates"]["window_kv_bytes"]
        assert failed["pass"] is False
        assert failed["evidence"]["by_batch"][8]["ratio_per_row_group"] == 4.0


# ---- cases that do not compile, and other Triton versions (fast) -----------------------------


class CompilationError(Exception):
    """Named as Triton's, which ``describe_failure`` finds by name."""


class TestFailures:
    CASE = ks.Case("H16 Sq1 fp8", 16, 1, "fp8")

    def test_a_plan_that_fails_or_is_refused(self) -> None:
        target = ks.TARGETS["sm90"]
        failed = {"batch": 8, "refused": False, "error": "RuntimeError: PassManager::run failed"}
        gates = ks.analyze(self.CASE, target, failed, {})["gates"]
        assert list(gates) == ["compiles"] and gates["compiles"]["pass"] is False
        refused = dict(failed, refused=True, error="ValueError: Triton 3.4.0 is below 3.5.1")
        gates = ks.analyze(self.CASE, target, refused, {})["gates"]
        assert gates["compiles"]["pass"] is None and not gates["compiles"]["applies"]

    def test_a_kernel_that_does_not_compile_fails_its_cases(self) -> None:
        kernels = {
            "s1": {"kernel": "_mla_decode_stage1", "error": "RuntimeError: x\nk.py:1: error: bad"},
            "plan": {"kernel": "_plan_schedule_kernel", "loop": {"found": False}},
        }
        plans = [{"batch": 8, "keys": ["plan", "s1"], "stage1": "s1"}]
        result = ks.analyze(self.CASE, ks.TARGETS["gfx942"], plans, kernels)
        assert result["per_batch"] == []
        assert result["gates"]["compiles"]["pass"] is False
        assert result["gates"]["compiles"]["evidence"]["kernels"] == {"s1": kernels["s1"]["error"]}
        payload = {
            "environment": {"triton": "3.6.0", "date": "2026-12-04"},
            "context": 32768,
            "page_size": 64,
            "batches": [8],
            "wall_s": {"total": 1.0},
            "distinct_compiles": 2,
            "all_gates_pass": False,
            "failed_gates": ["compiles"],
            "kernels": kernels,
            "results": [
                {"case": {"name": self.CASE.name}, "target": "gfx942", **result},
                {
                    "case": {"name": "H128 Sq1 fp8"},
                    "target": "sm90",
                    **ks.analyze(
                        self.CASE,
                        ks.TARGETS["sm90"],
                        {"batch": 8, "refused": True, "error": "ValueError: below the floor"},
                        {},
                    ),
                },
            ],
        }
        text = ks.markdown(payload)
        assert "| _mla_decode_stage1 does not compile: bad |" in text
        assert "| refused: ValueError: below the floor |" in text

    def test_describe_failure_names_the_innermost_error_and_mlir_errors(self) -> None:
        try:
            try:
                try:
                    raise AttributeError("'int' object has no attribute 'to'")
                except AttributeError as root:
                    raise CompilationError("at 3:4:\n    x = n.to(tl.int64)\n        ^") from root
            except CompilationError as inner:
                raise CompilationError("at 9:8:\n    f(n)") from inner
        except CompilationError as outer:
            text = ks.describe_failure(outer, ["k.py:1:0: error: failed to legalize"])
        assert text.startswith("CompilationError: at 3:4:") and "f(n)" not in text
        assert "AttributeError: 'int' object has no attribute 'to'" in text
        assert text.endswith("error: failed to legalize")


class TestTritonFolders:
    def test_a_version_or_a_folder(self, tmp_path: Path, monkeypatch) -> None:
        wheel = tmp_path / "3.9.9"
        (wheel / "triton").mkdir(parents=True)
        (wheel / "triton" / "__init__.py").write_text("")
        monkeypatch.setenv("ROCM_MLA_TRITONS", str(tmp_path))
        assert ks.triton_folder("3.9.9") == wheel.resolve()
        assert ks.triton_folder(str(wheel)) == wheel.resolve()
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        with pytest.raises(SystemExit, match=r"pip install --no-deps --target .*triton==3\.1\.0"):
            ks.triton_folder("3.1.0")
        with pytest.raises(SystemExit, match="expected a version"):
            ks.triton_folder("latest")


class TestCompareStatic:
    @staticmethod
    def _payload(block_n: int, spills: bool | None) -> dict:
        result = {
            "case": {"name": "H16 Sq1 bf16"},
            "target": "gfx950",
            "per_batch": [{"batch": 8, "config": {"block_n": block_n}}],
            "gates": {"compiles": {"pass": True}, "no_spills": {"pass": spills}},
        }
        return {"results": [result]}

    def test_configs_and_verdicts_are_compared_case_by_case(self) -> None:
        from benchmarks.compare_static import compare

        same = compare(self._payload(16, True), self._payload(16, True))
        assert same["targets"]["gfx950"] == {
            "cases": 1, "configs_differ": 0, "gates_differ": 0, "missing": 0
        }  # fmt: skip
        assert same["differences"] == []
        moved = compare(self._payload(16, True), self._payload(32, False))
        assert moved["targets"]["gfx950"]["configs_differ"] == 1
        assert moved["targets"]["gfx950"]["gates_differ"] == 1
        # A gate that stops applying (pass None) is a change too.
        assert compare(self._payload(16, True), self._payload(16, None))["differences"]
        gone = compare(self._payload(16, True), {"results": []}, {"gfx950"})
        assert gone["targets"]["gfx950"]["missing"] == 1
