"""Stage-1 launch configs of the Triton MLA decode, per target, as data.

A table maps (target, head-count bucket, S_q bucket, KV kind) to a ``LaunchConfig`` and says
where the entry comes from: ``measured`` names the run that chose it, ``unmeasured`` marks a
guess from hardware limits that only compiles cleanly (``tests/test_triton_decode.py``
compiles every AMD entry for gfx942/gfx950 and checks VGPR spills and LDS).

Lookup goes from the most specific key to the least: an exact (heads, S_q, kv) entry, then
the same with S_q as ``"*"``, then with heads as ``"*"`` too, then ``("*", "*", "*")``.
``benchmarks/autotune_triton.py`` writes JSON files in the format ``load_table_file`` reads;
``ROCM_MLA_TRITON_CONFIGS`` names such a file to override the built-in entries at import.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

#: Head-count buckets: a bucket is the largest H it holds.
HEAD_BUCKETS = (16, 64, 128)
#: S_q buckets: 1 (plain decode), 2 (one speculative token), 4 (longer verify windows).
Q_LEN_BUCKETS = (1, 2, 4)
#: KV kinds that change the tile's bytes, hence what fits in shared memory.
KV_KINDS = ("fp32", "16bit", "fp8")
TARGET_KEYS = ("sm90", "gfx942", "gfx950", "fallback", "interpreter")


@dataclass(frozen=True)
class LaunchConfig:
    """Block shapes and launch options of stage 1 (stage 2 has its own, see merge_states).

    ``waves_per_eu``, ``matrix_instr_nonkdim`` and ``kpack`` are AMD compiler options: they are
    passed to the launch only when the target is hip (``None`` leaves them out). ``fp8_qk``
    and ``fp8_pv`` only matter for an fp8 cache on a target with fp8 dots (see
    ``mla_decode``): Q is then quantized per row and ``Q K^T`` runs in fp8, and/or the
    softmax weights are quantized and ``P V`` runs in fp8.
    """

    block_h: int  #: query rows (S_q x heads) per program; the dots' M dimension
    block_n: int  #: keys per tile
    num_warps: int
    num_stages: int
    dv_chunks: int = 1  #: the V columns (and the accumulator) as 1 or 2 separate dots
    num_xcds: int = 1  #: > 1 remaps program ids so one request's programs share an XCD
    fp8_qk: bool = False
    fp8_pv: bool = False
    waves_per_eu: int | None = None
    matrix_instr_nonkdim: int | None = None
    kpack: int | None = None
    #: Each warp (wave) owns this many distinct rows: ``block_h = rows_per_warp * num_warps``.
    #: Then no warp repeats another's share of ``Q K^T`` (a 16-row MFMA per wave), and a
    #: problem of fewer rows shrinks ``block_h`` and ``num_warps`` together (``mla_decode``).
    rows_per_warp: int | None = None
    #: Load each tile's block ids one loop trip ahead, so the KV loads can be pipelined into
    #: ``num_stages - 1`` LDS / shared buffers (costs the registers of one more id vector).
    prefetch_ids: bool = False
    #: ``num_stages`` / ``prefetch_ids`` of a group ``mla_decode`` shrinks BLOCK_H for (fewer
    #: rows, or fewer padded ones), where they differ (None: the same). sm90: a group under
    #: 64 rows runs mma.sync, whose KV copies get a second buffer one stage later than
    #: wgmma's, and only with the ids a trip ahead.
    shrunk_num_stages: int | None = None
    shrunk_prefetch_ids: bool | None = None
    #: BLOCK_N of a shrunk group, where it differs (None: the same).
    shrunk_block_n: int | None = None
    #: Keys as the dots' M and query rows as N (S^T = K Q^T, O^T = V^T P^T), for a row
    #: group smaller than the target's smallest matrix M (sm90's fp8 wgmma: 64 per
    #: warpgroup), so that no padded row is issued. ``shrunk_keys_as_m``: for a shrunk group.
    keys_as_m: bool = False
    shrunk_keys_as_m: bool | None = None
    #: BLOCK_H never shrinks below this (sm90 fp8: only wgmma has fp8 operands, M = 64).
    min_block_h: int = 16

    def __post_init__(self) -> None:
        for name in ("block_h", "block_n", "shrunk_block_n"):
            value = getattr(self, name)
            if value is None and name == "shrunk_block_n":
                continue
            if value < 16 or value & (value - 1):
                raise ValueError(f"LaunchConfig: {name} must be a power of two >= 16, got {value}")
        if self.dv_chunks not in (1, 2):
            raise ValueError(f"LaunchConfig: dv_chunks must be 1 or 2, got {self.dv_chunks}")
        if self.shrunk_num_stages is not None and self.shrunk_num_stages < 1:
            raise ValueError(
                f"LaunchConfig: shrunk_num_stages must be >= 1, got {self.shrunk_num_stages}"
            )
        if (
            self.min_block_h < 16
            or self.min_block_h & (self.min_block_h - 1)
            or self.min_block_h > self.block_h
        ):
            raise ValueError(
                "LaunchConfig: min_block_h must be a power of two in [16, block_h], got "
                f"{self.min_block_h} (block_h={self.block_h})"
            )
        if self.num_warps < 1 or self.num_stages < 1 or self.num_xcds < 1:
            raise ValueError(f"LaunchConfig: num_warps, num_stages, num_xcds must be >= 1: {self}")
        if self.rows_per_warp is not None and (
            self.rows_per_warp < 16
            or self.rows_per_warp & (self.rows_per_warp - 1)
            or self.rows_per_warp * self.num_warps != self.block_h
        ):
            raise ValueError(
                "LaunchConfig: rows_per_warp must be a power of two >= 16 with "
                f"rows_per_warp x num_warps == block_h, got rows_per_warp={self.rows_per_warp}, "
                f"num_warps={self.num_warps}, block_h={self.block_h}"
            )

    def launch_options(self, target) -> dict:
        """Keyword options of the Triton launch for ``target`` (a ``TritonTarget`` or None)."""
        options = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if target is not None and target.backend == "hip":
            for key in ("waves_per_eu", "matrix_instr_nonkdim", "kpack"):
                value = getattr(self, key)
                if value is not None:
                    options[key] = value
        return options

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> LaunchConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"LaunchConfig: unknown fields {sorted(unknown)} in {data}")
        return cls(**data)


@dataclass(frozen=True)
class TableEntry:
    config: LaunchConfig
    source: str  #: "measured: <device, run>" or "unmeasured: <why this guess>"


Key = tuple[str, str, str]  # (heads bucket or "*", S_q bucket or "*", kv kind or "*")

_AMD_KNOBS = {"waves_per_eu": 1, "matrix_instr_nonkdim": 16}


#: gfx942's and gfx950's fp8 entry for the compute-bound shapes (gfx942 adds kpack 2; see the
#: tables for why this shape).
_AMD_FP8_ROW_OWNED = LaunchConfig(
    block_h=64,
    block_n=16,
    num_warps=4,
    num_stages=2,
    dv_chunks=2,
    num_xcds=8,
    fp8_qk=True,
    rows_per_warp=16,
    prefetch_ids=True,
    **_AMD_KNOBS,
)


def _row_owned(
    arch: str, *, bf16: LaunchConfig, fp8: LaunchConfig | None = None
) -> dict[Key, TableEntry]:
    """AMD entries for the compute-bound shapes (S_q x H >= 64 in the buckets that reach it:
    H 17-128 at any S_q, H <= 16 at S_q 3-8): 16 rows per wave, so the waves split the rows of
    ``Q K^T`` instead of each computing all of them (the 4x replication of 16-row tiles).
    ``fp8`` None: the fp8 shapes keep the arch's general fp8 entry."""
    why = (
        f"unmeasured: compiled for {arch}, each wave owns 16 rows (issued/useful QK.PV 1.0), "
        "V in two halves, block ids one trip ahead so the KV loads are pipelined, no spills"
    )
    entries = {}
    for key in (("128", "*"), ("64", "*"), ("16", "4")):
        entries[(*key, "16bit")] = TableEntry(bf16, why)
        if fp8 is not None:
            entries[(*key, "fp8")] = TableEntry(fp8, why)
    return entries


