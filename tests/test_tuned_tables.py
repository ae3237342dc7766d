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
