"""The tuned tables are data files (issue 41, item 2).

- The JSON tables shipped in the package (``rocm_mla/kernels/configs/``) reproduce the configs
  the Python tables chose before them, with the same provenance, for every case of ``rocm-mla
  bench static`` on sm90, gfx942 and gfx950 under Triton 3.8 and 3.9: the entry, its source
  and the config launched (``tests/data/bench_static_configs.json``, dumped from the Python
  tables; it matches the configs of the committed bench-static results of 2026-12-05).
- Every file there reads as a table, its name agrees with its content, and the wheel ships
  them (``pyproject.toml``'s package data).
- A user's file overrides the built-in entries (``ROCM_MLA_TRITON_CONFIGS`` at import, or
  ``install_table_file``); a file that is not a table is a ``TableFileError`` naming the file,
  the entry and what was wrong.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rocm_mla.kernels import tuned_configs as tables
from rocm_mla.kernels.mla_decode_args import group_config
from rocm_mla.targets import TARGETS

ROOT = Path(__file__).resolve().parents[1]
EXPECTED = json.loads((ROOT / "tests" / "data" / "bench_static_configs.json").read_text())


def _cases() -> list:
    return [
        pytest.param(
            target,
            tuple(int(v) for v in release.split(".")),
            heads,
            q_len,
            kv,
            EXPECTED["configs"][config],
            EXPECTED["sources"][source],
            EXPECTED["configs"][launched],
            id=f"{target}-{release}-{name}",
        )
        for target, release, name, heads, q_len, kv, config, source, launched in EXPECTED["cases"]
    ]


def test_the_expected_configs_cover_every_case_target_and_release():
    from benchmarks import kernel_static as ks

    seen = {(t, r, name) for t, r, name, *_ in EXPECTED["cases"]}
    want = {
        (t, r, case.name)
        for t in ("sm90", "gfx942", "gfx950")
        for r in ("3.8", "3.9")
        for case in ks.CASES
    }
    assert len(ks.CASES) == 54 and seen == want


@pytest.mark.parametrize(
    ("target", "release", "heads", "q_len", "kv", "config", "source", "launched"), _cases()
)
def test_json_tables_reproduce_the_python_tables(
    target, release, heads, q_len, kv, config, source, launched
):
    kv_dtype = torch.bfloat16 if kv == "bf16" else TARGETS[target].fp8_dtype
    entry = tables.lookup(target, heads, q_len, kv_dtype, release)
    assert entry.config.to_dict() == config
    assert entry.source == source
    assert group_config(entry.config, heads * q_len).to_dict() == launched


def test_every_shipped_file_is_a_table_named_for_its_content():
    files = sorted(tables.CONFIGS_DIR.glob("*.json"))
    assert {p.name for p in files} >= {f"{key}.json" for key in tables.TARGET_KEYS}
    for path in files:
        table = tables.read_table_file(path)
        bound = "" if table.before is None else f".before-triton-{'.'.join(map(str, table.before))}"
        assert path.name == f"{table.target}{bound}.json"
        assert all(e.source.strip() for e in table.entries.values())
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"rocm_mla.kernels.configs",' in pyproject.split("[tool.setuptools]")[1]
    assert '\n"rocm_mla.kernels.configs" = ["*.json"]\n' in pyproject, (
        "pyproject.toml must ship rocm_mla/kernels/configs/*.json in the wheel"
    )


def _write(path: Path, payload) -> Path:
    path.write_text(json.dumps(payload))
    return path


def test_a_user_file_overrides_the_built_in_entries_at_import(tmp_path):
    config = {"block_h": 32, "block_n": 32, "num_warps": 4, "num_stages": 1}
    path = _write(
        tmp_path / "mine.json",
        {
            "target": "gfx950",
            "device": "AMD Instinct MI355X",
            "entries": [{"heads": "128", "q_len": "1", "kv": "16bit", "config": config}],
        },
    )
    code = (
        "import torch\n"
        "from rocm_mla.kernels import tuned_configs as t\n"
        "e = t.lookup('gfx950', 128, 1, torch.bfloat16)\n"
        "o = t.lookup('gfx950', 128, 2, torch.bfloat16)\n"
        "print(e.config.block_h, e.source, '|', o.config.block_h)\n"
    )
    env = dict(os.environ, ROCM_MLA_TRITON_CONFIGS=str(path), PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "32 measured: AMD Instinct MI355X | 64"


def test_a_release_file_installs_under_its_release(tmp_path):
    config = {"block_h": 16, "block_n": 16, "num_warps": 4, "num_stages": 1}
    path = _write(
        tmp_path / "old.json",
        {
            "target": "gfx950",
            "before_triton": "3.7",
            "entries": [
                {"heads": "*", "q_len": "*", "kv": "*", "config": config, "source": "mine"}
            ],
        },
    )
    saved = dict(tables.RELEASE_TABLES)
    try:
        tables.install_table_file(path)
        assert tables.lookup("gfx950", 16, 1, torch.bfloat16, (3, 6)).source == "mine"
        assert tables.lookup("gfx950", 16, 1, torch.bfloat16, (3, 7)).source != "mine"
    finally:
        tables.RELEASE_TABLES.clear()
        tables.RELEASE_TABLES.update(saved)


CONFIG = {"block_h": 16, "block_n": 16, "num_warps": 4, "num_stages": 1}
ENTRY = {"heads": "*", "q_len": "*", "kv": "*", "config": CONFIG}


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ([], "must hold a JSON object"),
        ({"target": "gfx950", "entries": [], "colour": 1}, r"unknown fields \['colour'\]"),
        ({"target": "hip", "entries": []}, "hip reads gfx942's table"),
        ({"target": "gfx950", "entries": {}}, "'entries' must be a list"),
        ({"target": "gfx950", "before_triton": 3.9, "entries": []}, "before_triton"),
        ({"target": "gfx950", "before_triton": "soon", "entries": []}, "before_triton"),
        ({"target": "gfx950", "entries": [{"heads": "*"}]}, r"entry 0: must be an object"),
        ({"target": "gfx950", "entries": [{**ENTRY, "heads": "100"}]}, "heads '100'"),
        ({"target": "gfx950", "entries": [{**ENTRY, "tile": 1}]}, r"entry 0: unknown fields"),
        ({"target": "gfx950", "entries": [ENTRY, ENTRY]}, "entry 1: key .* appears twice"),
        (
            {"target": "gfx950", "entries": [{**ENTRY, "config": {"block_h": 16}}]},
            "entry 0 .*num_warps",
        ),
        (
            {"target": "gfx950", "entries": [{**ENTRY, "config": {**CONFIG, "block_h": 48}}]},
            "entry 0 .*block_h",
        ),
        ({"target": "gfx950", "entries": [{**ENTRY, "config": [16]}]}, "'config' must be"),
        ({"target": "gfx950", "entries": [{**ENTRY, "source": ""}]}, "'source' must be"),
    ],
)
def test_a_bad_file_is_a_named_error(tmp_path, payload, message):
    path = _write(tmp_path / "bad.json", payload)
    with pytest.raises(tables.TableFileError, match=message) as caught:
        tables.install_table_file(path)
    assert str(path) in str(caught.value)


def test_a_file_that_is_not_json_is_a_named_error(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{target: gfx950")
    with pytest.raises(tables.TableFileError, match="not a readable JSON file"):
        tables.read_table_file(path)
    with pytest.raises(tables.TableFileError, match="not a readable JSON file"):
        tables.read_table_file(tmp_path / "missing.json")


# ---- an entry's refusals (issue 41, item 6: a shape refused by name, with the reason) -----

WIDE = {"block_h": 64, "block_n": 32, "num_warps": 4, "num_stages": 2, "rows_per_warp": 16}
REFUSING = {**ENTRY, "config": WIDE, "refuse": [{"block_h": 32, "why": "spills 41 VGPRs"}]}


@pytest.mark.parametrize(
    ("refuse", "message"),
    [
        ({"block_h": 32, "why": "x"}, "'refuse' must be a list"),
        ([{"block_h": 48, "why": "x"}], "power of two in \\[16, 64\\]"),
        ([{"block_h": 128, "why": "x"}], "power of two in \\[16, 64\\]"),
        ([{"block_h": True, "why": "x"}], "each 'refuse' item"),
        ([{"block_h": 32}], "each 'refuse' item"),
        ([{"block_h": 32, "why": " "}], "each 'refuse' item"),
        ([{"block_h": 32, "why": "x", "rows": 96}], "each 'refuse' item"),
        ([{"block_h": 32, "why": "x"}, {"block_h": 32, "why": "y"}], "block_h 32 twice"),
    ],
)
def test_a_bad_refusal_is_a_named_error(tmp_path, refuse, message):
    path = _write(
        tmp_path / "bad.json", {"target": "gfx950", "entries": [{**REFUSING, "refuse": refuse}]}
    )
    with pytest.raises(tables.TableFileError, match=f"entry 0: .*{message}") as caught:
        tables.read_table_file(path)
    assert str(path) in str(caught.value)


@pytest.fixture
def refusing_gfx950(tmp_path):
    """gfx950's table with one entry, for every shape, refusing its 32-row groups."""
    path = _write(tmp_path / "refusing.json", {"target": "gfx950", "entries": [REFUSING]})
    saved = dict(tables.TABLES["gfx950"])
    tables.TABLES["gfx950"] = tables.read_table_file(path).entries
    try:
        yield
    finally:
        tables.TABLES["gfx950"] = saved