TABLES: dict[str, dict[Key, TableEntry]] = {
    # Hopper: 228 KB of shared memory per SM and wgmma wants M = 64. 8 warps split the
    # [64, 512] fp32 accumulator over two warpgroups (128 registers a thread).
    "sm90": {
        # 64 rows (wgmma): two stages, so the next tile's copies are issued while this one
        # is computed (two smem buffers, 224 KB with Q and P). 16 or 32 rows (mma.sync):
        # three, with the block ids a trip ahead (else one buffer is all the pipeliner
        # makes). fp8 has no mma.sync (Triton upcasts it to f16): its groups under 64 rows
        # keep wgmma with keys as M (S^T = K Q^T: M the 64 keys, N the 16 or 32 rows; each
        # warpgroup half of N for Q.K^T and half of Dv for P.V), so 96 rows run as three
        # 32-row groups with no padded row issued rather than two 64-row groups (1.33).
        ("*", "*", "16bit"): TableEntry(
            LaunchConfig(
                block_h=64,
                block_n=64,
                num_warps=8,
                num_stages=2,
                shrunk_num_stages=3,
                shrunk_prefetch_ids=True,
            ),
            "unmeasured: the H200 sweep's winner (issue 17: 64 x 64, 8 warps) with the "
            "stages set per group size; compiled for sm90: each warpgroup computes its own "
            "32 keys of Q.K^T, two KV smem buffers",
        ),
        ("*", "*", "fp8"): TableEntry(
            LaunchConfig(
                block_h=64,
                block_n=32,
                num_warps=8,
                num_stages=3,
                fp8_qk=True,
                shrunk_block_n=64,
                shrunk_prefetch_ids=True,
                shrunk_keys_as_m=True,
            ),
            "unmeasured: compiled for sm90 with Triton 3.8.0 and 3.9.0: fp8 Q.K^T, fp16 P.V "
            "(V converted as read: no byte-wide shared access); 64-row groups in 32-key "
            "tiles (247-255 registers, no spills; 64 keys spill 24-56 B), a group under 64 "
            "rows runs keys as M in 64-key tiles (issued/useful 1.0 at 16 and 32 rows), "
            "three KV smem buffers",
        ),
        # fp32 tiles are twice the bytes: three 64-key stages would not fit.
        ("*", "*", "fp32"): TableEntry(
            LaunchConfig(block_h=16, block_n=32, num_warps=4, num_stages=2),
            "unmeasured: the pre-tuning CUDA default (fp32 is a test dtype)",
        ),
    },
    # MI300X: 64 KB of LDS per CU, so 16-key tiles (32 for fp8); one wave per SIMD leaves
    # the registers to the accumulator; 16x16 MFMA with kpack 2; 8 XCDs. The memory-bound
    # shapes (fewer than 64 rows) keep 4 waves on one 16-row tile; the compute-bound ones
    # give each wave its own 16 rows and two LDS stages (_row_owned).
    "gfx942": {
        ("*", "*", "*"): TableEntry(
            LaunchConfig(
                block_h=16,
                block_n=16,
                num_warps=4,
                num_stages=2,
                num_xcds=8,
                kpack=2,
                prefetch_ids=True,
                **_AMD_KNOBS,
            ),
            "unmeasured: sglang/vLLM's MI3xx shape, with the next tile prefetched (block ids "
            "one trip ahead, two LDS buffers); compiles without spills",
        ),
        ("*", "*", "fp8"): TableEntry(
            LaunchConfig(
                block_h=16,
                block_n=32,
                num_warps=4,
                num_stages=2,
                num_xcds=8,
                fp8_qk=True,
                kpack=2,
                prefetch_ids=True,
                **_AMD_KNOBS,
            ),
            "unmeasured: fp8 tiles are half the bytes, so 32 keys fit the LDS twice (the next "
            "tile prefetched)",
        ),
        # fp8 rows owned per wave fit since Q arrives quantized (quantize_q) and the softmax
        # step shares the dots' block (mla_decode_kernel._attend_tile: each wave 16 rows of both
        # dots): V in two halves, no spills at any case of bench static. Two stages (the
        # next tile in registers, one LDS slot): with three, the 32-row groups of a causal
        # verify window (H12 S_q 8, H24 S_q 4) spill 57 VGPRs (gfx950: 21). P.V runs fp16 on
        # V converted as read (ds_read_b128): an fp8 P.V read V byte by byte here (gfx942
        # has no transposing LDS read), 256 ds_read_u8 a 32-key tile; now 64 ds_read_u16 of
        # the fp16 copy a 16-key tile, as a bf16 cache does. 16 keys, not the 32 of fp8's
        # K: with P.V's fp16 copy of V, 32 keys spill 1 VGPR at H24 S_q 2 (gfx942) and 15-66
        # at H96 (gfx950, Triton 3.9 / 3.8); 16 also leaves 10-130 AGPRs where 32 took
        # 70-160.
        **_row_owned(
            "gfx942",
            bf16=LaunchConfig(
                block_h=64,
                block_n=16,
                num_warps=4,
                num_stages=2,
                dv_chunks=2,
                num_xcds=8,
                kpack=2,
                rows_per_warp=16,
                prefetch_ids=True,
                **_AMD_KNOBS,
            ),
            fp8=replace(_AMD_FP8_ROW_OWNED, kpack=2),
        ),
    },
    # MI355X: 160 KB of LDS allows double buffering; 8 warps split the accumulator (32-key
    # tiles with 8 warps spill in Triton 3.9); kpack is deprecated there (forced to 1).
    "gfx950": {
        ("*", "*", "*"): TableEntry(
            LaunchConfig(
                block_h=16,
                block_n=16,
                num_warps=8,
                num_stages=2,
                num_xcds=8,
                prefetch_ids=True,
                **_AMD_KNOBS,
            ),
            "unmeasured: the next tile prefetched (block ids one trip ahead, two LDS "
            "buffers); compiles without spills",
        ),
        ("*", "*", "fp8"): TableEntry(
            LaunchConfig(
                block_h=16,
                block_n=32,
                num_warps=4,
                num_stages=2,
                num_xcds=8,
                fp8_qk=True,
                prefetch_ids=True,
                **_AMD_KNOBS,
            ),
            "unmeasured: fp8 tiles are half the bytes, so 32 keys fit twice (the next tile "
            "prefetched)",
        ),
        **_row_owned(
            "gfx950",
            bf16=LaunchConfig(
                block_h=64,
                block_n=16,
                num_warps=4,
                num_stages=3,
                dv_chunks=2,
                num_xcds=8,
                rows_per_warp=16,
                prefetch_ids=True,
                **_AMD_KNOBS,
            ),
            fp8=_AMD_FP8_ROW_OWNED,
        ),
        # fp32 tiles spill 100-130 VGPRs with 8 warps (Triton 3.9), with or without stages.
        ("*", "*", "fp32"): TableEntry(
            LaunchConfig(
                block_h=16, block_n=16, num_warps=4, num_stages=1, num_xcds=8, **_AMD_KNOBS
            ),
            "unmeasured: fp32 is a test dtype; compiles without spills",
        ),
    },
    # Any other GPU: the pre-tuning CUDA default (other hip archs take gfx942's entries).
    "fallback": {
        ("*", "*", "*"): TableEntry(
            LaunchConfig(block_h=16, block_n=32, num_warps=4, num_stages=2),
            "unmeasured: the pre-tuning CUDA default",
        ),
    },
    # The CPU interpreter pays per program and per loop trip, not per register: big tiles.
    "interpreter": {
        ("*", "*", "*"): TableEntry(
            LaunchConfig(block_h=64, block_n=64, num_warps=4, num_stages=1),
            "interpreter: fewest programs and loop trips",
        ),
    },
}


