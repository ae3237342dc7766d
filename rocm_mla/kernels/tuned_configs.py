"""Stage-1 launch configs of the Triton MLA decode, per target, as data files.

A table maps (target, head-count bucket, S_q bucket, KV kind) to a ``LaunchConfig`` and says
where the entry comes from: ``measured`` names the run that chose it, ``unmeasured`` marks a
guess from hardware limits that only compiles cleanly (``rocm-mla bench static`` compiles
every planned launch and gates it).

The tables are JSON files shipped in the package, ``configs/<key>.json``, one per registry
record that reads its own table (``rocm_mla.targets``: another AMD arch reads gfx942's);
beside each, ``configs/<key>.before-triton-<X.Y>.json`` holds entries that replace the
table's own under Triton releases before X.Y. All are read with ``read_table_file``, in the
format ``benchmarks/autotune_triton.py`` writes; ``ROCM_MLA_TRITON_CONFIGS`` names a user's
file merged over the built-in entries at import (``install_table_file`` does so for any
file). A file that does not read as a table is a ``TableFileError`` naming the file, the
entry and what was wrong.

Lookup goes from the most specific key to the least: an exact (heads, S_q, kv) entry, then
the same with S_q as ``"*"``, then with heads as ``"*"`` too, then ``("*", "*", "*")``.

An entry may refuse some of its shapes: ``refuse`` names the row groups (``BLOCK_H`` after
``mla_decode_args.group_config`` fits the config to a problem's S_q x H rows) for which no
config the table's author compiled passes every gate, with the reason. ``default_config``
then raises ``RefusedShape`` naming the shape, and the Triton backend lists it among the
reasons it cannot run the call; a config passed in, or a user's table entry for the key,
runs it anyway.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from packaging.version import InvalidVersion
from packaging.version import Version as _Release

from rocm_mla.kernels.target import triton_version
from rocm_mla.targets import TARGETS as REGISTRY
from rocm_mla.targets import tables

#: Head-count buckets: a bucket is the largest H it holds.
HEAD_BUCKETS = (16, 64, 128)
#: S_q buckets: 1 (plain decode), 2 (one speculative token), 4 (longer verify windows).
Q_LEN_BUCKETS = (1, 2, 4)
#: KV kinds that change the tile's bytes, hence what fits in shared memory.
KV_KINDS = ("fp32", "16bit", "fp8")
#: The tables: one per registry record that reads its own (``rocm_mla.targets``).
TARGET_KEYS = tables()


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
    #: ``((BLOCK_H, why), ...)``: the row groups of ``config`` this entry refuses to run.
    refuse: tuple[tuple[int, str], ...] = ()

    def refused(self, block_h: int) -> str | None:
        """Why this entry refuses to run its config in groups of ``block_h`` rows (None: it
        does not)."""
        return dict(self.refuse).get(block_h)


class RefusedShape(ValueError):
    """A shape whose table entry refuses it (``TableEntry.refuse``): the message names the
    target, the shape, the row group and the reason."""


Key = tuple[str, str, str]  # (heads bucket or "*", S_q bucket or "*", kv kind or "*")
#: Triton releases as (major, minor): a release table applies below its bound.
Release = tuple[int, int]


class TableFileError(ValueError):
    """A table file (built in, autotune's, or a user's) that does not read as one: the message
    names the file, the entry and what was wrong."""


#: The fields a table file may hold; ``entries`` is the table, the rest is provenance.
_FILE_FIELDS = {"target", "before_triton", "about", "device", "environment", "entries", "sweeps"}
_ENTRY_FIELDS = {"heads", "q_len", "kv", "config", "source", "why", "refuse"}
_KEY_VALUES = (
    ("heads", (*(str(b) for b in HEAD_BUCKETS), "*")),
    ("q_len", (*(str(b) for b in Q_LEN_BUCKETS), "*")),
    ("kv", (*KV_KINDS, "*")),
)


@dataclass(frozen=True)
class TableFile:
    """One table file as read: its target, the release it applies below (None: every
    release) and its entries."""

    target: str
    before: Release | None
    entries: dict[Key, TableEntry]


def _release(text: object, path: object) -> Release:
    """``"3.9"`` -> ``(3, 9)``, through ``packaging`` as every Triton version the package reads."""
    try:
        release = _Release(str(text)).release
    except InvalidVersion:
        release = ()
    if not isinstance(text, str) or len(release) != 2:
        raise TableFileError(
            f"{path}: 'before_triton' must be a Triton release as a string, e.g. \"3.9\", "
            f"got {text!r}"
        )
    return release[0], release[1]


def read_table_file(path: str | os.PathLike) -> TableFile:
    """Read and check a table file (the format ``benchmarks/autotune_triton.py`` writes):

    ``{"target": "gfx942", "entries": [{"heads": "128", "q_len": "1", "kv": "16bit",
    "config": {...}, "source": "..."}, ...]}``, ``"*"`` allowed in the three keys; optional
    ``"before_triton": "3.9"`` (the entries apply under older releases only), ``"device"``
    (an entry without ``"source"`` is ``"measured: <device>"``), ``"about"``, per entry
    ``"why"`` and ``"refuse": [{"block_h": 32, "why": "..."}, ...]`` (row groups of the
    entry's config it refuses, each at most its BLOCK_H, ``TableEntry.refuse``), and
    autotune's ``"environment"`` and ``"sweeps"``. Raises ``TableFileError`` naming the file
    and the entry on anything else."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise TableFileError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise TableFileError(f"{path}: must hold a JSON object, got {type(data).__name__}")
    unknown = set(data) - _FILE_FIELDS
    if unknown:
        raise TableFileError(
            f"{path}: unknown fields {sorted(unknown)}; a table file holds {sorted(_FILE_FIELDS)}"
        )
    target = data.get("target")
    if target not in TARGET_KEYS:
        borrower = REGISTRY.get(target) if isinstance(target, str) else None
        hint = f" ({target} reads {borrower.table}'s table)" if borrower else ""
        raise TableFileError(f"{path}: 'target' must be one of {TARGET_KEYS}, got {target!r}{hint}")
    before = None if data.get("before_triton") is None else _release(data["before_triton"], path)
    items = data.get("entries")
    if not isinstance(items, list):
        raise TableFileError(f"{path}: 'entries' must be a list of entries, got {items!r}")
    entries: dict[Key, TableEntry] = {}
    for index, item in enumerate(items):
        where = f"{path}: entry {index}"
        if not isinstance(item, dict) or not {"heads", "q_len", "kv", "config"} <= set(item):
            raise TableFileError(
                f"{where}: must be an object with 'heads', 'q_len', 'kv' and 'config', got {item!r}"
            )
        if set(item) - _ENTRY_FIELDS:
            raise TableFileError(
                f"{where}: unknown fields {sorted(set(item) - _ENTRY_FIELDS)}; an entry holds "
                f"{sorted(_ENTRY_FIELDS)}"
            )
        key = tuple(str(item[name]) for name, _ in _KEY_VALUES)
        for (name, allowed), part in zip(_KEY_VALUES, key, strict=True):
            if part not in allowed:
                raise TableFileError(f"{where}: {name} {part!r} is not one of {allowed}")
        if key in entries:
            raise TableFileError(f"{where}: key {key} appears twice")
        if not isinstance(item["config"], dict):
            raise TableFileError(f"{where}: 'config' must be an object, got {item['config']!r}")
        try:
            config = LaunchConfig.from_dict(item["config"])
        except (TypeError, ValueError) as exc:
            raise TableFileError(f"{where} {key}: {exc}") from None
        source = item.get("source", f"measured: {data.get('device', 'unknown device')}")
        if not isinstance(source, str) or not source.strip():
            raise TableFileError(f"{where} {key}: 'source' must be a non-empty string")
        entries[key] = TableEntry(config, source, _refuse(item.get("refuse", []), config, where))
    return TableFile(target, before, entries)


def _refuse(items: object, config: LaunchConfig, where: str) -> tuple[tuple[int, str], ...]:
    """An entry's ``refuse`` list as ``((BLOCK_H, why), ...)``, checked against its config."""
    if not isinstance(items, list):
        raise TableFileError(f"{where}: 'refuse' must be a list of objects, got {items!r}")
    refuse: dict[int, str] = {}
    for item in items:
        block_h = item.get("block_h") if isinstance(item, dict) else None
        why = item.get("why") if isinstance(item, dict) else None
        if (
            not isinstance(item, dict)
            or set(item) != {"block_h", "why"}
            or not isinstance(block_h, int)
            or isinstance(block_h, bool)
            or block_h < 16
            or block_h & (block_h - 1)
            or block_h > config.block_h
            or not isinstance(why, str)
            or not why.strip()
        ):
            raise TableFileError(
                f"{where}: each 'refuse' item must be {{\"block_h\": a power of two in "
                f'[16, {config.block_h}] (the config\'s block_h), "why": a non-empty string}}, '
                f"got {item!r}"
            )
        if block_h in refuse:
            raise TableFileError(f"{where}: 'refuse' names block_h {block_h} twice")
        refuse[block_h] = why
    return tuple(sorted(refuse.items()))


def load_table_file(path: str | os.PathLike) -> dict[str, dict[Key, TableEntry]]:
    """``{target: {key: entry}}`` of a table file (``read_table_file``), without installing
    it; ``install_table_file`` merges it in."""
    table = read_table_file(path)
    return {table.target: table.entries}


#: The built-in tables, one JSON file per table key, and beside them the release tables:
#: ``<key>.before-triton-<X.Y>.json``.
CONFIGS_DIR = Path(__file__).resolve().with_name("configs")


def _builtin() -> tuple[dict[str, dict[Key, TableEntry]], dict[str, tuple]]:
    tables: dict[str, dict[Key, TableEntry]] = {}
    releases: dict[str, list[tuple[Release, dict[Key, TableEntry]]]] = {}
    for key in TARGET_KEYS:
        path = CONFIGS_DIR / f"{key}.json"
        table = read_table_file(path)
        if table.target != key or table.before is not None:
            raise TableFileError(f"{path}: must hold {key}'s table for every release")
        tables[key] = table.entries
        for path in sorted(CONFIGS_DIR.glob(f"{key}.before-triton-*.json")):
            table = read_table_file(path)
            bound = path.name.removeprefix(f"{key}.before-triton-").removesuffix(".json")
            if table.target != key or table.before != _release(bound, path):
                raise TableFileError(
                    f'{path}: must hold {key}\'s entries with "before_triton": "{bound}"'
                )
            releases.setdefault(key, []).append((table.before, table.entries))
    return tables, {key: tuple(sorted(found)) for key, found in releases.items()}


#: ``{table key: {key: entry}}``, from ``configs/<key>.json``.
TABLES: dict[str, dict[Key, TableEntry]]
#: Entries for Triton releases before a given one, that replace the target's own entry of the
#: same key there (``lookup``): ``{target: ((first release that no longer needs them,
#: {key: entry}), ...)}``, the oldest bound first. Each source names the release it was
#: compiled with (``rocm-mla bench static --triton``).
RELEASE_TABLES: dict[str, tuple[tuple[Release, dict[Key, TableEntry]], ...]]
TABLES, RELEASE_TABLES = _builtin()


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
    release: Release | None = None,
) -> TableEntry:
    """The most specific entry of ``TABLES[target_key]`` for this shape and KV dtype, with the
    ``RELEASE_TABLES`` entries of Triton ``release`` (None: the one imported; a version that
    does not parse takes none) over it."""
    table = TABLES[target_key]
    if release is None:
        version = triton_version()
        release = None if version is None else version[:2]
    for before, entries in reversed(RELEASE_TABLES.get(target_key, ())):
        if release is not None and release < before:
            table = {**table, **entries}
    h, s, kv = head_bucket(num_heads), q_len_bucket(q_len), kv_kind(kv_dtype)
    for key in ((h, s, kv), (h, s, "*"), (h, "*", kv), (h, "*", "*"), ("*", "*", kv)):
        if key in table:
            return table[key]
    return table[("*", "*", "*")]


def install_table_file(path: str | os.PathLike) -> None:
    """Merge a table file (autotune's, a user's) over the built-in entries of its target: over
    its table, or with ``before_triton`` over (or as) its release table of that bound."""
    table = read_table_file(path)
    if table.before is None:
        TABLES[table.target] = {**TABLES[table.target], **table.entries}
        return
    releases = dict(RELEASE_TABLES.get(table.target, ()))
    releases[table.before] = {**releases.get(table.before, {}), **table.entries}
    RELEASE_TABLES[table.target] = tuple(sorted(releases.items()))


#: A user's table file, merged over the built-in tables at import (``install_table_file``).
CONFIGS_ENV = "ROCM_MLA_TRITON_CONFIGS"
if os.environ.get(CONFIGS_ENV):
    install_table_file(os.environ[CONFIGS_ENV])