def test_a_refused_row_group_is_refused_by_name_and_no_other(refusing_gfx950):
    from rocm_mla.kernels.mla_decode_args import default_config, refusal_reason
    from rocm_mla.kernels.target import TritonTarget

    gfx950 = TritonTarget("hip", "gfx950", 256)
    fp8 = torch.float8_e4m3fn
    # 96 rows run as three 32-row groups of 2 waves: refused, the shape and the reason named.
    with pytest.raises(tables.RefusedShape) as caught:
        default_config(gfx950, num_heads=24, q_len=4, kv_dtype=fp8)
    message = str(caught.value)
    for part in ("S_q 4 x 24 heads = 96 rows", "gfx950", "32-row groups", "spills 41 VGPRs"):
        assert part in message
    assert tables.CONFIGS_ENV in message
    # 64 and 128 rows run in 64-row groups, 48 rows in one padded 64-row group: not refused.
    for heads, q_len in ((16, 4), (32, 4), (12, 4)):
        assert refusal_reason(gfx950, num_heads=heads, q_len=q_len, kv_dtype=fp8) is None
        assert default_config(gfx950, num_heads=heads, q_len=q_len, kv_dtype=fp8).block_h == 64


def test_the_triton_backend_lists_a_refused_shape_among_its_reasons(refusing_gfx950, monkeypatch):
    from rocm_mla.backends import triton as backend
    from rocm_mla.inputs import DecodeSpec
    from rocm_mla.kernels.target import TritonTarget

    monkeypatch.setattr(backend, "_target", lambda: TritonTarget("hip", "gfx950", 256))

    def spec(heads: int) -> DecodeSpec:
        return DecodeSpec(
            device=torch.device("cpu"),
            q_dtype=torch.bfloat16,
            kv_dtype=torch.bfloat16,
            num_heads=heads,
            q_len=4,
            head_dim=576,
            head_dim_v=512,
        )

    refused = backend.TritonMLAImpl.unsupported_reasons(spec(24))
    kept = backend.TritonMLAImpl.unsupported_reasons(spec(16))
    assert [r for r in refused if r not in kept] == [
        r for r in refused if "96 rows" in r and "spills 41 VGPRs" in r
    ]
    assert len(refused) == len(kept) + 1