#: Entries for Triton releases before a given one, that replace the target's own entry of the
#: same key there (``lookup``): ``{target: ((first release that no longer needs them,
#: {key: entry}), ...)}``, the oldest bound first. Each source names the release it was
#: compiled with (``rocm-mla bench static --triton``).
RELEASE_TABLES: dict[str, tuple[tuple[tuple[int, int], dict[Key, TableEntry]], ...]] = {
    "sm90": (
        (
            (3, 9),
            {
                # Triton 3.8 (torch 2.14, vLLM 0.33) keeps more of a 64-row group live through
                # the walk than 3.9: at 64 x 64 tiles its builds spill 16-80 B at 255
                # registers (H128, K3 DCP-4, H96 and H24 windows; 3.9 none). 32-key tiles
                # fit; 16- and 32-row groups keep 64 keys, spill-free on 3.8.
                ("*", "*", "16bit"): TableEntry(
                    replace(
                        TABLES["sm90"][("*", "*", "16bit")].config,
                        block_n=32,
                        num_stages=3,
                        shrunk_block_n=64,
                    ),
                    "unmeasured: compiled with Triton 3.8.0 for sm90: 64-row groups in 32-key "
                    "tiles (254 registers, no spills; 64 keys spill 36-80 B), smaller groups "
                    "as on 3.9",
                ),
                # Verify windows (S_q > 1): the window's tail tiles keep more live again, and
                # 64-row groups spill 4-8 B at 255 registers in 32-key tiles (H24 S_q 2, H12
                # S_q 4, H96 and H128 windows), 12-24 B in 16-key tiles and 8-20 B in 64-key
                # ones; 32-row groups in 64-key tiles (206 registers) do not. Each KV tile is
                # then read by twice the groups, from L2 by neighbouring programs, as 96 rows
                # already run on every release.
                **{
                    (heads, q_len, "16bit"): TableEntry(
                        replace(
                            TABLES["sm90"][("*", "*", "16bit")].config,
                            block_h=32,
                            block_n=64,
                            num_stages=3,
                            prefetch_ids=True,
                        ),
                        "unmeasured: compiled with Triton 3.8.0 for sm90: verify windows in "
                        "32-row groups of 64-key tiles (206 registers, no spills; 64-row "
                        "groups spill 4-24 B in 16-, 32- or 64-key tiles)",
                    )
                    for heads in ("16", "64", "128")
                    for q_len in ("2", "4")
                },
            },
        ),
    ),
    # MI300X under Triton 3.5-3.7 (torch 2.11's ROCm wheels carry 3.6): the row-owned verify
    # windows (S_q > 1 where 16 rows a wave apply) spill 34-127 VGPRs with their KV loads
    # pipelined (two stages, bf16 and fp8 alike; 3.8 and 3.9 none). One stage spills none
    # (204-219 AGPRs); its loads are not overlapped with the walk.
    "gfx942": (
        (
            (3, 8),
            {
                (heads, q_len, kind): TableEntry(
                    replace(TABLES["gfx942"][(heads, q_bucket, kind)].config, num_stages=1),
                    "unmeasured: compiled with Triton 3.6.0 for gfx942: row-owned verify "
                    "windows in one stage (no spills; two stages spill 34-127 VGPRs there)",
                )
                for heads, q_bucket, q_lens in (
                    ("16", "4", ("4",)),
                    ("64", "*", ("2", "4")),
                    ("128", "*", ("2", "4")),
                )
                for q_len in q_lens
                for kind in ("16bit", "fp8")
            },
        ),
    ),
}


