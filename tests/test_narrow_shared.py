"""The narrow shared-memory gate of ``bench static`` (issue 37, item 3) sees what the H200 saw.

ncu on the H200 (Triton 3.8.0, the decode at 4600785): the sm90 KV loop of fp8 H128 stores V
byte by byte to transpose it (128 ``STS.U8`` an iteration, a 29-way bank conflict), the fp8
H16 loop loads it back byte by byte (128 ``LDS.U8``); the gfx942 builds of every fp8 case
read 256 ``ds_read_u8`` an iteration (bf16: 128 ``ds_read_u16``). The fixtures in
``tests/data/narrow_shared`` are those builds' KV loops as ``bench static --loops`` writes
them (the header of each says the case, the config, the Triton and the command). They were
written at 4226319, whose kernels differ from 4600785's only in two casts of the
specialization fix (``tl.cast`` for ``.to`` on an int argument), which compile to the same
code here: rebuilt with 4600785's kernel files, every excerpt came out identical.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks import isa
from benchmarks import kernel_static as ks

DATA = Path(__file__).resolve().parent / "data" / "narrow_shared"
HEADER = re.compile(
    r"# (\w+) \w+: the KV loop of _mla_decode_stage1, (.+?) at B 32 \((\d+)x(\d+), (\d+) warps"
)


def read_fixture(name: str) -> tuple[str, dict, dict]:
    """``(target, the loop as the reader reads it, its shared_facts)`` of a fixture."""
    text = (DATA / f"{name}.txt").read_text()
    target, case, _, block_n, warps = HEADER.match(text).groups()
    backend = ks.TARGETS[target].backend
    loop = isa.read_sass_loop(text) if backend == "cuda" else isa.read_amdgcn_loop(text)
    kv_bytes = 1 if case.endswith("fp8") else 2
    tile_bytes = int(block_n) * ks.HEAD_DIM * kv_bytes
    return target, loop, ks.shared_facts(loop, backend, int(warps), tile_bytes)


@pytest.mark.parametrize(
    ("name", "opcode", "count"),
    [
        # The ncu-condemned builds, with the counts ncu's source view gave per iteration.
        ("sm90-H128-Sq1-fp8", "STS.U8", 128),
        ("sm90-H16-Sq1-fp8", "LDS.U8", 128),
        ("gfx942-H16-Sq1-fp8", "ds_read_u8", 256),
    ],
)
def test_the_gate_fails_the_fp8_builds_the_h200_condemned(name: str, opcode: str, count: int):
    target, loop, shared = read_fixture(name)
    assert loop["found"] and loop["matrix"], name
    assert loop["shared"][opcode] == count
    assert shared["byte_wide"] >= count
    assert not ks.wide_enough(shared, ks.TARGETS[target].backend)


@pytest.mark.parametrize(
    ("name", "half_wide"),
    [
        ("sm90-H16-Sq1-bf16", 0),
        # AMD's bf16 V is read 16 bits at a time: reported, not refused (MIN_SHARED_ACCESS_BITS).
        ("gfx942-H16-Sq1-bf16", 128),
    ],
)
def test_the_gate_passes_the_bf16_builds(name: str, half_wide: int) -> None:
    target, loop, shared = read_fixture(name)
    assert loop["found"] and loop["matrix"], name
    assert shared["byte_wide"] == 0 and shared["half_wide"] == half_wide
    assert ks.wide_enough(shared, ks.TARGETS[target].backend)


def test_sm90_refuses_16_bit_shared_accesses() -> None:
    # The fp8 H128 loop also stores 8 STS.U16 an iteration: sm90 refuses those on their own.
    _, loop, shared = read_fixture("sm90-H128-Sq1-fp8")
    assert loop["shared"]["STS.U16"] == 8
    halfword_only = dict(shared, by_width_bits={"16": 8, "32": 15, "64": 6, "128": 10})
    assert not ks.wide_enough(halfword_only, "cuda")
    assert ks.wide_enough(halfword_only, "hip")


def test_shared_bytes_per_kv_byte() -> None:
    """Bytes the loop's shared loads and stores move per iteration over the KV tile's: the
    fp8 H128 loop on sm90 moves 412 bytes a thread (128 STS.U8 at 1, 8 STS.U16 at 2, 15 LDS
    at 4, 8 LDS.128 at 16, 3 LDS.64 and 3 STS.64 at 8, 2 LDSM.16.M88.4 at 16) in 256 threads,
    over a 64 x 576 fp8 tile."""
    _, _, shared = read_fixture("sm90-H128-Sq1-fp8")
    assert shared["bytes_per_iteration"] == 412 * 256
    assert shared["kv_tile_bytes"] == 64 * 576
    assert shared["shared_bytes_per_kv_byte"] == pytest.approx(412 * 256 / (64 * 576), abs=1e-3)


@pytest.mark.parametrize(
    ("op", "backend", "access"),
    [
        ("LDS.U8", "cuda", (8, 1)),
        ("STS.S8", "cuda", (8, 1)),
        ("STS.U16", "cuda", (16, 1)),
        ("LDS", "cuda", (32, 1)),
        ("LDS.64", "cuda", (64, 1)),
        ("STS.128", "cuda", (128, 1)),
        ("LDSM.16.M88.4", "cuda", (128, 1)),
        ("LDSM.16.MT88.2", "cuda", (64, 1)),
        ("STSM.16.M88", "cuda", (32, 1)),
        ("ds_read_u8", "hip", (8, 1)),
        ("ds_read_i8", "hip", (8, 1)),
        ("ds_read_u8_d16_hi", "hip", (8, 1)),
        ("ds_write_b8", "hip", (8, 1)),
        ("ds_read_u16", "hip", (16, 1)),
        ("ds_write_b16", "hip", (16, 1)),
        ("ds_read_b32", "hip", (32, 1)),
        ("ds_write2_b32", "hip", (32, 2)),
        ("ds_read2st64_b64", "hip", (64, 2)),
        ("ds_read_b96", "hip", (96, 1)),
        ("ds_read_b128", "hip", (128, 1)),
        ("ds_read_b64_tr_b16", "hip", (64, 1)),
        ("ds_load_u8", "hip", (8, 1)),
        ("ds_store_b128", "hip", (128, 1)),
    ],
)
def test_access_widths(op: str, backend: str, access: tuple[int, int]) -> None:
    assert isa.shared_access(op, backend) == access
    assert isa.shared_counts([op, "MOV", "v_add_f32"], backend) == {op: 1}


def test_other_ops_are_not_shared_accesses() -> None:
    body = ["LDG.E.128", "LDGSTS.E.BYPASS.128", "LDL", "STL.64", "STG.E", "LDSM_X"]
    assert isa.shared_counts(body, "cuda") == {}
    amd = ["ds_bpermute_b32", "ds_swizzle_b32", "ds_add_u32", "buffer_load_dwordx4", "v_mfma"]
    assert isa.shared_counts(amd, "hip") == {}
    with pytest.raises(ValueError, match="not an LDS load or store"):
        isa.shared_access("ds_bpermute_b32", "hip")