def test_gfx1250_refuses_exactly_the_cases_its_bench_static_result_refuses():
    # The committed bench static run of the target the table refuses shapes on: every case it
    # does not refuse passes every gate there, and each refused one is refused by the table.
    from rocm_mla.kernels.mla_decode_args import refusal_reason
    from rocm_mla.kernels.target import TritonTarget

    key = "gfx1250"
    runs = sorted(
        (ROOT / "benchmarks" / "results").glob(f"kernel-static-{key}-triton-3.9.0-*.json")
    )
    payload = json.loads(runs[-1].read_text())
    target = TritonTarget("hip", key, 256)
    assert len(payload["results"]) == 54
    for result in payload["results"]:
        case = result["case"]
        kv_dtype = torch.bfloat16 if case["kv"] == "bf16" else TARGETS[key].fp8_dtype
        reason = refusal_reason(
            target, num_heads=case["heads"], q_len=case["q_len"], kv_dtype=kv_dtype
        )
        compiles = result["gates"]["compiles"]
        if reason is None:
            assert all(v["pass"] is not False for v in result["gates"].values()), case["name"]
            assert compiles["pass"] is True, case["name"]
        else:
            assert compiles["applies"] is False, case["name"]
            assert reason.split(" (")[0] in compiles["evidence"]["planning"], case["name"]