def triton_release() -> tuple[int, int]:
    """(major, minor) of the Triton this process imports."""
    import triton

    major, minor = triton.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def head_bucket(num_heads: int) -> str:
    for bucket in HEAD_BUCKETS:
        if num_heads <= bucket:
            return str(bucket)
    return str(HEAD_BUCKETS[-1])


def q_len_bucket(q_len: int) -> str:
    for bucket in Q_LEN_BUCKETS:
        if q_len <= bucket:
            return str(bucket)
    return str(Q_LEN_BUCKETS[-1])


def kv_kind(kv_dtype: torch.dtype) -> str:
    if kv_dtype.itemsize == 1:
        return "fp8"
    return "fp32" if kv_dtype.itemsize == 4 else "16bit"


def lookup(
    target_key: str,
    num_heads: int,
    q_len: int,
    kv_dtype: torch.dtype,
    release: tuple[int, int] | None = None,
) -> TableEntry:
    """The most specific entry of ``TABLES[target_key]`` for this shape and KV dtype, with the
    ``RELEASE_TABLES`` entries of Triton ``release`` (None: the one imported) over it."""
    table = TABLES[target_key]
    release = triton_release() if release is None else release
    for before, entries in reversed(RELEASE_TABLES.get(target_key, ())):
        if release < before:
            table = {**table, **entries}
    h, s, kv = head_bucket(num_heads), q_len_bucket(q_len), kv_kind(kv_dtype)
    for key in ((h, s, kv), (h, s, "*"), (h, "*", kv), (h, "*", "*"), ("*", "*", kv)):
        if key in table:
            return table[key]
    return table[("*", "*", "*")]


def load_table_file(path: str | os.PathLike) -> dict[str, dict[Key, TableEntry]]:
    """Parse an autotune JSON file: ``{"target": ..., "device": ..., "entries": [...]}``.

    Each entry is ``{"heads": "128", "q_len": "1", "kv": "16bit", "config": {...},
    "source": "..."}`` (``"*"`` allowed in the three keys). Returns ``{target: {key: entry}}``
    without touching ``TABLES``; ``install_table_file`` merges it in.
    """
    data = json.loads(Path(path).read_text())
    target = data.get("target")
    if target not in TARGET_KEYS:
        raise ValueError(f"{path}: 'target' must be one of {TARGET_KEYS}, got {target!r}")
    entries = {}
    for item in data.get("entries", []):
        key = (str(item["heads"]), str(item["q_len"]), str(item["kv"]))
        allowed = (
            [str(b) for b in HEAD_BUCKETS] + ["*"],
            [str(b) for b in Q_LEN_BUCKETS] + ["*"],
            [*KV_KINDS, "*"],
        )
        for part, ok in zip(key, allowed, strict=True):
            if part not in ok:
                raise ValueError(f"{path}: key {key}: {part!r} is not one of {ok}")
        source = item.get("source") or f"measured: {data.get('device', 'unknown device')}"
        entries[key] = TableEntry(LaunchConfig.from_dict(item["config"]), source)
    return {target: entries}


def install_table_file(path: str | os.PathLike) -> None:
    """Merge an autotune JSON file over the built-in entries of its target."""
    for target, entries in load_table_file(path).items():
        TABLES[target] = {**TABLES[target], **entries}


if os.environ.get("ROCM_MLA_TRITON_CONFIGS"):
    install_table_file(os.environ["ROCM_MLA_TRITON_CONFIGS"])
